"""The simulator on hybrid models (recurrent-state layers beside attention): it reads the same config as the engine
and must size what the engine allocates — a sequence's state bytes, the state slots (running + prefix snapshots),
the KV blocks of the attention layers alone — and count the state layers' projections as the checkpoints hold them.
Tiny random models of Qwen 3.5 (Gated DeltaNet), LFM2 (short convolutions) and Granite 4.0-H (Mamba-2), each as an
HF directory and as llama.cpp's GGUF."""

import pytest

from helpers import save_hf_and_gguf
from pagedllm import LLM
from pagedllm.sim.cost import CostModel, Deployment, SeqWork
from pagedllm.sim.hardware import get_gpu_profile
from pagedllm.sim.model_profile import SCHEMES, load_model_profile
from pagedllm.sim.simulator import EngineSettings, simulate
from pagedllm.sim.trace import LengthDist, synthetic
from test_granite_hybrid import _hf_model as granite_model, _write_gguf as granite_gguf
from test_lfm2 import _hf_model as lfm2_model, _write_gguf as lfm2_gguf
from test_qwen3_5 import _hf_model as qwen35_model, _write_gguf as qwen35_gguf

FAMILIES = {"qwen35": (qwen35_model, qwen35_gguf), "lfm2": (lfm2_model, lfm2_gguf),
            "granite": (granite_model, granite_gguf)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_simulator_sizes_a_hybrid_as_the_engine_does(tmp_path, llm, family):
    make, write = FAMILIES[family]
    model = make(llm.engine.core.vocab_size)
    d, path = save_hf_and_gguf(tmp_path, llm, model, write, f"tiny-{family}")
    # the layers' linears as the checkpoint holds them (2-D weights under the layers: no conv kernels, no norms)
    linears = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and p.ndim == 2)
    for src in (str(d), path):
        engine = LLM(model=src, max_model_len=256, dtype="float32").engine
        runner, seqs = engine.core.runner, engine.config.scheduler.max_num_seqs
        profile = load_model_profile(src)
        assert profile.state_layers() == runner.kv.state_layers and profile.linear_params == linears, src
        # float32 activations, as the CPU engine here: the convolutions' inputs in 4 bytes too
        dep = Deployment(get_gpu_profile("a100-80gb").with_overrides(activation_bytes=4), profile, SCHEMES["bf16"],
                         kv_dtype="fp32")
        assert dep.state_bytes_per_slot == runner.kv.state_bytes_per_slot > 0
        assert dep.kv_bytes_per_block(16) == runner.kv.bytes_per_block
        plan = dep.memory_plan(16, seqs, prefix_caching=True)
        assert (plan.state_slots, plan.state_live_slots) == (runner.num_state_slots, runner.state_live_slots)
        assert plan.state_bytes_per_device == runner.kv.state_bytes  # the pools the engine allocated
        off = dep.memory_plan(16, seqs, prefix_caching=False)
        assert off.state_slots == off.state_live_slots == seqs < plan.state_slots  # no snapshots to keep
        del engine, runner


def test_a_hybrids_steps_read_its_states_and_prefix_hits_restore_them(tmp_path, llm):
    """Each sequence of a step reads and writes its states once (a decode step of 32 rows: 32 x 2 x a slot's
    bytes); prefix hits go through the state snapshots as the engine's scheduler decides: a prompt saves one at its
    last block boundary, so prompts of a 64-token shared prefix and 8 tokens of their own hit it, while prompts of
    48 tokens of their own after it (snapshots at 112) do not — as on the engine."""
    profile = load_model_profile(str(save_hf_and_gguf(tmp_path, llm, qwen35_model(llm.engine.core.vocab_size),
                                                      qwen35_gguf, "tiny-qwen35")[0]))
    dep = Deployment(get_gpu_profile("a100-80gb"), profile, SCHEMES["bf16"])
    cost = CostModel(dep)
    one, many = cost.decode_step(1, 100), cost.decode_step(32, 100)
    assert many.op("state").bytes == 32 * one.op("state").bytes == 32 * 2 * dep.state_bytes_per_slot
    assert many.op("state").flops == 32 * profile.state_flops_per_token() > 0
    prefill = cost.step([SeqWork(64, 0, 1)])
    assert prefill.op("state").bytes == one.op("state").bytes  # a chunk's scan: the state in and out once
    def run(own: int, caching: bool = True):
        w = synthetic(24, LengthDist.parse(str(own)), LengthDist.parse("8"), rate=None, concurrency=4,
                      shared_prefix_len=64, seed=0, num_prefixes=2)
        return simulate(dep, w, EngineSettings(max_num_seqs=4, max_model_len=256, enable_prefix_caching=caching,
                                           num_blocks=256)).summary

    shared = run(8)
    assert shared.num_requests == 24 and shared.prefix_hit_rate > 0.5 and shared.state_pool_bytes > 0
    cold = run(8, caching=False)
    assert cold.prefix_hit_rate == 0 and cold.prefill_tokens_computed > shared.prefill_tokens_computed
    assert run(48).prefix_hit_rate == 0


def test_simulate_command_on_a_hybrid(tmp_path, llm, capsys):
    """`pagedllm simulate --model DIR` on a hybrid, as a user sizes one: the recurrent states in the deployment
    line and the memory row; W1's prompts with --output-len."""
    import os

    from pagedllm.cli.main import main

    d = save_hf_and_gguf(tmp_path, llm, lfm2_model(llm.engine.core.vocab_size), lfm2_gguf, "tiny-lfm2")[0]
    roofline = os.path.join(os.path.dirname(__file__), "..", "data", "roofline_epyc.json")
    assert main(["simulate", "--calibrate", roofline, "--model", str(d), "--workload", "w1", "--concurrency", "4",
                 "--output-len", "16", "--max-model-len", "512"]) == 0
    text = capsys.readouterr().out
    assert "recurrent states (3 layers)" in text and "of recurrent states |" in text, text
    assert "| output tok/s |" in text
