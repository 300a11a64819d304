"""Tensor parallelism on CPU (gloo), 3 ranks on the default model (9 query heads, 3 KV heads, intermediate 1536):
greedy output equal to one rank token for token (batched, chunked prefill, prefix-cache hit, swap preemption,
n-gram speculation), per-rank weights about 1/3, the documented start-up error, a killed worker stopping the
engine within seconds, and hand-started workers (`pagedllm tp-worker`, tcp:// rendezvous) with a draft model on
rank 0. Each rank runs 1 intra-op thread."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import PROMPTS
from pagedllm import LLM, SamplingParams
from pagedllm.distributed.sharding import shard_weights
from pagedllm.model.decoder import TP_SPLIT
from pagedllm.errors import TensorParallelError
from pagedllm.model.arch import ModelArchConfig, tp_layout
from helpers import model_of

N = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
PREFIX = (
    "<|im_start|>system\nYou answer questions about a small bakery. Opening hours: 7am to 6pm, closed on Mondays. "
    "Bread is baked twice a day. Cakes must be ordered two days ahead.<|im_end|>\n<|im_start|>user\n"
)
PREFIX_PROMPTS = [PREFIX + "When do you open?<|im_end|>\n<|im_start|>assistant\n",
                  PREFIX + "Can I order a cake for tomorrow?<|im_end|>\n<|im_start|>assistant\n"]
# small step budget (chunked prefill), a tight KV pool swapped to host memory (preemption), n-gram drafts
SETTINGS = dict(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=128, num_gpu_blocks_override=10,
                preemption_mode="swap", swap_space=0.25,
                speculative_config={"method": "ngram", "num_speculative_tokens": 3})


def _cfg(**kw) -> ModelArchConfig:
    base = dict(arch="llama", vocab_size=10, hidden_size=8, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=2,
                intermediate_size=8, rms_norm_eps=1e-6, rope_theta=1e4, max_position=64, tie_word_embeddings=True,
                attention_bias=True, bos_token_id=1, eos_token_id=2)
    return ModelArchConfig(**{**base, **kw})


def _weights(cfg: ModelArchConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q, kv, i, h = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size, cfg.hidden_size
    shapes = {"embed": (cfg.vocab_size, h), "norm": (h,), "layers.0.input_norm": (h,), "layers.0.post_norm": (h,),
              "layers.0.q": (q, h), "layers.0.k": (kv, h), "layers.0.v": (kv, h), "layers.0.q_bias": (q,),
              "layers.0.k_bias": (kv,), "layers.0.v_bias": (kv,), "layers.0.o": (h, q), "layers.0.gate": (i, h),
              "layers.0.up": (i, h), "layers.0.down": (h, i), "layers.0.o_bias": (h,), "layers.0.sinks": (cfg.num_heads,)}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


# ---------------------------------------------------------------------------------------------- sharding (no ranks)
def test_shape_that_does_not_divide_names_the_model():
    smollm = _cfg(num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576, intermediate_size=1536, vocab_size=49152)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide the model \(llama: 9 query heads, "
                                         r"3 KV heads, intermediate size 1536") as e:
        tp_layout(smollm, 2)
    assert "9 query heads are not a multiple of 2" in str(e.value)
    assert "3 KV heads are neither a multiple nor a divisor of 2" in str(e.value)
    with pytest.raises(ValueError, match="intermediate size 10 is not a multiple of 4"):
        tp_layout(_cfg(intermediate_size=10), 4)
    lay = tp_layout(smollm, 3, 2)
    assert (lay.num_heads, lay.num_kv_heads, lay.kv_head_start, lay.intermediate_size) == (3, 1, 2, 512)
    assert (lay.vocab_per_rank, lay.vocab_start) == (16384, 32768)


def test_shards_reassemble_and_kv_heads_replicate():
    cfg = _cfg()  # 4 query heads, 2 KV heads, vocab 10
    full = _weights(cfg)
    for n in (2, 4):  # 4 ranks > 2 KV heads: each KV head is held by the 2 ranks whose query heads use it
        shards = [shard_weights(cfg, dict(full), r, n, TP_SPLIT) for r in range(n)]
        cat = lambda name, dim: torch.cat([s[name] for s in shards], dim=dim)  # noqa: E731
        for name in ("layers.0.q", "layers.0.q_bias", "layers.0.gate", "layers.0.up"):
            assert torch.equal(cat(name, 0), full[name]), (n, name)
        for name in ("layers.0.o", "layers.0.down"):
            assert torch.equal(cat(name, 1), full[name]), (n, name)
        # a row-parallel output's bias is added once (rank 0's; the all-reduce sums the ranks); sinks by query head
        assert torch.equal(sum(s["layers.0.o_bias"] for s in shards), full["layers.0.o_bias"])
        assert torch.equal(shards[0]["layers.0.o_bias"], full["layers.0.o_bias"])
        assert torch.equal(cat("layers.0.sinks", 0), full["layers.0.sinks"]), n
        d = cfg.head_dim
        for r, s in enumerate(shards):
            kv_head = r * cfg.num_kv_heads // n if n <= cfg.num_kv_heads else r // (n // cfg.num_kv_heads)
            heads = cfg.num_kv_heads // n if n <= cfg.num_kv_heads else 1
            for name in ("layers.0.k", "layers.0.v", "layers.0.k_bias"):
                assert torch.equal(s[name], full[name][kv_head * d : (kv_head + heads) * d]), (n, r, name)
            assert torch.equal(s["norm"], full["norm"])
        per_rank = -(-cfg.vocab_size // n)  # 10 rows: 5 + 5, or 3 + 3 + 3 + (1 and 2 zero rows)
        table = cat("embed", 0)
        assert table.shape[0] == per_rank * n
        assert torch.equal(table[: cfg.vocab_size], full["embed"]) and not table[cfg.vocab_size :].any()


def test_prequantized_weights_are_refused():
    from pagedllm.quant.formats import quantize_rtn

    cfg = _cfg()
    w = _weights(cfg)
    w["layers.0.down"] = quantize_rtn(w["layers.0.down"], 8, 8, symmetric=True)
    with pytest.raises(ValueError, match="cannot shard pre-quantized weights"):
        shard_weights(cfg, w, 0, 2, TP_SPLIT)


def test_step_inputs_pack_round_trip():
    from pagedllm.worker.step_inputs import StepInputs

    st = StepInputs(input_ids=[5, 6, 7, 8], positions=[3, 0, 1, 2], slots=[19, 32, 33, 34], decode_rows=[0],
                    decode_lens=[4], logit_rows=[0, 3], decode_tables=[[1]], prefills=[[1, 4, 3]],
                    prefill_tables=[[2]], swap_out=[[7, 0]], swap_in=[])
    assert StepInputs.unpack(st.pack()) == st
    assert StepInputs.unpack(StepInputs().pack()) == StepInputs()


# ---------------------------------------------------------------------------------------------- 3 ranks vs 1
@pytest.fixture(scope="module")
def engines():
    threads = torch.get_num_threads()
    tp = LLM(dtype="float32", tensor_parallel_size=N, tp_threads_per_rank=1, **SETTINGS)
    ref = LLM(dtype="float32", **SETTINGS)
    yield tp, ref
    tp.engine.shutdown()
    torch.set_num_threads(threads)  # rank 0 ran in this process with 1 thread


def test_three_ranks_equal_one_rank_token_for_token(engines):
    tp, ref = engines
    sched = tp.engine.core.scheduler
    chunks = []
    orig = sched.schedule

    def spy():
        so = orig()
        chunks.extend(len(s.token_ids) for s in so.scheduled if not s.sample)
        return so

    sched.schedule = spy
    try:
        got = [o.outputs[0].token_ids for o in tp.generate(PROMPTS, GREEDY, use_tqdm=False)]
        got_prefix = [tp.generate(p, GREEDY, use_tqdm=False)[0] for p in PREFIX_PROMPTS]  # the 2nd hits the cache
    finally:
        sched.schedule = orig
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, GREEDY, use_tqdm=False)]
    want_prefix = [ref.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PREFIX_PROMPTS]
    for p, g, w in zip(PROMPTS, got, want):
        assert len(g) == 16 and g == w, p
    assert [o.outputs[0].token_ids for o in got_prefix] == want_prefix
    st = tp.engine.core.stats()
    assert chunks, "no prompt was split into chunks"
    assert got_prefix[1].num_cached_tokens >= 32, "no prefix-cache hit"
    assert st.num_preemptions > 0 and st.num_swap_outs > 0, st
    assert st.spec_num_drafts > 0
    kv = tp.engine.core.kv_cache_manager
    kv.check_integrity()
    assert kv.pool.num_free_blocks == kv.num_blocks


def test_three_ranks_prompt_logprobs_and_embeddings(engines):
    """The ranks compute the prompt rows' logits together (gathered across their vocabulary slices) and rank 0
    pools the hidden states: the same figures as one rank."""
    tp, ref = engines
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    for a, b in zip(tp.generate(PROMPTS[:2], sp, use_tqdm=False), ref.generate(PROMPTS[:2], sp, use_tqdm=False)):
        assert [lp.token_id for lp in a.prompt_logprobs[1:]] == [lp.token_id for lp in b.prompt_logprobs[1:]]
        assert [lp.logprob for lp in a.prompt_logprobs[1:]] == pytest.approx(
            [lp.logprob for lp in b.prompt_logprobs[1:]], abs=1e-4)
        assert [[t.token_id for t in lp.top] for lp in a.prompt_logprobs[1:]] == [
            [t.token_id for t in lp.top] for lp in b.prompt_logprobs[1:]]
    for a, b in zip(tp.embed(PROMPTS[:2], use_tqdm=False), ref.embed(PROMPTS[:2], use_tqdm=False)):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-4)


def test_per_rank_weights_and_kv_are_a_third(engines):
    tp, ref = engines
    whole = model_of(ref).weight_bytes()
    per_rank = tp.engine.core.runner.rank_weight_bytes
    assert len(per_rank) == N
    for b in per_rank:  # embedding / LM head included; only the norms are replicated
        assert abs(b - whole / N) / (whole / N) < 0.01, (b, whole)
    runner = tp.engine.core.runner
    assert runner.model.num_kv_heads == 1 and runner.kv.kv_caches[0][0].shape[2] == 1
    assert runner.bytes_per_block * N == ref.engine.core.runner.bytes_per_block


def test_killed_worker_stops_the_engine_within_seconds(engines):
    tp, _ = engines
    runner = tp.engine.core.runner
    victim = runner.tp_workers.procs[2]
    core = tp.engine.core
    start_steps = core.num_steps
    killed_at = []

    def kill_mid_generation():
        deadline = time.monotonic() + 60
        while core.num_steps < start_steps + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(victim.pid, signal.SIGKILL)
        killed_at.append(time.monotonic())

    killer = threading.Thread(target=kill_mid_generation, daemon=True)
    killer.start()
    with pytest.raises(TensorParallelError, match=r"rank 2 .* SIGKILL"):
        tp.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=96, ignore_eos=True), use_tqdm=False)
    raised_at = time.monotonic()
    killer.join()
    assert core.num_steps >= start_steps + 3, "the engine finished before the kill"
    assert raised_at - killed_at[0] < 5.0
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 2"):  # and it stays stopped, at once
        tp.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    assert time.monotonic() - t0 < 1.0


# ---------------------------------------------------------------------------------------------- hand-started ranks
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hand_started_workers_over_tcp_with_a_draft_model_on_rank_0(engines):
    """The multi-machine commands of the README, on localhost; the draft model runs whole on rank 0 only."""
    _, ref = engines
    tp_old, _ = engines
    tp_old.engine.shutdown()  # one tensor-parallel engine per process
    url = f"tcp://127.0.0.1:{_free_port()}"
    workers = [subprocess.Popen([sys.executable, "-m", "pagedllm.cli.main", "tp-worker", "--rank", str(r),
                                 "--world-size", str(N), "--distributed-init-method", url, "--max-model-len", "128",
                                 "--tp-threads-per-rank", "1"])
               for r in range(1, N)]
    try:
        llm = LLM(dtype="float32", tensor_parallel_size=N, distributed_init_method=url, tp_threads_per_rank=1, max_model_len=128,
                  speculative_config={"method": "draft_model", "model": "default", "num_speculative_tokens": 3})
        runner = llm.engine.core.runner
        assert runner.tp_workers is None and runner.draft_model is not None and runner.draft_model.tp is None
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)]
        want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS[:4], GREEDY, use_tqdm=False)]
        assert got == want
        assert llm.engine.core.stats().spec_num_accepted_tokens > 0
        llm.engine.shutdown()
        assert [w.wait(30) for w in workers] == [0] * (N - 1)
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
