// Entry point of the harness self-tests (csrc/simt/selftest.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace simt {
namespace selftest {

struct Result {
  int error = 0;            // cudaError_t of the launch (0 = success)
  std::string message;      // cudaGetErrorString of it
  std::vector<uint32_t> out;
};

// Runs self-test kernel `name` as one block of `threads` threads on inputs `in`.
Result run(const std::string& name, const std::vector<uint32_t>& in, int threads, int arg, int width, int op,
           int dynamic_smem);

}  // namespace selftest
}  // namespace simt
