// Standalone decompress of the byte-split layout (docs/FORMAT.md appendix A):
// tiles -> row-major bf16 [M, K], bit-exact. The decoupled path of a weight
// held in that layout (large N: this kernel, then cuBLAS), and the decode of
// exact mode. One 64x64 tile per block; warp w rebuilds medium tile w (FTs
// 16 w .. 16 w + 15) with the fused kernel's per-lane decode (packed_pair: two
// 16-bit loads, five byte permutes) and its exception patch (patch_pair),
// straight from global memory (each record byte is read once), into a staged
// tile that store_tile_rows writes out. Padding (rows >= M, columns >= K) is
// never written.
#include "zipgemm_packed.cuh"

namespace zipserv {
namespace cuda {
namespace packed {
namespace {

__global__ void __launch_bounds__(kThreads) decompress_packed_kernel(PackedDecompressArgs a) {
  ZS_SHARED(uint16_t, tile, [kTile * kOutPitch]);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kt = (a.K + kTile - 1) / kTile;
  const int64_t g = blockIdx.x;
  const int tm = static_cast<int>(g / kt), tk = static_cast<int>(g % kt);

  const uint32_t* lut = reinterpret_cast<const uint32_t*>(a.luts + g * zipserv::cpu::kPkLutEntries);
  const uint32_t t0 = lut[0], t1 = lut[1], t2 = lut[2], t3 = lut[3];
  const int64_t e0 = a.exc_start[g], e1 = a.exc_start[g + 1];
  const int p = 2 * lane;
  const int lo_at = zipserv::cpu::pk_lo_byte(0, p), code_at = zipserv::cpu::pk_code_byte(0, p);
  const int shift = 4 * zipserv::cpu::pk_code_nibble(p);
  const uint8_t* rec = a.tiles + g * kPkTileBytes;
#pragma unroll 4
  for (int i = 0; i < kFtPerMed; ++i) {
    const int f = warp * kFtPerMed + i;
    const uint8_t* r = rec + f * kPkFtBytes;
    const uint32_t lo = *reinterpret_cast<const uint16_t*>(r + lo_at);
    const uint32_t cw = *reinterpret_cast<const uint16_t*>(r + code_at);
    uint32_t v = packed_pair(lo, cw, shift, t0, t1, t2, t3);
    if (e1 > e0) v = patch_pair(v, a.exc, e0, e1, f, lane);  // (uniform over the block)
    *reinterpret_cast<uint32_t*>(tile + out_tile_index(frag_row0(f) + lane / 4, frag_col0(f) + 2 * (lane % 4))) = v;
  }
  __syncwarp();
  store_tile_rows(tile, a.out, a.M, a.K, tm, tk, warp, lane);
}

}  // namespace

// Loads the kernel now (lazy module loading must not happen during graph capture).
int decompress_preload() {
  cudaFuncAttributes at;
  return static_cast<int>(cudaFuncGetAttributes(&at, decompress_packed_kernel));
}

}  // namespace packed

int decompress_packed(const PackedDecompressArgs& a, uintptr_t stream) {
  using zipserv::gemm::kThreads;
  const int64_t g = zipserv::gemm::tile_blocks(a.M, a.K);
  if (g == 0) return static_cast<int>(cudaErrorInvalidValue);
  ZS_LAUNCH(packed::decompress_packed_kernel, static_cast<unsigned>(g), kThreads, 0,
            reinterpret_cast<cudaStream_t>(stream))(a);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace cuda
}  // namespace zipserv
