// pybind11 module zipserv_vllm._cpu_gemm: the fused decode-GEMM CPU kernels.
//
// Arrays arrive as NumPy views of the CompressedTensor's torch tensors (no
// torch C++ ABI). This file checks them (shapes, dtypes, contiguity; the
// per-tile segment bounds are checked by the kernels), picks the kernel for
// the requested ISA and runs it on torch's OpenMP threads (parallel.cpp)
// with the GIL released.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <stdexcept>
#include <string>
#include <vector>

#include "zipserv/cpu_gemm.h"

namespace py = pybind11;
using namespace zipserv;
using namespace zipserv::cpu;

namespace {

std::vector<std::string> supported_isas() {
  std::vector<std::string> v;
  if (avx512_supported()) v.push_back("avx512");
  if (avx2_supported()) v.push_back("avx2");
  v.push_back("scalar");
  return v;
}

Kernel pick(const std::string& isa) {
  const auto ok = supported_isas();
  std::string want = isa == "auto" ? ok.front() : isa;
  bool found = false;
  for (const auto& s : ok) found |= s == want;
  if (!found) {
    std::string list;
    for (const auto& s : ok) list += (list.empty() ? "" : ", ") + s;
    throw std::invalid_argument("isa '" + isa + "' is not supported on this CPU (supported: " + list + ", auto)");
  }
  if (want == "avx512") return avx512_kernel();
  if (want == "avx2") return avx2_kernel();
  return scalar_kernel();
}

// kinds: the accepted NumPy dtype kinds ("u", "i", or "ui" for bit patterns,
// which may arrive as signed views of torch's int16 / int64 tensors).
void check(const py::array& a, const char* name, const char* kinds, int itemsize, std::vector<int64_t> shape) {
  const auto dt = a.dtype();
  if (std::string(kinds).find(dt.kind()) == std::string::npos || dt.itemsize() != itemsize) {
    throw std::invalid_argument(std::string(name) + " must have dtype kind '" + kinds + "' and " +
                                std::to_string(itemsize) + " bytes per item, got kind '" + dt.kind() + "' of " +
                                std::to_string(dt.itemsize()) + " bytes");
  }
  if (!(a.flags() & py::array::c_style)) throw std::invalid_argument(std::string(name) + " must be C-contiguous");
  bool same = static_cast<size_t>(a.ndim()) == shape.size();
  for (size_t i = 0; same && i < shape.size(); ++i) same = shape[i] < 0 || a.shape(i) == shape[i];
  if (!same) {
    std::string got, want;
    for (py::ssize_t i = 0; i < a.ndim(); ++i) got += (i ? ", " : "") + std::to_string(a.shape(i));
    for (size_t i = 0; i < shape.size(); ++i) want += (i ? ", " : "") + (shape[i] < 0 ? std::string("?") : std::to_string(shape[i]));
    throw std::invalid_argument(std::string(name) + " has shape [" + got + "], expected [" + want + "]");
  }
}

Matrix matrix(const py::array& bitmaps, const py::array& base, const py::array& offsets, const py::array& sm,
              const py::array& fb, int64_t m, int64_t k) {
  if (m < 1 || k < 1) throw std::invalid_argument("matrix shape must be positive, got " + std::to_string(m) + " x " + std::to_string(k));
  const int64_t mt = (m + kTile - 1) / kTile, kt = (k + kTile - 1) / kTile;
  check(bitmaps, "bitmaps", "ui", 8, {mt, kt, kPlanes, kFragsPerTile});
  check(base, "base", "u", 1, {mt, kt});
  check(offsets, "offsets", "i", 8, {mt, kt, 2});
  check(sm, "sm", "u", 1, {-1});
  check(fb, "fb", "ui", 2, {-1});
  return Matrix{static_cast<const uint64_t*>(bitmaps.data()), static_cast<const uint8_t*>(base.data()),
                static_cast<const int64_t*>(offsets.data()),  static_cast<const uint8_t*>(sm.data()),
                static_cast<int64_t>(sm.shape(0)),             static_cast<const uint16_t*>(fb.data()),
                static_cast<int64_t>(fb.shape(0)),             m, k, mt, kt};
}

void raise_bad(int64_t g, const Matrix& w) {
  if (g >= 0) {
    throw std::invalid_argument("tile (" + std::to_string(g / w.kt) + ", " + std::to_string(g % w.kt) +
                                ") has segment offsets outside the streams or misaligned");
  }
}

struct GemmCtx {
  const GemmJob* job;
  GemmRowsFn fn;
};
struct DecodeCtx {
  const DecodeJob* job;
  DecodeRowsFn fn;
};

void gemm(const py::array& x, const py::array& bitmaps, const py::array& base, const py::array& offsets,
          const py::array& sm, const py::array& fb, int64_t m, int64_t k, const py::object& bias,
          py::array out, int threads, const std::string& isa) {
  const Kernel kern = pick(isa);
  const Matrix w = matrix(bitmaps, base, offsets, sm, fb, m, k);
  check(x, "x", "ui", 2, {-1, k});
  const int64_t n = x.shape(0);
  check(out, "out", "ui", 2, {n, m});
  if (!out.writeable()) throw std::invalid_argument("out must be writeable");
  const uint16_t* bias_p = nullptr;
  py::array bias_a;
  if (!bias.is_none()) {
    bias_a = bias.cast<py::array>();
    check(bias_a, "bias", "ui", 2, {m});
    bias_p = static_cast<const uint16_t*>(bias_a.data());
  }
  if (n == 0) return;
  const int64_t kp = w.kt * kTile;
  std::atomic<int64_t> bad{-1};
  {
    py::gil_scoped_release nogil;
    std::vector<float> xf(static_cast<size_t>(n * kp), 0.0f);
    const uint16_t* xs = static_cast<const uint16_t*>(x.data());
    for (int64_t t = 0; t < n; ++t)
      for (int64_t c = 0; c < k; ++c) xf[t * kp + c] = bf16_to_float(xs[t * k + c]);
    GemmJob job{w, xf.data(), n, kp, bias_p, static_cast<uint16_t*>(out.mutable_data()), &bad};
    GemmCtx ctx{&job, kern.gemm_rows};
    parallel_for(w.mt, threads, [](void* c, int64_t a, int64_t b) {
      auto* g = static_cast<GemmCtx*>(c);
      g->fn(*g->job, a, b);
    }, &ctx);
  }
  raise_bad(bad.load(), w);
}

void decode(const py::array& bitmaps, const py::array& base, const py::array& offsets, const py::array& sm,
            const py::array& fb, int64_t m, int64_t k, py::array out, int threads, const std::string& isa) {
  const Kernel kern = pick(isa);
  const Matrix w = matrix(bitmaps, base, offsets, sm, fb, m, k);
  check(out, "out", "ui", 2, {m, k});
  std::atomic<int64_t> bad{-1};
  {
    py::gil_scoped_release nogil;
    DecodeJob job{w, static_cast<uint16_t*>(out.mutable_data()), &bad};
    DecodeCtx ctx{&job, kern.decode_rows};
    parallel_for(w.mt, threads, [](void* c, int64_t a, int64_t b) {
      auto* d = static_cast<DecodeCtx*>(c);
      d->fn(*d->job, a, b);
    }, &ctx);
  }
  raise_bad(bad.load(), w);
}

}  // namespace

PYBIND11_MODULE(_cpu_gemm, mod) {
  mod.doc() = "zipserv-vllm fused decode-GEMM CPU kernels (TCA-TBE v1)";
  mod.def("isas", &supported_isas, "ISAs this CPU can run, best first (always ends with 'scalar')");
  mod.def("gemm", &gemm, py::arg("x"), py::arg("bitmaps"), py::arg("base"), py::arg("offsets"), py::arg("sm"),
          py::arg("fb"), py::arg("m"), py::arg("k"), py::arg("bias"), py::arg("out"), py::arg("threads"),
          py::arg("isa"),
          "out[n, m] = bf16(x[n, :] . W[m, :] + bias[m]) from the compressed W (bf16 bit patterns as uint16)");
  mod.def("decode", &decode, py::arg("bitmaps"), py::arg("base"), py::arg("offsets"), py::arg("sm"), py::arg("fb"),
          py::arg("m"), py::arg("k"), py::arg("out"), py::arg("threads"), py::arg("isa"),
          "Decode W[m, k] with the fused kernel's tile decoder (for bit-exactness tests)");
}
