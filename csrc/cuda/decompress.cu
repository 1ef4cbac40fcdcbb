// Standalone decompress: TCA-TBE v1 tiles -> row-major bf16 [M, K], bit-exact.
// One 64x64 tile per block; warp w decodes medium tile w with the same staging
// (warp_segment) and the same per-lane decode (decode_lane_pair) as the fused
// kernel. Padding positions (rows >= M, columns >= K) are never written.
// This kernel plus torch.matmul is the decoupled path (large N).
#include "device_common.cuh"
#include "launch.h"

namespace zipserv {
namespace cuda {
namespace {

using namespace zipserv::gemm;
using namespace zipserv::dev;

__global__ void __launch_bounds__(kThreads) decompress_kernel(DecompressArgs a) {
  ZS_SHARED(uint64_t, bmp, [kPlanes * kFragsPerTile]);
  ZS_SHARED(uint8_t, st_sm, [kWarps][kSmStageBytes]);
  ZS_SHARED(uint16_t, st_fb, [kWarps][kFbStageElems]);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kt = (a.K + kTile - 1) / kTile;
  const int64_t g = blockIdx.x;
  const int tm = static_cast<int>(g / kt), tk = static_cast<int>(g % kt);

  issue_bitmaps(bmp, a.bitmaps, g);
  cp_async_commit();
  const int64_t o_sm = a.offsets[2 * g], o_fb = a.offsets[2 * g + 1];
  const int base_exp = a.base[g];
  cp_async_wait_all();
  __syncthreads();

  int hb, hc;
  warp_counts(bmp, warp, lane, &hb, &hc);
  const WarpSegment seg = warp_segment(o_sm, o_fb, warp, hb, hc);
  issue_values(st_sm[warp], st_fb[warp], seg, a.sm, a.fb, lane);
  cp_async_commit();
  cp_async_wait_all();
  __syncwarp();

  ZS_SHARED(uint16_t, tile, [kTile * kOutPitch]);
  int hrun = 0;
#pragma unroll 4
  for (int i = 0; i < kFtPerMed; ++i) {
    const int f = warp * kFtPerMed + i;
    const uint64_t p0 = bmp[f], p1 = bmp[kFragsPerTile + f], p2 = bmp[2 * kFragsPerTile + f];
    const uint32_t v = decode_lane_pair(p0, p1, p2, base_exp, st_sm[warp], st_fb[warp], ft_sm_before(seg, hrun),
                                        ft_fb_before(seg, i, hrun), lane);
    hrun += popc64(indicator(p0, p1, p2));
    *reinterpret_cast<uint32_t*>(tile + out_tile_index(frag_row0(f) + lane / 4, frag_col0(f) + 2 * (lane % 4))) = v;
  }
  __syncwarp();
  store_tile_rows(tile, a.out, a.M, a.K, tm, tk, warp, lane);
}

}  // namespace

// Loads the kernel now (lazy module loading must not happen during graph capture).
int decompress_preload() {
  cudaFuncAttributes at;
  return static_cast<int>(cudaFuncGetAttributes(&at, decompress_kernel));
}

int decompress(const DecompressArgs& a, uintptr_t stream) {
  const int64_t g = tile_blocks(a.M, a.K);
  if (g == 0) return static_cast<int>(cudaErrorInvalidValue);
  ZS_LAUNCH(decompress_kernel, static_cast<unsigned>(g), kThreads, 0, reinterpret_cast<cudaStream_t>(stream))(a);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace cuda
}  // namespace zipserv
