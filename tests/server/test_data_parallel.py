"""`pagedllm serve --data-parallel-size 2`: two replicas behind the built-in balancer, and the same replicas behind
vllm-router (the router the README's multi-machine recipe uses): every request answered, prefix-affine routing that
beats round robin on prefix-cache hits, merged metrics, a replica killed mid-stream, a clean stop."""

import argparse
import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from helpers import MODEL, free_port, start_server, wait_until_serving
from pagedllm.metrics.prometheus import merge_expositions
from pagedllm.routing import ReplicaRouter
from pagedllm.server.data_parallel import ENGINE_HEADER, ReplicaSet, core_groups, replica_endpoint, routing_text, text_chain

# ---------------------------------------------------------------------- units (no server)


def test_core_groups_share_out_the_cores():
    assert core_groups([0, 1], 2) == [[0], [1]]
    assert core_groups([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert core_groups([4, 5, 6], 1) == [[4, 5, 6]]
    with pytest.raises(ValueError, match="needs at least 3 CPU cores"):
        core_groups([0, 1], 3)


def test_cache_aware_routing_follows_shared_starts_within_the_load_slack():
    router = ReplicaRouter(2, "cache_aware", slack=2)

    def choose(text, loads):
        return router.choose(text_chain(text), loads)

    system = "You are a careful assistant for the billing team. " * 4
    first = choose(system + "user one", {0: 0, 1: 0})
    other = 1 - first
    # the same start goes where it went while that replica is within the slack of the least busy one
    assert all(choose(system + f"user {i}", {first: 2, other: 0}) == first for i in range(5))
    # a start nobody was sent goes to the least busy replica
    assert choose("A completely different conversation opener. " * 3, {first: 0, other: 0}) == other
    # the matching replica busier than the slack allows: the least busy one (which then has the start too, and
    # wins the next tie by being less busy)
    assert choose(system + "user 9", {first: 3, other: 0}) == other
    assert choose(system + "user 11", {first: 3, other: 2}) == other
    # text shorter than a chunk matches nothing: least busy
    assert choose("hi", {0: 3, 1: 1}) == 1
    # a shared opening shorter than half the text (and than the minimum match) is not followed
    b = ReplicaRouter(2)
    opening = '[[{"role": "system", "content": "'
    b.choose(text_chain(opening + "x" * 200), {0: 0, 1: 0})
    assert b.choose(text_chain(opening + "y" * 200), {0: 1, 1: 0}) == 1
    # round robin: each available replica in turn, whatever the text
    rr = ReplicaRouter(3, "round_robin")
    assert [rr.choose(text_chain(system), {0: 5, 1: 0, 2: 0}) for _ in range(4)] == [0, 1, 2, 0]
    assert rr.choose(None, {0: 0, 2: 0}) in (0, 2)


def test_routing_text_keeps_a_shared_start_shared():
    sys_msg = {"role": "system", "content": "S" * 100}
    a = routing_text(b'{"model": "m", "messages": [%s, {"role": "user", "content": "a"}]}'
                     % str(sys_msg).replace("'", '"').encode())
    b = routing_text(b'{"model": "m", "messages": [%s, {"role": "user", "content": "b"}]}'
                     % str(sys_msg).replace("'", '"').encode())
    common = len(os.path.commonprefix([a, b]))
    assert common > 100 and a != b
    assert routing_text(b'{"prompt": "hello"}').startswith('["hello')
    assert routing_text(b"not json") is None and routing_text(b"[1, 2]") is None
    assert routing_text(b'{"model": "m"}') is None


def test_replicas_lend_cores_through_a_folder_unless_told_not_to():
    lend = ReplicaSet(argparse.Namespace(data_parallel_lend_cores=True), 2, "cache_aware")
    assert os.path.isdir(lend.share_dir)
    lend.remove_files()
    assert not os.path.exists(lend.share_dir)
    pinned = ReplicaSet(argparse.Namespace(data_parallel_lend_cores=False), 2, "cache_aware")
    assert pinned.share_dir is None
    pinned.remove_files()
    assert ReplicaSet(argparse.Namespace(data_parallel_lend_cores=True), 1, "cache_aware").share_dir is None


def test_replica_kv_event_endpoints_do_not_collide():
    assert replica_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert replica_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert replica_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv-1"


def test_merged_metrics_label_each_replica():
    text = ("# HELP vllm:num_requests_running Requests.\n# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{model_name="m"} %d\n')
    out = merge_expositions({"0": text % 3, "1": text % 5}, "engine").decode()
    assert out.count("# TYPE vllm:num_requests_running gauge") == 1
    assert 'vllm:num_requests_running{engine="0",model_name="m"} 3.0' in out
    assert 'vllm:num_requests_running{engine="1",model_name="m"} 5.0' in out


# ---------------------------------------------------------------------- two replicas on this machine


@pytest.fixture(scope="module")
def dp(tmp_path_factory):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.fail("these tests need 2 CPU cores (one per replica); CI has 2")
    proc, base, log = start_server(tmp_path_factory, "--dtype", "auto", "--data-parallel-size", "2",
                                   "--max-model-len", "1024")
    yield proc, base, log
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _replicas(base):
    return httpx.get(base + "/health").json()["replicas"]


def _hits(urls) -> float:
    """Prefix-cache hit tokens summed over the replicas, scraped from each."""
    total = 0.0
    for url in urls:
        for line in httpx.get(url + "/metrics").text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _workload(tag: str, systems: int = 3, users: int = 4) -> list[list[dict]]:
    """Chat requests: ``systems`` long system prompts, each followed by ``users`` short user turns, in the order
    users arrive (the system prompts interleaved; an odd count, so that round robin over two replicas does not
    happen to keep each system prompt on one)."""
    out = []
    for u in range(users):
        for s in range(systems):
            system = f"[{tag} desk {s}] " + " ".join(f"rule {s}.{k}: answer politely about topic {k}."
                                                     for k in range(24))
            out.append([{"role": "system", "content": system}, {"role": "user", "content": f"question {u}?"}])
    return out


def _chat(url, messages) -> httpx.Response:
    r = httpx.post(url + "/v1/chat/completions", timeout=120,
                   json={"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    return r


def test_two_replicas_each_on_its_core_answer_follow_prefixes_and_lend_idle_cores(dp):
    _, base, _ = dp
    reps = _replicas(base)
    assert [len(r["cores"]) for r in reps] == [1, 1] and reps[0]["cores"] != reps[1]["cores"]
    assert all(r["healthy"] for r in reps)
    where: dict[str, set[str]] = {}
    for messages in _workload("builtin"):
        r = _chat(base, messages)
        assert r.json()["choices"][0]["message"]["content"]
        where.setdefault(messages[0]["content"], set()).add(r.headers[ENGINE_HEADER])
    # every user of one system prompt landed on one replica, and both replicas served
    assert all(len(engines) == 1 for engines in where.values()), where
    assert set().union(*where.values()) == {"0", "1"}
    # streaming passes through
    with httpx.stream("POST", base + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "stream": True}) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        lines = [x for x in s.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3
    # errors keep the API's shape and status
    r = httpx.post(base + "/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    # the balancer's /metrics: each replica's samples, labelled by engine
    metrics = httpx.get(base + "/metrics").text
    assert 'vllm:num_requests_running{engine="0"' in metrics and 'vllm:num_requests_running{engine="1"' in metrics
    # one request at a time: the replica serving it ran steps on the idle one's core too (lent by default)
    cores = [httpx.get(r["url"] + "/health").json()["runtime"]["data_parallel_cores"] for r in reps]
    assert all(c["own_threads"] == 1 for c in cores)
    assert sum(c["steps_on_borrowed_cores"] for c in cores) > 0, cores


def test_vllm_router_cache_aware_beats_round_robin_on_prefix_hits(dp, tmp_path):
    _, base, _ = dp
    urls = [r["url"] for r in _replicas(base)]
    hits = {}
    for policy in ("round_robin", "cache_aware"):
        port = free_port()
        log = tmp_path / f"router-{policy}.log"
        router = subprocess.Popen(["vllm-router", "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
                                   "--prometheus-port", str(free_port()), "--worker-urls", *urls],
                                  stdout=open(log, "w"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until_serving(router, url, log)
            before = _hits(urls)
            for messages in _workload(policy):
                _chat(url, messages)
            hits[policy] = _hits(urls) - before
        finally:
            router.terminate()
            router.wait(10)
    # the same workload (fresh system prompts each time): cache-aware routing finds more of them cached
    assert hits["cache_aware"] > hits["round_robin"] > 0, hits


def test_sglang_router_in_front_of_the_replicas_gets_answers(dp, tmp_path):
    """SGLang's router writes its own extension fields into every body: at their defaults they are answered."""
    _, base, _ = dp
    urls = [r["url"] for r in _replicas(base)]
    port = free_port()
    log = tmp_path / "sglang-router.log"
    router = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--policy", "cache_aware",
                               "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
                               "--worker-urls", *urls],
                              stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(router, url, log)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0).choices[0].text
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=3, temperature=0)
        assert chat.choices[0].message.content
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=3, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    finally:
        router.terminate()
        router.wait(10)


def test_vllm_router_fails_over_when_a_replica_dies(tmp_path_factory, tmp_path):
    """Two plain servers behind vllm-router: one is SIGKILLed with requests in flight. Those end (answered by the
    router's retry on the other replica, or an error), none hangs; every later request is answered."""
    servers = [start_server(tmp_path_factory, "--dtype", "auto", "--max-model-len", "1024") for _ in range(2)]
    port = free_port()
    log = tmp_path / "router.log"
    router = subprocess.Popen(["vllm-router", "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
                               "--prometheus-port", str(free_port()), "--worker-urls", *[b for _, b, _ in servers]],
                              stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def complete(i, n):
        try:
            return httpx.post(url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": f"Request {i}:", "max_tokens": n, "ignore_eos": True}).status_code
        except httpx.HTTPError as e:  # a transport error is an answer too (not a hang)
            return type(e).__name__

    try:
        wait_until_serving(router, url, log)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(complete, i, 150) for i in range(4)]
            time.sleep(1.0)
            servers[1][0].kill()
            t0 = time.time()
            in_flight = [f.result() for f in futures]
        assert time.time() - t0 < 45 and len(in_flight) == 4
        assert in_flight.count(200) >= 2, in_flight  # the survivor's own requests at least
        assert [complete(i, 4) for i in range(8)] == [200] * 8
    finally:
        router.terminate()
        router.wait(10)
        for proc, _, _ in servers:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_a_replica_killed_mid_stream_errors_its_stream_the_rest_go_on_and_it_comes_back(dp):
    _, base, _ = dp
    with httpx.stream("POST", base + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "Count to one thousand:", "max_tokens": 400, "stream": True,
                            "ignore_eos": True}) as s:
        victim = int(s.headers[ENGINE_HEADER])
        lines = s.iter_lines()
        assert next(x for x in lines if x.startswith("data: "))
        dead_pid = _replicas(base)[victim]["pid"]
        os.kill(dead_pid, signal.SIGKILL)
        t0 = time.time()
        rest = [x for x in lines if x.startswith("data: ")]  # ends (no hang) with an error event
    assert time.time() - t0 < 30
    assert rest and '"error"' in rest[-1], rest[-3:]
    # the balancer sees the death (it polls every 0.5 s) and starts the victim again; meanwhile everything goes to
    # the survivor, answered (a restarted victim that is healthy again before these end may take one: it is ready)
    deadline = time.time() + 10
    while _replicas(base)[victim]["restarts"] != 1:
        assert time.time() < deadline, _replicas(base)
        time.sleep(0.1)
    for messages in _workload("after", systems=3, users=1):
        engine = _chat(base, messages).headers[ENGINE_HEADER]
        assert engine == str(1 - victim) or _replicas(base)[victim]["healthy"], _replicas(base)
    # the victim is started again (a new process on the same core) and rejoins the rotation
    deadline = time.time() + 120
    while not (_replicas(base)[victim]["healthy"]):
        assert time.time() < deadline, _replicas(base)
        time.sleep(0.3)
    back = _replicas(base)[victim]
    assert back["pid"] != dead_pid and back["restarts"] == 1 and not back["exited"]
    # its cache starts empty, so a new conversation goes to it (the least busy, with the least cached)
    assert _chat(base, _workload("rejoined", systems=1, users=1)[0]).headers[ENGINE_HEADER] == str(victim)
    h = httpx.get(base + "/health")
    assert h.status_code == 200 and all(r["healthy"] for r in h.json()["replicas"])


def test_sigterm_stops_the_balancer_and_its_replicas(dp):
    proc, base, _ = dp
    pids = [r["pid"] for r in _replicas(base)]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    for pid in pids:  # both gone (reaped by the balancer), none left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
