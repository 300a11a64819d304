"""A random-weight hybrid GGUF file at real layer shapes, written as llama.cpp's converter writes the architecture,
for speed comparisons (no package on the index ships these weights): Qwen 3.5 at the 0.8B's shapes (``qwen35``) or
LFM2 at the 350M's (``lfm2``).

    python tools/scripts/random_hybrid_gguf.py /tmp/q35-0.8b-f16.gguf --shape qwen35-0.8b
    llama-quantize /tmp/q35-0.8b-f16.gguf /tmp/q35-0.8b-q4km.gguf Q4_K_M

The vocabulary is the default model's (SmolLM2's 49152 tokens, so a tied head is smaller than the real models':
Qwen 3.5 0.8B's 254M weights, LFM2's 67M); weights N(0, 0.02), norms 1, A in [1, 16], dt_bias 1, F16 (the norms and
small vectors F32, as the converter keeps them)."""

from __future__ import annotations

import argparse

import gguf
import numpy as np

from pagedllm.config import default_model_path
from pagedllm.gguf_file import GGUFFile

SHAPES = {
    "qwen35-0.8b": dict(arch="qwen35", hidden=1024, layers=24, inter=3584, heads=8, kv_heads=2, head_dim=256,
                        k_heads=16, v_heads=16, k_dim=128, v_dim=128, conv=4, interval=4),
    # LFM2-350M: attention on layers 2, 5, 8, 10, 12 and 14, short convolutions (kernel 3) elsewhere
    "lfm2-350m": dict(arch="lfm2", hidden=1024, layers=16, inter=4608, heads=16, kv_heads=8, head_dim=64, conv=3,
                      attention=(2, 5, 8, 10, 12, 14)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--shape", default="qwen35-0.8b", choices=sorted(SHAPES))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    s = SHAPES[a.shape]
    rng = np.random.default_rng(a.seed)
    src = GGUFFile(default_model_path())
    tokens = src.get("tokenizer.ggml.tokens")
    lfm2 = s["arch"] == "lfm2"
    w = gguf.GGUFWriter(a.out, s["arch"])
    w.add_block_count(s["layers"])
    w.add_context_length(32768)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["inter"])
    w.add_head_count(s["heads"])
    attention = [i in s["attention"] if lfm2 else (i + 1) % s["interval"] == 0 for i in range(s["layers"])]
    w.add_head_count_kv([s["kv_heads"] if att else 0 for att in attention] if lfm2 else s["kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6 if lfm2 else 1e7)
    if lfm2:
        w.add_shortconv_l_cache(s["conv"])
    else:
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
    vec("token_embd_norm.weight" if lfm2 else "output_norm.weight", np.ones(h))
    key, value = s.get("k_heads", 0) * s.get("k_dim", 0), s.get("v_heads", 0) * s.get("v_dim", 0)
    for i in range(s["layers"]):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", np.ones(h))
        vec(p + ("ffn_norm.weight" if lfm2 else "post_attention_norm.weight"), np.ones(h))
        if lfm2 and not attention[i]:  # a gated short convolution
            lin(p + "shortconv.in_proj.weight", 3 * h, h)
            vec(p + "shortconv.conv.weight", rng.standard_normal((h, s["conv"])) * 0.2)
            lin(p + "shortconv.out_proj.weight", h, h)
        elif lfm2:  # attention with QK-norm
            lin(p + "attn_q.weight", s["heads"] * s["head_dim"], h)
            lin(p + "attn_k.weight", s["kv_heads"] * s["head_dim"], h)
            lin(p + "attn_v.weight", s["kv_heads"] * s["head_dim"], h)
            lin(p + "attn_output.weight", h, s["heads"] * s["head_dim"])
            vec(p + "attn_q_norm.weight", np.ones(s["head_dim"]))
            vec(p + "attn_k_norm.weight", np.ones(s["head_dim"]))
        elif not attention[i]:  # Gated DeltaNet
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
