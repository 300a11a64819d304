"""The auto weight path on CPU (worker/autotune.py): the plan follows the measured timings, is cached per CPU and
model, and the default engine runs it with output close to the float32 reference."""

import json

import pytest
import torch

from pagedllm.worker.autotune import WeightPlan, choose_plan, fit_to_steps, plan_from_timings
from helpers import model_of


def _t(block, f32, bf16=None):
    sizes = (1, 4, 16, 64, 256)
    d = {"block": dict(zip(sizes, block)), "dense-float32": dict(zip(sizes, f32))}
    if bf16 is not None:
        d["dense-bfloat16"] = dict(zip(sizes, bf16))
    return d


def test_plan_from_timings():
    # AVX2-like: no fast bf16; the blocks win up to 16 rows, float32 from 64 (layers); the head never switches
    p = plan_from_timings({"layers": _t([1, 3, 10, 50, 200], [5, 6, 12, 40, 150]),
                           "head": _t([1, 2, 5, 20, 80], [9, 10, 15, 40, 120])}, "measured")
    assert p == WeightPlan(True, 64, 0, "float32", "measured", p.timings_ms)
    # AMX-like: bf16 copies win from 4 rows (the head's by 7% there, under DENSE_MARGIN: from 16)
    p = plan_from_timings({"layers": _t([4, 10, 36, 145, 646], [12, 27, 40, 147, 449], [7, 8, 15, 42, 225]),
                           "head": _t([1.2, 2.9, 12, 49, 198], [12, 22, 27, 54, 144], [2, 2.7, 4, 11, 45])}, "cached")
    assert (p.block_kernel, p.layer_dense_min_tokens, p.head_dense_min_tokens, p.dense_dtype) == (True, 4, 16, "bfloat16")
    assert "bfloat16 copy from 4 rows" in p.describe()
    # a dense path that wins at one row: no packed weights at all
    p = plan_from_timings({"layers": _t([9, 9, 9, 9, 9], [5, 5, 5, 5, 5]), "head": _t([1] * 5, [2] * 5)}, "measured")
    assert not p.block_kernel and p.dense_dtype == "float32"
    # a tie at one row (a tiny model: 0.0598 vs 0.0582 ms measured) keeps the packed weights alone there
    p = plan_from_timings({"layers": _t([0.0598, 0.114, 0.218, 0.646, 2.31], [0.0582, 0.0734, 0.303, 0.569, 1.91]),
                           "head": _t([1] * 5, [2] * 5)}, "measured")
    assert p.block_kernel and p.layer_dense_min_tokens == 4


def test_copies_no_step_reaches_are_dropped():
    plan = WeightPlan(True, 64, 256, "float32", "measured", {})
    kept, notes = fit_to_steps(plan, max_step_tokens=2048, max_head_rows=256)
    assert kept == plan and notes == []
    fit, notes = fit_to_steps(plan, max_step_tokens=2048, max_head_rows=64)  # 64 sequences: the head sees <= 64 rows
    assert (fit.layer_dense_min_tokens, fit.head_dense_min_tokens) == (64, 0) and "no LM head copy" in notes[0]
    fit, notes = fit_to_steps(plan, max_step_tokens=32, max_head_rows=8)
    assert (fit.layer_dense_min_tokens, fit.head_dense_min_tokens, len(notes)) == (0, 0, 2)
    assert fit.describe() == "layers: packed blocks at every size; LM head: packed blocks at every size"
    # the memory budget: the layers' copy first, the head's in what is left
    mib = 2**20
    fit, notes = fit_to_steps(plan, 2048, 256, (400 * mib, 200 * mib), 600 * mib)
    assert (fit.layer_dense_min_tokens, fit.head_dense_min_tokens, notes) == (64, 256, [])
    fit, notes = fit_to_steps(plan, 2048, 256, (400 * mib, 200 * mib), 500 * mib)
    assert (fit.layer_dense_min_tokens, fit.head_dense_min_tokens) == (64, 0) and "100 MiB left" in notes[0]
    fit, notes = fit_to_steps(plan, 2048, 256, (1400 * mib, 200 * mib), 500 * mib)  # a big model: the head fits
    assert (fit.layer_dense_min_tokens, fit.head_dense_min_tokens) == (0, 256) and "1400 MiB" in notes[0]
    fit, notes = fit_to_steps(plan, 2048, 256, (400 * mib, 200 * mib), 0)
    assert (fit.layer_dense_min_tokens, fit.head_dense_min_tokens, len(notes)) == (0, 0, 2)


def test_engine_keeps_only_the_copies_its_steps_reach(monkeypatch):
    """A plan with float32 copies from 16 rows (layers) and 8 rows (head): an engine of at most 4 sequences keeps
    the layers' copy only; its weights are smaller by the head's float32 copy, and its greedy tokens equal an
    engine's that keeps both (no step of 4 sequences reaches the head's copy). A budget of 0 keeps neither."""
    from conftest import PROMPTS
    from pagedllm import LLM, SamplingParams
    from pagedllm.worker import plan as runtime_plan

    monkeypatch.setattr(runtime_plan, "choose_plan", lambda *a, **k: WeightPlan(True, 16, 8, "float32", "measured", {}))
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    both = LLM(enable_prefix_caching=False, max_num_seqs=8, dense_copy_budget_mib=1024)
    four = LLM(enable_prefix_caching=False, max_num_seqs=4, dense_copy_budget_mib=1024)
    none = LLM(enable_prefix_caching=False, max_num_seqs=8, dense_copy_budget_mib=0)  # weights at file size
    assert none.engine.runtime["weight_plan"]["description"] == (
        "layers: packed blocks at every size; LM head: packed blocks at every size")
    assert both.engine.runtime["weight_plan"]["head_dense_min_tokens"] == 8
    assert four.engine.runtime["weight_plan"]["head_dense_min_tokens"] == 0
    assert four.engine.runtime["weight_plan"]["layer_dense_min_tokens"] == 16
    cfg = model_of(four).cfg
    head_f32 = cfg.vocab_size * cfg.hidden_size * 4
    assert model_of(both).weight_bytes() - model_of(four).weight_bytes() == head_f32
    from pagedllm.config import default_model_path
    from pagedllm.model.loader import load_model_files
    from pagedllm.worker.autotune import dense_copy_bytes

    layers_f32, _ = dense_copy_bytes(load_model_files(default_model_path(), native=True, lazy=True)[1], cfg.num_layers)
    assert model_of(four).weight_bytes() - model_of(none).weight_bytes() == layers_f32
    ref = [o.outputs[0].token_ids for o in four.generate(PROMPTS[:4], sp, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in both.generate(PROMPTS[:4], sp, use_tqdm=False)] == ref


@pytest.fixture(scope="module")
def native_weights():
    from pagedllm.config import default_model_path
    from pagedllm.model.loader import load_model_files

    return load_model_files(default_model_path(), native=True)


def test_choose_plan_measures_once_then_reads_the_cache(native_weights, tmp_path, monkeypatch):
    from pagedllm.kernels import cpu_ops
    from pagedllm.worker import autotune

    arch, weights = native_weights
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    calls = []
    real = autotune.measure
    monkeypatch.setattr(autotune, "measure", lambda *a, **k: calls.append(1) or real(*a, batch_sizes=(1, 16), **k))
    first = choose_plan(weights, arch.num_layers, cpu_ops(), measure_here=True)  # as `pagedllm autotune` asks
    second = choose_plan(weights, arch.num_layers, cpu_ops())
    assert (first.source, second.source, len(calls)) == ("measured", "cached", 1)
    assert (tmp_path / "autotune.json").exists()
    assert second == WeightPlan(first.block_kernel, first.layer_dense_min_tokens, first.head_dense_min_tokens,
                                first.dense_dtype, "cached", second.timings_ms)
    for group in ("layers", "head"):
        assert set(second.timings_ms[group]["block"]) == {1, 16}
        assert all(t > 0 for per in second.timings_ms[group].values() for t in per.values())
    # an entry an older version flagged for its dense curves alone: the flag comes from the block curves now
    path = tmp_path / "autotune.json"
    cached = json.loads(path.read_text())
    (key,) = cached
    cached[key]["consistent"] = False
    path.write_text(json.dumps(cached))
    assert choose_plan(weights, arch.num_layers, cpu_ops()).source == "cached"  # 2 points (1, 16): consistent
    # the same CPU and model with the kernels' other mode (AMX off, or refused): its own measurement

    def other_isa(name: str):
        class OtherIsa:
            def __getattr__(self, attr):
                return getattr(cpu_ops(), attr)

            def isa(self):
                return name

        return OtherIsa()

    assert choose_plan(weights, arch.num_layers, other_isa("avx2+other")).source == "measured" and len(calls) == 2
    # nothing cached and int8 dot products: the arithmetic's plan (blocks at every size), nothing measured
    plan = choose_plan(weights, arch.num_layers, other_isa("avx512+vnni+other"))
    assert plan == autotune.arithmetic_plan(plan.source.removeprefix("arithmetic (").removesuffix(")"))
    assert plan.source.startswith("arithmetic") and plan.block_kernel and not plan.layer_dense_min_tokens
    assert not plan.head_dense_min_tokens and len(calls) == 2
    assert choose_plan(weights, arch.num_layers, other_isa("avx2+amx+x")).source.startswith("arithmetic")


def _agreement(got, ref, logprob_tol: float, tie: float) -> int:
    """Tokens that agree before each output's first divergence, with logprobs within ``logprob_tol`` there; a
    divergence must be a near-tie (within ``tie``) in the float32 reference."""
    agree = 0
    for a, b in zip(got, ref):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(tb))
        agree += n
        for la, lb in zip(a.outputs[0].logprobs[:n], b.outputs[0].logprobs[:n]):
            assert abs(la.logprob - lb.logprob) < logprob_tol, (a.prompt, la, lb)
        if n < len(tb):
            alts = {t.token_id: t.logprob for t in b.outputs[0].logprobs[n].top}
            assert ta[n] in alts and alts[tb[n]] - alts[ta[n]] < tie, (a.prompt, n, alts, ta[n])
    return agree


def test_default_engine_runs_the_plan_close_to_float32(llm_nocache):
    """LLM() on CPU: the measured plan and a bfloat16 KV cache, named in its runtime description. Its greedy
    tokens follow the float32 reference on the same weights: with a float32 KV cache and the block kernels at every
    step size only the ~15-bit rounding of activations differs (logprobs within 0.01); the default bfloat16 cache
    adds a 9-bit rounding of cached K/V (within 0.05), and where AMX-BF16 tiles run the prompt steps, their bfloat16
    activations a 9-bit rounding more (within 0.15; ``pagedllm eval`` gates the quality of both,
    docs/benchmarks.md)."""
    from conftest import PROMPTS
    from pagedllm import LLM, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=16, logprobs=3)
    ref = llm_nocache.generate(PROMPTS, sp, use_tqdm=False)
    auto = LLM(enable_prefix_caching=False)
    rt = auto.engine.runtime
    assert rt["device"] == "cpu" and "fused CPU kernels" in rt["kernels"]
    plan = rt["weight_plan"]
    assert plan["block_kernel"] and rt["weights"] == "gguf blocks (auto)" and rt["kv_cache_dtype"] == "bfloat16"
    assert auto.engine.core.runner.sampler.ops is not None  # greedy tokens through the argmax kernel
    lins = model_of(auto).linears()
    assert {lin.kind for lin in lins.values()} == {"q4-block", "q8-block"}
    # the file's float16 block scales and offsets as they are; Q8_0's all-zero offsets not stored
    assert all(lin.scales.dtype == torch.float16 and (lin.offsets.numel() > 0) == (lin.kind == "q4-block")
               for lin in lins.values())
    got = auto.generate(PROMPTS, sp, use_tqdm=False)
    del auto
    tol = (0.15, 0.3) if "bf16_tile_min_rows" in rt else (0.05, 0.1)
    assert _agreement(got, ref, *tol) >= len(PROMPTS) * 16 * 3 // 4  # most tokens agree before any tie
    f32kv = LLM(enable_prefix_caching=False, kv_cache_dtype="float32", large_step_weights="blocks")
    assert f32kv.engine.runtime["kv_cache_dtype"] == "float32"
    got32 = f32kv.generate(PROMPTS, sp, use_tqdm=False)
    assert _agreement(got32, ref, 0.01, 0.02) >= len(PROMPTS) * 16 * 3 // 4


def test_inconsistent_flags_what_a_busy_machine_measured():
    """The plan a busy machine cached (issue 32): the block kernel at 4 rows 76x its 1-row time and 13x its
    16-row time; clean curves (memory-bound, then linear) pass."""
    from pagedllm.worker.autotune import inconsistent

    assert inconsistent({1: 3.2, 4: 244.9, 16: 18.2, 64: 60.0, 256: 230.0}) == {1, 4, 16}
    assert inconsistent({1: 3.2, 4: 3.9, 16: 8.8, 64: 30.3, 256: 165.0}) == set()
    assert inconsistent({1: 140.6, 4: 449.9, 16: 609.9, 64: 1137.0, 256: 2848.0}) == set()


def _fake_timer(spikes: dict):
    """Timings of a clean machine (block 3 + 0.5 m ms, dense 20 + 0.1 m: dense wins from 64 rows), except that
    the first ``spikes[(kind, m)]`` calls at those points take 80x as long."""
    from pagedllm.quant.linear import BlockQuantLinear

    left = dict(spikes)

    def timer(lin, x):
        kind, m = ("block" if isinstance(lin, BlockQuantLinear) else "dense"), x.shape[0]
        t = 3 + 0.5 * m if kind == "block" else 20 + 0.1 * m
        if left.get((kind, m), 0) > 0:
            left[(kind, m)] -= 1
            return 80 * t
        return t
    return timer


def test_a_noisy_timer_does_not_spoil_the_plan(native_weights):
    """One spike (the block kernel at 4 rows, twice) is re-measured away: the same plan as a clean machine's.
    A machine busy through every re-measurement gives the arithmetic's plan (packed blocks, no dense copy), not
    a measured one with a dense copy from 4 rows."""
    from pagedllm.kernels import cpu_ops
    from pagedllm.worker.autotune import measure

    arch, weights = native_weights
    ops = cpu_ops()
    clean = plan_from_timings(measure(weights, arch.num_layers, ops, timer=_fake_timer({})), "measured")
    assert (clean.block_kernel, clean.layer_dense_min_tokens, clean.head_dense_min_tokens) == (True, 64, 64)
    noisy = measure(weights, arch.num_layers, ops, timer=_fake_timer({("block", 4): 2}))
    assert noisy["consistent"] and noisy["layers"]["block"] == clean.timings_ms["layers"]["block"]
    assert plan_from_timings(noisy, "measured").layer_dense_min_tokens == 64
    # a dense spike (or a float32 GEMM's rightly super-linear time) is kept as measured, not re-measured: it can
    # only keep the packed blocks
    dense_spike = measure(weights, arch.num_layers, ops, timer=_fake_timer({("dense", 256): 100}))
    spiked, clean_256 = dense_spike["layers"]["dense-float32"][256], clean.timings_ms["layers"]["dense-float32"][256]
    assert dense_spike["consistent"] and spiked == pytest.approx(80 * clean_256)
    assert plan_from_timings(dense_spike, "measured").layer_dense_min_tokens == 64
    busy = measure(weights, arch.num_layers, ops, timer=_fake_timer({("block", 4): 100}))
    plan = plan_from_timings(busy, "measured")
    assert not busy["consistent"] and plan.source.startswith("arithmetic")
    assert (plan.block_kernel, plan.layer_dense_min_tokens, plan.head_dense_min_tokens) == (True, 0, 0)


def test_autotune_command_shows_and_remeasures(tmp_path):
    import subprocess
    import sys

    env = {**__import__("os").environ, "PAGEDLLM_CACHE_DIR": str(tmp_path)}
    run = lambda *a: subprocess.run([sys.executable, "-m", "pagedllm.cli.main", "autotune", *a], env=env,
                                    capture_output=True, text=True, timeout=600)
    first = run()
    assert first.returncode == 0, first.stderr[-2000:]
    assert "plan    (measured" in first.stdout or "plan    (arithmetic" in first.stdout, first.stdout
    second = run("--json")
    assert second.returncode == 0 and '"source": "cached"' in second.stdout, second.stdout
    third = run("--remeasure")
    assert third.returncode == 0 and "(cached)" not in third.stdout and "block" in third.stdout, third.stdout
