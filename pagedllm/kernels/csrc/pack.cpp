// Loading a GGUF file's blocks into qlinear's layout at memory speed: the per-weight steps of a start-up (a 1.5B
// model's 1.5 G codes) in plain loops instead of numpy/torch passes with their temporaries.
// - gguf_codes: a K-quant or Q5_0 tensor's codes, one byte per weight in input order, as quant/gguf_blocks.py's
//   decoders give them (4-bit codes in [0, 16); 8-bit ones as signed values: Q6_K q - 32, Q5_0 q - 16);
// - pack_codes: codes (rows, K) into the interleaved layout of qlinear.h (groups of 8 rows, 4-byte units; 4-bit codes
//   two to a byte, 8-bit ones as signed bytes).
// Both run single-threaded: the loader calls them from its own threads, one tensor each.
#include "common.h"
#include "ops.h"

namespace {

// Q4_K (144-byte blocks of 256): per 64 inputs 32 bytes of qs, low nibbles inputs 0-31, high nibbles 32-63
void q4_k_codes(const uint8_t* b, int64_t nblocks, uint8_t* out) {
  for (int64_t n = 0; n < nblocks; ++n, b += 144, out += 256) {
    const uint8_t* qs = b + 16;
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) {
        out[64 * j + l] = qs[32 * j + l] & 0x0F;
        out[64 * j + 32 + l] = qs[32 * j + l] >> 4;
      }
  }
}

// Q5_K (176 bytes): Q4_K's nibbles plus bit 4 of input 32 i + l from bit i of qh[l]
void q5_k_codes(const uint8_t* b, int64_t nblocks, uint8_t* out) {
  for (int64_t n = 0; n < nblocks; ++n, b += 176, out += 256) {
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) {
        out[64 * j + l] = (qs[32 * j + l] & 0x0F) | (((qh[l] >> (2 * j)) & 1) << 4);
        out[64 * j + 32 + l] = (qs[32 * j + l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4);
      }
  }
}

// Q6_K (210 bytes): per 128 inputs 64 bytes of ql (low 4 bits) and 32 of qh (2 high bits each), value q - 32
void q6_k_codes(const uint8_t* b, int64_t nblocks, int8_t* out) {
  for (int64_t n = 0; n < nblocks; ++n, b += 210, out += 256)
    for (int half = 0; half < 2; ++half) {
      const uint8_t *ql = b + 64 * half, *qh = b + 128 + 32 * half;
      int8_t* y = out + 128 * half;
      for (int l = 0; l < 32; ++l) {
        y[l] = static_cast<int8_t>(((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) - 32);
        y[l + 32] = static_cast<int8_t>(((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32);
        y[l + 64] = static_cast<int8_t>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
        y[l + 96] = static_cast<int8_t>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
      }
    }
}

// Q5_0 (22-byte blocks of 32): 4 bytes qh (bit i: bit 4 of input i), 16 bytes of nibbles (inputs i, 16 + i), q - 16
void q5_0_codes(const uint8_t* b, int64_t nblocks, int8_t* out) {
  for (int64_t n = 0; n < nblocks; ++n, b += 22, out += 32) {
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const uint8_t* qs = b + 6;
    for (int i = 0; i < 16; ++i) {
      out[i] = static_cast<int8_t>(((qs[i] & 0x0F) | (((qh >> i) & 1) << 4)) - 16);
      out[16 + i] = static_cast<int8_t>(((qs[i] >> 4) | (((qh >> (16 + i)) & 1) << 4)) - 16);
    }
  }
}

}  // namespace

namespace pagedllm {

at::Tensor gguf_codes(const uint8_t* b, int64_t nbytes, const std::string& kind) {
  struct Type { int block, bytes; bool is_signed; };
  Type t;
  if (kind == "Q4_K") t = {256, 144, false};
  else if (kind == "Q5_K") t = {256, 176, false};
  else if (kind == "Q6_K") t = {256, 210, true};
  else if (kind == "Q5_0") t = {32, 22, true};
  else TORCH_CHECK(false, "gguf_codes: no fast path for ", kind);
  TORCH_CHECK(nbytes % t.bytes == 0, "gguf_codes: ", nbytes, " bytes are not whole ", kind, " blocks");
  const int64_t nblocks = nbytes / t.bytes;
  auto out = at::empty({nblocks * t.block}, at::TensorOptions().dtype(t.is_signed ? at::kChar : at::kByte));
  if (kind == "Q4_K") q4_k_codes(b, nblocks, out.data_ptr<uint8_t>());
  else if (kind == "Q5_K") q5_k_codes(b, nblocks, out.data_ptr<uint8_t>());
  else if (kind == "Q6_K") q6_k_codes(b, nblocks, out.data_ptr<int8_t>());
  else q5_0_codes(b, nblocks, out.data_ptr<int8_t>());
  return out;
}

at::Tensor pack_codes(const at::Tensor& codes, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "pack_codes: bits must be 4 or 8");
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.dim() == 2 && codes.size(0) % 8 == 0 && codes.size(1) % 32 == 0,
              "pack_codes: codes must be contiguous uint8 (a multiple of 8 rows, of 32 inputs)");
  const int64_t rows = codes.size(0), K = codes.size(1), ng = rows / 8, nb = K / 32, gbytes = bits * 32;
  auto out = at::empty({ng, nb * gbytes}, codes.options());
  const uint8_t* c = codes.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  for (int64_t g = 0; g < ng; ++g)
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* dst = o + (g * nb + b) * gbytes;
      for (int r = 0; r < 8; ++r) {
        const uint8_t* src = c + (g * 8 + r) * K + b * 32;
        if (bits == 4) {  // byte (unit i, row, t) = code 4i + t | code 16 + 4i + t << 4, units 0-3
          for (int i = 0; i < 4; ++i)
            for (int t = 0; t < 4; ++t) dst[32 * i + 4 * r + t] = (src[4 * i + t] & 0x0F) | (src[16 + 4 * i + t] << 4);
        } else {  // byte (unit i, row, t) = code 4i + t as a signed byte (stored + 128: its sign bit flipped)
          for (int i = 0; i < 8; ++i)
            for (int t = 0; t < 4; ++t) dst[32 * i + 4 * r + t] = src[4 * i + t] ^ 0x80;
        }
      }
    }
  return out;
}

}  // namespace pagedllm
