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
  __shared__ __align__(16) uint64_t bmp[kPlanes * kFragsPerTile];
  __shared__ __align__(16) uint8_t st_sm[kWarps][kSmStageBytes];
  __shared__ __align__(16) uint16_t st_fb[kWarps][kFbStageElems];
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

  const bool k_even = (a.K & 1) == 0;
  int hrun = 0;
#pragma unroll 4
  for (int i = 0; i < kFtPerMed; ++i) {
    const int f = warp * kFtPerMed + i;
    const uint64_t p0 = bmp[f], p1 = bmp[kFragsPerTile + f], p2 = bmp[2 * kFragsPerTile + f];
    const uint32_t v = decode_lane_pair(p0, p1, p2, base_exp, st_sm[warp], st_fb[warp], seg.sm_local + hrun,
                                        seg.fb_local + i * kFragElems - hrun, lane);
    hrun += popc64(indicator(p0, p1, p2));
    const int row = tm * kTile + frag_row0(f) + lane / 4;
    const int col = tk * kTile + frag_col0(f) + 2 * (lane % 4);
    if (row < a.M) {
      uint16_t* dst = a.out + static_cast<int64_t>(row) * a.K + col;
      if (col + 1 < a.K) {
        if (k_even) {
          *reinterpret_cast<uint32_t*>(dst) = v;
        } else {
          dst[0] = static_cast<uint16_t>(v);
          dst[1] = static_cast<uint16_t>(v >> 16);
        }
      } else if (col < a.K) {
        dst[0] = static_cast<uint16_t>(v);
      }
    }
  }
}

}  // namespace

int decompress(const DecompressArgs& a, uintptr_t stream) {
  if (a.M < 1 || a.K < 1) return static_cast<int>(cudaErrorInvalidValue);
  const int64_t g = static_cast<int64_t>((a.M + kTile - 1) / kTile) * ((a.K + kTile - 1) / kTile);
  if (g > 0x7FFFFFFFLL) return static_cast<int>(cudaErrorInvalidValue);
  decompress_kernel<<<static_cast<unsigned>(g), kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(a);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace cuda
}  // namespace zipserv
