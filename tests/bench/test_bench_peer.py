"""`pagedllm bench compare --peer NAME=URL` against a tiny fake OpenAI-compatible server, `--peer` parsing, and the
CPU description in benchmark results. No model is loaded."""

import argparse
import json
import socket
import threading
import time

import pytest

from pagedllm.bench import compare
from pagedllm.bench.cpuinfo import ISA_FLAGS, cpu_info, cpu_line, parse_cpuinfo

from fake_openai_server import FAKE_MODEL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fake_peer():
    """A streaming /v1/completions server in a thread: one SSE chunk per token, then usage; yields (url, bodies)."""
    import uvicorn

    from fake_openai_server import make_app

    bodies: list[dict] = []
    app = make_app(bodies)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", bodies
    server.should_exit = True
    thread.join(timeout=5)


def test_peer_phase_rows(fake_peer, tmp_path):
    url, bodies = fake_peer
    bodies.clear()
    assert compare.check_peer("fake", url) == FAKE_MODEL
    prompts = ["one two three", "four five", "six"]
    rows = compare.phase_peer("fake", url, FAKE_MODEL, prompts, output_len=5, concurrencies=[1, 2])
    assert [r["system"] for r in rows] == ["peer fake, concurrency 1", "peer fake, concurrency 2"]
    for r in rows:
        assert r["failed"] == 0
        assert r["output_tokens"] == len(prompts) * 5  # what the fake streamed: EOS was ignored
        assert r["output_tok_s"] > 0 and r["duration_s"] > 0
        assert 0 < r["mean_ttft_s"] <= r["mean_latency_s"] <= r["p99_latency_s"] + 1e-9
        assert r["peak_rss_bytes"] is None
    assert len(bodies) == 2 * len(prompts)
    for b in bodies:  # the same request pagedllm's server gets
        assert b["model"] == FAKE_MODEL and b["max_tokens"] == 5 and b["temperature"] == 0.0
        assert b["stream"] is True and b["ignore_eos"] is True and b["prompt"] in prompts

    meta = {"num_prompts": 3, "output_len": 5, "prompt_tokens_min": 1, "prompt_tokens_max": 3, "cpus": 2,
            "cpu": {"model": "Test CPU", "flags": ["avx2", "fma"]},
            "peers": {"fake": {"url": url, "model": FAKE_MODEL}}}
    table = compare.write_report(rows, meta, str(tmp_path))
    assert "CPU: Test CPU (avx2, fma), 2 logical CPUs." in table
    assert f"Peer fake: {url}, model {FAKE_MODEL}." in table
    assert "| peer fake, concurrency 2 |" in table and "| — | — |" in table  # RSS and KV unknown for a peer
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["meta"]["peers"]["fake"]["model"] == FAKE_MODEL and len(saved["rows"]) == 2


def test_peer_cmd_starts_each_peer_alone_with_startup_and_rss(tmp_path):
    """--peer-cmd: the phase starts the command once per concurrency (its {port}, {c} and {ctx} filled in), waits
    for it to answer, measures it, reads its peak RSS and stops it."""
    import os
    import sys

    script = os.path.join(os.path.dirname(__file__), "fake_openai_server.py")
    name, cmd = compare.parse_peer_cmd(f"fake={sys.executable} {script} --port {{port}} --tag c{{c}}-ctx{{ctx}}")
    rows = compare.phase_peer_cmd(name, cmd, ["one two three", "four five"], 4, [1, 2], str(tmp_path))
    assert [r["system"] for r in rows] == ["peer fake, concurrency 1", "peer fake, concurrency 2"]
    for r, c in zip(rows, (1, 2)):
        assert r["failed"] == 0 and r["output_tokens"] == 8
        assert r["startup_s"] > 0 and r["peak_rss_bytes"] > 10 * 2**20
        assert f"started c{c}-ctx{2048 * c}" in (tmp_path / f"peer-fake-c{c}.log").read_text()
    with pytest.raises(argparse.ArgumentTypeError):
        compare.parse_peer_cmd("fake=server --no-port")


def test_unreachable_peer_fails_clearly():
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    with pytest.raises(ValueError, match=r"peer llama\.cpp at http://127\.0\.0\.1:\d+ is not an OpenAI-compatible"):
        compare.check_peer("llama.cpp", url)


def test_unreachable_peer_stops_compare_before_measuring(tmp_path, monkeypatch):
    def no_phase(*a, **k):
        raise AssertionError("measured before checking the peer")

    monkeypatch.setattr(compare, "_run_phase", no_phase)
    monkeypatch.setattr(compare, "phase_server", no_phase)
    p = argparse.ArgumentParser()
    compare.add_args(p)
    args = p.parse_args(["--peer", f"x=http://127.0.0.1:{_free_port()}", "--results-dir", str(tmp_path / "r")])
    with pytest.raises(ValueError, match="peer x at"):
        compare.main(args)
    assert not (tmp_path / "r").exists()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    compare.add_args(p)
    return p


def test_peer_parsing():
    a = _parser().parse_args(["--peer", "llama.cpp=http://127.0.0.1:8080/", "--peer", "vllm=https://h:8000"])
    assert a.peer == [("llama.cpp", "http://127.0.0.1:8080"), ("vllm", "https://h:8000")]
    assert _parser().parse_args([]).peer == []


@pytest.mark.parametrize("bad", ["llama.cpp", "=http://127.0.0.1:8080", "x=127.0.0.1:8080", "x=ftp://h:1",
                                 "x=http://", "x="])
def test_peer_parsing_errors(bad, capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["--peer", bad])
    assert e.value.code == 2
    assert "argument --peer" in capsys.readouterr().err


def test_duplicate_peer_names(tmp_path):
    args = _parser().parse_args(["--peer", "a=http://127.0.0.1:1", "--peer", "a=http://127.0.0.1:2"])
    with pytest.raises(ValueError, match="must differ"):
        compare.main(args)


def test_cpu_info():
    info = cpu_info()
    assert isinstance(info["model"], str) and info["model"]
    assert isinstance(info["flags"], list) and set(info["flags"]) <= set(ISA_FLAGS)
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), None)
    if flags is not None:  # x86
        assert ("avx2" in info["flags"]) == ("avx2" in flags)
    assert info["model"] in cpu_line(info)


def test_parse_cpuinfo_x86_and_arm():
    x86 = "processor\t: 0\nmodel name\t: Intel Xeon\nflags\t\t: fpu sse2 avx2 fma avx512f amx_tile\n\nprocessor\t: 1\n"
    assert parse_cpuinfo(x86) == {"model": "Intel Xeon", "flags": ["avx2", "fma", "avx512f", "amx_tile"]}
    arm = "processor\t: 0\nFeatures\t: fp asimd evtstrm sve\nCPU implementer\t: 0x41\n"
    assert parse_cpuinfo(arm) == {"model": "", "flags": ["asimd", "sve"]}
    assert cpu_line({"model": "X", "flags": []}) == "X (none of the listed ISA flags)"
