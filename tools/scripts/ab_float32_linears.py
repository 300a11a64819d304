"""A/B of the float32 path's linears: the kernels' ``dense_linear`` (dense.cpp) against torch's ``F.linear``
(MKL), in one process on the embedded model (or MODEL), the two swapped per round.

``python3 -m tools.scripts.ab_float32_linears [MODEL] [ROUNDS]`` prints, per path, the medians of: one prompt's 128
greedy tokens (decode of one sequence), a fresh ~1000-token prompt's prefill (1 token out; fresh, so the prefix
cache does not answer it) and 8 prompts x 64 tokens."""

from __future__ import annotations

import itertools
import statistics
import sys
import time

from pagedllm import LLM, SamplingParams
from pagedllm.layers.linear import DenseLinear

LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 100)


def measure(llm: LLM, fresh) -> tuple[float, float, float, int]:
    """(decode tok/s of one sequence, prefill tok/s of a ~1000-token prompt, tok/s of 8 sequences, prompt tokens)."""
    t = time.perf_counter()
    llm.generate(f"{next(fresh)} The capital of France is", SamplingParams(temperature=0.0, max_tokens=128,
                                                                          ignore_eos=True), use_tqdm=False)
    decode = 128 / (time.perf_counter() - t)
    t = time.perf_counter()
    out = llm.generate(f"{next(fresh)} {LONG}", SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0]
    prefill = len(out.prompt_token_ids) / (time.perf_counter() - t)
    t = time.perf_counter()
    llm.generate([f"{next(fresh)} Once upon a time {i}" for i in range(8)],
                 SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    return decode, prefill, 8 * 64 / (time.perf_counter() - t), len(out.prompt_token_ids)


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else None
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    llm = LLM(model=model, dtype="float32") if model else LLM(dtype="float32")
    lins = [lin for lin in llm.engine.runner.model.linears().values() if isinstance(lin, DenseLinear)]
    kernels = next((lin.kernels for lin in lins if lin.kernels is not None), None)
    if kernels is None:
        sys.exit("no float32 linear runs dense_linear here (kernels off, or not a float32 CPU run)")
    fresh = itertools.count()
    measure(llm, fresh)  # warm-up
    paths = {"dense_linear": kernels, "F.linear (MKL)": None}
    res: dict[str, list] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, k in paths.items():
            for lin in lins:
                lin.kernels = k
            res[name].append(measure(llm, fresh))
    print(f"{len(lins)} float32 linears; isa {kernels.isa()}")
    for name, v in res.items():
        med = [statistics.median(x[i] for x in v) for i in range(3)]
        print(f"{name}: decode 1 sequence {med[0]:.1f} tok/s, prefill {v[0][3]} tokens {med[1]:.0f} tok/s, "
              f"8 sequences {med[2]:.1f} tok/s")


if __name__ == "__main__":
    main()
