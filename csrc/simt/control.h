// Settings and counters of the SIMT harness (csrc/simt/runtime.cpp), for the
// Python module (csrc/simt/module.cpp). Kernel code never includes this.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace simt {

enum class Schedule : int { Forward = 0, Reverse = 1, Random = 2 };

struct Options {
  Schedule schedule = Schedule::Forward;  // order in which ready threads resume
  uint64_t seed = 1;                      // Random schedule, shared-memory garbage
  size_t device_max_dynamic_shared = 232448;  // opt-in limit per block (sm_90: 227 KiB)
  size_t max_static_shared = 48 * 1024;
};

struct Stats {
  uint64_t launches = 0, blocks = 0, threads = 0;
  uint64_t barriers = 0;     // completed __syncthreads
  uint64_t collectives = 0;  // completed warp collectives (incl. __syncwarp and mma)
  uint64_t mma = 0;          // completed mma.sync (per warp)
  uint64_t cp_async = 0;     // cp.async copies issued
  uint64_t switches = 0;     // fiber switches
};

Options& options();
Stats& stats();
// A fresh device: kernel attributes (cudaFuncSetAttribute) back to their defaults.
void reset_device();
// The message of the last launch that failed (empty if none since the last call).
std::string take_failure();
// Whether the build runs under AddressSanitizer / ThreadSanitizer.
bool asan_build();
bool tsan_build();

}  // namespace simt
