"""`pagedllm ray-serve`: the server as a Ray Serve deployment on a local Ray cluster started by the command, two
replicas answering through the OpenAI SDK; the deployment's options (replicas, autoscaling on requests in flight)."""

import argparse
import concurrent.futures
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from helpers import MODEL, free_port, wait_until_serving
from pagedllm.server.cli_args import add_ray_serve_args
from pagedllm.server.kv_events import KVEventPublisher, KVEventsConfig
from pagedllm.server.ray_serve import REPLICA_HEADER, PagedLLMDeployment, app_builder, deployment_options


def _args(*argv):
    p = argparse.ArgumentParser()
    add_ray_serve_args(p)
    return p.parse_args(list(argv))


def test_deployment_options_fixed_and_autoscaled():
    fixed = deployment_options(_args("--num-replicas", "2", "--num-cpus-per-replica", "1", "--max-num-seqs", "8"))
    assert fixed == {"max_ongoing_requests": 32, "num_replicas": 2, "ray_actor_options": {"num_cpus": 1.0}}
    auto = deployment_options(_args("--min-replicas", "1", "--max-replicas", "4", "--target-ongoing-requests", "8"))
    assert auto["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8.0}
    assert "num_replicas" not in auto and auto["ray_actor_options"] == {"num_cpus": 1.0}
    for bad, needle in ((("--min-replicas", "3", "--max-replicas", "2"), "min-replicas"),
                        (("--min-replicas", "1"), "goes with --max-replicas"),
                        (("--num-replicas", "0"), "num-replicas must be >= 1")):
        with pytest.raises(ValueError, match=needle):
            deployment_options(_args(*bad))


def test_serve_run_builder_checks_the_flags_before_any_replica_starts():
    assert app_builder({"num_replicas": 2, "max_num_seqs": 16, "no_enable_prefix_caching": "true"}) is not None
    with pytest.raises(ValueError, match="--data-parallel-size"):
        app_builder({"data_parallel_size": 2})
    with pytest.raises(ValueError, match="block_size"):
        app_builder({"block_size": 0})


def test_two_replicas_on_a_local_ray_cluster_answer_through_the_openai_sdk(tmp_path):
    port = free_port()
    log = tmp_path / "ray-serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.cli.main", "ray-serve", "--num-replicas", "2",
                             "--port", str(port), "--max-model-len", "1024"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, base, log, timeout_s=240)
        # The proxy answers once one replica is up; `serve.run` returns when both are RUNNING, and Serve says so
        deadline = time.time() + 120
        while "Application 'pagedllm' is ready" not in log.read_text():
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)

        def complete(i):
            r = client.completions.with_raw_response.create(model=MODEL, prompt="The three primary colours are",
                                                            max_tokens=8, temperature=0)
            return r.headers[REPLICA_HEADER], r.parse().choices[0].text

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(complete, range(16)))
        replicas = {rid for rid, _ in answers}
        assert len(replicas) == 2, answers  # Serve spread the requests over both replicas
        assert len({text for _, text in answers}) == 1 and answers[0][1]  # the same greedy answer from each
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}],
                                                     max_tokens=6, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "hi", "temperature": -1})
        assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]  # the API's error shape
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_stopping_replica_closes_its_engines_and_kv_event_publisher():
    """Serve calls a replica's ``__del__`` when it stops: the parts close (the engines, and the publisher's socket,
    whose endpoint is then free to bind again); closing twice is harmless."""
    port = free_port()
    cfg = KVEventsConfig.parse(f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:{port}"}}')
    closed = []

    class Engine:
        def shutdown(self):
            closed.append("engine")

    from pagedllm.server.cli_args import ServerParts

    wrapper = PagedLLMDeployment.func_or_class  # Serve's ingress wrapper awaits its app's shutdown, then calls
    ours = next(c for c in wrapper.__mro__[1:] if "__del__" in c.__dict__)  # the class's own __del__
    assert ours.__name__ == "PagedLLMDeployment"
    replica = object.__new__(wrapper)
    replica.parts = ServerParts(None, MODEL, Engine(), None, KVEventPublisher(cfg, 16))
    ours.__del__(replica)
    assert closed == ["engine"]
    replica.parts.publisher.close()
    again = KVEventPublisher(cfg, 16)  # the port was released
    again.close()
