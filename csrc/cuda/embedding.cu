// zipserv::embedding on a GPU: see gather_layout.cuh (the block body).
#include "gather_layout.cuh"
#include "target.cuh"
#include "launch.h"

namespace zipserv {
namespace cuda {
namespace {

using namespace zipserv::gather;

__global__ void __launch_bounds__(kThreads) embedding_kernel(GatherArgs a) {
  ZS_SHARED(Shared, s, );
  const int64_t i = blockIdx.x;
  const int tk = static_cast<int>(blockIdx.y), t = static_cast<int>(threadIdx.x);
  const int64_t row = gather_row(a, i);
  const int64_t g = gather_tile(a, row, tk);
  gather_load(a, g, t, s);
  __syncthreads();
  if (t == 0) gather_scan(g, s);
  __syncthreads();
  gather_decode(a, i, row, g, tk, t, s);
}

}  // namespace

int embedding_preload() {
  cudaFuncAttributes at;
  return static_cast<int>(cudaFuncGetAttributes(&at, embedding_kernel));
}

int embedding_gather(const GatherArgs& a, uintptr_t stream) {
  if (a.n == 0) return 0;
  if (a.n < 0 || a.M < 1 || a.K < 1 || a.rows < a.M || a.n > 0x7FFFFFFFLL) return static_cast<int>(cudaErrorInvalidValue);
  const int64_t kt = (a.K + kTile - 1) / kTile;
  if (kt > 65535) return static_cast<int>(cudaErrorInvalidValue);
  const dim3 grid(static_cast<unsigned>(a.n), static_cast<unsigned>(kt));
  ZS_LAUNCH(embedding_kernel, grid, kThreads, 0, reinterpret_cast<cudaStream_t>(stream))(a);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace cuda
}  // namespace zipserv
