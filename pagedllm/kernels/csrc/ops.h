// The kernels the module exports (bindings.cpp), defined in attention.cpp, deltanet.cpp, dense.cpp, qlinear.cpp,
// qlinear_k.cpp and pack.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace pagedllm {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            int64_t window, double softcap, const std::optional<at::Tensor>& sinks);
at::Tensor rms_norm(at::Tensor h, const at::Tensor& weight, double eps, bool out_bf16);
at::Tensor add_rms_norm(at::Tensor h, const at::Tensor& delta, const at::Tensor& weight, double eps, bool out_bf16);
at::Tensor add_layer_norm(at::Tensor h, const at::Tensor& delta, const at::Tensor& weight, const at::Tensor& bias,
                          double eps);
void qk_norm(at::Tensor qkv, const at::Tensor& q_weight, const at::Tensor& k_weight, int64_t nq, int64_t nkv,
             double eps);
void rope_write_kv(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                   const at::Tensor& slots, at::Tensor k_cache, at::Tensor v_cache, int64_t nq, int64_t nkv);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
at::Tensor gelu_tanh_and_mul(const at::Tensor& gate_up);
at::Tensor swiglu_oai_and_mul(const at::Tensor& gate_up);
at::Tensor argmax_rows(const at::Tensor& x);
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);
at::Tensor gated_delta_rows(const at::Tensor& proj, const at::Tensor& seqs, at::Tensor conv_pool, at::Tensor rec_pool,
                            const at::Tensor& conv_w, const at::Tensor& a_neg, const at::Tensor& dt_bias,
                            const at::Tensor& norm_w, int64_t nk, int64_t dk, int64_t dv, bool v_tiled, double eps);
at::Tensor mamba2_step(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& b, const at::Tensor& c,
                       const at::Tensor& a_neg, const at::Tensor& d, at::Tensor pool, const at::Tensor& slots);
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d, const at::Tensor& m, int64_t bits,
                   int64_t N, int64_t levels = 2, const std::optional<at::Tensor>& table = std::nullopt,
                   int64_t table_zero = 0);
at::Tensor qlinear_k(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, const at::Tensor& mn,
                     const at::Tensor& D, const at::Tensor& Dm, int64_t bits, int64_t N, int64_t levels = 2);
at::Tensor qweight_bf16(const at::Tensor& w, const at::Tensor& d, const at::Tensor& m, int64_t bits, int64_t N,
                        int64_t g0, int64_t g1, const std::optional<at::Tensor>& table = std::nullopt,
                        int64_t table_zero = 0);
at::Tensor qweight_k_bf16(const at::Tensor& w, const at::Tensor& s, const at::Tensor& mn, const at::Tensor& D,
                          const at::Tensor& Dm, int64_t bits, int64_t N, int64_t g0, int64_t g1);
// a GGUF block type as Python's table gives it (gguf_file.py BlockType.kernel_type): its one-pass decoder (0: the
// rows are codes already, K bytes a row), values and bytes per block, and the bits of the codes it gives
struct BlockType { int64_t decoder, block, bytes, bits; };
void gguf_codes(const uint8_t* raw, int64_t nbytes, const BlockType& type, const at::Tensor& out);
at::Tensor gguf_k_scales(const uint8_t* raw, int64_t nbytes, int64_t block_bytes);
// a part of pack_parts: rows of codes or of a GGUF type's raw blocks, read in place
// drop: the rows are pages of a read-only file mapping (a GGUF file), which pack_parts drops from the process's
// resident set as it passes them (never set for memory of the process's own: that would be zeroed)
struct CodeSource { const uint8_t* data; int64_t nbytes; BlockType type; int64_t rows; bool widen; bool drop = false; };
at::Tensor pack_parts(const std::vector<CodeSource>& parts, int64_t bits, int64_t K);
std::string isa();
bool amx_enabled();
bool bf16_tiles_enabled();
bool encoder_attention_tiles();
at::Tensor encoder_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& spans,
                             double scale);
bool set_qlinear_amx(bool on);

}  // namespace pagedllm
