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
#include <array>
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
// "tile (r, c) <what>" for tile g of a matrix kt tiles wide.
std::string bad_tile_text(int64_t g, int64_t kt, const char* what) {
  return "tile (" + std::to_string(g / kt) + ", " + std::to_string(g % kt) + ") " + what;
}

void raise_bad(int64_t g, int64_t kt, const char* what) {
  if (g >= 0) throw std::invalid_argument(bad_tile_text(g, kt, what));
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

// y[n, m] = x[n, k] . W^T + bias by kernel function fn (W a Matrix or a Packed) on
// checked, contiguous bf16 buffers (bias may be null); the caller has released the GIL. False when
// a thread's scratch could not be allocated (y is then incomplete).
template <class W, class Fn>
bool fused_rows(const W& w, Fn fn, const uint16_t* xs, int64_t n, const uint16_t* bias, uint16_t* y, int threads,
                std::atomic<int64_t>& bad) {
  const int64_t kp = w.kt * kTile;
  std::vector<float> xf(static_cast<size_t>(n * kp), 0.0f);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < w.k; ++c) xf[t * kp + c] = bf16_to_float(xs[t * w.k + c]);
  std::atomic<bool> oom{false};
  const GemmJobT<W> job{w, xf.data(), n, kp, bias, y, &bad, &oom};
  auto body = [&](int64_t a, int64_t b) { fn(job, a, b); };
  parallel_for(w.mt, threads, body);
  return !oom.load();
}

// y = x . W^T + bias by kernel function fn (W a Matrix or a Packed).
template <class W, class Fn>
void run_gemm(const W& w, Fn fn, const py::array& x, const py::object& bias, py::array& out, int threads,
              std::atomic<int64_t>& bad) {
  const GemmArgs args = gemm_args(w.m, w.k, x, bias, out);
  if (args.n == 0) return;
  bool done;
  {
    py::gil_scoped_release nogil;
    done = fused_rows(w, fn, static_cast<const uint16_t*>(x.data()), args.n, args.bias,
                      static_cast<uint16_t*>(out.mutable_data()), threads, bad);
  }
  if (!done) throw std::bad_alloc();  // (MemoryError; the output is incomplete)
}

template <class W, class Fn>
void run_decode(const W& w, Fn fn, py::array& out, int threads, std::atomic<int64_t>& bad) {
  check(out, "out", "ui", 2, {w.m, w.k});
  std::atomic<bool> oom{false};
  {
    py::gil_scoped_release nogil;
    const DecodeJobT<W> job{w, static_cast<uint16_t*>(out.mutable_data()), &bad, &oom};
    auto body = [&](int64_t a, int64_t b) { fn(job, a, b); };
    parallel_for(w.mt, threads, body);
  }
  if (oom.load()) throw std::bad_alloc();  // (MemoryError; the output is incomplete)
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

// y[i] = row ids[i] of W (ids clamped to [0, rows); rows m .. rows - 1 are
// vocabulary padding: zeros), bit for bit: each row decoded on its own from the
// 8 FTs per tile that hold it (decode_packed_row; before, the whole 64-row tile
// row of every id was decoded and copied out: 8x the work, 4.3 ms of a 512-token
// prefill step on a 32000 x 1024 table). Runs without the GIL; the first
// malformed tile a row touches goes to bad.
void embedding_rows(const Packed& w, const int64_t* id, int64_t n, int64_t rows, uint16_t* y, int threads,
                    std::atomic<int64_t>& bad) {
  const int64_t m = w.m, k = w.k;
  constexpr int64_t kIdsPerItem = 16;
  auto body = [&](int64_t a, int64_t b) {
    for (int64_t i = a * kIdsPerItem; i < std::min(n, b * kIdsPerItem); ++i) {
      const int64_t r = std::min(std::max<int64_t>(id[i], 0), rows - 1);
      if (r >= m) {
        std::memset(y + i * k, 0, static_cast<size_t>(k) * 2);
        continue;
      }
      const int64_t g = decode_packed_row(w, r, y + i * k);
      if (g >= 0) report_bad(&bad, g);
    }
  };
  // (a decode step's few ids: one item, on the calling thread)
  parallel_for((n + kIdsPerItem - 1) / kIdsPerItem, threads, body);
}

// embedding_rows on checked arrays (kernels/cpu.py packed_embedding).
void packed_embedding(const py::array& ids, const py::array& tiles, const py::array& luts,
                      const py::array& exc_start, const py::array& exc, int64_t m, int64_t k, int64_t rows,
                      py::array out, int threads, const std::string& isa) {
  pick(isa);  // (checked only: the lookup is portable code, decode_packed_row)
  const Packed w = packed(tiles, luts, exc_start, exc, m, k);
  if (rows < m) throw std::invalid_argument("rows (" + std::to_string(rows) + ") must be at least the table's " +
                                            std::to_string(m));
  check(ids, "ids", "i", 8, {-1});
  const int64_t n = ids.shape(0);
  check(out, "out", "ui", 2, {n, k});
  if (!out.writeable()) throw std::invalid_argument("out must be writeable");
  std::atomic<int64_t> bad{-1};
  {
    py::gil_scoped_release nogil;
    embedding_rows(w, static_cast<const int64_t*>(ids.data()), n, rows, static_cast<uint16_t*>(out.mutable_data()),
                   threads, bad);
  }
  raise_bad(bad.load(), w.kt, kPackedBad);
}

// The capsule entry (EmbeddingCall, cpu_gemm.h): packed_embedding without Python, on arrays the
// caller checked (the torch op extension calls it with the GIL released).
int64_t embedding_call(const EmbeddingCall& c) {
  try {
    if (c.rows < c.m || c.n < 0) return kEmbeddingCallFailed;
    const Packed w{c.tiles, c.luts, c.exc_start, c.exc, c.exc_len, c.m, c.k, tile_count(c.m), tile_count(c.k)};
    std::atomic<int64_t> bad{-1};
    embedding_rows(w, c.ids, c.n, c.rows, c.y, c.threads, bad);
    if (bad.load() >= 0) return kEmbeddingCallFailed;
    return kEmbeddingCallDone;
  } catch (...) {  // (nothing here allocates any more; kept so that no exception can cross the capsule)
    return kEmbeddingCallFailed;
  }
}

constexpr int64_t kBf16Rows = 4;

// Work items of the panel kernel: (job, tm0, tm1).
using RowRun = std::array<int64_t, 3>;

// Appends job's tile rows 0 .. mt - 1 as runs of kBf16Rows consecutive rows (the kernel prefetches
// the next chunk of records across row ends, and its buffered path decodes it while it multiplies
// the current one).
void add_row_runs(std::vector<RowRun>& items, int64_t job, int64_t mt) {
  for (int64_t tm = 0; tm < mt; tm += kBf16Rows) items.push_back({job, tm, std::min(tm + kBf16Rows, mt)});
}

// When the threads would not get the same number of items, the last 2 tile rows per thread split
// into items of one row, so that the threads (which take items in order) finish within a row of
// each other (11008x4096: 172 tile rows, 43 runs of 4, one thread had a run more: 2.3 % of the
// work). Where the runs divide evenly it is not done (measured slower when the items' first chunks
// were not prefetched; not measured again since run_row_runs prefetches them). A thread holds its
// current item and the one it claimed: one that falls behind (preempted) can still leave the other
// idle for up to a run.
void split_tail(std::vector<RowRun>& items, int threads) {
  threads = std::max(threads, 1);
  if (static_cast<int64_t>(items.size()) % threads == 0) return;
  int64_t tail = 2 * static_cast<int64_t>(threads);
  std::vector<RowRun> singles;
  while (tail > 0 && !items.empty()) {
    const RowRun last = items.back();
    items.pop_back();
    const int64_t take = std::min(tail, last[2] - last[1]);
    for (int64_t tm = last[2] - 1; tm >= last[2] - take; --tm) singles.push_back({last[0], tm, tm + 1});
    tail -= take;
    if (last[2] - take > last[1]) {  // the run's first rows stay one item
      items.push_back({last[0], last[1], last[2] - take});
      break;
    }
  }
  items.insert(items.end(), singles.rbegin(), singles.rend());
}

// Runs every item through the panel kernel on `threads` threads, each item prefetching the first
// records of the item its thread runs next (parallel_claims).
void run_row_runs(const std::vector<Bf16GemmJob>& jobs, const std::vector<RowRun>& items, int threads) {
  const Bf16GemmRowsFn fn = avx512bf16_gemm_rows();
  auto body = [&](int64_t i, int64_t next) {
    const uint8_t* after = nullptr;
    if (next >= 0) {
      const Packed& w = jobs[items[next][0]].w;
      after = w.tiles + items[next][1] * w.kt * kPkTileBytes;
    }
    fn(jobs[items[i][0]], items[i][1], items[i][2], after);
  };
  parallel_claims(static_cast<int64_t>(items.size()), threads, body);
}

// y[n, m] = x[n, k] . W^T + bias by the AVX512-BF16 panel kernel on checked, contiguous bf16 buffers
// (bias may be null); the caller has released the GIL. False when a thread's scratch could not be
// allocated (y is then incomplete).
bool panel_rows(const Packed& w, const uint16_t* xs, int64_t n, const uint16_t* bias, uint16_t* y, int threads,
                std::atomic<int64_t>& bad) {
  const int64_t kp = w.kt * kTile;
  // x zero-padded to Kp columns (a copy only when K is not a multiple of 64)
  std::vector<uint16_t> xb;
  if (kp != w.k) {
    xb.assign(static_cast<size_t>(n * kp), 0);
    for (int64_t t = 0; t < n; ++t) std::memcpy(xb.data() + t * kp, xs + t * w.k, static_cast<size_t>(w.k) * 2);
    xs = xb.data();
  }
  std::atomic<bool> oom{false};
  const std::vector<Bf16GemmJob> jobs{Bf16GemmJob{w, xs, n, kp, bias, y, &bad, &oom}};
  std::vector<RowRun> items;
  add_row_runs(items, 0, w.mt);
  split_tail(items, threads);
  run_row_runs(jobs, items, threads);
  return !oom.load();
}

// y = x . W^T + bias by the AVX512-BF16 kernel (vdpbf16ps; not bit-identical to
// the fp32 kernels above: kernel_avx512bf16.cpp states its numerics).
void packed_gemm_bf16(const py::array& x, const py::array& tiles, const py::array& luts, const py::array& exc_start,
                      const py::array& exc, int64_t m, int64_t k, const py::object& bias, py::array out,
                      int threads) {
  if (!avx512bf16_supported()) throw std::invalid_argument("this CPU has no AVX512-BF16 (vdpbf16ps)");
  const Packed w = packed(tiles, luts, exc_start, exc, m, k);
  const GemmArgs args = gemm_args(w.m, w.k, x, bias, out);
  if (args.n == 0) return;
  std::atomic<int64_t> bad{-1};
  bool done;
  {
    py::gil_scoped_release nogil;
    done = panel_rows(w, static_cast<const uint16_t*>(x.data()), args.n, args.bias,
                      static_cast<uint16_t*>(out.mutable_data()), threads, bad);
  }
  if (!done) throw std::bad_alloc();  // (MemoryError; the output is incomplete)
  raise_bad(bad.load(), w.kt, kPackedBad);
}

// y[n, m] = x[n, k] . W^T + bias on checked buffers at addresses: the panel kernel, else the fp32
// fused one of `fused`; the caller holds no GIL. False when a kernel could not allocate its
// buffers (y incomplete); a malformed tile is reported in bad. Shared by PackedLinear::run and the
// capsule entry.
bool packed_rows(const Packed& w, const Kernel& fused, bool panel, const uint16_t* x, int64_t n,
                 const uint16_t* bias, uint16_t* y, int threads, std::atomic<int64_t>& bad) {
  if (!panel) return fused_rows(w, fused.packed_gemm_rows, x, n, bias, y, threads, bad);
  return panel_rows(w, x, n, bias, y, threads, bad);
}

// The capsule entry (PackedCall, cpu_gemm.h): what PackedLinear::run does, on sizes the caller
// checked, without Python (the torch op extension calls it with the GIL released).
int64_t packed_call(const PackedCall& c) {
  try {
    if (c.panel && !avx512bf16_supported()) return kPackedCallFailed;
    const Packed w{c.tiles, c.luts, c.exc_start, c.exc, c.exc_len, c.m, c.k, tile_count(c.m), tile_count(c.k)};
    static const Kernel best = pick("auto");
    std::atomic<int64_t> bad{-1};
    if (!packed_rows(w, best, c.panel, c.x, c.n, c.bias, c.y, c.threads, bad)) return kPackedCallFailed;
    const int64_t g = bad.load();
    return g < 0 ? kPackedCallDone : g;
  } catch (...) {  // (std::bad_alloc from a buffer)
    return kPackedCallFailed;
  }
}

// One byte-split weight, checked once, for the fast path's per-call entry (kernels/cpu.py
// native_linear): a decode step calls every layer once, and the per-call array checks and NumPy
// conversions of packed_gemm / packed_gemm_bf16 cost more than the kernel at a few tokens when
// the interpreter's state is cold. run() takes buffer addresses, which the Python side checks
// (contiguous bf16 CPU tensors of the right sizes) before it calls. The weight's arrays are held.
class PackedLinear {
 public:
  PackedLinear(const py::array& tiles, const py::array& luts, const py::array& exc_start, const py::array& exc,
               int64_t m, int64_t k)
      : held_{tiles, luts, exc_start, exc},
        w_(packed(tiles, luts, exc_start, exc, m, k)),
        fused_(pick("auto")) {}

  // y[n, m] = x[n, k] . W^T + bias; panel: the AVX512-BF16 kernel, else the fp32 fused kernel at the
  // best ISA.
  void run(uintptr_t x, int64_t n, uintptr_t y, uintptr_t bias, int threads, bool panel) const {
    if (n < 1) throw std::invalid_argument("n must be positive, got " + std::to_string(n));
    if (!x || !y) throw std::invalid_argument("x and y must be addresses of buffers");
    if (panel && !avx512bf16_supported()) throw std::invalid_argument("this CPU has no AVX512-BF16 (vdpbf16ps)");
    const auto* xs = reinterpret_cast<const uint16_t*>(x);
    const auto* bs = reinterpret_cast<const uint16_t*>(bias);
    auto* ys = reinterpret_cast<uint16_t*>(y);
    std::atomic<int64_t> bad{-1};
    bool done;
    {
      py::gil_scoped_release nogil;
      done = packed_rows(w_, fused_, panel, xs, n, bs, ys, threads, bad);
    }
    if (!done) throw std::bad_alloc();
    raise_bad(bad.load(), w_.kt, kPackedBad);
  }

  int64_t m() const { return w_.m; }
  int64_t k() const { return w_.k; }

 private:
  std::array<py::array, 4> held_;  // keep the weight's memory alive
  Packed w_;
  Kernel fused_;
};

// ---- one MoE layer's routed experts in one call (AVX512-BF16 panel kernel) ----
// Expert weights come as a table of addresses, [E][kExpertCols] int64: tiles,
// luts, exc_start, exc, exc_len, M, K of each expert's byte-split PackedTensor
// (w13: 2I x H, gate rows then up rows; w2: H x I). The caller
// (kernels/cpu.py expert_table) builds it from tensors whose dtypes and array
// shapes it checked against M, K and keeps them alive; every call checks each
// row's M, K against the sizes it is given.
constexpr int64_t kExpertCols = 7;

Packed expert_view(const int64_t* row, int64_t m, int64_t k) {
  return Packed{reinterpret_cast<const uint8_t*>(row[0]), reinterpret_cast<const uint8_t*>(row[1]),
                reinterpret_cast<const int64_t*>(row[2]), reinterpret_cast<const uint32_t*>(row[3]), row[4],
                m, k, tile_count(m), tile_count(k)};
}

void check_table(const py::array& table, const char* name, int64_t e_count, int64_t m, int64_t k) {
  check(table, name, "i", 8, {e_count, kExpertCols});
  const int64_t* t = static_cast<const int64_t*>(table.data());
  for (int64_t e = 0; e < e_count; ++e)
    if (t[e * kExpertCols + 5] != m || t[e * kExpertCols + 6] != k || t[e * kExpertCols + 4] < 0)
      throw std::invalid_argument(std::string(name) + ": expert " + std::to_string(e) + " is " +
                                  std::to_string(t[e * kExpertCols + 5]) + " x " + std::to_string(t[e * kExpertCols + 6]) +
                                  ", the call needs " + std::to_string(m) + " x " + std::to_string(k));
}

// experts_forward's error when a thread's scratch could not be allocated (no tile error reads so).
const char kOutOfMemory[] = "out of memory";

// Y[rows of e] = X[rows of e] . W_e^T for every expert with rows, as one
// parallel loop over (expert, run of kBf16Rows tile rows) items (the last
// rows one per item: split_tail); false, with
// (expert, tile) in bad_e / bad_g, when a tile is malformed. oom is set when a
// thread's scratch could not be allocated (Y incomplete).
bool experts_gemm(const int64_t* table, const int64_t* bounds, int64_t e_count, int64_t m, int64_t k,
                  const uint16_t* x, uint16_t* y, int threads, int64_t& bad_e, int64_t& bad_g,
                  std::atomic<bool>& oom) {
  std::vector<std::atomic<int64_t>> bad(static_cast<size_t>(e_count));
  std::vector<Bf16GemmJob> jobs;
  std::vector<RowRun> items;
  jobs.reserve(static_cast<size_t>(e_count));
  for (int64_t e = 0; e < e_count; ++e) {
    bad[e].store(-1);
    const int64_t n = bounds[e + 1] - bounds[e];
    if (n == 0) continue;
    const Packed w = expert_view(table + kExpertCols * e, m, k);
    jobs.push_back(Bf16GemmJob{w, x + bounds[e] * k, n, k, nullptr, y + bounds[e] * m, &bad[e], &oom});
    add_row_runs(items, static_cast<int64_t>(jobs.size()) - 1, w.mt);
  }
  split_tail(items, threads);
  run_row_runs(jobs, items, threads);
  for (int64_t e = 0; e < e_count; ++e)
    if (bad[e].load() >= 0) {
      bad_e = e;
      bad_g = bad[e].load();
      return false;
    }
  return true;
}

// Element count under which the MoE layer's small steps (gather, SiLU x up, weighted sum) run on the
// calling thread: at a few tokens, entering and leaving a parallel region costs more than the work.
constexpr int64_t kSmallWork = 1 << 16;

// The routed experts' outputs y[r] for rows xs[r] grouped by expert (bounds[e]
// .. bounds[e + 1] for expert e): h = xs . W13_e^T (bf16), act = bf16(silu(gate)
// * up) in fp32, y = act . W2_e^T. Runs without the GIL; returns "" or the error.
std::string experts_forward(const uint16_t* xs, const int64_t* bd, int64_t e_count, const int64_t* t13,
                            const int64_t* t2, int64_t inter, int64_t hidden, uint16_t* hp, uint16_t* ap, uint16_t* y,
                            int threads) {
  int64_t bad_e = -1, bad_g = -1;
  std::atomic<bool> oom{false};
  const int64_t r = bd[e_count];
  const bool ok13 = experts_gemm(t13, bd, e_count, 2 * inter, hidden, xs, hp, threads, bad_e, bad_g, oom);
  if (oom.load()) return kOutOfMemory;
  if (!ok13)
    return "expert " + std::to_string(bad_e) + " (w13): " + bad_tile_text(bad_g, tile_count(hidden), kPackedBad);
  auto silu_mul = [&](int64_t a, int64_t b) { avx512bf16_silu_mul(hp, a, b, inter, ap); };
  parallel_for(r, r * inter < kSmallWork ? 1 : threads, silu_mul);
  const bool ok2 = experts_gemm(t2, bd, e_count, hidden, inter, ap, y, threads, bad_e, bad_g, oom);
  if (oom.load()) return kOutOfMemory;
  if (!ok2)
    return "expert " + std::to_string(bad_e) + " (w2): " + bad_tile_text(bad_g, tile_count(inter), kPackedBad);
  return "";
}

// An error string's meaning for the Python-facing entries: out of memory -> MemoryError, else ValueError.
void raise_moe_error(const std::string& err) {
  if (err == kOutOfMemory) throw std::bad_alloc();
  if (!err.empty()) throw std::invalid_argument(err);
}

void check_moe_sizes(int64_t inter, int64_t hidden, const py::array& w13, const py::array& w2, int64_t e_count) {
  if (!avx512bf16_supported()) throw std::invalid_argument("this CPU has no AVX512-BF16 (vdpbf16ps)");
  if (inter < 1 || hidden < 1 || inter % kTile || hidden % kTile)
    throw std::invalid_argument("hidden and intermediate sizes must be positive multiples of 64");
  check_table(w13, "w13", e_count, 2 * inter, hidden);
  check_table(w2, "w2", e_count, hidden, inter);
}

// y = the routed experts' outputs for rows xs grouped by expert (experts_forward); h, act: scratch.
// Fast mode (the panel kernel's numerics); H and I multiples of 64.
void moe_experts_bf16(const py::array& xs, const py::array& bounds, const py::array& w13, const py::array& w2,
                      int64_t inter, int64_t hidden, py::array h, py::array act, py::array y, int threads) {
  check(bounds, "bounds", "i", 8, {-1});
  const int64_t e_count = bounds.shape(0) - 1;
  const int64_t* bd = static_cast<const int64_t*>(bounds.data());
  if (e_count < 1 || bd[0] != 0) throw std::invalid_argument("bounds must start at 0 and name at least one expert");
  for (int64_t e = 0; e < e_count; ++e)
    if (bd[e + 1] < bd[e]) throw std::invalid_argument("bounds must not decrease");
  check_moe_sizes(inter, hidden, w13, w2, e_count);
  const int64_t r = bd[e_count];
  check(xs, "xs", "ui", 2, {r, hidden});
  check(h, "h", "ui", 2, {r, 2 * inter});
  check(act, "act", "ui", 2, {r, inter});
  check(y, "y", "ui", 2, {r, hidden});
  if (!h.writeable() || !act.writeable() || !y.writeable()) throw std::invalid_argument("h, act and y must be writeable");
  if (r == 0) return;
  std::string err;
  {
    py::gil_scoped_release nogil;
    err = experts_forward(static_cast<const uint16_t*>(xs.data()), bd, e_count,
                          static_cast<const int64_t*>(w13.data()), static_cast<const int64_t*>(w2.data()), inter,
                          hidden, static_cast<uint16_t*>(h.mutable_data()), static_cast<uint16_t*>(act.mutable_data()),
                          static_cast<uint16_t*>(y.mutable_data()), threads);
  }
  raise_moe_error(err);
}

// A whole MoE layer's routed experts for tokens xp [t_count][hidden]: out[t] = sum over j of
// w[t][j] * expert ids[t][j](x[t]) (fp32 sum in increasing j, then bf16; with on_input, the weight
// scales x[t] (bf16) instead and the outputs are summed unweighted). ids: [t_count][k] of int32
// (id_bytes 4) or int64 (8). Rows are grouped by expert in (token, j) order; ids outside [0, E) are
// refused before any weight is read. Runs without the GIL; returns "" or the error.
std::string moe_forward_core(const uint16_t* xp, int64_t t_count, int64_t hidden, const void* ids, int id_bytes,
                             const float* wt, int64_t k, const int64_t* t13, const int64_t* t2, int64_t e_count,
                             int64_t inter, bool on_input, uint16_t* op, int threads) {
  const int64_t r = t_count * k;
  std::vector<int64_t> id(static_cast<size_t>(r));
  for (int64_t i = 0; i < r; ++i) {
    id[i] = id_bytes == 4 ? static_cast<const int32_t*>(ids)[i] : static_cast<const int64_t*>(ids)[i];
    if (id[i] < 0 || id[i] >= e_count)
      return "topk_ids holds expert " + std::to_string(id[i]) + ", outside [0, " + std::to_string(e_count) + ")";
  }
  if (r == 0) return "";
  std::vector<int64_t> bd(static_cast<size_t>(e_count + 1), 0), slot(static_cast<size_t>(r));
  for (int64_t i = 0; i < r; ++i) ++bd[id[i] + 1];
  for (int64_t e = 0; e < e_count; ++e) bd[e + 1] += bd[e];
  std::vector<int64_t> fill(bd.begin(), bd.end() - 1), row_of(static_cast<size_t>(r));
  for (int64_t i = 0; i < r; ++i) {  // i = t * k + j, in order: stable per expert
    row_of[i] = fill[id[i]]++;
    slot[row_of[i]] = i;
  }
  std::vector<uint16_t> xs(static_cast<size_t>(r * hidden)), h(static_cast<size_t>(r * 2 * inter)),
      act(static_cast<size_t>(r * inter)), y(static_cast<size_t>(r * hidden));
  auto gather = [&](int64_t a, int64_t b) {
    for (int64_t row = a; row < b; ++row) {
      const int64_t i = slot[row], t = i / k;
      if (on_input)
        for (int64_t c = 0; c < hidden; ++c)
          xs[row * hidden + c] = float_to_bf16(bf16_to_float(xp[t * hidden + c]) * wt[i]);
      else
        std::memcpy(xs.data() + row * hidden, xp + t * hidden, static_cast<size_t>(hidden) * 2);
    }
  };
  // (a few rows, as at decode: one thread, no parallel region to enter and leave)
  parallel_for(r, r * hidden < kSmallWork ? 1 : threads, gather);
  const std::string err =
      experts_forward(xs.data(), bd.data(), e_count, t13, t2, inter, hidden, h.data(), act.data(), y.data(), threads);
  if (!err.empty()) return err;
  auto combine = [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t)
      for (int64_t c0 = 0; c0 < hidden; c0 += 16) {
        float acc[16] = {};
        for (int64_t j = 0; j < k; ++j) {
          const int64_t i = t * k + j;
          const uint16_t* yr = y.data() + row_of[i] * hidden + c0;
          const float s = on_input ? 1.0f : wt[i];
          for (int l = 0; l < 16; ++l) acc[l] += s * bf16_to_float(yr[l]);
        }
        for (int l = 0; l < 16; ++l) op[t * hidden + c0 + l] = float_to_bf16(acc[l]);
      }
  };
  parallel_for(t_count, t_count * k * hidden < kSmallWork ? 1 : threads, combine);
  return "";
}

// One MoE layer's expert tables (kExpertCols addresses and sizes per expert, kernels/cpu.py
// expert_table), checked once and copied: the fast path's per-call entry (kernels/cpu.py moe_run).
// A decode step calls every MoE layer once, and the per-call NumPy conversions and table checks of
// an array entry cost tens of microseconds when the interpreter's state is cold. run() takes buffer
// addresses, which the Python side checks (contiguous CPU tensors of the right dtypes and sizes)
// before it calls; the caller keeps the experts' tensors alive.
class MoeLayer {
 public:
  MoeLayer(const py::array& w13, const py::array& w2, int64_t inter, int64_t hidden)
      : inter_(inter), hidden_(hidden), e_count_(w13.ndim() == 2 ? w13.shape(0) : 0) {
    check_moe_sizes(inter, hidden, w13, w2, e_count_);
    if (e_count_ < 1) throw std::invalid_argument("w13 must name at least one expert");
    const auto* a = static_cast<const int64_t*>(w13.data());
    const auto* b = static_cast<const int64_t*>(w2.data());
    t13_.assign(a, a + e_count_ * kExpertCols);
    t2_.assign(b, b + e_count_ * kExpertCols);
  }

  // out[t_count, hidden] (bf16) for x[t_count, hidden] (bf16), ids[t_count, k] (int32 or int64 by
  // id_bytes) and weights[t_count, k] (fp32), all contiguous at the given addresses.
  void run(uintptr_t x, int64_t t_count, uintptr_t ids, int id_bytes, uintptr_t weights, int64_t k, uintptr_t out,
           bool on_input, int threads) const {
    if (t_count < 0 || k < 1) throw std::invalid_argument("t_count must be >= 0 and k >= 1");
    if (id_bytes != 4 && id_bytes != 8) throw std::invalid_argument("topk_ids must be int32 or int64");
    if (t_count == 0) return;
    if (!x || !ids || !weights || !out) throw std::invalid_argument("x, ids, weights and out must be addresses of buffers");
    std::string err;
    {
      py::gil_scoped_release nogil;
      err = forward(reinterpret_cast<const uint16_t*>(x), t_count, reinterpret_cast<const void*>(ids), id_bytes,
                    reinterpret_cast<const float*>(weights), k, reinterpret_cast<uint16_t*>(out), on_input, threads);
    }
    raise_moe_error(err);
  }

  // run() on checked arguments, without Python: "" or the error.
  std::string forward(const uint16_t* x, int64_t t_count, const void* ids, int id_bytes, const float* weights,
                      int64_t k, uint16_t* out, bool on_input, int threads) const {
    return moe_forward_core(x, t_count, hidden_, ids, id_bytes, weights, k, t13_.data(), t2_.data(), e_count_, inter_,
                            on_input, out, threads);
  }

  // The capsule the torch op extension takes (kMoeLayerCapsule): this object's address, no ownership.
  py::capsule handle() const { return py::capsule(const_cast<MoeLayer*>(this), kMoeLayerCapsule); }

  int64_t hidden() const { return hidden_; }
  int64_t inter() const { return inter_; }
  int64_t experts() const { return e_count_; }

 private:
  int64_t inter_, hidden_, e_count_;
  std::vector<int64_t> t13_, t2_;
};

// The capsule entry (MoeCall, cpu_gemm.h): MoeLayer::run without Python, on arguments the caller
// checked (the torch op extension calls it with the GIL released).
int64_t moe_call(const MoeCall& c) {
  try {
    if (c.t < 1 || c.k < 1 || (c.id_bytes != 4 && c.id_bytes != 8)) return kMoeCallFailed;
    const auto* layer = static_cast<const MoeLayer*>(c.layer);
    const std::string err = layer->forward(c.x, c.t, c.ids, c.id_bytes, c.weights, c.k, c.out, c.on_input, c.threads);
    if (!err.empty()) return kMoeCallFailed;  // (out of memory too: the Python path then reports it)
    return kMoeCallDone;
  } catch (...) {  // (std::bad_alloc from a buffer)
    return kMoeCallFailed;
  }
}

void packed_decode_bf16(const py::array& tiles, const py::array& luts, const py::array& exc_start,
                        const py::array& exc, int64_t m, int64_t k, py::array out, int threads) {
  if (!avx512bf16_supported()) throw std::invalid_argument("this CPU has no AVX512-BF16 (vdpbf16ps)");
  const Packed w = packed(tiles, luts, exc_start, exc, m, k);
  std::atomic<int64_t> bad{-1};
  run_decode(w, avx512bf16_decode_rows(), out, threads, bad);  // (throws MemoryError when out of memory)
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
  // (a function pointer as the capsule's pointer: the torch op extension calls it directly)
  mod.attr("packed_call") = py::capsule(reinterpret_cast<void*>(&packed_call), kPackedCallCapsule);
  mod.attr("moe_call") = py::capsule(reinterpret_cast<void*>(&moe_call), kMoeCallCapsule);
  mod.attr("embedding_call") = py::capsule(reinterpret_cast<void*>(&embedding_call), kEmbeddingCallCapsule);
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
  mod.def("moe_experts_bf16", &moe_experts_bf16, py::arg("xs"), py::arg("bounds"), py::arg("w13"), py::arg("w2"),
          py::arg("inter"), py::arg("hidden"), py::arg("h"), py::arg("act"), py::arg("y"), py::arg("threads"),
          "One MoE layer's routed experts (w13, SiLU x up, w2) by the AVX512-BF16 panel kernel, one call");
  // module_local: two builds of this extension loaded in one process (side-by-side benchmarks of two
  // builds) each keep their own classes instead of failing at import
  py::class_<MoeLayer>(mod, "MoeLayer", py::module_local(),
                       "A MoE layer's expert tables checked once; run() is the fast path's per-call entry")
      .def(py::init<const py::array&, const py::array&, int64_t, int64_t>(), py::arg("w13"), py::arg("w2"),
           py::arg("inter"), py::arg("hidden"))
      .def("run", &MoeLayer::run, py::arg("x"), py::arg("t_count"), py::arg("ids"), py::arg("id_bytes"),
           py::arg("weights"), py::arg("k"), py::arg("out"), py::arg("on_input"), py::arg("threads"),
           "A MoE layer's routed experts for tokens x (routing, both GEMMs, SiLU x up, weighted sum), one call, "
           "on buffers at the given addresses")
      .def("handle", &MoeLayer::handle,
           "A capsule holding this layer's address (for the torch op extension; the caller keeps the layer alive)")
      .def_property_readonly("hidden", &MoeLayer::hidden)
      .def_property_readonly("inter", &MoeLayer::inter)
      .def_property_readonly("experts", &MoeLayer::experts);
  mod.def("packed_embedding", &packed_embedding, py::arg("ids"), py::arg("tiles"), py::arg("luts"),
          py::arg("exc_start"), py::arg("exc"), py::arg("m"), py::arg("k"), py::arg("rows"), py::arg("out"),
          py::arg("threads"), py::arg("isa"),
          "out[i] = row ids[i] of W (clamped to [0, rows); rows >= m are zeros): only the touched tile rows decoded");
  mod.def("bf16_supported", &avx512bf16_supported, "Whether this CPU has AVX512-BF16 (vdpbf16ps)");
  mod.def("packed_gemm_bf16", &packed_gemm_bf16, py::arg("x"), py::arg("tiles"), py::arg("luts"),
          py::arg("exc_start"), py::arg("exc"), py::arg("m"), py::arg("k"), py::arg("bias"), py::arg("out"),
          py::arg("threads"),
          "packed_gemm by the AVX512-BF16 panel kernel (vdpbf16ps; fast mode, not bit-identical to packed_gemm)");
  mod.def("packed_decode_bf16", &packed_decode_bf16, py::arg("tiles"), py::arg("luts"), py::arg("exc_start"),
          py::arg("exc"), py::arg("m"), py::arg("k"), py::arg("out"), py::arg("threads"),
          "Decode W[m, k] by the AVX512-BF16 panel kernel's decode step (bit-exactness tests)");
  py::class_<PackedLinear>(mod, "PackedLinear", py::module_local(),
                           "A byte-split weight checked once; run() is the eager fast path's per-call entry")
      .def(py::init<const py::array&, const py::array&, const py::array&, const py::array&, int64_t, int64_t>(),
           py::arg("tiles"), py::arg("luts"), py::arg("exc_start"), py::arg("exc"), py::arg("m"), py::arg("k"))
      .def("run", &PackedLinear::run, py::arg("x"), py::arg("n"), py::arg("y"), py::arg("bias"), py::arg("threads"),
           py::arg("panel"),
           "y[n, m] = x[n, k] . W^T + bias at the given addresses (contiguous bf16; bias 0 = none)")
      .def_property_readonly("m", &PackedLinear::m)
      .def_property_readonly("k", &PackedLinear::k);
  mod.def("pack", &pack, py::arg("w"), py::arg("threads"),
          "W (bf16 bits, uint16 [m, k]) -> (tiles, luts, exc_start, exc) of the byte-split layout");
  mod.def("layout_constants", &layout_constants, "The byte-split layout's constants (tests compare them with Python)");
}
