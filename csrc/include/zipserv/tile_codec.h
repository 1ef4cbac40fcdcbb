// TCA-TBE v1: encode and decode ONE 64 x 64 tile (or one 8 x 8 FragTile) on the CPU.
//
// Header-only, no framework types, so that any host kernel can reuse it: the
// native codec (csrc/codec.cpp) loops these functions over tiles with threads,
// and a fused decode-GEMM kernel can decode a tile (or an FT) into a small
// buffer right before multiplying it. Byte-level layout: docs/FORMAT.md.
//
// Two implementations of everything, byte-identical by construction and by test:
//   * portable scalar C++ (any architecture),
//   * x86-64 AVX2 + BMI2 + POPCNT, compiled with a per-function target attribute
//     so that a default -O3 build (no -march) contains it; pick it at run time
//     with best_isa() (it uses __builtin_cpu_supports).
//
// Decoding a tile (the usual entry point for a kernel):
//
//   zipserv::TileSrc t{planes, base, sm_stream + off_sm, fb_stream + off_fb};
//   zipserv::decode_tile(zipserv::best_isa(), t, out, ld);   // 64 x 64, padding included
//
// where `planes` points at the tile's 192 words ([3][64]: plane b of FT f at
// planes[b * 64 + f]). The AVX2 decoder may READ up to kSmReadSlack bytes past
// the tile's H sign-mantissa bytes (H = tile_high_count(planes)); use
// decode_tile_checked(), which validates the offsets against the stream lengths
// and copies a tile lacking that slack into a local buffer, when the tile may be
// the last one of its stream or the input is untrusted.
//
// One FT (8 x 8): ft_stream_starts(planes, f, &s0, &f0) gives where its values
// start inside the tile's segments, then decode_ft(isa, planes[f],
// planes[64 + f], planes[128 + f], base, t.sm + s0, t.fb + f0, out, ld).
// Encoding: encode_tile() (any corner size; it writes the padding itself).
// An Isa argument must be one this CPU runs (best_isa(), or Isa::kScalar).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "zipserv/format.h"

// ZS_NO_SIMD=1 builds the portable path only (what other architectures get).
#if !defined(ZS_NO_SIMD) && (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define ZS_HAVE_AVX2_PATH 1
#include <immintrin.h>
#define ZS_TARGET_AVX2 __attribute__((target("avx2,bmi,bmi2,popcnt")))
#else
#define ZS_HAVE_AVX2_PATH 0
#endif

namespace zipserv {

// Instruction sets a tile function can run with.
enum class Isa : int { kScalar = 0, kAvx2 = 1 };

// True when this CPU can run the AVX2 path (AVX2, BMI2 and POPCNT).
inline bool cpu_has_avx2() {
#if ZS_HAVE_AVX2_PATH
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2") &&
                         __builtin_cpu_supports("popcnt");
  return ok;
#else
  return false;
#endif
}

// The fastest Isa this CPU supports.
inline Isa best_isa() { return cpu_has_avx2() ? Isa::kAvx2 : Isa::kScalar; }

// Bytes the AVX2 decoder may read past a tile's H sign-mantissa bytes.
constexpr int kSmReadSlack = 16;
// Room the encoders need in their output buffers beyond the worst case
// (4096 sm bytes, 4096 fb elements): they store whole words past the end.
constexpr int kSmWriteSlack = 32;
constexpr int kFbWriteSlack = 16;

// One encoded tile, as a decoder sees it.
struct TileSrc {
  const uint64_t* planes;  // 192 words: plane b of FT f at planes[b * 64 + f]
  int base;                // base_exp (0..248)
  const uint8_t* sm;       // first byte of the tile's sign-mantissa segment
  const uint16_t* fb;      // first element of the tile's fallback segment
};

namespace detail {

inline int popcount64(uint64_t x) { return __builtin_popcountll(x); }
inline int ctz64(uint64_t x) { return __builtin_ctzll(x); }

inline uint64_t load_u64(const void* p) {
  uint64_t x;
  std::memcpy(&x, p, 8);
  return x;
}

inline uint64_t indicator(const uint64_t* planes, int f) {
  return planes[f] | planes[kFragsPerTile + f] | planes[2 * kFragsPerTile + f];
}

// 0xFF in byte i of entry m when bit i of m is set (pext/pdep byte masks).
struct ByteMasks {
  uint64_t v[256];
};
constexpr ByteMasks make_byte_masks() {
  ByteMasks t{};
  for (int m = 0; m < 256; ++m) {
    uint64_t x = 0;
    for (int i = 0; i < 8; ++i)
      if ((m >> i) & 1) x |= uint64_t{0xFF} << (8 * i);
    t.v[m] = x;
  }
  return t;
}
inline constexpr ByteMasks kByteMasks = make_byte_masks();

// The window of FORMAT.md section 3 from a 256-bin exponent histogram.
inline int base_from_hist(const uint32_t* hist) {
  uint32_t cover = 0;
  for (int e = kMinWindowStart; e < kMinWindowStart + kWindow; ++e) cover += hist[e];
  uint32_t best = cover;
  int best_start = kMinWindowStart;
  for (int s = kMinWindowStart + 1; s <= kMaxWindowStart; ++s) {
    cover += hist[s + kWindow - 1] - hist[s - 1];
    if (cover > best) {  // strict: the smallest start wins ties
      best = cover;
      best_start = s;
    }
  }
  return best_start - 1;
}

// Exponent histogram of a full 64 x 64 block (row stride ld elements).
// Four sub-tables break the store-to-load chains of repeated exponents.
inline int base_of_full_tile(const uint16_t* src, ptrdiff_t ld) {
  uint16_t h[4][256];
  std::memset(h, 0, sizeof(h));
  for (int r = 0; r < kTile; ++r) {
    const uint16_t* row = src + r * ld;
    for (int c = 0; c < kTile; c += 4) {
      uint64_t x = load_u64(row + c);
      ++h[0][(x >> 7) & 0xFF];
      ++h[1][(x >> 23) & 0xFF];
      ++h[2][(x >> 39) & 0xFF];
      ++h[3][(x >> 55) & 0xFF];
    }
  }
  uint32_t hist[256];
  for (int e = 0; e < 256; ++e) hist[e] = uint32_t{h[0][e]} + h[1][e] + h[2][e] + h[3][e];
  return base_from_hist(hist);
}

// Same over the valid rows x cols corner of a tile.
inline int base_of_partial_tile(const uint16_t* src, ptrdiff_t ld, int rows, int cols) {
  uint32_t hist[256] = {0};
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) ++hist[(src[r * ld + c] >> 7) & 0xFF];
  return base_from_hist(hist);
}

// Zero the segment padding after n sm bytes / n fb elements (FORMAT.md section 5).
inline void zero_sm_pad(uint8_t* sm, int h) { std::memset(sm + h, 0, kSmAlign); }
inline void zero_fb_pad(uint16_t* fb, int f) { std::memset(fb + f, 0, kFbAlign * sizeof(uint16_t)); }

}  // namespace detail

// H (high-frequency elements, padding included) of a tile.
inline int tile_high_count(const uint64_t* planes) {
  int h = 0;
  for (int f = 0; f < kFragsPerTile; ++f) h += detail::popcount64(detail::indicator(planes, f));
  return h;
}

// Sign-mantissa bytes and fallback elements of FTs 0..f-1: where FT f's values
// start inside the tile's segments (for decoding a single FT).
inline void ft_stream_starts(const uint64_t* planes, int f, int* sm_start, int* fb_start) {
  int h = 0;
  for (int i = 0; i < f; ++i) h += detail::popcount64(detail::indicator(planes, i));
  *sm_start = h;
  *fb_start = f * kFragElems - h;
}

// ------------------------------------------------------------------ scalar
// Decode one FT (planes p0, p1, p2) into out (8 rows, row stride ld).
// sm / fb point at the FT's first value in the segments (ft_stream_starts).
inline void decode_ft_scalar(uint64_t p0, uint64_t p1, uint64_t p2, int base, const uint8_t* sm,
                             const uint16_t* fb, uint16_t* out, ptrdiff_t ld) {
  for (int p = 0; p < kFragElems; ++p) {
    int code = static_cast<int>(((p0 >> p) & 1) | (((p1 >> p) & 1) << 1) | (((p2 >> p) & 1) << 2));
    out[(p >> 3) * ld + (p & 7)] = code ? assemble(*sm++, base, code) : *fb++;
  }
}

// Decode a whole tile (64 x 64, padding included) into out (row stride ld).
// Reads exactly the tile's H sm bytes and 4096 - H fb elements.
inline void decode_tile_scalar(const TileSrc& t, uint16_t* out, ptrdiff_t ld) {
  const uint8_t* sm = t.sm;
  const uint16_t* fb = t.fb;
  for (int f = 0; f < kFragsPerTile; ++f) {
    uint64_t p0 = t.planes[f], p1 = t.planes[kFragsPerTile + f], p2 = t.planes[2 * kFragsPerTile + f];
    decode_ft_scalar(p0, p1, p2, t.base, sm, fb, out + frag_row0(f) * ld + frag_col0(f), ld);
    int h = detail::popcount64(p0 | p1 | p2);
    sm += h;
    fb += kFragElems - h;
  }
}

namespace detail {
// Encode a full 64 x 64 block with a known base: planes, sm bytes, fb elements
// (no padding written). Returns H.
inline int encode_block_scalar(const uint16_t* src, ptrdiff_t ld, int base, uint64_t* planes,
                               uint8_t* sm, uint16_t* fb) {
  int h = 0, nf = 0;
  for (int f = 0; f < kFragsPerTile; ++f) {
    const uint16_t* s = src + frag_row0(f) * ld + frag_col0(f);
    uint64_t pl[3] = {0, 0, 0};
    for (int p = 0; p < kFragElems; ++p) {
      uint16_t v = s[(p >> 3) * ld + (p & 7)];
      int rel = ((v >> 7) & 0xFF) - base;
      int code = (rel >= 1 && rel <= kWindow) ? rel : 0;
      for (int b = 0; b < kPlanes; ++b) pl[b] |= static_cast<uint64_t>((code >> b) & 1) << p;
      if (code)
        sm[h++] = static_cast<uint8_t>(((v >> 8) & 0x80) | (v & 0x7F));
      else
        fb[nf++] = v;
    }
    for (int b = 0; b < kPlanes; ++b) planes[b * kFragsPerTile + f] = pl[b];
  }
  return h;
}
}  // namespace detail

// ------------------------------------------------------------------- AVX2
#if ZS_HAVE_AVX2_PATH
namespace detail {

ZS_TARGET_AVX2 inline __m256i loadu2(const uint16_t* hi, const uint16_t* lo) {
  return _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)), 1);
}

ZS_TARGET_AVX2 inline void storeu2(uint16_t* hi, uint16_t* lo, __m256i v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm256_castsi256_si128(v));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm256_extracti128_si256(v, 1));
}

// 0xFF in byte i where bit i of x is set (32 bits -> 32 bytes).
ZS_TARGET_AVX2 inline __m256i bits_to_bytes(uint32_t x, __m256i spread, __m256i bit) {
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x)), spread);
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

// Exact window of FORMAT.md section 3 when only exponents emin..emax (>= 1)
// occur: windows outside [emin - 6, emax] cover nothing, so they cannot win.
inline int base_from_hist_range(const uint32_t* hist, int emin, int emax) {
  if (emin > emax) return kMinWindowStart - 1;  // nothing coverable: s = 1
  const int s_lo = emin - (kWindow - 1) > kMinWindowStart ? emin - (kWindow - 1) : kMinWindowStart;
  const int s_hi = emax < kMaxWindowStart ? emax : kMaxWindowStart;
  uint32_t cover = 0;
  for (int e = s_lo; e < s_lo + kWindow; ++e) cover += hist[e];
  uint32_t best = cover;
  int best_start = s_lo;
  for (int s = s_lo + 1; s <= s_hi; ++s) {
    cover += hist[s + kWindow - 1] - hist[s - 1];
    if (cover > best) {
      best = cover;
      best_start = s;
    }
  }
  return best_start - 1;
}

// Bins counted with vector compares around the expected window; the rare
// exponents outside them are counted one by one, so the histogram is exact
// whatever the guess (a wrong guess only costs time).
constexpr int kVecBins = 10;

// Encode a full 64 x 64 block (row stride ld). base >= 0: use it; base < 0:
// choose it (hint: a likely base, e.g. the previous tile's, or -1).
// Pass 1 extracts exponent and sign-mantissa bytes in linear order (and
// counts exponents); pass 2 derives codes, bit-planes and the compacted streams.
template <bool kCount>
ZS_TARGET_AVX2 inline int encode_block_avx2(const uint16_t* src, ptrdiff_t ld, int base, int hint,
                                            uint64_t* planes, uint8_t* base_out, uint8_t* sm, uint16_t* fb) {
  alignas(32) uint8_t exps[kTileElems];
  alignas(32) uint8_t smb[kTileElems];
  const __m256i m00ff = _mm256_set1_epi16(0xFF), m007f = _mm256_set1_epi16(0x7F),
                m0080 = _mm256_set1_epi16(0x80);
  // ---- pass 1
  int lo = 0;
  __m256i acc[kVecBins];
  uint32_t outside[kTileElems / 32];
  if (kCount) {
    int guess = hint;
    if (guess < 0) {  // no hint: the largest exponent of the first row, less the window
      int mx = 0;
      for (int c = 0; c < kTile; ++c) mx = std::max(mx, (src[c] >> 7) & 0xFF);
      guess = mx - kWindow;
    }
    lo = std::min(std::max(guess - 1, 0), 256 - kVecBins);
    for (int j = 0; j < kVecBins; ++j) acc[j] = _mm256_setzero_si256();
  }
  const __m256i vlo = _mm256_set1_epi8(static_cast<char>(lo)), vtop = _mm256_set1_epi8(kVecBins - 1);
  for (int f = 0; f < kFragsPerTile; ++f) {
    const uint16_t* s = src + frag_row0(f) * ld + frag_col0(f);
    for (int half = 0; half < 2; ++half) {
      const uint16_t* r = s + 4 * half * ld;
      // a = rows 0 | 2, b = rows 1 | 3: packus then yields positions 0..31 in order.
      __m256i a = loadu2(r + 2 * ld, r);
      __m256i b = loadu2(r + 3 * ld, r + ld);
      __m256i e = _mm256_packus_epi16(_mm256_and_si256(_mm256_srli_epi16(a, 7), m00ff),
                                      _mm256_and_si256(_mm256_srli_epi16(b, 7), m00ff));
      __m256i sa = _mm256_or_si256(_mm256_and_si256(a, m007f), _mm256_and_si256(_mm256_srli_epi16(a, 8), m0080));
      __m256i sb = _mm256_or_si256(_mm256_and_si256(b, m007f), _mm256_and_si256(_mm256_srli_epi16(b, 8), m0080));
      const int q = f * kFragElems + 32 * half;
      _mm256_store_si256(reinterpret_cast<__m256i*>(exps + q), e);
      _mm256_store_si256(reinterpret_cast<__m256i*>(smb + q), _mm256_packus_epi16(sa, sb));
      if (kCount) {
        __m256i d = _mm256_sub_epi8(e, vlo);
#pragma GCC unroll 16
        for (int j = 0; j < kVecBins; ++j)
          acc[j] = _mm256_sub_epi8(acc[j], _mm256_cmpeq_epi8(d, _mm256_set1_epi8(static_cast<char>(j))));
        outside[q / 32] = ~static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_min_epu8(d, vtop), d)));
      }
    }
  }
  if (kCount) {
    uint32_t hist[256];
    std::memset(hist, 0, sizeof(hist));
    int emin = 256, emax = 0;
    for (int j = 0; j < kVecBins; ++j) {
      __m256i t = _mm256_sad_epu8(acc[j], _mm256_setzero_si256());
      __m128i u = _mm_add_epi64(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
      uint32_t n = static_cast<uint32_t>(_mm_cvtsi128_si64(u) + _mm_extract_epi64(u, 1));
      hist[lo + j] = n;
      if (n && lo + j >= 1) {
        emin = std::min(emin, lo + j);
        emax = std::max(emax, lo + j);
      }
    }
    for (int i = 0; i < kTileElems / 32; ++i) {
      for (uint32_t m = outside[i]; m; m &= m - 1) {
        int e = exps[i * 32 + static_cast<int>(_tzcnt_u32(m))];
        ++hist[e];
        if (e >= 1) {
          emin = std::min(emin, e);
          emax = std::max(emax, e);
        }
      }
    }
    base = base_from_hist_range(hist, emin, emax);
  }
  *base_out = static_cast<uint8_t>(base);
  // ---- pass 2
  const __m256i vbase = _mm256_set1_epi8(static_cast<char>(base));
  const __m256i one8 = _mm256_set1_epi8(1), six8 = _mm256_set1_epi8(6);
  uint8_t* smp = sm;
  uint16_t* fbp = fb;
  for (int f = 0; f < kFragsPerTile; ++f) {
    uint64_t pl[3] = {0, 0, 0};
    for (int half = 0; half < 2; ++half) {
      __m256i e = _mm256_load_si256(reinterpret_cast<const __m256i*>(exps + f * kFragElems + 32 * half));
      __m256i rel = _mm256_sub_epi8(e, vbase);
      __m256i t = _mm256_sub_epi8(rel, one8);
      __m256i code = _mm256_and_si256(rel, _mm256_cmpeq_epi8(_mm256_min_epu8(t, six8), t));
      pl[0] |= uint64_t{static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_slli_epi16(code, 7)))} << (32 * half);
      pl[1] |= uint64_t{static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_slli_epi16(code, 6)))} << (32 * half);
      pl[2] |= uint64_t{static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_slli_epi16(code, 5)))} << (32 * half);
    }
    planes[f] = pl[0];
    planes[kFragsPerTile + f] = pl[1];
    planes[2 * kFragsPerTile + f] = pl[2];
    const uint64_t ind = pl[0] | pl[1] | pl[2];
    const uint8_t* sb = smb + f * kFragElems;
    if (ind == ~uint64_t{0}) {
      std::memcpy(smp, sb, kFragElems);
      smp += kFragElems;
      continue;
    }
    for (int g = 0; g < 8; ++g) {
      unsigned m = static_cast<unsigned>(ind >> (8 * g)) & 0xFF;
      uint64_t x = _pext_u64(load_u64(sb + 8 * g), kByteMasks.v[m]);
      std::memcpy(smp, &x, 8);
      smp += _mm_popcnt_u32(m);
    }
    const uint16_t* s = src + frag_row0(f) * ld + frag_col0(f);
    for (uint64_t fbm = ~ind; fbm; fbm &= fbm - 1) {
      int p = static_cast<int>(_tzcnt_u64(fbm));
      *fbp++ = s[(p >> 3) * ld + (p & 7)];
    }
  }
  return static_cast<int>(smp - sm);
}

}  // namespace detail

// Decode one FT with AVX2 (same contract as decode_ft_scalar, plus: may read
// kSmReadSlack bytes past the FT's last sm byte).
ZS_TARGET_AVX2 inline void decode_ft_avx2(uint64_t p0, uint64_t p1, uint64_t p2, int base,
                                          const uint8_t* sm, const uint16_t* fb, uint16_t* out,
                                          ptrdiff_t ld) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
  const __m256i vbase = _mm256_set1_epi8(static_cast<char>(base));
  const __m256i one = _mm256_set1_epi8(1), two = _mm256_set1_epi8(2), four = _mm256_set1_epi8(4);
  const __m256i m80 = _mm256_set1_epi8(static_cast<char>(0x80)), m7f = _mm256_set1_epi8(0x7F);
  const uint64_t ind = p0 | p1 | p2;
  for (int half = 0; half < 2; ++half) {
    const int sh = 32 * half;
    __m256i b0 = detail::bits_to_bytes(static_cast<uint32_t>(p0 >> sh), spread, bit);
    __m256i b1 = detail::bits_to_bytes(static_cast<uint32_t>(p1 >> sh), spread, bit);
    __m256i b2 = detail::bits_to_bytes(static_cast<uint32_t>(p2 >> sh), spread, bit);
    // exponent = base + code (b0 is 0 or -1)
    __m256i e = _mm256_sub_epi8(vbase, b0);
    e = _mm256_add_epi8(e, _mm256_and_si256(b1, two));
    e = _mm256_add_epi8(e, _mm256_and_si256(b2, four));
    __m256i hi = _mm256_or_si256(b0, _mm256_or_si256(b1, b2));
    // rank of each high position among the high positions of its 16-lane
    __m256i c1 = _mm256_and_si256(hi, one);
    __m256i c = _mm256_add_epi8(c1, _mm256_slli_si256(c1, 1));
    c = _mm256_add_epi8(c, _mm256_slli_si256(c, 2));
    c = _mm256_add_epi8(c, _mm256_slli_si256(c, 4));
    c = _mm256_add_epi8(c, _mm256_slli_si256(c, 8));
    __m256i idx = _mm256_or_si256(_mm256_sub_epi8(c, c1), _mm256_andnot_si256(hi, m80));
    const uint32_t i32 = static_cast<uint32_t>(ind >> sh);
    const int n_lo = _mm_popcnt_u32(i32 & 0xFFFF);
    __m256i src = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(sm + n_lo)), 1);
    __m256i s = _mm256_shuffle_epi8(src, idx);
    sm += _mm_popcnt_u32(i32);
    __m256i vhi = _mm256_or_si256(_mm256_and_si256(s, m80), _mm256_and_si256(_mm256_srli_epi16(e, 1), m7f));
    __m256i vlo = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(e, 7), m80), _mm256_and_si256(s, m7f));
    uint16_t* o = out + 4 * half * ld;
    detail::storeu2(o + 2 * ld, o, _mm256_unpacklo_epi8(vlo, vhi));
    detail::storeu2(o + 3 * ld, o + ld, _mm256_unpackhi_epi8(vlo, vhi));
  }
  for (uint64_t fbm = ~ind; fbm; fbm &= fbm - 1) {
    int p = static_cast<int>(_tzcnt_u64(fbm));
    out[(p >> 3) * ld + (p & 7)] = *fb++;
  }
}

// Decode a whole tile with AVX2 (may read kSmReadSlack bytes past its H sm bytes).
ZS_TARGET_AVX2 inline void decode_tile_avx2(const TileSrc& t, uint16_t* out, ptrdiff_t ld) {
  const uint8_t* sm = t.sm;
  const uint16_t* fb = t.fb;
  for (int f = 0; f < kFragsPerTile; ++f) {
    uint64_t p0 = t.planes[f], p1 = t.planes[kFragsPerTile + f], p2 = t.planes[2 * kFragsPerTile + f];
    decode_ft_avx2(p0, p1, p2, t.base, sm, fb, out + frag_row0(f) * ld + frag_col0(f), ld);
    int h = static_cast<int>(_mm_popcnt_u64(p0 | p1 | p2));
    sm += h;
    fb += kFragElems - h;
  }
}
#endif  // ZS_HAVE_AVX2_PATH

// ----------------------------------------------------------- dispatchers
// Decode one FT; isa must be supported by this CPU (best_isa()).
inline void decode_ft(Isa isa, uint64_t p0, uint64_t p1, uint64_t p2, int base, const uint8_t* sm,
                      const uint16_t* fb, uint16_t* out, ptrdiff_t ld) {
#if ZS_HAVE_AVX2_PATH
  if (isa == Isa::kAvx2) return decode_ft_avx2(p0, p1, p2, base, sm, fb, out, ld);
#endif
  (void)isa;
  decode_ft_scalar(p0, p1, p2, base, sm, fb, out, ld);
}

// Decode a whole tile (64 x 64, padding included) into out (row stride ld).
inline void decode_tile(Isa isa, const TileSrc& t, uint16_t* out, ptrdiff_t ld) {
#if ZS_HAVE_AVX2_PATH
  if (isa == Isa::kAvx2) return decode_tile_avx2(t, out, ld);
#endif
  (void)isa;
  decode_tile_scalar(t, out, ld);
}

#if ZS_HAVE_AVX2_PATH
namespace detail {
// Popcount of the 64 indicators, 4 at a time (nibble lookup + byte sums).
ZS_TARGET_AVX2 inline int tile_high_count_avx2(const uint64_t* planes) {
  const __m256i lut = _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4,
                                       0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256i acc = _mm256_setzero_si256();
  for (int f = 0; f < kFragsPerTile; f += 4) {
    const __m256i* p = reinterpret_cast<const __m256i*>(planes + f);
    __m256i x = _mm256_or_si256(_mm256_loadu_si256(p),
                                _mm256_or_si256(_mm256_loadu_si256(p + kFragsPerTile / 4),
                                                _mm256_loadu_si256(p + kFragsPerTile / 2)));
    __m256i c = _mm256_add_epi8(_mm256_shuffle_epi8(lut, _mm256_and_si256(x, low4)),
                                _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(x, 4), low4)));
    acc = _mm256_add_epi64(acc, _mm256_sad_epu8(c, _mm256_setzero_si256()));
  }
  __m128i t = _mm_add_epi64(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  return static_cast<int>(_mm_cvtsi128_si64(t) + _mm_extract_epi64(t, 1));
}
}  // namespace detail
#endif

// tile_high_count with the popcount instruction when isa allows it.
inline int tile_high_count(Isa isa, const uint64_t* planes) {
#if ZS_HAVE_AVX2_PATH
  if (isa == Isa::kAvx2) return detail::tile_high_count_avx2(planes);
#endif
  (void)isa;
  return tile_high_count(planes);
}

// Check a tile's segment offsets against its streams (FORMAT.md section 5).
// Returns nullptr when valid, else a static description of the problem.
inline const char* check_tile_offsets(const uint64_t* planes, int base, int64_t off_sm, int64_t off_fb,
                                      int64_t sm_len, int64_t fb_len, int* h_out = nullptr,
                                      Isa isa = Isa::kScalar) {
  if (base > kMaxWindowStart - 1) return "base exponent out of range (> 248)";
  const int h = tile_high_count(isa, planes);
  if (h_out) *h_out = h;
  const int64_t hp = sm_segment_len(h), fp = fb_segment_len(h);
  if (off_sm % kSmAlign != 0) return "sign-mantissa offset not a multiple of 16";
  if (off_fb % kFbAlign != 0) return "fallback offset not a multiple of 8";
  if (off_sm < 0 || hp > sm_len || off_sm > sm_len - hp) return "sign-mantissa segment out of bounds";
  if (off_fb < 0 || fp > fb_len || off_fb > fb_len - fp) return "fallback segment out of bounds";
  return nullptr;
}

// Validate, then decode a tile straight from its streams (the safe entry point).
// Returns nullptr on success, else the problem (nothing is read or written then).
// A tile whose segment ends too close to the end of the sm stream is decoded
// from a local copy, so no byte outside the streams is ever read.
inline const char* decode_tile_checked(Isa isa, const uint64_t* planes, int base, const uint8_t* sm_stream,
                                       int64_t sm_len, int64_t off_sm, const uint16_t* fb_stream,
                                       int64_t fb_len, int64_t off_fb, uint16_t* out, ptrdiff_t ld) {
  int h = 0;
  if (const char* err = check_tile_offsets(planes, base, off_sm, off_fb, sm_len, fb_len, &h, isa)) return err;
  TileSrc t{planes, base, sm_stream + off_sm, fb_stream + off_fb};
  if (isa != Isa::kScalar && off_sm + h + kSmReadSlack > sm_len) {
    alignas(32) uint8_t copy[kTileElems + kSmReadSlack];
    std::memcpy(copy, t.sm, static_cast<size_t>(h));
    std::memset(copy + h, 0, kSmReadSlack);
    t.sm = copy;
    decode_tile(isa, t, out, ld);
    return nullptr;
  }
  decode_tile(isa, t, out, ld);
  return nullptr;
}

// ------------------------------------------------------------------ encode
// Encode one tile whose valid corner is rows x cols (1..64 each) at src (row
// stride ld). Writes the 192 plane words, *base_out, the sign-mantissa segment
// into sm (zero-padded to sm_segment_len(H)) and the fallback segment into fb
// (zero-padded to fb_segment_len(H)). sm needs 4096 + kSmWriteSlack bytes of
// room, fb 4096 + kFbWriteSlack elements. Returns H.
// base_hint: optional speed hint only (a likely base_exp, e.g. the previous
// tile's; -1 for none); the result never depends on it.
inline int encode_tile(Isa isa, const uint16_t* src, ptrdiff_t ld, int rows, int cols, uint64_t* planes,
                       uint8_t* base_out, uint8_t* sm, uint16_t* fb, int base_hint = -1) {
  // Work on a contiguous copy: rows of a matrix tile are K elements apart and
  // map to few cache sets, so visiting them FT by FT would thrash L1.
  alignas(32) uint16_t local[kTileElems];
  int base = -1;
  const bool full = rows == kTile && cols == kTile;
  if (full) {
    if (ld != kTile) {
      for (int r = 0; r < kTile; ++r) std::memcpy(local + r * kTile, src + r * ld, kTile * sizeof(uint16_t));
      src = local;
    }
  } else {
    // Copy the valid corner and fill padding with the value whose code is 1
    // and whose sm byte is 0 under this tile's window: (base + 1) << 7.
    base = detail::base_of_partial_tile(src, ld, rows, cols);
    const uint16_t pad = static_cast<uint16_t>((base + kPadCode) << 7);
    for (int r = 0; r < kTile; ++r)
      for (int c = 0; c < kTile; ++c) local[r * kTile + c] = (r < rows && c < cols) ? src[r * ld + c] : pad;
    src = local;
  }
  ld = kTile;
  int h;
#if ZS_HAVE_AVX2_PATH
  if (isa == Isa::kAvx2) {
    h = full ? detail::encode_block_avx2<true>(src, ld, -1, base_hint, planes, base_out, sm, fb)
             : detail::encode_block_avx2<false>(src, ld, base, -1, planes, base_out, sm, fb);
  } else
#endif
  {
    if (full) base = detail::base_of_full_tile(src, ld);
    *base_out = static_cast<uint8_t>(base);
    h = detail::encode_block_scalar(src, ld, base, planes, sm, fb);
  }
  (void)isa;
  (void)base_hint;
  detail::zero_sm_pad(sm, h);
  detail::zero_fb_pad(fb, kTileElems - h);
  return h;
}

}  // namespace zipserv
