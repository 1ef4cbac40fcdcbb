// Device-only helpers of the ZipServ kernels: cp.async, mma.sync, and the
// staging of one tile's compressed data that the fused and the decompress
// kernels share. The index math lives in zipgemm_layout.cuh; this file only
// moves bytes. The inline PTX is confined to the four functions below; under
// the SIMT harness (target.cuh) they call its host twins, which check how
// they are used (csrc/simt/simt.h).
#pragma once

#include "target.cuh"

#include <cstdint>

#include "zipgemm_layout.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "zipserv kernels need compute capability 8.0 or newer (cp.async, mma.sync bf16)"
#endif

namespace zipserv {
namespace dev {

using namespace zipserv::gemm;

#if defined(ZIPSERV_SIMT)

// Host twins (csrc/simt/runtime.cpp); the harness names the caller's line in its reports.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes = 16,
                                           const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::simt::cp_async(dst, src, 16, src_bytes, file, line);
}
__device__ __forceinline__ void cp_async_commit() { ::simt::cp_async_commit(); }
__device__ __forceinline__ void cp_async_wait_all(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::simt::cp_async_wait_all(file, line);
}
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                               const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::simt::mma_m16n8k16_bf16(c, a, b0, b1, file, line);
}

#else

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; src_bytes = 0 zero-fills the destination.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes = 16) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// D = A * B + D, m16n8k16, bf16 inputs, fp32 accumulation.
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#endif

// Bit-planes of tile g (1536 bytes = 96 chunks) into shared memory, by
// threads 0..95 of the block.
__device__ __forceinline__ void issue_bitmaps(uint64_t* dst, const uint64_t* bitmaps, int64_t g) {
  const int t = threadIdx.x;
  if (t < kBmpBytes / kChunk) cp_async16(reinterpret_cast<char*>(dst) + t * kChunk,
                                         reinterpret_cast<const char*>(bitmaps + g * kPlanes * kFragsPerTile) + t * kChunk);
}

// Per-warp counts from a tile's bit-planes in shared memory (FORMAT.md s.5):
// hb = high-frequency elements before FT 16 w, hc = inside FTs 16 w .. 16 w + 15.
__device__ __forceinline__ void warp_counts(const uint64_t* bmp, int warp, int lane, int* hb, int* hc) {
  const int pc_lo = popc64(indicator(bmp[lane], bmp[kFragsPerTile + lane], bmp[2 * kFragsPerTile + lane]));
  const int pc_hi = popc64(indicator(bmp[lane + 32], bmp[kFragsPerTile + lane + 32], bmp[2 * kFragsPerTile + lane + 32]));
  int before, inside;
  lane_count_share(warp, lane, pc_lo, pc_hi, &before, &inside);
  *hb = static_cast<int>(__reduce_add_sync(0xFFFFFFFFu, static_cast<unsigned>(before)));
  *hc = static_cast<int>(__reduce_add_sync(0xFFFFFFFFu, static_cast<unsigned>(inside)));
}

// Warp-cooperative copy of the warp's value sub-segments into its staging.
__device__ __forceinline__ void issue_values(uint8_t* st_sm, uint16_t* st_fb, const WarpSegment& s,
                                             const uint8_t* sm, const uint16_t* fb, int lane) {
  for (int c = lane; c < s.sm_chunks; c += 32) cp_async16(st_sm + c * kChunk, sm + s.sm_begin + c * kChunk);
  for (int c = lane; c < s.fb_chunks; c += 32) cp_async16(st_fb + c * 8, fb + s.fb_begin + c * 8);
}

// The decompress kernels' store: warp w's rows of a decoded tile (tile rows 16 w .. 16 w + 15,
// staged at out_tile_index) to row-major bf16 out [M, K], 16 bytes per lane where the row chunk is
// inside the matrix and aligned, element by element at the edges; padding is never written.
__device__ __forceinline__ void store_tile_rows(const uint16_t* tile, uint16_t* out, int M, int K, int tm, int tk,
                                                int warp, int lane) {
  const bool vec = (K % 8 == 0) && ((reinterpret_cast<uintptr_t>(out) & 15) == 0);
  for (int c = lane; c < kMedRows * 8; c += 32) {
    const int r = warp * kMedRows + c / 8, c0 = (c % 8) * 8;
    const int row = tm * kTile + r, col = tk * kTile + c0;
    if (row >= M) continue;
    const uint16_t* src = tile + out_tile_index(r, c0);
    uint16_t* dst = out + static_cast<int64_t>(row) * K + col;
    if (vec && col + 8 <= K) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      for (int e = 0; e < 8; ++e)
        if (col + e < K) dst[e] = src[e];
    }
  }
}

}  // namespace dev
}  // namespace zipserv
