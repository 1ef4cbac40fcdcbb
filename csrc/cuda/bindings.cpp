// pybind11 module zipserv_vllm._cuda (compiled by the host compiler; the
// kernels are in the nvcc-built objects). The same bindings, compiled with
// ZIPSERV_SIMT, are the kernel half of zipserv_vllm._simt (csrc/simt/module.cpp),
// where the kernels are the same sources run by the SIMT harness on the CPU. Every pointer is a Python int
// (tensor.data_ptr()), the stream is torch.cuda.current_stream().cuda_stream:
// no torch C++ ABI, cudart only. Errors become RuntimeError naming the call.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "zipgemm_layout.cuh"
#include "launch.h"

namespace py = pybind11;
using namespace zipserv::cuda;

namespace {

template <typename T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

void check(int err, const char* what) {
  if (err != 0) throw std::runtime_error(std::string("zipserv CUDA ") + what + " failed: " + error_string(err));
}

}  // namespace

namespace zipserv {
namespace cuda {

void bind_kernels(py::module_& m) {
  m.def("tile_ns", []() { return py::make_tuple(8, 16, 32, 64, 128); },
        "Columns per block of the fused kernel instances");
  m.def("fused_smem_bytes", [](int tile_n) { return zipserv::gemm::fused_smem_bytes(tile_n); },
        "Dynamic shared memory of the fused kernel for tile_n columns (fixed per instance)");
  m.def("splitk_parts", [](int kt, int split) { return zipserv::gemm::splitk_parts(kt, split); },
        "Non-empty K parts when Kt tiles are split `split` ways");

  m.def("prepare", []() { check(prepare_current_device(), "prepare (cudaFuncSetAttribute)"); },
        "Set kernel attributes once on the current device (before any launch or graph capture)");

  m.def(
      "zipgemm",
      [](uintptr_t x, uintptr_t bitmaps, uintptr_t base, uintptr_t offsets, uintptr_t sm, uintptr_t fb,
         uintptr_t bias, uintptr_t y, uintptr_t ws, int M, int K, int N, int tile_n, int split, int x_vec,
         uintptr_t stream) {
        GemmArgs a{ptr<const uint64_t>(bitmaps), ptr<const uint8_t>(base), ptr<const int64_t>(offsets),
                   ptr<const uint8_t>(sm), ptr<const uint16_t>(fb), ptr<const uint16_t>(x),
                   ptr<const uint16_t>(bias), ptr<uint16_t>(y), ptr<float>(ws), M, K, N, split, x_vec};
        check(zipgemm(a, tile_n, stream), "zipgemm");
      },
      py::arg("x"), py::arg("bitmaps"), py::arg("base"), py::arg("offsets"), py::arg("sm"), py::arg("fb"),
      py::arg("bias"), py::arg("y"), py::arg("ws"), py::arg("M"), py::arg("K"), py::arg("N"), py::arg("tile_n"),
      py::arg("split"), py::arg("x_vec"), py::arg("stream"),
      "Fused ZipGEMM launch (split = non-empty K parts; ws holds split*N*M fp32 when split > 1)");

  m.def(
      "zipgemm_packed",
      [](uintptr_t x, uintptr_t tiles, uintptr_t luts, uintptr_t exc_start, uintptr_t exc, uintptr_t bias,
         uintptr_t y, uintptr_t ws, int M, int K, int N, int tile_n, int split, int x_vec, uintptr_t stream) {
        PackedGemmArgs p{ptr<const uint8_t>(tiles), ptr<const uint8_t>(luts), ptr<const int64_t>(exc_start),
                         ptr<const int32_t>(exc),
                         GemmArgs{nullptr, nullptr, nullptr, nullptr, nullptr, ptr<const uint16_t>(x),
                                  ptr<const uint16_t>(bias), ptr<uint16_t>(y), ptr<float>(ws), M, K, N, split, x_vec}};
        check(zipgemm_packed(p, tile_n, stream), "zipgemm_packed");
      },
      py::arg("x"), py::arg("tiles"), py::arg("luts"), py::arg("exc_start"), py::arg("exc"), py::arg("bias"),
      py::arg("y"), py::arg("ws"), py::arg("M"), py::arg("K"), py::arg("N"), py::arg("tile_n"), py::arg("split"),
      py::arg("x_vec"), py::arg("stream"),
      "Fused GEMM over the byte-split layout (docs/FORMAT.md appendix A), tile_n 8 or 16");

  m.def(
      "zipgemm_grouped",
      [](uintptr_t weights, uintptr_t expert_rows, uintptr_t x, uintptr_t y, int M, int K, int E, int rows,
         int tile_n, int x_vec, uintptr_t stream) {
        GroupedGemmArgs g{ptr<const uint64_t>(weights), ptr<const int32_t>(expert_rows), ptr<const uint16_t>(x),
                          ptr<uint16_t>(y), M, K, E, rows, x_vec};
        check(zipgemm_grouped(g, tile_n, stream), "zipgemm_grouped");
      },
      py::arg("weights"), py::arg("expert_rows"), py::arg("x"), py::arg("y"), py::arg("M"), py::arg("K"),
      py::arg("E"), py::arg("rows"), py::arg("tile_n"), py::arg("x_vec"), py::arg("stream"),
      "Grouped fused ZipGEMM (one launch over the experts): weights = int64 [E, 5] addresses of each expert's "
      "bitmaps, base, offsets, sm, fb; expert_rows = int32 [E + 1] row starts of X [rows, K] / Y [rows, M]");

  m.def(
      "decompress",
      [](uintptr_t bitmaps, uintptr_t base, uintptr_t offsets, uintptr_t sm, uintptr_t fb, uintptr_t out, int M,
         int K, uintptr_t stream) {
        DecompressArgs a{ptr<const uint64_t>(bitmaps), ptr<const uint8_t>(base), ptr<const int64_t>(offsets),
                         ptr<const uint8_t>(sm), ptr<const uint16_t>(fb), ptr<uint16_t>(out), M, K};
        check(decompress(a, stream), "decompress");
      },
      "Decompress to row-major bf16 [M, K]");

  m.def(
      "decompress_packed",
      [](uintptr_t tiles, uintptr_t luts, uintptr_t exc_start, uintptr_t exc, uintptr_t out, int M, int K,
         uintptr_t stream) {
        PackedDecompressArgs a{ptr<const uint8_t>(tiles), ptr<const uint8_t>(luts), ptr<const int64_t>(exc_start),
                               ptr<const int32_t>(exc), ptr<uint16_t>(out), M, K};
        check(decompress_packed(a, stream), "decompress_packed");
      },
      py::arg("tiles"), py::arg("luts"), py::arg("exc_start"), py::arg("exc"), py::arg("out"), py::arg("M"),
      py::arg("K"), py::arg("stream"),
      "Decompress a weight in the byte-split layout (docs/FORMAT.md appendix A) to row-major bf16 [M, K]");

  m.def(
      "embedding_gather",
      [](uintptr_t ids, int ids_int64, int64_t n, uintptr_t bitmaps, uintptr_t base, uintptr_t offsets,
         uintptr_t sm, uintptr_t fb, uintptr_t out, int M, int K, int64_t rows, uintptr_t stream) {
        zipserv::gather::GatherArgs a{reinterpret_cast<const void*>(ids), ids_int64, n, ptr<const uint64_t>(bitmaps),
                                      ptr<const uint8_t>(base), ptr<const int64_t>(offsets), ptr<const uint8_t>(sm),
                                      ptr<const uint16_t>(fb), ptr<uint16_t>(out), M, K, rows};
        check(embedding_gather(a, stream), "embedding_gather");
      },
      "Rows ids of a compressed table (vocabulary padding rows M..rows-1 read zeros) into bf16 out [n, K]");

  m.def(
      "encode_tiles",
      [](uintptr_t w, int M, int K, int tm0, int tm_count, uintptr_t bitmaps, uintptr_t base, uintptr_t hcount,
         uintptr_t scratch_sm, uintptr_t scratch_fb, uintptr_t stream) {
        EncodeArgs a{ptr<const uint16_t>(w), M, K, tm0, tm_count, ptr<uint64_t>(bitmaps), ptr<uint8_t>(base),
                     ptr<int64_t>(hcount), ptr<uint8_t>(scratch_sm), ptr<uint16_t>(scratch_fb)};
        check(encode_tiles(a, stream), "encode_tiles");
      },
      "Encoder pass 1: windows, bit-planes, per-tile compaction into scratch, H per tile");

  m.def(
      "encode_scatter",
      [](uintptr_t hcount, uintptr_t offsets, uintptr_t scratch_sm, uintptr_t scratch_fb, uintptr_t sm,
         uintptr_t fb, int64_t G, uintptr_t stream) {
        ScatterArgs a{ptr<const int64_t>(hcount), ptr<const int64_t>(offsets), ptr<const uint8_t>(scratch_sm),
                      ptr<const uint16_t>(scratch_fb), ptr<uint8_t>(sm), ptr<uint16_t>(fb), G};
        check(encode_scatter(a, stream), "encode_scatter");
      },
      "Encoder pass 2: copy each tile's scratch into its canonical segments");
}

}  // namespace cuda
}  // namespace zipserv

#if !defined(ZIPSERV_SIMT)
PYBIND11_MODULE(_cuda, m) {
  m.doc() = "zipserv-vllm CUDA kernels: fused ZipGEMM, decompress, GPU encoder (TCA-TBE v1)";
  zipserv::cuda::bind_kernels(m);
}
#endif
