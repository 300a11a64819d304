"""`pagedllm eval`: baseline vs candidate quality gate (exit status 1 when the candidate fails it)."""

from __future__ import annotations

import argparse
import json
import os

from pagedllm.config import KV_CACHE_DTYPE_CHOICES, LARGE_STEP_WEIGHTS_CHOICES, resolve_model_path
from pagedllm.engine.llm import LLM
from pagedllm.eval.quality import (
    BUSINESS_SET, answer_items, eval_chunks, gate, is_correct, load_items, score_model, table, to_json)
from pagedllm.quant import verdicts
from pagedllm.quant.texts import read_text_file


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--baseline", default="default", help="model path (default: SmolLM2-135M, dequantized)")
    p.add_argument("--baseline-quantization", default=None)
    p.add_argument("--candidate", default=None, help="model path or quantized checkpoint directory")
    p.add_argument("--candidate-quantization", default=None, help="e.g. int8 / fp8 / gguf for load-time schemes")
    p.add_argument("--candidate-dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                   help="auto: the engine's default path on this machine (e.g. packed GGUF blocks on CPU)")
    p.add_argument("--candidate-kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                   help="the candidate's KV cache dtype (auto: as the engine chooses it for the candidate's dtype)")
    p.add_argument("--candidate-activation-bits", type=int, default=16, choices=[8, 16],
                   help="the candidate's --activation-bits (packed GGUF blocks on CPU: 8-bit or ~15-bit activations)")
    p.add_argument("--candidate-large-step-weights", default="blocks",
                   choices=[c for c in LARGE_STEP_WEIGHTS_CHOICES if c != "auto"],
                   help="the candidate's --large-step-weights (packed GGUF blocks on CPU: steps of 256+ rows on the "
                        "block kernels or on bfloat16 weight stripes)")
    p.add_argument("--max-ppl-increase", type=float, default=0.05, help="relative perplexity increase allowed")
    p.add_argument("--max-accuracy-drop", type=float, default=0.01, help="absolute accuracy drop allowed")
    p.add_argument("--eval-tokens", type=int, default=4096, help="held-out text tokens for perplexity/KL")
    p.add_argument("--items", default=None, help="business test set JSONL (default: the shipped one; 'none': no "
                   "business items, perplexity and KL only)")
    p.add_argument("--text", default=None, help="held-out text file for perplexity/KL (default: the Python docs' "
                   "eval split, shipped with Python)")
    p.add_argument("--chunk-len", type=int, default=256, help="tokens per perplexity/KL window")
    p.add_argument("--as-llama-perplexity", action="store_true",
                   help="cut and score the windows as `llama-perplexity --kl-divergence` does (BOS first where the "
                   "model adds one, each window's second half scored), so its KL and top-1 figures compare with "
                   "llama.cpp's on the same text and --chunk-len")
    p.add_argument("--json", default=None, help="write the scores here")
    p.add_argument("--select-from", default=None,
                   help="maintenance: answer these candidate items with the baseline, in float32 and in bfloat16, "
                        "and write the ones it gets right both times to --write (items that float rounding alone "
                        "flips would measure noise, not quantization)")
    p.add_argument("--write", default=None)


def _llm(path: str, quantization: str | None, dtype: str = "float32", kv_cache_dtype: str = "auto",
         activation_bits: int = 16, large_step_weights: str = "blocks", max_model_len: int = 1024):
    return LLM(model=path, quantization=quantization, max_model_len=max_model_len, dtype=dtype,
               kv_cache_dtype=kv_cache_dtype,
               activation_bits=activation_bits, large_step_weights=large_step_weights)


def main(args) -> int:
    if args.select_from:
        if not args.write:
            raise ValueError("--select-from needs --write")
        items = load_items(args.select_from)
        runs = [answer_items(_llm(args.baseline, args.baseline_quantization, dt), items)
                for dt in ("float32", "bfloat16")]
        kept = [it for it, *outs in zip(items, *runs) if all(is_correct(o, it["answers"]) for o in outs)]
        with open(args.write, "w") as f:
            for it in kept:
                f.write(json.dumps(it) + "\n")
        print(f"kept {len(kept)} of {len(items)} items -> {args.write}")
        return 0
    if not args.candidate:
        raise ValueError("give --candidate (or --select-from)")
    items = [] if args.items == "none" else load_items(args.items or BUSINESS_SET)
    base_llm = _llm(args.baseline, args.baseline_quantization, max_model_len=max(1024, args.chunk_len))
    text = read_text_file(args.text) if args.text else None
    chunks = eval_chunks(base_llm.get_tokenizer(), args.eval_tokens, args.chunk_len, text, args.as_llama_perplexity)
    score_from = args.chunk_len // 2 if args.as_llama_perplexity else 0
    base, base_lp, _ = score_model(base_llm, f"baseline {args.baseline} ({args.baseline_quantization or 'none'})",
                                   chunks, items, score_from=score_from)
    del base_llm
    cand_llm = _llm(args.candidate, args.candidate_quantization, args.candidate_dtype, args.candidate_kv_cache_dtype,
                    args.candidate_activation_bits, args.candidate_large_step_weights, max(1024, args.chunk_len))
    rt = cand_llm.engine.runtime
    label = f"candidate {args.candidate} ({args.candidate_quantization or 'none'}, dtype {args.candidate_dtype})"
    if args.candidate_dtype == "auto":
        label += f": {rt['weights']}"
    if "activation_bits" in rt:
        label += f", {rt['activation_bits']}-bit activations"
    if rt.get("large_step_weights") == "bf16":
        label += ", bf16 weight stripes for large steps"
    label += f", KV cache {rt['kv_cache_dtype']}"
    cand, _, _ = score_model(cand_llm, label, chunks, items, base_lp, score_from)
    fails = gate(base, cand, args.max_ppl_increase, args.max_accuracy_drop)
    print(table([base, cand]))
    print(f"\ngate: perplexity increase <= {args.max_ppl_increase:.2%}, accuracy drop <= {args.max_accuracy_drop:.2%} "
          f"({len(items)} items, {sum(len(c) for c in chunks)} text tokens)")
    print("PASS" if not fails else "FAIL: " + "; ".join(fails))
    cand_path = os.path.abspath(resolve_model_path(args.candidate))
    large = args.candidate_large_step_weights
    if ((args.candidate_activation_bits == 8 or large == "bf16") and args.candidate_dtype == "auto"
            and args.candidate_quantization is None and cand_path.endswith(".gguf") and os.path.isfile(cand_path)
            and args.baseline_quantization is None and cand_path == os.path.abspath(resolve_model_path(args.baseline))):
        # the file against its own float32 numbers: what --activation-bits / --large-step-weights auto read, when the
        # candidate ran its blocks at these bits in every step (no dense copy took the prefill chunks; bf16 large
        # steps: those on bfloat16 stripes) under the standard gate
        plan = rt.get("weight_plan") or {}
        bits = args.candidate_activation_bits
        ran = (rt.get("activation_bits") == bits and not plan.get("layer_dense_min_tokens")
               and not plan.get("head_dense_min_tokens") and rt.get("large_step_weights", "blocks") == large)
        standard = (args.eval_tokens >= 4096 and args.items is None and args.max_ppl_increase <= 0.05
                    and args.max_accuracy_drop <= 0.01 and args.text is None and args.chunk_len == 256
                    and not args.as_llama_perplexity)
        what = f"{bits}-bit activations" + (", bf16 large steps" if large == "bf16" else "")
        if not ran:
            print(f"not recorded for auto: the candidate's steps did not all run the block kernels at {what}")
        else:
            summary = (f"perplexity {base.perplexity:.3f} -> {cand.perplexity:.3f}, KL {cand.kl:.4f}, top-1 "
                       f"{cand.top1_agreement:.2%}, {cand.correct}/{len(items)} items")
            verdicts.record(cand_path, bits, large, not fails, summary, standard)
            print(f"recorded for auto: {what} {'pass' if not fails else 'fail'} on {cand_path}"
                  + ("" if standard else " (a non-standard gate: auto does not use it)"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"scores": to_json([base, cand]), "passed": not fails, "failures": fails}, f, indent=2)
    return 0 if not fails else 1
