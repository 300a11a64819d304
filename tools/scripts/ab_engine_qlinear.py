"""A/B of the engine's greedy generation with two kernel builds in one process (the machine's noise hits both).

``python3 -m tools.scripts.ab_engine_qlinear OLD_CSRC MODEL.gguf [C ...]`` (``git archive REV pagedllm/kernels/csrc |
tar -x -C /tmp/old`` gives OLD_CSRC = /tmp/old/pagedllm/kernels/csrc) loads MODEL with the defaults (no prefix
caching) and, per concurrency C (default 8 32), generates 64 greedy tokens (EOS ignored) for each of the 32 W1
prompts of ``bench compare`` with at most C sequences a step, the packed linears switched between the installed
build and OLD_CSRC built for ``-march=native``, alternating ``ROUNDS`` times (default 3). Prints each build's
tokens/s per round and the ratio of the medians; the greedy tokens of both must be equal (every path keeps a row's
arithmetic). Only the block kernels (``qlinear``, ``qlinear_k``) differ between the arms; attention and the rest
run the installed build."""

from __future__ import annotations

import os
import pathlib
import statistics
import sys
import time

import pagedllm.kernels as K
from pagedllm import LLM, SamplingParams
from pagedllm.bench.offline import load_prompts
from tools.scripts.kernel_build import build_source

OUTPUT_LEN = 64


def main() -> None:
    old_src, model = sys.argv[1], sys.argv[2]
    cs = [int(a) for a in sys.argv[3:]] or [8, 32]
    rounds = int(os.environ.get("ROUNDS", "3"))
    old = build_source(pathlib.Path(old_src), "native")
    print("CPU:", K.cpu_info()[0], flush=True)
    prompts = load_prompts()[:32]
    sp = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    for c in cs:
        llm = LLM(model=model, enable_prefix_caching=False, max_num_seqs=c)
        lins = [lin for lin in llm.engine.runner.model.linears().values() if hasattr(lin, "codes")]
        arms = {"new": lins[0].ops, "old": old}
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm up
        rates: dict[str, list[float]] = {"new": [], "old": []}
        tokens = {}
        for r in range(rounds):
            for arm in ("new", "old") if r % 2 == 0 else ("old", "new"):
                for lin in lins:
                    lin.ops = arms[arm]
                t = time.perf_counter()
                out = llm.generate(prompts, sp, use_tqdm=False)
                rates[arm].append(len(prompts) * OUTPUT_LEN / (time.perf_counter() - t))
                tokens[arm] = [o.outputs[0].token_ids for o in out]
        med = {arm: statistics.median(v) for arm, v in rates.items()}
        print(f"C={c}: new {' / '.join(f'{x:.1f}' for x in rates['new'])} tok/s, old "
              f"{' / '.join(f'{x:.1f}' for x in rates['old'])}; medians new/old {med['new'] / med['old']:.3f}; "
              f"same tokens: {tokens['new'] == tokens['old']}", flush=True)
        del llm


if __name__ == "__main__":
    main()
