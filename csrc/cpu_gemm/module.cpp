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

#include <algorithm>
#include <atomic>
#include <new>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "zipserv/cpu_gemm.h"
#include "zipserv/cpu_pack.h"

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
  const int64_t mt = tile_count(m), kt = tile_count(k);
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

constexpr const char* kV1Bad = "has segment offsets outside the streams or misaligned";
constexpr const char* kPackedBad = "of the byte-split layout has a malformed exception list";

// Raises for the first malformed tile g (>= 0) that a kernel reported.
void raise_bad(int64_t g, int64_t kt, const char* what) {
  if (g >= 0) throw std::invalid_argument("tile (" + std::to_string(g / kt) + ", " + std::to_string(g % kt) + ") " + what);
}

Packed packed(const py::array& tiles, const py::array& luts, const py::array& exc_start, const py::array& exc,
              int64_t m, int64_t k) {
  if (m < 1 || k < 1) throw std::invalid_argument("matrix shape must be positive, got " + std::to_string(m) + " x " + std::to_string(k));
  const int64_t mt = tile_count(m), kt = tile_count(k);
  check(tiles, "tiles", "u", 1, {mt, kt, kPkTileBytes});
  check(luts, "luts", "u", 1, {mt, kt, kPkLutEntries});
  check(exc_start, "exc_start", "i", 8, {mt * kt + 1});
  check(exc, "exc", "ui", 4, {-1});
  return Packed{static_cast<const uint8_t*>(tiles.data()), static_cast<const uint8_t*>(luts.data()),
                static_cast<const int64_t*>(exc_start.data()), static_cast<const uint32_t*>(exc.data()),
                static_cast<int64_t>(exc.shape(0)), m, k, mt, kt};
}

// The checked activation, bias and output arrays of one GEMM call with W of m x k.
struct GemmArgs {
  int64_t n;
  py::array bias_a;  // keeps the bias array alive
  const uint16_t* bias = nullptr;
};

GemmArgs gemm_args(int64_t m, int64_t k, const py::array& x, const py::object& bias, py::array& out) {
  check(x, "x", "ui", 2, {-1, k});
  GemmArgs a{x.shape(0), py::array(), nullptr};
  check(out, "out", "ui", 2, {a.n, m});
  if (!out.writeable()) throw std::invalid_argument("out must be writeable");
  if (!bias.is_none()) {
    a.bias_a = bias.cast<py::array>();
    check(a.bias_a, "bias", "ui", 2, {m});
    a.bias = static_cast<const uint16_t*>(a.bias_a.data());
  }
  return a;
}

// y = x . W^T + bias by kernel function fn (W a Matrix or a Packed).
template <class W, class Fn>
void run_gemm(const W& w, Fn fn, const py::array& x, const py::object& bias, py::array& out, int threads,
              std::atomic<int64_t>& bad) {
  const GemmArgs args = gemm_args(w.m, w.k, x, bias, out);
  const int64_t n = args.n;
  const uint16_t* bias_p = args.bias;
  if (n == 0) return;
  const int64_t kp = w.kt * kTile;
  py::gil_scoped_release nogil;
  std::vector<float> xf(static_cast<size_t>(n * kp), 0.0f);
  const uint16_t* xs = static_cast<const uint16_t*>(x.data());
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < w.k; ++c) xf[t * kp + c] = bf16_to_float(xs[t * w.k + c]);
  const GemmJobT<W> job{w, xf.data(), n, kp, bias_p, static_cast<uint16_t*>(out.mutable_data()), &bad};
  auto body = [&](int64_t a, int64_t b) { fn(job, a, b); };
  parallel_for(w.mt, threads, body);
}

template <class W, class Fn>
void run_decode(const W& w, Fn fn, py::array& out, int threads, std::atomic<int64_t>& bad) {
  check(out, "out", "ui", 2, {w.m, w.k});
  py::gil_scoped_release nogil;
  const DecodeJobT<W> job{w, static_cast<uint16_t*>(out.mutable_data()), &bad};
  auto body = [&](int64_t a, int64_t b) { fn(job, a, b); };
  parallel_for(w.mt, threads, body);
}

void gemm(const py::array& x, const py::array& bitmaps, const py::array& base, const py::array& offsets,
          const py::array& sm, const py::array& fb, int64_t m, int64_t k, const py::object& bias,
          py::array out, int threads, const std::string& isa) {
  const Kernel kern = pick(isa);
  const Matrix w = matrix(bitmaps, base, offsets, sm, fb, m, k);
  std::atomic<int64_t> bad{-1};
  run_gemm(w, kern.gemm_rows, x, bias, out, threads, bad);
  raise_bad(bad.load(), w.kt, kV1Bad);
}

void decode(const py::array& bitmaps, const py::array& base, const py::array& offsets, const py::array& sm,
            const py::array& fb, int64_t m, int64_t k, py::array out, int threads, const std::string& isa) {
  const Kernel kern = pick(isa);
  const Matrix w = matrix(bitmaps, base, offsets, sm, fb, m, k);
  std::atomic<int64_t> bad{-1};
  run_decode(w, kern.decode_rows, out, threads, bad);
  raise_bad(bad.load(), w.kt, kV1Bad);
}

void packed_gemm(const py::array& x, const py::array& tiles, const py::array& luts, const py::array& exc_start,
                 const py::array& exc, int64_t m, int64_t k, const py::object& bias, py::array out, int threads,
                 const std::string& isa) {
  const Kernel kern = pick(isa);
  const Packed w = packed(tiles, luts, exc_start, exc, m, k);
  std::atomic<int64_t> bad{-1};
  run_gemm(w, kern.packed_gemm_rows, x, bias, out, threads, bad);
  raise_bad(bad.load(), w.kt, kPackedBad);
}

void packed_decode(const py::array& tiles, const py::array& luts, const py::array& exc_start, const py::array& exc,
                   int64_t m, int64_t k, py::array out, int threads, const std::string& isa) {
  const Kernel kern = pick(isa);
  const Packed w = packed(tiles, luts, exc_start, exc, m, k);
  std::atomic<int64_t> bad{-1};
  run_decode(w, kern.packed_decode_rows, out, threads, bad);
  raise_bad(bad.load(), w.kt, kPackedBad);
}

constexpr int64_t kBf16Rows = 4;

// y = x . W^T + bias by the AVX512-BF16 kernel (vdpbf16ps; not bit-identical to
// the fp32 kernels above: kernel_avx512bf16.cpp states its numerics).
void packed_gemm_bf16(const py::array& x, const py::array& tiles, const py::array& luts, const py::array& exc_start,
                      const py::array& exc, int64_t m, int64_t k, const py::object& bias, py::array out,
                      int threads) {
  if (!avx512bf16_supported()) throw std::invalid_argument("this CPU has no AVX512-BF16 (vdpbf16ps)");
  const Packed w = packed(tiles, luts, exc_start, exc, m, k);
  const GemmArgs args = gemm_args(w.m, w.k, x, bias, out);
  const int64_t n = args.n;
  const uint16_t* bias_p = args.bias;
  if (n == 0) return;
  const int64_t kp = w.kt * kTile;
  std::atomic<int64_t> bad{-1};
  {
    py::gil_scoped_release nogil;
    // x zero-padded to Kp columns (a copy only when K is not a multiple of 64)
    const uint16_t* xs = static_cast<const uint16_t*>(x.data());
    std::vector<uint16_t> xb;
    if (kp != w.k) {
      xb.assign(static_cast<size_t>(n * kp), 0);
      for (int64_t t = 0; t < n; ++t) std::memcpy(xb.data() + t * kp, xs + t * w.k, static_cast<size_t>(w.k) * 2);
      xs = xb.data();
    }
    const Bf16GemmJob job{w, xs, n, kp, bias_p, static_cast<uint16_t*>(out.mutable_data()), &bad};
    const Bf16GemmRowsFn fn = avx512bf16_gemm_rows();
    // Runs of kBf16Rows consecutive tile rows per item: the kernel prefetches
    // the next chunk of records (across row ends) while it multiplies the current one.
    const int64_t items = (w.mt + kBf16Rows - 1) / kBf16Rows;
    auto body = [&](int64_t a, int64_t b) { fn(job, a * kBf16Rows, std::min(b * kBf16Rows, w.mt)); };
    parallel_for(items, threads, body);
  }
  if (avx512bf16_alloc_failed()) throw std::bad_alloc();  // (MemoryError; the output is incomplete)
  raise_bad(bad.load(), w.kt, kPackedBad);
}

void packed_decode_bf16(const py::array& tiles, const py::array& luts, const py::array& exc_start,
                        const py::array& exc, int64_t m, int64_t k, py::array out, int threads) {
  if (!avx512bf16_supported()) throw std::invalid_argument("this CPU has no AVX512-BF16 (vdpbf16ps)");
  const Packed w = packed(tiles, luts, exc_start, exc, m, k);
  std::atomic<int64_t> bad{-1};
  run_decode(w, avx512bf16_decode_rows(), out, threads, bad);
  if (avx512bf16_alloc_failed()) throw std::bad_alloc();
  raise_bad(bad.load(), w.kt, kPackedBad);
}

// W (bf16 bits [m, k]) -> (tiles, luts, exc_start, exc) of the byte-split layout.
py::tuple pack(const py::array& w, int threads) {
  if (w.ndim() != 2 || w.shape(0) < 1 || w.shape(1) < 1) throw std::invalid_argument("pack takes a non-empty 2-D matrix");
  const int64_t m = w.shape(0), k = w.shape(1);
  check(w, "w", "ui", 2, {m, k});
  const int64_t mt = tile_count(m), kt = tile_count(k);
  py::array_t<uint8_t> tiles({mt, kt, static_cast<int64_t>(kPkTileBytes)});
  py::array_t<uint8_t> luts({mt, kt, static_cast<int64_t>(kPkLutEntries)});
  py::array_t<int64_t> exc_start({mt * kt + 1});
  PackJob job{static_cast<const uint16_t*>(w.data()), m, k, mt, kt, tiles.mutable_data(), luts.mutable_data()};
  std::vector<uint32_t> exc;
  {
    py::gil_scoped_release nogil;
    exc = pack_matrix(job, threads, exc_start.mutable_data());
  }
  py::array_t<int32_t> exc_a({static_cast<int64_t>(exc.size())});
  if (!exc.empty()) std::memcpy(exc_a.mutable_data(), exc.data(), exc.size() * 4);
  return py::make_tuple(tiles, luts, exc_start, exc_a);
}

py::dict layout_constants() {
  py::dict d;
  d["TILE_BYTES"] = kPkTileBytes;
  d["LO_BYTES"] = kPkLoBytes;
  d["CODE_BYTES"] = kPkCodeBytes;
  d["LUT_ENTRIES"] = kPkLutEntries;
  d["EXC_SHIFT"] = kPkExcShift;
  d["PAD_LO"] = kPkPadLo;
  py::list cb;
  for (int f = 0; f < kFragsPerTile; ++f)
    for (int p = 0; p < kFragElems; ++p) cb.append(py::make_tuple(pk_code_byte(f, p), pk_code_nibble(p)));
  d["code_positions"] = cb;
  return d;
}

}  // namespace

PYBIND11_MODULE(_cpu_gemm, mod) {
  mod.doc() = "zipserv-vllm fused decode-GEMM CPU kernels (TCA-TBE v1)";
  install_fork_guard();
  mod.def("isas", &supported_isas, "ISAs this CPU can run, best first (always ends with 'scalar')");
  mod.def("gemm", &gemm, py::arg("x"), py::arg("bitmaps"), py::arg("base"), py::arg("offsets"), py::arg("sm"),
          py::arg("fb"), py::arg("m"), py::arg("k"), py::arg("bias"), py::arg("out"), py::arg("threads"),
          py::arg("isa"),
          "out[n, m] = bf16(x[n, :] . W[m, :] + bias[m]) from the compressed W (bf16 bit patterns as uint16)");
  mod.def("decode", &decode, py::arg("bitmaps"), py::arg("base"), py::arg("offsets"), py::arg("sm"), py::arg("fb"),
          py::arg("m"), py::arg("k"), py::arg("out"), py::arg("threads"), py::arg("isa"),
          "Decode W[m, k] with the fused kernel's tile decoder (for bit-exactness tests)");
  mod.def("packed_gemm", &packed_gemm, py::arg("x"), py::arg("tiles"), py::arg("luts"), py::arg("exc_start"),
          py::arg("exc"), py::arg("m"), py::arg("k"), py::arg("bias"), py::arg("out"), py::arg("threads"),
          py::arg("isa"), "gemm from W in the CPU byte-split layout (docs/FORMAT.md appendix A)");
  mod.def("packed_decode", &packed_decode, py::arg("tiles"), py::arg("luts"), py::arg("exc_start"), py::arg("exc"),
          py::arg("m"), py::arg("k"), py::arg("out"), py::arg("threads"), py::arg("isa"),
          "Decode W[m, k] from the byte-split layout with the kernels' tile decoder");
  mod.def("bf16_supported", &avx512bf16_supported, "Whether this CPU has AVX512-BF16 (vdpbf16ps)");
  mod.def("packed_gemm_bf16", &packed_gemm_bf16, py::arg("x"), py::arg("tiles"), py::arg("luts"),
          py::arg("exc_start"), py::arg("exc"), py::arg("m"), py::arg("k"), py::arg("bias"), py::arg("out"),
          py::arg("threads"),
          "packed_gemm by the AVX512-BF16 panel kernel (vdpbf16ps; fast mode, not bit-identical to packed_gemm)");
  mod.def("packed_decode_bf16", &packed_decode_bf16, py::arg("tiles"), py::arg("luts"), py::arg("exc_start"),
          py::arg("exc"), py::arg("m"), py::arg("k"), py::arg("out"), py::arg("threads"),
          "Decode W[m, k] by the AVX512-BF16 panel kernel's decode step (bit-exactness tests)");
  mod.def("pack", &pack, py::arg("w"), py::arg("threads"),
          "W (bf16 bits, uint16 [m, k]) -> (tiles, luts, exc_start, exc) of the byte-split layout");
  mod.def("layout_constants", &layout_constants, "The byte-split layout's constants (tests compare them with Python)");
}
