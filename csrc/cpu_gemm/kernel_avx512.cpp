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
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <immintrin.h>

#include "zipserv/cpu_gemm.h"

#pragma GCC push_options
// GCC 12's own avx512fintrin.h trips -Wmaybe-uninitialized (its
// _mm256_undefined_si256 placeholder) when its 512->256 extracts are inlined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vpopcntdq,avx2,fma,bmi,bmi2,popcnt")

namespace zipserv {
namespace cpu {
namespace {

// Defined in the shared body (simd_common.inc), included below.
inline void assemble_store(__m256i c, __m256i smx, __m256i thi, __m256i tlo, uint32_t* dst);

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

inline void decode_ft_avx512(uint64_t p0, uint64_t p1, uint64_t p2, uint64_t ind, const uint8_t* smp,
                             __m256i thi, __m256i tlo, uint32_t* dst) {
  const __m512i c = _mm512_or_si512(
      _mm512_or_si512(_mm512_maskz_mov_epi8(_cvtu64_mask64(p0), _mm512_set1_epi8(1)),
                      _mm512_maskz_mov_epi8(_cvtu64_mask64(p1), _mm512_set1_epi8(2))),
      _mm512_maskz_mov_epi8(_cvtu64_mask64(p2), _mm512_set1_epi8(4)));
  const __m512i smx = _mm512_maskz_expandloadu_epi8(_cvtu64_mask64(ind), smp);
  assemble_store(_mm512_castsi512_si256(c), _mm512_castsi512_si256(smx), thi, tlo, dst);
  assemble_store(_mm512_extracti64x4_epi64(c, 1), _mm512_extracti64x4_epi64(smx, 1), thi, tlo, dst + 32);
}

#define ZS_TILE_HIGH(planes) tile_high_avx512(planes)
#define ZS_DECODE_FT(p0, p1, p2, ind, smp, thi, tlo, dst) decode_ft_avx512(p0, p1, p2, ind, smp, thi, tlo, dst)
#include "simd_common.inc"

}  // namespace
}  // namespace cpu
}  // namespace zipserv

#pragma GCC diagnostic pop
#pragma GCC pop_options

namespace zipserv {
namespace cpu {

Kernel avx512_kernel() { return {"avx512", gemm_rows, decode_rows}; }

bool avx512_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi2") &&
         __builtin_cpu_supports("avx512vpopcntdq") && __builtin_cpu_supports("avx2") &&
         __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
}

}  // namespace cpu
}  // namespace zipserv
