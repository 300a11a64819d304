"""Engine options are written once, as config dataclass fields: the CLI flags and the keyword arguments of
``LLM(...)`` / ``build_config`` are generated from them (no model, no torch)."""

import argparse
import dataclasses
import json

import pytest

from pagedllm.config import (
    DTYPE_CHOICES,
    QUANTIZATION_CHOICES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    engine_options,
)
from pagedllm.engine.arg_utils import add_engine_args, config_from_args

# the engine's flags (vLLM's names): a contract with scripts and deployments
FLAGS = {
    "--model", "--dtype", "--device", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--block-size",
    "--kv-cache-memory", "--gpu-memory-utilization", "--enable-prefix-caching", "--enable-chunked-prefill",
    "--quantization", "--quant-dense-min-tokens", "--dense-copy-budget-mib", "--activation-bits",
    "--large-step-weights", "--tensor-parallel-size",
    "--distributed-init-method",
    "--tp-threads-per-rank", "--distributed-timeout-s", "--seed", "--scheduling-policy", "--preemption-mode",
    "--swap-space", "--kv-cache-dtype", "--target-ttft-ms", "--target-tpot-ms", "--max-waiting-requests",
    "--max-queue-delay-ms", "--pooling",
    "--speculative-config", "--speculative-disable-by-batch-size",
}


def parse(argv):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p, p.parse_args(argv)


def test_flags_are_the_engine_flags():
    p, _ = parse([])
    flags = {s for a in p._actions for s in a.option_strings} - {"-h", "--help"}
    assert flags == FLAGS | {"--no-enable-prefix-caching", "--no-enable-chunked-prefill"}
    actions = {a.dest: a for a in p._actions}
    assert tuple(actions["dtype"].choices) == DTYPE_CHOICES
    assert tuple(actions["quantization"].choices) == QUANTIZATION_CHOICES
    assert tuple(actions["scheduling_policy"].choices) == ("fcfs", "priority")
    assert tuple(actions["preemption_mode"].choices) == ("recompute", "swap")
    assert tuple(actions["kv_cache_dtype"].choices) == ("auto", "float32", "bfloat16")
    assert all(a.help for a in p._actions)


def test_no_flags_and_no_options_give_the_dataclass_defaults():
    _, args = parse([])
    assert config_from_args(args) == EngineConfig() == EngineConfig.from_options()
    assert args.max_num_seqs == SchedulerConfig().max_num_seqs == 64
    assert args.block_size == CacheConfig().block_size == 16
    assert args.enable_prefix_caching is True and args.distributed_timeout_s == 600.0


def test_flags_and_options_build_the_same_config():
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    _, args = parse([
        "--model", "m.gguf", "--dtype", "float32", "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
        "--scheduling-policy", "priority", "--preemption-mode", "swap", "--swap-space", "0.5",
        "--kv-cache-memory", "1000000", "--kv-cache-dtype", "bfloat16", "--max-queue-delay-ms", "250",
        "--quantization", "int8",
        "--speculative-config", json.dumps(spec), "--speculative-disable-by-batch-size", "3",
        "--tp-threads-per-rank", "2", "--distributed-timeout-s", "5", "--target-tpot-ms", "30",
    ])
    from_flags = config_from_args(args)
    from_kwargs = EngineConfig.from_options(
        model="m.gguf", dtype="float32", enable_prefix_caching=False, enable_chunked_prefill=False,
        scheduling_policy="priority", preemption_mode="swap", swap_space=0.5, kv_cache_memory=1000000,
        kv_cache_dtype="bfloat16", max_queue_delay_ms=250.0, quantization="int8", speculative_config=spec,
        speculative_disable_by_batch_size=3,
        tp_threads_per_rank=2, distributed_timeout_s=5.0, target_tpot_ms=30.0)
    assert from_flags == from_kwargs
    c = from_flags
    assert c.scheduler.policy == "priority" and not c.cache.enable_prefix_caching
    assert c.cache.kv_cache_dtype == "bfloat16"
    assert c.speculative.num_speculative_tokens == 3 and c.speculative.disable_by_batch_size == 3
    assert (c.parallel.threads_per_rank, c.parallel.timeout_s) == (2, 5.0)


def test_served_model_name_comes_from_the_server_flags():
    _, args = parse([])
    assert not hasattr(args, "served_model_name")  # the server's parser defines it
    args.served_model_name = "mine"
    assert config_from_args(args).model.served_model_name == "mine"


def test_unknown_options_are_named():
    with pytest.raises(TypeError, match="max_num_seq, prefix_caching"):
        EngineConfig.from_options(max_num_seq=4, prefix_caching=False)


def test_options_keep_validation():
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig.from_options(dtype="int3")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig.from_options(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="needs --speculative-config"):
        EngineConfig.from_options(speculative_disable_by_batch_size=4)
    with pytest.raises(SystemExit):
        parse(["--quantization", "int3"])


def test_every_config_field_is_an_option():
    """A field added to a config dataclass is an option (keyword argument, and a flag unless cli=False)."""
    names = {o.name for o in engine_options()}
    assert len(names) == len(engine_options())
    for cls in (ModelConfig, CacheConfig, SchedulerConfig):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("option"), f"{cls.__name__}.{f.name} has no option metadata"
    kwarg_only = {o.name for o in engine_options() if not o.cli}
    # enable_kv_cache_events: set by the server's --kv-events-config (vLLM's flag), which also says where to publish;
    # core_share_file: set for each replica by the server's --data-parallel-lend-cores
    assert kwarg_only == {"served_model_name", "num_gpu_blocks_override", "num_host_blocks_override",
                          "enable_kv_cache_events", "core_share_file"}


def test_torchrun_sets_the_init_method_and_world_size(monkeypatch):
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(k, v)
    _, args = parse([])
    c = config_from_args(args)
    assert c.tensor_parallel_size == 2 and c.parallel.distributed_init_method == "env://"
    _, args = parse(["--tensor-parallel-size", "4"])
    with pytest.raises(ValueError, match="differs from torchrun's WORLD_SIZE"):
        config_from_args(args)
