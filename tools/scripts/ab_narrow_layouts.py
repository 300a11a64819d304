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
import sys

import pagedllm.quant.linear as ql
from pagedllm import LLM
from pagedllm.layers.linear import tensor_bytes
from tools.scripts.ab_decode_linears import alternate, packed_linears
from tools.scripts.kernel_build import build_source


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
    copies = {"narrow": packed_linears(narrow), "8-bit": packed_linears(eight)}
    ops = copies["narrow"][0][1].ops
    if os.environ.get("LEVEL"):
        ops = build_source(pathlib.Path(ql.__file__).parents[1] / "kernels" / "csrc", os.environ["LEVEL"])
    kind = {n: ("head" if n in ("lm_head", "head") else f"{lin.layout_bits}-bit") for n, lin in copies["narrow"]}
    nbytes = {c: collections.Counter() for c in copies}
    for c, lins in copies.items():
        for n, lin in lins:
            nbytes[c][kind[n]] += tensor_bytes(lin._tensors())
    print("isa:", ops.isa(), " packed MB:",
          {c: {k: round(v / 1e6) for k, v in sorted(b.items())} for c, b in nbytes.items()})
    alternate({c: (lins, ops) for c, lins in copies.items()}, kind, nbytes, rows, rounds)

if __name__ == "__main__":
    main()
