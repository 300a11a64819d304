"""A/B of the decode-attention kernel inside the engine, two builds in one process (the machine's noise hits both).

``python3 -m tools.scripts.ab_attention A.cpp B.cpp`` builds both sources for ``-march=native``, loads the default engine
(``LLM()``), and times ``generate`` of BS equal prompts (PLEN repeats of one sentence: ~12 tokens each) x N greedy
tokens with the model's fused kernels switched between the two builds, alternating ``ROUNDS`` times. A 1-token run
before each is subtracted, so the step time is the decode's. Each ``decode_attention`` call is timed, so the
attention's share is measured where it runs: between linears that stream the weights, with its KV cold in cache
(a standalone loop keeps a batch's KV hot in L3 and runs ~2x faster). Reports medians and whether both arms gave
the same greedy tokens. Environment: ``BS`` (32), ``N`` (64), ``PLEN`` (14), ``ROUNDS`` (6)."""

import collections
import os
import pathlib
import statistics
import sys
import time

import pagedllm.kernels as K
from tools.scripts.kernel_build import build_source
from pagedllm import LLM, SamplingParams
from pagedllm.layers.ops import FusedOps


class TimedAttention:
    """The build's kernels, with the time of each decode_attention call added to ``spent``."""

    def __init__(self, ops, spent: collections.Counter) -> None:
        self._ops, self._spent = ops, spent

    def __getattr__(self, name: str):
        f = getattr(self._ops, name)
        if name != "decode_attention":
            return f

        def timed(*args):
            t = time.perf_counter()
            out = f(*args)
            self._spent["attention"] += time.perf_counter() - t
            return out
        return timed


def main() -> None:
    llm = LLM(enable_prefix_caching=False)
    model = llm.engine.core.runner.model
    spent = collections.Counter()
    arms = {arm: FusedOps(TimedAttention(build_source(pathlib.Path(src), "native"), spent))
            for arm, src in zip("AB", sys.argv[1:3])}  # the model's ops backend on each build's kernels
    print("CPU:", K.cpu_info()[0])
    bs, n = int(os.environ.get("BS", "32")), int(os.environ.get("N", "64"))
    prompts = ["Write a short story about a robot who learns to paint. " * int(os.environ.get("PLEN", "14"))] * bs
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=n + 1, ignore_eos=True)
    model.ops = arms["A"]
    llm.generate(prompts, full, use_tqdm=False)  # warm-up
    step, attn, tokens = {a: [] for a in arms}, {a: [] for a in arms}, {}
    for r in range(int(os.environ.get("ROUNDS", "6"))):
        for arm in ("A", "B") if r % 2 == 0 else ("B", "A"):
            model.ops = arms[arm]
            spent.clear()
            t = time.perf_counter()
            llm.generate(prompts, one, use_tqdm=False)
            t1, a1 = time.perf_counter() - t, spent["attention"]
            spent.clear()
            t = time.perf_counter()
            out = llm.generate(prompts, full, use_tqdm=False)
            step[arm].append((time.perf_counter() - t - t1) / n * 1e3)
            attn[arm].append((spent["attention"] - a1) / n * 1e3)
            tokens[arm] = [o.outputs[0].token_ids for o in out]
    med = {a: (statistics.median(step[a]), statistics.median(attn[a])) for a in arms}
    for a in arms:
        print(f"{a}: decode step {med[a][0]:.2f} ms, attention {med[a][1]:.2f} ms per step "
              f"(rounds: {' '.join(f'{x:.2f}' for x in attn[a])})")
    print(f"B/A: attention {med['B'][1] / med['A'][1]:.3f}, step {med['B'][0] / med['A'][0]:.3f}, "
          f"same tokens: {tokens['A'] == tokens['B']}")


if __name__ == "__main__":
    main()
