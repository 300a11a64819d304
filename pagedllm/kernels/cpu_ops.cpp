// pagedllm's fused CPU kernels: the small per-layer operations of a decode step, each one pass over memory.
//
// - decode_attention: one query token per sequence over its paged K/V, read in place through the block table
//   (no gathered copy of the context), grouped-query aware, float32 accumulation;
// - rms_norm / add_rms_norm: RMSNorm, optionally after adding the residual branch in place;
// - rope_write_kv: rotary embedding of q (in place) and k, with k and v written straight into their cache slots;
// - silu_and_mul: SiLU(gate) * up of the fused gate/up projection.
// Float32 and bfloat16 tensors; arithmetic in float32, one rounding at the end. Rows are split over torch's
// intra-op threads (at::parallel_for), so the kernels share the OpenMP team of the matmuls around them.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
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

// rows converted to float32 and back, 16 lanes at a time where AVX-512 is there (bf16 rounding: to nearest even)
inline void load_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void load_row(const at::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
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

// ------------------------------------------------------------------ decode attention

#if defined(__AVX512F__)
// AVX-512 path for head dims that are a multiple of 16 (NC chunks of 16 floats): the G query heads of a KV head
// and their output accumulators stay in registers while the context streams past.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// e^x (softmax after subtracting the max, SiLU): x = n ln2 + r, |r| <= ln2/2, e^r by its Taylor series to
// r^7 (relative error < 1e-8, under float32's precision), times 2^n by scalef (0 below about -87, inf above about 88).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.f)), _mm512_set1_ps(100.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 split in a high and a low part
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(static_cast<const char*>(p) + off, _MM_HINT_T0);
}

// One sequence, all heads. Each block of 16 tokens is one contiguous run of memory (16 x Hkv x D): it is read
// once, head after head, while the next block is prefetched; a KV head's G query rows (pass 1) or output rows
// (pass 3) stay in registers over the block.
template <typename T, int G, int NC>
void attend_seq(const float* qf, const T* kc, const T* vc, const int64_t* table, int64_t L, int64_t BS, int64_t Hkv,
                float* scores, float* out) {
  constexpr int64_t D = NC * 16;
  const int64_t tok = Hkv * D, blk = BS * tok, nblocks = (L + BS - 1) / BS, Hq = Hkv * G;
  for (int64_t bi = 0; bi < nblocks; ++bi) {
    const int64_t t0 = bi * BS, n = std::min(BS, L - t0);
    if (bi + 1 < nblocks) prefetch(kc + table[bi + 1] * blk, std::min(BS, L - t0 - BS) * tok * int64_t(sizeof(T)));
    const T* kb = kc + table[bi] * blk;
    for (int64_t h = 0; h < Hkv; ++h) {
      __m512 qv[G][NC];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < NC; ++c) qv[g][c] = _mm512_loadu_ps(qf + (h * G + g) * D + c * 16);
      for (int64_t j = 0; j < n; ++j) {
        __m512 kv[NC];
        for (int c = 0; c < NC; ++c) kv[c] = load16(kb + j * tok + h * D + c * 16);
        for (int g = 0; g < G; ++g) {
          __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
          for (int c = 1; c < NC; ++c) acc = _mm512_fmadd_ps(qv[g][c], kv[c], acc);
          scores[(h * G + g) * L + t0 + j] = _mm512_reduce_add_ps(acc);
        }
      }
    }
  }
  if (nblocks > 0) prefetch(vc + table[0] * blk, std::min(BS, L) * tok * int64_t(sizeof(T)));
  std::vector<float> inv_sum(Hq);
  for (int64_t r = 0; r < Hq; ++r) {  // exact softmax of each query head's row: max, exp, sum
    float* s = scores + r * L;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < L; t += 16) {
      const __mmask16 k = L - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (L - t)) - 1);
      mx = _mm512_mask_max_ps(mx, k, mx, _mm512_maskz_loadu_ps(k, s + t));
    }
    const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < L; t += 16) {
      const __mmask16 k = L - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (L - t)) - 1);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), mv));
      _mm512_mask_storeu_ps(s + t, k, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
    }
    inv_sum[r] = 1.f / _mm512_reduce_add_ps(sum);
  }
  std::fill(out, out + Hq * D, 0.f);
  for (int64_t bi = 0; bi < nblocks; ++bi) {
    const int64_t t0 = bi * BS, n = std::min(BS, L - t0);
    if (bi + 1 < nblocks) prefetch(vc + table[bi + 1] * blk, std::min(BS, L - t0 - BS) * tok * int64_t(sizeof(T)));
    const T* vb = vc + table[bi] * blk;
    for (int64_t h = 0; h < Hkv; ++h) {
      __m512 o[G][NC];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < NC; ++c) o[g][c] = _mm512_loadu_ps(out + (h * G + g) * D + c * 16);
      for (int64_t j = 0; j < n; ++j) {
        __m512 vv[NC];
        for (int c = 0; c < NC; ++c) vv[c] = load16(vb + j * tok + h * D + c * 16);
        for (int g = 0; g < G; ++g) {
          const __m512 p = _mm512_set1_ps(scores[(h * G + g) * L + t0 + j]);
          for (int c = 0; c < NC; ++c) o[g][c] = _mm512_fmadd_ps(p, vv[c], o[g][c]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < NC; ++c) _mm512_storeu_ps(out + (h * G + g) * D + c * 16, o[g][c]);
    }
  }
  for (int64_t r = 0; r < Hq; ++r) {
    const __m512 inv = _mm512_set1_ps(inv_sum[r]);
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(out + r * D + c * 16, _mm512_mul_ps(_mm512_loadu_ps(out + r * D + c * 16), inv));
  }
}

template <typename T, int NC>
bool attend_seq_g(int64_t G, const float* qf, const T* kc, const T* vc, const int64_t* table, int64_t L, int64_t BS,
                  int64_t Hkv, float* scores, float* out) {
  switch (G) {
#define PAGEDLLM_G(n) \
  case n: attend_seq<T, n, NC>(qf, kc, vc, table, L, BS, Hkv, scores, out); return true;
    PAGEDLLM_G(1) PAGEDLLM_G(2) PAGEDLLM_G(3) PAGEDLLM_G(4) PAGEDLLM_G(5) PAGEDLLM_G(6) PAGEDLLM_G(7) PAGEDLLM_G(8)
#undef PAGEDLLM_G
    default: return false;
  }
}

// The AVX-512 path for head dims 64 and 128 and up to 8 query heads per KV head; false: use the portable loop.
template <typename T>
bool attend_fast(int64_t G, int64_t D, const float* qf, const T* kc, const T* vc, const int64_t* table, int64_t L,
                 int64_t BS, int64_t Hkv, float* scores, float* out) {
  if (D == 64) return attend_seq_g<T, 4>(G, qf, kc, vc, table, L, BS, Hkv, scores, out);
  if (D == 128) return attend_seq_g<T, 8>(G, qf, kc, vc, table, L, BS, Hkv, scores, out);
  return false;
}
#else
template <typename T>
bool attend_fast(int64_t, int64_t, const float*, const T*, const T*, const int64_t*, int64_t, int64_t, int64_t,
                 int64_t, float*, float*) {
  return false;
}
#endif

template <typename T>
void decode_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = Hq / Hkv;
  const int64_t q_sb = q.stride(0), q_sh = q.stride(1);
  const int64_t max_blocks = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t tok_stride = Hkv * D;  // elements between consecutive tokens of a block
  const int64_t num_blocks = k_cache.size(0);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(Hq * D), acc(Hq * D), row(D), scores;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = lens[b];
      TORCH_CHECK(L >= 1 && L <= max_blocks * BS, "context length ", L, " does not fit the block table");
      const int64_t* table = tables + b * max_blocks;
      for (int64_t i = 0; i < (L + BS - 1) / BS; ++i)
        TORCH_CHECK(table[i] >= 0 && table[i] < num_blocks, "block ", table[i], " outside the cache");
      for (int64_t hq = 0; hq < Hq; ++hq) {
        const T* src = qp + b * q_sb + hq * q_sh;
        for (int64_t i = 0; i < D; ++i) qf[hq * D + i] = to_f(src[i]) * static_cast<float>(scale);
      }
      scores.resize(Hq * L);
      if (!attend_fast<T>(G, D, qf.data(), kc, vc, table, L, BS, Hkv, scores.data(), acc.data())) {
        for (int64_t h = 0; h < Hkv; ++h) {  // portable path: one KV head at a time
          float* sc = scores.data() + h * G * L;
          for (int64_t t = 0; t < L; ++t) {
            load_row(kc + (table[t / BS] * BS + t % BS) * tok_stride + h * D, row.data(), D);
            for (int64_t g = 0; g < G; ++g) sc[g * L + t] = dot(qf.data() + (h * G + g) * D, row.data(), D);
          }
          for (int64_t g = 0; g < G; ++g) {
            float* sg = sc + g * L;
            float m = -INFINITY, sum = 0.f;
            for (int64_t t = 0; t < L; ++t) m = std::max(m, sg[t]);
            for (int64_t t = 0; t < L; ++t) sum += (sg[t] = std::exp(sg[t] - m));
            for (int64_t t = 0; t < L; ++t) sg[t] /= sum;
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
      for (int64_t i = 0; i < Hq * D; ++i) dst[i] = from_f<T>(acc[i]);
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  check_cpu(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be (B, Hq, D) with unit stride in D");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(), "caches must be contiguous (blocks, block_size, Hkv, D)");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, "head shapes do not match");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == q.size(0), "block_tables must be contiguous int64 (B, max_blocks)");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() &&
                  context_lens.numel() == q.size(0), "context_lens must be contiguous int64 (B,)");
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  dispatch_float_bf16(q.scalar_type(), "decode_attention", [&](auto tag) {
    decode_attention_impl<decltype(tag)>(out, q, k_cache, v_cache, block_tables, context_lens, scale);
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
template <typename T>
void rope_write_kv_impl(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& slots, at::Tensor& k_cache, at::Tensor& v_cache, int64_t nq, int64_t nkv) {
  const int64_t T_ = qkv.size(0), row_stride = qkv.stride(0);
  const int64_t D = k_cache.size(3), half = D / 2;
  T* base = qkv.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* ct = cos.data_ptr<float>();
  const float* st = sin.data_ptr<float>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t max_pos = cos.size(0);
  at::parallel_for(0, T_, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(D), rf(D);
    for (int64_t t = begin; t < end; ++t) {
      TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " outside the rotary table");
      const float* c = ct + pos[t] * half;
      const float* s = st + pos[t] * half;
      T* row = base + t * row_stride;
      T* kdst = kc + slot[t] * nkv * D;
      for (int64_t hd = 0; hd < nq + nkv; ++hd) {
        T* x = row + hd * D;
        T* dst = hd < nq ? x : kdst + (hd - nq) * D;  // q rotated in place, k rotated into the cache
        load_row(x, xf.data(), D);
        const float* x1 = xf.data();
        const float* x2 = xf.data() + half;
        float* r = rf.data();
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          r[i] = x1[i] * c[i] - x2[i] * s[i];
          r[i + half] = x2[i] * c[i] + x1[i] * s[i];
        }
        store_row(r, dst, D);
      }
      std::memcpy(vc + slot[t] * nkv * D, row + (nq + nkv) * D, nkv * D * sizeof(T));
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
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type(),
              "qkv and the caches must share a dtype");
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
    rope_write_kv_impl<decltype(tag)>(qkv, positions, cos, sin, slots, k_cache, v_cache, nq, nkv);
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
#if defined(__AVX512F__)
      for (; i + 16 <= n; i += 16) {  // x * sigmoid(x) * up
        const __m512 x = _mm512_loadu_ps(g.data() + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
        _mm512_storeu_ps(g.data() + i,
                         _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)), _mm512_loadu_ps(u.data() + i)));
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention (one query per sequence)");
  m.def("rms_norm", &rms_norm, "RMSNorm");
  m.def("add_rms_norm", &add_rms_norm, "h += delta in place, then RMSNorm(h)");
  m.def("rope_write_kv", &rope_write_kv, "rotary on q (in place) and k; k and v written to the cache");
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up");
}
