// Gated DeltaNet's step (layers/gated_deltanet.py) for every sequence of a step at once, decode rows and prefill
// chunks alike: each sequence's rows run through the recurrence in order, its states read and updated in place in
// the layer's pools at its slot (no gathered copy), and the gated RMSNorm applied. Two passes:
// 1. per (sequence, block of channels): the causal depthwise convolution over the slot's last K - 1 inputs and the
//    sequence's rows (the state shifted row by row), SiLU, rounded to the activations' dtype; then per row q and k
//    L2-normalised per key head, q times 1/sqrt(Dk);
// 2. per (sequence, value head), row after row: S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q, with S^T k
//    taken before the decay (times exp(g)) and the new S written while o is summed. Each column of S depends only
//    on itself, so S (Dk x Dv float32, 64 KiB at 128 x 128) goes in slabs of 16 columns (8 KiB), each slab in L1
//    across all of the sequence's rows: S is read from memory and written back once per step. Then o's RMSNorm,
//    times the norm weight, times SiLU(z), each rounded to the dtype as transformers' RMSNormGated rounds.
// The recurrent form: ~3 Dk Dv multiply-adds per row and head, against the chunked form's ~4.5 Dk Dv plus its
// intra-chunk products (the torch path's, for long chunks on other devices); exact in arithmetic, it differs from
// the chunked form only in rounding. A snapshot (a prefix-cache state) is copied to its slot after save_rows rows.

#include <vector>

#include "common.h"
#include "ops.h"

namespace pagedllm {
namespace {

template <typename T>
inline float dn_round(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return static_cast<float>(static_cast<T>(x));
}

inline float dn_silu(float x) { return x / (1.f + std::exp(-x)); }
// x / (1 + e^-x) over a row, vectorised (vexp: common.h)
inline void dn_silu_row(float* x, int64_t n) {
  int64_t i = 0;
#if PAGEDLLM_VEC
  for (; i + W <= n; i += W) {
    const vf v = vload(x + i);
    vstore(x + i, vdiv(v, vadd(vset1(1.f), vexp(vsub(vzero(), v)))));
  }
#endif
  for (; i < n; ++i) x[i] = dn_silu(x[i]);
}
inline float dn_softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }  // torch's threshold 20

constexpr int64_t CONV_BLOCK = 512;  // channels per task of the convolution pass
constexpr int64_t DN_COLS = 16;  // columns of S per block of the recurrence (Dv a multiple of it)

struct Seq { int64_t start, n, slot, save_rows, save_slot; };

// Denormals flushed to zero (FTZ) and read as zero (DAZ) while a thread runs this kernel, its own setting restored
// after (MXCSR is per thread; the process's stays IEEE): a decaying state passes through the denormal range, where
// each multiply costs ~100 cycles (the chunked form's matmuls ran 4.5x slower on them).
struct FlushDenormals {
#if defined(__SSE__) || defined(__x86_64__)
  unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

template <typename T>
void delta_rows_impl(const at::Tensor& proj, const std::vector<Seq>& seqs, at::Tensor& conv_pool, at::Tensor& rec_pool,
                     const at::Tensor& conv_w, const float* a_neg, const float* dt_bias, const T* norm_w, int64_t nk,
                     int64_t dk, int64_t dv, bool v_tiled, float eps, T* out) {
  const int64_t C = conv_w.size(0), K = conv_w.size(1), Hv = rec_pool.size(1), V = Hv * dv, key = nk * dk;
  const int64_t stride = proj.stride(0), r = Hv / nk, T_ = proj.size(0), B = static_cast<int64_t>(seqs.size());
  const T* px = proj.data_ptr<T>();
  const T* w = conv_w.data_ptr<T>();
  T* conv = conv_pool.data_ptr<T>();
  float* rec = rec_pool.data_ptr<float>();
  // each row's convolved q, k, v: a buffer kept by the thread (a fresh 50 MB one per call, zeroed and faulted in,
  // took as long as the convolution)
  static thread_local std::vector<float> kept;
  if (kept.size() < static_cast<size_t>(T_ * C)) kept.resize(T_ * C);
  float* const buf = kept.data();  // (the workers see the caller's buffer through this pointer, not their own)
  const int64_t nblk = (C + CONV_BLOCK - 1) / CONV_BLOCK;
  at::parallel_for(0, B * nblk, 1, [&](int64_t t0, int64_t t1) {
    const FlushDenormals ftz;
    std::vector<float> wf(CONV_BLOCK * K), acc(CONV_BLOCK);
    for (int64_t t = t0; t < t1; ++t) {
      const Seq& s = seqs[t / nblk];
      const int64_t c0 = (t % nblk) * CONV_BLOCK, nc = std::min(C, c0 + CONV_BLOCK) - c0, km1 = K - 1;
      T* hist = conv + s.slot * C * km1 + c0 * km1;  // (nc, K-1): the channels' last inputs before this step
      for (int64_t c = 0; c < nc; ++c)
        for (int64_t j = 0; j < K; ++j) wf[j * CONV_BLOCK + c] = static_cast<float>(w[(c0 + c) * K + j]);
      // input p of the sequence's window: rows before the step's first from the slot's history
      auto input = [&](int64_t p, int64_t c) -> float {
        return p >= 0 ? static_cast<float>(px[(s.start + p) * stride + c0 + c])
                      : static_cast<float>(hist[c * km1 + km1 + p]);
      };
      for (int64_t i = 0; i < s.n; ++i) {  // row by row, channels contiguous
        float* a = acc.data();
        const T* xi = px + (s.start + i) * stride + c0;
        const float* wl = wf.data() + km1 * CONV_BLOCK;
#pragma omp simd
        for (int64_t c = 0; c < nc; ++c) a[c] = static_cast<float>(xi[c]) * wl[c];
        for (int64_t j = 0; j < km1; ++j) {
          const int64_t p = i - km1 + j;
          const float* wj = wf.data() + j * CONV_BLOCK;
          if (p >= 0) {
            const T* xp = px + (s.start + p) * stride + c0;
#pragma omp simd
            for (int64_t c = 0; c < nc; ++c) a[c] += static_cast<float>(xp[c]) * wj[c];
          } else {
            for (int64_t c = 0; c < nc; ++c) a[c] += static_cast<float>(hist[c * km1 + km1 + p]) * wj[c];
          }
        }
        dn_silu_row(a, nc);
        float* y = buf + (s.start + i) * C + c0;
        for (int64_t c = 0; c < nc; ++c) y[c] = dn_round<T>(a[c]);
      }
      // the snapshot's history (the last K-1 inputs after save_rows rows), then the slot's (after all rows)
      if (s.save_rows > 0) {
        T* snap = conv + s.save_slot * C * km1 + c0 * km1;
        for (int64_t c = 0; c < nc; ++c)
          for (int64_t j = 0; j < km1; ++j) snap[c * km1 + j] = static_cast<T>(input(s.save_rows - km1 + j, c));
      }
      std::vector<float> last(nc * km1);
      for (int64_t c = 0; c < nc; ++c)
        for (int64_t j = 0; j < km1; ++j) last[c * km1 + j] = input(s.n - km1 + j, c);
      for (int64_t c = 0; c < nc * km1; ++c) hist[c] = static_cast<T>(last[c]);
    }
  });
  at::parallel_for(0, T_, 16, [&](int64_t r0, int64_t r1) {  // q, k heads normalised (rows no sequence has: unused)
    for (int64_t row = r0; row < r1; ++row) {
      for (int64_t h = 0; h < 2 * nk; ++h) {
        float* u = buf + row * C + h * dk;
        float ss = 0.f;
        for (int64_t i = 0; i < dk; ++i) ss += u[i] * u[i];
        const float inv = 1.f / std::sqrt(ss + 1e-6f) * (h < nk ? 1.f / std::sqrt(static_cast<float>(dk)) : 1.f);
        for (int64_t i = 0; i < dk; ++i) u[i] *= inv;
      }
    }
  });
  at::parallel_for(0, B * Hv, 1, [&](int64_t i0, int64_t i1) {
    const FlushDenormals ftz;
    std::vector<float> ob, dec, bet, zs(dv);
    for (int64_t task = i0; task < i1; ++task) {
      const Seq& s = seqs[task / Hv];
      const int64_t h = task % Hv, kh = v_tiled ? h % nk : h / r;
      float* S = rec + (s.slot * Hv + h) * dk * dv;
      ob.resize(s.n * dv);
      dec.resize(s.n);
      bet.resize(s.n);
      for (int64_t i = 0; i < s.n; ++i) {
        const T* x = px + (s.start + i) * stride;
        bet[i] = dn_round<T>(1.f / (1.f + std::exp(-static_cast<float>(x[C + V + h]))));
        dec[i] = std::exp(a_neg[h] * dn_softplus(static_cast<float>(x[C + V + Hv + h]) + dt_bias[h]));
      }
      // column block by column block: the block's Dk x 16 slab of S (8 KiB at Dk 128) stays in L1 across all of
      // the sequence's rows, each row's S^T k, update and S^T q in registers
      for (int64_t jb = 0; jb < dv; jb += DN_COLS) {
        for (int64_t i = 0; i < s.n; ++i) {
          const float* y = buf + (s.start + i) * C;
          const float* q = y + kh * dk;
          const float* k = y + key + kh * dk;
          const float* v = y + 2 * key + h * dv + jb;
          const float decay = dec[i], beta = bet[i];
#if PAGEDLLM_VEC
          constexpr int NV = DN_COLS / W;  // the slab's columns in vectors, held in registers
          vf kvv[NV], ov[NV];
          for (int u = 0; u < NV; ++u) kvv[u] = ov[u] = vzero();
          for (int64_t a = 0; a < dk; ++a) {
            const vf ka = vset1(k[a]);
            const float* srow = S + a * dv + jb;
            for (int u = 0; u < NV; ++u) kvv[u] = vfma(vload(srow + u * W), ka, kvv[u]);
          }
          const vf dvec = vset1(decay), bvec = vset1(beta);
          for (int u = 0; u < NV; ++u) kvv[u] = vmul(vfnma(dvec, kvv[u], vload(v + u * W)), bvec);  // delta
          for (int64_t a = 0; a < dk; ++a) {
            const vf ka = vset1(k[a]), qa = vset1(q[a]);
            float* srow = S + a * dv + jb;
            for (int u = 0; u < NV; ++u) {
              const vf sv = vfma(ka, kvv[u], vmul(vload(srow + u * W), dvec));
              vstore(srow + u * W, sv);
              ov[u] = vfma(sv, qa, ov[u]);
            }
          }
          for (int u = 0; u < NV; ++u) vstore(ob.data() + i * dv + jb + u * W, ov[u]);
#else
          float kv[DN_COLS] = {}, o[DN_COLS] = {};
          for (int64_t a = 0; a < dk; ++a) {
            const float ka = k[a];
            const float* srow = S + a * dv + jb;
#pragma omp simd
            for (int64_t j = 0; j < DN_COLS; ++j) kv[j] += srow[j] * ka;
          }
#pragma omp simd
          for (int64_t j = 0; j < DN_COLS; ++j) kv[j] = (v[j] - decay * kv[j]) * beta;  // delta
          for (int64_t a = 0; a < dk; ++a) {
            const float ka = k[a], qa = q[a];
            float* srow = S + a * dv + jb;
#pragma omp simd
            for (int64_t j = 0; j < DN_COLS; ++j) {
              const float sv = srow[j] * decay + ka * kv[j];
              srow[j] = sv;
              o[j] += sv * qa;
            }
          }
          std::copy(o, o + DN_COLS, ob.data() + i * dv + jb);
#endif
          if (i + 1 == s.save_rows) {
            float* snap = rec + (s.save_slot * Hv + h) * dk * dv;
            for (int64_t a = 0; a < dk; ++a) std::copy(S + a * dv + jb, S + a * dv + jb + DN_COLS, snap + a * dv + jb);
          }
        }
      }
      for (int64_t i = 0; i < s.n; ++i) {  // the gated RMSNorm of each row's output
        float* o = ob.data() + i * dv;
        float ss = 0.f;
        for (int64_t j = 0; j < dv; ++j) {
          o[j] = dn_round<T>(o[j]);  // the rule's output in the model's dtype
          ss += o[j] * o[j];
        }
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(dv) + eps);
        const T* z = px + (s.start + i) * stride + C + h * dv;
        for (int64_t j = 0; j < dv; ++j) zs[j] = static_cast<float>(z[j]);
        dn_silu_row(zs.data(), dv);
        T* dst = out + (s.start + i) * V + h * dv;
        for (int64_t j = 0; j < dv; ++j)
          dst[j] = static_cast<T>(dn_round<T>(static_cast<float>(norm_w[j]) * dn_round<T>(o[j] * inv)) * zs[j]);
      }
    }
  });
}

}  // namespace

at::Tensor gated_delta_rows(const at::Tensor& proj, const at::Tensor& seqs, at::Tensor conv_pool, at::Tensor rec_pool,
                            const at::Tensor& conv_w, const at::Tensor& a_neg, const at::Tensor& dt_bias,
                            const at::Tensor& norm_w, int64_t nk, int64_t dk, int64_t dv, bool v_tiled, double eps) {
  TORCH_CHECK(proj.device().is_cpu() && proj.dim() == 2 && proj.stride(1) == 1, "proj must be CPU (T, W) rows");
  const int64_t Hv = a_neg.numel(), C = conv_w.size(0), K = conv_w.size(1), S = rec_pool.size(0);
  TORCH_CHECK(seqs.scalar_type() == at::kLong && seqs.is_contiguous() && seqs.dim() == 2 && seqs.size(1) == 5,
              "seqs must be contiguous int64 (B, 5): start row, rows, slot, save rows, save slot");
  TORCH_CHECK(K >= 2 && C == 2 * nk * dk + Hv * dv && Hv % nk == 0, "the heads do not match the convolution");
  TORCH_CHECK(dv % DN_COLS == 0, "the value head dimension must be a multiple of ", DN_COLS);
  TORCH_CHECK(proj.size(1) == C + Hv * dv + 2 * Hv, "proj must be [mixed qkv, z, b, a] (", C + Hv * dv + 2 * Hv,
              " columns), got ", proj.size(1));
  TORCH_CHECK(conv_w.is_contiguous() && conv_w.scalar_type() == proj.scalar_type() && norm_w.is_contiguous() &&
                  norm_w.scalar_type() == proj.scalar_type() && norm_w.numel() == dv,
              "the convolution and norm weights must be contiguous, in proj's dtype");
  TORCH_CHECK(conv_pool.is_contiguous() && conv_pool.scalar_type() == proj.scalar_type() && conv_pool.dim() == 3 &&
                  conv_pool.size(0) == S && conv_pool.size(1) == C && conv_pool.size(2) == K - 1,
              "conv_pool must be contiguous (S, C, K-1) in proj's dtype");
  TORCH_CHECK(rec_pool.is_contiguous() && rec_pool.scalar_type() == at::kFloat && rec_pool.dim() == 4 &&
                  rec_pool.size(1) == Hv && rec_pool.size(2) == dk && rec_pool.size(3) == dv,
              "rec_pool must be contiguous float32 (S, Hv, Dk, Dv)");
  TORCH_CHECK(a_neg.scalar_type() == at::kFloat && dt_bias.scalar_type() == at::kFloat && a_neg.is_contiguous() &&
                  dt_bias.is_contiguous() && dt_bias.numel() == Hv, "A and dt_bias must be contiguous float32 (Hv,)");
  const int64_t* sp = seqs.data_ptr<int64_t>();
  std::vector<Seq> list(seqs.size(0));
  std::vector<char> seen(S, 0);
  for (size_t b = 0; b < list.size(); ++b) {
    const Seq s{sp[5 * b], sp[5 * b + 1], sp[5 * b + 2], sp[5 * b + 3], sp[5 * b + 4]};
    TORCH_CHECK(s.start >= 0 && s.n >= 1 && s.start + s.n <= proj.size(0), "a sequence's rows lie outside proj");
    TORCH_CHECK(s.slot >= 0 && s.slot < S && !seen[s.slot], "state slot ", s.slot, " outside the pool or repeated");
    seen[s.slot] = 1;
    TORCH_CHECK(s.save_rows == 0 || (s.save_rows <= s.n && s.save_slot >= 0 && s.save_slot < S &&
                                     s.save_slot != s.slot), "a snapshot needs rows within the sequence and a slot");
    list[b] = s;
  }
  auto out = at::empty({proj.size(0), Hv * dv}, proj.options());
  dispatch_float_bf16(proj.scalar_type(), "gated_delta_rows", [&](auto tag) {
    using T = decltype(tag);
    delta_rows_impl<T>(proj, list, conv_pool, rec_pool, conv_w, a_neg.data_ptr<float>(), dt_bias.data_ptr<float>(),
                       norm_w.data_ptr<T>(), nk, dk, dv, v_tiled, static_cast<float>(eps), out.data_ptr<T>());
  });
  return out;
}

// Mamba-2's recurrence (layers/mamba2.py) for one row per sequence, each state updated in place in the pool at its
// slot, one pass over it: per (sequence, head) and state row p, S[p, :] = exp(dt A) S[p, :] + (dt x[p]) B and
// y[p] = S[p, :] . C + D x[p]. The torch path gathers the states, updates and scatters them, ~5 passes over the
// (heads, head_dim, d_state) float32 state of every sequence (2 MiB at 64 x 64 x 128).
at::Tensor mamba2_step(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& b, const at::Tensor& c,
                       const at::Tensor& a_neg, const at::Tensor& d, at::Tensor pool, const at::Tensor& slots) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&x, &dt, &b, &c, &a_neg, &d, &pool}) {
    check_cpu(*t, "mamba2_step's tensors");
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "mamba2_step takes contiguous float32 tensors");
  }
  TORCH_CHECK(x.dim() == 3 && pool.dim() == 4, "x must be (B, H, P) and the pool (S, H, P, N)");
  const int64_t Bn = x.size(0), H = x.size(1), P = x.size(2), S = pool.size(0), N = pool.size(3);
  TORCH_CHECK(pool.size(1) == H && pool.size(2) == P && dt.numel() == Bn * H && b.numel() == Bn * H * N &&
                  c.numel() == Bn * H * N && a_neg.numel() == H && d.numel() == H,
              "dt (B, H), B and C (B, H, N), A and D (H,) must match x and the pool");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == Bn,
              "slots must be contiguous int64 (B,)");
  const int64_t* sl = slots.data_ptr<int64_t>();
  std::vector<char> seen(S, 0);
  for (int64_t i = 0; i < Bn; ++i) {
    TORCH_CHECK(sl[i] >= 0 && sl[i] < S && !seen[sl[i]], "state slot ", sl[i], " outside the pool or repeated");
    seen[sl[i]] = 1;
  }
  auto out = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *bp = b.data_ptr<float>();
  const float *cp = c.data_ptr<float>(), *ap = a_neg.data_ptr<float>(), *dp = d.data_ptr<float>();
  float* st = pool.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, Bn * H, 1, [&](int64_t i0, int64_t i1) {
    const FlushDenormals ftz;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t bi = i / H, h = i % H;
      const float dtv = dtp[i], decay = std::exp(dtv * ap[h]);
      const float* bb = bp + i * N;
      const float* cc = cp + i * N;
      float* state = st + (sl[bi] * H + h) * P * N;
      for (int64_t p = 0; p < P; ++p) {
        const float xv = xp[i * P + p], xd = xv * dtv;
        float* row = state + p * N;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t n = 0; n < N; ++n) {
          const float v = row[n] * decay + xd * bb[n];
          row[n] = v;
          acc += v * cc[n];
        }
        op[i * P + p] = acc + dp[h] * xv;
      }
    }
  });
  return out;
}

}  // namespace pagedllm
