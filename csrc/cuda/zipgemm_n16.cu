// Fused ZipGEMM instance tile_n = 16 (NT8 = 2); see zipgemm_kernel.cuh.
#include "zipgemm_kernel.cuh"

namespace zipserv {
namespace cuda {
namespace fused {
ZIPSERV_FUSED_INSTANCE(2)
}  // namespace fused
}  // namespace cuda
}  // namespace zipserv
