"""Command-line flags of the engine (vLLM's names), shared by `pagedllm generate/chat/serve` and the
`python -m pagedllm.entrypoints.openai.api_server` entry point."""

from __future__ import annotations

import argparse

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import build_config


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="a .gguf file or a HuggingFace-style directory (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights/activations dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache size in bytes (CPU default 1 GiB)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of GPU memory to use")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of shared prompt prefixes")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--quantization", default=None,
                   choices=["none", "int8", "fp8", "gguf", "rtn", "awq", "gptq"],
                   help="int8/fp8: quantize weights at load time; gguf: run a GGUF file's 4-bit blocks packed; "
                        "awq/gptq/rtn: a checkpoint made by `pagedllm quantize` (detected without this flag too)")
    g.add_argument("--quant-dense-min-tokens", type=int, default=0,
                   help="with packed quantized weights, steps of at least N tokens use a bfloat16 copy of the "
                        "weights (faster large batches on CPU, +2 bytes per weight); 0 = off")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over N ranks (torch.distributed: gloo on CPU, NCCL on CUDA); without "
                        "--distributed-init-method the engine starts ranks 1..N-1 on this machine")
    g.add_argument("--distributed-init-method", default=None,
                   help="tcp://HOST:PORT: rank 0 listens there and ranks 1..N-1 are started separately "
                        "(`pagedllm tp-worker`, e.g. on other machines); env:// under torchrun (detected)")
    g.add_argument("--tp-threads-per-rank", type=int, default=None,
                   help="intra-op threads per tensor-parallel rank (default: the cores divided by N, at least 1)")
    g.add_argument("--distributed-timeout-s", type=float, default=600.0,
                   help="a collective or the start-up rendezvous waiting longer than this fails the engine")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="priority: requests' `priority` (lower first) orders the queue and picks preemption victims")
    g.add_argument("--preemption-mode", choices=["recompute", "swap"], default="recompute",
                   help="swap: a preempted request's KV blocks move to host memory and back")
    g.add_argument("--swap-space", type=float, default=4.0, help="GiB of host memory for swapped KV blocks")
    g.add_argument("--target-ttft-ms", type=float, default=None, help="SLA mode: adapt the step token budget")
    g.add_argument("--target-tpot-ms", type=float, default=None, help="SLA mode: adapt the step token budget")
    g.add_argument("--max-waiting-requests", type=int, default=None, help="refuse new requests (429) beyond this")
    g.add_argument("--max-queue-delay-ms", type=float, default=None,
                   help="drop a request (503) that waited longer than this before starting")
    g.add_argument("--speculative-config", default=None,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                        '\'{"method": "draft_model", "model": "draft.gguf", "num_speculative_tokens": 4}\'')
    g.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                   help="turn speculation off while at least this many requests run")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return build_config(
        args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed,
        served_model_name=getattr(args, "served_model_name", None), block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, enable_chunked_prefill=args.enable_chunked_prefill, device=args.device,
        quantization=args.quantization, quant_dense_min_tokens=args.quant_dense_min_tokens,
        speculative_config=args.speculative_config,
        speculative_disable_by_batch_size=args.speculative_disable_by_batch_size,
        scheduling_policy=args.scheduling_policy, max_waiting_requests=args.max_waiting_requests,
        max_queue_delay_ms=args.max_queue_delay_ms, preemption_mode=args.preemption_mode, swap_space=args.swap_space,
        target_ttft_ms=args.target_ttft_ms, target_tpot_ms=args.target_tpot_ms,
        **_distributed_kwargs(args),
    )


def torchrun_env() -> dict[str, int] | None:
    """RANK / WORLD_SIZE when this process was started by torchrun (or with its variables set by hand)."""
    import os

    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    return {"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


def _distributed_kwargs(args: argparse.Namespace) -> dict:
    tp, method = args.tensor_parallel_size, args.distributed_init_method
    env = torchrun_env()
    if method is None and env is not None and env["world_size"] > 1:
        method = "env://"
        if tp == 1:
            tp = env["world_size"]
        elif tp != env["world_size"]:
            raise ValueError(f"--tensor-parallel-size {tp} differs from torchrun's WORLD_SIZE {env['world_size']}")
    return {"tensor_parallel_size": tp, "distributed_init_method": method,
            "tp_threads_per_rank": args.tp_threads_per_rank, "distributed_timeout_s": args.distributed_timeout_s}
