"""A/B of two versions of the kernels' ``qlinear`` in one process (the machine's noise hits both alike).

``python3 scripts/ab_qlinear.py OLD.cpp NEW.cpp`` builds both sources (e.g. ``git show REV:pagedllm/kernels/cpu_ops.cpp
> /tmp/old.cpp``) for ``-march=$MARCH`` (default native), then per SmolLM2-135M linear shape and row count times
the two builds and torch's float32 ``F.linear`` alternately (``ROUNDS`` rounds, medians), on the same random packed
weights (cache-resident: the shapes are 0.3-28 MiB), and checks that both builds give the same bits.
Environment: ``MS`` row counts (default "1 2 3 8 32 512"), ``ROUNDS`` (3), ``NOLM=1`` skips the LM head."""

import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import torch

import pagedllm.kernels as K


def load(src: str, tag: str):
    d = pathlib.Path(tempfile.mkdtemp(prefix=f"abq_{tag}_"))
    shutil.copy(src, d / "cpu_ops.cpp")
    K.SOURCE = d / "cpu_ops.cpp"  # build() names the module by the source's hash
    return K.build(os.environ.get("MARCH", "native"))


def timed(f, reps: int) -> float:
    f()
    t = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t) / reps


def main() -> None:
    old, new = load(sys.argv[1], "old"), load(sys.argv[2], "new")
    print("CPU:", K.cpu_info()[0], "isa:", old.isa(), new.isa())
    shapes = [("qkv", 576, 960, 4), ("o", 576, 576, 4), ("gate_up", 576, 3072, 4), ("down", 1536, 576, 4),
              ("lm_head", 576, 49152, 8)]
    g = torch.Generator().manual_seed(0)
    for name, k, n, bits in shapes:
        if bits == 8 and os.environ.get("NOLM"):
            continue
        ng, nb = (n + 7) // 8, k // 32
        w = torch.randint(0, 256, (ng, nb * bits * 32), dtype=torch.uint8, generator=g)
        d, m = torch.rand(ng, nb * 8, generator=g) * 0.01, torch.randn(ng, nb * 8, generator=g) * 0.01
        dense = torch.randn(n, k)
        for rows in (int(a) for a in os.environ.get("MS", "1 2 3 8 32 512").split()):
            x = torch.randn(rows, k)
            same = torch.equal(old.qlinear(x, w, d, m, bits, n), new.qlinear(x, w, d, m, bits, n))
            macs = rows * k * n
            reps = min(2000, max(1, int(2e8 // macs)))
            times = {"old": [], "new": [], "f32": []}
            for _ in range(int(os.environ.get("ROUNDS", "3"))):
                times["old"].append(timed(lambda: old.qlinear(x, w, d, m, bits, n), reps))
                times["new"].append(timed(lambda: new.qlinear(x, w, d, m, bits, n), reps))
                times["f32"].append(timed(lambda: torch.nn.functional.linear(x, dense), reps))
            t = {key: statistics.median(v) for key, v in times.items()}
            print(f"{name:8s} M={rows:5d} old {t['old'] * 1e6:9.1f} us  new {t['new'] * 1e6:9.1f} us  "
                  f"f32 {t['f32'] * 1e6:9.1f} us  new/old {t['old'] / t['new']:5.2f}x  "
                  f"new {macs / t['new'] / 1e9:6.1f} GMAC/s  f32 {macs / t['f32'] / 1e9:6.1f}  same bits: {same}",
                  flush=True)


if __name__ == "__main__":
    main()
