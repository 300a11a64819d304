"""A/B of whole servers (two or more source trees) on the shipped W1 prompts, one server resident at a time.

``python3 tools/scripts/ab_serve.py MODEL CONCURRENCY ROUNDS TREE [TREE ...]`` (a TREE is a checkout, e.g. ``git worktree
add /tmp/old HEAD~1``): per round, each tree's server is started in turn (`bench compare`'s peer start-up, the
command run inside the tree with ``PYTHONPATH=TREE``: ``python -m`` puts its working directory first on the path, so
from the repository's root every tree would be the root's code), driven twice with the 32 prompts x 64 greedy
tokens at CONCURRENCY (the `bench compare` client), and stopped. Prints each run's output tok/s and, per tree, the
median over all its runs. Alternating the trees round by round keeps a drifting VM from favouring one of them."""

import asyncio
import os
import statistics
import sys

from pagedllm.bench.compare import load_args, started_peer
from pagedllm.bench.offline import load_prompts
from pagedllm.bench.serve import BenchRequest, run_load

PROMPTS = os.path.join(os.path.dirname(__file__), "..", "..", "pagedllm", "bench", "data", "prompts.jsonl")


def main() -> None:
    model, concurrency, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    trees = [os.path.abspath(t) for t in sys.argv[4:]]
    reqs = [BenchRequest(prompt=p, output_len=64) for p in load_prompts(PROMPTS)[:32]]
    res: dict[str, list[float]] = {t: [] for t in trees}
    for r in range(rounds):
        for tree in trees:
            cmd = (f"env -C {tree} PYTHONPATH={tree} {sys.executable} -m pagedllm.entrypoints.openai.api_server "
                   f"--port {{port}} --model {model} --no-enable-prefix-caching")
            log_path = f"/tmp/ab_serve_{os.path.basename(tree)}.log"
            with started_peer(tree, cmd, log_path) as (_, url, _, _):
                for _ in range(2):
                    out = asyncio.run(run_load(load_args(url, concurrency), reqs, show_progress=False))
                    res[tree].append(round(out["output_throughput"], 1))
            print(r, tree, res[tree][-2:], flush=True)
    for tree in trees:
        print(tree, res[tree], "median", statistics.median(res[tree]))


if __name__ == "__main__":
    main()
