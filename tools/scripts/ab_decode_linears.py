"""A/B of two kernel builds on a real model's linears in decode order, in one process (the machine's noise hits both).

``python3 -m tools.scripts.ab_decode_linears OLD_CSRC MODEL.gguf [M ...]`` (``git archive REV pagedllm/kernels/csrc |
tar -x -C /tmp/old`` gives OLD_CSRC = /tmp/old/pagedllm/kernels/csrc) loads MODEL as the engine builds it, builds
OLD_CSRC for the installed build's ``-march`` (``native``, or ``PAGEDLLM_CPU_MARCH``: e.g. ``x86-64-v3`` for
the AVX2 path), and per row count M (default 1) runs every packed linear of the model once in
decode order (each layer's, then the LM head; the model's weights are far larger than the caches, so a pass streams
them from memory as a decode step does) with M random activation rows, alternating the installed build and the old
one ``ROUNDS`` times (default 8; medians). Prints, per build and kind of layer (its code width, the head apart), the
time of one pass and the weight bytes read per second; the outputs of both builds must be bitwise equal (every
path keeps a row's arithmetic)."""

from __future__ import annotations

import collections
import os
import pathlib
import statistics
import sys
import time

import torch

import pagedllm.kernels as K
from pagedllm import LLM
from pagedllm.layers.linear import tensor_bytes
from tools.scripts.kernel_build import build_source


def packed_linears(llm: LLM) -> list:
    """A model's packed linears, (name, linear), in decode order (the embedding table apart)."""
    return [(n, lin) for n, lin in llm.engine.runner.model.linears().items() if n != "embed" and hasattr(lin, "codes")]


def alternate(copies: dict, kind: dict, nbytes: dict, rows: list[int], rounds: int) -> None:
    """Per row count M: every linear of each copy (name -> (its (name, linear) pairs in decode order, the kernels it
    runs on)) once on the same M random rows, the copies alternating ``rounds`` times; prints each copy's median pass
    and, per kind of layer (``kind``: linear name -> label), its time and bytes (``nbytes``: copy -> label -> packed
    bytes) per second, and whether every output was bitwise equal across the copies."""
    first = next(iter(copies.values()))[0]
    with torch.inference_mode():
        for m in rows:
            xs = {lin.in_features: torch.randn(m, lin.in_features) for _, lin in first}
            times = {c: collections.defaultdict(list) for c in copies}
            outs = collections.defaultdict(list)
            for r in range(rounds):
                for c, (lins, ops) in copies.items():
                    t = collections.Counter()
                    for n, lin in lins:
                        lin.ops = ops
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


def main() -> None:
    old_src, model = pathlib.Path(sys.argv[1]), sys.argv[2]
    rows = [int(m) for m in sys.argv[3:]] or [1]
    rounds = int(os.environ.get("ROUNDS", "8"))
    llm = LLM(model=model, enable_prefix_caching=False)
    new, old = K.cpu_ops(), build_source(old_src, K.target_march())
    print("CPU:", K.cpu_info()[0], "isa:", new.isa(), "threads:", torch.get_num_threads())
    lins = packed_linears(llm)
    kind = {n: ("head" if n in ("lm_head", "head") else f"{lin.bits}-bit layers") for n, lin in lins}
    nbytes = collections.Counter()
    for n, lin in lins:
        nbytes[kind[n]] += tensor_bytes(lin._tensors())  # the packed weights (as bench roofline's decode bytes)
    alternate({"new": (lins, new), "old": (lins, old)}, kind, {"new": nbytes, "old": nbytes}, rows, rounds)
    for _, lin in lins:
        lin.ops = new

if __name__ == "__main__":
    main()
