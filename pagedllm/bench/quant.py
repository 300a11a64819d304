"""`pagedllm bench quant`: every quantization method side by side, in one run.

For each: weight bytes in memory, perplexity / mean KL / top-1 agreement against full precision on held-out
Python-docs text, business-set accuracy, and generation speed at batch 1 (one chat prompt, 128 tokens, median of 3) and batch
32 (32 bench prompts, 64 tokens each) — output tokens over wall time, prefill included, greedy, ignore_eos.
Checkpoints for rtn/awq/gptq are made in the run (or reused from --ckpt-dir)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

from pagedllm.bench.common import add_model_arg, add_result_json_arg, write_json
from pagedllm.bench.offline import load_prompts
from pagedllm.engine.llm import LLM
from pagedllm.eval.quality import eval_chunks, load_items, score_model, table
from pagedllm.quant.checkpoint import is_quantized_checkpoint
from pagedllm.quantize.quantize import default_policy, quantize_to_dir
from pagedllm.sampling_params import SamplingParams

DEFAULT_VARIANTS = ["none", "int8", "fp8", "gguf", "awq:32", "rtn:64", "awq:64", "gptq:64"]


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p, default="default")
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS,
                   help="none, int8, fp8, gguf (load time) or METHOD:GROUP for 4-bit checkpoints "
                        "(METHOD in rtn/awq/gptq)")
    p.add_argument("--ckpt-dir", default="results/quant/checkpoints")
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--calib-tokens", type=int, default=4096)
    p.add_argument("--skip-speed", action="store_true")
    add_result_json_arg(p, default="results/quant/bench_quant.json")


def _speed(llm) -> dict:
    msg = [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message."}]
    llm.chat(msg, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)  # warm-up
    runs = []
    for _ in range(3):  # median of three: batch-1 speed is sensitive to anything else on the machine
        t = time.perf_counter()
        out = llm.chat(msg, SamplingParams(max_tokens=128, temperature=0, ignore_eos=True), use_tqdm=False)
        runs.append(len(out[0].outputs[0].token_ids) / (time.perf_counter() - t))
    b1 = sorted(runs)[1]
    prompts = load_prompts()[:32]
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True), use_tqdm=False)
    b32 = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
    return {"tok_s_b1": round(b1, 1), "tok_s_b32": round(b32, 1)}


def _checkpoint(args, method: str, group: int) -> str:
    out = os.path.join(args.ckpt_dir, f"{method}-int4-g{group}")
    if not is_quantized_checkpoint(out):
        info, _ = quantize_to_dir(args.model, method, 4, default_policy(4, group, False), out,
                                  calib_tokens=args.calib_tokens)
        print(f"quantized {method} g{group} in {info['seconds']} s -> {out}", flush=True)
    return out


def main(args) -> int:
    items = load_items()
    rows, results, base_lp, chunks = [], [], None, None
    for v in args.variants:
        if ":" in v:
            method, group = v.split(":")
            llm = LLM(model=_checkpoint(args, method, int(group)), max_model_len=1024)
            label = f"{method} int4 g{group} (LM head int8)"
        else:
            llm = LLM(model=args.model, quantization=None if v == "none" else v, max_model_len=1024)
            label = {"none": "float32 (dequantized GGUF)", "int8": "int8 per channel (load time)",
                     "fp8": "fp8 e4m3 (load time)", "gguf": "GGUF Q4_1 blocks native (LM head int8)"}[v]
        if chunks is None:
            chunks = eval_chunks(llm.get_tokenizer(), args.eval_tokens)
        scores, lp, _ = score_model(llm, label, chunks, items, base_lp)
        if base_lp is None:
            base_lp = lp
        row = {"variant": v, **scores.__dict__}
        if not args.skip_speed:
            row.update(_speed(llm))
        print(json.dumps(row), flush=True)
        rows.append(scores)
        results.append(row)
        del llm
        gc.collect()
    print(table(rows))
    if not args.skip_speed:
        base = results[0]
        print("\n| variant | weights MiB | x smaller | batch-1 tok/s | x | batch-32 tok/s | x |\n|---|---|---|---|---|---|---|")
        for r in results:
            print(f"| {r['label']} | {r['weight_bytes'] / 2**20:.1f} | {base['weight_bytes'] / r['weight_bytes']:.2f} | "
                  f"{r['tok_s_b1']} | {r['tok_s_b1'] / base['tok_s_b1']:.2f} | {r['tok_s_b32']} | "
                  f"{r['tok_s_b32'] / base['tok_s_b32']:.2f} |")
    write_json(args.result_json, results)
    return 0
