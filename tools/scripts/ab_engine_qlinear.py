"""A/B of the engine's greedy decode with two ``qlinear`` builds in one process (the machine's noise hits both).

``python3 -m tools.scripts.ab_engine_qlinear OLD.cpp`` (``git show 6c629e0:pagedllm/kernels/cpu_ops.cpp >
/tmp/old.cpp``, the last source with float32 block scales only) loads the default engine (``LLM()``: the GGUF
blocks through ``qlinear``), builds OLD.cpp for ``-march=native``, and times ``generate`` of BS prompts x 64 tokens
with the layers' kernel and scales switched between the current build (the layer's own float16 scales, no Q8_0
offsets) and the old one (the same values as float32, zero offsets), alternating ``ROUNDS`` times (medians); the
greedy tokens of both must be equal. Environment: ``BS`` batch sizes (default "1 8 32"), ``ROUNDS`` (6)."""

import os
import pathlib
import statistics
import sys
import time

import torch

import pagedllm.kernels as K
from tools.scripts.kernel_build import build_source
from pagedllm import LLM, SamplingParams


def main() -> None:
    llm = LLM(enable_prefix_caching=False)
    new = K.cpu_ops()
    old = build_source(pathlib.Path(sys.argv[1]), "native")
    print("CPU:", K.cpu_info()[0], "isa:", new.isa())
    lins = [lin for lin in llm.engine.core.runner.model.linears().values() if hasattr(lin, "offsets")]
    own = {id(lin): (lin.scales, lin.offsets) for lin in lins}

    def use(arm: str) -> None:
        for lin in lins:
            s, o = own[id(lin)]
            if arm == "new":
                lin.ops, lin.scales, lin.offsets = new, s, o
            else:
                lin.ops, lin.scales = old, s.float()
                lin.offsets = o.float() if o.numel() else torch.zeros_like(s, dtype=torch.float32)

    prompts = ["Write a short story about a robot who learns to paint. " * 3] * 32
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for bs in (int(a) for a in os.environ.get("BS", "1 8 32").split()):
        times, tokens = {"old": [], "new": []}, {}
        for r in range(int(os.environ.get("ROUNDS", "6"))):
            for arm in ("old", "new") if r % 2 == 0 else ("new", "old"):
                use(arm)
                t = time.perf_counter()
                out = llm.generate(prompts[:bs], sp, use_tqdm=False)
                times[arm].append(time.perf_counter() - t)
                tokens[arm] = [o.outputs[0].token_ids for o in out]
        m = {arm: statistics.median(v) for arm, v in times.items()}
        print(f"batch {bs:3d}: old {bs * 64 / m['old']:6.1f} tok/s  new {bs * 64 / m['new']:6.1f} tok/s  "
              f"new/old {m['old'] / m['new']:5.2f}x  same tokens: {tokens['old'] == tokens['new']}", flush=True)


if __name__ == "__main__":
    main()
