"""A random-weight GGUF file at real layer shapes of a 2026 architecture, written as llama.cpp's converter writes it,
for speed comparisons (no package on the index ships these weights): Qwen 3.5 at the 0.8B's shapes (``qwen35``),
LFM2 at the 350M's (``lfm2``), Gemma 4 at the E2B's (``gemma4``: 35 layers, a full one every 5th, the last 20
reading the K/V of layers 13 / 14, per-layer inputs of 256) or Granite 4.0-H at a Micro-like shape
(``granitehybrid``: 40 layers, 4 of them attention, Mamba-2 with 64 heads of 64 and a state of 128).

    python tools/scripts/random_hybrid_gguf.py /tmp/q35-0.8b-f16.gguf --shape qwen35-0.8b
    llama-quantize /tmp/q35-0.8b-f16.gguf /tmp/q35-0.8b-q4km.gguf Q4_K_M

The vocabulary is the default model's (SmolLM2's 49152 tokens, so a tied head is smaller than the real models':
Qwen 3.5 0.8B's 254M weights, LFM2's 67M, Gemma 4 E2B's 403M and its per-layer-input table's 2.35G); weights
N(0, 0.02), norms 1, A in [1, 16], dt_bias 1, F16 (the norms and small vectors F32, as the converter keeps them)."""

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
    # Granite 4.0-H Micro-like: 40 layers, attention (16 / 4 heads of 128, no rotary) on 4 of them, Mamba-2 elsewhere
    "granite-4.0-h-micro": dict(arch="granitehybrid", hidden=2048, layers=40, inter=8192, heads=16, kv_heads=4,
                                head_dim=128, m_heads=64, m_state=128, m_groups=1, conv=4, attention=(9, 19, 29, 39)),
    "gemma4-e2b": dict(arch="gemma4", hidden=1536, layers=35, inter=6144, heads=8, kv_heads=1, head_dim=256,
                       global_head_dim=512, window=512, shared=20, per_layer=256),
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
    if s["arch"] == "gemma4":
        _gemma4(w, s, rng, src)
        return
    if s["arch"] == "granitehybrid":
        _granite(w, s, rng, src)
        return
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
    lin, vec = _writers(w, rng, src)
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
    _close(w)


def _writers(w, rng, src):
    """The file type and the default model's vocabulary written; (lin, vec): add a random F16 matrix, an F32
    vector."""
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

    return lin, vec


def _close(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _granite(w, s: dict, rng, src) -> None:
    """Granite 4.0-H as llama.cpp's converter writes it: per-layer KV heads (0 on the Mamba layers), A as
    -exp(A_log), the norm per group, the dense MLP as ffn_gate / ffn_up / ffn_down, no rotary."""
    n, h, inner = s["layers"], s["hidden"], 2 * s["hidden"]
    mh, ns, g = s["m_heads"], s["m_state"], s["m_groups"]
    conv_dim = inner + 2 * g * ns
    w.add_block_count(n)
    w.add_context_length(32768)
    w.add_embedding_length(h)
    w.add_feed_forward_length(s["inter"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv([s["kv_heads"] if i in s["attention"] else 0 for i in range(n)])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_ssm_conv_kernel(s["conv"])
    w.add_ssm_state_size(ns)
    w.add_ssm_group_count(g)
    w.add_ssm_inner_size(inner)
    w.add_ssm_time_step_rank(mh)
    w.add_rope_scaling_finetuned(False)
    w.add_embedding_scale(12.0)
    w.add_residual_scale(0.22)
    w.add_attention_scale(0.0078125)
    w.add_logit_scale(8.0)
    lin, vec = _writers(w, rng, src)
    lin("token_embd.weight", len(src.get("tokenizer.ggml.tokens")), h)
    vec("output_norm.weight", np.ones(h))
    for i in range(n):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", np.ones(h))
        vec(p + "ffn_norm.weight", np.ones(h))
        if i in s["attention"]:
            lin(p + "attn_q.weight", s["heads"] * s["head_dim"], h)
            lin(p + "attn_k.weight", s["kv_heads"] * s["head_dim"], h)
            lin(p + "attn_v.weight", s["kv_heads"] * s["head_dim"], h)
            lin(p + "attn_output.weight", h, s["heads"] * s["head_dim"])
        else:
            lin(p + "ssm_in.weight", inner + conv_dim + mh, h)
            vec(p + "ssm_conv1d.weight", rng.standard_normal((conv_dim, s["conv"])) * 0.2)
            vec(p + "ssm_conv1d.bias", np.zeros(conv_dim))
            vec(p + "ssm_dt.bias", np.ones(mh))
            vec(p + "ssm_a", -rng.uniform(1, 16, (mh, 1)))
            vec(p + "ssm_d", np.ones((mh, 1)))
            vec(p + "ssm_norm.weight", np.ones((g, inner // g)))
            lin(p + "ssm_out.weight", h, inner)
        lin(p + "ffn_gate.weight", s["inter"], h)
        lin(p + "ffn_up.weight", s["inter"], h)
        lin(p + "ffn_down.weight", h, s["inter"])
    _close(w)


def _gemma4(w, s: dict, rng, src) -> None:
    """Gemma 4 as llama.cpp's converter writes it: per-layer feed-forward sizes (the K/V-sharing layers' twice as
    wide), the sliding pattern, both head sizes, ``rope_freqs`` for the full layers' proportional rotary."""
    n, h, hd, ghd, ple = s["layers"], s["hidden"], s["head_dim"], s["global_head_dim"], s["per_layer"]
    sliding = [i % 5 != 4 for i in range(n)]
    first_shared = n - s["shared"]
    inter = [s["inter"] * (2 if i >= first_shared else 1) for i in range(n)]
    w.add_block_count(n)
    w.add_context_length(32768)
    w.add_embedding_length(h)
    w.add_feed_forward_length(inter)
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(ghd)
    w.add_value_length(ghd)
    w.add_key_length_swa(hd)
    w.add_value_length_swa(hd)
    w.add_rope_freq_base(1e6)
    w.add_rope_freq_base_swa(1e4)
    w.add_rope_dimension_count(ghd)
    w.add_rope_dimension_count_swa(hd)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(s["window"])
    w.add_sliding_window_pattern(sliding)
    w.add_shared_kv_layers(s["shared"])
    w.add_embedding_length_per_layer_input(ple)
    w.add_final_logit_softcapping(30.0)
    lin, vec = _writers(w, rng, src)
    vocab = len(src.get("tokenizer.ggml.tokens"))
    lin("token_embd.weight", vocab, h)
    lin("per_layer_token_embd.weight", vocab, n * ple)
    lin("per_layer_model_proj.weight", n * ple, h)
    vec("per_layer_proj_norm.weight", np.ones(ple))
    vec("rope_freqs.weight", np.array([1.0] * (ghd // 8) + [1e30] * (ghd // 2 - ghd // 8)))
    vec("output_norm.weight", np.ones(h))
    for i in range(n):
        p, d = f"blk.{i}.", hd if sliding[i] else ghd
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm", "post_norm"):
            vec(p + norm + ".weight", np.ones(h))
        lin(p + "attn_q.weight", s["heads"] * d, h)
        vec(p + "attn_q_norm.weight", np.ones(d))
        if i < first_shared:
            lin(p + "attn_k.weight", s["kv_heads"] * d, h)
            lin(p + "attn_v.weight", s["kv_heads"] * d, h)
            vec(p + "attn_k_norm.weight", np.ones(d))
        lin(p + "attn_output.weight", h, s["heads"] * d)
        lin(p + "ffn_gate.weight", inter[i], h)
        lin(p + "ffn_up.weight", inter[i], h)
        lin(p + "ffn_down.weight", h, inter[i])
        lin(p + "inp_gate.weight", ple, h)
        lin(p + "proj.weight", h, ple)
        vec(p + "layer_output_scale.weight", np.array([0.5]))
    _close(w)


if __name__ == "__main__":
    main()
