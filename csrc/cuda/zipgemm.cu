// Host side of the fused ZipGEMM: picks the instance for tile_n (the kernels
// are compiled one per file, zipgemm_n*.cu, from zipgemm_kernel.cuh), launches
// the split-K reduction or the grouped (mixture-of-experts) kernel, sets the
// kernel attributes once per device.
#include "device_common.cuh"
#include "launch.h"

namespace zipserv {
namespace cuda {
// Entry points of the fused instances (zipgemm_n*.cu).
namespace fused {
#define ZIPSERV_FUSED_DECL(NT8)                                            \
  int launch_nt8_##NT8(const GemmArgs& a, cudaStream_t st);                  \
  int launch_grouped_nt8_##NT8(const GroupedGemmArgs& g, cudaStream_t st);   \
  int set_attr_nt8_##NT8();
ZIPSERV_FUSED_DECL(1)
ZIPSERV_FUSED_DECL(2)
ZIPSERV_FUSED_DECL(4)
ZIPSERV_FUSED_DECL(8)
ZIPSERV_FUSED_DECL(16)
#undef ZIPSERV_FUSED_DECL
}  // namespace fused
// Entry points of the byte-split-layout instances (zipgemm_packed.cu).
namespace packed {
int launch_nt8_1(const PackedGemmArgs& p, cudaStream_t st);
int launch_nt8_2(const PackedGemmArgs& p, cudaStream_t st);
int preload();
int decompress_preload();  // decompress_packed.cu
}  // namespace packed

namespace {

using namespace zipserv::gemm;

// Sums the split parts in order, adds the bias, rounds once to bf16. Any M, N.
__global__ void __launch_bounds__(256) splitk_reduce(const float* ws, const uint16_t* bias, uint16_t* y,
                                                     int64_t mn, int M, int parts) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < mn;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] = f32_to_bf16_bits(epilogue_sum(ws + i, mn, parts, bias, static_cast<int>(i % M)));
  }
}

// The split-K parts of a.ws summed into a.y (with the bias).
int reduce_parts(const GemmArgs& a, cudaStream_t st) {
  const int64_t mn = static_cast<int64_t>(a.M) * a.N;
  const int64_t blocks64 = (mn + 255) / 256;
  const int blocks = static_cast<int>(blocks64 < 8192 ? blocks64 : 8192);
  ZS_LAUNCH(splitk_reduce, blocks, 256, 0, st)(a.ws, a.bias, a.y, mn, a.M, a.split);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int zipgemm(const GemmArgs& a, int tile_n, uintptr_t stream) {
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  if (a.M < 1 || a.K < 1 || a.N < 1 || a.split < 1) return static_cast<int>(cudaErrorInvalidValue);
  if (a.split > 1 && a.ws == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  int err;
  switch (tile_n) {
    case 8: err = fused::launch_nt8_1(a, st); break;
    case 16: err = fused::launch_nt8_2(a, st); break;
    case 32: err = fused::launch_nt8_4(a, st); break;
    case 64: err = fused::launch_nt8_8(a, st); break;
    case 128: err = fused::launch_nt8_16(a, st); break;
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
  if (err != 0 || a.split == 1) return err;
  return reduce_parts(a, st);
}

int zipgemm_packed(const PackedGemmArgs& p, int tile_n, uintptr_t stream) {
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const GemmArgs& a = p.g;
  if (a.M < 1 || a.K < 1 || a.N < 1 || a.split < 1) return static_cast<int>(cudaErrorInvalidValue);
  if (a.split > 1 && a.ws == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  int err;
  switch (tile_n) {
    case 8: err = packed::launch_nt8_1(p, st); break;
    case 16: err = packed::launch_nt8_2(p, st); break;
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
  if (err != 0 || a.split == 1) return err;
  return reduce_parts(a, st);
}

int zipgemm_grouped(const GroupedGemmArgs& g, int tile_n, uintptr_t stream) {
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  if (g.M < 1 || g.K < 1 || g.E < 1 || g.E > 65535 || g.rows < 0) return static_cast<int>(cudaErrorInvalidValue);
  if (g.rows == 0) return 0;
  switch (tile_n) {
    case 8: return fused::launch_grouped_nt8_1(g, st);
    case 16: return fused::launch_grouped_nt8_2(g, st);
    case 32: return fused::launch_grouped_nt8_4(g, st);
    case 64: return fused::launch_grouped_nt8_8(g, st);
    case 128: return fused::launch_grouped_nt8_16(g, st);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

int prepare_current_device() {
  int err = fused::set_attr_nt8_1();
  if (!err) err = fused::set_attr_nt8_2();
  if (!err) err = fused::set_attr_nt8_4();
  if (!err) err = fused::set_attr_nt8_8();
  if (!err) err = fused::set_attr_nt8_16();
  if (!err) {
    cudaFuncAttributes at;
    err = static_cast<int>(cudaFuncGetAttributes(&at, splitk_reduce));
  }
  if (!err) err = packed::preload();
  if (!err) err = decompress_preload();
  if (!err) err = packed::decompress_preload();
  if (!err) err = embedding_preload();
  return err;
}

const char* error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // namespace cuda
}  // namespace zipserv
