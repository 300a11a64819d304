"""A/B in one process: GGUF K-quant layers with the file's two-level scales (qlinear_k) against float32 scales per
block (qlinear), at 1, 8 and 32 rows. Run: python tools/scripts/ab_kscales.py"""
import dataclasses
import time
import sys
import torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_gguf_blocks import random_blocks
from pagedllm.quant.gguf_blocks import decode
from pagedllm.kernels import cpu_ops
from pagedllm.quant.linear import BlockQuantLinear
torch.set_num_threads(2)
ops = cpu_ops()
for kind, n, k in [("Q4_K", 8960, 1536), ("Q4_K", 1536, 8960), ("Q6_K", 1536, 8960)]:
    raw = random_blocks(kind, n, k, seed=1)
    qw = decode(raw, kind)
    a = BlockQuantLinear(qw, None, torch.device("cpu"), torch.float32, ops)
    b = BlockQuantLinear(dataclasses.replace(qw, kscales=None), None, torch.device("cpu"), torch.float32, ops)
    for m in (1, 8, 32):
        x = torch.randn(m, k)
        res = {}
        for rnd in range(3):
            for name, lin in (("K", a), ("flat", b)):
                lin(x)
                t, r = time.perf_counter(), 20 if m < 32 else 6
                for _ in range(r):
                    lin(x)
                dt = (time.perf_counter() - t) / r
                res[name] = min(res.get(name, 1e9), dt)
        print(kind, n, k, m, "K %.3f ms  flat %.3f ms  ratio %.2f" % (res["K"]*1e3, res["flat"]*1e3, res["K"]/res["flat"]), flush=True)
