"""A/B of the narrow code layouts (5- and 6-bit, ``quant/linear.py`` ``_narrow_bits``) against the 8-bit one, in one
process (the machine's noise hits both).

``python3 -m tools.scripts.ab_narrow_layouts MODEL.gguf [M ...]`` loads MODEL twice as the engine builds it, once
with every layout forced to 8 bits, and per row count M (default 1) runs every packed linear of each copy once in
decode order with M random activation rows, alternating the two copies ``ROUNDS`` times (default 8; medians).
Prints, per copy and kind of layer (its layout's code width, the head apart), the time of one pass and the packed
bytes read per second; the outputs of both copies must be bitwise equal (the layouts give the same integer sums).
``LEVEL=x86-64-v3`` runs both copies on that instruction-set level's build of the kernels instead."""

from __future__ import annotations

import collections
import os
import pathlib
import statistics
import sys
import time

import torch

import pagedllm.quant.linear as ql
from pagedllm import LLM
from pagedllm.layers.linear import tensor_bytes
from tools.scripts.kernel_build import build_source


def _linears(llm: LLM) -> list:
    return [(n, lin) for n, lin in llm.engine.runner.model.linears().items() if n != "embed" and hasattr(lin, "codes")]


def main() -> None:
    model, rows = sys.argv[1], [int(m) for m in sys.argv[2:]] or [1]
    rounds = int(os.environ.get("ROUNDS", "8"))
    narrow = LLM(model=model, enable_prefix_caching=False)
    fits = ql._narrow_bits
    ql._narrow_bits = lambda part: 8
    try:
        eight = LLM(model=model, enable_prefix_caching=False)
    finally:
        ql._narrow_bits = fits
    copies = {"narrow": _linears(narrow), "8-bit": _linears(eight)}
    if os.environ.get("LEVEL"):
        ops = build_source(pathlib.Path(ql.__file__).parents[1] / "kernels" / "csrc", os.environ["LEVEL"])
        for lins in copies.values():
            for _, lin in lins:
                lin.ops = ops
    kind = {n: ("head" if n in ("lm_head", "head") else f"{lin.layout_bits}-bit") for n, lin in copies["narrow"]}
    nbytes = {c: collections.Counter() for c in copies}
    for c, lins in copies.items():
        for n, lin in lins:
            nbytes[c][kind[n]] += tensor_bytes(lin._tensors())
    print("isa:", copies["narrow"][0][1].ops.isa(), " packed MB:",
          {c: {k: round(v / 1e6) for k, v in sorted(b.items())} for c, b in nbytes.items()})
    with torch.inference_mode():
        for m in rows:
            xs = {lin.in_features: torch.randn(m, lin.in_features) for _, lin in copies["narrow"]}
            times = {c: collections.defaultdict(list) for c in copies}
            outs = collections.defaultdict(list)
            for r in range(rounds):
                for c, lins in copies.items():
                    t = collections.Counter()
                    for n, lin in lins:
                        t0 = time.perf_counter()
                        y = lin(xs[lin.in_features])
                        t[kind[n]] += time.perf_counter() - t0
                        if r == 0:
                            outs[n].append(y)
                    for k, v in t.items():
                        times[c][k].append(v)
            for c in copies:
                med = {k: statistics.median(v) for k, v in times[c].items()}
                parts = "  ".join(f"{k} {t * 1e3:.2f} ms ({nbytes[c][k] / t / 1e9:.1f} GB/s)"
                                  for k, t in sorted(med.items()))
                print(f"M={m} {c}: pass {sum(med.values()) * 1e3:.2f} ms   {parts}")
            print(f"M={m} outputs bitwise equal: {all(torch.equal(a, b) for a, b in outs.values())}", flush=True)


if __name__ == "__main__":
    main()
