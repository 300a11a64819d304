"""A/B of kernel builds' ``qlinear_k`` on Qwen2.5-Coder-1.5B's, Gemma 3 270M's and the 0.5B's shapes (random GGUF
blocks of each file's types), in one process.

``python3 -m tools.scripts.ab_qlinear_k OLD_CSRC NEW_CSRC`` (a ``csrc`` directory each, e.g. ``git archive REV
pagedllm/kernels/csrc | tar -x -C /tmp/old`` gives /tmp/old/pagedllm/kernels/csrc; one directory alone times that
build) builds each version for ``-march=native`` and, per shape and row count, times the builds alternately on the
same weights and input (``ROUNDS`` rounds, medians), printing ms and G multiply-adds per second, the ratio of the
first build's time to the second's, and whether the outputs are bitwise equal. Environment: ``L`` activation levels
(1: 8-bit, the default on a file whose 8-bit gate passed; 2: ~15-bit), ``MS`` row counts (default "8 32 128"),
``ONLY`` shape names (qkv o gate_up down4 down6 of the 1.5B; g_gate_up g_down4 g_down6 g_head of Gemma 3 270M;
h_gate_up h_head of the 0.5B), ``ROUNDS`` (5)."""

import os
import pathlib
import statistics
import sys
import time

import torch

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[2] / d) for d in ("tests/kernels", "tests")]
from test_gguf_blocks import random_blocks  # noqa: E402

from pagedllm.quant.gguf_blocks import decode  # noqa: E402
from pagedllm.quant.linear import BlockQuantLinear  # noqa: E402
from pagedllm.worker.heap import keep_freed_memory  # noqa: E402
from tools.scripts.kernel_build import build_source  # noqa: E402

SHAPES = [("qkv", "Q4_K", 2048, 1536), ("o", "Q4_K", 1536, 1536), ("gate_up", "Q4_K", 17920, 1536),
          ("down4", "Q4_K", 1536, 8960), ("down6", "Q6_K", 1536, 8960),
          # Gemma 3 270M's and Qwen2.5-Coder-0.5B's (Q5_0 / Q8_0 run as 8-bit codes; the heads are the tied embeddings)
          ("g_gate_up", "Q5_0", 4096, 640), ("g_down4", "Q4_K", 640, 2048), ("g_down6", "Q6_K", 640, 2048),
          ("g_head", "Q8_0", 262144, 640), ("h_gate_up", "Q5_0", 9728, 896), ("h_head", "Q8_0", 151936, 896)]


def main() -> None:
    torch.set_num_threads(2)
    keep_freed_memory()  # as the engine: freed outputs are reused, not page-faulted in again per call
    mods = [build_source(pathlib.Path(p), "native") for p in sys.argv[1:]]
    levels = int(os.environ.get("L", "1"))
    only = os.environ.get("ONLY", "").split()
    for name, kind, n, k in SHAPES:
        if only and name not in only:
            continue
        lin = BlockQuantLinear(decode(random_blocks(kind, n, k, seed=1), kind), None, torch.device("cpu"),
                               torch.float32, mods[0])
        lin.act_levels = levels
        for m in (int(a) for a in os.environ.get("MS", "8 32 128").split()):
            x = torch.randn(m, k)
            outs, times = [], [[] for _ in mods]
            for mod in mods:
                lin.ops = mod
                outs.append(lin(x))
            for _ in range(int(os.environ.get("ROUNDS", "5"))):
                for i, mod in enumerate(mods):
                    lin.ops = mod
                    reps = max(2, 200 // m)
                    t = time.perf_counter()
                    for _ in range(reps):
                        lin(x)
                    times[i].append((time.perf_counter() - t) / reps)
            med = [statistics.median(t) for t in times]
            cols = "  ".join(f"{t * 1e3:7.3f} ms {m * n * k / t / 1e9:6.1f} G/s" for t in med)
            ratio = f"  ratio {med[0] / med[1]:.3f}" if len(mods) > 1 else ""
            same = all(torch.equal(outs[0], o) for o in outs[1:])
            print(f"{name:8s} {kind} M={m:4d} {cols}{ratio}  same bits: {same}", flush=True)


if __name__ == "__main__":
    main()
