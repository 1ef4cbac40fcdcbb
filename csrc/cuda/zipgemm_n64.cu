// Fused ZipGEMM instance tile_n = 64 (NT8 = 8); see zipgemm_kernel.cuh.
#include "zipgemm_kernel.cuh"

namespace zipserv {
namespace cuda {
namespace fused {
ZIPSERV_FUSED_INSTANCE(8)
}  // namespace fused
}  // namespace cuda
}  // namespace zipserv
