// The small per-layer operations of a decode step, each one pass over memory: paged decode attention, RMSNorm
// (+ residual add), rotary + KV cache write, SiLU(gate) * up, greedy argmax.
#include "common.h"
#include "ops.h"

namespace {

// ------------------------------------------------------------------ decode attention

// What a row's softmax does besides max, exp, sum, scale: ``cap`` > 0 soft-caps the scores first, cap * tanh(s / cap)
// (gemma 2's attention logits); ``sinks`` (per query head, or null) adds a learned logit to each head's denominator
// that no value follows (gpt-oss's attention sinks: the probabilities may sum to less than 1)
struct ScoreRule {
  float cap = 0.f;
  const float* sinks = nullptr;
};

// softmax of s[0..L) in place, query head ``head`` (exact: max, exp, sum, scale), as ``rule`` says
inline void softmax_row(float* s, int64_t L, const ScoreRule& rule, int64_t head) {
  const float cap = rule.cap;
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
  const float sink = rule.sinks != nullptr ? rule.sinks[head] : -INFINITY;
  m = std::max(m, sink);
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
  if (rule.sinks != nullptr) sum += std::exp(sink - m);
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
void attend_seq(float* qf, const T* kc, const T* vc, const int64_t* table, int64_t L, int64_t BS, int64_t tok,
                int64_t h0, int64_t h1, float* scores, float* out, int64_t skip, const ScoreRule& rule) {
  constexpr int64_t D = NC * W;
  constexpr bool split = std::is_same_v<T, at::BFloat16>;
  const int64_t blk = BS * tok, nblocks = (L + BS - 1) / BS;  // tok: elements from a token's row to the next
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
    softmax_row(scores + r * L + skip, L - skip, rule, r);
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
                  int64_t tok, int64_t h0, int64_t h1, float* scores, float* out, int64_t skip, const ScoreRule& rule) {
  switch (G) {
#define PAGEDLLM_G(n) \
  case n: attend_seq<T, n, NC>(qf, kc, vc, table, L, BS, tok, h0, h1, scores, out, skip, rule); return true;
    PAGEDLLM_G(1) PAGEDLLM_G(2) PAGEDLLM_G(3) PAGEDLLM_G(4) PAGEDLLM_G(5) PAGEDLLM_G(6) PAGEDLLM_G(7) PAGEDLLM_G(8)
#undef PAGEDLLM_G
    default: return false;
  }
}
#endif

// The vector path for head dims 64, 128 and 256 and up to 8 query heads per KV head; false: use the portable loop.
template <typename T>
bool attend_fast(int64_t G, int64_t D, float* qf, const T* kc, const T* vc, const int64_t* table, int64_t L,
                 int64_t BS, int64_t tok, int64_t h0, int64_t h1, float* scores, float* out, int64_t skip,
                 const ScoreRule& rule) {
#if PAGEDLLM_VEC
  if (D == 64) return attend_seq_g<T, 64 / W>(G, qf, kc, vc, table, L, BS, tok, h0, h1, scores, out, skip, rule);
  if (D == 128) return attend_seq_g<T, 128 / W>(G, qf, kc, vc, table, L, BS, tok, h0, h1, scores, out, skip, rule);
  if (D == 256)  // gemma
    return attend_seq_g<T, 256 / W>(G, qf, kc, vc, table, L, BS, tok, h0, h1, scores, out, skip, rule);
  if (D == 512)  // gemma 4's full layers
    return attend_seq_g<T, 512 / W>(G, qf, kc, vc, table, L, BS, tok, h0, h1, scores, out, skip, rule);
#endif
  (void)G, (void)D, (void)qf, (void)kc, (void)vc, (void)table, (void)L, (void)BS, (void)tok, (void)h0, (void)h1,
      (void)scores, (void)out, (void)skip, (void)rule;
  return false;
}

// T: the dtype of q and out; C: the caches' (a bfloat16 cache under float32 activations halves the bytes read)
template <typename T, typename C>
void decode_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                           int64_t window, double softcap, const float* sinks) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const ScoreRule rule{static_cast<float>(softcap), sinks};
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
  // elements between consecutive tokens of a block: Hkv * D, or more where a cache row is shared by layers of
  // different head shapes and this layer uses its first Hkv * D values (``paged_layout``)
  const int64_t tok_stride = k_cache.stride(1);
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
      if (!attend_fast<C>(G, D, qf.data(), kc, vc, table, L, BS, tok_stride, h0, h1, scores.data(), acc.data(), skip,
                           rule)) {
        for (int64_t h = h0; h < h1; ++h) {  // portable path: one KV head at a time
          float* sc = scores.data() + h * G * L;
          for (int64_t t = 0; t < L; ++t) {
            load_row(kc + (table[t / BS] * BS + t % BS) * tok_stride + h * D, row.data(), D);
            for (int64_t g = 0; g < G; ++g) sc[g * L + t] = dot(qf.data() + (h * G + g) * D, row.data(), D);
          }
          for (int64_t g = 0; g < G; ++g) {
            std::fill(sc + g * L, sc + g * L + skip, 0.f);
            softmax_row(sc + g * L + skip, L - skip, rule, h * G + g);
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

// ------------------------------------------------------------------ RMSNorm (+ residual add)
// Row r of h (and of out and delta) starts at (r / heads) * stride + (r % heads) * n: rows one after another
// (heads 1, stride n), or the heads of a token's row of width stride (the per-head q/k norms, in place).
// WT: the weight's dtype. The normalized row is rounded to T before the weight multiplies it when WT is T (HF's
// llama: weight * x.to(dtype)); a float32 weight under bfloat16 activations multiplies the float32 row, rounded
// once at the end (HF's gemma: x * (1 + w.float()) in float32).
// Float32 rows (an encoder's residual stream under bfloat16 linears) may also take a bfloat16 delta (DT: a linear's
// output, added exactly as torch adds it) and write a bfloat16 output (OT: the next linear's input, rounded once,
// as its cast would round it): the casts around the linears fused into the norm's one pass.
template <typename T, typename WT = T, typename DT = T, typename OT = T>
void rms_norm_impl(OT* out, T* h, const DT* delta, const WT* w, int64_t rows, int64_t n, double eps,
                   int64_t heads = 1, int64_t stride = 0) {
  if (stride == 0) stride = n;
  constexpr bool F32 = std::is_same_v<T, float>;  // rows are read and written in place, with no float32 copies
  static_assert(F32 || (std::is_same_v<DT, T> && std::is_same_v<OT, T>), "bfloat16 rows: delta and out alike");
  constexpr bool MIXED = !std::is_same_v<DT, T> || !std::is_same_v<OT, T>;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> x(F32 && !MIXED ? 0 : n), d(F32 && std::is_same_v<DT, T> ? 0 : n),
        wf(std::is_same_v<WT, float> ? 0 : n);
    std::vector<T> tmp(F32 ? 0 : n);
    const float* wr = as_float_row(w, wf.data(), n);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t off = (r / heads) * stride + (r % heads) * n;
      T* hr = h + off;
      const float* xr;  // the row (plus delta), as float32
      if constexpr (F32) {
        if (delta != nullptr) {
          const float* dr = as_float_row(delta + off, d.data(), n);
#pragma omp simd
          for (int64_t i = 0; i < n; ++i) hr[i] += dr[i];
        }
        xr = hr;
      } else {
        load_row(hr, x.data(), n);
        if (delta != nullptr) {  // h += delta, rounded to the storage dtype as a separate add would round it
          load_row(delta + off, d.data(), n);
#pragma omp simd
          for (int64_t i = 0; i < n; ++i) x[i] += d[i];
          store_row(x.data(), hr, n);
          load_row(hr, x.data(), n);
        }
        xr = x.data();
      }
      const float ss = dot(xr, xr, n);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
      if constexpr (F32 && std::is_same_v<OT, float>) {
        float* o = out + off;  // may be hr itself (element by element: in place is safe)
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) o[i] = xr[i] * inv * wr[i];
      } else if constexpr (F32) {  // float32 row, bfloat16 out
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) x[i] = xr[i] * inv * wr[i];
        store_row(x.data(), out + off, n);
      } else {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) x[i] *= inv;
        if constexpr (std::is_same_v<WT, T>) {
          store_row(x.data(), tmp.data(), n);  // normalized, rounded to the dtype, then times the weight
          load_row(tmp.data(), x.data(), n);
        }
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) x[i] *= wr[i];
        store_row(x.data(), out + off, n);
      }
    }
  });
}

at::Tensor rms_norm_common(at::Tensor& h, const at::Tensor* delta, const at::Tensor& weight, double eps,
                           bool out_bf16) {
  check_cpu(h, "hidden");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "hidden must be contiguous (T, H)");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == h.size(1) &&
                  (weight.scalar_type() == h.scalar_type() || weight.scalar_type() == at::kFloat),
              "weight must be (H,) in the hidden dtype or float32");
  if (delta != nullptr)
    TORCH_CHECK(delta->is_contiguous() && delta->sizes() == h.sizes() &&
                    (delta->scalar_type() == h.scalar_type() || delta->scalar_type() == at::kBFloat16),
                "the residual branch must be contiguous and shaped like hidden, in its dtype or bfloat16");
  auto out = at::empty_like(h, out_bf16 ? h.options().dtype(at::kBFloat16) : h.options());
  const int64_t rows = h.size(0), n = h.size(1);
  if (h.scalar_type() == at::kFloat) {  // float32 rows: the delta and the output in float32 or bfloat16
    TORCH_CHECK(weight.scalar_type() == at::kFloat, "float32 hidden rows take a float32 weight");
    dispatch_float_bf16(delta ? delta->scalar_type() : at::kFloat, "rms_norm (delta)", [&](auto dtag) {
      using DT = decltype(dtag);
      dispatch_float_bf16(out.scalar_type(), "rms_norm (out)", [&](auto otag) {
        using OT = decltype(otag);
        rms_norm_impl<float, float, DT, OT>(out.data_ptr<OT>(), h.data_ptr<float>(),
                                            delta ? delta->data_ptr<DT>() : nullptr, weight.data_ptr<float>(),
                                            rows, n, eps);
      });
    });
    return out;
  }
  TORCH_CHECK(delta == nullptr || delta->scalar_type() == h.scalar_type(),
              "bfloat16 hidden rows take a bfloat16 delta");
  dispatch_float_bf16(h.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, float>) {
      dispatch_float_bf16(weight.scalar_type(), "rms_norm (weight)", [&](auto wtag) {  // T's, or float32
        using WT = decltype(wtag);
        rms_norm_impl<T, WT>(out.data_ptr<T>(), h.data_ptr<T>(), delta ? delta->data_ptr<T>() : nullptr,
                             weight.data_ptr<WT>(), rows, n, eps);
      });
    }
  });
  return out;
}

// ------------------------------------------------------------------ rotary + KV cache write
// T: the dtype of qkv; C: the caches' (k and v are rounded to it as they are written)
template <typename T, typename C>
void rope_write_kv_impl(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& slots, at::Tensor& k_cache, at::Tensor& v_cache, int64_t nq, int64_t nkv) {
  const int64_t T_ = qkv.size(0), row_stride = qkv.stride(0);
  // the rotary turns the first 2 * half dimensions of each head (pairs i, i + half); the rest pass (partial rotary)
  const int64_t D = k_cache.size(3), half = cos.size(1), tok_stride = k_cache.stride(1);
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
      C* kdst = kc + slot[t] * tok_stride;
      for (int64_t hd = 0; hd < nq + nkv; ++hd) {
        T* x = row + hd * D;
        load_row(x, xf.data(), D);
        const float* x1 = xf.data();
        const float* x2 = xf.data() + half;
        float* r = rf.data();
        for (int64_t i = 2 * half; i < D; ++i) r[i] = xf[i];
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
      C* vdst = vc + slot[t] * tok_stride;
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

// ------------------------------------------------------------------ act(gate) * up
// SiLU: x * sigmoid(x). GELU with the tanh approximation (gemma's GeGLU): 0.5 x (1 + tanh(u)) with
// u = sqrt(2/pi) (x + 0.044715 x^3), computed as x * sigmoid(2u) = x / (1 + e^(-2u)) (the same value, without the
// cancellation of 1 + tanh(u) for negative u), so both are x / (1 + e^a) with a = -x or -2u. gpt-oss's clamped
// SwiGLU: the gate x clamped above at 7, x / (1 + e^(-1.702 x)) times the up projection clamped to +-7, plus 1.
enum class Act { SiLU, GeluTanh, SwigluOai };
constexpr float OAI_ALPHA = 1.702f, OAI_LIMIT = 7.f;  // layers/ops.py SWIGLU_OAI_ALPHA / _LIMIT

template <Act A>
inline float gate_exponent(float x) {
  if constexpr (A == Act::GeluTanh) return -1.5957691216057308f * (x + 0.044715f * x * x * x);
  if constexpr (A == Act::SwigluOai) return -OAI_ALPHA * x;
  return -x;
}

template <typename T, Act A>
void act_and_mul_impl(T* out, const T* gu, int64_t rows, int64_t n) {
  constexpr bool F32 = std::is_same_v<T, float>;  // float32 rows: read and written where they are
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> g(F32 ? 0 : n), u(F32 ? 0 : n);
    for (int64_t r = begin; r < end; ++r) {
      const float* gr = as_float_row(gu + r * 2 * n, g.data(), n);
      const float* ur = as_float_row(gu + r * 2 * n + n, u.data(), n);
      float* o;
      if constexpr (F32) o = out + r * n;
      else o = g.data();  // over gr, element by element
      int64_t i = 0;
#if PAGEDLLM_VEC
      for (; i + W <= n; i += W) {
        vf x = vload(gr + i), u = vload(ur + i);
        if constexpr (A == Act::SwigluOai) {  // min/max(limit, v): a NaN v passes through, as torch's clamp
          x = vmin(vset1(OAI_LIMIT), x);
          u = vadd(vmax(vset1(-OAI_LIMIT), vmin(vset1(OAI_LIMIT), u)), vset1(1.f));
        }
        const vf a = A == Act::GeluTanh ? vmul(vset1(-1.5957691216057308f), vfma(vmul(vset1(0.044715f), vmul(x, x)), x, x))
                   : A == Act::SwigluOai ? vmul(vset1(-OAI_ALPHA), x)
                                         : vsub(vzero(), x);
        vstore(o + i, vmul(vdiv(x, vadd(vset1(1.f), vexp(a))), u));
      }
#endif
      for (; i < n; ++i) {
        float x = gr[i], u = ur[i];
        if constexpr (A == Act::SwigluOai) {
          x = std::isnan(x) ? x : std::min(OAI_LIMIT, x);
          u = (std::isnan(u) ? u : std::max(-OAI_LIMIT, std::min(OAI_LIMIT, u))) + 1.f;
        }
        o[i] = x / (1.f + std::exp(gate_exponent<A>(x))) * u;
      }
      if constexpr (!F32) store_row(g.data(), out + r * n, n);
    }
  });
}

// ------------------------------------------------------------------ greedy sampling: first maximum per row
// torch.max(dim=-1).indices, which is single-threaded (figures: docs/history.md#figures-from-code-comments): the index
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


// ------------------------------------------------------------------ an encoder's attention on AMX bfloat16 tiles
// Each text's rows attend to all of its rows (both ways, no cache). torch's SDPA runs a small head (BERT's 32
// dimensions) at ~0.1 T multiply-adds/s here; on the tiles the products are nearly free and the softmax's exps are
// the work. Per (text, kv head): K packed as B tiles of the scores (16 keys x 32 dimensions each: row r holds
// each key's dimension pair 2r, 2r + 1), V as B tiles of the output (32 keys x 16 dimensions: row r holds each
// dimension of keys 2r, 2r + 1); then per block of 16 queries: the whole score rows (16 x keys, float32 sums of
// the bfloat16 products), a two-pass softmax in float32 (powers of 2: enc_exp2), the probabilities rounded to
// bfloat16, and the output's float32 sums divided by each row's sum, rounded to bfloat16 once. q, k and v are what
// the bfloat16 linears gave (no rounding of their own); the probabilities' rounding is the one step torch's float32
// path lacks.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__) && \
    defined(__linux__)
#define PAGEDLLM_ENC_AMX 1

struct alignas(64) EncTileCfg {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// 2^t for t <= 0 (clamped at -126): 2^round(t) times 2^f, |f| <= 1/2, by its Taylor polynomial of degree 5
// (relative error < 3e-6: the probabilities are rounded to bfloat16, 8 bits, before they weigh the values)
inline __m512 enc_exp2(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022651f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69314718f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Tiles: 0 = A (queries, or probabilities), 1 and 2 = B (alternating), 4-7 = C: up to 4 independent sums at once
// (one tile's chain of dependent tdpbf16ps would wait on each product's latency).
#define PAGEDLLM_ENC_C(j, OP)    \
  do {                           \
    switch (j) {                 \
      case 0: OP(4); break;      \
      case 1: OP(5); break;      \
      case 2: OP(6); break;      \
      default: OP(7); break;     \
    }                            \
  } while (0)

// rows [s, s + n) of one kv head hk and its query heads; q, k, v: (T, H, D) bfloat16 with unit head stride
void encoder_attention_text(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int64_t qs,
                            int64_t ks, int64_t vs, int64_t os, int64_t s, int64_t n, int64_t hk, int64_t group,
                            int64_t D, float scale) {
  const int64_t n16 = round_up(n, 16), n32 = round_up(n, 32), dc32 = D / 32, dc16 = D / 16;
  std::vector<uint16_t> kb(n16 * D), vb(n32 * D), qb(16 * D), p(2 * 16 * n32);
  std::vector<float> sc(16 * n16);
  alignas(64) float ot[16][16];
  // K: tile (key block b, dimension chunk c) row r, column j = key 16 b + j's dimensions 32 c + 2 r, + 1: a gather
  // of one 32-bit pair per key (keys past n: zeros)
  const __m512i key_rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(static_cast<int>(ks / 2)));
  for (int64_t b = 0; b < n16 / 16; ++b) {
    const __mmask16 live = __mmask16((1u << std::min<int64_t>(n - 16 * b, 16)) - 1);
    for (int64_t c = 0; c < dc32; ++c) {
      const int* src = reinterpret_cast<const int*>(k + (s + 16 * b) * ks + hk * D + 32 * c);
      uint16_t* t = kb.data() + (b * dc32 + c) * 512;
      for (int64_t r = 0; r < 16; ++r)
        _mm512_storeu_si512(t + 32 * r,
                            _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, key_rows, src + r, 4));
    }
  }
  // V: tile (key pair block b, dimension chunk c) row r = keys 32 b + 2 r, + 1 of dimensions 16 c .. 16 c + 15,
  // interleaved (one word permute of the two rows)
  const __m512i pairs = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005,
                                          0x00260006, 0x00270007, 0x00280008, 0x00290009, 0x002A000A, 0x002B000B,
                                          0x002C000C, 0x002D000D, 0x002E000E, 0x002F000F);
  for (int64_t b = 0; b < n32 / 32; ++b)
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t k0 = 32 * b + 2 * r;
      for (int64_t c = 0; c < dc16; ++c) {
        const __m512i e0 = k0 < n ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                        reinterpret_cast<const __m256i*>(v + (s + k0) * vs + hk * D + 16 * c)))
                                  : _mm512_setzero_si512();
        const __m512i e1 = k0 + 1 < n ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                            reinterpret_cast<const __m256i*>(v + (s + k0 + 1) * vs + hk * D + 16 * c)))
                                      : _mm512_setzero_si512();
        _mm512_storeu_si512(vb.data() + (b * dc16 + c) * 512 + 32 * r, _mm512_permutex2var_epi16(e0, pairs, e1));
      }
    }
  // per query block: its scores (tiles), then the previous block's output (tiles: its probabilities were stored
  // long before, so the tile loads do not wait on the vector stores), then its softmax (vector unit)
  float inv[2][16];
  auto scores = [&](int64_t hq, int64_t q0) {
    // the queries' A tiles straight from q; a last block of fewer than 16 rows from a zero-padded copy
    const uint16_t* qa = q + (s + q0) * qs + hq * D;
    int64_t qstride = qs;
    if (q0 + 16 > n) {
      for (int64_t i = 0; i < 16; ++i) {
        if (q0 + i < n)
          std::memcpy(qb.data() + i * D, qa + i * qs, D * sizeof(uint16_t));
        else
          std::memset(qb.data() + i * D, 0, D * sizeof(uint16_t));
      }
      qa = qb.data();
      qstride = D;
    }
    for (int64_t b0 = 0; b0 < n16 / 16; b0 += 4) {  // 16 queries x 16 keys per C tile, 4 key blocks at once
      const int64_t nb = std::min<int64_t>(4, n16 / 16 - b0);
      for (int64_t j = 0; j < nb; ++j) PAGEDLLM_ENC_C(j, _tile_zero);
      for (int64_t c = 0; c < dc32; ++c) {
        _tile_loadd(0, qa + 32 * c, qstride * sizeof(uint16_t));
        for (int64_t j = 0; j < nb; ++j) {
          const uint16_t* bt = kb.data() + ((b0 + j) * dc32 + c) * 512;
#define PAGEDLLM_ENC_MUL(C)             \
  do {                                  \
    if (j % 2 == 0) {                   \
      _tile_loadd(1, bt, 64);           \
      _tile_dpbf16ps(C, 0, 1);          \
    } else {                            \
      _tile_loadd(2, bt, 64);           \
      _tile_dpbf16ps(C, 0, 2);          \
    }                                   \
  } while (0)
          PAGEDLLM_ENC_C(j, PAGEDLLM_ENC_MUL);
        }
      }
      for (int64_t j = 0; j < nb; ++j) {
        float* dst = sc.data() + 16 * (b0 + j);
#define PAGEDLLM_ENC_ST(C) _tile_stored(C, dst, n16 * sizeof(float))
        PAGEDLLM_ENC_C(j, PAGEDLLM_ENC_ST);
#undef PAGEDLLM_ENC_ST
      }
    }
  };
  const int64_t full = n / 16 * 16;
  const __mmask16 tail = __mmask16((1u << (n - full)) - 1);
  const vf k2 = vset1(scale * 1.44269504088896341f);
  auto softmax = [&](int64_t buf) {  // each row over its n keys, as powers of 2
    for (int64_t i = 0; i < 16; ++i) {
      const float* row = sc.data() + i * n16;
      vf m = vset1(-INFINITY);
      for (int64_t j = 0; j < full; j += 16) m = vmax(m, vload(row + j));
      if (tail) m = _mm512_mask_max_ps(m, tail, m, vload(row + full));
      const vf mk2 = vmul(vset1(vhmax(m)), k2);  // (scale > 0)
      vf sum = vzero();
      uint16_t* pr = p.data() + (buf * 16 + i) * n32;
      for (int64_t j = 0; j < full; j += 16) {
        const vf e = enc_exp2(_mm512_fmsub_ps(vload(row + j), k2, mk2));
        sum = vadd(sum, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)_mm512_cvtneps_pbh(e));
      }
      int64_t j = full;
      if (tail) {
        const vf e = _mm512_maskz_mov_ps(tail, enc_exp2(_mm512_fmsub_ps(vload(row + j), k2, mk2)));
        sum = vadd(sum, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)_mm512_cvtneps_pbh(e));
        j += 16;
      }
      for (; j < n32; j += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), _mm256_setzero_si256());
      inv[buf][i] = 1.f / vsum(sum);
    }
  };
  auto output = [&](int64_t hq, int64_t q0, int64_t buf) {  // 16 queries x 16 dimensions per C tile, 4 at once
    const uint16_t* pb = p.data() + buf * 16 * n32;
    for (int64_t c0 = 0; c0 < dc16; c0 += 4) {
      const int64_t nc = std::min<int64_t>(4, dc16 - c0);
      for (int64_t j = 0; j < nc; ++j) PAGEDLLM_ENC_C(j, _tile_zero);
      for (int64_t b = 0; b < n32 / 32; ++b) {
        _tile_loadd(0, pb + 32 * b, n32 * sizeof(uint16_t));
        for (int64_t j = 0; j < nc; ++j) {
          const uint16_t* bt = vb.data() + (b * dc16 + c0 + j) * 512;
          PAGEDLLM_ENC_C(j, PAGEDLLM_ENC_MUL);
        }
      }
      for (int64_t j = 0; j < nc; ++j) {
#define PAGEDLLM_ENC_ST(C) _tile_stored(C, ot, 64)
        PAGEDLLM_ENC_C(j, PAGEDLLM_ENC_ST);
#undef PAGEDLLM_ENC_ST
        for (int64_t i = 0; i < std::min<int64_t>(16, n - q0); ++i) {
          const vf y = vmul(_mm512_load_ps(ot[i]), vset1(inv[buf][i]));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (s + q0 + i) * os + hq * D + 16 * (c0 + j)),
                              (__m256i)_mm512_cvtneps_pbh(y));
        }
      }
    }
  };
#undef PAGEDLLM_ENC_MUL
  // the blocks of all query heads of this kv head in one sequence: block t = (head t / nqb, rows 16 (t % nqb))
  const int64_t nqb = n16 / 16, total = group * nqb;
  for (int64_t t = 0; t <= total; ++t) {
    if (t < total) scores(hk * group + t / nqb, 16 * (t % nqb));
    if (t > 0) output(hk * group + (t - 1) / nqb, 16 * ((t - 1) % nqb), (t - 1) % 2);
    if (t < total) softmax(t % 2);
  }
}
#undef PAGEDLLM_ENC_C
#endif

}  // namespace

namespace pagedllm {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
  check_cpu(q, "q");
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none)");
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->device().is_cpu() &&
                         sinks->numel() == q.size(1)), "sinks must be contiguous float32 (Hq,) on the CPU");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be (B, Hq, D) with unit stride in D");
  TORCH_CHECK(paged_layout(k_cache) && paged_layout(v_cache) && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.strides() == k_cache.strides(),
              "caches must be (blocks, block_size, Hkv, D), each token's heads contiguous");
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
                                                           window, softcap,
                                                           sinks ? sinks->data_ptr<float>() : nullptr);
    });
  });
  return out;
}

at::Tensor rms_norm(at::Tensor h, const at::Tensor& weight, double eps, bool out_bf16) {
  return rms_norm_common(h, nullptr, weight, eps, out_bf16);
}

// h += delta in place; returns rms_norm(h) * weight
at::Tensor add_rms_norm(at::Tensor h, const at::Tensor& delta, const at::Tensor& weight, double eps, bool out_bf16) {
  return rms_norm_common(h, &delta, weight, eps, out_bf16);
}

// BERT's post-norm step: h = LayerNorm(h + delta) * weight + bias in place (float32 rows; delta float32 or
// bfloat16, a linear's output), and a bfloat16 copy of the new rows (the next linear's input, rounded once):
// the add, the norm and the cast in one pass over the rows
at::Tensor add_layer_norm(at::Tensor h, const at::Tensor& delta, const at::Tensor& weight, const at::Tensor& bias,
                          double eps) {
  check_cpu(h, "hidden");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.scalar_type() == at::kFloat,
              "hidden must be contiguous float32 (T, H)");
  TORCH_CHECK(delta.is_contiguous() && delta.sizes() == h.sizes() &&
                  (delta.scalar_type() == at::kFloat || delta.scalar_type() == at::kBFloat16),
              "delta must be contiguous, shaped like hidden, float32 or bfloat16");
  TORCH_CHECK(weight.is_contiguous() && bias.is_contiguous() && weight.scalar_type() == at::kFloat &&
                  bias.scalar_type() == at::kFloat && weight.numel() == h.size(1) && bias.numel() == h.size(1),
              "weight and bias must be float32 (H,)");
  auto out = at::empty_like(h, h.options().dtype(at::kBFloat16));
  const int64_t rows = h.size(0), n = h.size(1);
  const float* w = weight.data_ptr<float>();
  const float* b = bias.data_ptr<float>();
  dispatch_float_bf16(delta.scalar_type(), "add_layer_norm (delta)", [&](auto dtag) {
    using DT = decltype(dtag);
    const DT* dp = delta.data_ptr<DT>();
    float* hp = h.data_ptr<float>();
    at::BFloat16* op = out.data_ptr<at::BFloat16>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> d(std::is_same_v<DT, float> ? 0 : n);
      for (int64_t r = begin; r < end; ++r) {
        float* x = hp + r * n;
        const float* dr = as_float_row(dp + r * n, d.data(), n);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) {
          x[i] += dr[i];
          sum += x[i];
        }
        const float mean = sum / static_cast<float>(n);
        float var = 0.f;
#pragma omp simd reduction(+ : var)
        for (int64_t i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
        const float rstd = 1.f / std::sqrt(var / static_cast<float>(n) + static_cast<float>(eps));
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) x[i] = (x[i] - mean) * rstd * w[i] + b[i];
        store_row(x, op + r * n, n);
      }
    });
  });
  return out;
}

void qk_norm(at::Tensor qkv, const at::Tensor& q_weight, const at::Tensor& k_weight, int64_t nq, int64_t nkv,
             double eps) {
  check_cpu(qkv, "qkv");
  const int64_t D = q_weight.numel();
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) >= (nq + nkv) * D,
              "qkv must be (T, width >= (nq + nkv) * head_dim) with unit column stride");
  TORCH_CHECK(q_weight.is_contiguous() && k_weight.is_contiguous() && k_weight.numel() == D &&
                  q_weight.scalar_type() == k_weight.scalar_type() &&
                  (q_weight.scalar_type() == qkv.scalar_type() || q_weight.scalar_type() == at::kFloat),
              "the q and k norm weights must be (head_dim,) in qkv's dtype or float32");
  const int64_t T_ = qkv.size(0), stride = qkv.stride(0);
  dispatch_float_bf16(qkv.scalar_type(), "qk_norm", [&](auto tag) {
    using T = decltype(tag);
    T* q = qkv.data_ptr<T>();
    dispatch_float_bf16(q_weight.scalar_type(), "qk_norm (weights)", [&](auto wtag) {  // T's, or float32
      using WT = decltype(wtag);
      const T* none = nullptr;  // (no delta)
      rms_norm_impl<T, WT>(q, q, none, q_weight.data_ptr<WT>(), T_ * nq, D, eps, nq, stride);
      rms_norm_impl<T, WT>(q + nq * D, q + nq * D, none, k_weight.data_ptr<WT>(), T_ * nkv, D, eps, nkv, stride);
    });
  });
}

// qkv: (T, (nq + 2 nkv) D) rows (row stride may exceed the width); rotates q in place and writes rotated k and
// v to their slots in (blocks, block_size, nkv, D) caches. cos, sin: float32 (max_position, D/2) tables.
void rope_write_kv(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                   const at::Tensor& slots, at::Tensor k_cache, at::Tensor v_cache, int64_t nq, int64_t nkv) {
  check_cpu(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be (T, width) with unit column stride");
  TORCH_CHECK(paged_layout(k_cache) && paged_layout(v_cache) && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.strides() == k_cache.strides() && (nkv == 0 || k_cache.size(2) == nkv),
              "caches must be (blocks, block_size, nkv, D), each token's heads contiguous");
  const int64_t D = k_cache.size(3);
  TORCH_CHECK(qkv.size(1) == (nq + 2 * nkv) * D && D % 2 == 0, "qkv width does not match the heads");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "the K and V caches must share a dtype");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(1) <= D / 2 && sin.size(1) == cos.size(1),
              "cos/sin must be contiguous float32 (P, R/2), R <= D the rotated dimensions");
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

template <Act A>
at::Tensor act_and_mul(const at::Tensor& gate_up) {
  check_cpu(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be contiguous (T, 2I)");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = at::empty({rows, n}, gate_up.options());
  dispatch_float_bf16(gate_up.scalar_type(), "act_and_mul", [&](auto tag) {
    using T = decltype(tag);
    act_and_mul_impl<T, A>(out.data_ptr<T>(), gate_up.data_ptr<T>(), rows, n);
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) { return act_and_mul<Act::SiLU>(gate_up); }

at::Tensor gelu_tanh_and_mul(const at::Tensor& gate_up) { return act_and_mul<Act::GeluTanh>(gate_up); }

at::Tensor swiglu_oai_and_mul(const at::Tensor& gate_up) { return act_and_mul<Act::SwigluOai>(gate_up); }

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
  if (amx_enabled()) s += "+amx";  // qlinear's tiles on AMX (built for it, and the OS grants the tile state)
  return s;
}


bool encoder_attention_tiles() {
#if defined(PAGEDLLM_ENC_AMX)
  return bf16_tiles_enabled();
#else
  return false;
#endif
}

// q (T, Hq, D), k and v (T, Hkv, D): bfloat16 views with unit head and dimension strides (of the qkv rows);
// spans (B, 2) int64 [start, end) of each text, disjoint; returns (T, Hq, D) bfloat16, rows outside every span
// unwritten. Runs where encoder_attention_tiles() (AMX-BF16 built and granted, and qlinear's AMX not turned off:
// PAGEDLLM_CPU_AMX=0 / set_qlinear_amx(False) turn off both).
at::Tensor encoder_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& spans,
                             double scale) {
  TORCH_CHECK(encoder_attention_tiles(), "encoder_attention: no AMX-BF16 tiles here (encoder_attention_tiles())");
  for (const at::Tensor* t : {&q, &k, &v}) {
    check_cpu(*t, "q/k/v");
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == at::kBFloat16 && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "q, k and v must be bfloat16 (T, H, D) with contiguous heads");
  }
  const int64_t T_ = q.size(0), hq = q.size(1), hkv = k.size(1), D = q.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == T_ && k.size(2) == D && hkv > 0 && hq % hkv == 0 && D % 32 == 0,
              "k and v must be (T, Hkv, D) with Hq a multiple of Hkv and D a multiple of 32");
  check_cpu(spans, "spans");
  TORCH_CHECK(spans.scalar_type() == at::kLong && spans.dim() == 2 && spans.size(1) == 2 && spans.is_contiguous(),
              "spans must be contiguous int64 (B, 2)");
  TORCH_CHECK(k.stride(0) % 2 == 0 && scale > 0, "k's row stride must be even (pairs of dimensions are gathered) "
              "and the scale positive");
  const int64_t* sp = spans.data_ptr<int64_t>();
  const int64_t B = spans.size(0);
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(0 <= sp[2 * b] && sp[2 * b] < sp[2 * b + 1] && sp[2 * b + 1] <= T_, "span ", b, " outside the rows");
  auto out = at::empty({T_, hq, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
#if defined(PAGEDLLM_ENC_AMX)
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t group = hq / hkv;
  // items: (text, kv head), longest texts first so that the last items to finish are short
  std::vector<int64_t> order(B);
  for (int64_t b = 0; b < B; ++b) order[b] = b;
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return sp[2 * a + 1] - sp[2 * a] > sp[2 * b + 1] - sp[2 * b]; });
  parallel_claims(B * hkv, 1, [&](int64_t begin, int64_t end) {
    EncTileCfg cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.rows[t] = 16;
      cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t b = order[it / hkv], h = it % hkv;
      encoder_attention_text(qp, kp, vp, op, q.stride(0), k.stride(0), v.stride(0), hq * D, sp[2 * b],
                             sp[2 * b + 1] - sp[2 * b], h, group, D, static_cast<float>(scale));
    }
  });
#endif
  return out;
}

}  // namespace pagedllm
