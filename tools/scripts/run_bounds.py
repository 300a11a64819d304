"""The fastest a `bench compare` run could be on this machine: a lower bound on its time from the file's arithmetic
and bytes and two machine limits, and the output tok/s that bound allows (the issue-48 targets checked against it).

A run serves the shipped W1 prompts (the first 32), ``--output-len`` new tokens each, ``C`` at a time. Whatever the
engine, it must
- prefill every prompt: 2 x (the file's matrix weights but the embedding and the LM head) multiply-adds per prompt
  token, at most the CPU's int8 multiply-add peak (``--peak-gmacs``: ``vpdpbusd`` on both cores, measured with a
  register-only loop; docs/benchmarks.md, "Machine limits");
- decode: each step of ``C`` rows reads every weight once (the file's bytes, embedding rows aside) at most at the copy
  bandwidth (``--bandwidth``), and computes ``C`` rows of the whole model (LM head included) at most at the peak:
  the step takes at least the longer of the two.
Attention, sampling and the engine are left out (a few percent at these contexts), so real runs stay below it.

    python3 -m tools.scripts.run_bounds FILE [FILE ...] [--bandwidth 33] [--peak-gmacs 465] [--num-prompts 32] [--output-len 64]
        [--concurrency 1 8 32] [--peer "1.5b=21.9,25.7,35.7"]
"""

from __future__ import annotations

import argparse
import math
import os

import gguf
import numpy as np

from pagedllm.bench.offline import load_prompts
from pagedllm.engine.tokenizer import load_tokenizer


def file_costs(path: str) -> dict:
    """Multiply-adds per prefill token (no LM head: a prefill's logits are its last row's) and per decode token,
    and the bytes a decode step reads (the matrix weights; a tied table counted once, as the LM head)."""
    r = gguf.GGUFReader(path)
    body = head = emb = 0
    step_bytes = emb_bytes = 0
    names = {t.name for t in r.tensors}
    for t in r.tensors:
        if len(t.shape) < 2 or min(int(s) for s in t.shape) == 1:
            continue  # norms, biases
        n = int(np.prod([int(s) for s in t.shape]))
        if t.name == "token_embd.weight":
            emb, emb_bytes = n, int(t.n_bytes)
        elif t.name == "output.weight":
            head, step_bytes = head + n, step_bytes + int(t.n_bytes)
        else:
            body, step_bytes = body + n, step_bytes + int(t.n_bytes)
    if "output.weight" not in names:  # tied: the embedding table is the head
        head, step_bytes = emb, step_bytes + emb_bytes
    return {"prefill_macs": body, "decode_macs": body + head, "step_bytes": step_bytes}


def bound_seconds(costs: dict, prompt_lens: list[int], output_len: int, c: int, bandwidth: float,
                  peak_gmacs: float) -> tuple[float, float]:
    """(the run's time bound, the mean TTFT bound at this concurrency) in seconds."""
    prefill = [n * costs["prefill_macs"] / (peak_gmacs * 1e9) for n in prompt_lens]
    step = max(costs["step_bytes"] / (bandwidth * 1e9), c * costs["decode_macs"] / (peak_gmacs * 1e9))
    steps = math.ceil(len(prompt_lens) / c) * output_len  # waves of C requests, output_len steps each
    # TTFT: the C requests sent together (a wave) prefill one after another, the shortest first (the least mean
    # wait), each request's TTFT counted from its wave's start
    ttft, t0 = [], 0.0
    for w in range(0, len(prefill), c):
        t = t0
        for p in sorted(prefill[w:w + c]):
            t += p
            ttft.append(t - t0)
        t0 = t + output_len * step
    return sum(prefill) + steps * step, sum(ttft) / len(ttft)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--bandwidth", type=float, default=33.0, help="copy bandwidth, GB/s (bench roofline)")
    p.add_argument("--peak-gmacs", type=float, default=465.0, help="int8 multiply-add peak, G/s, both cores")
    p.add_argument("--num-prompts", type=int, default=32, help="the first N of the W1 prompts (bench compare's)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--peer", action="append", default=[],
                   help="NAME=tok/s,tok/s,...: the peer's figures at each concurrency (a FILE whose name holds NAME)")
    a = p.parse_args()
    peers = {k: [float(v) for v in vals.split(",")] for k, vals in (s.split("=", 1) for s in a.peer)}
    targets = {1: 1.5, 8: 2.5, 32: 4.0}
    prompts = load_prompts()[:a.num_prompts]
    for path in a.files:
        costs = file_costs(path)
        tok = load_tokenizer(path)
        lens = [len(tok.encode(x)) for x in prompts]
        print(f"{os.path.basename(path)}: {costs['prefill_macs'] / 1e6:.0f} M multiply-adds a prompt token, "
              f"{costs['decode_macs'] / 1e6:.0f} M a decoded token, {costs['step_bytes'] / 1e6:.0f} MB a step; "
              f"{len(lens)} prompts, {sum(lens)} tokens")
        peer = next((v for k, v in peers.items() if k in os.path.basename(path)), None)
        for i, c in enumerate(a.concurrency):
            t, ttft = bound_seconds(costs, lens, a.output_len, c, a.bandwidth, a.peak_gmacs)
            tok_s = len(lens) * a.output_len / t
            line = f"  C={c:<3} >= {t:6.2f} s: <= {tok_s:7.1f} tok/s, mean TTFT >= {ttft:5.2f} s"
            if peer is not None and i < len(peer):
                want = targets.get(c)
                line += f"; the peer's {peer[i]:.1f}: at most {tok_s / peer[i]:.2f}x"
                if want:
                    line += f" (target {want}x: {want * peer[i] / tok_s:.0%} of the bound)"
            print(line)


if __name__ == "__main__":
    main()
