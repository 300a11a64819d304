"""`pagedllm bench spec`: decode speed with and without speculative decoding, measured in the same run.

- single request (latency): tokens/s of one request at a time on a workload whose output repeats its input
  (code rewrites: where n-gram lookup shines), greedy;
- concurrency (throughput): all prompts at once, with speculation always on vs turned off by batch size.
"""

from __future__ import annotations

import argparse
import time

from pagedllm.bench.common import add_dtype_arg, add_model_arg, add_result_json_arg, write_json
from pagedllm.bench.offline import load_prompts
from pagedllm.engine.llm import LLM
from pagedllm.sampling_params import SamplingParams

REWRITES = [
    ("rename `total` to `result`",
     "def add_all(values):\n    total = 0\n    for v in values:\n        if v is None:\n            continue\n"
     "        total = total + v\n    return total\n\n\ndef mean(values):\n    total = add_all(values)\n"
     "    count = len([v for v in values if v is not None])\n    return total / count if count else 0.0\n"),
    ("make `greet` take a `punctuation` argument defaulting to '!'",
     "def greet(name):\n    message = 'Hello, ' + name\n    message = message + '!'\n    print(message)\n"
     "    return message\n\n\ndef greet_all(names):\n    for name in names:\n        greet(name)\n"
     "    return len(names)\n"),
    ("replace the while loop with a for loop",
     "def count_vowels(text):\n    vowels = 'aeiou'\n    count = 0\n    i = 0\n    while i < len(text):\n"
     "        if text[i].lower() in vowels:\n            count = count + 1\n        i = i + 1\n    return count\n"),
    ("add a docstring to `area`",
     "import math\n\n\ndef area(radius):\n    if radius < 0:\n        raise ValueError('negative radius')\n"
     "    return math.pi * radius * radius\n\n\ndef circumference(radius):\n    return 2 * math.pi * radius\n"),
]


def rewrite_prompts() -> list[str]:
    return [f"Rewrite this Python code with one change: {change}. Output only the code.\n\n{code}\nRewritten code:\n"
            for change, code in REWRITES]


def _single(llm, prompts, output_len) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=output_len)
    llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    n_out, t_decode = 0, 0.0
    outs = []
    for p in prompts:
        o = llm.generate(p, sp, use_tqdm=False)[0]
        m = o.metrics
        n = len(o.outputs[0].token_ids)
        if n > 1:
            n_out += n - 1
            t_decode += m.last_token_time - m.first_token_time
        outs.append(o.outputs[0].token_ids)
    return {"decode_tok_s": n_out / t_decode, "token_ids": outs}


def _batch(llm, prompts, output_len) -> float:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True), use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def main(args: argparse.Namespace) -> int:
    prompts = rewrite_prompts()
    configs = [("no speculation", None), ("ngram k=%d" % args.k,
                {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 5})]
    if args.draft_model:
        configs.append((f"draft model k={args.k}", {"method": "draft_model", "model": args.draft_model,
                                                   "num_speculative_tokens": args.k}))
    rows = []
    base_ids = None
    for name, cfg in configs:
        llm = LLM(args.model, dtype=args.dtype, speculative_config=cfg, max_model_len=args.max_model_len)
        r = _single(llm, prompts, args.output_len)
        st = llm.engine.stats()
        row = {"config": name, "single_decode_tok_s": r["decode_tok_s"]}
        if st.spec_num_drafts:
            row["mean_acceptance_length"] = 1 + st.spec_num_accepted_tokens / st.spec_num_drafts
            row["acceptance_rate"] = st.spec_num_accepted_tokens / st.spec_num_draft_tokens
        if base_ids is None:
            base_ids = r["token_ids"]
        row["greedy_identical"] = r["token_ids"] == base_ids
        rows.append(row)
        del llm
    batch_prompts = load_prompts(None)[: args.concurrency]
    thr = {}
    for name, cfg, disable in () if args.skip_concurrency else (("no speculation", None, None),
                               ("ngram, always on", configs[1][1], None),
                               (f"ngram, off at batch >= {args.disable_by_batch_size}", configs[1][1],
                                args.disable_by_batch_size)):
        llm = LLM(args.model, dtype=args.dtype, speculative_config=cfg, speculative_disable_by_batch_size=disable,
                  max_model_len=args.max_model_len)
        thr[name] = _batch(llm, batch_prompts, args.batch_output_len)
        del llm
    base = rows[0]["single_decode_tok_s"]
    print(f"\nsingle request, {len(prompts)} code-rewrite prompts, greedy, up to {args.output_len} tokens")
    print(f"{'config':22s} {'decode tok/s':>13s} {'speedup':>8s} {'accept len':>11s} {'identical':>10s}")
    for r in rows:
        print(f"{r['config']:22s} {r['single_decode_tok_s']:13.1f} {r['single_decode_tok_s'] / base:7.2f}x "
              f"{r.get('mean_acceptance_length', 1.0):11.2f} {str(r['greedy_identical']):>10s}")
    if thr:
        print(f"\n{len(batch_prompts)} prompts at once x {args.batch_output_len} tokens (throughput)")
    for name, v in thr.items():
        print(f"{name:32s} {v:8.1f} output tok/s")
    write_json(args.result_json, {"single": rows, "concurrent_output_tok_s": thr})
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p, help_text="target model (default: the embedded one)")
    p.add_argument("--draft-model", default=None, help="also measure a draft model (same tokenizer)")
    add_dtype_arg(p)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--output-len", type=int, default=160)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--batch-output-len", type=int, default=64)
    p.add_argument("--disable-by-batch-size", type=int, default=8)
    p.add_argument("--skip-concurrency", action="store_true", help="only the single-request measurement")
    p.add_argument("--max-model-len", type=int, default=None)
    add_result_json_arg(p)
