// The block-quantized linear kernels shared by qlinear.cpp (scales per block of 32) and qlinear_k.cpp (GGUF
// K-quant two-level scales): activation quantization, the integer dot products of each vector path, the tiling.
#pragma once

#include "common.h"

namespace pagedllm {
bool bf16_tiles_enabled();  // qlinear.cpp: qlinear's levels 0 (bfloat16 tiles) can run here
}

namespace {

// ------------------------------------------------------------------ block-quantized linear (GGUF-style weights)
// y = x W^T with W in blocks of 32 input channels, each block with a float scale d and offset m per row:
//   4-bit codes u in [0, 16): w = d*u + m (GGUF Q4_1 as it is; Q4_0 with m = -8d);
//   8-bit signed codes s:     w = d*s + m (GGUF Q8_0 with m = 0);
//   4-bit codes through a table (the scales' ``table``: 16 bytes, each < 128): w = d*table[u] + m (MXFP4's E2M1
//   values, doubled and moved to 4..28, with m = -16d); the nibbles unpacked to bytes meet one byte shuffle.
// Activations are quantized per row and block to two int8 levels (see QuantizedRows: x ~ s (254 q + q2)); then
// per block  sum_i w_i x_i = d*s*sum_i(u_i (254 q_i + q2_i)) + m*s*sum_i(254 q_i + q2_i).
//
// Layout: output rows in groups of 8, interleaved so that one 32-byte vector holds 4 consecutive inputs of each
// of the 8 rows ("unit" i of a block: inputs 4i..4i+3, byte 4*row + t). A unit times the 4 activation bytes
// broadcast to every lane is one vpdpbusd (AVX512-VNNI) or vpmaddubsw + vpmaddwd (AVX2): lane `row` collects
// that row's dot product with no horizontal sums, and the 8 rows' scales are one vector load.
//   4-bit: per group and block 128 bytes: byte (i, row, t) = code[4i+t] | code[16+4i+t] << 4 (units i, 4+i);
//   8-bit: per group and block 256 bytes: byte (i, row, t) = code[4i+t], i in [0, 8);
//   5-bit (8-bit codes s in [-16, 16): GGUF Q5_0, 4-bit codes widened into a fused 8-bit layer; 160 bytes, 5/8 of
//   the 8-bit layout's): of u = s + 16 in [0, 32), the 4-bit layout of its low 4 bits (128 bytes), then 32 bytes of
//   its bits 4: byte (row, t) = bit 4 of unit i's code (4i+t) at bit i (a unit's vector is this one shifted and
//   masked);
//   6-bit (s in [-32, 32): GGUF Q6_K, Q5_K; 192 bytes): of u = s + 32, the 4-bit layout of its low 4 bits, then two
//   vectors of its bits 4-5: byte (row, t) of vector v = bits 4-5 of unit 4v + k's code at bits 2k, 2k+1.
//   Every path runs 5- and 6-bit codes as the 8-bit codes they are (the same integer sums), so the results are
//   bitwise those of the 8-bit layout;
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
  int levels = 2;  // 1: the coarse level alone (q2 all zero: 8-bit activations; the tiles skip its products)
  // the integer sum of a block is level() * (sum with q) + (sum with q2): 254 with two levels; 1 with one (s is
  // then max / 127 and isum sum(q), so a kernel's sum is the coarse level's products alone, with no multiply)
  int level() const { return levels == 1 ? 1 : LEVEL; }
};

// padded_rows (>= M): q and q2 hold that many rows, those past M zero (whole AMX tiles).
// levels 1: q2 = 0, x ~ s q with s = max / 127 (8 bits per activation and a scale per block of 32, as llama.cpp's Q8_0
// rows; out.level() 1): every path sums the coarse level's products alone, with no factor 254 to apply (the AMX tiles'
// scaling of a block is then 4 vector operations instead of 8), and the tiles skip the fine level's products.
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, QuantizedRows& out, int64_t padded_rows = 0, int levels = 2) {
  out.levels = levels;
  const int lvl = out.level();
  const int64_t nb = K / QB, rows = std::max(M, padded_rows);  // rows past M: zero codes and scales
#if defined(PAGEDLLM_QWIDE)
  out.v.resize(M * K);
#else
  out.q.resize(rows * K);
  out.q2.resize(rows * K);
#endif
  out.s.resize(rows * nb);
  out.ss.resize(rows * nb);
  out.isum.resize(M * nb);
  out.ss2.resize(2 * rows * nb);
  out.isum2.resize(2 * M * nb);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    float buf[QB];
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        load_row(x + r * K + b * QB, buf, QB);
#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(PAGEDLLM_QWIDE)
        {  // the 8-lane loop below on 16 lanes: the same operations, so the same values
          const __m512 v[2] = {_mm512_loadu_ps(buf), _mm512_loadu_ps(buf + 16)};
          const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
          const float inv = amax > 0.f ? 127.f / amax : 0.f;
          const __m512 vinv = _mm512_set1_ps(inv), vinv2 = _mm512_set1_ps(inv * LEVEL);
          const __m512 vsx = _mm512_set1_ps(amax / 127.f);
          int8_t* q = out.q.data() + r * K + b * QB;
          int8_t* q2 = out.q2.data() + r * K + b * QB;
          int32_t sums[2];  // of inputs 0-15, 16-31
          for (int j = 0; j < 2; ++j) {
            const __m512 q1f =
                _mm512_roundscale_ps(_mm512_mul_ps(v[j], vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m512i q1i = _mm512_cvtps_epi32(q1f);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * j), _mm512_cvtsepi32_epi8(q1i));
            if (levels == 1) {  // q2 stays zero (the vectors start so)
              sums[j] = _mm512_reduce_add_epi32(q1i);
              continue;
            }
            const __m512 rest = _mm512_fnmadd_ps(q1f, vsx, v[j]);
            const __m512i q2i = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(rest, vinv2)),
                                                                  _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + 16 * j), _mm512_cvtsepi32_epi8(q2i));
            sums[j] = _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_mullo_epi32(q1i, _mm512_set1_epi32(lvl)), q2i));
          }
          const float s = amax / (127.f * static_cast<float>(lvl));
          const int32_t lo = sums[0], isum = sums[0] + sums[1];
          const int64_t i = r * nb + b;
          out.s[i] = s;
          out.isum[i] = isum;
          out.ss[i] = s * static_cast<float>(isum);
          out.isum2[2 * i] = lo;
          out.isum2[2 * i + 1] = isum - lo;
          out.ss2[2 * i] = s * static_cast<float>(lo);
          out.ss2[2 * i + 1] = s * static_cast<float>(isum - lo);
          continue;
        }
#endif
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
            q2i[j] = levels == 1 ? _mm256_setzero_si256() : _mm256_max_epi32(_mm256_min_epi32(
                _mm256_cvtps_epi32(_mm256_mul_ps(rest, vinv2)), _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
            vi[j] = _mm256_add_epi32(_mm256_mullo_epi32(q1i[j], _mm256_set1_epi32(lvl)), q2i[j]);
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
          const float s = amax / (127.f * static_cast<float>(lvl));
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
          const int v2 = levels == 1 ? 0 : std::max(-127, std::min(127, static_cast<int>(std::nearbyint(
                                                    (buf[i] - q1f * sx) * (inv * LEVEL)))));
          q[i] = static_cast<int8_t>(q1f);
          q2[i] = static_cast<int8_t>(v2);
          sum += static_cast<int>(q1f) * lvl + v2;
        }
        const float s = amax / (127.f * static_cast<float>(lvl));
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

// 8 scales or offsets of a QScales layout whose width is told at run time (WIDTH 0, below): float32, or float16 where
// the layer keeps its file's values (`shift` 1: 2-byte values, 2: 4-byte ones). The width is a property of the layer,
// so a load's test of it goes the same way for a whole call: one predictable branch per 8 (16) values, in place of
// one build of the layout's kernels per width. A float16 value widens to exactly the float32 it stands for, so the
// arithmetic is that of the float32 layout.
struct SPtr {
  const void* p;
  int shift;  // log2 of a value's bytes: 1 (float16) or 2 (float32)
  SPtr operator+(int64_t k) const { return {static_cast<const char*>(p) + (k << shift), shift}; }
  bool half() const { return shift == 1; }
  float operator[](int64_t j) const {
    return half() ? static_cast<float>(static_cast<const at::Half*>(p)[j]) : static_cast<const float*>(p)[j];
  }
};
inline int scale_shift(bool half) { return half ? 1 : 2; }
// A layout's scales (offsets) from p as QScales' WIDTH reads them: typed (2: float16, 4: float32), or an SPtr of
// width `shift` (0).
template <int WIDTH>
inline auto scales_ptr(const void* p, int shift) {
  if constexpr (WIDTH == 2) return static_cast<const at::Half*>(p);
  else if constexpr (WIDTH == 4) return static_cast<const float*>(p);
  else return SPtr{p, shift};
}

// A layer's block scales d and offsets m: per group of 8 rows and block, the 8 rows' values, float32 or float16
// (a GGUF file's own precision, which the layer keeps when every value converts exactly: 20 instead of 24
// bytes per 4-bit block of a row). No offsets (OFF false: GGUF Q8_0, symmetric 8-bit weights) skips their loads and
// multiply-adds.
// SUB: scales (and offsets) per block, 1 or 2 (GGUF's blocks of 16: Q2_K, Q3_K, Q6_K); with 2 the integer sums of
// each half block (inputs 0-15, 16-31) get their own float steps, against the activations' per-half sums.
// WIDTH: the values' bytes when known at compile time (2: float16, 4: float32), read through typed pointers, or 0:
// either, told by `shift` at run time (SPtr). The layouts with a scale per block of 32, which every common GGUF type
// outside the K-quant form has (Q8_0, Q5_0, Q4_0, Q4_1 in float16) and pagedllm's own 8- and 4-bit weights (float32),
// are built for both widths; scales per 16 (Q2_K, Q3_K, Q6_K tensors whose rows are not a multiple of 256, or that a
// fused projection mixes with other types) take the run-time width. One build per width of every layout made
// qlinear.cpp's compile 106 s of a core; run-time widths everywhere 44 s, but 0-2% slower in cache on 8-bit codes
// at 4-16 rows (an earlier run-time test had lost 3-12%: docs/history.md); this split 62 s (docs/benchmarks.md,
// session 45).
template <bool OFF, int SUB = 1, int WIDTH = 0>
struct QScales {
  static constexpr bool offsets = OFF;
  static constexpr int sub = SUB;
  const void* d;
  const void* m;  // unused without OFF
  int shift;  // float16 values (1) or float32 (2): SPtr (WIDTH 0)
  int64_t nb;  // blocks per row
  const uint8_t* table = nullptr;  // 4-bit codes: the 16 values they stand for (null: the codes themselves)
  // index of group g's 8 values of block b (its half h)
  int64_t at(int64_t g, int64_t b, int h = 0) const { return ((g * nb + b) * SUB + h) * 8; }
  // where those 8 scales (offsets) start
  auto dp(int64_t g, int64_t b, int h = 0) const { return scales_ptr<WIDTH>(d, shift) + at(g, b, h); }
  auto mp(int64_t g, int64_t b, int h = 0) const { return scales_ptr<WIDTH>(m, shift) + at(g, b, h); }
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
// one block: their super-block scales and sub-block integers) stands where QScales gives a pointer or SPtr (p[j],
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
  const uint8_t* table = nullptr;  // never set: K-quants' 4-bit codes are their values
  int64_t at(int64_t g, int64_t b, int h = 0) const { return ((g * nb + b) * SUB + h) * 8; }
  int64_t super(int64_t g, int64_t b) const { return (g * (nb / 8) + b / 8) * 8; }
  KPtr dp(int64_t g, int64_t b, int h = 0) const { return {D + super(g, b), s + at(g, b, h)}; }
  KPtr mp(int64_t g, int64_t b, int h = 0) const { return {Dm + super(g, b), mn + at(g, b, h)}; }
};
// Scales whose blocks' offsets follow from them: -zero * d (a table's values stored as value + zero, MXFP4's codes),
// so no offsets are stored or streamed. An OffPtr stands where QScales gives the offsets' pointer (p[j], p + 4,
// load8, load_pair, load4): each offset is computed from its scale, exactly (d a power of two, zero a small integer).
// P: the scales' pointer (const at::Half*, const float* or SPtr, as QScales' WIDTH).
template <typename P>
struct OffPtr {
  P d;
  float zero;
  OffPtr operator+(int64_t k) const { return {d + k, zero}; }
  float operator[](int64_t j) const { return -zero * static_cast<float>(d[j]); }
};
template <int WIDTH>  // 2 or 4
struct TScales {
  static constexpr bool offsets = true;
  static constexpr int sub = 1;
  const void* d;  // float16 (WIDTH 2) or float32 (4) scales
  int64_t nb;
  const uint8_t* table;
  float zero;
  int64_t at(int64_t g, int64_t b, int h = 0) const { return (g * nb + b + h) * 8; }
  auto dp(int64_t g, int64_t b, int h = 0) const { return scales_ptr<WIDTH>(d, 0) + at(g, b, h); }
  auto mp(int64_t g, int64_t b, int h = 0) const { return OffPtr<decltype(dp(g, b, h))>{dp(g, b, h), zero}; }
};

template <typename S> inline const void* addr(const S* p) { return p; }
inline const void* addr(const SPtr& p) { return p.p; }
inline const void* addr(const KPtr& p) { return p.s; }
template <typename P> inline const void* addr(const OffPtr<P>& p) { return addr(p.d); }

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// What the vpdpbusd paths add to an 8-bit (5-, 6-bit) layout's signed code to make it unsigned, so 128 (16, 32)
// times the activations' integer sum comes off each block's sum.
template <int BITS>
constexpr int CODE_BIAS = BITS == 5 ? 16 : BITS == 6 ? 32 : 128;

// 5- and 6-bit codes: the vector of unit i's high bits (bits 4, or 4-5) is at plane_at<BITS>(i) of its block, as its
// unit plane_unit<BITS>(i) there.
template <int BITS> constexpr int plane_at(int i) { return 128 + (BITS == 6 ? 32 * (i >> 2) : 0); }
template <int BITS> constexpr int plane_unit(int i) { return BITS == 6 ? i & 3 : i; }
// The bit that lands at bit 4: unit k's (5-bit: bit k; 6-bit: bits 2k, 2k+1 to 4, 5), and the bits kept.
template <int BITS> constexpr int plane_bit(int k) { return BITS == 6 ? 2 * k : k; }
template <int BITS> constexpr int HIGH_MASK = BITS == 6 ? 0x30 : 0x10;
// GF2P8AFFINEQB's matrix moving them there: output bit r is the parity of matrix byte 7 - r and the input byte.
template <int BITS>
constexpr int64_t plane_matrix(int k) {
  return BITS == 6 ? (int64_t{1} << (24 + 2 * k)) | (int64_t{1} << (17 + 2 * k)) : int64_t{1} << (24 + k);
}

// A 4-bit code's value: itself, or its entry of the scales' table.
inline int code_value(const uint8_t* table, int c) { return table != nullptr ? table[c] : c; }

#if defined(__AVX2__)
// The table in each 128-bit lane (vpshufb looks up within lanes); zero without one (never used then).
inline __m256i table256(const uint8_t* table) {
  return table != nullptr ? _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table)))
                          : _mm256_setzero_si256();
}
#endif

template <typename T>
inline void store_group(T* y, int64_t N, int64_t n0, const float* v) {  // up to 8 outputs, cut at N
  const int64_t cnt = std::min<int64_t>(8, N - n0);
  if constexpr (std::is_same_v<T, float>) {
    if (cnt == 8) return std::memcpy(y + n0, v, 8 * sizeof(float)), void();  // one vector move, not 8 stores
  }
  for (int64_t j = 0; j < cnt; ++j) y[n0 + j] = from_f<T>(v[j]);
}

// A qlinear's activation or output rows, float32 or bfloat16, the type a run-time flag: every tile is built once,
// not once per type (the second copies were half of the kernels' build time), for one well-predicted branch per 8
// outputs stored.
struct Rows {
  void* p;
  bool bf16;
};

inline Rows rows_of(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "qlinear: float32 or bfloat16 only");
  return {t.data_ptr(), t.scalar_type() == at::kBFloat16};
}

inline void store_group(const Rows& y, int64_t row, int64_t N, int64_t n0, const float* v) {  // row `row` of y
  if (y.bf16)
    store_group(static_cast<at::BFloat16*>(y.p) + row * N, N, n0, v);
  else
    store_group(static_cast<float*>(y.p) + row * N, N, n0, v);
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

// Unit k's high bits in place (bits 4 or 4-5 of each byte, the rest zero) from a plane p: one affine bit transform
// per byte where the CPU has GFNI, else a 16-bit shift and a mask (a bit crossing into the lane's other byte lands
// outside the bits kept: shifts of at most 4).
template <int BITS>
inline __m256i high_bits(__m256i p, int k) {
#if defined(__GFNI__)
  return _mm256_gf2p8affine_epi64_epi8(p, _mm256_set1_epi64x(plane_matrix<BITS>(k)), 0);
#else
  const int f = plane_bit<BITS>(k);
  return _mm256_and_si256(f <= 4 ? _mm256_slli_epi16(p, 4 - f) : _mm256_srli_epi16(p, f - 4),
                          _mm256_set1_epi8(HIGH_MASK<BITS>));
#endif
}
// Unit i (< 8) of a 5- or 6-bit block (wb: the group's block) as its 32 codes u = s + CODE_BIAS: the low or high
// nibbles of the 4-bit vector i % 4, or'd with the high bits.
template <int BITS>
inline __m256i unit_narrow(const uint8_t* wb, int i) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * (i & 3)));
  const __m256i lo = _mm256_and_si256(i < 4 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
  const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + plane_at<BITS>(i)));
  return _mm256_or_si256(lo, high_bits<BITS>(p, plane_unit<BITS>(i)));
}

// Unit i of an 8-, 5- or 6-bit block: its signed codes s, and the unsigned bytes s + CODE_BIAS that vpdpbusd takes.
template <int BITS>
inline __m256i unit_signed(const uint8_t* wb, int i) {
  if constexpr (BITS != 8) return _mm256_sub_epi8(unit_narrow<BITS>(wb, i), _mm256_set1_epi8(CODE_BIAS<BITS>));
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * i));
}
template <int BITS>
inline __m256i unit_unsigned(const uint8_t* wb, int i) {
  if constexpr (BITS != 8) return unit_narrow<BITS>(wb, i);
  return _mm256_xor_si256(unit_signed<BITS>(wb, i), _mm256_set1_epi8(-128));
}

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

inline __m256 load8(const SPtr& p) {
  return p.half() ? load8(static_cast<const at::Half*>(p.p)) : load8(static_cast<const float*>(p.p));
}
template <typename P>
inline __m256 load8(const OffPtr<P>& p) { return _mm256_mul_ps(_mm256_set1_ps(-p.zero), load8(p.d)); }

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
// sum, and spills most products to the stack.
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
  const bool tab = sc.table != nullptr;
  const __m256i tbl = table256(sc.table), low4b = _mm256_set1_epi8(0x0F), low8 = _mm256_set1_epi16(0xFF);
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
              if (tab) {  // each byte's nibble through the table, then the int16 pairs of its bytes
                v = _mm256_shuffle_epi8(tbl, _mm256_and_si256(v, low4b));
                e0[g] = _mm256_and_si256(v, low8);  // (a, a+2)
                e1[g] = _mm256_srli_epi16(v, 8);    // (a+1, a+3)
                continue;
              }
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
            const uint8_t* wg = w + (g0 + g) * gstride + b * gbytes;
            if constexpr (BITS == 5 || BITS == 6) {  // u = s + CODE_BIAS, non-negative: CODE_BIAS * isum comes off
              const __m256i u = unit_narrow<BITS>(wg, i);
              f0[g] = _mm256_and_si256(u, low8);  // (4i, 4i+2)
              f1[g] = _mm256_srli_epi16(u, 8);   // (4i+1, 4i+3)
              continue;
            }
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32 * i));
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
      add_blocks<GT, MT>(acc, sc, g0, xa, r0, b, half, [&](int g, int r) {
        if constexpr (BITS == 5 || BITS == 6)
          return _mm256_sub_epi32(s[g][r],
                                  _mm256_set1_epi32(CODE_BIAS<BITS> * act_isum<SUB>(xa, (r0 + r) * nb + b, half)));
        return s[g][r];
      });
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
  const bool two = xa.levels == 2;  // 1: q2 is zero, its products are skipped
  const bool tab = sc.table != nullptr;
  const __m256i tbl = table256(sc.table);
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
            if (tab) {
              ul[g] = _mm256_shuffle_epi8(tbl, ul[g]);
              uh[g] = _mm256_shuffle_epi8(tbl, uh[g]);
            }
          }
          for (int r = 0; r < MT; ++r) {
            if (SUB == 1 || half == 0) {
              const __m256i x1 = _mm256_set1_epi32(load_i32(xq[r] + 4 * i));
              const __m256i x2 = _mm256_set1_epi32(load_i32(xq2[r] + 4 * i));
              for (int g = 0; g < GT; ++g) {
                hi[g][r] = dot_acc(hi[g][r], ul[g], x1);
                if (two) lo[g][r] = dot_acc(lo[g][r], ul[g], x2);
              }
            }
            if (SUB == 1 || half == 1) {
              const __m256i y1 = _mm256_set1_epi32(load_i32(xq[r] + 16 + 4 * i));
              const __m256i y2 = _mm256_set1_epi32(load_i32(xq2[r] + 16 + 4 * i));
              for (int g = 0; g < GT; ++g) {
                hi[g][r] = dot_acc(hi[g][r], uh[g], y1);
                if (two) lo[g][r] = dot_acc(lo[g][r], uh[g], y2);
              }
            }
          }
        }
      } else {
        for (int i = SUB == 2 ? 4 * half : 0; i < (SUB == 2 ? 4 * half + 4 : 8); ++i) {
          __m256i ua[GT];  // the codes as vpdpbusd / vpmaddubsw take them (unsigned)
#if !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
          __m256i u[GT];  // the signed codes
#endif
          for (int g = 0; g < GT; ++g) {
            const uint8_t* wg = w + (g0 + g) * gstride + b * gbytes;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
            ua[g] = unit_unsigned<BITS>(wg, i);  // s + CODE_BIAS as unsigned; CODE_BIAS * isum comes off below
#else
            u[g] = unit_signed<BITS>(wg, i);
            ua[g] = _mm256_sign_epi8(u[g], u[g]);  // |s| times x with s's sign (vpmaddubsw needs u < 128)
#endif
          }
          for (int r = 0; r < MT; ++r) {
            const __m256i x1 = _mm256_set1_epi32(load_i32(xq[r] + 4 * i));
            const __m256i x2 = _mm256_set1_epi32(load_i32(xq2[r] + 4 * i));
            for (int g = 0; g < GT; ++g) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
              hi[g][r] = dot_acc(hi[g][r], ua[g], x1);
              if (two) lo[g][r] = dot_acc(lo[g][r], ua[g], x2);
#else
              hi[g][r] = dot_acc(hi[g][r], ua[g], _mm256_sign_epi8(x1, u[g]));
              if (two) lo[g][r] = dot_acc(lo[g][r], ua[g], _mm256_sign_epi8(x2, u[g]));
#endif
            }
          }
        }
      }
      add_blocks<GT, MT>(acc, sc, g0, xa, r0, b, half, [&](int g, int r) {
        __m256i s = two ? _mm256_add_epi32(_mm256_mullo_epi32(hi[g][r], _mm256_set1_epi32(LEVEL)), lo[g][r]) : hi[g][r];
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        if constexpr (BITS != 4)
          s = _mm256_sub_epi32(s, _mm256_set1_epi32(CODE_BIAS<BITS> * act_isum<SUB>(xa, (r0 + r) * nb + b, half)));
#endif
        return s;
      });
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int r = 0; r < MT; ++r) out[g * MT + r] = acc[g][r];
}
#endif

#if defined(__AVX512BW__)
inline __m512i table512(const uint8_t* table) {  // the table in each 128-bit lane (zero without one)
  return table != nullptr ? _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table)))
                          : _mm512_setzero_si512();
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGEDLLM_QZMM 1
inline __m512i load_pair(const uint8_t* a, const uint8_t* b) {  // 32 bytes of group g low, of group g+1 high
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}
// high_bits on 512-bit vectors: unit k0's in the low half, k1's in the high half (two groups' planes, or one
// plane in both halves)
template <int BITS>
inline __m512i high_bits(__m512i p, int k0, int k1) {
#if defined(__GFNI__)
  return _mm512_gf2p8affine_epi64_epi8(
      p, _mm512_inserti64x4(_mm512_set1_epi64(plane_matrix<BITS>(k0)), _mm256_set1_epi64x(plane_matrix<BITS>(k1)), 1),
      0);
#else  // both halves shift the same way (the units of one 64-byte load: bits 0-1 and 2-3 (5-bit: or 4-5, 6-7))
  const int f0 = plane_bit<BITS>(k0), f1 = plane_bit<BITS>(k1);
  const __m512i n = _mm512_inserti64x4(_mm512_set1_epi16(std::abs(4 - f0)), _mm256_set1_epi16(std::abs(4 - f1)), 1);
  return _mm512_and_si512(f0 <= 4 && f1 <= 4 ? _mm512_sllv_epi16(p, n) : _mm512_srlv_epi16(p, n),
                          _mm512_set1_epi8(HIGH_MASK<BITS>));
#endif
}
// unit_signed of two groups' blocks (a low, b high), on 512-bit vectors (the AMX tiles' decode)
template <int BITS>
inline __m512i unit_pair_signed(const uint8_t* a, const uint8_t* b, int i) {
  if constexpr (BITS != 8)
    return _mm512_inserti64x4(_mm512_castsi256_si512(unit_signed<BITS>(a, i)), unit_signed<BITS>(b, i), 1);
  return load_pair(a + 32 * i, b + 32 * i);
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

// (a and b: one layer's, of one width)
inline __m512 load_pair(const SPtr& a, const SPtr& b) {
  return a.half() ? load_pair(static_cast<const at::Half*>(a.p), static_cast<const at::Half*>(b.p))
                : load_pair(static_cast<const float*>(a.p), static_cast<const float*>(b.p));
}
template <typename P>
inline __m512 load_pair(const OffPtr<P>& a, const OffPtr<P>& b) {
  return _mm512_mul_ps(_mm512_set1_ps(-a.zero), load_pair(a.d, b.d));
}

inline __m512 load_pair(const KPtr& a, const KPtr& b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(load8(a))),
                                             _mm256_castps_pd(load8(b)), 1));
}

// One block's float step on 16 outputs (two groups): the block's exact integer sums isum times d * s, plus m * ss,
// into the running sums. qtile512 and the AMX tiles (qlinear_amx.h) both take it, so their results are bitwise equal.
template <bool OFF>
inline __m512 block_step512(__m512 acc, __m512i isum, __m512 dv, __m512 mv, float s, float ss) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dv, _mm512_set1_ps(s)), acc);
  if constexpr (OFF) acc = _mm512_fmadd_ps(mv, _mm512_set1_ps(ss), acc);
  return acc;
}

// Bytes of one pair of groups' block decoded: 8 units of 64 bytes (group 2p's 32 bytes, then group 2p+1's).
constexpr int64_t UNPACKED_BLOCK = 512;

// Blocks [b0, b1) of groups [g0, g0 + 2 np) of 5- or 6-bit codes decoded once for many row tiles (qtile512<...,
// BUF>): per pair and block (at (p (b1 - b0) + b - b0) UNPACKED_BLOCK) the 8 units as vpdpbusd takes them (s +
// CODE_BIAS), the bytes qtile512 makes of them in its registers. Steps of many rows otherwise unpack each weight
// again for every tile of rows: a fifth of their time (Zen 4; 4-bit codes unpack in two logic operations, 8-bit ones
// in one, and gained nothing this way).
template <int BITS>
inline void unpack_pairs(const uint8_t* w, int64_t gstride, int64_t g0, int np, int64_t b0, int64_t b1,
                         std::vector<uint8_t>& buf) {
  static_assert(BITS == 5 || BITS == 6, "unpack_pairs: 5- or 6-bit codes");
  constexpr int64_t gbytes = BITS * 32;
  const int64_t nbs = b1 - b0;
  buf.resize(np * nbs * UNPACKED_BLOCK);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int p = 0; p < np; ++p) {
    const uint8_t* a = w + (g0 + 2 * p) * gstride;
    const uint8_t* c = a + gstride;
    for (int64_t b = b0; b < b1; ++b) {
      __m512i* out = reinterpret_cast<__m512i*>(buf.data() + (p * nbs + b - b0) * UNPACKED_BLOCK);
      const uint8_t *ab = a + b * gbytes, *cb = c + b * gbytes;
      // the high bits of units 0-3 and 4-7, then as qtile512: nibble & 0x0F | high bits
      const __m512i pl = load_pair(ab + plane_at<BITS>(0), cb + plane_at<BITS>(0));
      const __m512i ph = BITS == 6 ? load_pair(ab + plane_at<BITS>(4), cb + plane_at<BITS>(4)) : pl;
      for (int i = 0; i < 4; ++i) {
        const __m512i v = load_pair(ab + 32 * i, cb + 32 * i);
        const int kl = plane_unit<BITS>(i), kh = plane_unit<BITS>(4 + i);
        _mm512_storeu_si512(out + i, _mm512_ternarylogic_epi32(v, high_bits<BITS>(pl, kl, kl), low4, 0xEC));
        _mm512_storeu_si512(out + 4 + i, _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4),
                                                                   high_bits<BITS>(ph, kh, kh), low4, 0xEC));
      }
    }
  }
}

// qtile on 512-bit vectors: PT pairs of groups (g0 + 2p, g0 + 2p + 1) in one vector each, so one vpdpbusd does 64
// products (twice the 256-bit rate on CPUs that issue one of either per cycle). The same integer sums and, per
// 8 rows, the same float steps as qtile: the results are bitwise those of the 256-bit tiles.
// ONE: the activations have one level (xa.levels 1), known when the tile is built: no fine-level sums are kept,
// and their registers hold more rows (qtile512_rows).
// BUF: blocks [b0, b1) only (qtile512_unpacked), w holding the tile's pairs already decoded (unpack_pairs' buffer of
// those blocks), gstride unused: the same products of the same bytes, with no unpacking in the tile; the sums start
// from out's (b0 > 0) and end there, so a row's float steps run in the same order as in one call over all blocks.
template <int BITS, int PT, int MT, typename SC, bool ONE = false, bool BUF = false>
inline void qtile512(const uint8_t* w, const SC& sc, int64_t g0, int64_t gstride,
                     const QuantizedRows& xa, int64_t r0, int64_t K, int64_t nb, __m512* out,
                     const uint8_t* ahead = nullptr, int64_t ahead_lines = 0,  // lines asked for ahead
                     int64_t b0 = 0, int64_t b1 = 0) {
  static_assert(!BUF || BITS == 5 || BITS == 6, "qtile512: decoded buffers (unpack_pairs) hold 5- or 6-bit codes");
  constexpr int64_t gbytes = BITS * 32;
  constexpr int SUB = SC::sub;
  if constexpr (!BUF) b1 = nb;
  __m512 acc[PT][MT];
  for (int p = 0; p < PT; ++p)
    for (int r = 0; r < MT; ++r) acc[p][r] = BUF && b0 > 0 ? out[p * MT + r] : _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const bool two = !ONE && xa.levels == 2;  // 1: q2 is zero, its products are skipped
  const bool tab = sc.table != nullptr;
  const __m512i tbl = table512(sc.table);
  for (int64_t b = b0; b < b1; ++b) {
    const int8_t* xq[MT];
    const int8_t* xq2[MT];
    for (int r = 0; r < MT; ++r) {
      xq[r] = xa.q.data() + (r0 + r) * K + b * QB;
      xq2[r] = xa.q2.data() + (r0 + r) * K + b * QB;
    }
    const uint8_t* wb = BUF ? w : w + g0 * gstride + b * gbytes;  // (BUF: unused)
    auto unpacked = [&](int p, int unit) {  // BUF: pair p's decoded unit of block b
      return _mm512_loadu_si512(w + (p * (b1 - b0) + b - b0) * UNPACKED_BLOCK + 64 * unit);
    };
    if (ahead_lines > 0)  // spread over the blocks
      for (int64_t j = ahead_lines * (b - b0) / (b1 - b0); j < ahead_lines * (b + 1 - b0) / (b1 - b0); ++j)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + j * 64), _MM_HINT_T1);
    for (int half = 0; half < SUB; ++half) {  // SUB 2: inputs 0-15 (low nibbles, units 0-3), then 16-31
      __m512i hi[PT][MT], lo[PT][MT];
      for (int p = 0; p < PT; ++p)
        for (int r = 0; r < MT; ++r) hi[p][r] = lo[p][r] = _mm512_setzero_si512();
      if constexpr (BITS != 8) {  // 5- and 6-bit: the 4-bit vectors' nibbles or'd with the high bits
        __m512i pl[PT], ph[PT];  // each pair's high bits of units 0-3 and 4-7 (5-bit: one plane)
        if constexpr (BITS != 4 && !BUF)
          for (int p = 0; p < PT; ++p) {
            const uint8_t *a = wb + 2 * p * gstride, *c = a + gstride;
            if (SUB == 1 || half == 0 || BITS == 5) pl[p] = load_pair(a + plane_at<BITS>(0), c + plane_at<BITS>(0));
            if (SUB == 1 || half == 1)
              ph[p] = BITS == 6 ? load_pair(a + plane_at<BITS>(4), c + plane_at<BITS>(4)) : pl[p];
          }
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          __m512i ul[PT], uh[PT];
          for (int p = 0; p < PT; ++p) {
            if constexpr (BUF) {
              ul[p] = unpacked(p, i);
              uh[p] = unpacked(p, 4 + i);
              continue;
            }
            const __m512i v = load_pair(wb + 2 * p * gstride + 32 * i, wb + (2 * p + 1) * gstride + 32 * i);
            if constexpr (BITS != 4) {  // u = s + CODE_BIAS as unsigned: nibble & 0x0F | high bits, one ternary step
              const int kl = plane_unit<BITS>(i), kh = plane_unit<BITS>(4 + i);
              if (SUB == 1 || half == 0)  // (a half block of 16 inputs: its units alone)
                ul[p] = _mm512_ternarylogic_epi32(v, high_bits<BITS>(pl[p], kl, kl), low4, 0xEC);  // a & c | b
              if (SUB == 1 || half == 1)
                uh[p] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), high_bits<BITS>(ph[p], kh, kh), low4, 0xEC);
              continue;  // CODE_BIAS * isum comes off below
            }
            ul[p] = _mm512_and_si512(v, low4);
            uh[p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            if (tab) {
              ul[p] = _mm512_shuffle_epi8(tbl, ul[p]);
              uh[p] = _mm512_shuffle_epi8(tbl, uh[p]);
            }
          }
          for (int r = 0; r < MT; ++r) {
            if (SUB == 1 || half == 0) {
              const __m512i x1 = _mm512_set1_epi32(load_i32(xq[r] + 4 * i));
              const __m512i x2 = _mm512_set1_epi32(load_i32(xq2[r] + 4 * i));
              for (int p = 0; p < PT; ++p) {
                hi[p][r] = _mm512_dpbusd_epi32(hi[p][r], ul[p], x1);
                if (two) lo[p][r] = _mm512_dpbusd_epi32(lo[p][r], ul[p], x2);
              }
            }
            if (SUB == 1 || half == 1) {
              const __m512i y1 = _mm512_set1_epi32(load_i32(xq[r] + 16 + 4 * i));
              const __m512i y2 = _mm512_set1_epi32(load_i32(xq2[r] + 16 + 4 * i));
              for (int p = 0; p < PT; ++p) {
                hi[p][r] = _mm512_dpbusd_epi32(hi[p][r], uh[p], y1);
                if (two) lo[p][r] = _mm512_dpbusd_epi32(lo[p][r], uh[p], y2);
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
              if (two) lo[p][r] = _mm512_dpbusd_epi32(lo[p][r], u[p], x2);
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
          __m512i s = two ? _mm512_add_epi32(_mm512_mullo_epi32(hi[p][r], _mm512_set1_epi32(LEVEL)), lo[p][r])
                          : hi[p][r];
          if constexpr (BITS != 4)
            s = _mm512_sub_epi32(s, _mm512_set1_epi32(CODE_BIAS<BITS> * act_isum<SUB>(xa, row, half)));
          acc[p][r] = block_step512<SC::offsets>(acc[p][r], s, dv, mv, xa.s[row], act_ss<SUB>(xa, row, half));
        }
      }
    }
  }
  for (int p = 0; p < PT; ++p)
    for (int r = 0; r < MT; ++r) out[p * MT + r] = acc[p][r];
}

// K-quant scales (KScales) of the groups [g0, g0 + 2 PT) widened to float32 once for all the row tiles of a call
// (exact: D * s, so the results are bitwise those of KScales), in QScales' order from g0: a row tile's scales are
// then plain loads, where each KPtr load_pair costs 8 conversions and multiplies per block (amortized over a tile's
// rows only). The 1.5B's linears on a Zen 4 (ab_decode_linears): 32 / 48 / 256 rows 5% / 7% / 5% faster; at 12 rows
// (three tiles) no gain, so it runs from three tiles up.
template <bool OFF, int SUB>
struct WideKScales {
  static constexpr bool offsets = OFF;
  static constexpr int sub = SUB;
  const float* d;
  const float* m;
  int64_t nb, g0;
  const uint8_t* table = nullptr;
  int64_t at(int64_t g, int64_t b, int h = 0) const { return (((g - g0) * nb + b) * SUB + h) * 8; }
  const float* dp(int64_t g, int64_t b, int h = 0) const { return d + at(g, b, h); }
  const float* mp(int64_t g, int64_t b, int h = 0) const { return m + at(g, b, h); }
};
template <bool OFF, int SUB>
WideKScales<OFF, SUB> widen(const KScales<OFF, SUB>& sc, int64_t g0, int64_t ng, std::vector<float>& buf) {
  const int64_t n = ng * sc.nb * SUB * 8;
  buf.resize(OFF ? 2 * n : n);
  const WideKScales<OFF, SUB> ws{buf.data(), buf.data() + (OFF ? n : 0), sc.nb, g0};
  for (int64_t g = g0; g < g0 + ng; ++g)
    for (int64_t b = 0; b < sc.nb; ++b)
      for (int h = 0; h < SUB; ++h) {
        _mm256_storeu_ps(buf.data() + ws.at(g, b, h), load8(sc.dp(g, b, h)));
        if constexpr (OFF) _mm256_storeu_ps(buf.data() + n + ws.at(g, b, h), load8(sc.mp(g, b, h)));
      }
  return ws;
}
template <typename SC> struct is_kscales : std::false_type {};
template <bool OFF, int SUB> struct is_kscales<KScales<OFF, SUB>> : std::true_type {};

// Rows of a tile with one activation level (8-bit activations): the registers of the fine level's sums hold a 4th
// row, so each weight vector decoded serves 4 rows instead of 3 (all linears of Qwen2.5-Coder 0.5B / 1.5B and
// Gemma 3 270M with one level, two builds alternating in one process on a Zen 4: 8 rows 12-13%, 32 rows 11-24%
// faster; tiles of 5 or 6 rows spill registers and were slower)
constexpr int ZMT_ONE = 4;
// Steps of up to this many rows ask for the next run's weights ahead (qtile512_rows).
constexpr int64_t AHEAD_MAX_ROWS = 16;

// Calls tile(n, one, r) for the row tiles of rows [r, M) of qtile512_rows, in order: n rows from r, n a
// std::integral_constant (ZMT_ONE with one activation level, one true; then MT, 2 and 1 rows).
template <int MT, typename F>
inline void for_row_tiles(int levels, int64_t r, int64_t M, F&& tile) {
  using std::integral_constant;
  if constexpr (MT > 2) {
    if (levels == 1)  // (5 rows left: 3 + 2, not 4 + a lone row that decodes the weights for itself)
      for (; r + ZMT_ONE <= M && M - r != 5; r += ZMT_ONE) tile(integral_constant<int, ZMT_ONE>{}, std::true_type{}, r);
  }
  for (; r + MT <= M; r += MT) tile(integral_constant<int, MT>{}, std::false_type{}, r);
  if constexpr (MT > 2) {
    if (r + 2 <= M) {
      tile(integral_constant<int, 2>{}, std::false_type{}, r);
      r += 2;
    }
  }
  for (; r < M; ++r) tile(integral_constant<int, 1>{}, std::false_type{}, r);
}

// The lines of `lines` to ask for ahead during steps [s, s + n) of `steps`: [first, second), an even share.
inline std::pair<int64_t, int64_t> ahead_share(int64_t lines, int64_t s, int64_t n, int64_t steps) {
  return {lines * s / steps, lines * (s + n) / steps};
}

// The 16 outputs of each pair p of groups from g0 for rows [r, r + nr), out[p nr + i] row r + i's, stored to y.
template <int PT>
inline void store_pairs(const Rows& y, int64_t N, int64_t g0, const __m512* out, int64_t r, int nr) {
  float res[16];
  for (int p = 0; p < PT; ++p)
    for (int i = 0; i < nr; ++i) {
      _mm512_storeu_ps(res, out[p * nr + i]);
      store_group(y, r + i, N, 8 * (g0 + 2 * p), res);
      store_group(y, r + i, N, 8 * (g0 + 2 * p + 1), res + 8);
    }
}

// Rows from which qtile512_rows decodes its 5- or 6-bit groups once (unpack_pairs) for all its row tiles, and the
// blocks decoded at a time: two pairs' 8 decoded blocks (8 KiB) and a 48-row chunk's activations for them (12 KiB)
// stay in L1 while every row tile passes over them (16 blocks: half the gain; all 28 blocks of Qwen2.5-Coder 0.5B's
// 896 inputs: none).
constexpr int64_t UNPACK_MIN_ROWS = 12;
constexpr int64_t UNPACK_BLOCKS = 8;

// qtile512_rows from rows r on, its groups decoded a slice of UNPACK_BLOCKS blocks at a time: each slice is decoded
// once, then every row tile runs over it, its running sums kept in memory between slices (the same float steps in
// the same order: bitwise the results of qtile512_rows).
// The next run's weights (ahead_groups groups after these) are asked for ahead as in qtile512_rows, spread over
// every slice's row tiles.
template <int BITS, int PT, int MT, typename SC>
inline void qtile512_unpacked(const uint8_t* w, const SC& sc, int64_t g0, int64_t gstride,
                              const QuantizedRows& xa, int64_t r, int64_t M, int64_t K, int64_t nb, int64_t N,
                              const Rows& y, int64_t ahead_groups) {
  thread_local std::vector<uint8_t> buf;
  thread_local std::vector<__m512> sums;
  sums.resize(PT * (M - r));  // a row tile of rows [t, t + n): PT n sums from PT (t - r)
  const int64_t lines = std::max<int64_t>(0, ahead_groups) * gstride / 64, slices = (nb + UNPACK_BLOCKS - 1) /
                        UNPACK_BLOCKS, steps = slices * (M - r);  // (slice, row) steps the lines spread over
  const uint8_t* ahead = w + (g0 + 2 * PT) * gstride;
  for (int64_t b0 = 0; b0 < nb; b0 += UNPACK_BLOCKS) {
    const int64_t b1 = std::min(nb, b0 + UNPACK_BLOCKS), step = b0 / UNPACK_BLOCKS * (M - r);
    unpack_pairs<BITS>(w, gstride, g0, PT, b0, b1, buf);
    for_row_tiles<MT>(xa.levels, r, M, [&](auto n, auto one, int64_t t) {
      const auto [l0, l1] = ahead_share(lines, step + t - r, n, steps);
      qtile512<BITS, PT, decltype(n)::value, SC, decltype(one)::value, true>(
          buf.data(), sc, g0, gstride, xa, t, K, nb, sums.data() + PT * (t - r), ahead + 64 * l0, l1 - l0, b0, b1);
    });
  }
  for_row_tiles<MT>(xa.levels, r, M, [&](auto n, auto, int64_t t) {
    store_pairs<PT>(y, N, g0, sums.data() + PT * (t - r), t, n);
  });
}

// Groups [g0, g0 + 2 PT) against rows [r, M), stored to y (row tiles of MT, ZMT_ONE with one activation level, then
// of 2 and 1: for_row_tiles).
template <int BITS, int PT, int MT, typename SC>
inline void qtile512_rows(const uint8_t* w, const SC& sc, int64_t g0, int64_t gstride,
                          const QuantizedRows& xa, int64_t r, int64_t M, int64_t K, int64_t nb, int64_t N,
                          const Rows& y, int64_t ahead_groups = 0) {
  if constexpr (is_kscales<SC>::value) {
    if (M - r > 2 * ZMT_ONE) {  // more than two row tiles
      thread_local std::vector<float> buf;
      return qtile512_rows<BITS, PT, MT>(w, widen(sc, g0, 2 * PT, buf), g0, gstride, xa, r, M, K, nb, N, y,
                                         ahead_groups);
    }
  }
  if constexpr (BITS == 5 || BITS == 6) {
    if (M - r >= UNPACK_MIN_ROWS)
      return qtile512_unpacked<BITS, PT, MT>(w, sc, g0, gstride, xa, r, M, K, nb, N, y, ahead_groups);
  }
  __m512 out[PT * std::max(MT, ZMT_ONE)];
  // A few rows (decode steps of a few sequences, up to AHEAD_MAX_ROWS): the next run's weights (ahead_groups groups
  // after these) are asked for into L2 while these are computed, each row tile a share of them in proportion to its
  // rows, so the memory streams while the tiles work instead of the two taking turns (many rows: the arithmetic is
  // most of the time, and the hardware's prefetcher keeps up).
  const int64_t r_first = r, rows_all = M - r;
  const int64_t lines = rows_all <= AHEAD_MAX_ROWS ? std::max<int64_t>(0, ahead_groups) * gstride / 64 : 0;
  const uint8_t* ahead = w + (g0 + 2 * PT) * gstride;
  for_row_tiles<MT>(xa.levels, r, M, [&](auto n, auto one, int64_t t) {
    const auto [l0, l1] = ahead_share(lines, t - r_first, n, rows_all);  // this tile's share
    qtile512<BITS, PT, decltype(n)::value, SC, decltype(one)::value>(w, sc, g0, gstride, xa, t, K, nb, out,
                                                                     ahead + 64 * l0, l1 - l0);
    store_pairs<PT>(y, N, g0, out, t, n);
  });
}

// One activation row against one group of 8 rows of 4-bit codes (a decode step of one sequence), on 512-bit vectors:
// a 64-byte load holds units 2j, 2j+1 in its low nibbles and 4+2j, 5+2j in its high ones, against those units'
// activation dwords (lanes 0-7 the first unit's, 8-15 the second's: one permute of the block's 32 bytes). Half the
// instructions of qtile<4, 1, 1> per block, whose one-row decode was bound by them (25 GB/s with the weights in
// cache, below this VM's 34 GB/s of memory), and one stream of codes (a tile of two or four groups reads as many,
// which streamed slower from memory). A block's (half block's) integer sum is the two units' lanes added, the same
// integers as qtile's, then qtile's float steps (add_blocks): bitwise qtile's results. Measured on a Zen 4
// (tools/scripts/ab_decode_linears.py: all linears in decode order, two builds alternating in one process): the
// 4-bit layers' one-row time 14-17% lower on Qwen2.5-Coder 1.5B / 0.5B and Gemma 3 270M, unchanged on SmolLM2's
// Q4_1; 8-bit codes (256 bytes a block) ran 4-16% slower this way than in qtile's one or two groups, which stream
// near the memory's speed already (those with a scale per 16 now run one qtile512 pair: qlinear_impl).
// 5- and 6-bit codes: the same loop on their 4-bit vectors, or'd with the high bits (a plane in both halves of a
// vector, moved by each half's unit), CODE_BIAS * isum off each sum.
template <int BITS, typename SC>
inline __m256 qrow512(const uint8_t* wg, const SC& sc, int64_t g, const QuantizedRows& xa, int64_t row, int64_t K,
                      int64_t nb) {
  static_assert(BITS == 4 || BITS == 5 || BITS == 6, "qrow512: 4-, 5- or 6-bit codes");
  constexpr int64_t gbytes = BITS * 32;
  constexpr int SUB = SC::sub;
  __m256 acc[1][1] = {{_mm256_setzero_ps()}};
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const bool two = xa.levels == 2;
  const __m512i pick[4] = {_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),   // units 0, 1
                           _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3),   // 2, 3
                           _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5),   // 4, 5
                           _mm512_setr_epi32(6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7)};  // 6, 7
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = wg + b * gbytes;
    prefetch_group(wb, gbytes, sc, g, b);
    const int64_t xo = row * K + b * QB;
    const __m512i x1 = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xa.q.data() + xo)));
    const __m512i x2 = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xa.q2.data() + xo)));
    // sums of units 0-3 (inputs 0-15: half 0) and 4-7 (half 1), coarse and fine level
    __m512i hi[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}, lo[2] = {hi[0], hi[1]};
    auto dot = [&](int h, __m512i u, int units) {
      hi[h] = _mm512_dpbusd_epi32(hi[h], u, _mm512_permutexvar_epi32(pick[units], x1));
      if (two) lo[h] = _mm512_dpbusd_epi32(lo[h], u, _mm512_permutexvar_epi32(pick[units], x2));
    };
    __m512i pl, ph;  // 5- and 6-bit: the planes of units 0-3 and 4-7 (5-bit: one) in both halves of a vector
    if constexpr (BITS != 4) {
      auto plane = [&](int i) {
        return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + plane_at<BITS>(i))));
      };
      pl = plane(0);
      ph = BITS == 6 ? plane(4) : pl;
    }
    for (int j = 0; j < 2; ++j) {  // vectors 2j, 2j+1
      const __m512i v = _mm512_loadu_si512(wb + 64 * j);
      __m512i ul = _mm512_and_si512(v, low4), uh = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      if constexpr (BITS != 4) {  // units 2j, 2j+1 (low nibbles) and 4+2j, 5+2j (high)
        const int kl = plane_unit<BITS>(2 * j), kh = plane_unit<BITS>(4 + 2 * j);
        ul = _mm512_or_si512(ul, high_bits<BITS>(pl, kl, kl + 1));
        uh = _mm512_or_si512(uh, high_bits<BITS>(ph, kh, kh + 1));
      }
      dot(0, ul, j);
      dot(1, uh, 2 + j);
    }
    auto halves = [](__m512i a) {
      return _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
    };
    for (int h = 0; h < SUB; ++h) {
      const __m512i c = SUB == 2 ? hi[h] : _mm512_add_epi32(hi[0], hi[1]);
      const __m512i f = SUB == 2 ? lo[h] : _mm512_add_epi32(lo[0], lo[1]);
      __m256i isum =
          two ? _mm256_add_epi32(_mm256_mullo_epi32(halves(c), _mm256_set1_epi32(LEVEL)), halves(f)) : halves(c);
      if constexpr (BITS != 4)
        isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(CODE_BIAS<BITS> * act_isum<SUB>(xa, row * nb + b, h)));
      add_blocks<1, 1>(acc, sc, g, xa, row, b, h, [&](int, int) { return isum; });
    }
  }
  return acc[0][0];
}
#endif

}  // namespace
#include "qlinear_amx.h"  // at file scope: it includes system headers and declares pagedllm::amx_enabled
namespace {

// The tiles of one slice of groups [g0, g0 + GT) against rows [r, M), stored to y.
template <int BITS, int GT, int MT, typename SC>
inline void qtile_rows(const uint8_t* w, const SC& sc, int64_t g0, int64_t gstride,
                       const QuantizedRows& xa, int64_t r, int64_t M, int64_t K, int64_t nb, int64_t N, const Rows& y) {
  __m256 out[GT * MT];
  float res[8];
  for (; r + MT <= M; r += MT) {
    qtile<BITS, GT, MT>(w, sc, g0, gstride, xa, r, K, nb, out);
    for (int g = 0; g < GT; ++g)
      for (int i = 0; i < MT; ++i) {
        _mm256_storeu_ps(res, out[g * MT + i]);
        store_group(y, r + i, N, 8 * (g0 + g), res);
      }
  }
  for (; r < M; ++r) {
    qtile<BITS, GT, 1>(w, sc, g0, gstride, xa, r, K, nb, out);
    for (int g = 0; g < GT; ++g) {
      _mm256_storeu_ps(res, out[g]);
      store_group(y, r, N, 8 * (g0 + g), res);
    }
  }
}
#endif

// Calls f(row j, input k, code) for each of a group's 8 x 32 codes of one block (wb): 4-bit codes u in [0, 16)
// (their table's values where there is one), 8-bit signed codes (5-bit: rebuilt).
template <int BITS, typename F>
inline void for_each_code(const uint8_t* wb, const uint8_t* table, F&& f) {
  for (int i = 0; i < (BITS == 8 ? 8 : 4); ++i)
    for (int j = 0; j < 8; ++j)
      for (int t = 0; t < 4; ++t) {
        const uint8_t byte = wb[32 * i + 4 * j + t];
        const int k = 4 * i + t;
        if constexpr (BITS == 4) {
          f(j, k, code_value(table, byte & 0x0F));
          f(j, 16 + k, code_value(table, byte >> 4));
        } else if constexpr (BITS == 5 || BITS == 6) {  // units i (low nibbles) and 4 + i (high), their high bits
          auto high = [&](int u) {
            const int f = plane_bit<BITS>(plane_unit<BITS>(u));
            return (wb[plane_at<BITS>(u) + 4 * j + t] >> f & (BITS == 6 ? 3 : 1)) << 4;
          };
          f(j, k, (byte & 0x0F | high(i)) - CODE_BIAS<BITS>);
          f(j, 16 + k, (byte >> 4 | high(4 + i)) - CODE_BIAS<BITS>);
        } else {
          f(j, k, static_cast<int8_t>(byte));
        }
      }
}

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
    for_each_code<BITS>(wb, sc.table, [&](int j, int k, int c) {
      s[SUB == 2 && k >= 16][j] += c * (xa.level() * xq[k] + xq2[k]);
    });
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

// The weight rows of groups [g0, g1) as bfloat16 (y: (min(8 g1, N) - 8 g0, K), row-major): per block, w = d*u + m
// in float32 (the product, then the offset: two roundings, as BlockQuantLinear.dequantized), rounded to nearest even.
// A step of many rows runs a stripe of the weights decoded so through a dense bfloat16 GEMM (oneDNN's, AMX tiles
// where there are some): 1.4-2.1x the block kernels' speed per call at prefill, holding only the stripe.
#if defined(__AVX512BF16__)
// 16 codes (4 rows x 4 inputs of a unit: rows 4 q .. 4 q + 3) times their rows' d plus m, as bfloat16, each row's 4
// values stored at y + row * K (8 bytes).
inline void store_unit_bf16(__m512i codes, __m512 d, __m512 m, at::BFloat16* y, int64_t K) {
  const __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(codes), d), m));
  const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(y), lo);
  _mm_storeh_pd(reinterpret_cast<double*>(y + K), _mm_castsi128_pd(lo));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(y + 2 * K), hi);
  _mm_storeh_pd(reinterpret_cast<double*>(y + 3 * K), _mm_castsi128_pd(hi));
}

// A whole group of 8 rows, block b: the vector form of the loop below (bitwise the same values).
template <int BITS, typename SC>
inline void dequant_group_bf16(const uint8_t* wb, const SC& sc, int64_t g, int64_t b, int64_t K, at::BFloat16* yb) {
  constexpr int SUB = SC::sub;
  const __m512i idx[2] = {_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                          _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7)};
  __m512 d[SUB][2], m[SUB][2];  // per half block and 4 rows: each row's value in its 4 lanes
  for (int h = 0; h < SUB; ++h) {
    const __m512 dv = _mm512_castps256_ps512(load8(sc.dp(g, b, h)));
    const __m512 mv = SC::offsets ? _mm512_castps256_ps512(load8(sc.mp(g, b, h))) : _mm512_setzero_ps();
    for (int q = 0; q < 2; ++q) {
      d[h][q] = _mm512_permutexvar_ps(idx[q], dv);
      m[h][q] = _mm512_permutexvar_ps(idx[q], mv);
    }
  }
  for (int i = 0; i < (BITS == 4 ? 4 : 8); ++i)
    for (int q = 0; q < 2; ++q) {  // rows 4q .. 4q+3 of unit i (4-bit: units i and 4+i)
      __m128i raw;
      if constexpr (BITS == 5 || BITS == 6) {
        const __m256i u = unit_signed<BITS>(wb, i);
        raw = q ? _mm256_extracti128_si256(u, 1) : _mm256_castsi256_si128(u);
      } else {
        raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 32 * i + 16 * q));
      }
      at::BFloat16* y = yb + 4 * q * K + 4 * i;
      if constexpr (BITS == 4) {
        const __m512i u = _mm512_cvtepu8_epi32(raw);
        __m512i lo = _mm512_and_si512(u, _mm512_set1_epi32(0x0F)), hi = _mm512_srli_epi32(u, 4);
        if (sc.table != nullptr) {  // the 16 values as 16 int32 lanes: one permute looks each code up
          const __m512i t = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc.table)));
          lo = _mm512_permutexvar_epi32(lo, t);
          hi = _mm512_permutexvar_epi32(hi, t);
        }
        store_unit_bf16(lo, d[0][q], m[0][q], y, K);
        store_unit_bf16(hi, d[SUB - 1][q], m[SUB - 1][q], y + 16, K);
      } else {
        const int h = SUB == 2 && i >= 4;
        store_unit_bf16(_mm512_cvtepi8_epi32(raw), d[h][q], m[h][q], y, K);
      }
    }
}
#endif

template <int BITS, typename SC>
void dequant_bf16(const uint8_t* w, const SC& sc, int64_t g0, int64_t g1, int64_t K, int64_t N, at::BFloat16* y) {
  constexpr int SUB = SC::sub;
  const int64_t nb = K / QB, gstride = nb * BITS * 32;
  // claimed 8 groups at a time (parallel_claims: a descheduled thread's share is taken over)
  parallel_claims(g1 - g0, 8, [&](int64_t begin, int64_t end) {
    float v[8][QB];
    for (int64_t g = g0 + begin; g < g0 + end; ++g) {
      const int64_t rows = std::min<int64_t>(8, N - 8 * g);
      at::BFloat16* yg = y + (g - g0) * 8 * K;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* wb = w + g * gstride + b * BITS * 32;
#if defined(__AVX512BF16__)
        if (rows == 8) {
          dequant_group_bf16<BITS>(wb, sc, g, b, K, yg + b * QB);
          continue;
        }
#endif
        float d[SUB][8], m[SUB][8];
        for (int h = 0; h < SUB; ++h) {
          const auto dv = sc.dp(g, b, h);
          const auto mv = sc.mp(g, b, h);  // not read without offsets
          for (int j = 0; j < 8; ++j) {
            d[h][j] = static_cast<float>(dv[j]);
            m[h][j] = SC::offsets ? static_cast<float>(mv[j]) : 0.f;
          }
        }
        for_each_code<BITS>(wb, sc.table, [&](int j, int k, int c) {
          const int h = SUB == 2 && k >= 16;
          v[j][k] = static_cast<float>(c) * d[h][j] + m[h][j];
        });
        for (int64_t r = 0; r < rows; ++r) store_row(v[r], yg + r * K + b * QB, QB);
      }
    }
  });
}

#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define PAGEDLLM_QNEON 1
inline float32x4_t load4(const float* p) { return vld1q_f32(p); }
inline float32x4_t load4(const at::Half* p) {
  return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))));
}
inline float32x4_t load4(const SPtr& p) {
  return p.half() ? load4(static_cast<const at::Half*>(p.p)) : load4(static_cast<const float*>(p.p));
}
template <typename P>
inline float32x4_t load4(const OffPtr<P>& p) { return vmulq_n_f32(load4(p.d), -p.zero); }
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
  const bool tab = sc.table != nullptr;
  const uint8x16_t tbl = tab ? vld1q_u8(sc.table) : vdupq_n_u8(0);
  auto look = [&](uint8x16_t c) { return vreinterpretq_s8_u8(tab ? vqtbl1q_u8(tbl, c) : c); };
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* xq = xa.q.data() + row * K + b * QB;
    const int8_t* xq2 = xa.q2.data() + row * K + b * QB;
    const uint8_t* wb = wg + b * gbytes;
    int32x4_t h0 = vdupq_n_s32(0), h1 = h0, l0 = h0, l1 = h0;
    auto bcast = [](const int8_t* p) { return vreinterpretq_s8_s32(vdupq_n_s32(load_i32(p))); };
    if constexpr (BITS == 4) {
      for (int i = 0; i < 4; ++i) {  // vector i: unit i in the low nibbles, unit 4+i in the high ones
        const uint8x16_t v0 = vld1q_u8(wb + 32 * i), v1 = vld1q_u8(wb + 32 * i + 16);
        const int8x16_t ul0 = look(vandq_u8(v0, low4)), ul1 = look(vandq_u8(v1, low4));
        const int8x16_t uh0 = look(vshrq_n_u8(v0, 4)), uh1 = look(vshrq_n_u8(v1, 4));
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
    acc0 = vfmaq_f32(acc0, vcvtq_f32_s32(vmlaq_n_s32(l0, h0, xa.level())), vmulq_n_f32(load4(dv), sx));
    acc1 = vfmaq_f32(acc1, vcvtq_f32_s32(vmlaq_n_s32(l1, h1, xa.level())), vmulq_n_f32(load4(dv + 4), sx));
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
// of groups by ZMT rows, otherwise GT groups by MT rows. Fewer than TILE_MIN_ROWS rows (decode) run one group at a
// time: that streams the weights in three sequential streams (codes, scales, offsets; two without offsets), which
// read faster from memory than wider tiles' many streams (4-bit codes with 512-bit VNNI: qrow512, one group too).
#if defined(PAGEDLLM_QZMM)
constexpr int ZPT = 2, ZMT = 3;
// rows from which the tiles run (fewer: one group at a time, row by row): with 512-bit VNNI two rows already
// share a tile of pairs of groups (the 1.5B's decode step: 76-79 ms row by row, one row 55-62, three rows 61-67)
constexpr int64_t TILE_MIN_ROWS = 2;
#else
constexpr int64_t TILE_MIN_ROWS = 3;
#endif
#if defined(__AVX512VL__)
constexpr int TILE_GT = 2, TILE_MT = 3;
#else
constexpr int TILE_GT = 1, TILE_MT = 3;
#endif
// rows per sweep of the groups (a multiple of the row tiles): 17% faster than one sweep of all rows at 512-2048 rows
// (prefill), the same up to 64
constexpr int64_t ROW_CHUNK = 48;
#if defined(PAGEDLLM_QAMX)
static_assert(ROW_CHUNK % AMX_ROWS == 0, "a chunk's AMX tiles must start at a multiple of 16 rows (xa's padding)");
#endif

template <int BITS, typename SC>
void qlinear_impl(const Rows& x, int64_t M, int64_t K, const uint8_t* w, const SC& sc, int64_t N, const Rows& y,
                  int levels) {
  const int64_t nb = K / QB, NG = (N + 7) / 8, gstride = nb * BITS * 32;
  QuantizedRows xa;
#if defined(PAGEDLLM_QAMX)
  const bool amx = M >= AMX_MIN_ROWS && pagedllm::amx_enabled();
  const int64_t padded = amx ? (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS : 0;
#else
  const int64_t padded = 0;
#endif
  if (x.bf16)
    quantize_rows(static_cast<const at::BFloat16*>(x.p), M, K, xa, padded, levels);
  else
    quantize_rows(static_cast<const float*>(x.p), M, K, xa, padded, levels);
#if defined(__AVX2__) && defined(__FMA__)
  // Rows go in chunks of ROW_CHUNK: a chunk's activations (2 bytes per input) stay in L2 while weights pass,
  // instead of all M rows streaming past every tile of groups.
  auto groups = [&](int64_t r0, int64_t r1, int64_t begin, int64_t end) {
#if defined(PAGEDLLM_QAMX)
    if (amx && r1 - r0 >= AMX_MIN_ROWS)  // a short last chunk: the VNNI tiles (bitwise the same results)
      return qrun_amx<BITS, ROW_CHUNK>(w, sc, begin, end, gstride, xa, r0, r1, K, nb, N, y);
#endif
    int64_t g = begin;
    if (r1 - r0 >= TILE_MIN_ROWS) {
#if defined(PAGEDLLM_QZMM)
      for (; g + 2 * ZPT <= end; g += 2 * ZPT)
        qtile512_rows<BITS, ZPT, ZMT>(w, sc, g, gstride, xa, r0, r1, K, nb, N, y,
                                      std::min<int64_t>(2 * ZPT, NG - g - 2 * ZPT));
      for (; g + 2 <= end; g += 2) qtile512_rows<BITS, 1, ZMT>(w, sc, g, gstride, xa, r0, r1, K, nb, N, y);
#else
      for (; g + TILE_GT <= end; g += TILE_GT)
        qtile_rows<BITS, TILE_GT, TILE_MT>(w, sc, g, gstride, xa, r0, r1, K, nb, N, y);
#endif
    }
    if constexpr (BITS == 8 && SC::sub == 2) {
      // decode rows on 8-bit codes with a scale per 16 inputs (GGUF Q6_K, the Q4_K_M files' LM head and half their
      // down projections): two groups a tile. One group's chain of 4 products per half block, then its float step,
      // is latency-bound; with a scale per 32 the single group streams faster, as the tile shapes' comment says
      // (docs/benchmarks.md, Zen 4). With 512-bit VNNI the two groups share each vector (qtile512, one pair): the
      // 1.5B's head at one row 9.6 -> 8.5 ms, its Q6_K down projections 7% faster than on two 256-bit vectors
      // (ab_decode_linears, Zen 4); Q8_0's scale per 32 ran slower in pairs there too, so it keeps one group. (With
      // 512-bit VNNI a GGUF file's Q6_K codes are packed in 6 bits now: qrow512.)
      if (r1 - r0 < TILE_MT) {
#if defined(PAGEDLLM_QZMM)
        for (; g + 2 <= end; g += 2) qtile512_rows<BITS, 1, ZMT>(w, sc, g, gstride, xa, r0, r1, K, nb, N, y);
#else
        for (; g + 2 <= end; g += 2) qtile_rows<BITS, 2, TILE_MT>(w, sc, g, gstride, xa, r0, r1, K, nb, N, y);
#endif
      }
    }
#if defined(PAGEDLLM_QZMM)
    if constexpr (BITS != 8) {
      if (r1 - r0 == 1 && sc.table == nullptr) {  // one row: qrow512 (a table's codes: qtile's byte shuffle)
        float res[8];
        for (; g < end; ++g) {
          _mm256_storeu_ps(res, qrow512<BITS>(w + g * gstride, sc, g, xa, r0, K, nb));
          store_group(y, r0, N, 8 * g, res);
        }
      }
    }
#endif
    for (; g < end; ++g) qtile_rows<BITS, 1, TILE_MT>(w, sc, g, gstride, xa, r0, r1, K, nb, N, y);
  };
  if (M < TILE_MIN_ROWS) {
    // fewer rows than a tile stream the weights from memory: each thread takes one contiguous half (claimed runs
    // broke the streams and the prefetch-ahead)
    at::parallel_for(0, NG, 8, [&](int64_t begin, int64_t end) { groups(0, M, begin, end); });
  } else {
    // row tiles are compute-bound: threads claim (row chunk, run of 4 groups) items, row chunk by row chunk, so both
    // threads share a chunk's activations while the weights pass and the last runs balance
    constexpr int64_t RUN = 4;
    const int64_t runs = (NG + RUN - 1) / RUN, chunks = (M + ROW_CHUNK - 1) / ROW_CHUNK;
    // a claim is an atomic add on a line both cores write: 1/16 of a thread's share per claim (one item per claim
    // spent ~3.5% of a prefill step of ~2040 rows x 128 runs in the claims' lock xadd, and the threads took
    // alternate runs instead of streaming their weights in order); at least one item, so a decode step's small
    // linears (a few dozen runs) still balance
    const int64_t items = chunks * runs, per = std::max<int64_t>(1, items / (16 * at::get_num_threads()));
    parallel_claims(items, per, [&](int64_t begin, int64_t end) {
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
        if constexpr (SC::sub == 1 && (BITS == 4 || BITS == 8))
          qgroup_neon<BITS>(w + g * gstride, sc, g, xa, r, K, nb, res);
        else qgroup_scalar<BITS>(w + g * gstride, sc, g, xa, r, K, nb, res);  // blocks of 16, 5/6-bit: portable
#else
        qgroup_scalar<BITS>(w + g * gstride, sc, g, xa, r, K, nb, res);
#endif
        store_group(y, r, N, 8 * g, res);
      }
  });
#endif
}

template <typename SC> constexpr bool table_scales = false;  // TScales: only 4-bit codes through a table
template <int WIDTH> constexpr bool table_scales<TScales<WIDTH>> = true;

// Calls f with std::integral_constant<int, 4> for 4-bit codes (only with offsets: SC::offsets), <int, 5> / <int, 6>
// for the 5- / 6-bit layouts, else <int, 8>; TScales (offsets implied by a table's zero) only with <int, 4> (no
// 8-bit kernels are built for them).
template <typename SC, typename F>
void with_bits(int64_t bits, F&& f) {
  if constexpr (table_scales<SC>) {
    TORCH_CHECK(bits == 4, "qlinear: offsets implied by a table's zero are for 4-bit codes");
    f(std::integral_constant<int, 4>{});
  } else {
    if constexpr (SC::offsets) {
      if (bits == 4) return f(std::integral_constant<int, 4>{});
    }
    if (bits == 5) return f(std::integral_constant<int, 5>{});
    if (bits == 6) return f(std::integral_constant<int, 6>{});
    f(std::integral_constant<int, 8>{});
  }
}

// Runs qlinear_impl for the scales layout `sc` (QScales or KScales) on x's dtype; levels: of the activations (1: 8-bit,
// 2: ~15-bit, see QuantizedRows; 0: bfloat16, on the bfloat16 tiles, qlinear_amx.h).
template <typename SC>
void qlinear_run(const at::Tensor& x, const at::Tensor& w, int64_t bits, int64_t N, const SC& sc, at::Tensor& y,
                 int64_t levels) {
  TORCH_CHECK(levels == 0 || levels == 1 || levels == 2,
              "qlinear: activation levels must be 0 (bfloat16 tiles), 1 (8-bit) or 2, got ", levels);
  TORCH_CHECK(levels != 0 || pagedllm::bf16_tiles_enabled(),
              "qlinear: levels 0 (bfloat16 tiles) needs AMX-BF16, built in and granted (see bf16_tiles())");
  const int64_t M = x.size(0), K = x.size(1);
  const int lv = static_cast<int>(levels);
  const Rows xr = rows_of(x), yr = rows_of(y);
  with_bits<SC>(bits, [&](auto bits_tag) {
    constexpr int BITS = decltype(bits_tag)::value;
#if defined(PAGEDLLM_QAMX_BF16)
    if (lv == 0)
      return dispatch_float_bf16(x.scalar_type(), "qlinear", [&](auto tag) {
        using T = decltype(tag);
        qlinear_bf16_tiles<BITS, T>(x.data_ptr<T>(), M, K, w.data_ptr<uint8_t>(), sc, N, y.data_ptr<T>());
      });
#endif
    qlinear_impl<BITS>(xr, M, K, w.data_ptr<uint8_t>(), sc, N, yr, lv);
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

void check_weight(const at::Tensor& w, int64_t bits, int64_t N, int64_t K) {
  check_cpu(w, "w");
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "qlinear: bits must be 4, 5, 6 or 8");
  TORCH_CHECK(K % QB == 0, "qlinear: in_features ", K, " is not a multiple of 32");
  TORCH_CHECK(N >= 1, "qlinear: out_features must be >= 1");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 2 && w.size(0) == (N + 7) / 8 &&
                  w.size(1) == K / QB * bits * 32, "qlinear: weight must be contiguous uint8 (ceil(N/8), K*bits)");
}

void check_qlinear(const at::Tensor& x, const at::Tensor& w, int64_t bits, int64_t N) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "qlinear: x must be contiguous (M, K)");
  check_weight(w, bits, N, x.size(1));
}

// The inputs K of a weight w decoded by qweight_bf16 / qweight_k_bf16, w checked as qlinear checks it.
int64_t decoded_weight_inputs(const at::Tensor& w, int64_t bits, int64_t N) {
  TORCH_CHECK(w.dim() == 2 && (bits == 4 || bits == 5 || bits == 6 || bits == 8),
              "qweight_bf16: w must be (ceil(N/8), K*bits), bits 4, 5, 6 or 8");
  const int64_t K = w.size(1) / bits;
  check_weight(w, bits, N, K);
  return K;
}

// The weight rows 8 g0 .. min(8 g1, N) - 1 as bfloat16 (dequant_bf16) for the scales layout `sc`; K: w's inputs.
template <typename SC>
at::Tensor dequant_run(const at::Tensor& w, int64_t bits, int64_t N, int64_t K, const SC& sc, int64_t g0, int64_t g1) {
  TORCH_CHECK(0 <= g0 && g0 < g1 && g1 <= (N + 7) / 8, "qweight_bf16: groups [", g0, ", ", g1, ") outside [0, ",
              (N + 7) / 8, ")");
  auto y = at::empty({std::min(8 * g1, N) - 8 * g0, K}, w.options().dtype(at::kBFloat16));
  with_bits<SC>(bits, [&](auto bits_tag) {
    dequant_bf16<decltype(bits_tag)::value>(w.data_ptr<uint8_t>(), sc, g0, g1, K, N, y.data_ptr<at::BFloat16>());
  });
  return y;
}

}  // namespace
