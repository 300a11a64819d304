"""`pagedllm quantize`: write a quantized checkpoint (safetensors + quant_config.json + tokenizer)."""

from __future__ import annotations

import argparse
import json

from pagedllm.quant.policy import QuantPolicy
from pagedllm.quant.texts import read_text_file
from pagedllm.quantize.quantize import default_policy, quantize_to_dir


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="a .gguf file or HF-style directory (default: SmolLM2-135M)")
    p.add_argument("--method", choices=["rtn", "awq", "gptq"], default="awq")
    p.add_argument("--bits", type=int, choices=[4, 8], default=4)
    p.add_argument("--group-size", type=int, default=None,
                   help="4-bit group size along the input dimension (32/64/128/256; default 64, which divides "
                        "SmolLM2's 576). 8-bit weights always use one scale per output channel (torch's int8 kernel)")
    p.add_argument("--symmetric", action="store_true", help="4-bit: no zero point")
    p.add_argument("--policy", default=None,
                   help="per-layer-type schemes, e.g. 'attn=int8,mlp=int4,lm_head=int8,embed=int8' "
                        "(default: body in --bits, LM head and embedding int8)")
    p.add_argument("--calib-file", default=None,
                   help="calibration text (.txt, or .jsonl with text/prompt fields); default: the calibration "
                        "half of Python's own documentation topics (held apart from `pagedllm eval`'s text)")
    p.add_argument("--calib-tokens", type=int, default=8192, help="calibration tokens to use")
    p.add_argument("--calib-seq-len", type=int, default=256)
    p.add_argument("--out", required=True, help="output directory")


def main(args) -> int:
    if args.bits == 8 and args.group_size is not None:
        raise ValueError("8-bit weights use one scale per output channel (torch's packed int8 kernel has no "
                         "groups); --group-size applies to 4-bit")
    gs = args.group_size or 64
    if args.policy:
        policy = QuantPolicy.parse(args.policy, group_size=gs, symmetric=args.symmetric)
    else:
        policy = default_policy(args.bits, gs, args.symmetric)
    info, report = quantize_to_dir(
        args.model, args.method, args.bits, policy, args.out,
        calib_text=read_text_file(args.calib_file) if args.calib_file else None,
        calib_label=args.calib_file or "pydoc_data.topics (calib split)",
        calib_tokens=args.calib_tokens, calib_seq_len=args.calib_seq_len)
    alphas = [v["alpha"] for v in report["layers"].values() if "alpha" in v]
    extra = f"; AWQ mean alpha {sum(alphas) / len(alphas):.2f}" if alphas else ""
    print(json.dumps({"out": args.out, "seconds": report["seconds"], **{k: info[k] for k in ("method", "bits")}}))
    print(f"wrote {args.out} ({args.method}, {args.bits}-bit{extra})")
    return 0
