// pagedllm's fused CPU kernels: the small per-layer operations of a decode step, each one pass over memory.
//
// - decode_attention: one query token per sequence over its paged K/V, read in place through the block table
//   (no gathered copy of the context), grouped-query aware, float32 accumulation;
// - rms_norm / add_rms_norm: RMSNorm, optionally after adding the residual branch in place; qk_norm: per head;
// - rope_write_kv: rotary embedding of q (in place) and k, with k and v written straight into their cache slots;
// - silu_and_mul / gelu_tanh_and_mul / swiglu_oai_and_mul: SiLU(gate) * up, GELU-tanh(gate) * up, gpt-oss's clamped
//   SwiGLU, of the fused gate/up projection;
// - qlinear / qlinear_k: x W^T with W in GGUF-style blocks (qlinear.cpp); dense_linear: x W^T for float32 weights
//   (dense.cpp); argmax_rows: greedy sampling's first maximum.
// Float32 and bfloat16 tensors; arithmetic in float32, one rounding at the end. Rows are split over torch's
// intra-op threads (at::parallel_for), so the kernels share the OpenMP team of the matmuls around them.

#include <torch/csrc/utils/pybind.h>

#include "ops.h"

using namespace pagedllm;

namespace {
py::buffer_info bytes_of(const py::buffer& raw, const char* op) {
  py::buffer_info info = raw.request();
  TORCH_CHECK(info.itemsize == 1, op, ": raw blocks must be a contiguous buffer of bytes");
  for (py::ssize_t d = info.ndim - 1, step = 1; d >= 0; step *= info.shape[d], --d)
    TORCH_CHECK(info.strides[d] == step, op, ": raw blocks must be a contiguous buffer of bytes");
  return info;
}

BlockType block_type(const py::tuple& t) {  // gguf_file.BlockType.kernel_type(): (decoder, values, bytes, bits)
  TORCH_CHECK(t.size() == 4, "a block type is (decoder, values, bytes, code bits)");
  return {t[0].cast<int64_t>(), t[1].cast<int64_t>(), t[2].cast<int64_t>(), t[3].cast<int64_t>()};
}
}  // namespace

// The kernels run without the GIL (as torch's own operators do): the server's event loop thread serves HTTP and
// streams tokens while a step computes, instead of waiting for the kernel to return. Every tensor argument is held
// by the caller for the call.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("decode_attention", &decode_attention, "paged decode attention (one query per sequence; window > 0: its last "
        "window keys; softcap > 0: scores soft-capped; sinks: a float32 logit per query head in each softmax's denominator)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none(), nogil);
  m.def("gated_delta_rows", &gated_delta_rows, "Gated DeltaNet over a step's sequences (seqs: (B, 5) start row, "
        "rows, state slot, snapshot after this many rows or 0, snapshot slot), their conv and recurrent states "
        "updated in place in the pools; returns the gated RMSNorm's output (T, Hv Dv)", py::arg("proj"),
        py::arg("seqs"), py::arg("conv_pool"), py::arg("rec_pool"), py::arg("conv_w"), py::arg("a_neg"),
        py::arg("dt_bias"), py::arg("norm_w"), py::arg("nk"), py::arg("dk"), py::arg("dv"), py::arg("v_tiled"),
        py::arg("eps"), nogil);
  m.def("mamba2_step", &mamba2_step, "Mamba-2's recurrence for one row per sequence (x (B, H, P), dt (B, H), B and "
        "C (B, H, N) float32), the states updated in place in the pool (S, H, P, N) at the slots; returns y "
        "(B, H, P) with the D skip", py::arg("x"), py::arg("dt"), py::arg("b"), py::arg("c"), py::arg("a_neg"),
        py::arg("d"), py::arg("pool"), py::arg("slots"), nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm (out_bf16: float32 rows normalised into bfloat16)", py::arg("h"),
        py::arg("weight"), py::arg("eps"), py::arg("out_bf16") = false, nogil);
  m.def("add_rms_norm", &add_rms_norm, "h += delta in place (delta in h's dtype, or bfloat16 under float32 rows), "
        "then RMSNorm(h) (out_bf16: into bfloat16)", py::arg("h"), py::arg("delta"), py::arg("weight"),
        py::arg("eps"), py::arg("out_bf16") = false, nogil);
  m.def("encoder_attention", &encoder_attention, "an encoder's attention on AMX-BF16 tiles: each span's rows attend "
        "to all of its rows (bfloat16 q, k, v (T, H, D); spans (B, 2) int64)", py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("spans"), py::arg("scale"), nogil);
  m.def("encoder_attention_tiles", &encoder_attention_tiles, "whether encoder_attention runs here (built with "
        "AMX-BF16, the tile state granted, AMX not turned off by set_qlinear_amx)");
  m.def("add_layer_norm", &add_layer_norm, "h = LayerNorm(h + delta) in place (float32 rows, a float32 or bfloat16 "
        "delta); returns the new rows in bfloat16", nogil);
  m.def("qk_norm", &qk_norm, "RMSNorm of each q head and each k head of qkv's rows, in place", nogil);
  m.def("rope_write_kv", &rope_write_kv, "rotary on q (in place) and k; k and v written to the cache", nogil);
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up", nogil);
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "GELU(gate, tanh approximation) * up", nogil);
  m.def("swiglu_oai_and_mul", &swiglu_oai_and_mul, "gpt-oss's clamped SwiGLU: min(gate, 7) * sigmoid(1.702 min(gate, "
        "7)) * (clamp(up, -7, 7) + 1)", nogil);
  m.def("qlinear", &qlinear, "x W^T with W in blocks of 32 (4-bit or 8-bit codes, scale + offset per block); levels "
        "of the activations: 2 (~15 bits), 1 (8 bits) or 0 (bfloat16, the weights decoded to bfloat16 tiles: "
        "bf16_tiles()); table: the 16 values 4-bit codes stand for (MXFP4), with m "
        "empty and table_zero > 0 each offset is -table_zero * d", py::arg("x"), py::arg("w"), py::arg("d"),
        py::arg("m"), py::arg("bits"), py::arg("N"), py::arg("levels") = 2, py::arg("table") = py::none(),
        py::arg("table_zero") = 0, nogil);
  m.def("qlinear_k", &qlinear_k, "qlinear with GGUF K-quant scales: int8 sub-block scales x float16 super-block "
        "scales", py::arg("x"), py::arg("w"), py::arg("s"), py::arg("mn"), py::arg("D"), py::arg("Dm"),
        py::arg("bits"), py::arg("N"), py::arg("levels") = 2, nogil);
  m.def("qweight_bf16", &qweight_bf16, "qlinear's weight rows 8 g0 .. min(8 g1, N) - 1 decoded to bfloat16 "
        "(rows, K)", py::arg("w"), py::arg("d"), py::arg("m"), py::arg("bits"), py::arg("N"), py::arg("g0"),
        py::arg("g1"), py::arg("table") = py::none(), py::arg("table_zero") = 0, nogil);
  m.def("qweight_k_bf16", &qweight_k_bf16, "qlinear_k's weight rows 8 g0 .. min(8 g1, N) - 1 decoded to bfloat16 "
        "(rows, K)", py::arg("w"), py::arg("s"), py::arg("mn"), py::arg("D"), py::arg("Dm"), py::arg("bits"),
        py::arg("N"), py::arg("g0"), py::arg("g1"), nogil);
  m.def("dense_linear", &dense_linear, "x W^T (+ bias), float32; each output's sum in one order whatever the "
        "number of rows (dense.cpp)", py::arg("x"), py::arg("w"), py::arg("bias") = py::none(), nogil);
  m.def("argmax_rows", &argmax_rows, "index of each row's first maximum (torch.max(dim=-1).indices)", nogil);
  // raw blocks as any contiguous buffer (a read-only numpy view of the memory-mapped file), read without the GIL
  m.def("gguf_codes", [](py::buffer raw, const py::tuple& type, const at::Tensor& out) {
    const py::buffer_info info = bytes_of(raw, "gguf_codes");
    const BlockType t = block_type(type);
    const py::gil_scoped_release nogil_scope;
    gguf_codes(static_cast<const uint8_t*>(info.ptr), info.size, t, out);
  }, "a tensor's codes (raw blocks: a contiguous byte buffer; type: gguf_file.BlockType.kernel_type()) into out, "
        "one byte per weight (8-bit: value + 128)", py::arg("raw"), py::arg("type"), py::arg("out"));
  m.def("gguf_k_scales", [](py::buffer raw, int64_t block_bytes) {
    const py::buffer_info info = bytes_of(raw, "gguf_k_scales");
    const py::gil_scoped_release nogil_scope;
    return gguf_k_scales(static_cast<const uint8_t*>(info.ptr), info.size, block_bytes);
  }, "Q4_K / Q5_K blocks' 6-bit sub-block scales and mins, (blocks, 16) bytes");
  // parts: (buffer, type, rows, widen[, drop]) each (type: BlockType.kernel_type(), decoder 0 for codes; drop: the
  // buffer is a read-only file mapping whose passed pages may leave the resident set); buffers held by the caller
  m.def("pack_parts", [](const py::list& parts, int64_t bits, int64_t K) {
    std::vector<CodeSource> src;
    for (const auto& item : parts) {
      const auto t = item.cast<py::tuple>();
      TORCH_CHECK(t.size() == 4 || t.size() == 5, "pack_parts: each part is (buffer, type, rows, widen[, drop])");
      const py::buffer_info info = bytes_of(t[0].cast<py::buffer>(), "pack_parts");
      src.push_back({static_cast<const uint8_t*>(info.ptr), static_cast<int64_t>(info.size),
                     block_type(t[1].cast<py::tuple>()), t[2].cast<int64_t>(), t[3].cast<bool>(),
                     t.size() == 5 && t[4].cast<bool>()});
    }
    const py::gil_scoped_release nogil_scope;
    return pack_parts(src, bits, K);
  }, "rows of codes or of raw GGUF blocks (decoded a group of 8 rows at a time, no copy of the tensor), one part "
        "after another, into qlinear's interleaved layout", py::arg("parts"), py::arg("bits"), py::arg("K"));
  m.def("isa", &isa, "the instruction set this build's vector paths use");
  m.def("bf16_tiles", &bf16_tiles_enabled, "whether qlinear's levels 0 (weights decoded to bfloat16 in AMX-BF16 tiles, "
        "bfloat16 activations) runs here: built for AMX-BF16, granted, and AMX not turned off");
  m.def("set_qlinear_amx", &set_qlinear_amx, "qlinear on AMX tiles where built and granted (True) or not; returns "
        "whether it now runs on them", py::arg("on"));
}
