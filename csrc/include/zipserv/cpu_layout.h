// The CPU byte-split layout: constants and index maps, mirrored from
// docs/FORMAT.md, appendix A ("CPU byte-split layout"). Its Python twin is
// zipserv_vllm/format/cpu_layout.py; tests/test_spec_agreement.py compares the
// two through zipserv_vllm._cpu_gemm.layout_constants().
//
// This layout is never written to disk: the CPU fast path repacks a TCA-TBE v1
// (or BF16) matrix into it once, at load time, because its decode is a few
// byte shuffles per 32 weights instead of v1's bit-plane expansion (docs/CPU.md).
// Per 64 x 64 tile (the same tile grid as v1, FTs in v1's order), a record of
// 64 FT records of 96 bytes, FT f at byte 96 f:
//   * bytes 0..63: the low bytes of the BF16 patterns (position p = 8 row + col);
//   * bytes 64..95: 4-bit codes: byte 64 + 16 h + j holds the code of position
//     32 h + j (low nibble) and of position 32 h + 16 + j (high nibble);
// plus a 16-entry table per tile: code -> high byte (sign, exponent bits 7..1);
//   * exceptions: elements whose high byte is not in the table, as
//     (d << 8 | high byte) with d = 64 f + p, ascending in d.
#pragma once

#include <cstdint>

#include "zipserv/format.h"

namespace zipserv {
namespace cpu {

constexpr int kPkLoBytes = kFragElems;                     // 64 low bytes per FT record
constexpr int kPkCodeBytes = kFragElems / 2;               // 32 code bytes per FT record
constexpr int kPkFtBytes = kPkLoBytes + kPkCodeBytes;      // 96
constexpr int kPkTileBytes = kFragsPerTile * kPkFtBytes;   // 6144 per tile record
constexpr int kPkLutEntries = 16;
constexpr int kPkExcShift = 8;                             // entry = d << 8 | hi
constexpr uint8_t kPkPadLo = 0;                            // padding element: low byte 0, code 0

// Byte offsets within a tile record of FT f's position p: its low byte, and
// the byte and nibble (0 low, 1 high) holding its code.
ZS_HD int pk_lo_byte(int f, int p) { return f * kPkFtBytes + p; }
ZS_HD int pk_code_byte(int f, int p) { return f * kPkFtBytes + kPkLoBytes + (p >> 5) * 16 + (p & 15); }
ZS_HD int pk_code_nibble(int p) { return (p >> 4) & 1; }

}  // namespace cpu
}  // namespace zipserv
