// Byte-split-layout GEMM instances, tile_n 8 and 16 (NT8 = 1, 2); see zipgemm_packed.cuh.
#include "zipgemm_packed.cuh"

namespace zipserv {
namespace cuda {
namespace packed {

template <int NT8>
int launch(const PackedGemmArgs& p, cudaStream_t st) {
  constexpr int TN = 8 * NT8;
  const dim3 grid((p.g.N + TN - 1) / TN, (p.g.M + kTile - 1) / kTile, p.g.split);
  if (p.g.x_vec && p.g.K % kTile == 0) {
    ZS_LAUNCH((packed_kernel<NT8, true>), grid, kThreads, 0, st)(p);
  } else {
    ZS_LAUNCH((packed_kernel<NT8, false>), grid, kThreads, 0, st)(p);
  }
  return static_cast<int>(cudaGetLastError());
}

int launch_nt8_1(const PackedGemmArgs& p, cudaStream_t st) { return launch<1>(p, st); }
int launch_nt8_2(const PackedGemmArgs& p, cudaStream_t st) { return launch<2>(p, st); }

// Loads both instances now (lazy module loading must not happen during graph capture).
int preload() {
  cudaFuncAttributes at;
  int err = static_cast<int>(cudaFuncGetAttributes(&at, packed_kernel<1, true>));
  if (!err) err = static_cast<int>(cudaFuncGetAttributes(&at, packed_kernel<1, false>));
  if (!err) err = static_cast<int>(cudaFuncGetAttributes(&at, packed_kernel<2, true>));
  if (!err) err = static_cast<int>(cudaFuncGetAttributes(&at, packed_kernel<2, false>));
  return err;
}

}  // namespace packed
}  // namespace cuda
}  // namespace zipserv
