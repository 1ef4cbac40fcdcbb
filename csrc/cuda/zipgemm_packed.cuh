// Fused GEMM over the byte-split layout (docs/FORMAT.md appendix A; the CPU
// fast path's in-memory layout, csrc/include/zipserv/cpu_layout.h), decoded
// straight into mma.m16n8k16 A fragments: Y[N, M] = X[N, K] . W[M, K]^T.
//
// Why a second layout on the GPU: TCA-TBE v1's decode costs 1.41 warp
// instructions per weight in the fused kernel's hot loop (benchmarks/
// sass_budget.py), so on an H200 it decodes ~2 weights per SM-cycle while BF16
// streams 9.2. Appendix A stores every weight in 12 bits at a fixed place (a
// low byte and a 4-bit code per position, a 16-entry table of high bytes per
// tile, rare exceptions), so no prefix counts or variable offsets are needed,
// and a lane rebuilds its pair of an FT with two 16-bit loads and five byte
// permutes (packed_pair below).
//
// Block = 4 warps over one 64-row tile row and TN = 8 NT8 columns of X, grid
// = (ceil(N / TN), Mt, split parts), as the TCA-TBE kernel (same X staging,
// B fragments, split-K workspace and epilogue). Per K tile: each warp copies
// its 16 FT records (1536 contiguous bytes) and thread 0 the tile's table
// into a double buffer with cp.async; one barrier per tile.
#pragma once

#include "device_common.cuh"
#include "launch.h"
#include "zipgemm_kernel.cuh"
#include "zipserv/cpu_layout.h"

namespace zipserv {
namespace cuda {
namespace packed {

using namespace zipserv::gemm;
using namespace zipserv::dev;
using zipserv::cpu::kPkFtBytes;
using zipserv::cpu::kPkTileBytes;

constexpr int kWarpRecBytes = kFtPerMed * kPkFtBytes;  // 1536: a warp's 16 FT records

// prmt.b32 (PTX ISA, default mode): byte n of the result is byte (s >> 4n) & 7 of {b, a} (a = bytes
// 0..3); when bit 3 of that nibble is set, the selected byte's most significant bit replicated.
ZS_HD uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
  return r;
#else
  const uint64_t v = a | (static_cast<uint64_t>(b) << 32);
  uint32_t r = 0;
  for (int n = 0; n < 4; ++n) {
    const uint32_t nib = (s >> (4 * n)) & 0xFu;
    uint32_t byte = static_cast<uint32_t>(v >> (8 * (nib & 7u))) & 0xFFu;
    if (nib & 8u) byte = (byte & 0x80u) ? 0xFFu : 0u;
    r |= byte << (8 * n);
  }
  return r;
#endif
}

// Lane l's pair (positions p = 2l, 2l + 1) of one FT: lo = their low bytes (lo0 | lo1 << 8), cw = the
// two code bytes holding their codes (shift 0: low nibbles, 4: high nibbles), t0..t3 = the tile's
// table (entry c in byte c % 4 of t[c / 4]). Returns the bf16x2 register (p + 1) << 16 | p.
ZS_HD uint32_t packed_pair(uint32_t lo, uint32_t cw, int shift, uint32_t t0, uint32_t t1, uint32_t t2, uint32_t t3) {
  const uint32_t a = cw >> shift;       // code 0 in nibble 0, code 1 in nibble 2 (nibbles 1, 3: not ours)
  const uint32_t s7 = a & 0x0707u;      // prmt selectors for result bytes 0 and 2: entry (code % 8)
  const uint32_t low8 = prmt(t0, t1, s7), high8 = prmt(t2, t3, s7);  // from entries 0..7 / 8..15
  // bytes 0 and 2 = 0xFF where the code is >= 8: (a << 4) has code 0's bit 3 as byte 0's top bit and
  // code 1's as byte 1's, replicated into result bytes 0 and 2
  const uint32_t m = prmt(a << 4, 0u, 0x0908u);
  const uint32_t hi = (low8 & ~m) | (high8 & m);  // bytes 0 and 2: the two high bytes
  return prmt(lo, hi, 0x6140u);                   // hi1 lo1 hi0 lo0
}

// The exceptions of the tile (entries d << 8 | high byte) that fall on FT f's positions 2 lane, 2 lane + 1.
ZS_HD uint32_t patch_pair(uint32_t v, const int32_t* exc, int64_t e0, int64_t e1, int f, int lane) {
  const int d0 = f * kFragElems + 2 * lane;
  for (int64_t e = e0; e < e1; ++e) {
    const uint32_t x = static_cast<uint32_t>(exc[e]);
    const int d = static_cast<int>(x >> zipserv::cpu::kPkExcShift);
    if (d == d0) v = (v & 0xFFFF00FFu) | ((x & 0xFFu) << 8);
    if (d == d0 + 1) v = (v & 0x00FFFFFFu) | ((x & 0xFFu) << 24);
  }
  return v;
}

template <int NT8, bool kExceptions>
__device__ __forceinline__ void compute(float (&acc)[NT8][4], const uint8_t* rec, const uint32_t* lut,
                                        const uint16_t* sx, int warp, int lane, int ncols, const int32_t* exc,
                                        int64_t e0, int64_t e1) {
  const uint32_t t0 = lut[0], t1 = lut[1], t2 = lut[2], t3 = lut[3];
  const int p = 2 * lane;
  const int lo_at = zipserv::cpu::pk_lo_byte(0, p);
  const int code_at = zipserv::cpu::pk_code_byte(0, p);  // positions p and p + 1 share it, in consecutive bytes
  const int shift = 4 * zipserv::cpu::pk_code_nibble(p);
#pragma unroll
  for (int kg = 0; kg < 4; ++kg) {
    uint32_t af[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int f = a_frag_ft(warp, kg, j);
      const uint8_t* r = rec + (f - warp * kFtPerMed) * kPkFtBytes;
      const uint32_t lo = *reinterpret_cast<const uint16_t*>(r + lo_at);
      const uint32_t cw = *reinterpret_cast<const uint16_t*>(r + code_at);
      af[j] = packed_pair(lo, cw, shift, t0, t1, t2, t3);
      if (kExceptions) af[j] = patch_pair(af[j], exc, e0, e1, f, lane);
    }
    fused::Fused<NT8>::mma_slice(acc, af, sx, kg, lane, ncols);
  }
}

// kXFast: X is 16-byte aligned and K a multiple of 64, so every X chunk is one 16-byte cp.async
// (the general instance also handles ragged K and unaligned X, element by element).
template <int NT8, bool kXFast>
__device__ __forceinline__ void packed_block(const PackedGemmArgs& p, int col0, int tm, int part) {
  using F = fused::Fused<NT8>;
  constexpr int TN = F::TN;
  const GemmArgs& a = p.g;
  ZS_SHARED(uint8_t, wrec, [2][kWarps][kWarpRecBytes]);
  ZS_SHARED(uint32_t, lut, [2][4]);
  ZS_SHARED(uint16_t, xs, [2][TN * kTile]);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kt_total = (a.K + kTile - 1) / kTile;
  int kb, ke;
  splitk_range(kt_total, a.split, part, &kb, &ke);
  const int nt = ke > kb ? ke - kb : 0;
  const int64_t g0 = static_cast<int64_t>(tm) * kt_total + kb;  // the block's first tile
  const int ncols = a.N - col0;

  // Per-thread sources, advanced by one tile per K step: the warp's 16 FT records (3 chunks per
  // lane), the table (thread 0), and in the fast case this thread's X chunk (row c / 8, chunk c % 8).
  const uint8_t* wsrc = p.tiles + g0 * kPkTileBytes + warp * kWarpRecBytes + lane * kChunk;
  const uint8_t* lsrc = p.luts + g0 * zipserv::cpu::kPkLutEntries;
  const int xc = threadIdx.x, xn = col0 + xc / 8;
  const uint16_t* xsrc = a.x + static_cast<int64_t>(xn < a.N ? xn : 0) * a.K + kb * kTile + (xc % 8) * 8;
  const int xdst = x_smem_index(xc / 8, (xc % 8) * 8);
  const int xbytes = xn < a.N ? 16 : 0;
  auto issue = [&](int s, int i) {
    const uint8_t* w = wsrc + static_cast<int64_t>(i) * kPkTileBytes;
#pragma unroll
    for (int c = 0; c < kWarpRecBytes / kChunk / 32; ++c)
      cp_async16(&wrec[s][warp][(lane + 32 * c) * kChunk], w + 32 * c * kChunk);
    if (threadIdx.x == 0) cp_async16(lut[s], lsrc + i * zipserv::cpu::kPkLutEntries);
    if (kXFast) {
      if (TN * 8 >= kThreads || xc < TN * 8) cp_async16(xs[s] + xdst, xsrc + i * kTile, xbytes);
    } else {
      F::issue_x(xs[s], a, col0, kb + i);
    }
  };
  static_assert(kWarpRecBytes % (32 * kChunk) == 0 && TN * 8 <= kThreads, "one chunk per thread per K tile");

  float acc[NT8][4];
#pragma unroll
  for (int t = 0; t < NT8; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
  const int64_t* es = p.exc_start + g0;
  // Main loop: every tile without exceptions (one barrier per tile, the next tile in flight).
  if (nt > 0) issue(0, 0);
  cp_async_commit();
  bool any_exc = false;
  for (int i = 0; i < nt; ++i) {
    cp_async_wait_all();
    __syncthreads();  // tile i landed for every warp; every warp is done with buffer (i + 1) % 2
    if (i + 1 < nt) issue((i + 1) & 1, i + 1);
    cp_async_commit();
    if (es[i + 1] > es[i]) {  // uniform over the block: left to the loop below
      any_exc = true;
      continue;
    }
    const int s = i & 1;
    compute<NT8, false>(acc, wrec[s][warp], lut[s], xs[s], warp, lane, ncols, p.exc, 0, 0);
  }
  // Tiles with exceptions (rare in trained weights: ~1 element in 10^5), staged again one at a time
  // and decoded with the exceptions patched in; kept out of the main loop so it stays short.
  if (any_exc) {
    for (int i = 0; i < nt; ++i) {
      const int64_t e0 = es[i], e1 = es[i + 1];
      if (e1 == e0) continue;
      __syncthreads();  // every warp is done with buffer 0
      issue(0, i);
      cp_async_commit();
      cp_async_wait_all();
      __syncthreads();
      compute<NT8, true>(acc, wrec[0][warp], lut[0], xs[0], warp, lane, ncols, p.exc, e0, e1);
    }
  }

  fused::store_acc<NT8>(a, acc, tm, col0, part, warp, lane);
}

template <int NT8, bool kXFast>
__global__ void __launch_bounds__(kThreads) packed_kernel(PackedGemmArgs p) {
  packed_block<NT8, kXFast>(p, blockIdx.x * (8 * NT8), blockIdx.y, blockIdx.z);
}

}  // namespace packed
}  // namespace cuda
}  // namespace zipserv
