// qlinear's tiles on AMX (Sapphire Rapids and later Xeons): the integer sums of a block come from the tile unit
// (tdpbsud: signed activations x unsigned 4-bit codes; tdpbssd: x signed 8-bit codes), 16 activation rows by 16
// weight rows per instruction, instead of one vpdpbusd per 4 inputs. They are the exact integers the VNNI tiles
// sum (a signed 8-bit code needs no +128 shift here), and the float steps per block are qtile512's, in the same
// order (block_step512): the results are bitwise those of the AVX-512 tiles, for any batch (so a row's result does not depend on
// whether its batch ran here).
//
// Per block of 32 inputs (16 with SUB 2): the B tiles hold 4 groups of 8 weight rows (two tiles of 16 columns;
// the interleaved layout's unit i of a group is already the tile's row i for its 8 columns, the 4-bit nibbles
// split apart), loaded once and used by each 16-row tile of the row chunk; per row tile two A tiles (coarse and
// fine activation levels) make four C tiles, whose int32 sums the vector unit scales into the float sums. With
// the tile unit doing the products, that epilogue (convert, multiply-add with d * s and m * ss) is the work left.
#pragma once

#if defined(PAGEDLLM_QZMM) && !defined(PAGEDLLM_QWIDE) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && \
    defined(__linux__)
#define PAGEDLLM_QAMX 1
#include <sys/syscall.h>
#include <unistd.h>

namespace pagedllm {
bool amx_enabled();  // qlinear.cpp: the OS granted the tile state and set_qlinear_amx has not turned AMX off
}

namespace {

constexpr int AMX_ROWS = 16;  // rows of an A (activation) and C tile
// Rows from which qlinear runs on AMX (fewer than 16: one tile of that many rows). Against the VNNI tiles (2 cores,
// Q4_0 / Q4_K / Q5_0 / Q6_K / Q8_0 weights of 2048-8960 inputs): 0.7-0.9x at 4 rows, 0.96-1.23x at 8, 1.0-1.5x at
// 12, 1.2-1.7x from 16. From 6 rather than 8 since the VNNI tiles take rows 3 at a time and a lone remainder row
// re-decodes the codes: whole decode steps at 6 / 7 rows (8 as the reference) 0.95-1.0 / 1.03-1.17 of the 8-row
// step on the VNNI tiles, 0.93 / 0.95-0.98 on AMX (Qwen2.5-Coder 0.5B and 1.5B Q4_K_M, SmolLM2 Q4_1); 5 rows (3 + 2)
// even.
constexpr int64_t AMX_MIN_ROWS = 6;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles: 0, 1 activations (coarse, fine levels); 2, 3 weights (groups 0-1, 2-3); 4-7 sums (level x weight tile)
template <int SUB>
inline void amx_configure(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = t == 2 || t == 3 ? 8 / SUB : rows;  // B: one row per 4 inputs
    cfg.colsb[t] = t < 2 ? QB / SUB : 64;
  }
  _tile_loadconfig(&cfg);
}

// One activation level's products: A tile A (rows of x at `x`, stride K) against both weight tiles (2, 3) into C
// tiles C0 and C1 (PAGEDLLM_AMX_STORE: to c[0] and c[1]). Macros: the tile intrinsics take their tile numbers as
// literal tokens (GCC pastes them into the instruction), so neither a function argument nor a template argument
// can carry them. BITS: the enclosing template's.
#define PAGEDLLM_AMX_ISSUE(A, C0, C1, x, K) \
  do {                                      \
    _tile_loadd(A, x, K);                   \
    _tile_zero(C0);                         \
    _tile_zero(C1);                         \
    if constexpr (BITS == 4) {              \
      _tile_dpbsud(C0, A, 2);               \
      _tile_dpbsud(C1, A, 3);               \
    } else {                                \
      _tile_dpbssd(C0, A, 2);               \
      _tile_dpbssd(C1, A, 3);               \
    }                                       \
  } while (0)
#define PAGEDLLM_AMX_STORE(C0, C1, c) \
  do {                                \
    _tile_stored(C0, (c)[0], 64);     \
    _tile_stored(C1, (c)[1], 64);     \
  } while (0)

// Groups [g0, g1) (at most 4) against rows [r0, r1) (r1 - r0 <= ROW_CHUNK), stored to y. xa's q and q2 hold whole
// 16-row tiles (quantize_rows pads them with zero rows). A slot past g1 repeats the last group; its outputs are
// not stored.
template <int BITS, int ROWS, typename SC>
void qrun_amx(const uint8_t* w, const SC& sc, int64_t g0, int64_t g1, int64_t gstride, const QuantizedRows& xa,
              int64_t r0, int64_t r1, int64_t K, int64_t nb, int64_t N, const Rows& y) {
  constexpr int64_t gbytes = BITS * 32;
  constexpr int SUB = SC::sub;
  amx_configure<SUB>(static_cast<int>(std::min<int64_t>(AMX_ROWS, r1 - r0)));  // fewer rows: shorter tiles
  alignas(64) uint8_t bt[2][8][64];   // weight tiles of this block: row i = unit i of 2 groups
  alignas(64) int32_t c[2][2][16][16];  // sums: (coarse, fine; or two sets of the coarse) x weight tile 0, 1
  alignas(64) float acc[ROWS][32];    // float sums of 4 groups
  for (int64_t r = 0; r < r1 - r0; ++r)
    for (int j = 0; j < 32; j += 16) _mm512_store_ps(&acc[r][j], _mm512_setzero_ps());
  int64_t gs[4];
  for (int j = 0; j < 4; ++j) gs[j] = std::min(g0 + j, g1 - 1);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const bool tab = sc.table != nullptr;
  const __m512i tbl = table512(sc.table);
  const bool two = xa.levels == 2;  // 1: q2 is zero, its tiles are skipped
  for (int64_t b = 0; b < nb; ++b) {
    for (int t = 0; t < 2; ++t) {
      const uint8_t* wa = w + gs[2 * t] * gstride + b * gbytes;
      const uint8_t* wb = w + gs[2 * t + 1] * gstride + b * gbytes;
      if constexpr (BITS == 4) {
        for (int i = 0; i < 4; ++i) {  // vector i: unit i low nibbles, unit 4 + i high
          const __m512i v = load_pair(wa + 32 * i, wb + 32 * i);
          __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          if (tab) {
            lo = _mm512_shuffle_epi8(tbl, lo);
            hi = _mm512_shuffle_epi8(tbl, hi);
          }
          _mm512_store_si512(bt[t][i], lo);
          _mm512_store_si512(bt[t][4 + i], hi);
        }
      } else {
        for (int i = 0; i < 8; ++i) _mm512_store_si512(bt[t][i], unit_pair_signed<BITS>(wa, wb, i));
      }
    }
    for (int h = 0; h < SUB; ++h) {
      _tile_loadd(2, bt[0][4 * h], 64);  // SUB 2: units 4h .. 4h+3 (inputs 16h .. 16h+15)
      _tile_loadd(3, bt[1][4 * h], 64);
      __m512 dv[2], mv[2];
      for (int t = 0; t < 2; ++t) {
        dv[t] = load_pair(sc.dp(gs[2 * t], b, h), sc.dp(gs[2 * t + 1], b, h));
        mv[t] = SC::offsets ? load_pair(sc.mp(gs[2 * t], b, h), sc.mp(gs[2 * t + 1], b, h)) : _mm512_setzero_ps();
      }
      // the float steps of row tile rt from its sums (cc: coarse level per weight tile; cf: fine level)
      auto scale = [&](int64_t rt, int32_t (*cc)[16][16], int32_t (*cf)[16][16]) {
        const int64_t nr = std::min<int64_t>(AMX_ROWS, r1 - rt);
        for (int64_t i = 0; i < nr; ++i) {
          const int64_t row = (rt + i) * nb + b;
          const float sx = xa.s[row], ss = act_ss<SUB>(xa, row, h);
          float* a = acc[rt - r0 + i];
          for (int t = 0; t < 2; ++t) {
            const __m512i hi = _mm512_load_si512(cc[t][i]);
            // 254 hi + lo (exact: |254 hi + lo| < 2^31), as qtile512's mullo; one level: hi alone
            const __m512i s = two ? _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(hi, 8), _mm512_slli_epi32(hi, 1)),
                                                     _mm512_load_si512(cf[t][i]))
                                  : hi;
            _mm512_store_ps(a + 16 * t,
                            block_step512<SC::offsets>(_mm512_load_ps(a + 16 * t), s, dv[t], mv[t], sx, ss));
          }
        }
      };
      auto off = [&](int64_t rt) { return rt * K + b * QB + 16 * h; };
      if (two) {
        for (int64_t rt = r0; rt < r1; rt += AMX_ROWS) {
          PAGEDLLM_AMX_ISSUE(0, 4, 6, xa.q.data() + off(rt), K);
          PAGEDLLM_AMX_ISSUE(1, 5, 7, xa.q2.data() + off(rt), K);
          PAGEDLLM_AMX_STORE(4, 6, c[0]);
          PAGEDLLM_AMX_STORE(5, 7, c[1]);
          scale(rt, c[0], c[1]);
        }
      } else {  // one level: two sets of tiles (A 0 -> C 4, 6; A 1 -> C 5, 7), the next row tile's products issued
                // before this one's float steps
        PAGEDLLM_AMX_ISSUE(0, 4, 6, xa.q.data() + off(r0), K);
        PAGEDLLM_AMX_STORE(4, 6, c[0]);
        int set = 0;
        for (int64_t rt = r0; rt < r1; rt += AMX_ROWS, set ^= 1) {
          const bool next = rt + AMX_ROWS < r1;
          if (next) {
            if (set == 0) PAGEDLLM_AMX_ISSUE(1, 5, 7, xa.q.data() + off(rt + AMX_ROWS), K);
            else PAGEDLLM_AMX_ISSUE(0, 4, 6, xa.q.data() + off(rt + AMX_ROWS), K);
          }
          scale(rt, c[set], c[set]);
          if (next) {
            if (set == 0) PAGEDLLM_AMX_STORE(5, 7, c[1]);
            else PAGEDLLM_AMX_STORE(4, 6, c[0]);
          }
        }
      }
    }
  }
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t g = g0; g < g1; ++g) store_group(y, r, N, 8 * g, acc[r - r0] + 8 * (g - g0));
}

#if defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define PAGEDLLM_QAMX_BF16 1
// ------------------------------------------------------------------ bfloat16 tiles (levels 0)
// Mid-size steps (decode batches, short prefills): the weights decoded to bfloat16 straight into the B tiles, the
// activations rounded to bfloat16, and tdpbf16ps summing in float32 over all of K inside the C tiles. The int8
// tiles above pay a float step per block of 32 for every row (the block's scale times its integer sums); here the
// scales are applied once per weight while it is decoded, a cost shared by every row of the step, so from a few
// dozen rows this path does more of its work in the tile unit. The values are qweight_bf16's (per block d*u + m
// in float32, the product then the offset, rounded to nearest even): the numerics of the bfloat16 stripes
// (--large-step-weights bf16: bfloat16 weights and activations, float32 sums), summed in another order.
//
// B tile layout (tdpbf16ps): row p holds, for each of its 16 weight rows, the bfloat16 pair of inputs 2p, 2p + 1.
// A unit i of the interleaved layout (inputs 4i..4i+3 of 8 rows, qlinear.h) gives B rows 2i and 2i + 1.
inline void amx_configure_bf16() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {  // 0, 1: A (16 rows x 32 inputs); 2, 3: B (16 pairs x 16 weight rows); 4-7: C
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Block b of the chunk's 4 groups gs (32 weight rows), decoded into its two B tiles bt[0], bt[1] (16 x 32 bfloat16).
template <int BITS, typename SC>
inline void decode_block_bf16(const uint8_t* w, const SC& sc, const int64_t (&gs)[4], int64_t gstride, int64_t b,
                              uint16_t (*bt)[16][32]) {
  constexpr int64_t gbytes = BITS * 32;
  constexpr int SUB = SC::sub;
  // byte o of a reordered unit: quarter o / 16 (rows 0-7 / 8-15 of inputs 0, 1, then of inputs 2, 3), row pair
  // (o % 16) / 2, input o % 2: source byte 4 * row + k
  alignas(64) static const uint8_t order_bytes[64] = {
      0,  1,  4,  5,  8,  9,  12, 13, 16, 17, 20, 21, 24, 25, 28, 29,   // rows 0-7, inputs 0, 1
      32, 33, 36, 37, 40, 41, 44, 45, 48, 49, 52, 53, 56, 57, 60, 61,   // rows 8-15
      2,  3,  6,  7,  10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31,   // rows 0-7, inputs 2, 3
      34, 35, 38, 39, 42, 43, 46, 47, 50, 51, 54, 55, 58, 59, 62, 63};  // rows 8-15
  const __m512i order = _mm512_load_si512(order_bytes);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const bool tab = sc.table != nullptr;
  const __m512i tbl = table512(sc.table);
  for (int t = 0; t < 2; ++t) {
    // d and m of the tile's 16 weight rows, each row's value in 2 lanes: rows 0-7 (dq[h][0]), rows 8-15 (dq[h][1])
    __m512 dq[SUB][2], mq[SUB][2];
    for (int h = 0; h < SUB; ++h) {
      const __m512 dv = load_pair(sc.dp(gs[2 * t], b, h), sc.dp(gs[2 * t + 1], b, h));
      const __m512 mv = SC::offsets ? load_pair(sc.mp(gs[2 * t], b, h), sc.mp(gs[2 * t + 1], b, h))
                                    : _mm512_setzero_ps();
      for (int q = 0; q < 2; ++q) {
        const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(8 * q),
                                             _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
        dq[h][q] = _mm512_permutexvar_ps(idx, dv);
        mq[h][q] = _mm512_permutexvar_ps(idx, mv);
      }
    }
    // one unit: 64 codes, byte 4 * row + k (k < 4), reordered so that each 16 bytes are one B row's half: rows 0-7
    // then 8-15 of inputs k 0, 1 (B row 2u), then of k 2, 3 (row 2u + 1); each 16 widen to floats (from memory: no
    // lane extracts), times d plus m, and two halves round to one B row of bfloat16 pairs
    alignas(64) uint8_t cb[64];
    auto unit = [&](__m512i codes, int u, int h) {
      _mm512_store_si512(cb, _mm512_permutexvar_epi8(order, codes));
      __m512 v[4];
      for (int q = 0; q < 4; ++q) {
        const __m128i part = _mm_load_si128(reinterpret_cast<const __m128i*>(cb + 16 * q));
        const __m512i c = BITS != 4 ? _mm512_cvtepi8_epi32(part) : _mm512_cvtepu8_epi32(part);
        v[q] = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(c), dq[h][q & 1]), mq[h][q & 1]);
      }
      _mm512_store_si512(bt[t][2 * u], (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]));
      _mm512_store_si512(bt[t][2 * u + 1], (__m512i)_mm512_cvtne2ps_pbh(v[3], v[2]));
    };
    const uint8_t* wa = w + gs[2 * t] * gstride + b * gbytes;
    const uint8_t* wb = w + gs[2 * t + 1] * gstride + b * gbytes;
    if constexpr (BITS == 4) {
      for (int i = 0; i < 4; ++i) {  // low nibbles: unit i; high: unit 4 + i
        const __m512i v = load_pair(wa + 32 * i, wb + 32 * i);
        __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        if (tab) {
          lo = _mm512_shuffle_epi8(tbl, lo);
          hi = _mm512_shuffle_epi8(tbl, hi);
        }
        unit(lo, i, 0);
        unit(hi, 4 + i, SUB - 1);
      }
    } else {
      for (int i = 0; i < 8; ++i) unit(unit_pair_signed<BITS>(wa, wb, i), i, SUB == 2 && i >= 4);
    }
  }
}

// y (M, N) = x W^T on bfloat16 tiles. Threads claim chunks of 32 weight rows; a chunk's blocks are decoded once
// (2 KiB each, held per thread) and then every 32 rows of the step run against them, the C tiles summing all of K.
template <int BITS, typename T, typename SC>
void qlinear_bf16_tiles(const T* x, int64_t M, int64_t K, const uint8_t* w, const SC& sc, int64_t N, T* y) {
  const int64_t nb = K / QB, NG = (N + 7) / 8, gstride = nb * BITS * 32, Mp = (M + 15) / 16 * 16;
  std::vector<at::BFloat16> xb(Mp * K);  // zero-initialised: rows past M stay zero (whole A tiles)
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if constexpr (std::is_same_v<T, at::BFloat16>)
        std::memcpy(xb.data() + r * K, x + r * K, K * sizeof(T));
      else
        store_row(x + r * K, xb.data() + r * K, K);  // rounded to nearest even
    }
  });
  const int64_t chunks = (NG + 3) / 4, astride = K * static_cast<int64_t>(sizeof(at::BFloat16));
  parallel_claims(chunks, 1, [&](int64_t c0, int64_t c1) {
    amx_configure_bf16();
    thread_local std::vector<uint16_t> buf;  // the chunk's B tiles: (nb, 2, 16, 32), kept between calls
    buf.resize(nb * 2 * 16 * 32 + 32);
    auto* bt = reinterpret_cast<uint16_t(*)[2][16][32]>((reinterpret_cast<uintptr_t>(buf.data()) + 63) &
                                                         ~uintptr_t(63));
    alignas(64) float c[4][16][16];
    for (int64_t ch = c0; ch < c1; ++ch) {
      int64_t gs[4];
      for (int j = 0; j < 4; ++j) gs[j] = std::min(4 * ch + j, NG - 1);
      for (int64_t b = 0; b < nb; ++b) decode_block_bf16<BITS>(w, sc, gs, gstride, b, bt[b]);
      const int64_t n0 = 32 * ch;
      for (int64_t rt = 0; rt < Mp; rt += 32) {
        const bool two = rt + 16 < Mp;
        const char* a0 = reinterpret_cast<const char*>(xb.data() + rt * K);
        const char* a1 = a0 + 16 * astride;
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t b = 0; b < nb; ++b) {
          _tile_loadd(2, bt[b][0], 64);
          _tile_loadd(3, bt[b][1], 64);
          _tile_loadd(0, a0 + b * QB * 2, astride);
          _tile_dpbf16ps(4, 0, 2);
          _tile_dpbf16ps(5, 0, 3);
          if (two) {
            _tile_loadd(1, a1 + b * QB * 2, astride);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
          }
        }
        _tile_stored(4, c[0], 64);
        _tile_stored(5, c[1], 64);
        _tile_stored(6, c[2], 64);
        _tile_stored(7, c[3], 64);
        for (int half = 0; half < (two ? 2 : 1); ++half)
          for (int i = 0; i < 16 && rt + 16 * half + i < M; ++i) {
            T* yr = y + (rt + 16 * half + i) * N;
            for (int t = 0; t < 2; ++t) {
              const int64_t nt = n0 + 16 * t, cols = std::min<int64_t>(16, N - nt);
              if (cols > 0) store_row(c[2 * half + t][i], yr + nt, cols);
            }
          }
      }
    }
  });
}
#endif

#undef PAGEDLLM_AMX_ISSUE
#undef PAGEDLLM_AMX_STORE

}  // namespace
#endif
