"""`python -m tools.ladder`: workloads, step flags, gates and the report, on hand-made rows (no server, no model:
the end-to-end run takes minutes and is done by hand, see docs/benchmarks.md)."""

import json

import pytest

from tools import ladder


def _w(tok_s, **kw):
    return {"output_tok_s": tok_s, "mean_latency_s": 10.0, "p99_latency_s": 12.0, "mean_ttft_s": 1.0, "failed": 0,
            **kw}


def _row(step, target, tok_s: dict, texts=None, **kw):
    s = {st.number: st for st in ladder.ladder_steps()}[step]
    r = ladder._new_row(s)
    assert r["target"] == target
    r["workloads"] = {k: _w(v) for k, v in tok_s.items()}
    r["texts"] = texts or {}
    r.update(kw)
    return r


SAME = {"prefix": ["a b c", "d e f"], "code": ["x = 1\n", "y = 2\n"]}


def _fake_rows(step5_texts=None):
    return [
        _row(1, "w1", {"w1": 10.0, "prefix": 8.0, "code": 10.0}, SAME, peak_rss_bytes=1200 * 2**20),
        _row(2, "w1", {"w1": 50.0, "prefix": 40.0, "code": 50.0}, SAME, weights_bytes=513 * 2**20),
        _row(3, "w1", {"w1": 100.0, "prefix": 80.0, "code": 100.0}, SAME, weights_bytes=110 * 2**20),
        _row(4, "prefix", {"w1": 100.0, "prefix": 120.0, "code": 100.0}, SAME, weights_bytes=110 * 2**20),
        _row(5, "code", {"w1": 90.0, "prefix": 110.0, "code": 150.0}, step5_texts or SAME,
             weights_bytes=110 * 2**20),
    ]


EVAL_PASS = {"passed": True, "failures": [], "scores": [
    {"correct": 115, "total": 115, "perplexity": 19.624, "top1_agreement": None},
    {"correct": 115, "total": 115, "perplexity": 19.630, "top1_agreement": 0.9998}]}


def test_speedups_are_per_workload_over_step_1():
    rows = _fake_rows()
    assert ladder.speedup(rows, 1, "w1") == 1.0
    assert ladder.speedup(rows, 3, "w1") == pytest.approx(10.0)
    assert ladder.speedup(rows, 4, "prefix") == pytest.approx(15.0)  # 120 / 8, not 120 / 10 (step 1's W1)
    assert ladder.speedup(rows, 5, "code") == pytest.approx(15.0)
    assert ladder.speedup(rows[1:], 3, "w1") is None  # no step 1: no speedup


def test_gates_pass_and_report_lists_every_step():
    rows = _fake_rows()
    ladder.compute_gates(rows, EVAL_PASS)
    assert [r["gate"]["status"] for r in rows] == ["reference", "PASS", "PASS", "PASS", "PASS"]
    meta = {"command": "python -m tools.ladder", "output_len": 128, "concurrency": 32, "cpu": "AMD EPYC (avx2)",
            "cpus": 2}
    md = ladder.build_report(rows, meta)
    assert "**FAILED**" not in md
    ladder_lines = [ln for ln in md.splitlines() if ln.startswith("| ") and "`" in ln]
    assert len(ladder_lines) == 5
    assert "| 15.00x |" in ladder_lines[3]  # step 4 on shared prefix: 120 / 8
    assert "| 10.00x |" in ladder_lines[2]
    assert "110 + 0 = 110" in ladder_lines[2]  # weights + peak KV
    assert "**120.0 (15.00x)**" in md  # step 4's target workload in bold in the per-workload table
    assert "AMD EPYC (avx2)" in md and "`python -m tools.ladder`" in md


def test_a_changed_output_fails_the_gate_and_is_shown_failed():
    changed = {"prefix": SAME["prefix"], "code": ["x = 1\n", "y = 3\n"]}
    rows = _fake_rows(step5_texts=changed)
    ladder.compute_gates(rows, EVAL_PASS)
    g = rows[4]["gate"]
    assert g["status"] == "FAILED"
    assert g["identity"]["code"] == {"identical": 1, "total": 2, "diffs": [{"prompt": 1, "char": 4}]}
    assert "2/2 shared prefix, 1/2 code rewrite" in g["detail"]
    md = ladder.build_report(rows, {"command": "x", "output_len": 8, "concurrency": 4})
    step5 = [ln for ln in md.splitlines() if ln.startswith("| 5 | ")][0]
    assert "(**FAILED**)" in step5 and "**FAILED**: greedy output identical to step 3" in step5
    assert "| 150.0 |" in step5  # a failed step keeps its numbers


def test_eval_failure_skip_error_and_missing_reference():
    rows = _fake_rows()
    bad = dict(EVAL_PASS, passed=False, failures=["accuracy -3.48% > -1.00%"])
    ladder.compute_gates(rows, bad)
    assert rows[2]["gate"]["status"] == "FAILED" and "accuracy -3.48%" in rows[2]["gate"]["detail"]
    ladder.compute_gates(rows, None)
    assert rows[2]["gate"]["status"] == "not run"
    assert "identical to step 2: 2/2 shared prefix, 2/2 code rewrite (informational)" in rows[2]["gate"]["detail"]
    rows[1]["workloads"]["w1"]["failed"] = 3
    rows[3]["error"] = "RuntimeError: server did not start"
    ladder.compute_gates(rows, EVAL_PASS)
    assert rows[1]["gate"] == {"status": "FAILED", "detail": "3 requests failed"}
    assert rows[3]["gate"]["status"] == "FAILED" and "did not start" in rows[3]["gate"]["detail"]
    no_ref = [r for r in _fake_rows() if r["step"] != 3]
    ladder.compute_gates(no_ref, EVAL_PASS)
    assert [r["gate"]["status"] for r in no_ref] == ["reference", "PASS", "n/a", "n/a"]


def test_greedy_identity():
    assert ladder.greedy_identity(["abc", "def"], ["abc", "def"])["identical"] == 2
    r = ladder.greedy_identity(["abc", "def", "gh"], ["abc", "dXf", "ghi"])
    assert r == {"identical": 1, "total": 3, "diffs": [{"prompt": 1, "char": 1}, {"prompt": 2, "char": 2}]}
    assert ladder.greedy_identity(["ab\ufffd"], ["ab"])["identical"] == 1  # a held-back partial character


def test_workloads_have_the_intended_shape():
    from pagedllm.config import default_model_path
    from pagedllm.engine.tokenizer import load_tokenizer

    w = ladder.build_workloads(32)
    assert {k: len(v) for k, v in w.items()} == {"w1": 32, "prefix": 32, "code": 32}
    assert len(set(w["w1"])) == 32 and len(set(w["code"])) == 32
    tok = load_tokenizer(default_model_path())
    n_sys = len(tok.encode(ladder.SHARED_SYSTEM))
    assert 380 <= n_sys <= 440, n_sys
    for p, q in zip(w["w1"], w["prefix"]):
        assert q.startswith(ladder.SHARED_SYSTEM) and q.endswith(p)
        # the shared part survives tokenization: at least 24 whole 16-token KV blocks are common to all prompts
        assert tok.encode(q)[: 24 * 16] == tok.encode(w["prefix"][0])[: 24 * 16]
    code = ladder.code_rewrite_prompts()
    assert len(code) == 40 and len(set(code)) == 40
    for p in code:
        snippet = p.split("\n\n", 1)[1].rsplit("Rewritten code:", 1)[0]
        assert p.startswith("Rewrite this Python code with one change: ")
        assert p.endswith("\nRewritten code:\n") and snippet.count("\n") >= 15  # the answer repeats the snippet
    # the one-stream prompts are not among the measured ones at the defaults (no prefix-cache help)
    assert not set(ladder.single_stream_prompts(4)) & set(w["code"])
    assert ladder.single_stream_prompts(0) == []
    assert len(ladder.build_workloads(50)["code"]) == 50  # beyond the set: it repeats


def test_steps_are_cumulative_and_the_spec_flag_survives_splitting():
    from pagedllm.config import SpeculativeConfig

    steps = {s.number: s for s in ladder.ladder_steps()}
    assert steps[1].dtype is None
    assert steps[2].dtype == "float32" and "--no-enable-prefix-caching" in steps[2].extra
    assert steps[3].dtype == "auto" and "--no-enable-prefix-caching" in steps[3].extra
    assert steps[4].dtype == "auto" and "--no-enable-prefix-caching" not in steps[4].extra
    assert steps[5].dtype == "auto" and "--no-enable-prefix-caching" not in steps[5].extra
    flags = " ".join(steps[5].extra).split()  # compare.running_server splits the extra flags on whitespace
    cfg = flags[flags.index("--speculative-config") + 1]
    assert SpeculativeConfig.from_dict(cfg).method == "ngram"


def test_argument_parsing():
    p = ladder.build_parser()
    a = p.parse_args([])
    assert (a.num_prompts, a.output_len, a.concurrency, a.steps) == (32, 128, 32, [1, 2, 3, 4, 5])
    assert a.func is ladder.main and not a.skip_hf and not a.skip_eval and a.results_dir == "results/ladder"
    a = p.parse_args(["--num-prompts", "4", "--output-len", "8", "--concurrency", "4",
                      "--steps", "3", "1", "5", "--skip-hf", "--skip-eval", "--result-json", "x.json",
                      "--spec-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert (a.num_prompts, a.output_len, a.concurrency, a.skip_eval, a.result_json) == (4, 8, 4, True, "x.json")
    assert ladder.selected_steps(a) == [3, 5]
    assert a.spec_config["num_speculative_tokens"] == 2
    with pytest.raises(SystemExit):
        p.parse_args(["--steps", "6"])


def test_weights_from_the_start_up_log():
    line = ("2026-12-01 10:00:00 INFO pagedllm.worker.model_runner: model /x/SmolLM2.gguf (llama, 30 layers) on "
            "cpu/float32, weights gguf blocks (auto) (109.8 MiB), qlinear; KV cache 5461 blocks x 16 tokens "
            "(1024.0 MiB)")
    assert ladder.weights_bytes_from_log("noise\n" + line + "\n") == int(109.8 * 2**20)
    assert ladder.weights_bytes_from_log("no such line") is None


def test_counter_deltas():
    before = {"pagedllm:prefix_cache_queries_total": 100.0, "pagedllm:prefix_cache_hits_total": 0.0}
    after = {"pagedllm:prefix_cache_queries_total": 1100.0, "pagedllm:prefix_cache_hits_total": 800.0,
             "pagedllm:spec_decode_num_drafts_total": 10.0, "pagedllm:spec_decode_num_draft_tokens_total": 40.0,
             "pagedllm:spec_decode_num_accepted_tokens_total": 22.0}
    d = ladder.counter_deltas(before, after)
    assert d["prefix_cache_hit_rate"] == pytest.approx(0.8)
    assert d["spec_mean_acceptance_length"] == pytest.approx(3.2)
    assert d["spec_acceptance_rate"] == pytest.approx(0.55)
    assert ladder.counter_deltas({}, {}) == {}


def test_outputs_written(tmp_path):
    rows = _fake_rows()
    ladder.compute_gates(rows, EVAL_PASS)
    meta = {"command": "python -m tools.ladder", "output_len": 128, "concurrency": 32, "num_prompts": 32}
    md = ladder.write_outputs(rows, meta, str(tmp_path), str(tmp_path / "sub" / "x.json"))
    assert (tmp_path / "results.md").read_text() == md
    doc = json.loads((tmp_path / "sub" / "x.json").read_text())
    assert [r["gate"]["status"] for r in doc["rows"]] == ["reference", "PASS", "PASS", "PASS", "PASS"]
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_draft_pair_resolution(tmp_path):
    t, d = tmp_path / "t.gguf", tmp_path / "d.gguf"
    t.write_bytes(b"x")
    d.write_bytes(b"x")
    assert ladder.resolve_draft_pair(f"{t},{d}") == (str(t), str(d))
    assert ladder.resolve_draft_pair(f"{t},{d}", enabled=False) is None
    with pytest.raises(ValueError, match="TARGET,DRAFT"):
        ladder.resolve_draft_pair(str(t))
    with pytest.raises(ValueError, match="does not exist"):
        ladder.resolve_draft_pair(f"{t},{tmp_path / 'missing.gguf'}")


def test_draft_step_end_to_end_and_in_the_report(tmp_path):
    """The draft-model variant's real run (`bench spec` in a subprocess; the embedded model as its own draft, so
    the gate must pass and the draft must be accepted), then its table in the report; a differing output fails."""
    d = ladder.run_draft_step("default", "default", 8, str(tmp_path), dtype="float32")
    assert [r["config"] for r in d["rows"]] == ["no speculation", "ngram k=4", "draft model k=4"]
    assert d["gate"]["status"] == "PASS"
    assert d["rows"][2]["mean_acceptance_length"] > 2.0  # a model drafting for itself is mostly accepted
    meta = {"command": "x", "output_len": 4, "concurrency": 2, "draft_step": d}
    report = ladder.build_report(_fake_rows(), meta)
    assert "Step 5 with a draft model" in report and "| draft model k=4 |" in report
    bad = json.loads(json.dumps(d))
    bad["rows"][2]["greedy_identical"] = False
    bad["gate"] = {"status": "FAILED", "detail": "greedy output differs from no speculation: draft model k=4"}
    assert "**FAILED**" in "".join(ladder.draft_section(bad))
    assert "FAILED** to run" in "".join(ladder.draft_section({"error": "CalledProcessError: boom"}))
