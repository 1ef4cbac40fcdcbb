// TCA-TBE format v1: the layout constants, mirrored from docs/FORMAT.md.
//
// This header is the single C++ definition of the format. Its Python twin is
// zipserv_vllm/format/spec.py; tests/test_spec_agreement.py compares the two
// through zipserv_vllm._C.format_constants(). It has no framework types and
// compiles as host code and as CUDA device code.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define ZS_HD __host__ __device__ __forceinline__
#else
#define ZS_HD inline
#endif

namespace zipserv {

constexpr int64_t kMagic = 0x5A535442;   // "ZSTB"
constexpr int64_t kVersion = 1;

constexpr int kTile = 64;                // a tile is kTile x kTile elements
constexpr int kTileElems = kTile * kTile;
constexpr int kFrag = 8;                 // a FragTile is kFrag x kFrag
constexpr int kFragElems = kFrag * kFrag;
constexpr int kFragsPerTile = kTileElems / kFragElems;   // 64
constexpr int kPlanes = 3;               // bit-planes of the 3-bit code
constexpr int kWindow = 7;               // exponents covered per tile
constexpr int kMinWindowStart = 1;       // exponent 0 is never coded
constexpr int kMaxWindowStart = 255 - kWindow + 1;       // 249
constexpr int kSmAlign = 16;             // sign-mantissa segment, bytes
constexpr int kFbAlign = 8;              // fallback segment, elements (16 bytes)
constexpr int kPadCode = 1;              // code of a padding element
constexpr uint8_t kPadSm = 0;            // its sign-mantissa byte
constexpr int kMetaLen = 6;              // zs_meta: magic, version, M, K, crc32, meta checksum (minor 1)
constexpr int kMetaLenMinor0 = 5;        // zs_meta of minor version 0 (no meta checksum)
constexpr int64_t kNoCrc = -1;

static_assert(kFragsPerTile == 64, "a tile holds 64 FragTiles");
constexpr int kTileBitmapBytes = kPlanes * kFragsPerTile * 8;  // first bytes of a tile checksum (zs_crc)
static_assert(kTileBitmapBytes == 1536, "3 bits per weight");

// FT index f inside a tile -> (row, col) of its top-left element in the tile.
ZS_HD int frag_row0(int f) { return (f / 16) * 16 + (f % 2) * 8; }
ZS_HD int frag_col0(int f) { return ((f / 4) % 4) * 16 + ((f % 4) / 2) * 8; }

ZS_HD int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// Number of tiles along a dimension of n elements (Mt for M, Kt for K).
ZS_HD int64_t tile_count(int64_t n) { return (n + kTile - 1) / kTile; }

// Segment lengths of a tile with H high-frequency elements.
ZS_HD int64_t sm_segment_len(int64_t h) { return round_up(h, kSmAlign); }
ZS_HD int64_t fb_segment_len(int64_t h) { return round_up(kTileElems - h, kFbAlign); }

// Rebuild the BF16 bits of a high-frequency element.
ZS_HD uint16_t assemble(uint8_t sm, int base_exp, int code) {
  return static_cast<uint16_t>(((sm & 0x80u) << 8) |
                               (static_cast<unsigned>(base_exp + code) << 7) |
                               (sm & 0x7Fu));
}

}  // namespace zipserv
