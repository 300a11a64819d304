#include "qlinear.h"
#include "ops.h"

namespace pagedllm {

namespace {
// Calls f with the KScales view of s, mn, D, Dm (checked against N and K).
template <typename F>
void with_kscales(const at::Tensor& s, const at::Tensor& mn, const at::Tensor& D, const at::Tensor& Dm, int64_t bits,
                  int64_t N, int64_t K, F&& f) {
  const int64_t NG = (N + 7) / 8, nb = K / QB;
  TORCH_CHECK(K % (8 * QB) == 0, "qlinear_k: in_features ", K, " is not a multiple of 256");
  const bool offsets = mn.numel() > 0;
  const int64_t per_sub = NG * nb * 8, sub = s.numel() == 2 * per_sub ? 2 : 1;
  auto ok = [](const at::Tensor& t, at::ScalarType st, int64_t n) {
    return t.scalar_type() == st && t.is_contiguous() && t.numel() == n;
  };
  TORCH_CHECK(ok(s, at::kChar, sub * per_sub) && ok(D, at::kHalf, NG * (nb / 8) * 8) &&
                  (!offsets || (ok(mn, at::kChar, sub * per_sub) && ok(Dm, at::kHalf, D.numel()))),
              "qlinear_k: sub-scales (and offsets) must be contiguous int8 (ceil(N/8), K/32 * sub * 8), "
              "super-block scales contiguous float16 (ceil(N/8), K/256 * 8)");
  TORCH_CHECK(bits != 4 || offsets, "qlinear_k: 4-bit codes need their offsets");
  const at::Half* dp = D.data_ptr<at::Half>();
  with_sub(sub, [&](auto sub_tag) {
    constexpr int S = decltype(sub_tag)::value;
    const int8_t* sp = s.data_ptr<int8_t>();
    if (offsets)
      f(KScales<true, S>{dp, sp, Dm.data_ptr<at::Half>(), mn.data_ptr<int8_t>(), nb});
    else
      f(KScales<false, S>{dp, sp, dp, sp, nb});
  });
}
}  // namespace

// qlinear with GGUF K-quant scales (KScales): s, mn: (ceil(N/8), K/32 * sub * 8) int8 sub-block scales and offsets
// (mn empty: none), D, Dm: (ceil(N/8), K/256 * 8) float16 super-block scales; a block's scale is D * s and its
// offset Dm * mn. K is a multiple of 256.
at::Tensor qlinear_k(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, const at::Tensor& mn,
                     const at::Tensor& D, const at::Tensor& Dm, int64_t bits, int64_t N, int64_t levels) {
  check_qlinear(x, w, bits, N);
  auto y = at::empty({x.size(0), N}, x.options());
  with_kscales(s, mn, D, Dm, bits, N, x.size(1), [&](const auto& sc) { qlinear_run(x, w, bits, N, sc, y, levels); });
  return y;
}

// Weight rows 8 g0 .. min(8 g1, N) - 1 of qlinear_k's weight, decoded to bfloat16: (rows, K).
at::Tensor qweight_k_bf16(const at::Tensor& w, const at::Tensor& s, const at::Tensor& mn, const at::Tensor& D,
                          const at::Tensor& Dm, int64_t bits, int64_t N, int64_t g0, int64_t g1) {
  const int64_t K = decoded_weight_inputs(w, bits, N);
  at::Tensor y;
  with_kscales(s, mn, D, Dm, bits, N, K, [&](const auto& sc) { y = dequant_run(w, bits, N, K, sc, g0, g1); });
  return y;
}

}  // namespace pagedllm
