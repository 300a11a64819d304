// dense_linear: y = x W^T (+ bias) for float32 rows x (M, K) and a float32 weight W (N, K), the float32 path's
// (--dtype float32) linears. torch's F.linear calls MKL, whose one-row products streamed the weights at 10 GB/s on
// a Zen 4 (MKL's slower path on a CPU that is not Intel's) where a plain sum over them streams at 25: a float32
// decode step of SmolLM2 took 48 ms, 97% of it in those products (docs/benchmarks.md).
//
// Each output is its row's dot product with its weight row: lane j of a vector accumulator takes the inputs
// k = j mod W in order, the lanes are summed in one fixed order, then the inputs past the last whole vector, then
// the bias. Nothing in that depends on M or on which tile or thread computed the output, so a row's outputs are
// bitwise the same alone or in a batch of any size (the batched, chunked and speculative paths' rows equal a
// request's rows alone).

#include "common.h"
#include "ops.h"

namespace pagedllm {

namespace {

// A tile: DENSE_MT rows x DENSE_NT outputs, an accumulator each, in the vector registers with the tile's weight
// vectors and one row's (AVX-512: 24 + 4 + 1 of 32; AVX2: 9 + 3 + 1 of 16).
#if PAGEDLLM_VEC == 16
constexpr int DENSE_MT = 6, DENSE_NT = 4;
#elif PAGEDLLM_VEC == 8
constexpr int DENSE_MT = 3, DENSE_NT = 3;
#else
constexpr int DENSE_MT = 4, DENSE_NT = 4;
#endif

#if PAGEDLLM_VEC
// Rows [r, r + MT) x outputs [n, n + NT) of y: x (M, K), w (N, K) row-major, K >= W.
template <int MT, int NT, bool PF = false>
inline void dense_tile(const float* x, const float* w, const float* bias, float* y, int64_t r, int64_t n, int64_t K,
                       int64_t N) {
  vf acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = vzero();
  const int64_t kv = K / W * W;
  for (int64_t k = 0; k < kv; k += W) {
    vf wv[NT];
    for (int j = 0; j < NT; ++j) {
      wv[j] = vload(w + (n + j) * K + k);
#if defined(__x86_64__)  // the next tile's weight rows, a line at a time (25.9 GB/s at one row, 15.6 without)
      if (PF && k % 16 == 0 && n + j + NT < N)
        _mm_prefetch(reinterpret_cast<const char*>(w + (n + j + NT) * K + k), _MM_HINT_T0);
#endif
    }
    for (int i = 0; i < MT; ++i) {
      const vf xv = vload(x + (r + i) * K + k);
      for (int j = 0; j < NT; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) {
      const float* xr = x + (r + i) * K;
      const float* wr = w + (n + j) * K;
      float s = vsum(acc[i][j]);
      for (int64_t k = kv; k < K; ++k) s += xr[k] * wr[k];
      y[(r + i) * N + n + j] = bias != nullptr ? s + bias[n + j] : s;
    }
}

// The last `left` (< MT) rows from r.
template <int MT, int NT>
inline void dense_rest(const float* x, const float* w, const float* bias, float* y, int64_t r, int64_t left,
                       int64_t n, int64_t K, int64_t N) {
  if constexpr (MT > 1) {
    if (left == MT - 1) return dense_tile<MT - 1, NT, true>(x, w, bias, y, r, n, K, N);
    dense_rest<MT - 1, NT>(x, w, bias, y, r, left, n, K, N);
  }
}
#endif

// Outputs [n, n + NT) of every row, in tiles of DENSE_MT rows (the weight rows stay in L1 while the rows pass).
template <int NT>
void dense_outputs(const float* x, const float* w, const float* bias, float* y, int64_t n, int64_t M, int64_t K,
                   int64_t N) {
#if PAGEDLLM_VEC
  if (K >= W) {
    int64_t r = 0;
    if (M >= DENSE_MT) {  // the first tile of rows prefetches the next tile's weight rows
      dense_tile<DENSE_MT, NT, true>(x, w, bias, y, r, n, K, N);
      r += DENSE_MT;
    }
    for (; r + DENSE_MT <= M; r += DENSE_MT) dense_tile<DENSE_MT, NT>(x, w, bias, y, r, n, K, N);
    return dense_rest<DENSE_MT, NT>(x, w, bias, y, r, M - r, n, K, N);
  }
#endif
  for (int64_t r = 0; r < M; ++r)  // no vectors (or K below one): one sum per output, the same for every M
    for (int j = 0; j < NT; ++j) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[r * K + k] * w[(n + j) * K + k];
      y[r * N + n + j] = bias != nullptr ? s + bias[n + j] : s;
    }
}

}  // namespace

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  check_cpu(x, "x");
  check_cpu(w, "w");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "dense_linear: float32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.is_contiguous() && w.is_contiguous() && x.size(1) == w.size(1),
              "dense_linear: x (M, K) and w (N, K), both contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K > 0, "dense_linear: in_features must be >= 1");
  const float* bp = nullptr;
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "dense_linear: bias must be contiguous float32 (N)");
    bp = bias->data_ptr<float>();
  }
  auto y = at::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // A claim: a run of outputs of one chunk of rows. A chunk's rows (about 256 KiB of them) stay in L2 while the
  // weights pass; all rows at once were streamed again from L3 for each tile of outputs, 19% slower than MKL on a
  // 1000-row prefill (Zen 4). Chunk by chunk, both threads on one chunk, 16 claims per thread and chunk (they
  // balance a thread that the HTTP or client thread held up).
  const int64_t chunk = std::max<int64_t>(DENSE_MT, (256 * 1024 / (4 * K)) / DENSE_MT * DENSE_MT);
  const int64_t runs = (N + DENSE_NT - 1) / DENSE_NT, chunks = (M + chunk - 1) / chunk;
  const int64_t per = std::max<int64_t>(1, runs / (16 * at::get_num_threads()));
  parallel_claims(chunks * runs, per, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r0 = i / runs * chunk, rows = std::min(M, r0 + chunk) - r0, n = i % runs * DENSE_NT;
      const float* xc = xp + r0 * K;
      float* yc = yp + r0 * N;
      const int64_t nt = std::min<int64_t>(DENSE_NT, N - n);
      if (nt == DENSE_NT) dense_outputs<DENSE_NT>(xc, wp, bp, yc, n, rows, K, N);
      else if (nt == 3) dense_outputs<3>(xc, wp, bp, yc, n, rows, K, N);
      else if (nt == 2) dense_outputs<2>(xc, wp, bp, yc, n, rows, K, N);
      else dense_outputs<1>(xc, wp, bp, yc, n, rows, K, N);
    }
  });
  return y;
}

}  // namespace pagedllm
