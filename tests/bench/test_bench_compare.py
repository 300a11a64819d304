"""`pagedllm bench compare --quick` end to end: every system runs, the table, JSON and PNG are written."""

import json
import subprocess
import sys


def test_bench_compare_quick(tmp_path):
    out = tmp_path / "cmp"
    r = subprocess.run([sys.executable, "-m", "pagedllm.cli.main", "bench", "compare", "--quick",
                        "--results-dir", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    systems = [row["system"] for row in res["rows"]]
    assert res["meta"]["cpu"]["model"] and isinstance(res["meta"]["cpu"]["flags"], list)
    assert any("one at a time" in s for s in systems)
    assert any("static batches" in s for s in systems)
    assert any("offline" in s for s in systems)
    assert sum("server, concurrency" in s for s in systems) == 2
    for row in res["rows"]:  # each server row: as a server started for that concurrency (the peers' are)
        if "server, concurrency" in row["system"]:
            assert row["peak_rss_per_run"] is True  # the peak was reset before the run (Linux's clear_refs)
            assert 0 < row["startup_peak_rss_bytes"] <= row["peak_rss_bytes"]
    for row in res["rows"]:
        assert row["output_tokens"] == res["meta"]["num_prompts"] * res["meta"]["output_len"], row
        assert row["output_tok_s"] > 0 and row["peak_rss_bytes"] > 0
        assert 0 < row["mean_ttft_s"] <= row["mean_latency_s"] <= row["p99_latency_s"] + 1e-9
        if "pagedllm" in row["system"]:
            assert 0 < row["kv_bytes_used_peak"] < row["kv_bytes_static_max_len"]
    table = (out / "results.md").read_text()
    assert table.count("\n| ") == len(systems) + 1  # header + one line per system
    assert (out / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
