"""`pagedllm bench roofline`: this machine's matmul throughput and memory bandwidth, and the engine's decode
throughput as a fraction of them (model FLOPs utilisation at several batch sizes, bandwidth use at batch 1)."""

from __future__ import annotations

import argparse
import time

import torch

from pagedllm.bench.common import add_dtype_arg, add_model_arg, add_result_json_arg, write_json
from pagedllm.bench.cpuinfo import cpu_info, cpu_line
from pagedllm.config import KV_CACHE_DTYPE_CHOICES
from pagedllm.engine.llm import LLM
from pagedllm.kernels import cpu_ops
from pagedllm.layers.linear import DenseLinear, tensor_bytes
from pagedllm.quant.formats import float16_blocks, quantize_rtn
from pagedllm.quant.linear import BlockQuantLinear
from pagedllm.sampling_params import SamplingParams


def _time(fn, min_time: float = 0.3, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        el = time.perf_counter() - start
        if el >= min_time:
            return el / n


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype) -> float:
    a = torch.randn(m, k, dtype=dtype)
    b = torch.randn(n, k, dtype=dtype)
    t = _time(lambda: torch.nn.functional.linear(a, b))
    return 2 * m * k * n / t / 1e9


def model_shapes(arch) -> list[tuple[int, int, int]]:
    """(in, out, count) of every linear layer in one decode step."""
    h, i = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return [(h, q + 2 * kv, arch.num_layers), (q, h, arch.num_layers), (h, 2 * i, arch.num_layers),
            (i, h, arch.num_layers), (h, arch.vocab_size, 1)]


def model_linear_gflops(arch, batch: int, dtype: torch.dtype) -> float:
    """Throughput of the model's own linear shapes at this batch size (one of each shape, weighted by count),
    each through the faster of torch's plain linear and what the engine runs (the pre-packed oneDNN
    layout; float32: the kernels' dense_linear)."""

    total_flops = total_time = 0.0
    for k, n, count in model_shapes(arch):
        a = torch.randn(batch, k, dtype=dtype)
        w = torch.randn(n, k, dtype=dtype)
        t = _time(lambda: torch.nn.functional.linear(a, w), min_time=0.15)
        packed = DenseLinear(w).prepack(keep_weight=False)
        if packed.packed is not None or packed.kernels is not None:  # oneDNN's layout, or float32's dense_linear
            t = min(t, _time(lambda: packed(a), min_time=0.15))
        total_flops += 2 * batch * k * n * count
        total_time += t * count
    return total_flops / total_time / 1e9


def block_kernel_rows(arch, batches=(1, 8, 32)) -> list[dict]:
    """The qlinear block kernel on the model's linear shapes with 4-bit blocks (random weights): time, weight bytes
    streamed per second, and multiply-adds per second, per shape and batch size."""

    ops = cpu_ops()
    if ops is None:
        return []
    rows = []
    for k, n, count in model_shapes(arch):
        qw = float16_blocks(quantize_rtn(torch.randn(n, k), 4, 32, False))  # GGUF Q4_1's float16 d and m
        lin = BlockQuantLinear(qw, None, torch.device("cpu"), torch.float32, ops)
        nbytes = tensor_bytes(lin._tensors())
        for b in batches:
            x = torch.randn(b, k)
            t = _time(lambda: lin(x), min_time=0.15)
            rows.append({"in": k, "out": n, "count": count, "batch": b, "us": t * 1e6, "weight_gbs": nbytes / t / 1e9,
                         "gmacs": b * k * n / t / 1e9})
    return rows


def layer_linear_rows(model, dtype: torch.dtype, rows=(1, 2, 4, 8, 16, 32, 128, 512, 2048)) -> dict[int, float]:
    """Milliseconds of one forward's decoder-layer linears at each row count, each linear as the engine built it
    (so each row count runs the path the engine runs there: the block kernels, bfloat16 tiles or stripes, a dense
    copy): the simulator's GEMM curve up to prefill-sized steps. The few-row points matter: a kernel's 4-row step
    costs ~0.8 of its 8-row one, not half (its row tiles), which a curve starting at 8 rows priced as half."""
    lins = [lin for name, lin in model.linears().items() if name.startswith("layers.")]
    out = {}
    for m in rows:
        xs = {}
        for lin in lins:
            if lin.in_features not in xs:
                xs[lin.in_features] = torch.randn(m, lin.in_features, dtype=dtype)

        def forward():
            for lin in lins:
                lin(xs[lin.in_features])

        with torch.inference_mode():  # as the engine's forward runs
            out[m] = _time(forward, min_time=0.2, warmup=1) * 1e3
    return out


def decode_read_bytes(model) -> int:
    """Weight bytes one single-row decode step reads: packed weights where a layer has them (not its dense copy
    for large steps), and the LM head (a tied embedding only through it)."""

    tensors = [model.norm]
    for name, lin in model.linears().items():
        if name == "embed":
            continue  # lookups read a few rows; a tied table is counted as the LM head
        tensors += lin._tensors() if hasattr(lin, "_tensors") else lin.tensors()
    return tensor_bytes(tensors)


def bandwidth_gbs(nbytes: int = 1 << 29) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    t = _time(lambda: dst.copy_(src), min_time=0.5)
    return 2 * nbytes / t / 1e9


def flops_per_token(arch, context: int) -> float:
    lin = sum(2 * k * n * c for k, n, c in model_shapes(arch))
    attn = 4 * context * arch.num_heads * arch.head_dim * arch.num_layers
    return lin + attn


DECODE_STEPS = 24  # timed decode steps of engine_decode (after 2 warm-up steps; each request asks 8 more tokens)


def engine_decode(llm, batch: int, prompt_len: int = 64, steps: int = DECODE_STEPS) -> tuple[float, float]:
    """Seconds per decode step with `batch` running requests; returns (step time, mean context)."""

    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        eng.add_tokenized_request(f"roof-{batch}-{i}", None, [(7 * i + j) % 1000 + 100 for j in range(prompt_len)], sp)
    prefilling = {f"roof-{batch}-{i}" for i in range(batch)}
    while prefilling:  # a request's first token ends its prefill
        prefilling -= {o.request_id for o in eng.step() if o.outputs[0].token_ids}
    for _ in range(2):
        eng.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    dt = (time.perf_counter() - t0) / steps
    ctx = prompt_len + 2 + steps / 2
    for i in range(batch):
        eng.abort_request(f"roof-{batch}-{i}")
    return dt, ctx


def main(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    res: dict = {"threads": torch.get_num_threads(), "cpu": cpu_info(), "model": args.model}
    print(f"CPU: {cpu_line(res['cpu'])}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    res["bandwidth_gbs"] = bandwidth_gbs()
    print(f"memory bandwidth (copy): {res['bandwidth_gbs']:.1f} GB/s")
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        res[f"peak_gflops_{name}"] = matmul_gflops(2048, 2048, 2048, dt)
        print(f"matmul 2048^3 {name}: {res[f'peak_gflops_{name}']:.0f} GFLOP/s")

    llm = LLM(args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype)
    runner = llm.engine.runner
    arch, dtype = runner.arch, runner.dtype
    res["runtime"] = runner.describe()
    blocks = block_kernel_rows(arch)
    if blocks:
        res["block_kernel"] = blocks
        print(f"\nqlinear block kernel (4-bit blocks, {runner.kernel_path}) on the model's shapes:")
        print(f"{'in':>6} {'out':>6} {'batch':>5} {'us':>8} {'weight GB/s':>12} {'% of copy bw':>13} {'GMAC/s':>8}")
        for r in blocks:
            print(f"{r['in']:6d} {r['out']:6d} {r['batch']:5d} {r['us']:8.1f} {r['weight_gbs']:12.1f} "
                  f"{100 * r['weight_gbs'] / res['bandwidth_gbs']:12.1f}% {r['gmacs']:8.1f}")
    res["layer_linears_ms"] = layer_linear_rows(runner.model, dtype)
    print("\nthe decoder layers' linears as the engine built them, one forward (ms by rows): " + ", ".join(
        f"{m}: {ms:.2f}" for m, ms in res["layer_linears_ms"].items()))
    weight_bytes = decode_read_bytes(runner.model)
    res["dtype"] = str(dtype).replace("torch.", "")
    lens = args.prompt_len
    res["prompt_len"] = lens[0]
    res["rows"] = []
    block_size = llm.engine.config.cache.block_size
    print(f"\nengine: {res['runtime']['weights']}, dtype {res['dtype']}, KV cache {res['runtime']['kv_cache_dtype']}; "
          f"{weight_bytes / 2**20:.0f} MiB of weights read per single-row step "
          f"({runner.model.weight_bytes() / 2**20:.0f} MiB held); prompts of {', '.join(map(str, lens))} tokens")
    print(f"{'prompt':>6} {'batch':>5} {'step ms':>8} {'tok/s':>8} {'GFLOP/s':>8} {'model-shape ceiling':>20} "
          f"{'MFU vs ceiling':>15} {'MFU vs peak':>12}")
    peak = res[f"peak_gflops_{res['dtype']}"] if f"peak_gflops_{res['dtype']}" in res else res["peak_gflops_float32"]
    ceilings = {}
    for plen in lens:
        for b in args.batch_sizes:
            need = b * -(-(plen + DECODE_STEPS + 8) // block_size)  # blocks: each request's prompt and tokens
            if need > runner.num_blocks:
                print(f"{plen:6d} {b:5d}  skipped: {need} KV blocks, the cache holds {runner.num_blocks}")
                continue
            step, ctx = engine_decode(llm, b, plen)
            tok_s = b / step
            gflops = tok_s * flops_per_token(arch, int(ctx)) / 1e9
            if b not in ceilings:
                ceilings[b] = model_linear_gflops(arch, b, dtype)
            ceiling = ceilings[b]
            row = {"prompt_len": plen, "batch": b, "step_ms": step * 1000, "tok_s": tok_s, "gflops": gflops,
                   "ceiling_gflops": ceiling, "mfu_vs_ceiling": gflops / ceiling, "mfu_vs_peak": gflops / peak}
            if b == 1:
                kv_bytes = 2 * arch.num_layers * ctx * arch.num_kv_heads * arch.head_dim * runner.kv_dtype.itemsize
                row["bandwidth_fraction"] = (weight_bytes + kv_bytes) / step / 1e9 / res["bandwidth_gbs"]
            res["rows"].append(row)
            print(f"{plen:6d} {b:5d} {step * 1000:8.1f} {tok_s:8.1f} {gflops:8.1f} {ceiling:20.1f} "
                  f"{100 * row['mfu_vs_ceiling']:14.1f}% {100 * row['mfu_vs_peak']:11.1f}%")
    b1 = next((r for r in res["rows"] if r["batch"] == 1), None)
    if b1:
        print(f"\nbatch 1: {100 * b1['bandwidth_fraction']:.1f}% of the bandwidth roofline "
              f"(weights + KV read per step / step time / copy bandwidth)")
    write_json(args.result_json, res)
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--prompt-len", type=int, nargs="+", default=[64, 320],
                   help="tokens of each decode's prompt (its context); the decode steps run at each (two lengths let "
                        "the simulator's calibration fit attention's cost)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES)
    add_dtype_arg(p)
    add_result_json_arg(p)
