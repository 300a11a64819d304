"""A random-weight Qwen 3.5 GGUF file at real layer shapes (default: the 0.8B's), written as llama.cpp's converter
writes the architecture (``qwen35``), for speed comparisons: no package on the index ships Qwen 3.5 weights.

    python tools/scripts/random_qwen35_gguf.py /tmp/q35-0.8b-f16.gguf
    llama-quantize /tmp/q35-0.8b-f16.gguf /tmp/q35-0.8b-q4km.gguf Q4_K_M

The vocabulary is the default model's (SmolLM2's 49152 tokens, so the tied head is 50M weights instead of the
0.8B's 254M); weights N(0, 0.02), norms 1, A in [1, 16], dt_bias 1, F16 (the norms and the small DeltaNet vectors
F32, as the converter keeps them)."""

from __future__ import annotations

import argparse

import gguf
import numpy as np

from pagedllm.config import default_model_path
from pagedllm.gguf_file import GGUFFile

SHAPES = {  # Qwen3.5-0.8B
    "0.8b": dict(hidden=1024, layers=24, inter=3584, heads=8, kv_heads=2, head_dim=256, k_heads=16, v_heads=16,
                 k_dim=128, v_dim=128, conv=4, interval=4),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--shape", default="0.8b", choices=sorted(SHAPES))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    s = SHAPES[a.shape]
    rng = np.random.default_rng(a.seed)
    src = GGUFFile(default_model_path())
    tokens = src.get("tokenizer.ggml.tokens")
    w = gguf.GGUFWriter(a.out, "qwen35")
    w.add_block_count(s["layers"])
    w.add_context_length(32768)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["inter"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e7)
    w.add_rope_dimension_count(s["head_dim"] // 4)
    w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_ssm_conv_kernel(s["conv"])
    w.add_ssm_state_size(s["k_dim"])
    w.add_ssm_group_count(s["k_heads"])
    w.add_ssm_time_step_rank(s["v_heads"])
    w.add_ssm_inner_size(s["v_dim"] * s["v_heads"])
    w.add_full_attention_interval(s["interval"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, fn in (("model", w.add_tokenizer_model), ("pre", w.add_tokenizer_pre), ("tokens", w.add_token_list),
                    ("token_type", w.add_token_types), ("merges", w.add_token_merges)):
        fn(src.get(f"tokenizer.ggml.{key}"))
    w.add_bos_token_id(src.get("tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(src.get("tokenizer.ggml.eos_token_id"))

    def lin(name: str, rows: int, cols: int) -> None:
        w.add_tensor(name, (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16))

    def vec(name: str, values: np.ndarray) -> None:
        w.add_tensor(name, values.astype(np.float32))

    h = s["hidden"]
    lin("token_embd.weight", len(tokens), h)
    vec("output_norm.weight", np.ones(h))
    key, value = s["k_heads"] * s["k_dim"], s["v_heads"] * s["v_dim"]
    for i in range(s["layers"]):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", np.ones(h))
        vec(p + "post_attention_norm.weight", np.ones(h))
        if (i + 1) % s["interval"]:  # Gated DeltaNet
            lin(p + "attn_qkv.weight", 2 * key + value, h)
            lin(p + "attn_gate.weight", value, h)
            lin(p + "ssm_beta.weight", s["v_heads"], h)
            lin(p + "ssm_alpha.weight", s["v_heads"], h)
            vec(p + "ssm_conv1d.weight", rng.standard_normal((2 * key + value, s["conv"])) * 0.2)
            vec(p + "ssm_dt.bias", np.ones(s["v_heads"]))
            vec(p + "ssm_a", -rng.uniform(1, 16, s["v_heads"]))
            vec(p + "ssm_norm.weight", np.ones(s["v_dim"]))
            lin(p + "ssm_out.weight", h, value)
        else:  # attention: q with its gate rows, QK-norm
            lin(p + "attn_q.weight", 2 * s["heads"] * s["head_dim"], h)
            lin(p + "attn_k.weight", s["kv_heads"] * s["head_dim"], h)
            lin(p + "attn_v.weight", s["kv_heads"] * s["head_dim"], h)
            lin(p + "attn_output.weight", h, s["heads"] * s["head_dim"])
            vec(p + "attn_q_norm.weight", np.ones(s["head_dim"]))
            vec(p + "attn_k_norm.weight", np.ones(s["head_dim"]))
        lin(p + "ffn_gate.weight", s["inter"], h)
        lin(p + "ffn_up.weight", s["inter"], h)
        lin(p + "ffn_down.weight", h, s["inter"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
