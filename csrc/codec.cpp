// Native multi-threaded CPU codec of TCA-TBE v1 (docs/FORMAT.md), exposed as
// zipserv_vllm._C.encode / decode. The per-tile work lives in
// zipserv/tile_codec.h; this file validates arrays, splits tiles over threads
// and builds the canonical layout.
//
// Encode: each thread encodes a contiguous range of tiles (in row-major tile
// order) into its own region of one worst-case-sized buffer per stream, with
// offsets relative to its region; the regions are then gathered in parallel
// into exact-size streams and the offsets rebased (one thread: the buffer is
// the stream, no copy). Segments end up in increasing tile order with no gaps,
// byte-identical to the reference encoder for any thread count.
//
// Decode: validates dtypes, shapes and contiguity up front, and each tile's
// base and offsets right before decoding it (so corrupt input is never read
// out of bounds); threads own disjoint tiles of the output.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <limits>
#include <memory>
#include <new>
#include <exception>
#include <stdexcept>
#include <system_error>
#include <string>
#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

#include <omp.h>
#include <pthread.h>

#include <zlib.h>

#include "zipserv/format.h"
#include "zipserv/tile_codec.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace py = pybind11;

namespace zipserv {
namespace {

// ------------------------------------------------------------ ISA choice
std::atomic<int> g_isa_override{-1};  // -1: auto

Isa current_isa() {
  int o = g_isa_override.load(std::memory_order_relaxed);
  return o < 0 ? best_isa() : static_cast<Isa>(o);
}

const char* isa_name(Isa isa) { return isa == Isa::kAvx2 ? "avx2" : "scalar"; }

void set_isa(const std::string& name) {
  if (name == "auto") {
    g_isa_override = -1;
  } else if (name == "scalar") {
    g_isa_override = static_cast<int>(Isa::kScalar);
  } else if (name == "avx2") {
    if (!cpu_has_avx2()) throw py::value_error("set_isa('avx2'): this CPU (or build) lacks AVX2/BMI2/POPCNT");
    g_isa_override = static_cast<int>(Isa::kAvx2);
  } else {
    throw py::value_error("set_isa: expected 'auto', 'scalar' or 'avx2', got '" + name + "'");
  }
}

py::list supported_isas() {
  py::list v;
  v.append("scalar");
  if (cpu_has_avx2()) v.append("avx2");
  return v;
}

// --------------------------------------------------------------- threads
// Run fn(i, first, last) for n_chunks contiguous chunks of [0, n) on OpenMP
// threads. The extension links libgomp.so.1, and torch (imported first by
// zipserv_vllm) has loaded its own copy under that soname, so these are
// torch's intra-op threads: inside a vLLM CPU worker, the threads vLLM bound to
// its cores (fresh std::threads would inherit the calling thread's affinity,
// one core there). A process forked after OpenMP threads ran cannot start a
// parallel region (GNU OpenMP waits for workers that do not exist in the
// child), so a forked child runs every chunk on its calling thread; so does a
// call from inside a parallel region.
std::atomic<bool> g_forked{false};
std::once_flag g_atfork_once;
void mark_forked() { g_forked.store(true); }

void parallel_chunks(int64_t n, int n_chunks, const std::function<void(int, int64_t, int64_t)>& fn) {
  std::call_once(g_atfork_once, [] { pthread_atfork(nullptr, nullptr, mark_forked); });
  auto bounds = [&](int i) { return n * i / n_chunks; };
  if (n_chunks <= 1) {
    fn(0, 0, n);
    return;
  }
  // An exception must not leave an OpenMP region: each chunk's is kept and the
  // first rethrown afterwards.
  std::vector<std::exception_ptr> errors(n_chunks);
  auto run = [&](int i) {
    try {
      fn(i, bounds(i), bounds(i + 1));
    } catch (...) {
      errors[i] = std::current_exception();
    }
  };
  if (g_forked.load(std::memory_order_relaxed) || omp_in_parallel()) {
    for (int i = 0; i < n_chunks; ++i) run(i);
  } else {
#pragma omp parallel for schedule(static, 1) num_threads(n_chunks)
    for (int i = 0; i < n_chunks; ++i) run(i);
  }
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

int omp_threads_now() { return omp_get_max_threads(); }

// Tiles are staged a block at a time: the block's 64 matrix rows are read (or
// written) row by row, as long contiguous runs, and each tile is worked on in
// its own contiguous 64 x 64 buffer. Visiting a tile's rows directly, K elements
// apart, defeats the prefetchers and thrashes a few cache sets.
constexpr int kBlockTiles = 32;
constexpr int64_t kStageStride = kTileElems + 64;  // elements; staggers cache sets

struct Stage {
  std::vector<uint16_t> mem = std::vector<uint16_t>(kBlockTiles * kStageStride + 32);
  uint16_t* tile(int b) {
    auto base = reinterpret_cast<uintptr_t>(mem.data());
    return reinterpret_cast<uint16_t*>((base + 63) & ~uintptr_t{63}) + b * kStageStride;
  }
};

// Copy one 64-element row segment to the output; with stream, bypass the cache
// (non-temporal stores) when both ends allow it.
inline void put_row(uint16_t* dst, const uint16_t* src, int n, bool stream) {
#if defined(__x86_64__) || defined(_M_X64)
  if (stream && n == kTile && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    for (int i = 0; i < kTile; i += 8)
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), _mm_load_si128(reinterpret_cast<const __m128i*>(src + i)));
    return;
  }
#endif
  (void)stream;
  std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(uint16_t));
}

inline void stream_fence() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_sfence();
#endif
}

int chunks_for(int threads, int64_t tiles) {
  if (threads < 1) throw py::value_error("threads must be >= 1, got " + std::to_string(threads));
  return static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(tiles, 1)));
}

// --------------------------------------------------------------- arrays
std::string dtype_str(const py::array& a) { return py::str(a.dtype()).cast<std::string>(); }

void require(const py::array& a, const char* name, char kind, int itemsize, int ndim) {
  if (a.dtype().kind() != kind || a.itemsize() != itemsize) {
    const char* want = kind == 'u' ? (itemsize == 1 ? "uint8" : itemsize == 2 ? "uint16" : "uint64") : "int64";
    throw py::value_error(std::string(name) + " must be " + want + ", got " + dtype_str(a));
  }
  if (a.dtype().byteorder() == '>')
    throw py::value_error(std::string(name) + " must be little-endian, got " + dtype_str(a));
  if (a.ndim() != ndim)
    throw py::value_error(std::string(name) + " must be " + std::to_string(ndim) + "-D, got " +
                          std::to_string(a.ndim()) + "-D");
  if (!(a.flags() & py::array::c_style))
    throw py::value_error(std::string(name) + " must be C-contiguous");
}

std::string shape_str(const py::array& a) {
  std::string s = "[";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

void require_shape(const py::array& a, const char* name, std::initializer_list<py::ssize_t> shape,
                   int64_t m, int64_t k) {
  bool ok = static_cast<size_t>(a.ndim()) == shape.size();
  size_t i = 0;
  for (auto d : shape) ok = ok && a.shape(i++) == d;
  if (!ok) {
    std::string want = "[";
    i = 0;
    for (auto d : shape) want += (i++ ? ", " : "") + std::to_string(d);
    throw py::value_error(std::string(name) + " has shape " + shape_str(a) + ", expected " + want + "] for a " +
                          std::to_string(m) + " x " + std::to_string(k) + " matrix");
  }
}

// ------------------------------------------------------- output memory
// Fresh memory costs a page fault per 4 KiB page on first touch, which on a
// virtual machine costs about as much as encoding the page. Large outputs
// therefore live in blocks that are (on Linux) mapped with transparent huge
// pages and, once NumPy frees the array, kept in a small pool for the next
// call: encoding checkpoint after checkpoint reuses already-faulted pages.
struct Block {
  void* map = nullptr;  // mmap'ed region (nullptr: data came from malloc)
  size_t map_len = 0;
  void* data = nullptr;
  size_t cap = 0;  // usable bytes at data
};

constexpr size_t kBigBlock = size_t{2} << 20;  // below this: plain malloc, no pool
constexpr size_t kPoolSlots = 8;
constexpr size_t kPoolBytes = size_t{512} << 20;  // capacity the pool may keep

std::mutex g_pool_mu;
std::vector<Block> g_pool;

void unmap(const Block& b) {
#if defined(__linux__)
  if (b.map) munmap(b.map, b.map_len);
#endif
}

Block block_get(size_t bytes) {
  bytes = std::max<size_t>(bytes, 64);
  if (bytes >= kBigBlock) {
    std::lock_guard<std::mutex> lock(g_pool_mu);
    int best = -1;
    for (size_t i = 0; i < g_pool.size(); ++i)  // smallest that fits, and not far too large
      if (g_pool[i].cap >= bytes && g_pool[i].cap <= 2 * bytes + 4 * kBigBlock &&
          (best < 0 || g_pool[i].cap < g_pool[best].cap))
        best = static_cast<int>(i);
    if (best >= 0) {
      Block b = g_pool[best];
      g_pool.erase(g_pool.begin() + best);
      return b;
    }
  }
#if defined(__linux__)
  if (bytes >= kBigBlock) {
    Block b;
    b.cap = (bytes + 4095) & ~size_t{4095};
    b.map_len = b.cap + kBigBlock;  // room to align to a huge page
    b.map = mmap(nullptr, b.map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (b.map == MAP_FAILED) throw std::bad_alloc();
    auto start = (reinterpret_cast<uintptr_t>(b.map) + kBigBlock - 1) & ~uintptr_t{kBigBlock - 1};
    b.data = reinterpret_cast<void*>(start);
    madvise(b.data, b.cap, MADV_HUGEPAGE);  // advisory: failure is harmless
    return b;
  }
#endif
  Block b;
  b.cap = bytes;
  b.data = std::malloc(bytes);
  if (!b.data) throw std::bad_alloc();
  return b;
}

void block_put(const Block& b) {
  if (!b.map) {
    std::free(b.data);
    return;
  }
  std::lock_guard<std::mutex> lock(g_pool_mu);
  size_t total = b.cap;
  for (const Block& x : g_pool) total += x.cap;
  while (!g_pool.empty() && (g_pool.size() >= kPoolSlots || total > kPoolBytes)) {
    total -= g_pool.front().cap;  // drop the oldest
    unmap(g_pool.front());
    g_pool.erase(g_pool.begin());
  }
  if (b.cap > kPoolBytes)
    unmap(b);
  else
    g_pool.push_back(b);
}

void trim_pool() {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  for (const Block& x : g_pool) unmap(x);
  g_pool.clear();
}

// Owns a Block until handed to a NumPy array.
class Buffer {
 public:
  explicit Buffer(size_t bytes) : b_(block_get(bytes)), owned_(true) {}
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    if (owned_) block_put(b_);
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(b_.data);
  }
  size_t capacity() const { return b_.cap; }
  // A NumPy array of the given shape over the block; the array owns it now.
  template <typename T>
  py::array_t<T> to_array(std::vector<py::ssize_t> shape) {
    auto* keep = new Block(b_);
    py::capsule owner(keep, [](void* p) {
      auto* blk = static_cast<Block*>(p);
      block_put(*blk);
      delete blk;
    });
    owned_ = false;
    std::vector<py::ssize_t> strides(shape.size());
    py::ssize_t st = sizeof(T);
    for (size_t i = shape.size(); i-- > 0;) {
      strides[i] = st;
      st *= shape[i];
    }
    return py::array_t<T>(shape, strides, static_cast<T*>(keep->data), owner);
  }

 private:
  Block b_;
  bool owned_;
};

// The first n elements of a worst-case-sized stream buffer as a NumPy array.
// When most of the buffer went unused (e.g. the fallback stream of ordinary
// weights, ~2% of its worst case) the elements move to an exact-size block,
// so that a kept array does not pin huge pages it does not need.
template <typename T>
py::array_t<T> stream_array(Buffer& buf, int64_t n) {
  const size_t used = static_cast<size_t>(n) * sizeof(T);
  if (buf.capacity() >= kBigBlock && 2 * used < buf.capacity()) {
    Buffer exact(used);
    std::memcpy(exact.as<T>(), buf.as<T>(), used);
    return exact.to_array<T>({n});
  }
  return buf.to_array<T>({n});
}

py::array_t<uint16_t> empty_bits(int64_t m, int64_t k) {
  if (m < 1 || k < 1) throw py::value_error("empty_bits: shape must be positive, got [" + std::to_string(m) + ", " +
                                            std::to_string(k) + "]");
  Buffer buf(static_cast<size_t>(m) * static_cast<size_t>(k) * sizeof(uint16_t));
  return buf.to_array<uint16_t>({m, k});
}

// ---------------------------------------------------------------- encode
py::tuple encode(const py::array& bits, int threads) {
  require(bits, "bits", 'u', 2, 2);
  const int64_t m = bits.shape(0), k = bits.shape(1);
  if (m < 1 || k < 1)
    throw py::value_error("cannot encode an empty matrix of shape " + shape_str(bits));
  const int64_t mt = (m + kTile - 1) / kTile, kt = (k + kTile - 1) / kTile, g_count = mt * kt;
  const int n_chunks = chunks_for(threads, g_count);
  const Isa isa = current_isa();

  Buffer bitmaps_buf(static_cast<size_t>(g_count) * kPlanes * kFragsPerTile * sizeof(uint64_t));
  py::array_t<uint8_t> base({mt, kt});
  py::array_t<int64_t> offsets({mt, kt, int64_t{2}});
  const uint16_t* src = static_cast<const uint16_t*>(bits.data());
  uint64_t* bm = bitmaps_buf.as<uint64_t>();
  uint8_t* bp = base.mutable_data();
  int64_t* op = offsets.mutable_data();

  // Worst case: every element in one stream, plus each chunk's write slack
  // (encoders store whole words past their segment's end). Untouched pages
  // cost nothing.
  Buffer sm_buf(static_cast<size_t>(g_count) * kTileElems + static_cast<size_t>(n_chunks) * kSmWriteSlack);
  Buffer fb_buf((static_cast<size_t>(g_count) * kTileElems + static_cast<size_t>(n_chunks) * kFbWriteSlack) *
                sizeof(uint16_t));
  uint8_t* sm = sm_buf.as<uint8_t>();
  uint16_t* fb = fb_buf.as<uint16_t>();
  std::vector<int64_t> sm_used(n_chunks), fb_used(n_chunks), first_tile(n_chunks + 1);
  for (int i = 0; i <= n_chunks; ++i) first_tile[i] = g_count * i / n_chunks;
  // Where chunk c encodes: its worst case, behind the previous chunks' worst
  // cases and slack, so that no chunk writes into another's region.
  auto sm_region = [&](int c) { return first_tile[c] * kTileElems + int64_t{c} * kSmWriteSlack; };
  auto fb_region = [&](int c) { return first_tile[c] * kTileElems + int64_t{c} * kFbWriteSlack; };
  int64_t sm_total = 0, fb_total = 0;
  std::unique_ptr<Buffer> sm_final, fb_final;  // exact-size streams (several chunks)
  {
    py::gil_scoped_release nogil;
    parallel_chunks(g_count, n_chunks, [&](int c, int64_t g0, int64_t g1) {
      uint8_t* smr = sm + sm_region(c);
      uint16_t* fbr = fb + fb_region(c);
      int64_t so = 0, fo = 0;
      int hint = -1;  // the previous tile's base: where to look for the next window
      Stage stage;
      for (int64_t g = g0; g < g1;) {
        const int64_t tm = g / kt, tk0 = g % kt;
        const int nb = static_cast<int>(std::min<int64_t>({kBlockTiles, kt - tk0, g1 - g}));
        const int rows = static_cast<int>(std::min<int64_t>(kTile, m - tm * kTile));
        const int64_t col0 = tk0 * kTile;
        const int64_t width = std::min<int64_t>(nb * kTile, k - col0);
        for (int r = 0; r < rows; ++r) {
          const uint16_t* row = src + (tm * kTile + r) * k + col0;
          for (int b = 0; b < nb; ++b)
            std::memcpy(stage.tile(b) + r * kTile, row + b * kTile,
                        static_cast<size_t>(std::min<int64_t>(kTile, width - b * kTile)) * sizeof(uint16_t));
        }
        for (int b = 0; b < nb; ++b, ++g) {
          const int cols = static_cast<int>(std::min<int64_t>(kTile, width - b * kTile));
          const int h = encode_tile(isa, stage.tile(b), kTile, rows, cols, bm + g * kPlanes * kFragsPerTile,
                                    bp + g, smr + so, fbr + fo, hint);
          hint = bp[g];
          op[2 * g] = so;
          op[2 * g + 1] = fo;
          so += sm_segment_len(h);
          fo += fb_segment_len(h);
        }
      }
      sm_used[c] = so;
      fb_used[c] = fo;
    });
    std::vector<int64_t> sm_start(n_chunks), fb_start(n_chunks);
    for (int c = 0; c < n_chunks; ++c) {
      sm_start[c] = sm_total;
      fb_start[c] = fb_total;
      sm_total += sm_used[c];
      fb_total += fb_used[c];
    }
    if (n_chunks > 1) {
      // Gather the chunks' segments, in parallel, into exact-size streams in
      // chunk (= tile) order, and rebase the offsets.
      sm_final = std::make_unique<Buffer>(static_cast<size_t>(sm_total));
      fb_final = std::make_unique<Buffer>(static_cast<size_t>(fb_total) * sizeof(uint16_t));
      uint8_t* smf = sm_final->as<uint8_t>();
      uint16_t* fbf = fb_final->as<uint16_t>();
      parallel_chunks(n_chunks, n_chunks, [&](int c, int64_t, int64_t) {
        std::memcpy(smf + sm_start[c], sm + sm_region(c), static_cast<size_t>(sm_used[c]));
        std::memcpy(fbf + fb_start[c], fb + fb_region(c), static_cast<size_t>(fb_used[c]) * sizeof(uint16_t));
        for (int64_t g = first_tile[c]; g < first_tile[c + 1]; ++g) {
          op[2 * g] += sm_start[c];
          op[2 * g + 1] += fb_start[c];
        }
      });
    }
  }
  py::array_t<uint64_t> bitmaps = bitmaps_buf.to_array<uint64_t>({mt, kt, kPlanes, kFragsPerTile});
  py::array_t<uint8_t> sm_arr = sm_final ? sm_final->to_array<uint8_t>({sm_total}) : stream_array<uint8_t>(sm_buf, sm_total);
  py::array_t<uint16_t> fb_arr = fb_final ? fb_final->to_array<uint16_t>({fb_total}) : stream_array<uint16_t>(fb_buf, fb_total);
  return py::make_tuple(bitmaps, base, offsets, sm_arr, fb_arr);
}

// ---------------------------------------------------------------- decode
void decode(const py::array& bitmaps, const py::array& base, const py::array& offsets, const py::array& sm,
            const py::array& fb, py::array out, int threads) {
  require(out, "out", 'u', 2, 2);
  if (!out.writeable()) throw py::value_error("out must be writeable");
  const int64_t m = out.shape(0), k = out.shape(1);
  if (m < 1 || k < 1) throw py::value_error("out has empty shape " + shape_str(out));
  const int64_t mt = (m + kTile - 1) / kTile, kt = (k + kTile - 1) / kTile, g_count = mt * kt;
  require(bitmaps, "bitmaps", 'u', 8, 4);
  require_shape(bitmaps, "bitmaps", {mt, kt, kPlanes, kFragsPerTile}, m, k);
  require(base, "base", 'u', 1, 2);
  require_shape(base, "base", {mt, kt}, m, k);
  require(offsets, "offsets", 'i', 8, 3);
  require_shape(offsets, "offsets", {mt, kt, 2}, m, k);
  require(sm, "sm", 'u', 1, 1);
  require(fb, "fb", 'u', 2, 1);
  const int n_chunks = chunks_for(threads, g_count);
  const Isa isa = current_isa();

  const uint64_t* bm = static_cast<const uint64_t*>(bitmaps.data());
  const uint8_t* bp = static_cast<const uint8_t*>(base.data());
  const int64_t* op = static_cast<const int64_t*>(offsets.data());
  const uint8_t* smp = static_cast<const uint8_t*>(sm.data());
  const uint16_t* fbp = static_cast<const uint16_t*>(fb.data());
  const int64_t sm_len = sm.shape(0), fb_len = fb.shape(0);
  uint16_t* dst = static_cast<uint16_t*>(out.mutable_data());

  // Lowest bad tile so far (threads stop past it) and its problem.
  // Large outputs bypass the cache: they will not be re-read soon.
  const bool stream = m * k * 2 >= (int64_t{8} << 20);
  std::atomic<int64_t> first_bad{std::numeric_limits<int64_t>::max()};
  std::vector<const char*> why(n_chunks, nullptr);
  std::vector<int64_t> where(n_chunks, -1);
  {
    py::gil_scoped_release nogil;
    parallel_chunks(g_count, n_chunks, [&](int c, int64_t g0, int64_t g1) {
      Stage stage;
      for (int64_t g = g0; g < g1;) {
        if (g > first_bad.load(std::memory_order_relaxed)) return;
        const int64_t tm = g / kt, tk0 = g % kt;
        const int nb = static_cast<int>(std::min<int64_t>({kBlockTiles, kt - tk0, g1 - g}));
        for (int b = 0; b < nb; ++b) {
          const int64_t t = g + b;
          const char* err = decode_tile_checked(isa, bm + t * kPlanes * kFragsPerTile, bp[t], smp, sm_len,
                                                op[2 * t], fbp, fb_len, op[2 * t + 1], stage.tile(b), kTile);
          if (err) {
            why[c] = err;
            where[c] = t;
            int64_t cur = first_bad.load();
            while (t < cur && !first_bad.compare_exchange_weak(cur, t)) {
            }
            return;
          }
        }
        const int rows = static_cast<int>(std::min<int64_t>(kTile, m - tm * kTile));
        const int64_t col0 = tk0 * kTile;
        const int64_t width = std::min<int64_t>(nb * kTile, k - col0);
        for (int r = 0; r < rows; ++r) {
          uint16_t* row = dst + (tm * kTile + r) * k + col0;
          for (int b = 0; b < nb; ++b)
            put_row(row + b * kTile, stage.tile(b) + r * kTile,
                    static_cast<int>(std::min<int64_t>(kTile, width - b * kTile)), stream);
        }
        g += nb;
      }
      stream_fence();
    });
  }
  const int64_t bad = first_bad.load();
  if (bad != std::numeric_limits<int64_t>::max()) {
    const char* msg = "invalid";
    for (int c = 0; c < n_chunks; ++c)
      if (where[c] == bad) msg = why[c];
    throw py::value_error("tile (" + std::to_string(bad / kt) + ", " + std::to_string(bad % kt) + "): " + msg +
                          " (base " + std::to_string(bp[bad]) + ", offsets (" + std::to_string(op[2 * bad]) +
                          ", " + std::to_string(op[2 * bad + 1]) + "), streams of " + std::to_string(sm_len) +
                          " sm bytes and " + std::to_string(fb_len) + " fb elements): truncated or corrupt data");
  }
}

// ---------------------------------------------------------------- checks
// CRC-32 (zlib's polynomial, as zlib.crc32) of a byte range, in parallel:
// chunks are summed on their own and joined with crc32_combine.
uint32_t crc32_range(const uint8_t* p, size_t n, int threads) {
  constexpr size_t kMinChunk = size_t{4} << 20;
  const int n_chunks = static_cast<int>(std::max<size_t>(1, std::min<size_t>(threads, n / kMinChunk)));
  std::vector<uLong> part(n_chunks, 0);
  std::vector<size_t> len(n_chunks, 0);
  parallel_chunks(static_cast<int64_t>(n), n_chunks, [&](int c, int64_t a, int64_t b) {
    uLong crc = crc32_z(0L, Z_NULL, 0);
    part[c] = crc32_z(crc, p + a, static_cast<z_size_t>(b - a));
    len[c] = static_cast<size_t>(b - a);
  });
  uLong crc = part[0];
  for (int c = 1; c < n_chunks; ++c) crc = crc32_combine(crc, part[c], static_cast<z_off_t>(len[c]));
  return static_cast<uint32_t>(crc);
}

uint32_t crc32_buffer(const py::buffer& b, int threads) {
  if (threads < 1) throw py::value_error("threads must be >= 1, got " + std::to_string(threads));
  py::buffer_info info = b.request();
  if (info.ndim > 0) {
    py::ssize_t expect = info.itemsize;
    for (py::ssize_t i = info.ndim; i-- > 0;) {
      if (info.shape[i] > 1 && info.strides[i] != expect) throw py::value_error("crc32: the buffer must be contiguous");
      expect *= info.shape[i];
    }
  }
  const size_t n = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
  py::gil_scoped_release nogil;
  return crc32_range(static_cast<const uint8_t*>(info.ptr), n, threads);
}

bool bytes_equal(const py::buffer& a, const py::buffer& b, int threads) {
  if (threads < 1) throw py::value_error("threads must be >= 1, got " + std::to_string(threads));
  py::buffer_info x = a.request(), y = b.request();
  const size_t n = static_cast<size_t>(x.size) * x.itemsize, n2 = static_cast<size_t>(y.size) * y.itemsize;
  if (n != n2) return false;
  const uint8_t* p = static_cast<const uint8_t*>(x.ptr);
  const uint8_t* q = static_cast<const uint8_t*>(y.ptr);
  constexpr size_t kMinChunk = size_t{8} << 20;
  const int n_chunks = static_cast<int>(std::max<size_t>(1, std::min<size_t>(threads, n / kMinChunk)));
  std::atomic<bool> same{true};
  py::gil_scoped_release nogil;
  parallel_chunks(static_cast<int64_t>(n), n_chunks, [&](int, int64_t lo, int64_t hi) {
    if (hi > lo && std::memcmp(p + lo, q + lo, static_cast<size_t>(hi - lo)) != 0) same = false;
  });
  return same.load();
}

// CRC-32 of every tile's stored bytes (docs/FORMAT.md section 6, zs_crc): its
// 1536 bit-plane bytes, its base byte, its sign-mantissa segment and its
// fallback segment, in that order. A segment outside its stream is an error
// naming the tile (as decode's).
py::array_t<uint32_t> tile_crc(const py::array& bitmaps, const py::array& base, const py::array& offsets,
                               const py::array& sm, const py::array& fb, int threads) {
  require(bitmaps, "bitmaps", 'u', 8, 4);
  require(base, "base", 'u', 1, 2);
  require(offsets, "offsets", 'i', 8, 3);
  require(sm, "sm", 'u', 1, 1);
  require(fb, "fb", 'u', 2, 1);
  const int64_t mt = bitmaps.shape(0), kt = bitmaps.shape(1), g_count = mt * kt;
  if (bitmaps.shape(2) != kPlanes || bitmaps.shape(3) != kFragsPerTile || base.shape(0) != mt ||
      base.shape(1) != kt || offsets.shape(0) != mt || offsets.shape(1) != kt || offsets.shape(2) != 2)
    throw py::value_error("tile_crc: bitmaps " + shape_str(bitmaps) + ", base " + shape_str(base) + " and offsets " +
                          shape_str(offsets) + " do not describe one tile grid");
  py::array_t<uint32_t> out({mt, kt});
  const uint64_t* bm = static_cast<const uint64_t*>(bitmaps.data());
  const uint8_t* bp = static_cast<const uint8_t*>(base.data());
  const int64_t* op = static_cast<const int64_t*>(offsets.data());
  const uint8_t* smp = static_cast<const uint8_t*>(sm.data());
  const uint8_t* fbp = static_cast<const uint8_t*>(fb.data());
  const int64_t sm_len = sm.shape(0), fb_len = fb.shape(0);
  uint32_t* dst = out.mutable_data();
  std::atomic<int64_t> first_bad{std::numeric_limits<int64_t>::max()};
  const int n_chunks = chunks_for(threads, g_count);
  {
    py::gil_scoped_release nogil;
    parallel_chunks(g_count, n_chunks, [&](int, int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const uint64_t* planes = bm + g * kPlanes * kFragsPerTile;
        int64_t h = 0;
        for (int f = 0; f < kFragsPerTile; ++f)
          h += __builtin_popcountll(planes[f] | planes[kFragsPerTile + f] | planes[2 * kFragsPerTile + f]);
        const int64_t so = op[2 * g], fo = op[2 * g + 1];
        const int64_t sl = sm_segment_len(h), fl = fb_segment_len(h);
        if (so < 0 || fo < 0 || so + sl > sm_len || fo + fl > fb_len) {
          int64_t cur = first_bad.load();
          while (g < cur && !first_bad.compare_exchange_weak(cur, g)) {
          }
          return;
        }
        uLong crc = crc32_z(0L, Z_NULL, 0);
        crc = crc32_z(crc, reinterpret_cast<const Bytef*>(planes), kTileBitmapBytes);
        crc = crc32_z(crc, bp + g, 1);
        crc = crc32_z(crc, smp + so, static_cast<z_size_t>(sl));
        crc = crc32_z(crc, fbp + 2 * fo, static_cast<z_size_t>(2 * fl));
        dst[g] = static_cast<uint32_t>(crc);
      }
    });
  }
  const int64_t bad = first_bad.load();
  if (bad != std::numeric_limits<int64_t>::max())
    throw py::value_error("tile (" + std::to_string(bad / kt) + ", " + std::to_string(bad % kt) +
                          "): segments at (" + std::to_string(op[2 * bad]) + ", " + std::to_string(op[2 * bad + 1]) +
                          ") overrun streams of " + std::to_string(sm_len) + " sm bytes and " +
                          std::to_string(fb_len) + " fb elements: truncated or corrupt data");
  return out;
}

}  // namespace

// The OS threads that ran the chunks of one parallel_chunks call with `threads`
// chunks (tests: the codec really runs on that many threads).
int threads_used(int threads) {
  std::mutex mu;
  std::vector<std::thread::id> ids;
  parallel_chunks(threads, threads, [&](int, int64_t, int64_t) {
    // long enough that one thread cannot take every chunk before the others start
    volatile double sink = 0;
    for (int i = 0; i < 2000000; ++i) sink = sink + i * 0.5;
    std::lock_guard<std::mutex> lock(mu);
    ids.push_back(std::this_thread::get_id());
  });
  std::sort(ids.begin(), ids.end());
  return static_cast<int>(std::unique(ids.begin(), ids.end()) - ids.begin());
}

void register_codec(py::module_& m) {
  // at import: a fork before the first parallel call must be seen too
  std::call_once(g_atfork_once, [] { pthread_atfork(nullptr, nullptr, mark_forked); });
  m.def("threads_used", &threads_used, py::arg("threads"),
        "Distinct OS threads one parallel codec call with this many chunks ran on (torch's OpenMP team)");
  m.def("omp_max_threads", &omp_threads_now, "omp_get_max_threads() of the OpenMP runtime the codec uses");
  m.def("encode", &encode, py::arg("bits"), py::arg("threads") = 1,
        "Encode a C-contiguous uint16 [M, K] array of BF16 bits to (bitmaps, base, offsets, sm, fb), "
        "byte-identical to zipserv_vllm.format.reference.encode.");
  m.def("decode", &decode, py::arg("bitmaps"), py::arg("base"), py::arg("offsets"), py::arg("sm"), py::arg("fb"),
        py::arg("out"), py::arg("threads") = 1,
        "Decode into the preallocated C-contiguous uint16 [M, K] array out; ValueError on invalid input.");
  m.def("empty_bits", &empty_bits, py::arg("m"), py::arg("k"),
        "An uninitialized C-contiguous uint16 [m, k] array for decode's out, from recycled huge-page memory.");
  m.def("trim_pool", &trim_pool, "Unmap the memory kept for reuse by later encode/empty_bits calls.");
  m.def("set_isa", &set_isa, py::arg("name"),
        "Force the tile kernels: 'scalar', 'avx2' (if supported) or 'auto' (the best this CPU runs).");
  m.def("get_isa", [] { return std::string(isa_name(current_isa())); }, "The instruction set in use.");
  m.def("supported_isas", &supported_isas, "Instruction sets this CPU and build can run.");
  m.def("crc32", &crc32_buffer, py::arg("buffer"), py::arg("threads") = 1,
        "zlib CRC-32 of a contiguous buffer's bytes (as zlib.crc32), computed on threads.");
  m.def("bytes_equal", &bytes_equal, py::arg("a"), py::arg("b"), py::arg("threads") = 1,
        "True when two buffers hold the same bytes.");
  m.def("tile_crc", &tile_crc, py::arg("bitmaps"), py::arg("base"), py::arg("offsets"), py::arg("sm"),
        py::arg("fb"), py::arg("threads") = 1,
        "uint32 [Mt, Kt]: the CRC-32 of each tile's stored bytes (docs/FORMAT.md, zs_crc).");
}

}  // namespace zipserv
