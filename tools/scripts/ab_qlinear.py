"""A/B of two versions of the kernels' ``qlinear`` in one process (the machine's noise hits both alike).

``python3 -m tools.scripts.ab_qlinear OLD NEW`` builds both versions of the kernels (each a ``csrc`` directory, e.g.
``git archive REV pagedllm/kernels/csrc | tar -x -C /tmp/old`` gives /tmp/old/pagedllm/kernels/csrc, or a one-file
``cpu_ops.cpp`` of a revision before the split: ``git show REV:pagedllm/kernels/cpu_ops.cpp > /tmp/old.cpp``) for ``-march=$MARCH`` (default native), then per SmolLM2-135M linear shape and row count times
the two builds and torch's float32 ``F.linear`` alternately (``ROUNDS`` rounds, medians), on the same random packed
weights (cache-resident: the shapes are 0.3-28 MiB, unless ``COPIES``), and checks that both builds give the same
bits. Environment: ``MS`` row counts (default "1 2 3 8 32 512"), ``ROUNDS`` (3), ``NOLM=1`` skips the LM head,
``COPIES=N`` cycles each call through N copies of the weights (from memory, as a model's 30 layers stream them),
``HALF=1`` gives the new build float16 scales and offsets (none for 8-bit codes; the old build the same values in
float32, zero offsets), as BlockQuantLinear stores a GGUF file's. ``FORWARD=1`` times instead one decode step's
121 linears (30 layers' own weights and the LM head, from memory) per round, ``ROUNDS`` (15) rounds alternating."""

import os
import pathlib
import statistics
import sys
import time

import torch

import pagedllm.kernels as K
from tools.scripts.kernel_build import build_source


def load(src: str):
    return build_source(pathlib.Path(src), os.environ.get("MARCH", "native"))


def timed(f, reps: int) -> float:
    f()
    t = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t) / reps


SHAPES = [("qkv", 576, 960, 4), ("o", 576, 576, 4), ("gate_up", 576, 3072, 4), ("down", 1536, 576, 4),
          ("lm_head", 576, 49152, 8)]


def packed(k: int, n: int, bits: int, half: bool, g: torch.Generator):
    """Random packed weights: codes, then (scales, offsets) for the old build and for the new one."""
    ng, nb = (n + 7) // 8, k // 32
    w = torch.randint(0, 256, (ng, nb * bits * 32), dtype=torch.uint8, generator=g)
    d = (torch.rand(ng, nb * 8, generator=g) * 0.01).half().float()
    m = (torch.randn(ng, nb * 8, generator=g) * 0.01).half().float() * (bits == 4 or not half)
    if not half:
        return w, (d, m), (d, m)
    return w, (d, m), (d.half(), m.half() if bits == 4 else m.new_empty(0, dtype=torch.half))


def forward(old, new, g: torch.Generator) -> None:
    """FORWARD=1: one decode step's linears (30 layers' own weights and the LM head, ~100 MiB: from memory)."""
    half = bool(os.environ.get("HALF"))
    layers = [(k, n, bits, packed(k, n, bits, half, g)) for _ in range(30) for _, k, n, bits in SHAPES[:4]]
    layers.append((576, 49152, 8, packed(576, 49152, 8, half, g)))
    nbytes = {arm: sum(t.numel() * t.element_size() for *_, (w, *sc) in layers for t in (w, *sc[i]))
              for i, arm in enumerate(("old", "new"))}
    print("weight MiB per pass: old %.1f, new %.1f" % (nbytes["old"] / 2**20, nbytes["new"] / 2**20))
    for rows in (int(a) for a in os.environ.get("MS", "1 2 8").split()):
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}

        def run(mod, i):
            return [mod.qlinear(xs[k], w, *sc[i], bits, n) for k, n, bits, (w, *sc) in layers]

        same = all(torch.equal(a, b) for a, b in zip(run(old, 0), run(new, 1)))
        times = {"old": [], "new": []}
        for _ in range(int(os.environ.get("ROUNDS", "15"))):
            for i, (arm, mod) in enumerate((("old", old), ("new", new))):
                t = time.perf_counter()
                run(mod, i)
                times[arm].append(time.perf_counter() - t)
        t = {arm: statistics.median(v) for arm, v in times.items()}
        print(f"forward M={rows:4d} old {t['old'] * 1e3:7.2f} ms ({nbytes['old'] / t['old'] / 1e9:5.1f} GB/s)  "
              f"new {t['new'] * 1e3:7.2f} ms ({nbytes['new'] / t['new'] / 1e9:5.1f} GB/s)  "
              f"new/old {t['old'] / t['new']:5.2f}x  same bits: {same}", flush=True)


def main() -> None:
    old, new = load(sys.argv[1]), load(sys.argv[2])
    print("CPU:", K.cpu_info()[0], "isa:", old.isa(), new.isa())
    g = torch.Generator().manual_seed(0)
    if os.environ.get("FORWARD"):
        return forward(old, new, g)
    half = bool(os.environ.get("HALF"))
    for name, k, n, bits in SHAPES:
        if bits == 8 and os.environ.get("NOLM"):
            continue
        copies = int(os.environ.get("COPIES", "1"))
        w, d, m, dn, mn = [], [], [], [], []
        for _ in range(copies):
            wi, (di, mi), (dni, mni) = packed(k, n, bits, half, g)
            w.append(wi), d.append(di), m.append(mi), dn.append(dni), mn.append(mni)
        turn = {"old": 0, "new": 0}

        def call(arm: str, x: torch.Tensor) -> torch.Tensor:
            i = turn[arm] = (turn[arm] + 1) % copies
            if arm == "old":
                return old.qlinear(x, w[i], d[i], m[i], bits, n)
            return new.qlinear(x, w[i], dn[i], mn[i], bits, n)

        dense = torch.randn(n, k)
        for rows in (int(a) for a in os.environ.get("MS", "1 2 3 8 32 512").split()):
            x = torch.randn(rows, k)
            same = all(torch.equal(call("old", x), call("new", x)) for _ in range(copies))
            macs = rows * k * n
            reps = min(2000, max(1, int(2e8 // macs)))
            times = {"old": [], "new": [], "f32": []}
            for _ in range(int(os.environ.get("ROUNDS", "3"))):
                times["old"].append(timed(lambda: call("old", x), reps))
                times["new"].append(timed(lambda: call("new", x), reps))
                times["f32"].append(timed(lambda: torch.nn.functional.linear(x, dense), reps))
            t = {key: statistics.median(v) for key, v in times.items()}
            print(f"{name:8s} M={rows:5d} old {t['old'] * 1e6:9.1f} us  new {t['new'] * 1e6:9.1f} us  "
                  f"f32 {t['f32'] * 1e6:9.1f} us  new/old {t['old'] / t['new']:5.2f}x  "
                  f"new {macs / t['new'] / 1e9:6.1f} GMAC/s  f32 {macs / t['f32'] / 1e9:6.1f}  same bits: {same}",
                  flush=True)


if __name__ == "__main__":
    main()
