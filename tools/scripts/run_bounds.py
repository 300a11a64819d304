"""The fastest a `bench compare` run could be on this machine: a lower bound on its time from the file's arithmetic
and bytes and two machine limits, and the output tok/s that bound allows (the issue-48 targets checked against it).

A run serves the shipped W1 prompts (the first 32), ``--output-len`` new tokens each, ``C`` at a time. Whatever the
engine:
- every prompt token takes one multiply-add per matrix weight of the layers (the embedding and the LM head aside),
  and every new token after a request's first one more per weight of the whole model (head included): all of it at
  most at the CPU's int8 multiply-add peak (``--peak-gmacs``: ``vpdpbusd`` on both cores, measured with a
  register-only loop; docs/benchmarks.md, "Machine limits"); a mixture of experts counts its active experts only;
- a request's tokens come from ``--output-len`` forward passes one after another (its prefill, then one step per
  token), at most ``C`` requests are in flight, and a pass reads every weight once (a mixture of experts: at least
  its active experts' share) at most at the copy bandwidth (``--bandwidth``).
So the run takes at least the longer of all its multiply-adds at the peak and ceil(N / C) x output-len passes at
the bandwidth; at C=1 each pass is alone, and takes at least the longer of its own two. A request's first token
needs its prefill: the first C requests arrive together, so the k-th to get one waited at least for the k smallest
prefills (at the peak); each later one, at least for its own. Attention, sampling and the engine are left out, so a
real run stays below the bound.

    python3 -m tools.scripts.run_bounds FILE [FILE ...] [--bandwidth 33] [--peak-gmacs 465] [--num-prompts 32]
        [--output-len 64] [--concurrency 1 8 32] [--peer "1.5b=21.9,25.7,35.7"]
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
    """Multiply-adds per prompt token (the layers: a prefill's logits are its last row's) and per decoded token (the
    head too), and the fewest bytes a pass reads (the matrix weights; a tied table once, as the head). A mixture of
    experts' expert tensors (3-D) count ``expert_used_count / expert_count`` of their size."""
    r = gguf.GGUFReader(path)
    fields = {f.name: f for f in r.fields.values()}

    def field(suffix: str) -> int | None:
        f = next((f for n, f in fields.items() if n.endswith(suffix)), None)
        return None if f is None else int(f.parts[f.data[0]][0])

    used, experts = field(".expert_used_count"), field(".expert_count")
    share = used / experts if used and experts else 1.0
    body = head = emb = 0.0
    step_bytes = emb_bytes = 0.0
    names = {t.name for t in r.tensors}
    for t in r.tensors:
        dims = [int(s) for s in t.shape]
        if len(dims) < 2 or min(dims) == 1 or "embd" in t.name and t.name != "token_embd.weight":
            continue  # norms, biases, position / token-type tables (looked up, not multiplied)
        n, nbytes = float(np.prod(dims)), float(t.n_bytes)
        if len(dims) == 3:  # experts: the active ones per token
            n, nbytes = n * share, nbytes * share
        if t.name == "token_embd.weight":
            emb, emb_bytes = n, nbytes
        elif t.name == "output.weight":
            head, step_bytes = head + n, step_bytes + nbytes
        else:
            body, step_bytes = body + n, step_bytes + nbytes
    if "output.weight" not in names:  # tied: the embedding table is the head
        head, step_bytes = emb, step_bytes + emb_bytes
    return {"prefill_macs": body, "decode_macs": body + head, "step_bytes": step_bytes}


def bound_seconds(costs: dict, prompt_lens: list[int], output_len: int, c: int, bandwidth: float,
                  peak_gmacs: float) -> tuple[float, float]:
    """(the run's time bound, the mean TTFT bound) in seconds, for N = len(prompt_lens) requests C at a time."""
    peak, read = peak_gmacs * 1e9, costs["step_bytes"] / (bandwidth * 1e9)
    prefill = [n * costs["prefill_macs"] / peak for n in prompt_lens]  # + its last row's head: in the decode term
    head = (costs["decode_macs"] - costs["prefill_macs"]) / peak
    decode = (output_len - 1) * costs["decode_macs"] / peak  # a request's steps after its first token
    if c == 1:  # one pass at a time: each takes the longer of its reads and its multiply-adds
        t = sum(max(read, p + head) + (output_len - 1) * max(read, costs["decode_macs"] / peak) for p in prefill)
    else:
        compute = sum(prefill) + len(prompt_lens) * (head + decode)
        t = max(compute, math.ceil(len(prompt_lens) / c) * output_len * read)
    first = sorted(prefill[:c])  # sent together: shortest first is the least mean wait
    ttft = [sum(first[:k + 1]) for k in range(len(first))] + prefill[c:]
    return t, sum(ttft) / len(ttft)


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
