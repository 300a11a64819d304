"""Shared checks and test infrastructure: greedy comparison against a reference, a live server subprocess, its
metrics, and the engine's model."""

import socket
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "SmolLM2-135M-Instruct"  # the server's default name for the embedded model


def model_of(llm):
    """The model an ``LLM`` runs (its runner's ``CausalLM``)."""
    return llm.engine.core.runner.model


def assert_greedy_close(ours_ids, ours_top, ref_ids, ref_logprobs, name=""):
    """Token-for-token equality, except at a near-tie (as vLLM's check_logprobs_close): at the first position
    where the two differ, each side's token must be among the other's top-5; the sequences are not compared
    after that. Returns the number of leading tokens that matched exactly.

    ours_top: per position, a list of our top-5 token ids. ref_logprobs: per position, the reference's
    log-softmax row (a tensor).
    """
    n = min(len(ours_ids), len(ref_ids))
    for i in range(n):
        if ours_ids[i] == ref_ids[i]:
            continue
        ref_top5 = ref_logprobs[i].topk(5).indices.tolist()
        assert ours_ids[i] in ref_top5 and ref_ids[i] in ours_top[i], (
            f"{name}: token {i} differs and is no near-tie: ours {ours_ids[i]} (ref top5 {ref_top5}), "
            f"ref {ref_ids[i]} (our top5 {ours_top[i]})"
        )
        gap = abs(ref_logprobs[i][ours_ids[i]].item() - ref_logprobs[i][ref_ids[i]].item())
        assert gap < 0.1, f"{name}: token {i} differs with a logprob gap of {gap:.3f} in the reference"
        return i
    assert len(ours_ids) == len(ref_ids), f"{name}: lengths differ: ours {len(ours_ids)}, ref {len(ref_ids)}"
    return n


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp_path_factory, *extra):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    fh = open(log, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", "--port", str(port),
         "--log-stats-interval", "1", *([] if "--dtype" in extra else ["--dtype", "float32"]), *extra],
        stdout=fh, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base, log
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server did not become healthy:\n{log.read_text()}")


def wait_until_serving(proc, url: str, log, timeout_s: float = 60, path: str = "/v1/models") -> None:
    """Polls ``url + path`` until it answers 200; fails with the end of ``log`` (a path) if ``proc`` exits first or
    the time is up."""
    deadline = time.time() + timeout_s
    while True:
        assert proc.poll() is None, f"exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, f"{url} did not come up in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.3)


def scrape(base) -> dict:
    text = httpx.get(base + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("" if "finished_reason" not in s.labels else f"[{s.labels['finished_reason']}]")
            out[key] = s.value
    return out
