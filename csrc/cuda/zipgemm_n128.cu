// Fused ZipGEMM instance tile_n = 128 (NT8 = 16); see zipgemm_kernel.cuh.
#include "zipgemm_kernel.cuh"

namespace zipserv {
namespace cuda {
namespace fused {
ZIPSERV_FUSED_INSTANCE(16)
}  // namespace fused
}  // namespace cuda
}  // namespace zipserv
