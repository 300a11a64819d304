"""Embeddings of a GGUF file against HF transformers' own hidden states of the same file: the cosine of each
prompt's vector (last-token and mean pooling) for ``--dtype float32`` and the default path.

    python tools/scripts/embeddings_vs_hf.py ~/.cache/pagedllm/models/qwen2.5-coder-0.5b-instruct-q4.gguf
"""

import argparse

import torch

from pagedllm import LLM
from pagedllm.reference.hf import load_hf_reference

PROMPTS = ["def quicksort(arr):", "The capital of France is Paris. It is known for", "SELECT name FROM users WHERE"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a .gguf file transformers can load")
    args = p.parse_args()
    _, hf = load_hf_reference("float32", args.model)
    for dtype in ("float32", "auto"):
        llm = LLM(model=args.model, dtype=dtype, max_model_len=512)
        for pool in ("last", "mean"):
            cos = []
            for o in llm.embed(PROMPTS, pooling=pool, use_tqdm=False):
                with torch.inference_mode():
                    h = hf(torch.tensor([o.prompt_token_ids]), output_hidden_states=True).hidden_states[-1][0].float()
                ref = h[-1] if pool == "last" else h.mean(0)
                cos.append(torch.nn.functional.cosine_similarity(torch.tensor(o.embedding), ref, dim=0).item())
            print(f"--dtype {dtype}, pooling {pool}: cosine to transformers " + " ".join(f"{c:.6f}" for c in cos))
        del llm


if __name__ == "__main__":
    main()
