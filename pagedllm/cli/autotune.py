"""`pagedllm autotune [--model FILE] [--remeasure]`: the weight plan that ``--dtype auto`` uses for a GGUF model on
this CPU (``worker/autotune.py``): shows the cached measurement, or measures it (again, with ``--remeasure``) and
caches it. Each point's timings are checked for consistency before anything is cached; a curve that stays
inconsistent (a busy machine) gives the arithmetic's plan (packed blocks at every size) instead of a measured one.
"""

from __future__ import annotations

import argparse
import json

from pagedllm.config import default_model_path
from pagedllm.kernels import cpu_ops, kernel_path
from pagedllm.model.loader import load_model_files
from pagedllm.worker.autotune import _cache_path, blocks_for_autotune, choose_plan, plan_summary


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file (default: the embedded model)")
    p.add_argument("--remeasure", action="store_true", help="measure again even where a plan is cached")
    p.add_argument("--json", action="store_true", help="print the plan and its timings as JSON")


def main(args: argparse.Namespace) -> int:
    path = args.model or default_model_path()
    if not path.endswith(".gguf"):
        raise ValueError(f"{path}: the weight plan is measured for GGUF files of 4/8-bit blocks")
    ops = cpu_ops()
    if ops is None:
        raise ValueError("the fused CPU kernels are unavailable here: --dtype auto runs torch operations")
    arch, weights = load_model_files(path, native=True)
    if not blocks_for_autotune(weights, arch.num_layers):
        raise ValueError(f"{path}: not every linear is a block type the kernel runs; no plan to measure")
    plan = choose_plan(weights, arch.num_layers, ops, remeasure=args.remeasure, measure_here=True)
    if args.json:
        print(json.dumps(plan_summary(plan), indent=1))
        return 0
    print(f"model   {path}\nkernels {kernel_path()}\ncache   {_cache_path()}\nplan    ({plan.source}) "
          f"{plan.describe()}")
    for group in ("layers", "head"):
        per = plan.timings_ms.get(group, {})
        if not per:
            continue
        sizes = sorted(next(iter(per.values())))
        print(f"\n{group} (ms per forward) " + "".join(f"{m:>10}" for m in sizes))
        for cand, t in per.items():
            print(f"{cand:>24} " + "".join(f"{t[m]:>10.2f}" for m in sizes))
    return 0
