"""A/B of whole servers (two or more source trees) on the shipped W1 prompts, one server resident at a time.

``python3 scripts/ab_serve.py MODEL CONCURRENCY ROUNDS TREE [TREE ...]`` (a TREE is a checkout, e.g. ``git worktree
add /tmp/old HEAD~1``): per round, each tree's server is started in turn (``PYTHONPATH=TREE``, prefix caching off),
driven twice with the 32 prompts x 64 greedy tokens at CONCURRENCY (the `bench compare` client), and stopped. Prints
each run's output tok/s and, per tree, the median over all its runs. Alternating the trees round by round keeps a
drifting VM from favouring one of them."""

import asyncio
import os
import statistics
import subprocess
import sys

from pagedllm.bench.compare import _free_port, load_args, stop, wait_healthy
from pagedllm.bench.offline import load_prompts
from pagedllm.bench.serve import BenchRequest, run_load

PROMPTS = os.path.join(os.path.dirname(__file__), "..", "pagedllm", "bench", "data", "prompts.jsonl")


def main() -> None:
    model, concurrency, rounds, trees = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    reqs = [BenchRequest(prompt=p, output_len=64) for p in load_prompts(PROMPTS)[:32]]
    res: dict[str, list[float]] = {t: [] for t in trees}
    for r in range(rounds):
        for tree in trees:
            port, log_path = _free_port(), f"/tmp/ab_serve_{os.path.basename(os.path.abspath(tree))}.log"
            with open(log_path, "w") as log:
                proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", "--port",
                                         str(port), "--model", model, "--no-enable-prefix-caching"],
                                        stdout=log, stderr=subprocess.STDOUT, cwd=tree,
                                        env=dict(os.environ, PYTHONPATH=os.path.abspath(tree)))
                base = f"http://127.0.0.1:{port}"
                try:
                    wait_healthy(proc, base, log_path)
                    for _ in range(2):
                        out = asyncio.run(run_load(load_args(base, concurrency), reqs, show_progress=False))
                        res[tree].append(round(out["output_throughput"], 1))
                finally:
                    stop(proc, 60)
            print(r, tree, res[tree][-2:], flush=True)
    for tree in trees:
        print(tree, res[tree], "median", statistics.median(res[tree]))


if __name__ == "__main__":
    main()
