"""`pagedllm simulate`: the real scheduler driven by a roofline cost model (pure Python: no torch, no model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from pagedllm.sim.calibrate import cpu_profile_from_roofline, load_roofline
from pagedllm.sim.cli import build_parser, plan_replicas, run
from pagedllm.sim.cost import CostModel, Deployment, SeqWork
from pagedllm.sim.hardware import HardwareProfile, get_gpu_profile
from pagedllm.sim.kvcalc import kv_bytes_per_token, kv_report, naive_kv_bytes_per_token
from pagedllm.sim.ladder import LadderConfig, run_ladder
from pagedllm.sim.model_profile import PRESETS, SCHEMES, from_hf_config, get_scheme
from pagedllm.sim.naive import simulate_static, static_batch_size
from pagedllm.sim.simulator import EngineSettings, SpecDecoding, simulate
from pagedllm.sim.trace import (W1_PROMPT_TOKENS, LengthDist, Workload, closed_loop, load_trace, save_trace, synthetic)
from pagedllm.sim.validate import load_measured, validate

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
ROOFLINE = os.path.join(DATA, "roofline_epyc.json")
MEASURED = os.path.join(DATA, "serve_w1_epyc.json")
# bench roofline on one core of the Xeon (taskset -c 0) and on both (docs/simulate.md, 2026-12-07)
ROOFLINE_1CORE, ROOFLINE_2CORE = (os.path.join(DATA, f"roofline_spr_{n}core.json") for n in (1, 2))

A100 = get_gpu_profile("a100-80gb")
L70 = PRESETS["llama-3-70b"]
L8 = PRESETS["llama-3-8b"]


def dep(model=L8, hw=A100, scheme="bf16", tp=1, **kw) -> Deployment:
    return Deployment(hw, model, SCHEMES[scheme], tp, **kw)


# ------------------------------------------------------------------ KV calculator and model profiles
def test_kv_calculator_gqa_vs_common_formula():
    # Llama-3-70B: 80 layers x 8 KV heads x 128 head_dim x 2 (K and V) x 2 bytes = 327,680 B = 320 KiB per token
    assert kv_bytes_per_token(L70, "bf16") == 2 * 80 * 8 * 128 * 2 == 320 * 1024
    assert naive_kv_bytes_per_token(L70, "bf16") == 2 * 80 * 8192 * 2  # 2.5 MiB: one KV vector per query head
    rep = kv_report(L70, "bf16", seq_len=8192, batch=4)
    assert rep.overstatement == 64 / 8
    assert rep.total == 4 * 8192 * 320 * 1024 == 10 * 2**30  # 10 GiB (the common formula: 80 GiB)
    assert kv_report(PRESETS["qwen2.5-7b"]).overstatement == 7  # 28 heads / 4 KV heads
    # SmolLM2 in the CPU engine's float32 KV: 45 KiB per token (W1 at C=32: ~8.5k tokens -> ~370 MiB, as measured)
    assert kv_bytes_per_token(PRESETS["smollm2-135m"], "fp32") == 2 * 30 * 3 * 64 * 4 == 46080


@pytest.mark.parametrize("name,published", [("llama-3-8b", 8.03e9), ("llama-3-70b", 70.55e9),
                                            ("qwen2.5-7b", 7.62e9), ("qwen2.5-72b", 72.71e9),
                                            ("smollm2-135m", 134.5e6)])
def test_preset_parameter_counts(name, published):
    assert PRESETS[name].num_params == pytest.approx(published, rel=0.005)


def test_weight_bytes_per_quantization():
    bf16, awq, fp8 = (SCHEMES[k].total_bytes(L70) for k in ("bf16", "awq", "fp8"))
    assert bf16 == pytest.approx(2 * L70.num_params, rel=1e-3)
    # AWQ 4-bit g128: 0.5 B + 2.5 B of scale/zero per 128 weights in the layers; embedding and head stay bf16
    layers = L70.linear_params
    assert SCHEMES["awq"].weight_bytes(L70)["layers"] == pytest.approx(layers * (0.5 + 2.5 / 128))
    assert awq < fp8 < bf16 and awq / bf16 == pytest.approx(0.28, abs=0.01)
    # the embedded model's GGUF file: Q4_1 layers (20 B per 32 weights), Q8_0 tied embedding (34 B per 32)
    wb = SCHEMES["q4_1"].weight_bytes(PRESETS["smollm2-135m"])
    assert wb["layers"] == 66_355_200 and wb["embed"] == 30_081_024 and wb["lm_head"] == 0


def test_model_from_hf_config(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False,
           "max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = from_hf_config(str(tmp_path))
    assert (m.num_params, m.head_dim, m.num_kv_heads) == (L8.num_params, 128, 8)
    with pytest.raises(ValueError, match="gguf"):
        get_scheme("gguf", m)


def test_model_from_gguf_header():
    from pagedllm.config import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError:
        pytest.skip("the default model package is not installed")
    from pagedllm.sim.model_profile import from_gguf

    m = from_gguf(path)
    ref = PRESETS["smollm2-135m"]
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.intermediate_size, m.vocab_size,
            m.tie_word_embeddings) == (ref.num_layers, ref.hidden_size, ref.num_heads, ref.num_kv_heads,
                                       ref.intermediate_size, ref.vocab_size, True)
    s = get_scheme("gguf", m)
    assert (s.linear.name, s.embed.name) == ("q4_1", "q8_0")
    assert s.total_bytes(m) == pytest.approx(92.1 * 2**20, rel=0.01)  # the file's tensor bytes


# ------------------------------------------------------------------ cost model
def test_decode_batch1_is_memory_bound_and_large_prefill_compute_bound():
    c = CostModel(dep())
    d1 = c.decode_step(1, 1000)
    for name in ("qkv", "o", "mlp_up", "mlp_down", "lm_head", "attention"):
        assert d1.op(name).bound == "memory", name
    # batch-1 decode reads every weight once but the embedding table (one row of it): ~15 GB / (2.04 TB/s x 0.8)
    read = SCHEMES["bf16"].total_bytes(L8) - SCHEMES["bf16"].weight_bytes(L8)["embed"]
    assert d1.compute_s == pytest.approx(read / A100.attainable_bw, rel=0.02)
    pf = c.prefill_step(2, 4096)
    for name in ("qkv", "o", "mlp_up", "mlp_down", "attention"):
        assert pf.op(name).bound == "compute", name
    assert pf.op("lm_head").flops == 2 * 2 * L8.hidden_size * L8.vocab_size  # only the 2 sampled rows
    # decode throughput grows with batch while memory-bound
    assert c.decode_step(32, 1000).time_s < 3 * d1.time_s


def test_prefill_chunk_without_sampling_skips_lm_head():
    c = CostModel(dep())
    names = [o.name for o in c.step([SeqWork(512, 0, 0)]).ops]
    assert "lm_head" not in names and "mlp_up" in names


def test_tensor_parallel_all_reduce_adds_time():
    c1, c2 = CostModel(dep(L70, tp=1)), CostModel(dep(L70, tp=2))
    s1, s2 = c1.prefill_step(1, 2048), c2.prefill_step(1, 2048)
    assert s1.allreduce_s == 0 and s2.allreduce_s > 0
    # 2 all-reduces per layer of 2048 x 8192 bf16 activations over NVLink (ring, 2 GPUs)
    per = 2048 * 8192 * 2 / (A100.interconnect_bw * A100.interconnect_efficiency) + 2 * A100.interconnect_latency_s
    assert s2.allreduce_s >= 2 * 80 * per
    slow = dep(L70, hw=A100.with_overrides(interconnect_bw=1e9), tp=2)
    assert CostModel(slow).prefill_step(1, 2048).time_s > s2.time_s + 1.0
    # ring all-reduce at tp=4: 2(t-1)/t of the bytes cross each link (at tp=2 the factor is 1 and proves nothing)
    s4 = CostModel(dep(L70, tp=4)).prefill_step(1, 2048)
    per4 = (2 * 3 / 4 * 2048 * 8192 * 2 / (A100.interconnect_bw * A100.interconnect_efficiency)
            + 2 * 3 * A100.interconnect_latency_s)
    assert s4.allreduce_s == pytest.approx(2 * 80 * per4, rel=0.02)
    # the linears split: tp=2 does half the work per device
    assert s2.op("mlp_up").compute_s == pytest.approx(s1.op("mlp_up").compute_s / 2)


def test_memory_plan_and_fit():
    assert not dep(L70, tp=1).memory_plan().fits  # 141 GB of bf16 weights on one 80 GB A100
    plan = dep(L70, tp=2).memory_plan()
    assert plan.fits and plan.kv_bytes_per_token_device == 160 * 1024  # KV heads split over the 2 GPUs
    left = 81920 * 2**20 * 0.9 - SCHEMES["bf16"].total_bytes(L70) / 2 - A100.activation_reserve_bytes
    assert plan.kv_tokens == int(left // (160 * 1024)) // 16 * 16
    with pytest.raises(ValueError, match="no memory for the KV cache"):
        simulate(dep(L70, tp=1), closed_loop([100], 10, 1))
    with pytest.raises(ValueError, match="do not split"):
        dep(PRESETS["smollm2-135m"], tp=2)  # 9 heads


def test_config_validation():
    with pytest.raises(ValueError, match="compute_efficiency"):
        A100.with_overrides(compute_efficiency=1.5)
    with pytest.raises(ValueError, match="acceptance_rate"):
        SpecDecoding(4, 1.0)
    with pytest.raises(ValueError, match="low <= high"):
        LengthDist.parse("300-100")
    with pytest.raises(ValueError, match="max_model_len"):
        simulate(dep(), closed_loop([9000], 10, 1))
    assert isinstance(A100, HardwareProfile) and A100.peak_flops("fp8") == A100.bf16_flops  # no fp8 on A100


# ------------------------------------------------------------------ simulator (the real scheduler)
def _burst(n=32, prompt=200, out=64, shared=0, concurrency=None):
    return synthetic(n, LengthDist(prompt, prompt), LengthDist(out, out), concurrency=concurrency or n,
                     shared_prefix_len=shared)


def test_simulation_outputs_and_continuous_batching_beats_static():
    w = synthetic(64, LengthDist(100, 400), LengthDist(32, 256), concurrency=16, seed=1)
    d = dep()
    paged = simulate(d, w, EngineSettings(enable_prefix_caching=False))
    assert len(paged.records) == 64
    assert sorted(r.output_len for r in paged.records) == sorted(r.output_len for r in w.requests)
    assert all(r.first_token_s > r.arrival_s and r.finish_s >= r.first_token_s for r in paged.records)
    naive = simulate_static(d, w, max_len=8192, max_batch=16)
    # same batch size (16 slots): static batches idle their slots until the longest output of the batch is done
    assert paged.summary.output_tok_s > 1.3 * naive.summary.output_tok_s
    assert paged.summary.kv_pool_bytes > 0 and 0 < paged.summary.kv_usage_mean <= paged.summary.kv_usage_max <= 1


def test_static_batching_reserves_max_length_and_waits_for_the_batch():
    d = dep(L70, tp=2)
    assert static_batch_size(d, 8192) == 3  # ~8.6 GiB of KV left / 2.5 GiB per 8192-token sequence
    res = simulate_static(d, _burst(6, 100, 16, concurrency=6), max_len=8192)
    finishes = sorted({round(r.finish_s, 9) for r in res.records})
    assert len(finishes) == 2  # two batches of 3, each returned whole
    assert res.summary.extra["static_batch_size"] == 3


def test_prefix_caching_hits_come_from_the_real_kv_cache():
    w = _burst(24, 88, 16, shared=512, concurrency=8)  # 600-token prompts, 512 of them shared
    off = simulate(dep(), w, EngineSettings(enable_prefix_caching=False)).summary
    on = simulate(dep(), w, EngineSettings(enable_prefix_caching=True)).summary
    assert off.prefix_hit_rate == 0 and off.prefill_tokens_computed == 24 * 600
    # every request after the first finds the 512 shared tokens (32 full blocks of 16)
    assert on.prefill_tokens_computed <= 24 * 600 - 16 * 512
    assert on.prefix_hit_rate > 0.6
    assert on.mean_ttft_s < off.mean_ttft_s


def test_tiny_kv_cache_causes_preemptions_and_everything_still_finishes():
    w = _burst(16, 256, 256)
    roomy = simulate(dep(), w, EngineSettings()).summary
    assert roomy.preemptions == 0
    tiny = simulate(dep(), w, EngineSettings(num_blocks=120))  # 1920 tokens for 16 x 512
    assert tiny.summary.preemptions > 0
    assert len(tiny.records) == 16 and all(r.output_len == 256 for r in tiny.records)
    assert tiny.summary.kv_usage_max > 0.9
    assert tiny.summary.output_tok_s < roomy.output_tok_s


def test_speculative_decoding_through_the_scheduler():
    sp = SpecDecoding(4, 0.7)
    assert sp.expected_tokens_per_step == pytest.approx((1 - 0.7**5) / 0.3)
    w = _burst(4, 100, 400, concurrency=1)
    base = simulate(dep(), w, EngineSettings()).summary
    spec = simulate(dep(), w, EngineSettings(spec=sp), seed=3)
    # accepted drafts per verify step follow alpha + alpha^2 + ... + alpha^k = 1.77
    assert spec.summary.spec_mean_accepted == pytest.approx(sum(0.7**i for i in range(1, 5)), abs=0.15)
    assert all(r.output_len == 400 for r in spec.records)
    assert spec.summary.num_steps < base.num_steps / 2
    assert spec.summary.output_tok_s > 2 * base.output_tok_s  # batch 1 is memory-bound: verifying 5 tokens is ~free


def test_poisson_trace_and_recorded_trace_roundtrip(tmp_path):
    w = synthetic(2000, LengthDist(10, 20), LengthDist(5, 5), rate=10.0, seed=2)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(w.requests, w.requests[1:])]
    assert min(gaps) >= 0 and sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.1)
    small = Workload(w.requests[:20])
    save_trace(small, str(tmp_path / "t.json"))
    assert load_trace(str(tmp_path / "t.json")).requests == small.requests
    (tmp_path / "serve.json").write_text(json.dumps({"requests": [{"prompt_tokens": 120, "output_tokens": 128}]}))
    assert load_trace(str(tmp_path / "serve.json"), concurrency=1).requests[0].prompt_len == 120
    res = simulate(dep(), small, EngineSettings())
    assert all(r.arrival_s == q.arrival_s for r, q in zip(res.records, small.requests))


def test_ladder_rows():
    w = replace(_burst(48, 200, 96, shared=400, concurrency=16), client_jitter_s=0.002)
    rows = run_ladder(LadderConfig(A100, L70, 2, w))
    assert [r.step for r in rows] == [1, 2, 3, 4, 5]
    s = [r.summary for r in rows]
    assert all(x is not None for x in s)
    assert s[1].output_tok_s > s[0].output_tok_s  # paged + continuous batching beats static batching
    assert s[2].num_devices == 1 and s[0].num_devices == 2  # AWQ 70B fits on one A100
    assert s[3].prefix_hit_rate > 0.5 and s[3].mean_ttft_s < s[2].mean_ttft_s
    assert s[4].spec_mean_accepted is not None


# ------------------------------------------------------------------ calibration against this machine
def test_cpu_calibration_fits_the_roofline_decode_steps():
    cal = cpu_profile_from_roofline(load_roofline(ROOFLINE))
    p = cal.profile
    assert p.calibrated and 0 < p.bandwidth_efficiency <= 1
    effs = [e for _, e in p.gemm_efficiency_curve]
    assert effs == sorted(effs) and effs[-1] == 1.0
    for batch, measured, fitted in cal.fit_rows:
        assert fitted == pytest.approx(measured, rel=0.05), batch
    assert [b for b, _, _ in cal.fit_rows] == [1, 8, 32]
    assert cal.kv_dtype == "fp32"  # a file from before runtime.kv_cache_dtype: the float32 cache of then


def test_cpu_calibration_follows_the_roofline_runs_kv_dtype_and_context():
    """A roofline run on a bfloat16 KV cache (the default CPU path now) with longer prompts: the deployment holds
    that cache (twice the tokens per byte) and the fit charges decode steps at that run's context."""
    d = load_roofline(ROOFLINE)
    fp32 = cpu_profile_from_roofline(d)
    bf16 = cpu_profile_from_roofline({**d, "runtime": {**d.get("runtime", {}), "kv_cache_dtype": "bfloat16"}})
    assert bf16.kv_dtype == "bf16" and bf16.profile.default_kv_dtype == "bf16"
    assert bf16.deployment().kv_bytes_per_token_device * 2 == fp32.deployment().kv_bytes_per_token_device
    longer = cpu_profile_from_roofline({**d, "prompt_len": 200})
    # the same measured steps over longer contexts: more of each step is attention, less is left to overheads
    assert longer.fixed_overhead_s + 32 * longer.row_overhead_s < fp32.fixed_overhead_s + 32 * fp32.row_overhead_s


def test_cpu_calibration_fits_attention_from_two_contexts_and_takes_the_engines_linears():
    """Decode steps at two contexts (`bench roofline --prompt-len 64 320`, the default) let the fit measure
    attention's cost instead of assuming it: steps made by the cost model with attention at 0.1 of the fp32 peak and
    known overheads are fitted back to that efficiency. The engine's own layer linears (`layer_linears_ms`, every
    row count on the path the engine runs there) become the GEMM curve, up to prefill-sized steps."""
    from pagedllm.sim.calibrate import ROOFLINE_DECODE_STEPS_OFFSET

    d = load_roofline(ROOFLINE)
    truth = cpu_profile_from_roofline(d).profile.with_overrides(attention_efficiency=0.1, step_overhead_s=0.004,
                                                                seq_overhead_s=0.0001, token_overhead_s=0.0001)
    model = CostModel(Deployment(truth, PRESETS["smollm2-135m"], SCHEMES["q4_1"], kv_dtype="fp32",
                                 kv_cache_bytes=1 << 30))
    rows = [{"prompt_len": p, "batch": b,
             "step_ms": 1e3 * model.decode_step(b, p + ROOFLINE_DECODE_STEPS_OFFSET - 1).time_s}
            for p in (64, 320) for b in (1, 8, 32)]
    cal = cpu_profile_from_roofline({**d, "rows": rows})
    assert cal.profile.attention_efficiency == pytest.approx(0.1, rel=0.13)  # the grid's step is 12%
    assert any("attention efficiency" in n for n in cal.notes)
    for _, measured, fitted in cal.fit_rows:
        assert fitted == pytest.approx(measured, rel=0.02)
    one_context = cpu_profile_from_roofline({**d, "rows": [r for r in rows if r["prompt_len"] == 64]})
    assert one_context.profile.attention_efficiency == 0.3  # one context: the assumption stands
    # the engine's linears as measured: 8 rows at a third of the per-row rate of 2048 rows
    layers = {"1": 2.0, "8": 6.0, "32": 12.0, "128": 30.0, "512": 100.0, "2048": 400.0}
    curve = dict(cpu_profile_from_roofline({**d, "layer_linears_ms": layers}).profile.gemm_efficiency_curve)
    assert sorted(curve) == [8, 32, 128, 512, 2048] and curve[2048] == 1.0
    assert curve[8] == pytest.approx((8 / 6.0) / (2048 / 400.0))


def test_calibrated_cpu_predicts_measured_bench_serve_within_20_percent():
    measured = load_measured(MEASURED)
    assert tuple(measured["workload"]["prompt_tokens"]) == W1_PROMPT_TOKENS
    cal = cpu_profile_from_roofline(load_roofline(ROOFLINE))
    rows = validate(cal, measured)
    checked = [r for r in rows if r.metric in ("output tok/s", "mean TTFT (s)")]
    assert len(checked) == 6  # C = 1, 8, 32
    bad = [(r.concurrency, r.metric, round(100 * r.error, 1)) for r in checked if abs(r.error) > 0.20]
    assert not bad, bad


# ------------------------------------------------------------------ command line, no torch
def test_cli_ladder_kv_calc_and_result_json(tmp_path, capsys):
    from pagedllm.cli.main import main

    out_json = tmp_path / "ladder.json"
    assert main(["simulate", "--model", "llama-3-70b", "--gpu", "a100-80gb", "--tp", "2", "--ladder",
                 "--num-requests", "32", "--concurrency", "16", "--result-json", str(out_json),
                 "--chart", str(tmp_path / "ladder.png")]) == 0
    assert (tmp_path / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 5 and "naive static batching" in table[1] and "speculative" in table[5]
    assert "below 20 tok/s" in text
    assert len(json.loads(out_json.read_text())["ladder"]) == 5

    assert main(["simulate", "--model", "llama-3-70b", "--kv-calc"]) == 0
    assert "327,680 B" in capsys.readouterr().out
    assert main(["simulate", "--gpu", "no-such-gpu"]) == 2


def test_simulation_imports_no_torch():
    code = (
        "import sys\n"
        "from pagedllm.cli.main import main\n"
        "assert main(['simulate', '--model', 'qwen2.5-7b', '--gpu', 'h100-80gb', '--num-requests', '8',"
        " '--concurrency', '4', '--quantization', 'fp8']) == 0\n"
        f"assert main(['simulate', '--calibrate', {ROOFLINE!r}, '--workload', 'w1', '--concurrency', '8']) == 0\n"
        "import pagedllm.sim.ladder, pagedllm.sim.validate, pagedllm.sim.naive\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=os.path.dirname(DATA) + "/..")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "NO-TORCH"


LADDER = os.path.join(DATA, "ladder_epyc.json")


def test_calibrated_cpu_predicts_the_measured_ladder_within_20_percent(tmp_path):
    """Held out from the calibration: longer prompts, prefix caching on, n-gram speculation (the ladder's rows, tools/ladder)."""
    from pagedllm.cli.main import main

    fixture = json.load(open(LADDER))
    base = ["simulate", "--calibrate", ROOFLINE, "--gpu", "cpu-local", "--model", "smollm2-135m", "--quantization",
            "q4_1", "--concurrency", "32", "--num-requests", "32", "--output-len", "128"]
    bad = []
    for i, row in enumerate(fixture["rows"]):
        out = tmp_path / f"{i}.json"
        assert main([*base, *row["sim_args"], "--result-json", str(out)]) == 0
        s = json.loads(out.read_text())["summary"]
        for key in ("output_tok_s", "mean_ttft_s"):
            err = s[key] / row[key] - 1
            if abs(err) > 0.20:
                bad.append((row["name"], key, round(100 * err, 1)))
    assert not bad, bad


def test_chunked_prefill_off_uses_the_default_budget_of_serve():
    """As `pagedllm serve` does, no --max-num-batched-tokens with chunked prefill off is the context length: prompts
    over 2,048 tokens run whole (with a fixed 2,048 they were never admitted)."""
    res = simulate(dep(), _burst(4, 3000, 16), EngineSettings(enable_chunked_prefill=False))
    assert len(res.records) == 4 and all(r.output_len == 16 for r in res.records)


def test_simulator_reads_a_checkpoint_as_the_model_loader_does(tmp_path):
    """One parser (``model.arch``): the simulator's shapes of a config.json and of the default GGUF file are the
    loader's, defaults included (a Qwen 2 config without ``attention_bias`` or ``max_position_embeddings``)."""
    from pagedllm.model.arch import config_from_hf
    from pagedllm.model.loader import load_model_files
    from pagedllm.sim.model_profile import from_gguf

    cfg = {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
           "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    fields = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size",
              "tie_word_embeddings", "head_dim", "max_position", "attention_bias")
    m, ref = from_hf_config(str(tmp_path)), config_from_hf(cfg)
    assert [getattr(m, f) for f in fields] == [getattr(ref, f) for f in fields]
    assert m.attention_bias and m.max_position == ref.max_position
    from pagedllm.config import default_model_path

    path = default_model_path()
    g, (loaded, _) = from_gguf(path), load_model_files(path, native=True, lazy=True)
    assert [getattr(g, f) for f in fields] == [getattr(loaded, f) for f in fields]


def test_sliding_window_models_keep_the_engines_kv_layout(tmp_path):
    """A Gemma 3 config (5 of every 6 layers sliding, window 512): the simulator reads the windows as the model
    loader does, groups the layers as the engine does (``model.arch.kv_groups``), sizes blocks for a group, runs the
    real KV cache manager with those windows (a long sequence holds fewer blocks than in an all-global model, so
    more of them fit), and charges a sliding layer's attention at most its window of keys."""
    from pagedllm.model.arch import config_from_hf
    from pagedllm.sim.cost import _keys_attended
    from pagedllm.sim.kvcalc import kv_bytes_per_sequence

    cfg = {"model_type": "gemma3_text", "hidden_size": 1152, "num_hidden_layers": 26, "num_attention_heads": 4,
           "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 6912, "vocab_size": 262144,
           "sliding_window": 512, "max_position_embeddings": 32768, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = from_hf_config(str(tmp_path))
    ref = config_from_hf(cfg)
    assert m.layer_windows == tuple(ref.window(i) for i in range(26)) and m.kv_layout == ref.kv_groups()
    assert m.layer_windows.count(512) == 22 and m.kv_layout.hybrid
    # the same shapes, every layer global (what the simulator assumed before)
    glob = replace(m, arch=replace(m.arch, layer_types=(), sliding_window=None))
    assert kv_bytes_per_sequence(m, 256) == kv_bytes_per_sequence(glob, 256) == 256 * kv_bytes_per_token(m)
    assert kv_bytes_per_sequence(m, 8192) == 2 * 256 * 2 * (4 * 8192 + 22 * 512)  # bf16, 1 KV head of 256
    assert "Sliding-window layers keep at most their window" in kv_report(m, seq_len=8192).markdown()
    d, dg = dep(m, kv_cache_bytes=2**30), dep(glob, kv_cache_bytes=2**30)
    plan = d.memory_plan()
    assert d.kv_bytes_per_block() == 16 * 2 * 256 * 2 * m.kv_layout.slots
    assert plan.num_blocks == 2**30 // d.kv_bytes_per_block()
    assert abs(plan.kv_tokens - dg.memory_plan().kv_tokens) < 16  # tokens in every layer: the same pool (whole blocks)
    assert plan.sequences_that_fit(8192) > 2.5 * dg.memory_plan().sequences_that_fit(8192)
    # the real KV cache manager with the model's windows: in a pool that holds 3 long sequences all-global, all 8
    # run at once (the all-global reading admits 3 at a time: the others wait)
    pool = 3 * dg.memory_plan().blocks_per_sequence(4096 + 64) * dg.kv_bytes_per_block()
    d, dg = dep(m, kv_cache_bytes=pool), dep(glob, kv_cache_bytes=pool)
    assert d.memory_plan().sequences_that_fit(4096 + 64) >= 8 > 3 == dg.memory_plan().sequences_that_fit(4096 + 64)
    w = _burst(8, 4096, 64)
    sliding = simulate(d, w, EngineSettings(max_model_len=8192)).summary
    allglobal = simulate(dg, w, EngineSettings(max_model_len=8192)).summary
    assert sliding.preemptions == 0 and sliding.mean_ttft_s < 0.7 * allglobal.mean_ttft_s
    assert sliding.output_tok_s > allglobal.output_tok_s
    # attention cost: each query row attends to min(its prefix, window) keys
    for q, c0, win in [(1, 5000, 512), (300, 400, 512), (2048, 0, 512), (7, 3, 0), (16, 600, 512)]:
        want = sum(min(c0 + j + 1, win) if win else c0 + j + 1 for j in range(q))
        assert _keys_attended(q, c0, win) == want, (q, c0, win)
    def attention_flops(deployment):
        return {o.name: o for o in CostModel(deployment).decode_step(1, 8000).ops}["attention"].flops

    assert attention_flops(d) == 4 * 256 * 4 * (4 * 8001 + 22 * 512)
    assert attention_flops(dg) == 4 * 256 * 4 * 26 * 8001


# ------------------------------------------------------------------ replicas behind a router
def test_replicas_share_the_load_and_cache_aware_routing_keeps_prefixes_on_one_replica():
    cal = cpu_profile_from_roofline(load_roofline(ROOFLINE))
    d = cal.deployment()
    # 8 system prompts of 400 tokens, short questions, Poisson arrivals: users of 8 desks in no set order
    w = synthetic(160, LengthDist(16, 24), LengthDist(16, 16), rate=6.0, shared_prefix_len=400, seed=3,
                  num_prefixes=8)
    assert len({r.prefix_group for r in w.requests}) == 8
    one = simulate(d, w, EngineSettings(), replicas=1).summary
    rr = simulate(d, w, EngineSettings(), replicas=2, routing="round_robin")
    ca = simulate(d, w, EngineSettings(), replicas=2, routing="cache_aware")
    for res in (rr, ca):  # every request answered, each once
        assert sorted(r.arrival_s for r in res.records) == sorted(r.arrival_s for r in w.requests)
    assert rr.summary.num_devices == 2 and rr.summary.kv_pool_bytes == 2 * one.kv_pool_bytes
    # round robin computes each prefix on both replicas, cache-aware on one: fewer prompt tokens computed
    assert ca.summary.prefill_tokens_computed < rr.summary.prefill_tokens_computed
    assert ca.summary.prefix_hit_rate > rr.summary.prefix_hit_rate
    # two replicas answer sooner than one
    assert ca.summary.mean_ttft_s < one.mean_ttft_s
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        simulate(d, w, EngineSettings(), replicas=0)


def test_few_row_steps_are_priced_from_their_own_linear_timings():
    """bench roofline times the layers' linears at 2 and 4 rows too: a 4-row step's linears cost ~0.76 of the 8-row
    ones on one core (the kernels' row tiles), which a curve starting at 8 rows priced as half."""
    d = load_roofline(ROOFLINE_1CORE)
    measured = d["layer_linears_ms"]

    def linears_ms(data, rows):
        ops = CostModel(cpu_profile_from_roofline(data).deployment(), include_overheads=False).decode_step(rows, 100)
        return sum(o.time_s for o in ops.ops if o.name in ("qkv", "o", "mlp_up", "mlp_down")) * 1e3

    for rows in (2, 4, 8):
        assert linears_ms(d, rows) == pytest.approx(measured[str(rows)], rel=0.02)
    coarse = {**d, "layer_linears_ms": {k: v for k, v in measured.items() if k not in ("2", "4", "16")}}
    assert linears_ms(coarse, 4) < 0.7 * measured["4"]


def test_idle_replicas_lend_their_cores(capsys):
    """`serve --data-parallel-size` replicas lend idle cores: one client at a time on a pair of 1-core replicas runs
    about as fast as one 2-core engine; with both replicas busy all the time, lending changes nothing."""
    one_core = cpu_profile_from_roofline(load_roofline(ROOFLINE_1CORE)).deployment()
    two_cores = cpu_profile_from_roofline(load_roofline(ROOFLINE_2CORE)).deployment()
    lone = closed_loop(W1_PROMPT_TOKENS[:6], 64, 1)
    engine = simulate(two_cores, lone, EngineSettings()).summary
    pinned = simulate(one_core, lone, EngineSettings(), replicas=2).summary
    lent = simulate(one_core, lone, EngineSettings(), replicas=2, lend=two_cores).summary
    assert pinned.output_tok_s < 0.8 * engine.output_tok_s
    assert lent.output_tok_s == pytest.approx(engine.output_tok_s, rel=0.05)
    # 16 clients: each replica always has work, no step borrows
    busy = closed_loop(W1_PROMPT_TOKENS[:16], 64, 16)
    assert simulate(one_core, busy, EngineSettings(), replicas=2, lend=two_cores).summary.output_tok_s == \
        pytest.approx(simulate(one_core, busy, EngineSettings(), replicas=2).summary.output_tok_s, rel=0.02)
    # a step on borrowed cores that meets a sibling's new step finishes on its own share: two clients whose
    # requests start 10 ms apart take longer than one alone, less than on one core from the start
    two = Workload(tuple(replace(r, arrival_s=0.01 * i) for i, r in enumerate(lone.requests[:2])))
    lent2 = simulate(one_core, two, EngineSettings(), replicas=2, lend=two_cores)
    first = min(lent2.records, key=lambda r: r.arrival_s)
    alone = simulate(one_core, Workload(two.requests[:1]), EngineSettings(), replicas=2, lend=two_cores).records[0]
    solo_pinned = simulate(one_core, Workload(two.requests[:1]), EngineSettings(), replicas=2).records[0]
    assert alone.first_token_s < first.first_token_s < solo_pinned.first_token_s
    assert run(["--calibrate", ROOFLINE_1CORE, "--lend-calibrate", ROOFLINE_2CORE, "--replicas", "2",
                "--workload", "w1", "--concurrency", "1", "--output-len", "16"]) == 0
    assert "idle replicas lend their cores" in capsys.readouterr().out
    assert run(["--calibrate", ROOFLINE_1CORE, "--lend-calibrate", ROOFLINE_2CORE]) == 2


def test_plan_finds_the_fewest_replicas_that_meet_the_slo(capsys, tmp_path):
    args = build_parser().parse_args(["--calibrate", ROOFLINE, "--num-requests", "64", "--prompt-len", "100",
                                      "--output-len", "32"])
    cal = cpu_profile_from_roofline(load_roofline(ROOFLINE))
    n, s = plan_replicas(cal.deployment(), EngineSettings(), 8.0, 1.0, args)
    assert s.p99_ttft_s <= 1.0 and n >= 2

    def p99(k):
        wl = synthetic(64, LengthDist(100, 100), LengthDist(32, 32), 8.0 / k, None, 0, args.seed)
        return simulate(cal.deployment(), wl, EngineSettings(), args.seed).summary.p99_ttft_s

    assert p99(n - 1) > 1.0  # one fewer replica misses the SLO
    out = tmp_path / "plan.json"
    assert run(["--calibrate", ROOFLINE, "--num-requests", "64", "--prompt-len", "100", "--output-len", "32",
                "--plan-rate", "8", "--slo-p99-ttft-s", "1", "--result-json", str(out)]) == 0
    assert "| 8 | %d | " % n in capsys.readouterr().out
    assert json.load(open(out))["plan"][0]["replicas"] == n


def test_mixture_of_experts_costs_its_active_experts(tmp_path):
    """Qwen3-30B-A3B's published config.json: all 128 experts in memory (30.5B parameters), 8 per token in the
    FLOPs (3.3B active); a step reads the experts its rows chose (expected under uniform routing): a one-row decode
    ~1/16 of them, a 256-row one nearly all; the simulator runs it end to end."""
    cfg = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
           "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
           "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False,
           "max_position_embeddings": 40960, "norm_topk_prob": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = from_hf_config(str(tmp_path))
    assert m.num_params == pytest.approx(30.53e9, rel=0.01)
    assert m.active_linear_params + 2 * m.embedding_params == pytest.approx(3.3e9, rel=0.05)
    experts = [g for g in m.linear_groups() if g.copies > 1]
    assert {(g.name, g.copies, g.active, g.layers) for g in experts} == {("mlp_up", 128, 8, 48), ("mlp_down", 128, 8, 48)}
    assert experts[0].touched(1) == pytest.approx(8) and experts[0].touched(256) == pytest.approx(128, rel=1e-6)
    cost = CostModel(dep(m, kv_cache_bytes=2**30))
    one, many = cost.decode_step(1, 512), cost.decode_step(256, 512)
    up_bytes = SCHEMES["bf16"].linear.matrix_bytes(2048, 2 * 768) * 48
    assert one.op("mlp_up").bytes == pytest.approx(8 * up_bytes + 1 * 2 * (2048 + 2 * 768) * 8 * 48, rel=1e-6)
    assert many.op("mlp_up").bytes > 15 * one.op("mlp_up").bytes  # nearly every expert read
    assert many.op("mlp_up").flops == 256 * one.op("mlp_up").flops  # the FLOPs: the active experts only
    w = synthetic(16, LengthDist(32, 64), LengthDist(8, 8), concurrency=8, seed=1)
    s = simulate(dep(m), w, EngineSettings(max_num_seqs=8)).summary
    assert s.num_requests == 16 and s.output_tokens == 16 * 8 and s.weights_bytes == SCHEMES["bf16"].total_bytes(m)
    with pytest.raises(ValueError, match="mixture-of-experts"):  # as the engine: experts are not split over ranks
        dep(m, tp=2)
