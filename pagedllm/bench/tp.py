"""`pagedllm bench tp`: decode tokens/s at several tensor-parallel sizes, and what the communication costs.

For each size N the engine is built with ``tensor_parallel_size=N``; for each batch size B, B prompts are
prefilled, then the decode steps alone are timed (greedy, fixed length). Rank 0's wall time inside the model's
collectives is read from its process group: the all-reduces (2 per layer + the embedding's) and the logits'
all-gather, waiting for the slowest rank included. Greedy tokens are compared with the first size's. Apart from
the engine, N bare processes time one all-reduce of a (batch, hidden) float32 tensor: the transport's own cost.
"""

from __future__ import annotations

import argparse
import datetime
import socket
import time

from pagedllm.bench.common import add_dtype_arg, add_model_arg, add_result_json_arg, write_json
from pagedllm.bench.offline import load_prompts
from pagedllm.distributed.launcher import threads_per_rank
from pagedllm.engine.llm import LLM
from pagedllm.sampling_params import SamplingParams


def _decode_run(llm, prompts: list[str], output_len: int) -> dict:
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True)
    ids = [eng.add_request(None, p, sp) for p in prompts]
    tokens = {rid: [] for rid in ids}

    def step() -> int:
        new = 0
        for out in eng.step():
            if out.request_id in tokens:
                toks = out.outputs[0].token_ids
                new += len(toks) - len(tokens[out.request_id])
                tokens[out.request_id] = list(toks)
        return new

    while any(not t for t in tokens.values()):  # prefill (and first token) of every prompt
        step()
    tp = eng.runner.tp
    c0 = (tp.all_reduce_seconds, tp.all_gather_seconds, tp.num_all_reduces) if tp else (0.0, 0.0, 0)
    steps, n_tok = 0, 0
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        n_tok += step()
        steps += 1
    dt = time.perf_counter() - t0
    c1 = (tp.all_reduce_seconds, tp.all_gather_seconds, tp.num_all_reduces) if tp else (0.0, 0.0, 0)
    return {"decode_tok_s": n_tok / dt, "ms_per_step": 1000 * dt / steps, "decode_steps": steps,
            "all_reduce_ms_per_step": 1000 * (c1[0] - c0[0]) / steps,
            "all_gather_ms_per_step": 1000 * (c1[1] - c0[1]) / steps,
            "all_reduces_per_step": (c1[2] - c0[2]) / steps,
            "token_ids": [tokens[r] for r in ids]}


def _raw_rank(rank: int, world: int, port: int, numel: int, iters: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    x = torch.ones(numel)
    for _ in range(20):
        dist.all_reduce(x)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    if rank == 0:
        out.put((time.perf_counter() - t0) / iters)
    dist.destroy_process_group()


def raw_all_reduce_ms(world: int, numel: int, iters: int) -> float:
    """Mean time of one gloo all-reduce of ``numel`` float32 over ``world`` fresh local processes."""

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_raw_rank, args=(r, world, port, numel, iters, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    return 1000 * out.get()


def main(args: argparse.Namespace) -> int:
    import torch

    sizes = [int(x) for x in args.sizes.split(",")]
    batches = [int(x) for x in args.batch_sizes.split(",")]
    prompts = load_prompts(None)
    threads0 = torch.get_num_threads()
    rows, base = [], {}
    for n in sizes:
        llm = LLM(args.model, dtype=args.dtype, tensor_parallel_size=n, tp_threads_per_rank=args.threads_per_rank,
                  max_model_len=args.max_model_len)
        threads = threads_per_rank(llm.engine.config) if n > 1 else threads0
        runner = llm.engine.runner
        hidden = runner.arch.hidden_size
        weights = runner.rank_weight_bytes or [runner.model.weight_bytes()]
        _decode_run(llm, prompts[:2], 4)  # warm-up
        for b in batches:
            r = _decode_run(llm, prompts[:b], args.output_len)
            ids = r.pop("token_ids")
            base.setdefault(b, ids)
            rows.append({"tp": n, "batch": b, "threads_per_rank": threads, "weight_mib_per_rank": max(weights) / 2**20,
                         **r, "greedy_identical_to_first_size": ids == base[b]})
        llm.engine.shutdown()
        del llm
        torch.set_num_threads(threads0)  # rank 0 ran in this process with its own thread count
    for r in rows:  # the transport alone, with the engine gone
        r["raw_all_reduce_ms"] = raw_all_reduce_ms(r["tp"], r["batch"] * hidden, args.raw_iters) if r["tp"] > 1 else 0.0
    print(f"\ndecode, greedy, {args.output_len} tokens per request, model {args.model or 'default'}; all-reduce and "
          f"all-gather: rank 0's time inside them per decode step (waiting for slower ranks included); raw: one "
          f"all-reduce of (batch, {hidden}) float32 between bare processes")
    print(f"{'TP':>3s} {'batch':>5s} {'thr/rank':>8s} {'MiB/rank':>8s} {'decode tok/s':>12s} {'ms/step':>8s} "
          f"{'all-reduce ms/step':>18s} {'(count)':>7s} {'all-gather ms/step':>18s} {'raw ms each':>11s} "
          f"{'same tokens':>11s}")
    for r in rows:
        print(f"{r['tp']:3d} {r['batch']:5d} {r['threads_per_rank']:8d} {r['weight_mib_per_rank']:8.1f} "
              f"{r['decode_tok_s']:12.1f} {r['ms_per_step']:8.1f} {r['all_reduce_ms_per_step']:18.2f} "
              f"{r['all_reduces_per_step']:7.0f} {r['all_gather_ms_per_step']:18.2f} {r['raw_all_reduce_ms']:11.3f} "
              f"{str(r['greedy_identical_to_first_size']):>11s}")
    write_json(args.result_json, rows)
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p, help_text="default: the embedded model (9 query / 3 KV heads: TP 1 or 3)")
    p.add_argument("--sizes", default="1,3", help="tensor-parallel sizes, comma-separated")
    p.add_argument("--batch-sizes", default="1,8", help="concurrent requests, comma-separated")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--threads-per-rank", type=int, default=None, help="default: the cores divided by N")
    add_dtype_arg(p)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--raw-iters", type=int, default=300, help="all-reduces timed between bare processes")
    add_result_json_arg(p)
