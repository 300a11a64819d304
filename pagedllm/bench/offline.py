"""`pagedllm bench offline`: output tokens/s of ``LLM.generate`` vs HuggingFace transformers generating the same
prompts one at a time (greedy, fixed output length), measured in the same run."""

from __future__ import annotations

import argparse
import json
import time
from importlib import resources

from pagedllm.bench.common import add_dtype_arg, add_result_json_arg, add_workload_args, write_json
from pagedllm.engine.llm import LLM
from pagedllm.reference.hf import load_hf_reference
from pagedllm.sampling_params import SamplingParams


def load_prompts(path: str | None = None) -> list[str]:
    if path is None:
        text = resources.files("pagedllm.bench").joinpath("data/prompts.jsonl").read_text()
    else:
        with open(path) as f:
            text = f.read()
    return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]


def run_pagedllm(prompts: list[str], output_len: int, **engine_kwargs) -> dict:
    llm = LLM(**engine_kwargs)
    # min_tokens masks EOS exactly as HF's min_new_tokens does, so both generate the same greedy tokens
    params = SamplingParams(temperature=0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"system": "pagedllm LLM.generate", "seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt,
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def run_hf_one_at_a_time(prompts: list[str], output_len: int, dtype: str = "float32") -> dict:
    import torch
    from tqdm import tqdm

    tok, model = load_hf_reference(dtype)
    n_out = 0
    ids_all = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for p in tqdm(prompts, desc="HF one at a time"):
            ids = tok(p, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
            new = out[0, ids.shape[1]:].tolist()
            ids_all.append(new)
            n_out += len(new)
    dt = time.perf_counter() - t0
    return {"system": f"HF transformers ({dtype}) one at a time", "seconds": dt, "output_tokens": n_out,
            "output_tok_s": n_out / dt, "token_ids": ids_all}


def main(args: argparse.Namespace) -> int:
    prompts = load_prompts(args.prompts_file)[: args.num_prompts]
    rows = [run_pagedllm(prompts, args.output_len, dtype=args.dtype)]
    if not args.skip_hf:
        rows.append(run_hf_one_at_a_time(prompts, args.output_len))
    print(f"\n{len(prompts)} prompts x {args.output_len} output tokens, greedy")
    print(f"{'system':45s} {'seconds':>9s} {'out tok/s':>10s} {'ratio':>7s}")
    base = rows[-1]["output_tok_s"]
    for r in rows:
        print(f"{r['system']:45s} {r['seconds']:9.1f} {r['output_tok_s']:10.1f} {r['output_tok_s'] / base:6.2f}x")
    if len(rows) == 2:
        same = sum(a == b for a, b in zip(rows[0]["token_ids"], rows[1]["token_ids"]))
        print(f"greedy outputs identical to HF for {same}/{len(prompts)} prompts")
    write_json(args.result_json, [{k: v for k, v in r.items() if k != "token_ids"} for r in rows])
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    add_dtype_arg(p)
    p.add_argument("--skip-hf", action="store_true", help="only measure pagedllm")
    add_result_json_arg(p)
