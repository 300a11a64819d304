#include "qlinear.h"
#include "ops.h"

namespace pagedllm {

// AMX needs the kernel's leave to use the tile state (Linux 5.16+: arch_prctl ARCH_REQ_XCOMP_PERM, asked once per
// process); without it (an older kernel, a hypervisor that hides it) the first tile instruction would fault, so
// qlinear keeps the VNNI tiles. set_qlinear_amx(false) turns AMX off (the tests compare both; a benchmark's A/B).
namespace {
std::atomic<bool> amx_wanted{true};
bool amx_granted() {
#if defined(PAGEDLLM_QAMX)
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
#else
  return false;
#endif
}
}  // namespace

bool amx_enabled() { return amx_wanted.load(std::memory_order_relaxed) && amx_granted(); }

bool bf16_tiles_enabled() {
#if defined(PAGEDLLM_QAMX_BF16)
  return amx_enabled();
#else
  return false;
#endif
}

bool set_qlinear_amx(bool on) {
  amx_wanted.store(on);
  return amx_enabled();
}

namespace {
// Calls f with the QScales view of d and m (float32 or float16, 1 or 2 scales per block of 32) and the table of
// 4-bit codes (16 uint8 values < 128), if any.
// With a table and no offsets, table_zero > 0: each offset is -table_zero * d (TScales).
template <typename F>
void with_qscales(const at::Tensor& d, const at::Tensor& m, int64_t bits, int64_t N, int64_t K,
                  const std::optional<at::Tensor>& table, int64_t table_zero, F&& f) {
  const int64_t NG = (N + 7) / 8, nb = K / QB;
  const bool half = d.scalar_type() == at::kHalf, offsets = m.numel() > 0;
  const int64_t per_sub = NG * nb * 8, sub = d.numel() == 2 * per_sub ? 2 : 1;
  TORCH_CHECK((half || d.scalar_type() == at::kFloat) && m.scalar_type() == d.scalar_type() && d.is_contiguous() &&
                  m.is_contiguous() && d.numel() == sub * per_sub && (!offsets || m.numel() == d.numel()),
              "qlinear: scales and offsets must be contiguous (ceil(N/8), K/32 * 8) or (ceil(N/8), K/16 * 8), both "
              "float32 or both float16 (offsets may be empty)");
  const bool implied = table.has_value() && !offsets && table_zero > 0;  // offsets -table_zero * d
  TORCH_CHECK(bits != 4 || offsets || implied, "qlinear: 4-bit codes need their offsets (or a table's zero)");
  const uint8_t* tab = nullptr;
  if (table) {
    TORCH_CHECK(bits == 4 && table->scalar_type() == at::kByte && table->is_contiguous() && table->numel() == 16 &&
                    table->device().is_cpu(), "qlinear: a table is 16 uint8 values, for 4-bit codes");
    tab = table->data_ptr<uint8_t>();
    for (int i = 0; i < 16; ++i)  // NEON's sdot reads them as signed bytes, vpmaddubsw needs them below 128
      TORCH_CHECK(tab[i] < 128, "qlinear: a table's values must be below 128, got ", int(tab[i]));
  }
  if (implied) {  // a scale per block of 32 (MXFP4's)
    TORCH_CHECK(sub == 1, "qlinear: offsets implied by a table's zero need one scale per block of 32");
    const float zero = static_cast<float>(table_zero);
    if (half) return f(TScales<2>{d.data_ptr(), nb, tab, zero});
    return f(TScales<4>{d.data_ptr(), nb, tab, zero});
  }
  with_sub(sub, [&](auto sub_tag) {
    constexpr int S = decltype(sub_tag)::value;
    if constexpr (S == 1) {  // a scale per 32: typed loads (QScales' WIDTH)
      if (half && offsets)
        f(QScales<true, 1, 2>{d.data_ptr(), m.data_ptr(), 1, nb, tab});
      else if (half)
        f(QScales<false, 1, 2>{d.data_ptr(), nullptr, 1, nb, tab});
      else if (offsets)
        f(QScales<true, 1, 4>{d.data_ptr(), m.data_ptr(), 2, nb, tab});
      else
        f(QScales<false, 1, 4>{d.data_ptr(), nullptr, 2, nb, tab});
    } else if (offsets) {  // a scale per 16: the width told at run time
      f(QScales<true, S>{d.data_ptr(), m.data_ptr(), scale_shift(half), nb, tab});
    } else {
      f(QScales<false, S>{d.data_ptr(), nullptr, scale_shift(half), nb, tab});
    }
  });
}
}  // namespace

// x: (M, K) float32/bfloat16; w: (ceil(N/8), K/32 * bits*32) uint8 in the interleaved layout (qlinear.h);
// d, m: (ceil(N/8), K/32 * sub * 8), both float32 or both float16, sub 1 or 2 scales per block (2: blocks of 16);
// m empty: every offset 0 (8-bit codes only). Returns (M, N) in x's dtype.
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d, const at::Tensor& m, int64_t bits,
                   int64_t N, int64_t levels, const std::optional<at::Tensor>& table, int64_t table_zero) {
  check_qlinear(x, w, bits, N);
  auto y = at::empty({x.size(0), N}, x.options());
  with_qscales(d, m, bits, N, x.size(1), table, table_zero,
               [&](const auto& sc) { qlinear_run(x, w, bits, N, sc, y, levels); });
  return y;
}

// Weight rows 8 g0 .. min(8 g1, N) - 1 of qlinear's w, d, m, decoded to bfloat16: (rows, K).
at::Tensor qweight_bf16(const at::Tensor& w, const at::Tensor& d, const at::Tensor& m, int64_t bits, int64_t N,
                        int64_t g0, int64_t g1, const std::optional<at::Tensor>& table, int64_t table_zero) {
  const int64_t K = decoded_weight_inputs(w, bits, N);
  at::Tensor y;
  with_qscales(d, m, bits, N, K, table, table_zero,
               [&](const auto& sc) { y = dequant_run(w, bits, N, K, sc, g0, g1); });
  return y;
}

}  // namespace pagedllm
