// zipserv_vllm._cpu_op: the CPU kernels of the zipserv::packed_gemm and
// zipserv::moe_experts ops in C++,
// so that a compiled vLLM graph calls the byte-split GEMM the way it calls
// vLLM's own BF16 kernel (_C::onednn_mm): dispatcher -> C++, no Python.
//
// The op is defined, and implemented for every device, in Python
// (zipserv_vllm/kernels/ops.py, packed_gemm); that implementation stays the
// one definition of what the op does. This file registers a CPU kernel that
// serves the hot case itself and hands every other call to that Python
// implementation (installed by kernels/cpu.py):
//   * the hot case: mode "fast", x bf16 with k features and at least one row,
//     the weight's four arrays contiguous CPU tensors of the layout's dtypes
//     and shapes, no bias or a bf16 [m] one, a shape the Python side has
//     served once (remember(): the dispatcher's kernel per token bucket and
//     the fused_max_n threshold with the raw environment value it was parsed
//     from), n within that threshold, and no set_isa / set_threads override
//     (enable()). It then runs the kernel through _cpu_gemm's capsule entry
//     (PackedCall, csrc/include/zipserv/cpu_gemm.h) on torch's thread count;
//   * everything else, and a kernel failure (a malformed tile, out of
//     memory), calls the Python implementation, which computes, refuses or
//     raises exactly as without this extension.
// The same for zipserv::moe_experts (defined, with its Python implementation, in
// zipserv_vllm/vllm_plugin/moe.py): a MoE layer the Python side served through the
// one-call kernel (_cpu_gemm.MoeLayer) and registered by name (remember_moe) is served
// here through the capsule entry _cpu_gemm.moe_call (MoeCall), while nothing that
// decides its path changed: forget() (the dispatcher's choices, set_isa, set_threads),
// forget_moe() (a layer of that name registered or freed) and any change of the
// layers' parts (kernels/cpu.py moe_op_forget) drop it. Any other call, and a kernel
// failure (an expert id out of range, a malformed tile), goes to the Python
// implementation.
// Built against the torch it was compiled with (the other extensions take
// arrays and need no torch ABI); the kernel is registered by install(), which
// kernels/cpu.py calls only when torch.__version__ is that one.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "zipserv/cpu_gemm.h"

namespace {

using zipserv::cpu::EmbeddingCall;
using zipserv::cpu::EmbeddingCallFn;
using zipserv::cpu::MoeCall;
using zipserv::cpu::MoeCallFn;
using zipserv::cpu::PackedCall;
using zipserv::cpu::PackedCallFn;

constexpr int kBuckets = 10;  // cpu_dispatch.BUCKETS: 1, 2, 4, ..., 512

// What the Python side decided for one weight shape.
struct Choice {
  std::array<bool, kBuckets> panel;    // per bucket: the panel kernel, else the fused one
  int64_t max_n;                       // fused_max_n(): above it, the Python path (decode + F.linear)
  std::optional<std::string> env_raw;  // the threshold variable's raw value it was parsed from
};
using Table = std::map<std::pair<int64_t, int64_t>, Choice>;

// A Python object held from C++: released under the GIL, whichever thread drops the last
// reference (the op runs without the GIL).
using Kept = std::shared_ptr<py::object>;
Kept keep(py::object obj) {
  return Kept(new py::object(std::move(obj)), [](py::object* o) {
    py::gil_scoped_acquire gil;
    delete o;
  });
}

// A compressed MoE layer that zipserv::moe_experts serves by name (remember_moe()).
struct MoeEntry {
  const void* layer;  // the _cpu_gemm.MoeLayer (its handle())
  int64_t hidden;
  bool on_input;      // apply_router_weight_on_input
  Kept held;          // what keeps the MoeLayer and the experts' tensors alive
};
using MoeTable = std::map<std::string, MoeEntry>;

struct State {
  PackedCallFn entry = nullptr;
  py::object fallback;      // kernels/ops.py packed_gemm (the op's Python implementation)
  std::string env_name;     // ZIPSERV_CPU_FUSED_MAX_N
  std::shared_ptr<const Table> table = std::make_shared<const Table>();
  EmbeddingCallFn embedding_entry = nullptr;
  py::object embedding_fallback;  // kernels/embedding.py packed_embedding (its Python implementation)
  MoeCallFn moe_entry = nullptr;
  py::object moe_fallback;  // vllm_plugin/moe.py's zipserv::moe_experts (its Python implementation)
  std::shared_ptr<const MoeTable> moe_table = std::make_shared<const MoeTable>();
  int64_t generation = 0;  // bumped by forget(): a remember() computed before it is dropped
  bool enabled = false;
};

std::mutex g_mu;  // guards g_state's members against concurrent updates from Python
State* g_state = new State();  // (never freed: the op may run until the process ends)

std::shared_ptr<const Table> table_now(PackedCallFn& entry, bool& enabled) {
  std::lock_guard<std::mutex> lock(g_mu);
  entry = g_state->entry;
  enabled = g_state->enabled;
  return g_state->table;
}

int bucket_index(int64_t n) {
  int i = 0;
  for (int64_t b = 1; i < kBuckets - 1 && n > b; b <<= 1) ++i;
  return i;
}

bool is_layout_array(const at::Tensor& t, at::ScalarType dtype) {
  return t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous();
}

// The four arrays of an m x k byte-split matrix: contiguous CPU tensors of the layout's dtypes and shapes.
bool layout_ok(const at::Tensor& tiles, const at::Tensor& luts, const at::Tensor& exc_start, const at::Tensor& exc,
               int64_t m, int64_t k) {
  const int64_t mt = (m + zipserv::kTile - 1) / zipserv::kTile;
  const int64_t kt = (k + zipserv::kTile - 1) / zipserv::kTile;
  return is_layout_array(tiles, at::kByte) && tiles.sizes() == at::IntArrayRef({mt, kt, zipserv::cpu::kPkTileBytes}) &&
         is_layout_array(luts, at::kByte) && luts.sizes() == at::IntArrayRef({mt, kt, zipserv::cpu::kPkLutEntries}) &&
         is_layout_array(exc_start, at::kLong) && exc_start.sizes() == at::IntArrayRef({mt * kt + 1}) &&
         (is_layout_array(exc, at::kInt) || is_layout_array(exc, at::kUInt32)) && exc.dim() == 1;
}

bool env_matches(const std::string& name, const std::optional<std::string>& raw) {
  const char* now = std::getenv(name.c_str());
  if (now == nullptr) return !raw.has_value();
  return raw.has_value() && *raw == now;
}

at::Tensor python_path(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& luts,
                       const at::Tensor& exc_start, const at::Tensor& exc, int64_t m, int64_t k,
                       const std::optional<at::Tensor>& bias, c10::string_view mode) {
  py::gil_scoped_acquire gil;
  py::object fn;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    fn = g_state->fallback;
  }
  TORCH_CHECK(fn, "zipserv_vllm._cpu_op is loaded but not installed (kernels/cpu.py installs it)");
  py::object b = bias.has_value() ? py::cast(*bias) : py::none();
  return fn(x, tiles, luts, exc_start, exc, m, k, b, std::string(mode)).cast<at::Tensor>();
}

// The hot case's y, or nullopt when the call is not the hot case or the kernel failed.
std::optional<at::Tensor> fast(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& luts,
                               const at::Tensor& exc_start, const at::Tensor& exc, int64_t m, int64_t k,
                               const std::optional<at::Tensor>& bias, c10::string_view mode) {
  PackedCallFn entry = nullptr;
  bool enabled = false;
  const std::shared_ptr<const Table> table = table_now(entry, enabled);
  if (!enabled || entry == nullptr || mode != "fast" || m < 1 || k < 1) return std::nullopt;
  if (!x.device().is_cpu() || x.scalar_type() != at::kBFloat16 || x.dim() < 1 || x.size(-1) != k) return std::nullopt;
  const int64_t n = x.numel() / k;
  if (n < 1) return std::nullopt;
  if (!layout_ok(tiles, luts, exc_start, exc, m, k)) return std::nullopt;
  at::Tensor b;
  if (bias.has_value()) {
    if (!bias->device().is_cpu() || bias->scalar_type() != at::kBFloat16 || bias->dim() != 1 || bias->size(0) != m)
      return std::nullopt;
    b = bias->contiguous();
  }
  const auto hit = table->find({m, k});
  if (hit == table->end()) return std::nullopt;
  const Choice& choice = hit->second;
  std::string env_name;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    env_name = g_state->env_name;
  }
  if (n > choice.max_n || !env_matches(env_name, choice.env_raw)) return std::nullopt;
  const at::Tensor x2 = x.contiguous();
  at::Tensor y = at::empty({n, m}, x.options());
  PackedCall call{static_cast<const uint8_t*>(tiles.data_ptr()),
                  static_cast<const uint8_t*>(luts.data_ptr()),
                  static_cast<const int64_t*>(exc_start.data_ptr()),
                  static_cast<const uint32_t*>(exc.data_ptr()),
                  exc.numel(),
                  m,
                  k,
                  static_cast<const uint16_t*>(x2.data_ptr()),
                  n,
                  b.defined() ? static_cast<const uint16_t*>(b.data_ptr()) : nullptr,
                  static_cast<uint16_t*>(y.data_ptr()),
                  at::get_num_threads(),
                  choice.panel[bucket_index(n)]};
  if (entry(call) != zipserv::cpu::kPackedCallDone) return std::nullopt;
  if (x.dim() == 2) return y;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = m;
  return y.view(shape);
}

at::Tensor packed_gemm_cpu(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& luts,
                           const at::Tensor& exc_start, const at::Tensor& exc, int64_t m, int64_t k,
                           const std::optional<at::Tensor>& bias, c10::string_view mode) {
  if (auto y = fast(x, tiles, luts, exc_start, exc, m, k, bias, mode)) return *y;
  return python_path(x, tiles, luts, exc_start, exc, m, k, bias, mode);
}

// ---- zipserv::packed_embedding ----

at::Tensor embedding_python(const at::Tensor& ids, const at::Tensor& tiles, const at::Tensor& luts,
                            const at::Tensor& exc_start, const at::Tensor& exc, int64_t m, int64_t k, int64_t rows) {
  py::gil_scoped_acquire gil;
  py::object fn;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    fn = g_state->embedding_fallback;
  }
  TORCH_CHECK(fn, "zipserv_vllm._cpu_op: packed_embedding is registered but has no Python implementation");
  return fn(ids, tiles, luts, exc_start, exc, m, k, rows).cast<at::Tensor>();
}

// The hot case: int32 / int64 CPU ids, the table's four arrays contiguous CPU tensors of the
// layout's dtypes and shapes, rows >= m; every call of it, from the first (no choice to remember:
// the lookup is bit-exact whatever decodes it).
std::optional<at::Tensor> embedding_fast(const at::Tensor& ids, const at::Tensor& tiles, const at::Tensor& luts,
                                         const at::Tensor& exc_start, const at::Tensor& exc, int64_t m, int64_t k,
                                         int64_t rows) {
  EmbeddingCallFn entry = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_state->enabled) return std::nullopt;
    entry = g_state->embedding_entry;
  }
  if (entry == nullptr || m < 1 || k < 1 || rows < m || !ids.device().is_cpu() ||
      !(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt) || !layout_ok(tiles, luts, exc_start, exc, m, k))
    return std::nullopt;
  const at::Tensor flat = ids.reshape({-1}).to(at::kLong).contiguous();
  const int64_t n = flat.numel();
  at::Tensor y = at::empty({n, k}, tiles.options().dtype(at::kBFloat16));
  if (n > 0) {
    EmbeddingCall call{static_cast<const uint8_t*>(tiles.data_ptr()),
                       static_cast<const uint8_t*>(luts.data_ptr()),
                       static_cast<const int64_t*>(exc_start.data_ptr()),
                       static_cast<const uint32_t*>(exc.data_ptr()),
                       exc.numel(),
                       m,
                       k,
                       rows,
                       flat.data_ptr<int64_t>(),
                       n,
                       static_cast<uint16_t*>(y.data_ptr()),
                       at::get_num_threads()};
    if (entry(call) != zipserv::cpu::kEmbeddingCallDone) return std::nullopt;
  }
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(k);
  return y.view(shape);
}

at::Tensor packed_embedding_cpu(const at::Tensor& ids, const at::Tensor& tiles, const at::Tensor& luts,
                                const at::Tensor& exc_start, const at::Tensor& exc, int64_t m, int64_t k,
                                int64_t rows) {
  if (auto y = embedding_fast(ids, tiles, luts, exc_start, exc, m, k, rows)) return *y;
  return embedding_python(ids, tiles, luts, exc_start, exc, m, k, rows);
}

// ---- zipserv::moe_experts ----

at::Tensor moe_python(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                      c10::string_view layer_name) {
  py::gil_scoped_acquire gil;
  py::object fn;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    fn = g_state->moe_fallback;
  }
  TORCH_CHECK(fn, "zipserv_vllm._cpu_op: moe_experts is registered but has no Python implementation");
  return fn(x, topk_weights, topk_ids, std::string(layer_name)).cast<at::Tensor>();
}

// The hot case: a layer name the Python side registered (remember_moe), x a 2-D bf16 CPU tensor of
// its hidden size, topk_ids int32 / int64 and topk_weights fp32, both [t, k >= 1] CPU tensors; the
// output, or nullopt (not the hot case, or the kernel failed: the Python path computes or raises).
std::optional<at::Tensor> moe_fast(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                                   c10::string_view layer_name) {
  MoeCallFn entry = nullptr;
  std::shared_ptr<const MoeTable> table;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_state->enabled || g_state->moe_entry == nullptr) return std::nullopt;
    entry = g_state->moe_entry;
    table = g_state->moe_table;
  }
  const auto hit = table->find(std::string(layer_name));
  if (hit == table->end()) return std::nullopt;
  const MoeEntry& layer = hit->second;  // (table holds it, and its held object, until we return)
  if (!x.device().is_cpu() || x.scalar_type() != at::kBFloat16 || x.dim() != 2 || x.size(1) != layer.hidden)
    return std::nullopt;
  const int64_t t = x.size(0);
  if (!topk_ids.device().is_cpu() || !(topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong) ||
      topk_ids.dim() != 2 || topk_ids.size(0) != t || topk_ids.size(1) < 1 || !topk_weights.device().is_cpu() ||
      topk_weights.scalar_type() != at::kFloat || topk_weights.sizes() != topk_ids.sizes())
    return std::nullopt;
  at::Tensor out = at::empty({t, layer.hidden}, x.options());
  if (t == 0) return out;
  const at::Tensor x2 = x.contiguous(), ids = topk_ids.contiguous(), w = topk_weights.contiguous();
  MoeCall call{layer.layer,
               static_cast<const uint16_t*>(x2.data_ptr()),
               t,
               ids.data_ptr(),
               static_cast<int>(ids.element_size()),
               w.data_ptr<float>(),
               ids.size(1),
               static_cast<uint16_t*>(out.data_ptr()),
               layer.on_input,
               at::get_num_threads()};
  if (entry(call) != zipserv::cpu::kMoeCallDone) return std::nullopt;
  return out;
}

at::Tensor moe_experts_cpu(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                           c10::string_view layer_name) {
  if (auto y = moe_fast(x, topk_weights, topk_ids, layer_name)) return *y;
  return moe_python(x, topk_weights, topk_ids, layer_name);
}

void check_capsule(const py::capsule& c, const char* name) {
  if (c.name() == nullptr || std::strcmp(c.name(), name) != 0)
    throw std::invalid_argument(std::string("not the capsule ") + name);
}

// Registers `kernel` as zipserv::`op`'s CPU kernel the first time (lib: that op's registration).
// Registered by the install functions, not when the library loads: kernels/cpu.py first checks
// that this build's torch is the running one. (Never freed: the registration lasts the process.)
template <class Kernel>
void register_once(torch::Library*& lib, const char* op, Kernel kernel) {
  if (lib == nullptr) {
    lib = new torch::Library(torch::Library::IMPL, "zipserv", c10::DispatchKey::CPU, __FILE__, __LINE__);
    lib->impl(op, kernel);
  }
}

// (The install functions and forget() release what they replace after unlocking g_mu, in the
// locals declared before the lock: a Python finalizer run by that release may call back in.)
void install(py::object fallback, py::capsule entry, std::string env_name) {
  check_capsule(entry, zipserv::cpu::kPackedCallCapsule);
  py::object old_fallback;
  std::shared_ptr<const MoeTable> old_moe;
  std::lock_guard<std::mutex> lock(g_mu);
  static torch::Library* lib = nullptr;
  register_once(lib, "packed_gemm", TORCH_FN(packed_gemm_cpu));
  old_fallback = std::exchange(g_state->fallback, std::move(fallback));
  g_state->entry = reinterpret_cast<PackedCallFn>(entry.get_pointer());
  g_state->env_name = std::move(env_name);
  g_state->table = std::make_shared<const Table>();
  old_moe = std::exchange(g_state->moe_table, std::make_shared<const MoeTable>());
  ++g_state->generation;
  g_state->enabled = true;
}

void install_embedding(py::object fallback, py::capsule entry) {
  check_capsule(entry, zipserv::cpu::kEmbeddingCallCapsule);
  py::object old_fallback;
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_state->entry == nullptr) throw std::logic_error("install() first");
  static torch::Library* lib = nullptr;  // (zipserv::packed_embedding is defined by then)
  register_once(lib, "packed_embedding", TORCH_FN(packed_embedding_cpu));
  old_fallback = std::exchange(g_state->embedding_fallback, std::move(fallback));
  g_state->embedding_entry = reinterpret_cast<EmbeddingCallFn>(entry.get_pointer());
}

void install_moe(py::object fallback, py::capsule entry) {
  check_capsule(entry, zipserv::cpu::kMoeCallCapsule);
  py::object old_fallback;
  std::shared_ptr<const MoeTable> old_moe;
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_state->entry == nullptr) throw std::logic_error("install() first");
  static torch::Library* lib = nullptr;  // (zipserv::moe_experts is defined by then)
  register_once(lib, "moe_experts", TORCH_FN(moe_experts_cpu));
  old_fallback = std::exchange(g_state->moe_fallback, std::move(fallback));
  g_state->moe_entry = reinterpret_cast<MoeCallFn>(entry.get_pointer());
  old_moe = std::exchange(g_state->moe_table, std::make_shared<const MoeTable>());
  ++g_state->generation;
}

void remember_moe(const std::string& name, py::capsule layer, py::object held, int64_t hidden, bool on_input,
                  int64_t generation) {
  check_capsule(layer, zipserv::cpu::kMoeLayerCapsule);
  if (hidden < 1) throw std::invalid_argument("hidden must be positive");
  MoeEntry e{layer.get_pointer(), hidden, on_input, keep(std::move(held))};
  std::shared_ptr<const MoeTable> old;  // (released after the lock: its entries' deleters take the GIL)
  std::lock_guard<std::mutex> lock(g_mu);
  if (generation != g_state->generation || g_state->moe_entry == nullptr) return;
  auto next = std::make_shared<MoeTable>(*g_state->moe_table);
  (*next)[name] = std::move(e);
  old = std::move(g_state->moe_table);
  g_state->moe_table = std::move(next);
}

void forget_moe(const std::optional<std::string>& name) {
  std::shared_ptr<const MoeTable> old;
  std::lock_guard<std::mutex> lock(g_mu);
  ++g_state->generation;  // (also when the name is not served: a remember_moe computed before is stale)
  if (name.has_value() && g_state->moe_table->count(*name) == 0) return;
  auto next = name.has_value() ? std::make_shared<MoeTable>(*g_state->moe_table) : std::make_shared<MoeTable>();
  if (name.has_value()) next->erase(*name);
  old = std::move(g_state->moe_table);
  g_state->moe_table = std::move(next);
}

void remember(int64_t m, int64_t k, const std::vector<bool>& panel, int64_t max_n, std::optional<std::string> env_raw,
              int64_t generation) {
  if (panel.size() != kBuckets) throw std::invalid_argument("one kernel choice per bucket (10) expected");
  Choice c;
  for (int i = 0; i < kBuckets; ++i) c.panel[i] = panel[i];
  c.max_n = max_n;
  c.env_raw = std::move(env_raw);
  std::lock_guard<std::mutex> lock(g_mu);
  if (generation != g_state->generation) return;  // the choices changed while they were computed
  auto next = std::make_shared<Table>(*g_state->table);
  (*next)[{m, k}] = std::move(c);
  g_state->table = std::move(next);
}

void forget() {
  std::shared_ptr<const MoeTable> old;
  std::lock_guard<std::mutex> lock(g_mu);
  g_state->table = std::make_shared<const Table>();
  old = std::move(g_state->moe_table);
  g_state->moe_table = std::make_shared<const MoeTable>();
  ++g_state->generation;
}

int64_t generation() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_state->generation;
}

void enable(bool on) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_state->enabled = on && g_state->entry != nullptr;
}

size_t remembered() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_state->table->size();
}

std::vector<std::string> remembered_moe() {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<std::string> names;
  for (const auto& kv : *g_state->moe_table) names.push_back(kv.first);
  return names;
}

}  // namespace

PYBIND11_MODULE(_cpu_op, mod) {
  mod.doc() = "zipserv::packed_gemm's CPU kernel in C++ (the hot case; the rest goes to the Python implementation)";
  mod.attr("torch_version") = ZIPSERV_TORCH_VERSION;
  mod.def("install", &install, py::arg("fallback"), py::arg("entry"), py::arg("env_name"),
          "Set the Python implementation, the _cpu_gemm.packed_call capsule and the threshold variable's name; "
          "forgets every shape and enables the hot path");
  mod.def("remember", &remember, py::arg("m"), py::arg("k"), py::arg("panel"), py::arg("max_n"), py::arg("env_raw"),
          py::arg("generation"),
          "The dispatcher's kernel per token bucket for an m x k weight (True: panel) and the token threshold, "
          "parsed from env_raw (None: the variable was unset); dropped when forget() ran since generation()");
  mod.def("generation", &generation, "Changes with every forget()");
  mod.def("forget", &forget, "Forget every remembered shape (the dispatcher's choices changed)");
  mod.def("enable", &enable, py::arg("on"), "Whether the hot path may run (False while an override is set)");
  mod.def("remembered", &remembered, "Number of remembered shapes");
  mod.def("install_embedding", &install_embedding, py::arg("fallback"), py::arg("entry"),
          "Register zipserv::packed_embedding's CPU kernel with its Python implementation and the "
          "_cpu_gemm.embedding_call capsule (after install())");
  mod.def("install_moe", &install_moe, py::arg("fallback"), py::arg("entry"),
          "Register zipserv::moe_experts' CPU kernel with its Python implementation and the _cpu_gemm.moe_call "
          "capsule (after install())");
  mod.def("remember_moe", &remember_moe, py::arg("name"), py::arg("layer"), py::arg("held"), py::arg("hidden"),
          py::arg("on_input"), py::arg("generation"),
          "Serve the MoE layer `name` by the MoeLayer whose handle() is `layer` (held alive by `held`); dropped "
          "when forget() or forget_moe() ran since generation()");
  mod.def("forget_moe", &forget_moe, py::arg("name"), "Stop serving the MoE layer `name` (None: every one) in C++");
  mod.def("remembered_moe", &remembered_moe, "The MoE layer names served in C++");
}
