"""Step token budgets compared in one process: W1's prompts through one AsyncLLM, the scheduler's
``max_num_batched_tokens`` switched between runs, arms alternating (this VM's speed drifts by 10-25% within
minutes, so separate processes measure the drift).

    python3 tools/scripts/ab_budget.py 2048,512 [ROUNDS=4] [CONCURRENCY=32]

Per arm, medians over the rounds: output tokens/s, mean time to the first output (an empty text counts: the
engine's view; a client that waits for text sees later ones), mean and p99 gap between outputs. Greedy tokens must
be equal across arms.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import sys
import time

from pagedllm.bench.offline import load_prompts
from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.sampling_params import SamplingParams


async def one(eng: AsyncLLM, prompt: str, params: SamplingParams, sem: asyncio.Semaphore, gaps: list) -> tuple:
    async with sem:
        t0 = time.perf_counter()
        ttft, last, toks = None, None, None
        async for o in eng.generate(prompt, eng.encode_text(prompt), params):
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            else:
                gaps.append(now - last)
            last, toks = now, list(o.outputs[0].token_ids)
        return ttft, toks


async def run(eng: AsyncLLM, prompts: list[str], conc: int) -> tuple[float, float, list[float], list]:
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    sem, gaps = asyncio.Semaphore(conc), []
    t0 = time.perf_counter()
    res = await asyncio.gather(*[one(eng, p, params, sem, gaps) for p in prompts])
    dur = time.perf_counter() - t0
    return len(prompts) * 128 / dur, statistics.mean(r[0] for r in res), sorted(gaps), [r[1] for r in res]


async def main() -> None:
    arms = [int(a) for a in sys.argv[1].split(",")]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    conc = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    eng = AsyncLLM(EngineConfig.from_options(enable_prefix_caching=False))
    sched = eng.engine.core.scheduler
    prompts = load_prompts()[:32]
    rows: dict[int, list] = {a: [] for a in arms}
    tokens: dict[int, list] = {}
    for _ in range(rounds):
        for a in arms:
            sched.config = dataclasses.replace(sched.config, max_num_batched_tokens=a)
            tps, ttft, gaps, toks = await run(eng, prompts, conc)
            rows[a].append((tps, ttft, statistics.mean(gaps), gaps[int(len(gaps) * 0.99)]))
            tokens.setdefault(a, toks)
    eng.shutdown()
    print(f"W1 (32 prompts x 128 tokens), concurrency {conc}, {rounds} rounds, medians (each round in brackets)")
    for a in arms:
        col = list(zip(*rows[a]))
        med = [statistics.median(c) for c in col]
        print(f"budget {a:5d}: {med[0]:6.1f} tok/s [{' '.join(f'{x:.0f}' for x in col[0])}]  mean TTFT "
              f"{med[1]:.2f} s [{' '.join(f'{x:.2f}' for x in col[1])}]  gap mean {med[2] * 1e3:.1f} ms, "
              f"p99 {med[3] * 1e3:.0f} ms")
    print("greedy tokens equal across arms:", all(tokens[a] == tokens[arms[0]] for a in arms))


if __name__ == "__main__":
    asyncio.run(main())
