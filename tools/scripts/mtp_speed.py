"""Decode speed with Qwen 3.5's multi-token prediction layer drafting (``"method": "mtp"``), at the 0.8B's layer
shapes with random weights (no package on the index ships a Qwen 3.5 checkpoint): an HF directory in bfloat16
(SmolLM2's vocabulary, a random MTP module beside the model), then 120-token prompts and 64 greedy tokens each
without speculation and with the module at k = 1 (its own drafts: random weights, so every one is rejected) and,
as an oracle, k = 1 and 2 with the verified drafts replaced by the model's own greedy continuation (the module
still runs, so its cost is in the figure). Tokens must equal the run without speculation.

    python3 -m tools.scripts.mtp_speed /tmp/q35-mtp --prompts 1
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

from pagedllm import LLM, SamplingParams

SHAPE = dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=3584, num_attention_heads=8,
             num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
             linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
             max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)


def build(path: str) -> None:
    """The directory: transformers' Qwen 3.5 at ``SHAPE`` (its own random init) and a random MTP module (the
    test's reference module, tests/model/test_mtp.py, at transformers' init scale)."""
    import transformers as tf
    from safetensors.torch import save_file

    sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "..", "tests", d) for d in ("model", "")]
    from test_mtp import Reference

    tok = LLM(max_model_len=256)
    torch.manual_seed(0)
    model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(vocab_size=tok.engine.core.vocab_size, **SHAPE)).eval()
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    tok.get_tokenizer().save_pretrained(path)
    ref = Reference(model.float())
    with torch.no_grad():  # the reference's weights were scaled 8x for confident choices; speed needs none
        for p in [*ref.layer.parameters(), *ref.fc.parameters()]:
            if p.dim() > 1:
                p.div_(8.0)
    save_file({k: v.to(torch.bfloat16) for k, v in ref.tensors().items()}, os.path.join(path, "mtp.safetensors"))


def timed(llm: LLM, prompts: list, label: str) -> list:
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t
    st = llm.engine.core.stats()
    print(f"{label}: {len(prompts) * 64 / dt:.1f} tok/s ({dt:.2f} s), acceptance "
          f"{st.spec_num_accepted_tokens / max(1, st.spec_num_draft_tokens):.2f}", flush=True)
    return [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--prompts", type=int, default=1)
    a = ap.parse_args()
    if not os.path.exists(os.path.join(a.dir, "mtp.safetensors")):
        build(a.dir)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(120)] for _ in range(a.prompts)]
    base = LLM(model=a.dir, max_model_len=512)
    print(f"dtype {base.engine.core.runner.dtype}, {a.prompts} prompt(s)")
    want = timed(base, prompts, "no speculation")
    base.engine.shutdown()
    ref = {tuple(p): w for p, w in zip(prompts, want)}
    for k, oracle in ((1, False), (1, True), (2, True)):
        llm = LLM(model=a.dir, max_model_len=512, speculative_config={"method": "mtp", "num_speculative_tokens": k})
        if oracle:
            prop = llm.engine.core.runner.proposer
            inner = prop._propose_mtp

            def drafts(budget, requests, tables, inner=inner):
                res = inner(budget, requests, tables)
                for rid, dr in res.items():
                    st = requests[rid]
                    n = len(st.output_token_ids)
                    res[rid] = list(ref[tuple(st.prompt_token_ids)][n : n + len(dr)]) or dr
                return res

            prop._propose_mtp = drafts
        got = timed(llm, prompts, f"mtp k={k} ({'oracle' if oracle else 'its own'} drafts)")
        print(f"  tokens as without speculation: {sum(g == w for g, w in zip(got, want))} / {len(want)}")
        llm.engine.shutdown()


if __name__ == "__main__":
    main()
