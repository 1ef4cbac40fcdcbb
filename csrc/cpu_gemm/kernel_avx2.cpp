// AVX2 (+FMA, BMI2, POPCNT) fused decode-GEMM. Compiled for that ISA through
// a target pragma limited to this file's own functions; chosen at run time
// only when the CPU reports the features (avx2_supported()).
//
// Per FT half (32 elements): the three bit-planes become byte masks
// (broadcast + pshufb + and + cmpeq), giving the code bytes; an in-lane prefix
// count of the fallback mask gives each high element's index into 16 bytes of
// the sign-mantissa stream loaded per 16 elements, and one pshufb expands them.
// The shared body (simd_common.inc) assembles fp32 weights and runs the FMAs.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <immintrin.h>

#include "zipserv/cpu_gemm.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,bmi,bmi2,popcnt")

namespace zipserv {
namespace cpu {
namespace {

// Defined in the shared body (simd_common.inc), included below.
inline void assemble_store(__m256i c, __m256i smx, __m256i thi, __m256i tlo, uint32_t* dst);

inline __m256i bits_mask(uint32_t v) {
  const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(v)), shuf);
  return _mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit);
}

inline int64_t tile_high_avx2(const uint64_t* planes) {
  int64_t h = 0;
  for (int f = 0; f < kFragsPerTile; ++f)
    h += _mm_popcnt_u64(planes[f] | planes[kFragsPerTile + f] | planes[2 * kFragsPerTile + f]);
  return h;
}

inline void decode_ft_avx2(uint64_t p0, uint64_t p1, uint64_t p2, uint64_t ind, const uint8_t* smp,
                           __m256i thi, __m256i tlo, uint32_t* dst) {
  const __m256i iota = _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                                        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m256i zero = _mm256_setzero_si256();
  const uint8_t* g1 = smp + _mm_popcnt_u64(ind & 0xFFFF);
  const uint8_t* g2 = g1 + _mm_popcnt_u64((ind >> 16) & 0xFFFF);
  const uint8_t* g3 = g2 + _mm_popcnt_u64((ind >> 32) & 0xFFFF);
  const uint8_t* lo_src[2] = {smp, g2};
  const uint8_t* hi_src[2] = {g1, g3};
  for (int h = 0; h < 2; ++h) {
    const __m256i m0 = bits_mask(static_cast<uint32_t>(p0 >> (32 * h)));
    const __m256i m1 = bits_mask(static_cast<uint32_t>(p1 >> (32 * h)));
    const __m256i m2 = bits_mask(static_cast<uint32_t>(p2 >> (32 * h)));
    const __m256i c = _mm256_or_si256(_mm256_or_si256(_mm256_and_si256(m0, _mm256_set1_epi8(1)),
                                                      _mm256_and_si256(m1, _mm256_set1_epi8(2))),
                                      _mm256_and_si256(m2, _mm256_set1_epi8(4)));
    // Inclusive prefix sum (per 16-byte lane) of -1 at fallback positions:
    // a high element at position i has i + x[i] high elements before it.
    __m256i x = _mm256_cmpeq_epi8(c, zero);
    x = _mm256_add_epi8(x, _mm256_slli_si256(x, 1));
    x = _mm256_add_epi8(x, _mm256_slli_si256(x, 2));
    x = _mm256_add_epi8(x, _mm256_slli_si256(x, 4));
    x = _mm256_add_epi8(x, _mm256_slli_si256(x, 8));
    const __m256i idx = _mm256_add_epi8(x, iota);
    const __m256i src = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo_src[h]))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi_src[h])), 1);
    assemble_store(c, _mm256_shuffle_epi8(src, idx), thi, tlo, dst + 32 * h);
  }
}

#define ZS_TILE_HIGH(planes) tile_high_avx2(planes)
#define ZS_DECODE_FT(p0, p1, p2, ind, smp, thi, tlo, dst) decode_ft_avx2(p0, p1, p2, ind, smp, thi, tlo, dst)
#include "simd_common.inc"
}  // namespace
}  // namespace cpu
}  // namespace zipserv

#pragma GCC pop_options

namespace zipserv {
namespace cpu {

Kernel avx2_kernel() { return {"avx2", gemm_rows, decode_rows}; }

bool avx2_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2") &&
         __builtin_cpu_supports("popcnt");
}

}  // namespace cpu
}  // namespace zipserv
