// int8 weight tiles for large steps on AMX: a layer's weights requantized once to signed 8-bit values with one
// float32 scale per row and block of KB inputs (128, or 64 where the inputs are not a multiple of 128), in the
// layout tdpbssd reads, beside the layer's packed blocks. A step's activations are quantized the same way (int8,
// a scale per row and block of KB), so the tile unit sums whole blocks of KB inputs exactly in int32 and the vector
// unit does one float step per block of KB per row and output: a quarter of the float work of qlinear's per-32
// blocks, and no decoding (1 byte a weight streamed instead of ~0.6, which only small steps notice). The
// requantization adds an error well under the 4-bit blocks' own; the numerics are a path of their own, chosen by the
// runtime plan (worker/plan.py) like the bf16 stripes.
//
// Layout: tiles (ceil(N/32), K/64, 2, 16, 64) int8: for 32 output rows (two B tiles of 16) and 64 inputs, tile t's
// row p holds, for each of its 16 outputs, inputs 4p .. 4p+3 (VNNI order); scales (ceil(N/32) * 32, K/KB) float32.
// Rows past N are zero. Without AMX (or without the OS's leave) qlinear_i8 runs portable loops with the same
// arithmetic: the same int32 sums, the same float steps in the same order, so the same results bit for bit.
#include "qlinear.h"
#include "ops.h"

namespace pagedllm {

namespace {
// inputs per scale: 128 (64 where K is not a multiple of 128). Per 128 the 1.5B's KL to its float32 numbers is
// below llama.cpp's (docs/benchmarks.md); per 256 (llama.cpp's Q8_K rows) it was not, per 64 the float steps cost
// most of the tiles' gain on large steps
int64_t i8_block(int64_t K) { return K % 128 == 0 ? 128 : 64; }

// f(const float*) or f(const at::BFloat16*) on t's data
template <typename F>
void i8_with_dtype(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kFloat)
    f(t.data_ptr<float>());
  else
    f(t.data_ptr<at::BFloat16>());
}

#if defined(__AVX512F__)
inline __m512 i8_load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 i8_load16(const at::BFloat16* p) {  // bfloat16 -> float32: the 16 bits shifted to the top (exact)
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif


// One row of K values quantized per block of KB: q (K int8), s (K/KB scales): s = amax / 127, q = round(v * 127 / amax)
// to nearest even (the vector path's conversion), so |q| <= 127.
template <typename T>
void i8_quantize_row(const T* x, int64_t K, int64_t KB, int8_t* q, float* s) {
  alignas(64) float v[128];  // KB <= 128
  for (int64_t b = 0; b < K / KB; ++b) {
    const T* xb = x + b * KB;
#if defined(__AVX512F__)
    __m512 mx = _mm512_setzero_ps();
    for (int64_t i = 0; i < KB; i += 16) {
      const __m512 f = i8_load16(xb + i);
      _mm512_store_ps(v + i, f);
      mx = _mm512_max_ps(mx, _mm512_abs_ps(f));
    }
    const float amax = _mm512_reduce_max_ps(mx);
#else
    float amax = 0.f;
    for (int64_t i = 0; i < KB; ++i) {
      v[i] = static_cast<float>(xb[i]);
      amax = std::max(amax, std::fabs(v[i]));
    }
#endif
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    s[b] = amax / 127.f;
#if defined(__AVX512F__)
    const __m512 iv = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < KB; i += 16)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * KB + i),
                       _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(v + i), iv))));
#else
    for (int64_t i = 0; i < KB; ++i) q[b * KB + i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
#endif
  }
}

// one float step: acc += float(sum) * (ws * xs), the product fused (the vector path's fmadd)
inline float i8_step(float acc, int32_t sum, float ws, float xs) { return std::fma(static_cast<float>(sum), ws * xs, acc); }

template <typename T>
void i8_store(const float* acc, T* y, int64_t n) {
  store_row(acc, y, n);
}

// Portable: for every row and output, the blocks' int32 sums and their float steps in block order.
template <typename T>
void i8_portable(const int8_t* q, const float* s, int64_t M, int64_t K, int64_t KB, const int8_t* w, const float* ws,
                 int64_t N, T* y) {
  const int64_t nb = K / KB, kt = K / 64;
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
    std::vector<float> acc(M);
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t ch = n / 32, t = (n % 32) / 16, col = n % 16;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t r = 0; r < M; ++r) {
          int32_t sum = 0;
          for (int64_t k = b * KB; k < (b + 1) * KB; ++k) {
            const int64_t tile = (ch * kt + k / 64) * 2 + t;
            sum += static_cast<int32_t>(q[r * K + k]) * w[tile * 1024 + ((k % 64) / 4) * 64 + col * 4 + k % 4];
          }
          acc[r] = i8_step(acc[r], sum, ws[n * nb + b], s[r * nb + b]);
        }
      for (int64_t r = 0; r < M; ++r) i8_store(&acc[r], y + r * N + n, 1);
    }
  });
}

#if defined(PAGEDLLM_QAMX)
// Threads take (row block, 32 outputs) items, row blocks outermost (a static split: each thread streams its own run
// of weights). Per row tile of 16 and block of KB inputs the tile unit sums into one of two sets of C tiles (C4, C5
// or C6, C7: the two weight tiles) while the vector unit turns the previous block's sums into float ones, so the
// products and the float steps overlap. The first row tile of an item prefetches the weights two blocks ahead.
constexpr int64_t I8_ROW_BLOCK = 256;

// block b's products of row tile A (rows at a, stride K) into C tiles C0, C1; weights w (2 KiB per 64 inputs)
#define PAGEDLLM_I8_ISSUE(A, C0, C1, b)                                                      \
  do {                                                                                       \
    _tile_zero(C0);                                                                          \
    _tile_zero(C1);                                                                          \
    for (int64_t k = (b) * kb64; k < ((b) + 1) * kb64; ++k) {                                \
      if (prefetch && k + 2 * kb64 < kt)                                                     \
        for (int l = 0; l < 2048; l += 64) _mm_prefetch(reinterpret_cast<const char*>(wc + (k + 2 * kb64) * 2048 + l), _MM_HINT_T0); \
      _tile_loadd(2, wc + k * 2048, 64);                                                     \
      _tile_loadd(3, wc + k * 2048 + 1024, 64);                                              \
      _tile_loadd(A, a + k * 64, K);                                                         \
      _tile_dpbssd(C0, A, 2);                                                                \
      _tile_dpbssd(C1, A, 3);                                                                \
    }                                                                                        \
  } while (0)

template <typename T>
void i8_amx(const int8_t* q, const float* s, int64_t M, int64_t K, int64_t KB, const int8_t* w, const float* ws,
            int64_t N, T* y) {
  const int64_t nb = K / KB, kt = K / 64, kb64 = KB / 64, Mp = (M + 15) / 16 * 16, chunks = (N + 31) / 32;
  const int64_t rblocks = (Mp + I8_ROW_BLOCK - 1) / I8_ROW_BLOCK;
  at::parallel_for(0, rblocks * chunks, 1, [&](int64_t i0, int64_t i1) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.rows[t] = 16;
      cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
    alignas(64) int32_t c[2][2][16][16];  // the sums of a block: set x weight tile
    alignas(64) float acc[16][32];
    const __m512i rows_nb = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32(static_cast<int>(nb)));
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t ch = it % chunks, ra = (it / chunks) * I8_ROW_BLOCK, re = std::min(Mp, ra + I8_ROW_BLOCK);
      const int8_t* wc = w + ch * kt * 2048;
      const float* wsc = ws + ch * 32 * nb;
      for (int64_t r0 = ra; r0 < re; r0 += 16) {
        const bool prefetch = r0 == ra;
        const int8_t* a = q + r0 * K;
        for (int r = 0; r < 16; ++r) {
          _mm512_store_ps(acc[r], _mm512_setzero_ps());
          _mm512_store_ps(acc[r] + 16, _mm512_setzero_ps());
        }
        // the float steps of block b from the sums of set `set`
        auto steps = [&](int64_t b, int set) {
          const __m512 w0 = _mm512_i32gather_ps(rows_nb, wsc + b, 4);
          const __m512 w1 = _mm512_i32gather_ps(rows_nb, wsc + 16 * nb + b, 4);
          for (int r = 0; r < 16; ++r) {
            const __m512 sx = _mm512_set1_ps(s[(r0 + r) * nb + b]);
            _mm512_store_ps(acc[r], _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[set][0][r])),
                                                    _mm512_mul_ps(w0, sx), _mm512_load_ps(acc[r])));
            _mm512_store_ps(acc[r] + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[set][1][r])),
                                                         _mm512_mul_ps(w1, sx), _mm512_load_ps(acc[r] + 16)));
          }
        };
        PAGEDLLM_I8_ISSUE(0, 4, 5, 0);
        _tile_stored(4, c[0][0], 64);
        _tile_stored(5, c[0][1], 64);
        for (int64_t b = 0; b < nb; ++b) {
          const int set = b & 1;
          const bool next = b + 1 < nb;
          if (next) {  // block b + 1's products, issued before block b's float steps
            if (set == 0) PAGEDLLM_I8_ISSUE(1, 6, 7, b + 1);
            else PAGEDLLM_I8_ISSUE(0, 4, 5, b + 1);
          }
          steps(b, set);
          if (next) {
            if (set == 0) {
              _tile_stored(6, c[1][0], 64);
              _tile_stored(7, c[1][1], 64);
            } else {
              _tile_stored(4, c[0][0], 64);
              _tile_stored(5, c[0][1], 64);
            }
          }
        }
        const int64_t cols = std::min<int64_t>(32, N - 32 * ch);
        for (int r = 0; r < 16 && r0 + r < M; ++r) i8_store(acc[r], y + (r0 + r) * N + 32 * ch, cols);
      }
    }
    _tile_release();
  });
}
#undef PAGEDLLM_I8_ISSUE
#endif
}  // namespace

bool i8_tiles_enabled() {
#if defined(PAGEDLLM_QAMX)
  return amx_enabled();
#else
  return false;
#endif
}

std::vector<at::Tensor> qweight_i8(const at::Tensor& wf) {
  check_cpu(wf, "w");
  TORCH_CHECK(wf.dim() == 2 && wf.is_contiguous() && (wf.scalar_type() == at::kFloat || wf.scalar_type() == at::kBFloat16),
              "qweight_i8: w must be contiguous float32 or bfloat16 (N, K)");
  const int64_t N = wf.size(0), K = wf.size(1);
  TORCH_CHECK(K % 64 == 0, "qweight_i8: in_features ", K, " is not a multiple of 64");
  const int64_t KB = i8_block(K), nb = K / KB, kt = K / 64, chunks = (N + 31) / 32;
  auto tiles = at::empty({chunks, kt, 2, 16, 64}, wf.options().dtype(at::kChar));
  auto scales = at::empty({chunks * 32, nb}, wf.options().dtype(at::kFloat));
  int8_t* tp = tiles.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  std::memset(tp, 0, tiles.numel());  // rows past N: zero weights and scales
  std::memset(sp, 0, scales.numel() * sizeof(float));
  i8_with_dtype(wf, [&](const auto* x) {
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      std::vector<int8_t> row(K);
      for (int64_t n = n0; n < n1; ++n) {
        i8_quantize_row(x + n * K, K, KB, row.data(), sp + n * nb);
        const int64_t ch = n / 32, t = (n % 32) / 16, col = n % 16;
        for (int64_t k = 0; k < K; ++k)
          tp[((ch * kt + k / 64) * 2 + t) * 1024 + ((k % 64) / 4) * 64 + col * 4 + k % 4] = row[k];
      }
    });
  });
  return std::vector<at::Tensor>{tiles, scales};
}

at::Tensor qlinear_i8(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales, int64_t N) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "qlinear_i8: x must be contiguous float32 or bfloat16 (M, K)");
  const int64_t M = x.size(0), K = x.size(1), KB = i8_block(K), nb = K / KB, chunks = (N + 31) / 32;
  TORCH_CHECK(K % 64 == 0 && tiles.scalar_type() == at::kChar && tiles.is_contiguous() &&
                  tiles.sizes() == at::IntArrayRef({chunks, K / 64, 2, 16, 64}) && scales.scalar_type() == at::kFloat &&
                  scales.is_contiguous() && scales.sizes() == at::IntArrayRef({chunks * 32, nb}),
              "qlinear_i8: tiles / scales do not match x's inputs ", K, " and N ", N, " (qweight_i8's layout)");
  const int64_t Mp = (M + 15) / 16 * 16;
  std::vector<int8_t> q(Mp * K, 0);  // rows past M stay zero (whole A tiles)
  std::vector<float> s(Mp * nb, 0.f);
  auto y = at::empty({M, N}, x.options());
  i8_with_dtype(x, [&](const auto* xp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
    at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) i8_quantize_row(xp + r * K, K, KB, q.data() + r * K, s.data() + r * nb);
    });
    T* yp = y.data_ptr<T>();
#if defined(PAGEDLLM_QAMX)
    if (i8_tiles_enabled()) {
      i8_amx(q.data(), s.data(), M, K, KB, tiles.data_ptr<int8_t>(), scales.data_ptr<float>(), N, yp);
      return;
    }
#endif
    i8_portable(q.data(), s.data(), M, K, KB, tiles.data_ptr<int8_t>(), scales.data_ptr<float>(), N, yp);
  });
  return y;
}

}  // namespace pagedllm
