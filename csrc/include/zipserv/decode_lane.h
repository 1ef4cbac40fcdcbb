// The per-lane decode of TCA-TBE v1 (docs/FORMAT.md section 5), as one
// __host__ __device__ function used by every CUDA kernel (csrc/cuda/); the
// SIMT harness runs those kernels on the CPU (tests/simt/).
//
// In the mma.m16n8k16 A fragment, lane l of a warp holds the two elements at
// positions p = 2l and p + 1 of an 8x8 FragTile (row l / 4, columns 2 (l % 4)
// and 2 (l % 4) + 1). decode_lane_pair() rebuilds those two BF16 patterns from
// the FT's three bit-planes and the value streams, using one popcount and no
// data-dependent branch: both the sign-mantissa byte and the fallback pattern
// are loaded and the right one is selected.
//
// Because both loads always happen, each of `sm` and `fb` may be read ONE
// element past the last element the FT actually uses. Callers stage the
// segments with slack (csrc/cuda/zipgemm_layout.cuh: kSmSlack, kFbSlack);
// a test uses the same staging.
#pragma once

#include <cstdint>

#include "zipserv/format.h"

namespace zipserv {

ZS_HD int popc64(uint64_t x) {
#if defined(__CUDA_ARCH__)
  return __popcll(x);
#else
  return __builtin_popcountll(x);
#endif
}

// The indicator word of an FT: bit p set for high-frequency elements.
ZS_HD uint64_t indicator(uint64_t p0, uint64_t p1, uint64_t p2) { return p0 | p1 | p2; }

// 3-bit code of position p.
ZS_HD unsigned code_at(uint64_t p0, uint64_t p1, uint64_t p2, int p) {
  return static_cast<unsigned>(((p0 >> p) & 1u) | (((p1 >> p) & 1u) << 1) | (((p2 >> p) & 1u) << 2));
}

// Decode positions p = 2 * lane and p + 1 of one FT.
//
//   p0, p1, p2   the FT's bit-planes (bit p of plane b = bit b of the code)
//   base_exp     the tile's base exponent
//   sm, fb       staged value streams
//   h_before     high-frequency elements before this FT in the order the
//                caller staged (so sm[h_before] is this FT's first sm byte)
//   f_before     fallback elements before this FT in that order
//   lane         0..31
//
// Returns the two BF16 patterns packed as (p + 1) << 16 | p, i.e. the
// bf16x2 register of the A fragment (low half = lower column).
ZS_HD uint32_t decode_lane_pair(uint64_t p0, uint64_t p1, uint64_t p2, int base_exp,
                                const uint8_t* sm, const uint16_t* fb,
                                int h_before, int f_before, int lane) {
  const int p = 2 * lane;
  const uint64_t ind = indicator(p0, p1, p2);
  const uint64_t below = ind & ((uint64_t{1} << p) - 1u);  // p <= 62
  const int hb = popc64(below);
  const int h0 = h_before + hb;           // sm index of position p
  const int l0 = f_before + (p - hb);     // fb index of position p
  const unsigned i0 = static_cast<unsigned>((ind >> p) & 1u);
  const unsigned i1 = static_cast<unsigned>((ind >> (p + 1)) & 1u);
  const int h1 = h0 + static_cast<int>(i0);
  const int l1 = l0 + 1 - static_cast<int>(i0);
  const uint16_t hv0 = assemble(sm[h0], base_exp, static_cast<int>(code_at(p0, p1, p2, p)));
  const uint16_t hv1 = assemble(sm[h1], base_exp, static_cast<int>(code_at(p0, p1, p2, p + 1)));
  const uint16_t fv0 = fb[l0];
  const uint16_t fv1 = fb[l1];
  const uint32_t v0 = i0 ? hv0 : fv0;     // selects, not branches
  const uint32_t v1 = i1 ? hv1 : fv1;
  return v0 | (v1 << 16);
}

}  // namespace zipserv
