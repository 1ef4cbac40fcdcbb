// Packer of the CPU byte-split layout (csrc/cpu_gemm/pack.cpp).
#pragma once

#include <cstdint>
#include <vector>

namespace zipserv {
namespace cpu {

struct PackJob {
  const uint16_t* w;  // [m][k] bf16 bits, row-major
  int64_t m, k, mt, kt;
  uint8_t* tiles;     // [mt * kt][kPkTileBytes]
  uint8_t* luts;      // [mt * kt][16]
};

// Fills job.tiles / job.luts and exc_start[0 .. mt*kt]; returns the exceptions.
std::vector<uint32_t> pack_matrix(const PackJob& job, int threads, int64_t* exc_start);

}  // namespace cpu
}  // namespace zipserv
