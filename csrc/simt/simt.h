// The SIMT harness: what the kernel sources see when g++ compiles them with
// ZIPSERV_SIMT (csrc/cuda/target.cuh includes this instead of cuda_runtime.h).
//
// A launch runs the grid's blocks one after another; the threads of a block
// run as fibers (csrc/simt/runtime.cpp) that switch only at the points where
// CUDA threads synchronise or exchange data: __syncthreads, __syncwarp, the
// warp intrinsics, mma.sync. So a block's threads really run concurrently in
// the sense that matters (any thread may be anywhere between two barriers),
// in an order the harness chooses (forward, reverse or seeded random, to
// expose code that depends on one). What the harness checks:
//
//  * __syncthreads / __syncwarp are barriers for the threads named; threads
//    waiting at different barriers, a thread that exits while others wait, a
//    warp whose lanes call different intrinsics: reported, never a hang;
//  * warp intrinsics exchange values across the 32 lanes as the PTX ISA
//    defines them (reading a lane outside the mask is reported);
//  * mma.sync.m16n8k16 is computed from the 32 lanes' registers with the
//    PTX ISA fragment tables (runtime.cpp, not the kernels' own maps);
//  * cp.async: the destination holds garbage (and, under AddressSanitizer,
//    is poisoned) from the issue until the issuing thread's wait, so a read
//    before its wait reads garbage or fails; source and destination must be
//    16-byte aligned, the destination inside the block's shared memory;
//  * shared memory starts as garbage; each __shared__ object and the dynamic
//    area are separate heap allocations of their exact size, so under
//    AddressSanitizer every access is checked against its allocation;
//  * under ThreadSanitizer, only barriers and __syncwarp order memory between
//    a block's threads: a shared-memory read/write pair not separated by one
//    is a reported race;
//  * launches: block and grid limits, dynamic shared memory against the
//    kernel's attribute (48 KiB unless cudaFuncSetAttribute raised it) and the
//    device limit, static shared memory <= 48 KiB.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <type_traits>

// ------------------------------------------------------------ CUDA keywords
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

// ------------------------------------------------------------ CUDA types
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
typedef struct CUstream_st* cudaStream_t;

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchFailure = 719,
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
struct cudaFuncAttributes {
  size_t sharedSizeBytes;
  int maxThreadsPerBlock;
  int maxDynamicSharedSizeBytes;
};

namespace simt {

// ------------------------------------------------------------ runtime API
const dim3& thread_idx();
const dim3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();

void syncthreads(const char* file, int line);
void syncwarp(unsigned mask, const char* file, int line);

enum class Op : int { ReduceAdd, ShflIdx, ShflUp, ShflDown, ShflXor, Ballot, Any, All, SyncWarp, Mma };
// One warp-collective operation of the calling lane; returns its result.
uint32_t collective(Op op, unsigned mask, uint32_t value, int arg, int width, const char* file, int line);

void cp_async(void* dst, const void* src, int cp_size, int src_bytes, const char* file, int line);
void cp_async_commit();
void cp_async_wait_all(const char* file, int line);
void mma_m16n8k16_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, const char* file, int line);

// Storage of a __shared__ object (one per block and declaration; `tag` names
// the declaration) and of the dynamic shared memory.
void* shared_object(const void* tag, size_t bytes);
unsigned char* dynamic_shared();

template <class T>
T* shared(const void* tag) {
  static_assert(std::is_trivially_default_constructible<T>::value, "__shared__ objects have no constructor");
  return static_cast<T*>(shared_object(tag, sizeof(T)));
}

// Launches (synchronous); errors go to cudaGetLastError.
void launch_grid(const void* kernel, const char* name, dim3 grid, dim3 block, size_t smem, const char* file,
                 int line, const std::function<void()>& body);
cudaError_t set_max_dynamic_shared(const void* kernel, int bytes);
int max_dynamic_shared(const void* kernel);
cudaError_t last_error_and_clear();
const char* error_string(cudaError_t e);

template <class... P>
struct Launch {
  void (*kernel)(P...);
  const char* name;
  dim3 grid, block;
  size_t smem;
  const char* file;
  int line;
  template <class... A>
  void operator()(A&&... args) const {
    // Every thread calls the kernel with its own copy of the parameters.
    launch_grid(reinterpret_cast<const void*>(kernel), name, grid, block, smem, file, line,
                [&]() { kernel(args...); });
  }
};

template <class... P>
Launch<P...> make_launch(void (*kernel)(P...), const char* name, dim3 grid, dim3 block, size_t smem,
                         cudaStream_t /*stream: launches are synchronous*/, const char* file, int line) {
  return Launch<P...>{kernel, name, grid, block, smem, file, line};
}

}  // namespace simt

// ------------------------------------------------------------ target macros
#define ZS_LAUNCH(kernel, grid, block, smem, stream) \
  ::simt::make_launch(kernel, #kernel, (grid), (block), (smem), (stream), __FILE__, __LINE__)
#define ZS_SHARED(T, name, dims)    \
  static const char name##_simt_tag = 0; \
  auto& name = *::simt::shared<T dims>(&name##_simt_tag)
#define ZS_DYNAMIC_SHARED(name) unsigned char* const name = ::simt::dynamic_shared()

// ------------------------------------------------------------ built-ins
#define threadIdx (::simt::thread_idx())
#define blockIdx (::simt::block_idx())
#define blockDim (::simt::block_dim())
#define gridDim (::simt::grid_dim())

// Built-in functions: the default arguments name the caller's line in reports.
#define SIMT_HERE const char* file = __builtin_FILE(), int line = __builtin_LINE()

inline void __syncthreads(SIMT_HERE) { ::simt::syncthreads(file, line); }
inline void __syncwarp(unsigned mask = 0xFFFFFFFFu, SIMT_HERE) { ::simt::syncwarp(mask, file, line); }
inline unsigned __reduce_add_sync(unsigned mask, unsigned v, SIMT_HERE) {
  return ::simt::collective(::simt::Op::ReduceAdd, mask, v, 0, 32, file, line);
}
inline unsigned __ballot_sync(unsigned mask, int p, SIMT_HERE) {
  return ::simt::collective(::simt::Op::Ballot, mask, p ? 1u : 0u, 0, 32, file, line);
}
inline int __any_sync(unsigned mask, int p, SIMT_HERE) {
  return static_cast<int>(::simt::collective(::simt::Op::Any, mask, p ? 1u : 0u, 0, 32, file, line));
}
inline int __all_sync(unsigned mask, int p, SIMT_HERE) {
  return static_cast<int>(::simt::collective(::simt::Op::All, mask, p ? 1u : 0u, 0, 32, file, line));
}

namespace simt {
template <class T>
T shfl(Op op, unsigned mask, T v, int arg, int width, const char* file, int line) {
  static_assert(sizeof(T) == 4, "the harness exchanges 32-bit values");
  uint32_t u;
  __builtin_memcpy(&u, &v, 4);
  u = collective(op, mask, u, arg, width, file, line);
  __builtin_memcpy(&v, &u, 4);
  return v;
}
}  // namespace simt

template <class T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32, SIMT_HERE) {
  return ::simt::shfl(::simt::Op::ShflIdx, mask, v, src, width, file, line);
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32, SIMT_HERE) {
  return ::simt::shfl(::simt::Op::ShflUp, mask, v, static_cast<int>(d), width, file, line);
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32, SIMT_HERE) {
  return ::simt::shfl(::simt::Op::ShflDown, mask, v, static_cast<int>(d), width, file, line);
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32, SIMT_HERE) {
  return ::simt::shfl(::simt::Op::ShflXor, mask, v, lane_mask, width, file, line);
}

inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }

// Atomics: compiled in the kernel's own translation unit, so a sanitizer sees
// them as atomic accesses (relaxed, like CUDA's).
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline int atomicMax(int* p, int v) {
  int old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (old < v && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}
inline unsigned atomicOr(unsigned* p, unsigned v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
inline unsigned long long atomicOr(unsigned long long* p, unsigned long long v) {
  return __atomic_fetch_or(p, v, __ATOMIC_RELAXED);
}

// ------------------------------------------------------------ runtime calls
inline cudaError_t cudaGetLastError() { return ::simt::last_error_and_clear(); }
inline const char* cudaGetErrorString(cudaError_t e) { return ::simt::error_string(e); }
template <class... P>
cudaError_t cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaErrorInvalidValue;
  return ::simt::set_max_dynamic_shared(reinterpret_cast<const void*>(kernel), value);
}
template <class... P>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* at, void (*kernel)(P...)) {
  at->sharedSizeBytes = 0;
  at->maxThreadsPerBlock = 1024;
  at->maxDynamicSharedSizeBytes = ::simt::max_dynamic_shared(reinterpret_cast<const void*>(kernel));
  return cudaSuccess;
}
