// Loading a GGUF file's blocks into qlinear's layout at memory speed: the per-weight steps of a start-up (a 1.5B
// model's 1.5 G codes) in plain loops instead of numpy/torch passes with their temporaries.
// - gguf_codes: a tensor's codes, one byte per weight in input order, in the form quant/gguf_blocks.py's decoders
//   store them (4-bit codes in [0, 16); 8-bit ones as their signed value + 128: Q6_K q - 32, Q5_0 q - 16, Q8_0 q),
//   written into the caller's array (the whole tensor's, so no chunk is copied twice);
// - gguf_k_scales: Q4_K / Q5_K's eight 6-bit sub-block scales and eight 6-bit mins per super-block;
// - pack_parts: the rows of one or more parts (fused q/k/v, gate/up: no concatenated copy), each either codes or a
//   GGUF tensor's raw blocks (decoded 8 rows at a time into a scratch in cache: a start-up writes no code array of a
//   byte per weight), into the interleaved layout of qlinear.h (groups of 8 rows, 4-byte units; 4-bit codes two to
//   a byte, 8-bit ones as signed bytes, or, where every code is in [-16, 16) or [-32, 32), the 5- or 6-bit layout:
//   4-bit nibbles and planes of the high bits).
// All run single-threaded: the loader calls them from its own threads, one tensor each. The inner steps move 4 or
// 8 bytes at a time (SWAR), which every target compiles to the same results.
#include <cstring>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common.h"
#include "ops.h"

namespace {

using pagedllm::BlockType;

constexpr uint64_t LOW4 = 0x0F0F0F0F0F0F0F0FULL, HIGH1 = 0x8080808080808080ULL;

inline uint64_t load8(const uint8_t* p) { uint64_t v; std::memcpy(&v, p, 8); return v; }
inline void store8(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }
inline uint32_t load4(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
inline void store4(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

// n bytes of nibbles: low nibbles to lo[0..n), high ones to hi[0..n) (n a multiple of 8)
inline void split_nibbles(const uint8_t* q, int n, uint8_t* lo, uint8_t* hi) {
  for (int l = 0; l < n; l += 8) {
    const uint64_t v = load8(q + l);
    store8(lo + l, v & LOW4);
    store8(hi + l, (v >> 4) & LOW4);
  }
}

// Q4_0 / Q4_1 (blocks of 32: 16 bytes of nibbles after `head` bytes of scales; inputs i and 16 + i)
void q4_01_codes(const uint8_t* b, int64_t nblocks, int bytes, int head, uint8_t* out) {
  for (int64_t n = 0; n < nblocks; ++n, b += bytes, out += 32) split_nibbles(b + head, 16, out, out + 16);
}

// Q4_K (144-byte blocks of 256): per 64 inputs 32 bytes of qs, low nibbles inputs 0-31, high nibbles 32-63
void q4_k_codes(const uint8_t* b, int64_t nblocks, uint8_t* out) {
  for (int64_t n = 0; n < nblocks; ++n, b += 144, out += 256)
    for (int j = 0; j < 4; ++j) split_nibbles(b + 16 + 32 * j, 32, out + 64 * j, out + 64 * j + 32);
}

// Q5_K (176 bytes): Q4_K's nibbles plus bit 4 of input 32 i + l from bit i of qh[l]; stored + 128
void q5_k_codes(const uint8_t* b, int64_t nblocks, uint8_t* out) {
  for (int64_t n = 0; n < nblocks; ++n, b += 176, out += 256) {
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; l += 8) {
        const uint64_t v = load8(qs + 32 * j + l), h = load8(qh + l);
        store8(out + 64 * j + l, ((v & LOW4) | (((h >> (2 * j)) & 0x0101010101010101ULL) << 4)) ^ HIGH1);
        store8(out + 64 * j + 32 + l, (((v >> 4) & LOW4) | (((h >> (2 * j + 1)) & 0x0101010101010101ULL) << 4)) ^ HIGH1);
      }
  }
}

// Q6_K (210 bytes): per 128 inputs 64 bytes of ql (low 4 bits) and 32 of qh (2 high bits each), value q - 32;
// stored q - 32 + 128 = q + 96 (q < 64: no carry between bytes)
void q6_k_codes(const uint8_t* b, int64_t nblocks, uint8_t* out) {
  constexpr uint64_t THREE = 0x0303030303030303ULL, BIAS = 0x6060606060606060ULL;
  for (int64_t n = 0; n < nblocks; ++n, b += 210, out += 256)
    for (int half = 0; half < 2; ++half) {
      const uint8_t *ql = b + 64 * half, *qh = b + 128 + 32 * half;
      uint8_t* y = out + 128 * half;
      for (int l = 0; l < 32; l += 8) {
        const uint64_t a = load8(ql + l), c = load8(ql + 32 + l), h = load8(qh + l);
        store8(y + l, ((a & LOW4) | ((h & THREE) << 4)) + BIAS);
        store8(y + 32 + l, ((c & LOW4) | (((h >> 2) & THREE) << 4)) + BIAS);
        store8(y + 64 + l, (((a >> 4) & LOW4) | (((h >> 4) & THREE) << 4)) + BIAS);
        store8(y + 96 + l, (((c >> 4) & LOW4) | (((h >> 6) & THREE) << 4)) + BIAS);
      }
    }
}

// Q5_0 (22-byte blocks of 32): 4 bytes qh (bit i: bit 4 of input i), 16 bytes of nibbles (inputs i, 16 + i);
// value q - 16, stored q + 112
void q5_0_codes(const uint8_t* b, int64_t nblocks, uint8_t* out) {
  for (int64_t n = 0; n < nblocks; ++n, b += 22, out += 32) {
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const uint8_t* qs = b + 6;
    for (int i = 0; i < 16; ++i) {
      out[i] = static_cast<uint8_t>(((qs[i] & 0x0F) | (((qh >> i) & 1) << 4)) + 112);
      out[16 + i] = static_cast<uint8_t>(((qs[i] >> 4) | (((qh >> (16 + i)) & 1) << 4)) + 112);
    }
  }
}

// Q8_0 (34-byte blocks of 32): float16 scale, 32 signed bytes; stored with the sign bit flipped (+ 128)
void q8_0_codes(const uint8_t* b, int64_t nblocks, uint8_t* out) {
  for (int64_t n = 0; n < nblocks; ++n, b += 34, out += 32)
    for (int l = 0; l < 32; l += 8) store8(out + l, load8(b + 2 + l) ^ HIGH1);
}

// 4 stored 8-bit codes (s + 128) as u = s + 2^(BITS-1) (no carry between bytes: each byte's low 7 bits plus 16 or
// 32 stay below 256, its top bit is xor'd back); s fits BITS signed bits exactly when u < 2^BITS.
template <int BITS>
inline uint32_t narrow(uint32_t v) {
  const uint32_t s = v ^ 0x80808080u;
  return ((s & 0x7F7F7F7Fu) + (1u << (BITS - 1)) * 0x01010101u) ^ (s & 0x80808080u);
}

// groups of 8 rows (row pointers `row`) into the interleaved layout: per block of 32 inputs, byte (unit i, row r,
// t) = 4-bit: code 4i + t | code 16 + 4i + t << 4 (units 0-3); 8-bit: code 4i + t as a signed byte (stored + 128:
// its sign bit flipped; units 0-7); 5-bit (qlinear.h): the 4-bit layout of u = s + 16, then byte (r, t) of their
// bits 4, unit i's at bit i; 6-bit: of u = s + 32, then two such bytes of bits 4-5, unit 4v + k's at bits 2k, 2k+1
// of the v-th. Returns the or of every 5- or 6-bit u (a bit above BITS - 1 set: a code that does not fit).
template <int BITS>
uint32_t pack_groups(const uint8_t* const* row, int64_t ng, int64_t nb, uint8_t* out) {
  constexpr int64_t GBYTES = BITS * 32;
  uint32_t seen = 0;
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* src[8];
    for (int r = 0; r < 8; ++r) src[r] = row[g * 8 + r];
    uint8_t* dst = out + g * nb * GBYTES;
    for (int64_t b = 0; b < nb; ++b, dst += GBYTES) {
      for (int r = 0; r < 8; ++r) {
        const uint8_t* s = src[r] + b * 32;
        if constexpr (BITS == 4) {
          for (int h = 0; h < 2; ++h) {
            const uint64_t v = (load8(s + 8 * h) & LOW4) | ((load8(s + 16 + 8 * h) & LOW4) << 4);
            store4(dst + 32 * (2 * h) + 4 * r, static_cast<uint32_t>(v));
            store4(dst + 32 * (2 * h + 1) + 4 * r, static_cast<uint32_t>(v >> 32));
          }
        } else if constexpr (BITS == 5 || BITS == 6) {
          uint32_t pl = 0, ph = 0;  // bytes t: the high bits of units 0-3 and 4-7 (5-bit: all in pl)
          for (int i = 0; i < 4; ++i) {  // units i and 4 + i
            const uint32_t lo = narrow<BITS>(load4(s + 4 * i)), hi = narrow<BITS>(load4(s + 16 + 4 * i));
            seen |= lo | hi;
            store4(dst + 32 * i + 4 * r, (lo & 0x0F0F0F0Fu) | (hi & 0x0F0F0F0Fu) << 4);
            if constexpr (BITS == 5) {
              pl |= ((lo >> 4) & 0x01010101u) << i | ((hi >> 4) & 0x01010101u) << (4 + i);
            } else {
              pl |= ((lo >> 4) & 0x03030303u) << (2 * i);
              ph |= ((hi >> 4) & 0x03030303u) << (2 * i);
            }
          }
          store4(dst + 128 + 4 * r, pl);
          if constexpr (BITS == 6) store4(dst + 160 + 4 * r, ph);
        } else {
          for (int i = 0; i < 8; ++i) store4(dst + 32 * i + 4 * r, load4(s + 4 * i) ^ 0x80808080u);
        }
      }
    }
  }
  return seen;
}

// A GGUF block type as Python's table hands it over (pagedllm/gguf_file.py BLOCK_TYPES, ``kernel_type``): its
// decoder here, and values, bytes and code bits per block. Each decoder knows its own layout: a row that disagrees
// with it is refused before a byte is read.
void check_type(const BlockType& t, const char* op) {
  static constexpr int64_t LAYOUT[][3] = {{0, 0, 0},      {32, 18, 4},  {32, 20, 4},  {256, 144, 4},
                                          {256, 176, 8}, {256, 210, 8}, {32, 22, 8},  {32, 34, 8}};
  TORCH_CHECK(t.decoder > 0 && t.decoder < 8, op, ": no one-pass decoder ", t.decoder);
  const int64_t* l = LAYOUT[t.decoder];
  TORCH_CHECK(t.block == l[0] && t.bytes == l[1] && t.bits == l[2], op, ": decoder ", t.decoder, " reads blocks of ",
              l[0], " values in ", l[1], " bytes giving ", l[2], "-bit codes, not ", t.block, " / ", t.bytes, " / ",
              t.bits);
}

// one row of a GGUF tensor (nblocks blocks of type t) into out, in gguf_codes' form
void decode_blocks(const BlockType& t, const uint8_t* b, int64_t nblocks, uint8_t* o) {
  switch (t.decoder) {
    case 1: q4_01_codes(b, nblocks, 18, 2, o); break;  // Q4_0
    case 2: q4_01_codes(b, nblocks, 20, 4, o); break;  // Q4_1
    case 3: q4_k_codes(b, nblocks, o); break;          // Q4_K
    case 4: q5_k_codes(b, nblocks, o); break;          // Q5_K
    case 5: q6_k_codes(b, nblocks, o); break;          // Q6_K
    case 6: q5_0_codes(b, nblocks, o); break;          // Q5_0
    default: q8_0_codes(b, nblocks, o);                // Q8_0 (7)
  }
}

// Map a new array's pages in one call before it is written (MADV_POPULATE_WRITE, Linux 5.14+): under a hypervisor a
// page fault per 4 KiB is a large part of a model's packing time. Elsewhere (or refused): the faults as before.
void populate(uint8_t* p, int64_t n) {
#if defined(__linux__)
  constexpr uintptr_t PAGE = 4096;
  const uintptr_t start = (reinterpret_cast<uintptr_t>(p) + PAGE - 1) & ~(PAGE - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(n)) & ~(PAGE - 1);
  if (end > start + (1 << 20)) madvise(reinterpret_cast<void*>(start), end - start, 23 /* MADV_POPULATE_WRITE */);
#else
  (void)p; (void)n;
#endif
}

// Drop the whole pages of [p, p + n) of a read-only file mapping from the resident set (MADV_DONTNEED: they stay in
// the page cache and read back from it if touched again). Packing the 1.5B's LM head (191 MB of Q6_K blocks into
// 250 MB) kept its file pages resident until the end: the start's peak was ~200 MB above its steady memory.
void drop_pages(const uint8_t* p, int64_t n) {
#if defined(__linux__)
  constexpr uintptr_t PAGE = 4096;
  const uintptr_t start = (reinterpret_cast<uintptr_t>(p) + PAGE - 1) & ~(PAGE - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(n)) & ~(PAGE - 1);
  if (end > start) madvise(reinterpret_cast<void*>(start), end - start, MADV_DONTNEED);
#else
  (void)p; (void)n;
#endif
}

}  // namespace

namespace pagedllm {

void gguf_codes(const uint8_t* b, int64_t nbytes, const BlockType& t, const at::Tensor& out) {
  check_type(t, "gguf_codes");
  TORCH_CHECK(nbytes % t.bytes == 0, "gguf_codes: ", nbytes, " bytes are not whole blocks of ", t.bytes);
  const int64_t nblocks = nbytes / t.bytes;
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kByte && out.is_contiguous() &&
                  out.numel() == nblocks * t.block,
              "gguf_codes: out must be a contiguous uint8 array of ", nblocks * t.block, " codes");
  decode_blocks(t, b, nblocks, out.data_ptr<uint8_t>());
}

at::Tensor gguf_k_scales(const uint8_t* b, int64_t nbytes, int64_t bytes) {
  TORCH_CHECK(bytes == 144 || bytes == 176, "gguf_k_scales: Q4_K or Q5_K blocks (144 or 176 bytes), not ", bytes);
  TORCH_CHECK(nbytes % bytes == 0, "gguf_k_scales: ", nbytes, " bytes are not whole blocks of ", bytes);
  const int64_t nblocks = nbytes / bytes;
  auto out = at::empty({nblocks, 16}, at::TensorOptions().dtype(at::kByte));
  uint8_t* o = out.data_ptr<uint8_t>();
  for (int64_t n = 0; n < nblocks; ++n, b += bytes, o += 16) {
    const uint8_t *d = b + 4, *m = b + 8, *md = b + 12;  // 12 bytes: sub-scales and mins of 6 bits
    for (int j = 0; j < 4; ++j) {
      o[j] = d[j] & 0x3F;
      o[4 + j] = (md[j] & 0x0F) | ((d[j] >> 2) & 0x30);
      o[8 + j] = m[j] & 0x3F;
      o[12 + j] = (md[j] >> 4) | ((m[j] >> 2) & 0x30);
    }
  }
  return out;
}

at::Tensor pack_parts(const std::vector<CodeSource>& parts, int64_t bits, int64_t K) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "pack_parts: bits must be 4, 5, 6 or 8");
  TORCH_CHECK(!parts.empty() && K > 0 && K % 32 == 0, "pack_parts: K must be a positive multiple of 32");
  // done: the part's rows packed so far; dropped: its bytes whose pages were dropped (drop)
  struct Src {
    const uint8_t* data;
    const BlockType* type;
    int64_t row_bytes;
    bool widen, drop;
    int64_t done, dropped;
  };
  std::vector<Src> src;
  std::vector<std::pair<int, int64_t>> row;  // each output row: its part and row within the part
  for (const auto& p : parts) {
    const BlockType* t = p.type.decoder == 0 ? nullptr : &p.type;  // decoder 0: the rows are codes already
    if (t != nullptr) check_type(*t, "pack_parts");
    const int64_t row_bytes = t == nullptr ? K : K / t->block * t->bytes;
    TORCH_CHECK(t == nullptr || K % t->block == 0, "pack_parts: K ", K, " is not whole blocks of ", t->block);
    TORCH_CHECK(p.nbytes == p.rows * row_bytes, "pack_parts: a part of ", p.rows, " rows has ", p.nbytes,
                " bytes, not ", p.rows * row_bytes);
    TORCH_CHECK(!p.widen || (t != nullptr && t->bits == 4 && bits != 4), "pack_parts: only raw blocks of 4-bit "
                "codes are widened, into an 8-bit (or 5-, 6-bit) layout");
    TORCH_CHECK(t == nullptr || t->bits == (bits == 5 || bits == 6 ? 8 : bits) || p.widen, "pack_parts: ",
                t == nullptr ? 0 : t->bits, "-bit codes in a ", bits,
                "-bit layout (4-bit codes in an 8-bit one must be widened)");
    for (int64_t i = 0; i < p.rows; ++i) row.emplace_back(static_cast<int>(src.size()), i);
    src.push_back({p.data, t, row_bytes, p.widen, p.drop, 0, 0});
  }
  const int64_t rows = static_cast<int64_t>(row.size()), ng = (rows + 7) / 8, nb = K / 32;
  constexpr int64_t DROP_GROUPS = 1024;  // groups of 8 rows between drops of a file's passed pages (~2-20 MB)
  std::vector<uint8_t> zero(K, bits == 4 ? 0 : 128), scratch(8 * K);
  uint32_t seen = 0;  // 5- and 6-bit: the or of every code u
  auto out = at::empty({ng, nb * bits * 32}, at::TensorOptions().dtype(at::kByte));
  uint8_t* o = out.data_ptr<uint8_t>();
  populate(o, out.numel());
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* ptr[8];
    for (int r = 0; r < 8; ++r) {
      const int64_t i = g * 8 + r;
      if (i >= rows) { ptr[r] = zero.data(); continue; }
      Src& s = src[row[i].first];
      const uint8_t* at = s.data + row[i].second * s.row_bytes;
      s.done = row[i].second + 1;
      if (s.type == nullptr) { ptr[r] = at; continue; }
      uint8_t* dst = scratch.data() + r * K;  // raw blocks decoded a row at a time, in cache
      decode_blocks(*s.type, at, K / s.type->block, dst);
      if (s.widen)  // 4-bit codes c in an 8-bit layer: stored c + 128 (c < 16: the sign bit set)
        for (int64_t l = 0; l < K; l += 8) store8(dst + l, load8(dst + l) | HIGH1);
      ptr[r] = dst;
    }
    if (bits == 4) pack_groups<4>(ptr, 1, nb, o + g * nb * 128);
    else if (bits == 5) seen |= pack_groups<5>(ptr, 1, nb, o + g * nb * 160);
    else if (bits == 6) seen |= pack_groups<6>(ptr, 1, nb, o + g * nb * 192);
    else pack_groups<8>(ptr, 1, nb, o + g * nb * 256);
    if ((g + 1) % DROP_GROUPS == 0 || g + 1 == ng) {  // the rows passed so far: their file pages are not read again
      for (Src& s : src) {
        if (s.drop && s.done * s.row_bytes > s.dropped) {
          drop_pages(s.data + s.dropped, s.done * s.row_bytes - s.dropped);
          s.dropped = s.done * s.row_bytes;
        }
      }
    }
  }
  TORCH_CHECK((seen & (bits == 5 ? 0xE0E0E0E0u : 0xC0C0C0C0u)) == 0, "pack_parts: a code outside [",
              bits == 5 ? -16 : -32, ", ", bits == 5 ? 16 : 32, ") in a ", bits, "-bit layout");
  return out;
}

}  // namespace pagedllm
