// AVX2 (+FMA, BMI2, POPCNT) fused decode-GEMM. Compiled for that ISA through
// a target pragma limited to this file's own functions; chosen at run time
// only when the CPU reports the features (avx2_supported()).
//
// Per FT half (32 elements): the three bit-planes become byte masks
// (broadcast + pshufb + and + cmpeq), giving the code bytes; an in-lane prefix
// count of the high elements (a multiply within dwords, two pshufb steps
// across them) gives each high element's index into 16 bytes of the
// sign-mantissa stream loaded per 16 elements, and one pshufb expands them.
// The shared body (simd_common.inc) assembles fp32 weights and runs the FMAs.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <immintrin.h>

#include "zipserv/cpu_gemm.h"

#pragma GCC push_options
// tune=znver3: no false-dependency-breaking xor before each popcnt / tzcnt
// (5 of ~137 instructions per FT; docs/CPU.md).
#pragma GCC target("avx2,fma,bmi,bmi2,popcnt,tune=znver3")

namespace zipserv {
namespace cpu {
namespace {

inline int64_t tile_high_avx2(const uint64_t* planes);
inline void decode_ft_avx2(const uint64_t* pl, const uint8_t*& smp, const uint16_t*& fbp, __m256i thi,
                           __m256i tlo, uint16_t* dst);

#define ZS_TILE_HIGH(planes) tile_high_avx2(planes)
#define ZS_DECODE_FT(pl, smp, fbp, thi, tlo, dst) decode_ft_avx2(pl, smp, fbp, thi, tlo, dst)
#include "simd_common.inc"

inline int64_t tile_high_avx2(const uint64_t* planes) {
  int64_t h = 0;
  for (int f = 0; f < kFragsPerTile; ++f)
    h += _mm_popcnt_u64(planes[f] | planes[kFragsPerTile + f] | planes[2 * kFragsPerTile + f]);
  return h;
}

// Byte masks (0xFF where the bit is set) of 32 bits of the broadcast plane
// word b: bits 0-31 with shuf = kShuf[0], bits 32-63 with kShuf[1].
inline __m256i plane_mask(__m256i b, __m256i shuf) {
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  return _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(b, shuf), bit), bit);
}

inline __m128i load16(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }

inline void decode_ft_avx2(const uint64_t* pl, const uint8_t*& smp, const uint16_t*& fbp, __m256i thi,
                           __m256i tlo, uint16_t* dst) {
  // Opaque to GCC, which would otherwise strength-reduce the multiply below
  // into two shift+add pairs (4 instructions instead of 1).
  __m256i dword_ones = _mm256_set1_epi32(0x01010101);
  asm("" : "+x"(dword_ones));
  const uint64_t ind = pl[0] | pl[kFragsPerTile] | pl[2 * kFragsPerTile];
  // High counts of the first three 16-element groups give each group's start
  // (32-bit popcnt and bzhi: one instruction each, no mask constant).
  const int64_t h0 = _mm_popcnt_u32(static_cast<uint32_t>(ind) & 0xFFFFu);
  const int64_t h01 = _mm_popcnt_u32(static_cast<uint32_t>(ind));
  const int64_t h012 = _mm_popcnt_u64(_bzhi_u64(ind, 48));
  const uint8_t* sg[4] = {smp, smp + h0, smp + h01, smp + h012};
  const int64_t hall = _mm_popcnt_u64(ind);
  const __m256i b0 = _mm256_set1_epi64x(static_cast<long long>(pl[0]));
  const __m256i b1 = _mm256_set1_epi64x(static_cast<long long>(pl[kFragsPerTile]));
  const __m256i b2 = _mm256_set1_epi64x(static_cast<long long>(pl[2 * kFragsPerTile]));
  for (int h = 0; h < 2; ++h) {
    const __m256i shuf = h == 0 ? _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                   2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3)
                                : _mm256_setr_epi8(4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5,
                                                   6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7);
    // code = 4 [plane 2] + 1 [plane 0] + 2 [plane 1] from the 0 / -1 masks.
    const __m256i m1 = plane_mask(b1, shuf);
    const __m256i c = _mm256_sub_epi8(_mm256_sub_epi8(_mm256_and_si256(plane_mask(b2, shuf), _mm256_set1_epi8(4)),
                                                      plane_mask(b0, shuf)),
                                      _mm256_add_epi8(m1, m1));
    // Inclusive count I of high elements per 16-element lane: within each
    // dword one multiply (bytes 0/1 times 0x01010101; sums <= 4, no carry),
    // then the dword totals (byte 3) of the previous one and two dwords added
    // by pshufb. A high element i has I[i] - 1 high elements before it.
    const __m256i hf = _mm256_min_epu8(c, _mm256_set1_epi8(1));
    __m256i x = _mm256_mullo_epi32(hf, dword_ones);
    x = _mm256_add_epi8(x, _mm256_shuffle_epi8(x, _mm256_setr_epi8(-1, -1, -1, -1, 3, 3, 3, 3, 7, 7, 7, 7, 11, 11, 11, 11,
                                                                   -1, -1, -1, -1, 3, 3, 3, 3, 7, 7, 7, 7, 11, 11, 11, 11)));
    x = _mm256_add_epi8(x, _mm256_shuffle_epi8(x, _mm256_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 3, 3, 3, 3, 7, 7, 7, 7,
                                                                   -1, -1, -1, -1, -1, -1, -1, -1, 3, 3, 3, 3, 7, 7, 7, 7)));
    const __m256i sms = _mm256_inserti128_si256(_mm256_castsi128_si256(load16(sg[2 * h])), load16(sg[2 * h + 1]), 1);
    __m256i lo, hi;
    assemble_lohi(c, _mm256_shuffle_epi8(sms, _mm256_sub_epi8(x, _mm256_set1_epi8(1))), thi, tlo, &lo, &hi);
    store_lohi(lo, hi, dst + 32 * h);
  }
  // The empty asm keeps GCC from rewriting blsr(~ind) as (~ind) & (-2 - ind).
  uint64_t nf = ~ind;
  asm("" : "+r"(nf));
  fix_fallback(nf, fbp, dst);
  smp += hall;
  fbp += _mm_popcnt_u64(nf);
}

}  // namespace
}  // namespace cpu
}  // namespace zipserv

#pragma GCC pop_options

namespace zipserv {
namespace cpu {

Kernel avx2_kernel() { return make_kernel("avx2"); }

bool avx2_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2") &&
         __builtin_cpu_supports("popcnt");
}

}  // namespace cpu
}  // namespace zipserv
