// Fused ZipGEMM instance tile_n = 8 (NT8 = 1); see zipgemm_kernel.cuh.
#include "zipgemm_kernel.cuh"

namespace zipserv {
namespace cuda {
namespace fused {
ZIPSERV_FUSED_INSTANCE(1)
}  // namespace fused
}  // namespace cuda
}  // namespace zipserv
