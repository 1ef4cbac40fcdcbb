// AVX-512 (F, BW, VL, VBMI2, VPOPCNTDQ) fused decode-GEMM. Compiled for that
// ISA through a target pragma limited to this file's own functions; chosen at
// run time only when the CPU reports every feature (avx512_supported()).
//
// Per FT (64 elements): the three bit-planes are used directly as mask
// registers (code = masked 1 | 2 | 4), the sign-mantissa bytes are expanded
// from the stream with one vpexpandb (VBMI2) under the indicator mask, and a
// tile's high count is a VPOPCNTDQ reduction. Assembly into fp32 and the FMAs
// reuse the 256-bit body of simd_common.inc, so the decode buffer and the
// summation order are exactly those of the AVX2 kernel: results are
// bit-identical to it and to the scalar kernel. vdpbf16ps (AVX512-BF16) is
// deliberately not used: it rounds each pair sum and flushes denormals, which
// would break that identity.
//
// NOTE: the development machine has no AVX-512, so this path is compiled and
// dispatch-guarded but has not been executed there.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <immintrin.h>

#include "zipserv/cpu_gemm.h"

#pragma GCC push_options
// GCC 12's own avx512fintrin.h trips -Wmaybe-uninitialized / -Wuninitialized
// (its _mm256_undefined_si256 placeholder) when its 512->256 extracts are inlined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vpopcntdq,avx2,fma,bmi,bmi2,popcnt")

namespace zipserv {
namespace cpu {
namespace {

inline int64_t tile_high_avx512(const uint64_t* planes);
inline void decode_ft_avx512(const uint64_t* pl, const uint8_t*& smp, const uint16_t*& fbp, __m256i thi,
                             __m256i tlo, uint16_t* dst);

#define ZS_TILE_HIGH(planes) tile_high_avx512(planes)
#define ZS_DECODE_FT(pl, smp, fbp, thi, tlo, dst) decode_ft_avx512(pl, smp, fbp, thi, tlo, dst)
#include "simd_common.inc"

inline int64_t tile_high_avx512(const uint64_t* planes) {
  __m512i acc = _mm512_setzero_si512();
  for (int f = 0; f < kFragsPerTile; f += 8) {
    const __m512i ind = _mm512_or_si512(
        _mm512_or_si512(_mm512_loadu_si512(planes + f), _mm512_loadu_si512(planes + kFragsPerTile + f)),
        _mm512_loadu_si512(planes + 2 * kFragsPerTile + f));
    acc = _mm512_add_epi64(acc, _mm512_popcnt_epi64(ind));
  }
  alignas(64) int64_t lanes[8];
  _mm512_store_si512(lanes, acc);
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

inline void decode_ft_avx512(const uint64_t* pl, const uint8_t*& smp, const uint16_t*& fbp, __m256i thi,
                             __m256i tlo, uint16_t* dst) {
  const uint64_t p0 = pl[0], p1 = pl[kFragsPerTile], p2 = pl[2 * kFragsPerTile];
  const uint64_t ind = p0 | p1 | p2, nf = ~ind;
  // code = 1 | 2 | 4 under the plane masks; vpexpandb places the high
  // elements' sign-mantissa bytes, vpexpandw the fallback patterns.
  const __m512i c = _mm512_or_si512(
      _mm512_or_si512(_mm512_maskz_mov_epi8(_cvtu64_mask64(p0), _mm512_set1_epi8(1)),
                      _mm512_maskz_mov_epi8(_cvtu64_mask64(p1), _mm512_set1_epi8(2))),
      _mm512_maskz_mov_epi8(_cvtu64_mask64(p2), _mm512_set1_epi8(4)));
  const __m512i smx = _mm512_maskz_expandloadu_epi8(_cvtu64_mask64(ind), smp);
  smp += _mm_popcnt_u64(ind);
  __m512i fbw[2];
  for (int h = 0; h < 2; ++h) {
    const uint32_t m = static_cast<uint32_t>(nf >> (32 * h));
    fbw[h] = _mm512_maskz_expandloadu_epi16(_cvtu32_mask32(m), fbp);
    fbp += _mm_popcnt_u32(m);
  }
  for (int h = 0; h < 2; ++h) {
    const __m256i ch = h == 0 ? _mm512_castsi512_si256(c) : _mm512_extracti64x4_epi64(c, 1);
    const __m256i sh = h == 0 ? _mm512_castsi512_si256(smx) : _mm512_extracti64x4_epi64(smx, 1);
    __m256i lo, hi;
    assemble_lohi(ch, sh, thi, tlo, &lo, &hi);
    const __mmask32 fm = _cvtu32_mask32(static_cast<uint32_t>(nf >> (32 * h)));
    lo = _mm256_mask_blend_epi8(fm, lo, _mm512_cvtepi16_epi8(fbw[h]));
    hi = _mm256_mask_blend_epi8(fm, hi, _mm512_cvtepi16_epi8(_mm512_srli_epi16(fbw[h], 8)));
    store_lohi(lo, hi, dst + 32 * h);
  }
}

}  // namespace
}  // namespace cpu
}  // namespace zipserv

#pragma GCC diagnostic pop
#pragma GCC pop_options

namespace zipserv {
namespace cpu {

Kernel avx512_kernel() { return make_kernel("avx512"); }

bool avx512_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi2") &&
         __builtin_cpu_supports("avx512vpopcntdq") && __builtin_cpu_supports("avx2") &&
         __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
}

}  // namespace cpu
}  // namespace zipserv
