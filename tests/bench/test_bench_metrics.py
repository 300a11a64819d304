"""Benchmark metric math on hand-made timestamps."""

import pytest

from pagedllm.bench.metrics import RequestRecord, parse_goodput, summarize


def test_summary_math():
    recs = [
        # 5 tokens: ttft 0.1, then 4 gaps of 0.05 -> latency 0.3, tpot = 0.2/4 = 0.05
        RequestRecord(True, prompt_tokens=10, output_tokens=5, ttft=0.1, latency=0.3, itl=[0.05] * 4),
        # 3 tokens: ttft 0.5, gaps 0.1, 0.3 -> latency 0.9, tpot = 0.4/2 = 0.2
        RequestRecord(True, prompt_tokens=20, output_tokens=3, ttft=0.5, latency=0.9, itl=[0.1, 0.3]),
        # 1 token: no tpot
        RequestRecord(True, prompt_tokens=7, output_tokens=1, ttft=0.2, latency=0.2, itl=[]),
        RequestRecord(False, error="HTTP 500"),
    ]
    r = summarize(recs, duration=2.0, goodput_slo_ms={"ttft": 300, "tpot": 100})
    assert r["completed"] == 3 and r["failed"] == 1
    assert r["total_input_tokens"] == 37 and r["total_output_tokens"] == 9
    assert r["request_throughput"] == pytest.approx(1.5)
    assert r["output_throughput"] == pytest.approx(4.5)
    assert r["total_token_throughput"] == pytest.approx(23.0)
    assert r["mean_ttft_ms"] == pytest.approx(800 / 3)
    assert r["median_ttft_ms"] == pytest.approx(200)
    assert r["mean_tpot_ms"] == pytest.approx(125)  # (50 + 200) / 2, the 1-token request excluded
    assert r["mean_itl_ms"] == pytest.approx((0.2 + 0.4) / 6 * 1000)
    assert r["p99_e2el_ms"] == pytest.approx(900 - 0.02 * (900 - 300), rel=1e-6)  # linear interpolation
    assert r["mean_e2el_ms"] == pytest.approx(1400 / 3)
    # goodput: request 1 meets ttft<=300 and tpot<=100; request 2 fails ttft; request 3 (tpot 0) meets both
    assert r["goodput"] == pytest.approx(1.0)
    assert r["errors"] == ["HTTP 500"]


def test_tpot_definition():
    rec = RequestRecord(True, output_tokens=11, ttft=1.0, latency=3.0)
    assert rec.tpot == pytest.approx(0.2)
    assert RequestRecord(True, output_tokens=1, ttft=1.0, latency=1.0).tpot is None


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    assert parse_goodput(None) is None
    with pytest.raises(ValueError, match="--goodput"):
        parse_goodput(["latency:5"])
