// Fused ZipGEMM instance tile_n = 32 (NT8 = 4); see zipgemm_kernel.cuh.
#include "zipgemm_kernel.cuh"

namespace zipserv {
namespace cuda {
namespace fused {
ZIPSERV_FUSED_INSTANCE(4)
}  // namespace fused
}  // namespace cuda
}  // namespace zipserv
