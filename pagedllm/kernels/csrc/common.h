// Shared by the kernel sources: the ATen headers they use, scalar helpers, the vector layer (one set of
// inline functions per path: AVX-512, AVX2 + FMA, NEON, none) and the name of the path compiled in.
#pragma once

// The few ATen headers the kernels use, not <torch/extension.h> (all of torch's C++ API, several times their parse
// time); pybind's headers only in bindings.cpp. The sources compile side by side (one compiler process each), so a
// fresh machine's first build takes about as long as the largest source (qlinear.cpp), not all of them.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

inline float to_f(float x) { return x; }
inline float to_f(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
template <typename T> inline T from_f(float x);
template <> inline float from_f<float>(float x) { return x; }
template <> inline at::BFloat16 from_f<at::BFloat16>(float x) { return at::BFloat16(x); }  // round to nearest even

// rows converted to float32 and back, a vector at a time where AVX2/AVX-512 is there (bf16 rounding: to nearest even)
inline void load_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void load_row(const at::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
  }
#elif defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
  }
#endif
  for (; i < n; ++i) dst[i] = to_f(src[i]);
}
inline void store_row(const float* src, at::BFloat16* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BF16__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
#endif
  for (; i < n; ++i) dst[i] = from_f<at::BFloat16>(src[i]);
}

// A row as float32: the row itself where it is float32 (no copy), else converted into buf (n floats).
inline const float* as_float_row(const float* src, float*, int64_t) { return src; }
inline const float* as_float_row(const at::BFloat16* src, float* buf, int64_t n) {
  load_row(src, buf, n);
  return buf;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Calls f with a value of the element type (float or at::BFloat16) of dtype t; any other dtype is an error.
template <typename F>
void dispatch_float_bf16(at::ScalarType t, const char* kernel, F&& f) {
  if (t == at::kFloat)
    f(float{});
  else if (t == at::kBFloat16)
    f(at::BFloat16{});
  else
    TORCH_CHECK(false, kernel, ": float32 or bfloat16 only");
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

// A paged K or V cache (blocks, block_size, heads, D): each token's heads contiguous, tokens a fixed stride apart
// (heads x D, or a wider row whose first heads x D values are this layer's: layers of different head shapes
// sharing one cache tensor, Gemma 4), a block's tokens one after another.
bool paged_layout(const at::Tensor& c) {
  return c.dim() == 4 && c.stride(3) == 1 && c.stride(2) == c.size(3) && c.stride(1) >= c.size(2) * c.size(3) &&
         c.stride(0) == c.size(1) * c.stride(1);
}

// Work split of the big kernels: each of torch's intra-op threads claims chunks of `chunk` items [b, e) from a shared
// counter until none are left, instead of taking one fixed share. On a 2-core machine the HTTP thread and the load
// generator run beside the step: a fixed split waits for a thread that was descheduled with half of the work still
// to do, here the other thread takes that work over (docs/history.md#figures-from-code-comments). Sequences of
// unequal length balance too.
// Which thread computes an item never changes its arithmetic.
template <typename F>
void parallel_claims(int64_t n, int64_t chunk, const F& f) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t b = next.fetch_add(chunk); b < n; b = next.fetch_add(chunk)) f(b, std::min(n, b + chunk));
  });
}

// ------------------------------------------------------------------ vector layer
// One float vector type per instruction set: 16 lanes (AVX-512), 8 lanes (AVX2 + FMA), 4 lanes (64-bit ARM's NEON),
// or none (the portable scalar loops below serve every other CPU). The kernels are written once against these
// helpers.
#if defined(__AVX512F__)
#define PAGEDLLM_VEC 16
using vf = __m512;
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }   // a*b + c
inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a*b
inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2n(vf x, vf n) { return _mm512_scalef_ps(x, n); }  // x * 2^n
inline float vsum(vf x) { return _mm512_reduce_add_ps(x); }
// lane j = the sum of v[j]'s lanes, for 16 vectors at once: 45 shuffles and adds instead of 16 reductions
inline vf vsumW(const vf* v) {
  vf t[8], u[4];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: v[2k] in even, v[2k+1] in odd positions
    t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k)  // per 128-bit lane: the 4 vectors v[4k..4k+3] in order
    u[k] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const vf w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
  const vf w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}
// bfloat16 pairs: 2W cached values as their even and odd elements, each with one shift or mask of the loaded bits
// (a bfloat16 is the high half of its float32), instead of widening W values at a time
inline void vload_split(const at::BFloat16* p, vf& even, vf& odd) {
  const __m512i raw = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}
// x[0, 2W) held as (lo, hi) <-> its even and odd elements
inline void vsplit(vf lo, vf hi, vf& even, vf& odd) {
  even = _mm512_permutex2var_ps(lo, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), hi);
  odd = _mm512_permutex2var_ps(lo, _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31), hi);
}
inline void vmerge(vf even, vf odd, vf& lo, vf& hi) {
  lo = _mm512_permutex2var_ps(even, _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23), odd);
  hi = _mm512_permutex2var_ps(even, _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31),
                              odd);
}
inline float vhmax(vf x) { return _mm512_reduce_max_ps(x); }
inline int veq_mask(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }  // bit j: lane j equal
inline int vnan_mask(vf x) { return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q); }     // bit j: lane j is NaN
#elif defined(__AVX2__) && defined(__FMA__)
#define PAGEDLLM_VEC 8
using vf = __m256;
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2n(vf x, vf n) {  // x * 2^n for integral n in [-126, 127] (vexp clamps its input so n stays there)
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(x, _mm256_castsi256_ps(e));
}
inline float vsum(vf x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// lane j = the sum of v[j]'s lanes, for 8 vectors at once
inline vf vsumW(const vf* v) {
  const vf t0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // v0..v3: low, high lanes
  const vf t1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}
// as with AVX-512: 16 bfloat16 values as their even and odd elements; (lo, hi) <-> even, odd
inline void vload_split(const at::BFloat16* p, vf& even, vf& odd) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
}
inline void vsplit(vf lo, vf hi, vf& even, vf& odd) {  // shuffles pick per 128-bit lane; the 64-bit permute orders
  even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0))),
                                                _MM_SHUFFLE(3, 1, 2, 0)));
  odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1))),
                                               _MM_SHUFFLE(3, 1, 2, 0)));
}
inline void vmerge(vf even, vf odd, vf& lo, vf& hi) {
  const vf a = _mm256_unpacklo_ps(even, odd), b = _mm256_unpackhi_ps(even, odd);
  lo = _mm256_permute2f128_ps(a, b, 0x20);
  hi = _mm256_permute2f128_ps(a, b, 0x31);
}
inline float vhmax(vf x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline int veq_mask(vf a, vf b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
inline int vnan_mask(vf x) { return _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define PAGEDLLM_VEC 4
using vf = float32x4_t;
inline vf vload(const float* p) { return vld1q_f32(p); }
inline void vstore(float* p, vf x) { vst1q_f32(p, x); }
inline vf vset1(float x) { return vdupq_n_f32(x); }
inline vf vzero() { return vdupq_n_f32(0.f); }
inline vf vadd(vf a, vf b) { return vaddq_f32(a, b); }
inline vf vsub(vf a, vf b) { return vsubq_f32(a, b); }
inline vf vmul(vf a, vf b) { return vmulq_f32(a, b); }
inline vf vdiv(vf a, vf b) { return vdivq_f32(a, b); }
inline vf vmax(vf a, vf b) { return vmaxq_f32(a, b); }
inline vf vmin(vf a, vf b) { return vminq_f32(a, b); }
inline vf vfma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
inline vf vfnma(vf a, vf b, vf c) { return vfmsq_f32(c, a, b); }
inline vf vround(vf x) { return vrndnq_f32(x); }  // to nearest, ties to even
inline vf vpow2n(vf x, vf n) {  // x * 2^n for integral n in [-126, 127]
  const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23);
  return vmulq_f32(x, vreinterpretq_f32_s32(e));
}
inline float vsum(vf x) { return vaddvq_f32(x); }
inline vf vsumW(const vf* v) {  // lane j = the sum of v[j]'s lanes: pairwise adds
  return vpaddq_f32(vpaddq_f32(v[0], v[1]), vpaddq_f32(v[2], v[3]));
}
inline void vload_split(const at::BFloat16* p, vf& even, vf& odd) {  // 8 bfloat16 values as even and odd elements
  const uint32x4_t raw = vreinterpretq_u32_u16(vld1q_u16(reinterpret_cast<const uint16_t*>(p)));
  even = vreinterpretq_f32_u32(vshlq_n_u32(raw, 16));
  odd = vreinterpretq_f32_u32(vandq_u32(raw, vdupq_n_u32(0xFFFF0000u)));
}
inline void vsplit(vf lo, vf hi, vf& even, vf& odd) {
  even = vuzp1q_f32(lo, hi);
  odd = vuzp2q_f32(lo, hi);
}
inline void vmerge(vf even, vf odd, vf& lo, vf& hi) {
  lo = vzip1q_f32(even, odd);
  hi = vzip2q_f32(even, odd);
}
inline float vhmax(vf x) { return vmaxvq_f32(x); }
inline int vbits(uint32x4_t m) {  // bit j: lane j all ones
  const uint32x4_t bit = {1u, 2u, 4u, 8u};
  return static_cast<int>(vaddvq_u32(vandq_u32(m, bit)));
}
inline int veq_mask(vf a, vf b) { return vbits(vceqq_f32(a, b)); }
inline int vnan_mask(vf x) { return vbits(vmvnq_u32(vceqq_f32(x, x))); }
#else
#define PAGEDLLM_VEC 0
#endif

#if PAGEDLLM_VEC
constexpr int W = PAGEDLLM_VEC;
// e^x (softmax after subtracting the max, SiLU): x = n ln2 + r, |r| <= ln2/2, e^r by its Taylor series to r^7
// (relative error < 1e-8, under float32's precision), times 2^n. The input is clamped to [-87, 88]: e^x then
// stays a normal float (under 1e-37 at the low end, where softmax and SiLU need 0 to within float32 rounding).
inline vf vexp(vf x) {
  x = vmin(vmax(x, vset1(-87.f)), vset1(88.f));
  const vf n = vround(vmul(x, vset1(1.44269504088896341f)));
  vf r = vfnma(n, vset1(0.693359375f), x);  // ln2 split in a high and a low part
  r = vfnma(n, vset1(-2.12194440e-4f), r);
  vf p = vset1(1.f / 5040);
  p = vfma(p, r, vset1(1.f / 720));
  p = vfma(p, r, vset1(1.f / 120));
  p = vfma(p, r, vset1(1.f / 24));
  p = vfma(p, r, vset1(1.f / 6));
  p = vfma(p, r, vset1(0.5f));
  p = vfma(p, r, vset1(1.f));
  p = vfma(p, r, vset1(1.f));
  return vpow2n(p, n);
}

// Into L2, not L1: a burst of L1 prefetches for a whole KV block (192 lines) waits on L1's few miss buffers, slower
// than L2 prefetches (or none) for decode attention (docs/history.md#figures-from-code-comments).
inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) {
#if defined(__x86_64__) || defined(_M_X64)
    _mm_prefetch(static_cast<const char*>(p) + off, _MM_HINT_T1);
#else
    __builtin_prefetch(static_cast<const char*>(p) + off, 0, 2);
#endif
  }
}
#endif

// The vector path's name, kept in the binary as data even where isa() folds it into code: the tests read it from
// objects cross-compiled for CPUs that cannot load them.
[[gnu::used]] constexpr char VECTOR_ISA[] =
#if defined(__AVX512F__)
    "pagedllm-vector-path:avx512";
#elif PAGEDLLM_VEC == 8
    "pagedllm-vector-path:avx2";
#elif PAGEDLLM_VEC == 4 && defined(__ARM_FEATURE_DOTPROD)
    "pagedllm-vector-path:neon+dotprod";  // qlinear's sdot path (qgroup_neon) is in
#elif PAGEDLLM_VEC == 4
    "pagedllm-vector-path:neon";
#else
    "pagedllm-vector-path:scalar";
#endif
inline const char* vector_isa() { return VECTOR_ISA + sizeof("pagedllm-vector-path:") - 1; }

}  // namespace
