// pagedllm's fused CPU kernels: the small per-layer operations of a decode step, each one pass over memory.
//
// - decode_attention: one query token per sequence over its paged K/V, read in place through the block table
//   (no gathered copy of the context), grouped-query aware, float32 accumulation;
// - rms_norm / add_rms_norm: RMSNorm, optionally after adding the residual branch in place;
// - rope_write_kv: rotary embedding of q (in place) and k, with k and v written straight into their cache slots;
// - silu_and_mul: SiLU(gate) * up of the fused gate/up projection;
// - qlinear: x W^T with W in GGUF-style blocks of 32 (below); argmax_rows: greedy sampling's first maximum.
// Float32 and bfloat16 tensors; arithmetic in float32, one rounding at the end. Rows are split over torch's
// intra-op threads (at::parallel_for), so the kernels share the OpenMP team of the matmuls around them.

// The few ATen headers the kernels use, not <torch/extension.h> (all of torch's C++ API): that halves the build
// (~20 s instead of ~45 s of one core here), which every fresh machine pays once and the x86-level tests pay twice.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>

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

// Work split of the big kernels: each of torch's intra-op threads claims chunks of `chunk` items [b, e) from a shared
// counter until none are left, instead of taking one fixed share. On a 2-core machine the HTTP thread and the load
// generator run beside the step: a fixed split waits for a thread that was descheduled with half of the work still
// to do, here the other thread takes that work over (measured on qlinear with a process busy 10% of a core in
// bursts: 12-15% slower with the fixed split, unchanged with claims). Sequences of unequal length balance too.
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

// Into L2, not L1: a burst of L1 prefetches for a whole KV block (192 lines) waits on L1's few miss buffers and
// measured 13-15% slower than L2 prefetches (or none) for decode attention over 30 layers' blocks.
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
const char* vector_isa() { return VECTOR_ISA + sizeof("pagedllm-vector-path:") - 1; }

// ------------------------------------------------------------------ decode attention

// softmax of s[0..L) in place; returns nothing, leaves probabilities (exact: max, exp, sum, scale). cap > 0: the
// scores are soft-capped first, cap * tanh(s / cap) (gemma 2's attention logits)
inline void softmax_row(float* s, int64_t L, float cap = 0.f) {
  if (cap > 0.f)
    for (int64_t i = 0; i < L; ++i) s[i] = cap * std::tanh(s[i] / cap);
  int64_t t = 0;
  float m = -INFINITY, sum = 0.f;
#if PAGEDLLM_VEC
  vf mx = vset1(-INFINITY);
  for (; t + W <= L; t += W) mx = vmax(mx, vload(s + t));
  m = vhmax(mx);
#endif
  for (; t < L; ++t) m = std::max(m, s[t]);
  t = 0;
#if PAGEDLLM_VEC
  const vf mv = vset1(m);
  vf acc = vzero();
  for (; t + W <= L; t += W) {
    const vf e = vexp(vsub(vload(s + t), mv));
    vstore(s + t, e);
    acc = vadd(acc, e);
  }
  sum = vsum(acc);
#endif
  for (; t < L; ++t) sum += (s[t] = std::exp(s[t] - m));
  const float inv = 1.f / sum;
  for (t = 0; t < L; ++t) s[t] *= inv;
}

#if PAGEDLLM_VEC
// A cached row of NC vectors. From a bfloat16 cache each pair of vectors holds its 2W values' even and odd elements
// (vload_split: one shift or mask per vector, no widening); q and the output accumulators use the same order
// (split and merged once per sequence), so each dot product pairs the same elements as in the natural order.
template <int NC>
inline void load_cached(const float* p, vf* v) {
  for (int c = 0; c < NC; ++c) v[c] = vload(p + c * W);
}
template <int NC>
inline void load_cached(const at::BFloat16* p, vf* v) {
  static_assert(NC % 2 == 0, "bfloat16 rows load in pairs of vectors");
  for (int c = 0; c < NC; c += 2) vload_split(p + c * W, v[c], v[c + 1]);
}
template <int NC>
inline void reorder_rows(float* x, int64_t rows, bool split) {  // rows of NC vectors: natural <-> even/odd pairs
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < NC; c += 2) {
      float* p = x + (r * NC + c) * W;
      vf a, b;
      if (split) vsplit(vload(p), vload(p + W), a, b);
      else vmerge(vload(p), vload(p + W), a, b);
      vstore(p, a);
      vstore(p + W, b);
    }
}

// Vector path for head dims that are a multiple of the vector width (NC chunks): the G query heads of a KV head
// and their output accumulators stay in registers (AVX-512) or L1 (AVX2 spills some) while the context streams
// past. Each block of 16 tokens is one contiguous run of memory (16 x Hkv x D): it is read once, head after
// head, while the next block is prefetched. Only KV heads [h0, h1) are computed (their rows of scores and out).
// qf's rows of those heads are reordered in place for a bfloat16 cache.
template <typename T, int G, int NC>
void attend_seq(float* qf, const T* kc, const T* vc, const int64_t* table, int64_t L, int64_t BS, int64_t Hkv,
                int64_t h0, int64_t h1, float* scores, float* out, int64_t skip, float cap) {
  constexpr int64_t D = NC * W;
  constexpr bool split = std::is_same_v<T, at::BFloat16>;
  const int64_t tok = Hkv * D, blk = BS * tok, nblocks = (L + BS - 1) / BS;
  if constexpr (split) reorder_rows<NC>(qf + h0 * G * D, (h1 - h0) * G, true);
  for (int64_t bi = 0; bi < nblocks; ++bi) {
    const int64_t t0 = bi * BS, n = std::min(BS, L - t0);
    if (bi + 1 < nblocks) prefetch(kc + table[bi + 1] * blk, std::min(BS, L - t0 - BS) * tok * int64_t(sizeof(T)));
    const T* kb = kc + table[bi] * blk;
    for (int64_t h = h0; h < h1; ++h) {
      vf qv[G][NC];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < NC; ++c) qv[g][c] = vload(qf + (h * G + g) * D + c * W);
      int64_t j = 0;
      for (; j + W <= n; j += W) {  // W tokens' dot products summed across lanes together: W scores per vector
        vf acc[G][W];  // a token's row is read once for the G heads: G independent chains of NC steps
        for (int i = 0; i < W; ++i) {
          vf kv[NC];
          load_cached<NC>(kb + (j + i) * tok + h * D, kv);
          for (int g = 0; g < G; ++g) {
            acc[g][i] = vmul(qv[g][0], kv[0]);
            for (int c = 1; c < NC; ++c) acc[g][i] = vfma(qv[g][c], kv[c], acc[g][i]);
          }
        }
        for (int g = 0; g < G; ++g) vstore(scores + (h * G + g) * L + t0 + j, vsumW(acc[g]));
      }
      for (; j < n; ++j) {
        vf kv[NC];
        load_cached<NC>(kb + j * tok + h * D, kv);
        for (int g = 0; g < G; ++g) {
          vf acc = vmul(qv[g][0], kv[0]);
          for (int c = 1; c < NC; ++c) acc = vfma(qv[g][c], kv[c], acc);
          scores[(h * G + g) * L + t0 + j] = vsum(acc);
        }
      }
    }
  }
  if (nblocks > 0) prefetch(vc + table[0] * blk, std::min(BS, L) * tok * int64_t(sizeof(T)));
  for (int64_t r = h0 * G; r < h1 * G; ++r) {
    std::fill(scores + r * L, scores + r * L + skip, 0.f);  // outside the window: weight 0
    softmax_row(scores + r * L + skip, L - skip, cap);
  }
  std::fill(out + h0 * G * D, out + h1 * G * D, 0.f);
  for (int64_t bi = 0; bi < nblocks; ++bi) {
    const int64_t t0 = bi * BS, n = std::min(BS, L - t0);
    if (bi + 1 < nblocks) prefetch(vc + table[bi + 1] * blk, std::min(BS, L - t0 - BS) * tok * int64_t(sizeof(T)));
    const T* vb = vc + table[bi] * blk;
    for (int64_t h = h0; h < h1; ++h) {
      vf o[G][NC];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < NC; ++c) o[g][c] = vload(out + (h * G + g) * D + c * W);
      for (int64_t j = 0; j < n; ++j) {
        vf vv[NC];
        load_cached<NC>(vb + j * tok + h * D, vv);
        for (int g = 0; g < G; ++g) {
          const vf p = vset1(scores[(h * G + g) * L + t0 + j]);
          for (int c = 0; c < NC; ++c) o[g][c] = vfma(p, vv[c], o[g][c]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < NC; ++c) vstore(out + (h * G + g) * D + c * W, o[g][c]);
    }
  }
  if constexpr (split) reorder_rows<NC>(out + h0 * G * D, (h1 - h0) * G, false);
}

template <typename T, int NC>
bool attend_seq_g(int64_t G, float* qf, const T* kc, const T* vc, const int64_t* table, int64_t L, int64_t BS,
                  int64_t Hkv, int64_t h0, int64_t h1, float* scores, float* out, int64_t skip, float cap) {
  switch (G) {
#define PAGEDLLM_G(n) \
  case n: attend_seq<T, n, NC>(qf, kc, vc, table, L, BS, Hkv, h0, h1, scores, out, skip, cap); return true;
    PAGEDLLM_G(1) PAGEDLLM_G(2) PAGEDLLM_G(3) PAGEDLLM_G(4) PAGEDLLM_G(5) PAGEDLLM_G(6) PAGEDLLM_G(7) PAGEDLLM_G(8)
#undef PAGEDLLM_G
    default: return false;
  }
}
#endif

// The vector path for head dims 64, 128 and 256 and up to 8 query heads per KV head; false: use the portable loop.
template <typename T>
bool attend_fast(int64_t G, int64_t D, float* qf, const T* kc, const T* vc, const int64_t* table, int64_t L,
                 int64_t BS, int64_t Hkv, int64_t h0, int64_t h1, float* scores, float* out, int64_t skip,
                 float cap) {
#if PAGEDLLM_VEC
  if (D == 64) return attend_seq_g<T, 64 / W>(G, qf, kc, vc, table, L, BS, Hkv, h0, h1, scores, out, skip, cap);
  if (D == 128) return attend_seq_g<T, 128 / W>(G, qf, kc, vc, table, L, BS, Hkv, h0, h1, scores, out, skip, cap);
  if (D == 256)  // gemma
    return attend_seq_g<T, 256 / W>(G, qf, kc, vc, table, L, BS, Hkv, h0, h1, scores, out, skip, cap);
#endif
  (void)G, (void)D, (void)qf, (void)kc, (void)vc, (void)table, (void)L, (void)BS, (void)Hkv, (void)h0, (void)h1,
      (void)scores, (void)out, (void)skip, (void)cap;
  return false;
}

// T: the dtype of q and out; C: the caches' (a bfloat16 cache under float32 activations halves the bytes read)
template <typename T, typename C>
void decode_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                           int64_t window, double softcap) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const float cap = static_cast<float>(softcap);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = Hq / Hkv;
  const int64_t q_sb = q.stride(0), q_sh = q.stride(1);
  const int64_t max_blocks = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const C* kc = k_cache.data_ptr<C>();
  const C* vc = v_cache.data_ptr<C>();
  T* op = out.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t tok_stride = Hkv * D;  // elements between consecutive tokens of a block
  const int64_t num_blocks = k_cache.size(0);
  // work items: whole sequences, or with fewer sequences than twice the threads (a single decode), sequence x KV
  // head, so that both cores work; a sequence's heads are neighbours in its blocks, so whole sequences read them
  // in one stream
  const int64_t split = B >= 2 * at::get_num_threads() ? 1 : Hkv, heads = Hkv / split;
  parallel_claims(B * split, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> qf, acc, row, scores;
    qf.resize(Hq * D);
    acc.resize(Hq * D);
    row.resize(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / split, h0 = item % split * heads, h1 = h0 + heads;
      const int64_t full = lens[b];
      TORCH_CHECK(full >= 1 && full <= max_blocks * BS, "context length ", full, " does not fit the block table");
      // a sliding window: read from the block holding the first key inside it, the keys before it (skip) masked
      const int64_t first = window > 0 ? std::max<int64_t>(0, full - window) : 0, b0 = first / BS;
      const int64_t L = full - b0 * BS, skip = first - b0 * BS;
      const int64_t* table = tables + b * max_blocks + b0;
      for (int64_t i = 0; i < (L + BS - 1) / BS; ++i)
        TORCH_CHECK(table[i] >= 0 && table[i] < num_blocks, "block ", table[i], " outside the cache");
      for (int64_t hq = h0 * G; hq < h1 * G; ++hq) {
        const T* src = qp + b * q_sb + hq * q_sh;
        for (int64_t i = 0; i < D; ++i) qf[hq * D + i] = to_f(src[i]) * static_cast<float>(scale);
      }
      scores.resize(Hq * L);
      if (!attend_fast<C>(G, D, qf.data(), kc, vc, table, L, BS, Hkv, h0, h1, scores.data(), acc.data(), skip,
                           cap)) {
        for (int64_t h = h0; h < h1; ++h) {  // portable path: one KV head at a time
          float* sc = scores.data() + h * G * L;
          for (int64_t t = 0; t < L; ++t) {
            load_row(kc + (table[t / BS] * BS + t % BS) * tok_stride + h * D, row.data(), D);
            for (int64_t g = 0; g < G; ++g) sc[g * L + t] = dot(qf.data() + (h * G + g) * D, row.data(), D);
          }
          for (int64_t g = 0; g < G; ++g) {
            std::fill(sc + g * L, sc + g * L + skip, 0.f);
            softmax_row(sc + g * L + skip, L - skip, cap);
          }
          float* a = acc.data() + h * G * D;
          std::fill(a, a + G * D, 0.f);
          for (int64_t t = 0; t < L; ++t) {
            load_row(vc + (table[t / BS] * BS + t % BS) * tok_stride + h * D, row.data(), D);
            for (int64_t g = 0; g < G; ++g) {
              const float p = sc[g * L + t];
#pragma omp simd
              for (int64_t i = 0; i < D; ++i) a[g * D + i] += p * row[i];
            }
          }
        }
      }
      T* dst = op + b * Hq * D;
      for (int64_t i = h0 * G * D; i < h1 * G * D; ++i) dst[i] = from_f<T>(acc[i]);
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            int64_t window, double softcap) {
  check_cpu(q, "q");
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none)");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be (B, Hq, D) with unit stride in D");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(), "caches must be contiguous (blocks, block_size, Hkv, D)");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "the K and V caches must share a dtype");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, "head shapes do not match");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == q.size(0), "block_tables must be contiguous int64 (B, max_blocks)");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() &&
                  context_lens.numel() == q.size(0), "context_lens must be contiguous int64 (B,)");
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  dispatch_float_bf16(q.scalar_type(), "decode_attention", [&](auto tag) {
    dispatch_float_bf16(k_cache.scalar_type(), "decode_attention (cache)", [&](auto ctag) {
      decode_attention_impl<decltype(tag), decltype(ctag)>(out, q, k_cache, v_cache, block_tables, context_lens, scale,
                                                           window, softcap);
    });
  });
  return out;
}

// ------------------------------------------------------------------ RMSNorm (+ residual add)
template <typename T>
void rms_norm_impl(T* out, T* h, const T* delta, const T* w, int64_t rows, int64_t n, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> x(n), d(n), wf(n);
    std::vector<T> tmp(n);
    load_row(w, wf.data(), n);
    for (int64_t r = begin; r < end; ++r) {
      T* hr = h + r * n;
      load_row(hr, x.data(), n);
      if (delta != nullptr) {  // h += delta, rounded to the storage dtype as a separate add would round it
        load_row(delta + r * n, d.data(), n);
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) x[i] += d[i];
        store_row(x.data(), hr, n);
        load_row(hr, x.data(), n);
      }
      const float ss = dot(x.data(), x.data(), n);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) x[i] *= inv;
      store_row(x.data(), tmp.data(), n);  // normalized, rounded to the dtype, then times the weight
      load_row(tmp.data(), x.data(), n);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) x[i] *= wf[i];
      store_row(x.data(), out + r * n, n);
    }
  });
}

at::Tensor rms_norm_common(at::Tensor& h, const at::Tensor* delta, const at::Tensor& weight, double eps) {
  check_cpu(h, "hidden");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "hidden must be contiguous (T, H)");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == h.size(1) && weight.scalar_type() == h.scalar_type(),
              "weight must be (H,) in the hidden dtype");
  if (delta != nullptr)
    TORCH_CHECK(delta->is_contiguous() && delta->sizes() == h.sizes() && delta->scalar_type() == h.scalar_type(),
                "the residual branch must be contiguous and shaped like hidden");
  auto out = at::empty_like(h);
  const int64_t rows = h.size(0), n = h.size(1);
  dispatch_float_bf16(h.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_impl<T>(out.data_ptr<T>(), h.data_ptr<T>(), delta ? delta->data_ptr<T>() : nullptr,
                     weight.data_ptr<T>(), rows, n, eps);
  });
  return out;
}

at::Tensor rms_norm(at::Tensor h, const at::Tensor& weight, double eps) {
  return rms_norm_common(h, nullptr, weight, eps);
}

// h += delta in place; returns rms_norm(h) * weight
at::Tensor add_rms_norm(at::Tensor h, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  return rms_norm_common(h, &delta, weight, eps);
}

// ------------------------------------------------------------------ rotary + KV cache write
// T: the dtype of qkv; C: the caches' (k and v are rounded to it as they are written)
template <typename T, typename C>
void rope_write_kv_impl(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& slots, at::Tensor& k_cache, at::Tensor& v_cache, int64_t nq, int64_t nkv) {
  const int64_t T_ = qkv.size(0), row_stride = qkv.stride(0);
  const int64_t D = k_cache.size(3), half = D / 2;
  T* base = qkv.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* ct = cos.data_ptr<float>();
  const float* st = sin.data_ptr<float>();
  C* kc = k_cache.data_ptr<C>();
  C* vc = v_cache.data_ptr<C>();
  const int64_t max_pos = cos.size(0);
  at::parallel_for(0, T_, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(D), rf(D);
    std::vector<T> rt(D);
    for (int64_t t = begin; t < end; ++t) {
      TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " outside the rotary table");
      const float* c = ct + pos[t] * half;
      const float* s = st + pos[t] * half;
      T* row = base + t * row_stride;
      C* kdst = kc + slot[t] * nkv * D;
      for (int64_t hd = 0; hd < nq + nkv; ++hd) {
        T* x = row + hd * D;
        load_row(x, xf.data(), D);
        const float* x1 = xf.data();
        const float* x2 = xf.data() + half;
        float* r = rf.data();
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          r[i] = x1[i] * c[i] - x2[i] * s[i];
          r[i + half] = x2[i] * c[i] + x1[i] * s[i];
        }
        if (hd < nq) {
          store_row(r, x, D);  // q rotated in place
        } else {  // k rotated into the cache, rounded to the activations' dtype first (as the torch path rounds it)
          if constexpr (sizeof(T) < sizeof(C)) {  // bfloat16 activations, float32 cache (float32 -> float32: a no-op)
            store_row(r, rt.data(), D);
            load_row(rt.data(), r, D);
          }
          store_row(r, kdst + (hd - nq) * D, D);
        }
      }
      C* vdst = vc + slot[t] * nkv * D;
      const T* vsrc = row + (nq + nkv) * D;
      if constexpr (std::is_same_v<T, C>) {
        std::memcpy(vdst, vsrc, nkv * D * sizeof(T));
      } else {
        for (int64_t hv = 0; hv < nkv; ++hv) {
          load_row(vsrc + hv * D, xf.data(), D);
          store_row(xf.data(), vdst + hv * D, D);
        }
      }
    }
  });
}

// qkv: (T, (nq + 2 nkv) D) rows (row stride may exceed the width); rotates q in place and writes rotated k and
// v to their slots in (blocks, block_size, nkv, D) caches. cos, sin: float32 (max_position, D/2) tables.
void rope_write_kv(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                   const at::Tensor& slots, at::Tensor k_cache, at::Tensor v_cache, int64_t nq, int64_t nkv) {
  check_cpu(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be (T, width) with unit column stride");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 && k_cache.size(2) == nkv,
              "caches must be contiguous (blocks, block_size, nkv, D)");
  const int64_t D = k_cache.size(3);
  TORCH_CHECK(qkv.size(1) == (nq + 2 * nkv) * D && D % 2 == 0, "qkv width does not match the heads");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "the K and V caches must share a dtype");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(1) == D / 2, "cos/sin must be contiguous float32 (P, D/2)");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && positions.is_contiguous() &&
                  slots.is_contiguous() && positions.numel() == qkv.size(0) && slots.numel() == qkv.size(0),
              "positions and slots must be contiguous int64 (T,)");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.numel(); ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " outside the cache");
  dispatch_float_bf16(qkv.scalar_type(), "rope_write_kv", [&](auto tag) {
    dispatch_float_bf16(k_cache.scalar_type(), "rope_write_kv (cache)", [&](auto ctag) {
      rope_write_kv_impl<decltype(tag), decltype(ctag)>(qkv, positions, cos, sin, slots, k_cache, v_cache, nq, nkv);
    });
  });
}

// ------------------------------------------------------------------ SiLU(gate) * up
template <typename T>
void silu_and_mul_impl(T* out, const T* gu, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> g(n), u(n);
    for (int64_t r = begin; r < end; ++r) {
      load_row(gu + r * 2 * n, g.data(), n);
      load_row(gu + r * 2 * n + n, u.data(), n);
      int64_t i = 0;
#if PAGEDLLM_VEC
      for (; i + W <= n; i += W) {  // x * sigmoid(x) * up
        const vf x = vload(g.data() + i);
        const vf e = vexp(vsub(vzero(), x));
        vstore(g.data() + i, vmul(vdiv(x, vadd(vset1(1.f), e)), vload(u.data() + i)));
      }
#endif
      for (; i < n; ++i) g[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
      store_row(g.data(), out + r * n, n);
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_cpu(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be contiguous (T, 2I)");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = at::empty({rows, n}, gate_up.options());
  dispatch_float_bf16(gate_up.scalar_type(), "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    silu_and_mul_impl<T>(out.data_ptr<T>(), gate_up.data_ptr<T>(), rows, n);
  });
  return out;
}

// ------------------------------------------------------------------ block-quantized linear (GGUF-style weights)
// y = x W^T with W in blocks of 32 input channels, each block with a float scale d and offset m per row:
//   4-bit codes u in [0, 16): w = d*u + m (GGUF Q4_1 as it is; Q4_0 with m = -8d);
//   8-bit signed codes s:     w = d*s + m (GGUF Q8_0 with m = 0).
// Activations are quantized per row and block to two int8 levels (see QuantizedRows: x ~ s (254 q + q2)); then
// per block  sum_i w_i x_i = d*s*sum_i(u_i (254 q_i + q2_i)) + m*s*sum_i(254 q_i + q2_i).
//
// Layout: output rows in groups of 8, interleaved so that one 32-byte vector holds 4 consecutive inputs of each
// of the 8 rows ("unit" i of a block: inputs 4i..4i+3, byte 4*row + t). A unit times the 4 activation bytes
// broadcast to every lane is one vpdpbusd (AVX512-VNNI) or vpmaddubsw + vpmaddwd (AVX2): lane `row` collects
// that row's dot product with no horizontal sums, and the 8 rows' scales are one vector load.
//   4-bit: per group and block 128 bytes: byte (i, row, t) = code[4i+t] | code[16+4i+t] << 4 (units i, 4+i);
//   8-bit: per group and block 256 bytes: byte (i, row, t) = code[4i+t], i in [0, 8);
//   d, m: (N/8, K/32, 8), float32 or float16 (QScales below); 8-bit codes may have no m (all zero).
// A row's arithmetic does not depend on how many rows the batch has (the same operations in the same order).
constexpr int QB = 32;

// Activations in two int8 levels per block of 32: x ~ s * (254 * q + q2) with s = max|x| / (127 * 254): q is the
// usual int8 rounding, q2 the rounding of what q leaves (|x - 254 s q| <= 127 s). That keeps about 15 bits of each
// activation (one level, as llama.cpp's Q8 activations, cost 2.6% of the business set's answers here), for a
// second integer dot product per block, which the memory-bound small batches barely notice.
constexpr int LEVEL = 254;

// Without VNNI (AVX2, or AVX-512 without it) the two levels travel as one int16 per activation, v = 254 q + q2
// (|v| <= 32385), against weights widened to int16: one vpmaddwd does 16 products of the whole value, where the
// two levels cost two vpmaddubsw + two vpmaddwd per 32. The integer sums are exactly the two levels' (254 hi + lo),
// so the results are bitwise the same. v is stored per unit of 4 inputs a..a+3 as (a, a+2, a+1, a+3): the int16
// pairs that the weight bytes give with a shift and a mask (below).
#if defined(__AVX2__) && defined(__FMA__) && !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define PAGEDLLM_QWIDE 1
#endif

struct QuantizedRows {
  std::vector<int8_t> q;   // (M, K) coarse level (not with PAGEDLLM_QWIDE)
  std::vector<int8_t> q2;  // (M, K) fine level (not with PAGEDLLM_QWIDE)
  std::vector<int16_t> v;  // (M, K) 254 q + q2 in pair order (only with PAGEDLLM_QWIDE)
  std::vector<float> s;    // (M, K/32) s
  std::vector<float> ss;   // (M, K/32) s * sum(254 q + q2), ~ the block's sum of x
  std::vector<int32_t> isum;  // (M, K/32) sum(254 q + q2): 8-bit codes run as unsigned (s + 128) and subtract it
  std::vector<float> ss2;      // (M, K/16): ss per half block (weights with a scale per 16 inputs)
  std::vector<int32_t> isum2;  // (M, K/16): isum per half block
};

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, QuantizedRows& out) {
  const int64_t nb = K / QB;
#if defined(PAGEDLLM_QWIDE)
  out.v.resize(M * K);
#else
  out.q.resize(M * K);
  out.q2.resize(M * K);
#endif
  out.s.resize(M * nb);
  out.ss.resize(M * nb);
  out.isum.resize(M * nb);
  out.ss2.resize(2 * M * nb);
  out.isum2.resize(2 * M * nb);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    float buf[QB];
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        load_row(x + r * K + b * QB, buf, QB);
#if defined(__AVX2__) && defined(__FMA__)
        {  // |x| max; q = round(x * 127 / max) (nearest even); q2 = round((x - q * max / 127) * 127 * 254 / max)
          const __m256 sign = _mm256_set1_ps(-0.f);
          __m256 v[4];
          __m256 mx = _mm256_setzero_ps();
          for (int j = 0; j < 4; ++j) {
            v[j] = _mm256_loadu_ps(buf + 8 * j);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
          }
          __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
          h = _mm_max_ps(h, _mm_movehl_ps(h, h));
          h = _mm_max_ss(h, _mm_movehdup_ps(h));
          const float amax = _mm_cvtss_f32(h);
          const float inv = amax > 0.f ? 127.f / amax : 0.f;
          const __m256 vinv = _mm256_set1_ps(inv), vinv2 = _mm256_set1_ps(inv * LEVEL);
          const __m256 vsx = _mm256_set1_ps(amax / 127.f);
          __m256i q1i[4], q2i[4], vi[4];
          __m256i sum = _mm256_setzero_si256(), sum_lo = sum;
          for (int j = 0; j < 4; ++j) {
            const __m256 q1f = _mm256_round_ps(_mm256_mul_ps(v[j], vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m256 rest = _mm256_fnmadd_ps(q1f, vsx, v[j]);
            q1i[j] = _mm256_cvtps_epi32(q1f);
            // the fine level saturates at +-127 (a rounding of x * 127 / max to exactly .5 above can ask for 128)
            q2i[j] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(rest, vinv2)),
                                                       _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
            vi[j] = _mm256_add_epi32(_mm256_mullo_epi32(q1i[j], _mm256_set1_epi32(LEVEL)), q2i[j]);
            sum = _mm256_add_epi32(sum, vi[j]);
            if (j == 1) sum_lo = sum;  // inputs 0-15
          }
#if defined(PAGEDLLM_QWIDE)
          // int16 in input order (the 64-bit permute undoes packs' per-lane interleave), then (a, a+2, a+1, a+3)
          const __m256i pair = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15,
                                                0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
          int16_t* vq = out.v.data() + r * K + b * QB;
          for (int j = 0; j < 2; ++j) {
            const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(vi[2 * j], vi[2 * j + 1]), 0xD8);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(vq + 16 * j), _mm256_shuffle_epi8(p, pair));
          }
#else
          int8_t* q = out.q.data() + r * K + b * QB;
          int8_t* q2 = out.q2.data() + r * K + b * QB;
          const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
          const __m256i p1 = _mm256_packs_epi16(_mm256_packs_epi32(q1i[0], q1i[1]), _mm256_packs_epi32(q1i[2], q1i[3]));
          const __m256i p2 = _mm256_packs_epi16(_mm256_packs_epi32(q2i[0], q2i[1]), _mm256_packs_epi32(q2i[2], q2i[3]));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(p1, order));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q2), _mm256_permutevar8x32_epi32(p2, order));
#endif
          auto hsum = [](__m256i x) {
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
            return _mm_cvtsi128_si32(s4);
          };
          const float s = amax / (127.f * LEVEL);
          out.s[r * nb + b] = s;
          const int32_t isum = hsum(sum), isum_lo = hsum(sum_lo);
          out.isum[r * nb + b] = isum;
          out.ss[r * nb + b] = s * static_cast<float>(isum);
          out.isum2[2 * (r * nb + b)] = isum_lo;
          out.isum2[2 * (r * nb + b) + 1] = isum - isum_lo;
          out.ss2[2 * (r * nb + b)] = s * static_cast<float>(isum_lo);
          out.ss2[2 * (r * nb + b) + 1] = s * static_cast<float>(isum - isum_lo);
        }
#else
        int8_t* q = out.q.data() + r * K + b * QB;
        int8_t* q2 = out.q2.data() + r * K + b * QB;
        float amax = 0.f;
        for (int i = 0; i < QB; ++i) amax = std::max(amax, std::fabs(buf[i]));
        const float sx = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int sum = 0, sum_lo = 0;
        for (int i = 0; i < QB; ++i) {
          if (i == QB / 2) sum_lo = sum;
          const float q1f = std::nearbyint(buf[i] * inv);
          const int v2 = std::max(-127, std::min(127, static_cast<int>(std::nearbyint((buf[i] - q1f * sx) *
                                                                                      (inv * LEVEL)))));
          q[i] = static_cast<int8_t>(q1f);
          q2[i] = static_cast<int8_t>(v2);
          sum += static_cast<int>(q1f) * LEVEL + v2;
        }
        const float s = amax / (127.f * LEVEL);
        out.s[r * nb + b] = s;
        out.isum[r * nb + b] = sum;
        out.ss[r * nb + b] = s * static_cast<float>(sum);
        out.isum2[2 * (r * nb + b)] = sum_lo;
        out.isum2[2 * (r * nb + b) + 1] = sum - sum_lo;
        out.ss2[2 * (r * nb + b)] = s * static_cast<float>(sum_lo);
        out.ss2[2 * (r * nb + b) + 1] = s * static_cast<float>(sum - sum_lo);
#endif
      }
  });
}

// A layer's block scales d and offsets m: per group of 8 rows and block, the 8 rows' values, float32 or float16
// (S: a GGUF file's own precision, which the layer keeps when every value converts exactly: 20 instead of 24 bytes
// per 4-bit block of a row). No offsets (OFF false: GGUF Q8_0, symmetric 8-bit weights) skips their loads and
// multiply-adds. A float16 value widens to exactly the float32 it stands for, so the arithmetic is that of the
// float32 layout; the format is a template argument, so the tiles hold no run-time test of it.
// SUB: scales (and offsets) per block, 1 or 2 (GGUF's blocks of 16: Q2_K, Q3_K, Q6_K); with 2 the integer sums of
// each half block (inputs 0-15, 16-31) get their own float steps, against the activations' per-half sums.
template <typename S, bool OFF, int SUB = 1>
struct QScales {
  static constexpr bool offsets = OFF;
  static constexpr int sub = SUB;
  const S* d;
  const S* m;  // unused without OFF
  int64_t nb;  // blocks per row
  // index of group g's 8 values of block b (its half h)
  int64_t at(int64_t g, int64_t b, int h = 0) const { return ((g * nb + b) * SUB + h) * 8; }
  // where those 8 scales (offsets) start
  const S* dp(int64_t g, int64_t b, int h = 0) const { return d + at(g, b, h); }
  const S* mp(int64_t g, int64_t b, int h = 0) const { return m + at(g, b, h); }
};

// The activation sums that the float steps of half h of a block (all of it with SUB 1) take: s * sum and sum.
template <int SUB>
inline float act_ss(const QuantizedRows& xa, int64_t row, int h) { return SUB == 1 ? xa.ss[row] : xa.ss2[2 * row + h]; }
template <int SUB>
inline int32_t act_isum(const QuantizedRows& xa, int64_t row, int h) {
  return SUB == 1 ? xa.isum[row] : xa.isum2[2 * row + h];
}

// GGUF K-quant scales as the file has them: value k of the (N/8, K/32 * SUB, 8) layout is D * s[k], with s a small
// integer (a sub-block's 6-bit scale, or minus its min) and D the float16 scale of its super-block of 256 inputs
// (N/8, K/256, 8): 1 byte per sub-block and row instead of 4. The product is exact in float32 (an 11-bit by
// 8-bit integer), so the kernels' results are bitwise those of the float32 layout. A KPtr (a group's 8 values of
// one block: their super-block scales and sub-block integers) stands where QScales gives a plain pointer (p[j],
// p + 4, load8), so every tile runs either layout unchanged; the super-block index is found once per block from
// (g, b), with no division in the tiles.
struct KPtr {
  const at::Half* D;
  const int8_t* s;
  KPtr operator+(int64_t k) const { return {D + k, s + k}; }  // within the 8 values (k < 8), or for a prefetch
  float operator[](int64_t j) const { return static_cast<float>(D[j]) * static_cast<float>(s[j]); }
};
template <bool OFF, int SUB = 1>
struct KScales {
  static constexpr bool offsets = OFF;
  static constexpr int sub = SUB;
  const at::Half* D;
  const int8_t* s;
  const at::Half* Dm;  // unused without OFF
  const int8_t* mn;
  int64_t nb;
  int64_t at(int64_t g, int64_t b, int h = 0) const { return ((g * nb + b) * SUB + h) * 8; }
  int64_t super(int64_t g, int64_t b) const { return (g * (nb / 8) + b / 8) * 8; }
  KPtr dp(int64_t g, int64_t b, int h = 0) const { return {D + super(g, b), s + at(g, b, h)}; }
  KPtr mp(int64_t g, int64_t b, int h = 0) const { return {Dm + super(g, b), mn + at(g, b, h)}; }
};
template <typename S> inline const void* addr(const S* p) { return p; }
inline const void* addr(const KPtr& p) { return p.s; }

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename T>
inline void store_group(T* y, int64_t N, int64_t n0, const float* v) {  // up to 8 outputs, cut at N
  const int64_t cnt = std::min<int64_t>(8, N - n0);
  for (int64_t j = 0; j < cnt; ++j) y[n0 + j] = from_f<T>(v[j]);
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) {  // acc + 8 int32 sums of 4 u8*s8 products; u < 128
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

constexpr int64_t PREFETCH_BYTES = 2048;  // of weights (scales: a quarter) ahead of a single-row tile

// 8 scales or offsets as float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  float v[8];
  for (int j = 0; j < 8; ++j) v[j] = static_cast<float>(p[j]);
  return _mm256_loadu_ps(v);
#endif
}

inline __m256 load8(const KPtr& p) {  // D * s for 8 rows: one super-block scale vector, 8 small integers
  return _mm256_mul_ps(load8(p.D), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                        reinterpret_cast<const __m128i*>(p.s)))));
}

// A single row streams the weights from memory: ask for group g's codes (wb: its block b) PREFETCH_BYTES ahead of
// the prefetcher, and for its scales and offsets as many values ahead as a quarter of that.
template <typename SC>
inline void prefetch_group(const uint8_t* wb, int64_t gbytes, const SC& sc, int64_t g, int64_t b) {
  for (int64_t c = 0; c < gbytes; c += 64)
    _mm_prefetch(reinterpret_cast<const char*>(wb + PREFETCH_BYTES + c), _MM_HINT_T0);
  _mm_prefetch(static_cast<const char*>(addr(sc.dp(g, b) + PREFETCH_BYTES / 4)), _MM_HINT_T0);
  if constexpr (SC::offsets) _mm_prefetch(static_cast<const char*>(addr(sc.mp(g, b) + PREFETCH_BYTES / 4)), _MM_HINT_T0);
}

// The end of block b in a tile of GT groups (from g0) by MT rows (from r0): the integer sums isum(g, r) of each
// (group, row) pair times d * s, plus m * ss, into the pair's float sums. The same float steps in every tile shape.
template <int GT, int MT, typename SC, typename Sum>
inline void add_blocks(__m256 (&acc)[GT][MT], const SC& sc, int64_t g0, const QuantizedRows& xa, int64_t r0,
                       int64_t b, int h, Sum isum) {
  for (int g = 0; g < GT; ++g) {
    const __m256 dv = load8(sc.dp(g0 + g, b, h));
    const __m256 mv = SC::offsets ? load8(sc.mp(g0 + g, b, h)) : _mm256_setzero_ps();
    for (int r = 0; r < MT; ++r) {
      const int64_t row = (r0 + r) * sc.nb + b;
      acc[g][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum(g, r)), _mm256_mul_ps(dv, _mm256_set1_ps(xa.s[row])),
                                  acc[g][r]);
      if constexpr (SC::offsets)
        acc[g][r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(act_ss<SC::sub>(xa, row, h)), acc[g][r]);
    }
  }
}

#if defined(PAGEDLLM_QWIDE)
// An empty asm that takes x in a register and may change it: the compiler keeps each tile's running sums where the
// loop adds to them. Without it, gcc reassociates the integer adds into every product of a block first, then their
// sum, and spills most products to the stack (1.3x slower).
inline void keep_in_register(__m256i& x) {
#if defined(__GNUC__)
  asm("" : "+x"(x));
#endif
}

// qtile (below) on int16 activations (PAGEDLLM_QWIDE): the same tiles, one accumulator per (group, row). A weight
// vector's 32-bit lane holds 4 bytes of one row; its int16 halves masked (and shifted by 4, 8, 12 bits for 4-bit
// codes, or sign-extended for 8-bit ones) are the pairs (a, a+2) and (a+1, a+3) of a unit (the high nibbles: of
// unit 4+i), which meet v's pair order.
template <int BITS, int GT, int MT, typename SC>
inline void qtile(const uint8_t* w, const SC& sc, int64_t g0, int64_t gstride,
                  const QuantizedRows& xa, int64_t r0, int64_t K, int64_t nb, __m256* out) {
  constexpr int64_t gbytes = BITS * 32;
  constexpr int SUB = SC::sub;
  __m256 acc[GT][MT];
  for (int g = 0; g < GT; ++g)
    for (int r = 0; r < MT; ++r) acc[g][r] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi16(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* xv[MT];  // 32-bit words: the int16 pairs
    for (int r = 0; r < MT; ++r) xv[r] = reinterpret_cast<const int8_t*>(xa.v.data() + (r0 + r) * K + b * QB);
    auto word = [&](int r, int k) { return _mm256_set1_epi32(load_i32(xv[r] + 4 * k)); };
    if constexpr (MT == 1) {  // a single row streams the weights from memory: ask for them ahead of the prefetcher
      for (int g = 0; g < GT; ++g) prefetch_group(w + (g0 + g) * gstride + b * gbytes, gbytes, sc, g0 + g, b);
    }
    for (int half = 0; half < SUB; ++half) {  // SUB 2: inputs 0-15 (low nibbles, units 0-3), then 16-31
      __m256i s[GT][MT];
      for (int g = 0; g < GT; ++g)
        for (int r = 0; r < MT; ++r) s[g][r] = _mm256_setzero_si256();
      if constexpr (BITS == 4) {
        for (int i = 0; i < 4; ++i) {  // vector i: unit i in the low nibbles, unit 4+i in the high ones
          for (int h = SUB == 2 ? half : 0; h < (SUB == 2 ? half + 1 : 2); ++h) {  // low nibbles (unit i), high
            __m256i e0[GT], e1[GT];
            for (int g = 0; g < GT; ++g) {
              __m256i v = _mm256_loadu_si256(
                  reinterpret_cast<const __m256i*>(w + (g0 + g) * gstride + b * gbytes + 32 * i));
              if (h) v = _mm256_srli_epi16(v, 4);
              e0[g] = _mm256_and_si256(v, low4);                        // (a, a+2)
              e1[g] = _mm256_and_si256(_mm256_srli_epi16(v, 8), low4);  // (a+1, a+3)
            }
            for (int r = 0; r < MT; ++r) {
              const __m256i x0 = word(r, 8 * h + 2 * i), x1 = word(r, 8 * h + 2 * i + 1);
              for (int g = 0; g < GT; ++g) {
                s[g][r] = _mm256_add_epi32(s[g][r], _mm256_add_epi32(_mm256_madd_epi16(e0[g], x0),
                                                                     _mm256_madd_epi16(e1[g], x1)));
                keep_in_register(s[g][r]);
              }
            }
          }
        }
      } else {
        for (int i = SUB == 2 ? 4 * half : 0; i < (SUB == 2 ? 4 * half + 4 : 8); ++i) {
          __m256i f0[GT], f1[GT];
          for (int g = 0; g < GT; ++g) {
            const __m256i v = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(w + (g0 + g) * gstride + b * gbytes + 32 * i));
            f0[g] = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8);  // (4i, 4i+2)
            f1[g] = _mm256_srai_epi16(v, 8);                        // (4i+1, 4i+3)
          }
          for (int r = 0; r < MT; ++r) {
            const __m256i x0 = word(r, 2 * i), x1 = word(r, 2 * i + 1);
            for (int g = 0; g < GT; ++g) {
              s[g][r] = _mm256_add_epi32(s[g][r], _mm256_add_epi32(_mm256_madd_epi16(f0[g], x0),
                                                                   _mm256_madd_epi16(f1[g], x1)));
              keep_in_register(s[g][r]);
            }
          }
        }
      }
      add_blocks<GT, MT>(acc, sc, g0, xa, r0, b, half, [&](int g, int r) { return s[g][r]; });
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int r = 0; r < MT; ++r) out[g * MT + r] = acc[g][r];
}
#else
// A tile of GT groups of 8 weight rows (groups g0 .. g0+GT-1) against activation rows [r0, r0 + MT):
// out[g * MT + r] = the 8 rows of group g0+g for activation row r0 + r. Every (group, row) pair has its own
// coarse and fine accumulators, so a tile runs 2*GT*MT independent chains of dot products (one group and one row
// alone is a chain of 8 dependent vpdpbusd per block, latency-bound at about a third of the machine's rate); a
// weight vector is loaded once per tile and an activation broadcast once per group tile. The integer sums are
// exact and the float steps per (block, group, row) are the same in every tile shape, so a row's result does not
// depend on the tile (or batch) it ran in.
template <int BITS, int GT, int MT, typename SC>
inline void qtile(const uint8_t* w, const SC& sc, int64_t g0, int64_t gstride,
                  const QuantizedRows& xa, int64_t r0, int64_t K, int64_t nb, __m256* out) {
  constexpr int64_t gbytes = BITS * 32;  // bytes per group and block: 128 (4-bit) or 256 (8-bit)
  constexpr int SUB = SC::sub;
  __m256 acc[GT][MT];
  for (int g = 0; g < GT; ++g)
    for (int r = 0; r < MT; ++r) acc[g][r] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* xq[MT];
    const int8_t* xq2[MT];
    for (int r = 0; r < MT; ++r) {
      xq[r] = xa.q.data() + (r0 + r) * K + b * QB;
      xq2[r] = xa.q2.data() + (r0 + r) * K + b * QB;
    }
    if constexpr (MT == 1) {  // a single row streams the weights from memory: ask for them ahead of the prefetcher
      for (int g = 0; g < GT; ++g) prefetch_group(w + (g0 + g) * gstride + b * gbytes, gbytes, sc, g0 + g, b);
    }
    for (int half = 0; half < SUB; ++half) {  // SUB 2: inputs 0-15 (low nibbles, units 0-3), then 16-31
      __m256i hi[GT][MT], lo[GT][MT];
      for (int g = 0; g < GT; ++g)
        for (int r = 0; r < MT; ++r) hi[g][r] = lo[g][r] = _mm256_setzero_si256();
      if constexpr (BITS == 4) {
        for (int i = 0; i < 4; ++i) {  // vector i: unit i (inputs 4i..4i+3) low, unit 4+i (16+4i..) high nibbles
          __m256i ul[GT], uh[GT];
          for (int g = 0; g < GT; ++g) {
            const __m256i v = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(w + (g0 + g) * gstride + b * gbytes + 32 * i));
            ul[g] = _mm256_and_si256(v, low4);
            uh[g] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          }
          for (int r = 0; r < MT; ++r) {
            if (SUB == 1 || half == 0) {
              const __m256i x1 = _mm256_set1_epi32(load_i32(xq[r] + 4 * i));
              const __m256i x2 = _mm256_set1_epi32(load_i32(xq2[r] + 4 * i));
              for (int g = 0; g < GT; ++g) {
                hi[g][r] = dot_acc(hi[g][r], ul[g], x1);
                lo[g][r] = dot_acc(lo[g][r], ul[g], x2);
              }
            }
            if (SUB == 1 || half == 1) {
              const __m256i y1 = _mm256_set1_epi32(load_i32(xq[r] + 16 + 4 * i));
              const __m256i y2 = _mm256_set1_epi32(load_i32(xq2[r] + 16 + 4 * i));
              for (int g = 0; g < GT; ++g) {
                hi[g][r] = dot_acc(hi[g][r], uh[g], y1);
                lo[g][r] = dot_acc(lo[g][r], uh[g], y2);
              }
            }
          }
        }
      } else {
        for (int i = SUB == 2 ? 4 * half : 0; i < (SUB == 2 ? 4 * half + 4 : 8); ++i) {
          __m256i u[GT], ua[GT];
          for (int g = 0; g < GT; ++g) {
            u[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (g0 + g) * gstride + b * gbytes + 32 * i));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
            ua[g] = _mm256_xor_si256(u[g], _mm256_set1_epi8(-128));  // s + 128 as unsigned; 128 * isum comes off
#else
            ua[g] = _mm256_sign_epi8(u[g], u[g]);  // |s| times x with s's sign (vpmaddubsw needs u < 128)
#endif
          }
          for (int r = 0; r < MT; ++r) {
            const __m256i x1 = _mm256_set1_epi32(load_i32(xq[r] + 4 * i));
            const __m256i x2 = _mm256_set1_epi32(load_i32(xq2[r] + 4 * i));
            for (int g = 0; g < GT; ++g) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
              hi[g][r] = dot_acc(hi[g][r], ua[g], x1);
              lo[g][r] = dot_acc(lo[g][r], ua[g], x2);
#else
              hi[g][r] = dot_acc(hi[g][r], ua[g], _mm256_sign_epi8(x1, u[g]));
              lo[g][r] = dot_acc(lo[g][r], ua[g], _mm256_sign_epi8(x2, u[g]));
#endif
            }
          }
        }
      }
      add_blocks<GT, MT>(acc, sc, g0, xa, r0, b, half, [&](int g, int r) {
        __m256i s = _mm256_add_epi32(_mm256_mullo_epi32(hi[g][r], _mm256_set1_epi32(LEVEL)), lo[g][r]);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        if constexpr (BITS == 8)
          s = _mm256_sub_epi32(s, _mm256_set1_epi32(128 * act_isum<SUB>(xa, (r0 + r) * nb + b, half)));
#endif
        return s;
      });
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int r = 0; r < MT; ++r) out[g * MT + r] = acc[g][r];
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGEDLLM_QZMM 1
inline __m512i load_pair(const uint8_t* a, const uint8_t* b) {  // 32 bytes of group g low, of group g+1 high
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}
// 8 scales or offsets of group g (a) low and of group g+1 (b) high, as float32.
inline __m512 load_pair(const float* a, const float* b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a))),
                                             _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
}
inline __m512 load_pair(const at::Half* a, const at::Half* b) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
}

inline __m512 load_pair(const KPtr& a, const KPtr& b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(load8(a))),
                                             _mm256_castps_pd(load8(b)), 1));
}

// qtile on 512-bit vectors: PT pairs of groups (g0 + 2p, g0 + 2p + 1) in one vector each, so one vpdpbusd does 64
// products (twice the 256-bit rate on CPUs that issue one of either per cycle). The same integer sums and, per
// 8 rows, the same float steps as qtile: the results are bitwise those of the 256-bit tiles.
template <int BITS, int PT, int MT, typename SC>
inline void qtile512(const uint8_t* w, const SC& sc, int64_t g0, int64_t gstride,
                     const QuantizedRows& xa, int64_t r0, int64_t K, int64_t nb, __m512* out) {
  constexpr int64_t gbytes = BITS * 32;
  constexpr int SUB = SC::sub;
  __m512 acc[PT][MT];
  for (int p = 0; p < PT; ++p)
    for (int r = 0; r < MT; ++r) acc[p][r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* xq[MT];
    const int8_t* xq2[MT];
    for (int r = 0; r < MT; ++r) {
      xq[r] = xa.q.data() + (r0 + r) * K + b * QB;
      xq2[r] = xa.q2.data() + (r0 + r) * K + b * QB;
    }
    const uint8_t* wb = w + g0 * gstride + b * gbytes;
    for (int half = 0; half < SUB; ++half) {  // SUB 2: inputs 0-15 (low nibbles, units 0-3), then 16-31
      __m512i hi[PT][MT], lo[PT][MT];
      for (int p = 0; p < PT; ++p)
        for (int r = 0; r < MT; ++r) hi[p][r] = lo[p][r] = _mm512_setzero_si512();
      if constexpr (BITS == 4) {
        for (int i = 0; i < 4; ++i) {
          __m512i ul[PT], uh[PT];
          for (int p = 0; p < PT; ++p) {
            const __m512i v = load_pair(wb + 2 * p * gstride + 32 * i, wb + (2 * p + 1) * gstride + 32 * i);
            ul[p] = _mm512_and_si512(v, low4);
            uh[p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          }
          for (int r = 0; r < MT; ++r) {
            if (SUB == 1 || half == 0) {
              const __m512i x1 = _mm512_set1_epi32(load_i32(xq[r] + 4 * i));
              const __m512i x2 = _mm512_set1_epi32(load_i32(xq2[r] + 4 * i));
              for (int p = 0; p < PT; ++p) {
                hi[p][r] = _mm512_dpbusd_epi32(hi[p][r], ul[p], x1);
                lo[p][r] = _mm512_dpbusd_epi32(lo[p][r], ul[p], x2);
              }
            }
            if (SUB == 1 || half == 1) {
              const __m512i y1 = _mm512_set1_epi32(load_i32(xq[r] + 16 + 4 * i));
              const __m512i y2 = _mm512_set1_epi32(load_i32(xq2[r] + 16 + 4 * i));
              for (int p = 0; p < PT; ++p) {
                hi[p][r] = _mm512_dpbusd_epi32(hi[p][r], uh[p], y1);
                lo[p][r] = _mm512_dpbusd_epi32(lo[p][r], uh[p], y2);
              }
            }
          }
        }
      } else {
        for (int i = SUB == 2 ? 4 * half : 0; i < (SUB == 2 ? 4 * half + 4 : 8); ++i) {
          __m512i u[PT];
          for (int p = 0; p < PT; ++p)  // s + 128 as unsigned; 128 * isum comes off below
            u[p] = _mm512_xor_si512(load_pair(wb + 2 * p * gstride + 32 * i, wb + (2 * p + 1) * gstride + 32 * i),
                                    _mm512_set1_epi8(-128));
          for (int r = 0; r < MT; ++r) {
            const __m512i x1 = _mm512_set1_epi32(load_i32(xq[r] + 4 * i));
            const __m512i x2 = _mm512_set1_epi32(load_i32(xq2[r] + 4 * i));
            for (int p = 0; p < PT; ++p) {
              hi[p][r] = _mm512_dpbusd_epi32(hi[p][r], u[p], x1);
              lo[p][r] = _mm512_dpbusd_epi32(lo[p][r], u[p], x2);
            }
          }
        }
      }
      for (int p = 0; p < PT; ++p) {  // add_blocks' steps on two groups at once
        const __m512 dv = load_pair(sc.dp(g0 + 2 * p, b, half), sc.dp(g0 + 2 * p + 1, b, half));
        const __m512 mv = SC::offsets ? load_pair(sc.mp(g0 + 2 * p, b, half), sc.mp(g0 + 2 * p + 1, b, half))
                                      : _mm512_setzero_ps();
        for (int r = 0; r < MT; ++r) {
          const int64_t row = (r0 + r) * nb + b;
          __m512i s = _mm512_add_epi32(_mm512_mullo_epi32(hi[p][r], _mm512_set1_epi32(LEVEL)), lo[p][r]);
          if constexpr (BITS == 8) s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * act_isum<SUB>(xa, row, half)));
          acc[p][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dv, _mm512_set1_ps(xa.s[row])),
                                      acc[p][r]);
          if constexpr (SC::offsets)
            acc[p][r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(act_ss<SUB>(xa, row, half)), acc[p][r]);
        }
      }
    }
  }
  for (int p = 0; p < PT; ++p)
    for (int r = 0; r < MT; ++r) out[p * MT + r] = acc[p][r];
}

// Groups [g0, g0 + 2 PT) against rows [r, M), stored to y (row tiles of MT, then of 2 and 1).
template <int BITS, int PT, int MT, typename SC, typename T>
inline void qtile512_rows(const uint8_t* w, const SC& sc, int64_t g0, int64_t gstride,
                          const QuantizedRows& xa, int64_t r, int64_t M, int64_t K, int64_t nb, int64_t N, T* y) {
  __m512 out[PT * MT];
  float res[16];
  auto store = [&](int64_t r, int nr) {
    for (int p = 0; p < PT; ++p)
      for (int i = 0; i < nr; ++i) {
        _mm512_storeu_ps(res, out[p * nr + i]);
        store_group(y + (r + i) * N, N, 8 * (g0 + 2 * p), res);
        store_group(y + (r + i) * N, N, 8 * (g0 + 2 * p + 1), res + 8);
      }
  };
  for (; r + MT <= M; r += MT) {
    qtile512<BITS, PT, MT>(w, sc, g0, gstride, xa, r, K, nb, out);
    store(r, MT);
  }
  if constexpr (MT > 2) {
    if (r + 2 <= M) {
      qtile512<BITS, PT, 2>(w, sc, g0, gstride, xa, r, K, nb, out);
      store(r, 2);
      r += 2;
    }
  }
  for (; r < M; ++r) {
    qtile512<BITS, PT, 1>(w, sc, g0, gstride, xa, r, K, nb, out);
    store(r, 1);
  }
}
#endif

// The tiles of one slice of groups [g0, g0 + GT) against rows [r, M), stored to y.
template <int BITS, int GT, int MT, typename SC, typename T>
inline void qtile_rows(const uint8_t* w, const SC& sc, int64_t g0, int64_t gstride,
                       const QuantizedRows& xa, int64_t r, int64_t M, int64_t K, int64_t nb, int64_t N, T* y) {
  __m256 out[GT * MT];
  float res[8];
  for (; r + MT <= M; r += MT) {
    qtile<BITS, GT, MT>(w, sc, g0, gstride, xa, r, K, nb, out);
    for (int g = 0; g < GT; ++g)
      for (int i = 0; i < MT; ++i) {
        _mm256_storeu_ps(res, out[g * MT + i]);
        store_group(y + (r + i) * N, N, 8 * (g0 + g), res);
      }
  }
  for (; r < M; ++r) {
    qtile<BITS, GT, 1>(w, sc, g0, gstride, xa, r, K, nb, out);
    for (int g = 0; g < GT; ++g) {
      _mm256_storeu_ps(res, out[g]);
      store_group(y + r * N, N, 8 * (g0 + g), res);
    }
  }
}
#endif

// The portable loop over the same layout: the 8 rows' results for activation row `row`.
template <int BITS, typename SC>
inline void qgroup_scalar(const uint8_t* wg, const SC& sc, int64_t g, const QuantizedRows& xa, int64_t row,
                          int64_t K, int64_t nb, float* out) {
  constexpr int64_t gbytes = BITS * 32;
  constexpr int SUB = SC::sub;
  for (int j = 0; j < 8; ++j) out[j] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* xq = xa.q.data() + row * K + b * QB;
    const int8_t* xq2 = xa.q2.data() + row * K + b * QB;
    const uint8_t* wb = wg + b * gbytes;
    int32_t s[SUB][8] = {};  // per half block (inputs 0-15, 16-31) with SUB 2
    for (int i = 0; i < (BITS == 4 ? 4 : 8); ++i)
      for (int j = 0; j < 8; ++j)
        for (int t = 0; t < 4; ++t) {
          const uint8_t byte = wb[32 * i + 4 * j + t];
          const int k = 4 * i + t;
          if constexpr (BITS == 4) {
            s[0][j] += (byte & 0x0F) * (LEVEL * xq[k] + xq2[k]);
            s[SUB - 1][j] += (byte >> 4) * (LEVEL * xq[16 + k] + xq2[16 + k]);
          } else {
            s[SUB == 2 && k >= 16][j] += static_cast<int8_t>(byte) * (LEVEL * xq[k] + xq2[k]);
          }
        }
    const float sx = xa.s[row * nb + b];
    for (int h = 0; h < SUB; ++h) {
      const float ss = act_ss<SUB>(xa, row * nb + b, h);
      const auto dv = sc.dp(g, b, h);
      const auto mv = sc.mp(g, b, h);  // not read without offsets
      for (int j = 0; j < 8; ++j)
        out[j] += static_cast<float>(dv[j]) * sx * static_cast<float>(s[h][j]) +
                  (SC::offsets ? static_cast<float>(mv[j]) : 0.f) * ss;
    }
  }
}

#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define PAGEDLLM_QNEON 1
inline float32x4_t load4(const float* p) { return vld1q_f32(p); }
inline float32x4_t load4(const at::Half* p) {
  return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))));
}
inline float32x4_t load4(const KPtr& p) {
  const float32x4_t d = load4(p.D);
  int32_t four;  // the 4 values' bytes (an 8-byte load could read past the array's end)
  std::memcpy(&four, p.s, sizeof four);
  const int16x4_t s = vget_low_s16(vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(four))));
  return vmulq_f32(d, vcvtq_f32_s32(vmovl_s16(s)));
}

// qgroup_scalar on ARM's dot-product instructions (ARMv8.2 dotprod: Graviton 2 and later, Apple M): a 32-byte unit
// of a group is two 16-byte vectors (rows 0-3, rows 4-7), each 32-bit lane 4 bytes of one row, and one sdot adds
// the lane's 4 products with the 4 activation bytes broadcast (4-bit codes in [0, 16) are non-negative int8).
// The integer sums and the float steps per block are the x86 tiles'.
template <int BITS, typename SC>
inline void qgroup_neon(const uint8_t* wg, const SC& sc, int64_t g, const QuantizedRows& xa, int64_t row,
                        int64_t K, int64_t nb, float* out) {
  constexpr int64_t gbytes = BITS * 32;
  float32x4_t acc0 = vdupq_n_f32(0.f), acc1 = vdupq_n_f32(0.f);
  const uint8x16_t low4 = vdupq_n_u8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* xq = xa.q.data() + row * K + b * QB;
    const int8_t* xq2 = xa.q2.data() + row * K + b * QB;
    const uint8_t* wb = wg + b * gbytes;
    int32x4_t h0 = vdupq_n_s32(0), h1 = h0, l0 = h0, l1 = h0;
    auto bcast = [](const int8_t* p) { return vreinterpretq_s8_s32(vdupq_n_s32(load_i32(p))); };
    if constexpr (BITS == 4) {
      for (int i = 0; i < 4; ++i) {  // vector i: unit i in the low nibbles, unit 4+i in the high ones
        const uint8x16_t v0 = vld1q_u8(wb + 32 * i), v1 = vld1q_u8(wb + 32 * i + 16);
        const int8x16_t ul0 = vreinterpretq_s8_u8(vandq_u8(v0, low4)), ul1 = vreinterpretq_s8_u8(vandq_u8(v1, low4));
        const int8x16_t uh0 = vreinterpretq_s8_u8(vshrq_n_u8(v0, 4)), uh1 = vreinterpretq_s8_u8(vshrq_n_u8(v1, 4));
        const int8x16_t x1 = bcast(xq + 4 * i), x2 = bcast(xq2 + 4 * i);
        const int8x16_t y1 = bcast(xq + 16 + 4 * i), y2 = bcast(xq2 + 16 + 4 * i);
        h0 = vdotq_s32(vdotq_s32(h0, ul0, x1), uh0, y1);
        h1 = vdotq_s32(vdotq_s32(h1, ul1, x1), uh1, y1);
        l0 = vdotq_s32(vdotq_s32(l0, ul0, x2), uh0, y2);
        l1 = vdotq_s32(vdotq_s32(l1, ul1, x2), uh1, y2);
      }
    } else {
      for (int i = 0; i < 8; ++i) {  // signed 8-bit codes
        const int8x16_t v0 = vreinterpretq_s8_u8(vld1q_u8(wb + 32 * i));
        const int8x16_t v1 = vreinterpretq_s8_u8(vld1q_u8(wb + 32 * i + 16));
        const int8x16_t x1 = bcast(xq + 4 * i), x2 = bcast(xq2 + 4 * i);
        h0 = vdotq_s32(h0, v0, x1);
        h1 = vdotq_s32(h1, v1, x1);
        l0 = vdotq_s32(l0, v0, x2);
        l1 = vdotq_s32(l1, v1, x2);
      }
    }
    const auto dv = sc.dp(g, b);
    const float sx = xa.s[row * nb + b], ss = xa.ss[row * nb + b];
    acc0 = vfmaq_f32(acc0, vcvtq_f32_s32(vmlaq_n_s32(l0, h0, LEVEL)), vmulq_n_f32(load4(dv), sx));
    acc1 = vfmaq_f32(acc1, vcvtq_f32_s32(vmlaq_n_s32(l1, h1, LEVEL)), vmulq_n_f32(load4(dv + 4), sx));
    if constexpr (SC::offsets) {
      const auto mv = sc.mp(g, b);
      acc0 = vfmaq_f32(acc0, load4(mv), vdupq_n_f32(ss));
      acc1 = vfmaq_f32(acc1, load4(mv + 4), vdupq_n_f32(ss));
    }
  }
  vst1q_f32(out, acc0);
  vst1q_f32(out + 4, acc1);
}
#endif

// Tile shapes, sized to the vector registers (32 with AVX-512, 16 with AVX2 alone): with 512-bit VNNI, ZPT pairs
// of groups by ZMT rows, otherwise GT groups by MT rows. One or two rows (decode) run one group at a time: that
// streams the weights in three sequential streams (codes, scales, offsets; two without offsets), which measured
// faster from memory than wider tiles' many streams.
#if defined(PAGEDLLM_QZMM)
constexpr int ZPT = 2, ZMT = 3;
#endif
#if defined(__AVX512VL__)
constexpr int TILE_GT = 2, TILE_MT = 3;
#else
constexpr int TILE_GT = 1, TILE_MT = 3;
#endif
// rows per sweep of the groups (a multiple of the row tiles): 17% faster than one sweep of all rows at 512-2048 rows
// (prefill), the same up to 64
constexpr int64_t ROW_CHUNK = 48;

template <int BITS, typename T, typename SC>
void qlinear_impl(const T* x, int64_t M, int64_t K, const uint8_t* w, const SC& sc, int64_t N, T* y) {
  const int64_t nb = K / QB, NG = (N + 7) / 8, gstride = nb * BITS * 32;
  QuantizedRows xa;
  quantize_rows(x, M, K, xa);
#if defined(__AVX2__) && defined(__FMA__)
  // Rows go in chunks of ROW_CHUNK: a chunk's activations (2 bytes per input) stay in L2 while weights pass,
  // instead of all M rows streaming past every tile of groups.
  auto groups = [&](int64_t r0, int64_t r1, int64_t begin, int64_t end) {
    int64_t g = begin;
    if (r1 - r0 >= TILE_MT) {
#if defined(PAGEDLLM_QZMM)
      for (; g + 2 * ZPT <= end; g += 2 * ZPT)
        qtile512_rows<BITS, ZPT, ZMT>(w, sc, g, gstride, xa, r0, r1, K, nb, N, y);
      for (; g + 2 <= end; g += 2) qtile512_rows<BITS, 1, ZMT>(w, sc, g, gstride, xa, r0, r1, K, nb, N, y);
#else
      for (; g + TILE_GT <= end; g += TILE_GT)
        qtile_rows<BITS, TILE_GT, TILE_MT>(w, sc, g, gstride, xa, r0, r1, K, nb, N, y);
#endif
    }
    for (; g < end; ++g) qtile_rows<BITS, 1, TILE_MT>(w, sc, g, gstride, xa, r0, r1, K, nb, N, y);
  };
  if (M < TILE_MT) {
    // fewer rows than a tile stream the weights from memory: each thread takes one contiguous half (claimed runs
    // broke the streams and the prefetch-ahead: batch 1 was 1.5x slower)
    at::parallel_for(0, NG, 8, [&](int64_t begin, int64_t end) { groups(0, M, begin, end); });
  } else {
    // row tiles are compute-bound: threads claim (row chunk, run of 4 groups) items, row chunk by row chunk, so both
    // threads share a chunk's activations while the weights pass and the last runs balance (a forward's linears at
    // 32 rows: 29.0 -> 26.4 ms)
    constexpr int64_t RUN = 4;
    const int64_t runs = (NG + RUN - 1) / RUN, chunks = (M + ROW_CHUNK - 1) / ROW_CHUNK;
    parallel_claims(chunks * runs, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r0 = i / runs * ROW_CHUNK, g0 = i % runs * RUN;
        groups(r0, std::min(M, r0 + ROW_CHUNK), g0, std::min(NG, g0 + RUN));
      }
    });
  }
#else
  at::parallel_for(0, NG, 2, [&](int64_t begin, int64_t end) {
    float res[8];
    for (int64_t g = begin; g < end; ++g)
      for (int64_t r = 0; r < M; ++r) {
#if defined(PAGEDLLM_QNEON)
        if constexpr (SC::sub == 1) qgroup_neon<BITS>(w + g * gstride, sc, g, xa, r, K, nb, res);
        else qgroup_scalar<BITS>(w + g * gstride, sc, g, xa, r, K, nb, res);  // blocks of 16: the portable loop
#else
        qgroup_scalar<BITS>(w + g * gstride, sc, g, xa, r, K, nb, res);
#endif
        store_group(y + r * N, N, 8 * g, res);
      }
  });
#endif
}

// Runs qlinear_impl for the scales layout `sc` (QScales or KScales) on x's dtype.
template <typename SC>
void qlinear_run(const at::Tensor& x, const at::Tensor& w, int64_t bits, int64_t N, const SC& sc, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1);
  dispatch_float_bf16(x.scalar_type(), "qlinear", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (SC::offsets) {
      if (bits == 4) return qlinear_impl<4, T>(x.data_ptr<T>(), M, K, w.data_ptr<uint8_t>(), sc, N, y.data_ptr<T>());
    }
    qlinear_impl<8, T>(x.data_ptr<T>(), M, K, w.data_ptr<uint8_t>(), sc, N, y.data_ptr<T>());
  });
}

// Calls f with std::integral_constant<int, sub> for sub 1 or 2.
template <typename F>
void with_sub(int64_t sub, F&& f) {
  if (sub == 2)
    f(std::integral_constant<int, 2>{});
  else
    f(std::integral_constant<int, 1>{});
}

void check_qlinear(const at::Tensor& x, const at::Tensor& w, int64_t bits, int64_t N) {
  check_cpu(x, "x");
  TORCH_CHECK(bits == 4 || bits == 8, "qlinear: bits must be 4 or 8");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "qlinear: x must be contiguous (M, K)");
  const int64_t K = x.size(1), NG = (N + 7) / 8;
  TORCH_CHECK(K % QB == 0, "qlinear: in_features ", K, " is not a multiple of 32");
  TORCH_CHECK(N >= 1, "qlinear: out_features must be >= 1");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 2 && w.size(0) == NG &&
                  w.size(1) == K / QB * bits * 32, "qlinear: weight must be contiguous uint8 (ceil(N/8), K*bits)");
}

// x: (M, K) float32/bfloat16; w: (ceil(N/8), K/32 * bits*32) uint8 in the interleaved layout above;
// d, m: (ceil(N/8), K/32 * sub * 8), both float32 or both float16, sub 1 or 2 scales per block (2: blocks of 16);
// m empty: every offset 0 (8-bit codes only). Returns (M, N) in x's dtype.
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d, const at::Tensor& m, int64_t bits,
                   int64_t N) {
  check_qlinear(x, w, bits, N);
  const int64_t M = x.size(0), K = x.size(1), NG = (N + 7) / 8, nb = K / QB;
  const bool half = d.scalar_type() == at::kHalf, offsets = m.numel() > 0;
  const int64_t per_sub = NG * nb * 8, sub = d.numel() == 2 * per_sub ? 2 : 1;
  TORCH_CHECK((half || d.scalar_type() == at::kFloat) && m.scalar_type() == d.scalar_type() && d.is_contiguous() &&
                  m.is_contiguous() && d.numel() == sub * per_sub && (!offsets || m.numel() == d.numel()),
              "qlinear: scales and offsets must be contiguous (ceil(N/8), K/32 * 8) or (ceil(N/8), K/16 * 8), both "
              "float32 or both float16 (offsets may be empty)");
  TORCH_CHECK(bits == 8 || offsets, "qlinear: 4-bit codes need their offsets");
  auto y = at::empty({M, N}, x.options());
  with_sub(sub, [&](auto sub_tag) {
    constexpr int S = decltype(sub_tag)::value;
    if (half && offsets)
      qlinear_run(x, w, bits, N, QScales<at::Half, true, S>{d.data_ptr<at::Half>(), m.data_ptr<at::Half>(), nb}, y);
    else if (half)
      qlinear_run(x, w, bits, N, QScales<at::Half, false, S>{d.data_ptr<at::Half>(), nullptr, nb}, y);
    else if (offsets)
      qlinear_run(x, w, bits, N, QScales<float, true, S>{d.data_ptr<float>(), m.data_ptr<float>(), nb}, y);
    else
      qlinear_run(x, w, bits, N, QScales<float, false, S>{d.data_ptr<float>(), nullptr, nb}, y);
  });
  return y;
}

// qlinear with GGUF K-quant scales (KScales): s, mn: (ceil(N/8), K/32 * sub * 8) int8 sub-block scales and offsets
// (mn empty: none), D, Dm: (ceil(N/8), K/256 * 8) float16 super-block scales; a block's scale is D * s and its
// offset Dm * mn. K is a multiple of 256.
at::Tensor qlinear_k(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, const at::Tensor& mn,
                     const at::Tensor& D, const at::Tensor& Dm, int64_t bits, int64_t N) {
  check_qlinear(x, w, bits, N);
  const int64_t M = x.size(0), K = x.size(1), NG = (N + 7) / 8, nb = K / QB;
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
  TORCH_CHECK(bits == 8 || offsets, "qlinear_k: 4-bit codes need their offsets");
  auto y = at::empty({M, N}, x.options());
  const at::Half* dp = D.data_ptr<at::Half>();
  with_sub(sub, [&](auto sub_tag) {
    constexpr int S = decltype(sub_tag)::value;
    const int8_t* sp = s.data_ptr<int8_t>();
    if (offsets)
      qlinear_run(x, w, bits, N, KScales<true, S>{dp, sp, Dm.data_ptr<at::Half>(), mn.data_ptr<int8_t>(), nb}, y);
    else
      qlinear_run(x, w, bits, N, KScales<false, S>{dp, sp, dp, sp, nb}, y);
  });
  return y;
}

// ------------------------------------------------------------------ greedy sampling: first maximum per row
// torch.max(dim=-1).indices, which is single-threaded and ~1 ms for 32 rows of a 49k vocabulary here: the index
// of each row's first maximum, a NaN counting as the maximum (the first NaN's index). Two passes over a row (its
// maximum and whether it holds a NaN; then the first lane equal to it), rows split over the threads.
int64_t argmax_row(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#if PAGEDLLM_VEC
  if (n >= W) {
    vf vm = vload(x);
    int nans = 0;
    for (; i + W <= n; i += W) {
      const vf v = vload(x + i);
      nans |= vnan_mask(v);
      vm = vmax(vm, v);
    }
    nan = nans != 0;
    m = vhmax(vm);
  }
#endif
  for (int64_t j = i; j < n; ++j) {
    nan = nan || std::isnan(x[j]);
    m = std::max(m, x[j]);
  }
  i = 0;
#if PAGEDLLM_VEC
  const vf vm = vset1(m);
  for (; i + W <= n; i += W) {
    const vf v = vload(x + i);
    const int hit = nan ? vnan_mask(v) : veq_mask(v, vm);
    if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
#endif
  for (; i < n; ++i)
    if (nan ? std::isnan(x[i]) : x[i] == m) return i;
  return 0;  // n == 0 is refused by the caller
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "x must be float32 (rows, n > 0) with unit column stride");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * stride, n);
  });
  return out;
}

std::string isa() {
  std::string s = vector_isa();
#if defined(__AVX2__) && defined(__FMA__)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  s += "+vnni";
#endif
#endif
#if defined(__AVX512BF16__)
  s += "+bf16";
#endif
  return s;
}

}  // namespace

// The kernels run without the GIL (as torch's own operators do): the server's event loop thread serves HTTP and
// streams tokens while a step computes, instead of waiting for the kernel to return. Every tensor argument is held
// by the caller for the call.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("decode_attention", &decode_attention, "paged decode attention (one query per sequence; window > 0: its last "
        "window keys; softcap > 0: scores soft-capped)", py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0, nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm", nogil);
  m.def("add_rms_norm", &add_rms_norm, "h += delta in place, then RMSNorm(h)", nogil);
  m.def("rope_write_kv", &rope_write_kv, "rotary on q (in place) and k; k and v written to the cache", nogil);
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up", nogil);
  m.def("qlinear", &qlinear, "x W^T with W in blocks of 32 (4-bit or 8-bit codes, scale + offset per block)", nogil);
  m.def("qlinear_k", &qlinear_k, "qlinear with GGUF K-quant scales: int8 sub-block scales x float16 super-block "
        "scales", nogil);
  m.def("argmax_rows", &argmax_rows, "index of each row's first maximum (torch.max(dim=-1).indices)", nogil);
  m.def("isa", &isa, "the instruction set this build's vector paths use");
}
