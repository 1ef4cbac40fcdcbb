// The SIMT harness's runtime: fibers, barriers, warp collectives, cp.async,
// mma.sync and launches for kernel sources compiled by g++ (see simt.h for
// what is checked). Single OS thread: a launch runs its blocks in order, and a
// block's threads are fibers (ucontext) resumed by the scheduler below until
// each blocks at a synchronisation point or exits.
//
// This file is compiled without ThreadSanitizer instrumentation even in the
// TSan build (its bookkeeping is shared between fibers by design); it tells
// TSan about the memory orderings CUDA defines (barrier, __syncwarp), the
// fiber switches (which order nothing) and the bytes a cp.async writes.
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "simt/control.h"
#include "simt/simt.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define SIMT_ASAN 1
#else
#define SIMT_ASAN 0
#endif

#if defined(SIMT_TSAN)
extern "C" {
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_destroy_fiber(void* fiber);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
void __tsan_ignore_thread_begin(void);
void __tsan_ignore_thread_end(void);
void __tsan_read_range(void* addr, unsigned long size);
void __tsan_write_range(void* addr, unsigned long size);
}
#define TSAN(...) __VA_ARGS__
#else
#define TSAN(...)
#endif

namespace simt {

namespace {

constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kDefaultDynamicLimit = 48 * 1024;

// A kernel misusing the CUDA model: ends the block, reported by the launch.
struct Fault : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, f);
  vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

std::string site(const char* file, int line) {
  const char* slash = file ? std::strrchr(file, '/') : nullptr;
  return fmt("%s:%d", slash ? slash + 1 : (file ? file : "?"), line);
}

const char* op_name(Op op) {
  switch (op) {
    case Op::ReduceAdd: return "__reduce_add_sync";
    case Op::ShflIdx: return "__shfl_sync";
    case Op::ShflUp: return "__shfl_up_sync";
    case Op::ShflDown: return "__shfl_down_sync";
    case Op::ShflXor: return "__shfl_xor_sync";
    case Op::Ballot: return "__ballot_sync";
    case Op::Any: return "__any_sync";
    case Op::All: return "__all_sync";
    case Op::SyncWarp: return "__syncwarp";
    case Op::Mma: return "mma.sync.m16n8k16";
  }
  return "?";
}

// Suspends TSan's view of the calling fiber's memory accesses (the harness's
// own bookkeeping); synchronisation annotations still count.
struct Quiet {
  Quiet() { TSAN(__tsan_ignore_thread_begin()); }
  ~Quiet() { TSAN(__tsan_ignore_thread_end()); }
};

enum class St { Ready, Barrier, Coll, Done, Failed };

struct Pending {
  unsigned char* dst;
  const unsigned char* src;
  int src_bytes, cp_size;
};

struct Thread {
  ucontext_t ctx;
  char* stack = nullptr;
  dim3 tid;
  int linear = 0;
  St state = St::Ready;
  const char* file = nullptr;  // where it waits
  int line = 0;
  // the collective it waits in
  Op op = Op::SyncWarp;
  unsigned mask = 0;
  uint32_t value = 0, result = 0;
  int arg = 0, width = 32;
  uint32_t a[4] = {}, b[2] = {};
  float c[4] = {}, d[4] = {};
  std::vector<Pending> pending;  // cp.async issued, not yet waited for
  void* fake_stack = nullptr;    // ASan
  void* fiber = nullptr;         // TSan
};

struct Alloc {
  const void* tag;
  unsigned char* p;
  size_t n;
};

struct Block {
  dim3 idx, dim, grid;
  int n = 0;
  std::vector<Thread>* threads = nullptr;
  std::vector<Alloc> objects;  // static __shared__ objects
  unsigned char* dyn = nullptr;
  size_t dyn_bytes = 0, static_bytes = 0;
  unsigned barrier_gen = 0;
  std::vector<unsigned> warp_gen;
  std::vector<char> warp_sync;  // TSan sync objects: 2 per warp
  char bar_sync[2] = {0, 0};
  char end_sync = 0;
  std::string error;
  const std::function<void()>* body = nullptr;
  uint64_t rng = 0;
};

Options g_options;
Stats g_stats;
std::string g_failure;

Block* g_block = nullptr;
Thread* g_cur = nullptr;
ucontext_t g_sched;
std::vector<char*> g_stacks;
std::map<const void*, int> g_dyn_limit;  // cudaFuncAttributeMaxDynamicSharedMemorySize per kernel
cudaError_t g_last_error = cudaSuccess;
std::string g_last_message;

#if SIMT_ASAN
void* g_sched_fake = nullptr;
const void* g_sched_bottom = nullptr;
size_t g_sched_size = 0;
#endif
TSAN(void* g_main_fiber = nullptr;)

uint64_t next_rand(uint64_t& s) {  // xorshift64*
  s ^= s >> 12;
  s ^= s << 25;
  s ^= s >> 27;
  return s * 0x2545F4914F6CDD1DULL;
}

void fill_garbage(unsigned char* p, size_t n, uint64_t& rng) {
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t r = next_rand(rng);
    for (size_t j = 0; j < 8 && i + j < n; ++j) p[i + j] = static_cast<unsigned char>(r >> (8 * j));
  }
}

Thread& me() {
  if (!g_cur) throw std::logic_error("simt: a device built-in was called outside a kernel launch");
  return *g_cur;
}

std::string who(const Thread& t) {
  return fmt("thread (%u,%u,%u) [warp %d lane %d]", t.tid.x, t.tid.y, t.tid.z, t.linear / 32, t.linear % 32);
}

[[noreturn]] void fault(const std::string& what) { throw Fault(who(me()) + ": " + what); }

char* stack_for(size_t i) {
  while (g_stacks.size() <= i) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    void* p = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("simt: cannot map a fiber stack");
    mprotect(p, page, PROT_NONE);  // guard page: an overflow faults instead of corrupting
    g_stacks.push_back(static_cast<char*>(p) + page);
  }
  return g_stacks[i];
}

// ------------------------------------------------------------ fiber switches
void yield(Thread& t) {
  ++g_stats.switches;
#if SIMT_ASAN
  __sanitizer_start_switch_fiber(&t.fake_stack, g_sched_bottom, g_sched_size);
#endif
  TSAN(__tsan_switch_to_fiber(g_main_fiber, 1 /* no synchronisation */));
  swapcontext(&t.ctx, &g_sched);
#if SIMT_ASAN
  __sanitizer_finish_switch_fiber(t.fake_stack, &g_sched_bottom, &g_sched_size);
#endif
}

void resume(Thread& t) {
  g_cur = &t;
#if SIMT_ASAN
  __sanitizer_start_switch_fiber(&g_sched_fake, t.stack, kStackBytes);
#endif
  TSAN(__tsan_switch_to_fiber(t.fiber, 1));
  swapcontext(&g_sched, &t.ctx);
#if SIMT_ASAN
  __sanitizer_finish_switch_fiber(g_sched_fake, nullptr, nullptr);
#endif
  g_cur = nullptr;
}

void fiber_main() {
#if SIMT_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &g_sched_bottom, &g_sched_size);
#endif
  Thread& t = *g_cur;
  Block& b = *g_block;
  try {
    (*b.body)();
    t.state = St::Done;
  } catch (const std::exception& e) {
    Quiet q;
    t.state = St::Failed;
    if (b.error.empty()) b.error = e.what();
  }
  TSAN(__tsan_release(&b.end_sync));
#if SIMT_ASAN
  __sanitizer_start_switch_fiber(nullptr, g_sched_bottom, g_sched_size);
#endif
  TSAN(__tsan_switch_to_fiber(g_main_fiber, 1));
  setcontext(&g_sched);
}

// ------------------------------------------------------------ reporting
// "threads 0-95 at x.cu:12; threads 96-127 exited"
std::string describe(const Block& b) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (const Thread& t : *b.threads) {
    std::string k;
    switch (t.state) {
      case St::Ready: k = "ready"; break;
      case St::Done: k = "exited"; break;
      case St::Failed: k = "failed"; break;
      case St::Barrier: k = "wait at __syncthreads (" + site(t.file, t.line) + ")"; break;
      case St::Coll: k = fmt("wait in %s (%s, mask %08x)", op_name(t.op), site(t.file, t.line).c_str(), t.mask); break;
    }
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == k; });
    if (it == groups.end()) groups.push_back({k, {t.linear}});
    else it->second.push_back(t.linear);
  }
  std::string out;
  for (const auto& g : groups) {
    std::string ids;
    for (size_t i = 0; i < g.second.size();) {
      size_t j = i;
      while (j + 1 < g.second.size() && g.second[j + 1] == g.second[j] + 1) ++j;
      if (!ids.empty()) ids += ",";
      ids += j > i ? fmt("%d-%d", g.second[i], g.second[j]) : fmt("%d", g.second[i]);
      i = j + 1;
    }
    if (!out.empty()) out += "; ";
    out += "threads " + ids + " " + g.first;
  }
  return out;
}

// ------------------------------------------------------------ collectives
// PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"
// (.bf16 A/B, .f32 C/D): groupID = lane >> 2, threadID_in_group = lane % 4.
// Register r of A holds a_{2r}, a_{2r+1} (lower index in the lower half):
//   row = groupID + 8 (r % 2), col = 2 threadID_in_group + e + 8 (r / 2)
// Register r of B holds b_{2r}, b_{2r+1}: row (k) = 2 threadID_in_group + e + 8 r, col = groupID
// C/D element r: row = groupID + 8 (r / 2), col = 2 threadID_in_group + r % 2
float bf16_half(uint32_t reg, int e) {
  const uint32_t u = (reg >> (16 * e)) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void mma_warp(std::vector<Thread*>& lanes) {
  float A[16][16], B[16][8], C[16][8];
  for (int l = 0; l < 32; ++l) {
    const Thread& t = *lanes[l];
    const int g = l >> 2, q = l & 3;
    for (int r = 0; r < 4; ++r)
      for (int e = 0; e < 2; ++e) A[g + 8 * (r % 2)][2 * q + e + 8 * (r / 2)] = bf16_half(t.a[r], e);
    for (int r = 0; r < 2; ++r)
      for (int e = 0; e < 2; ++e) B[2 * q + e + 8 * r][g] = bf16_half(t.b[r], e);
    for (int r = 0; r < 4; ++r) C[g + 8 * (r / 2)][2 * q + r % 2] = t.c[r];
  }
  for (int l = 0; l < 32; ++l) {
    Thread& t = *lanes[l];
    const int g = l >> 2, q = l & 3;
    for (int r = 0; r < 4; ++r) {
      const int m = g + 8 * (r / 2), n = 2 * q + r % 2;
      float s = 0.f;
      for (int k = 0; k < 16; ++k) s += A[m][k] * B[k][n];
      t.d[r] = C[m][n] + s;
    }
  }
  ++g_stats.mma;
}

// Completes the collective warp w's lanes wait in, once every lane of its mask
// has arrived; reports lanes that diverge or exited.
bool resolve_warp(Block& b, int w) {
  auto& th = *b.threads;
  const int lo = 32 * w, hi = std::min(lo + 32, b.n);
  Thread* lead = nullptr;
  for (int i = lo; i < hi; ++i)
    if (th[i].state == St::Coll) {
      lead = &th[i];
      break;
    }
  if (!lead) return false;
  const unsigned mask = lead->mask;
  const Op op = lead->op;
  std::vector<Thread*> lanes(32, nullptr);
  for (int l = 0; l < 32; ++l) {
    if (!((mask >> l) & 1u)) continue;
    if (lo + l >= hi) {
      b.error = who(*lead) + fmt(": %s mask %08x names lane %d, which this block does not have", op_name(op), mask, l);
      return false;
    }
    Thread& u = th[lo + l];
    if (u.state == St::Done || u.state == St::Failed) {
      b.error = who(*lead) + fmt(": waits in %s (%s) for lane %d, which exited", op_name(op),
                                 site(lead->file, lead->line).c_str(), l);
      return false;
    }
    if (u.state == St::Coll && (u.op != op || u.mask != mask)) {
      b.error = fmt("warp %d diverged: lane %d is in %s (%s, mask %08x), lane %d in %s (%s, mask %08x)", w,
                    lead->linear % 32, op_name(op), site(lead->file, lead->line).c_str(), mask, l, op_name(u.op),
                    site(u.file, u.line).c_str(), u.mask);
      return false;
    }
    if (u.state != St::Coll) return false;  // not there yet
    lanes[l] = &u;
  }
  // Every lane of the mask is here: exchange.
  for (int l = 0; l < 32; ++l) {
    Thread* t = lanes[l];
    if (!t) continue;
    const int width = t->width, seg = l & ~(width - 1), arg = t->arg;
    int src = l;
    switch (op) {
      case Op::ShflIdx: src = seg + (arg & (width - 1)); break;
      case Op::ShflUp: src = (l - seg) >= arg ? l - arg : l; break;
      case Op::ShflDown: src = (l - seg) + arg < width ? l + arg : l; break;
      case Op::ShflXor: src = ((l ^ arg) & ~(width - 1)) == seg ? (l ^ arg) : l; break;
      default: break;
    }
    if (src < 0 || src > 31 || !lanes[src]) {
      b.error = who(*t) + fmt(": %s (%s) reads lane %d, outside the mask %08x", op_name(op),
                              site(t->file, t->line).c_str(), src, mask);
      return false;
    }
    uint32_t acc = 0;
    switch (op) {
      case Op::ReduceAdd:
        for (Thread* u : lanes)
          if (u) acc += u->value;
        t->result = acc;
        break;
      case Op::Ballot:
        for (int j = 0; j < 32; ++j)
          if (lanes[j] && lanes[j]->value) acc |= 1u << j;
        t->result = acc;
        break;
      case Op::Any:
      case Op::All: {
        bool any = false, all = true;
        for (Thread* u : lanes)
          if (u) {
            any = any || u->value;
            all = all && u->value;
          }
        t->result = op == Op::Any ? any : all;
        break;
      }
      case Op::ShflIdx:
      case Op::ShflUp:
      case Op::ShflDown:
      case Op::ShflXor: t->result = lanes[src]->value; break;
      default: t->result = 0;
    }
  }
  if (op == Op::Mma) {
    if (mask != kFullMask) {
      b.error = who(*lead) + ": mma.sync.aligned needs all 32 lanes";
      return false;
    }
    mma_warp(lanes);
  }
  for (Thread* t : lanes)
    if (t) t->state = St::Ready;
  ++b.warp_gen[w];
  ++g_stats.collectives;
  return true;
}

// Releases __syncthreads once every live thread waits there; reports threads
// at different barriers or exited ones.
bool resolve_barrier(Block& b) {
  auto& th = *b.threads;
  int waiting = 0, done = 0;
  const Thread* first = nullptr;
  for (const Thread& t : th) {
    if (t.state == St::Barrier) {
      ++waiting;
      if (!first) first = &t;
    } else if (t.state == St::Done) {
      ++done;
    } else {
      return false;  // someone still runs (or waits in a warp collective)
    }
  }
  if (waiting == 0) return false;
  if (done > 0) {
    b.error = "__syncthreads at " + site(first->file, first->line) + " can never complete: " + describe(b);
    return false;
  }
  for (const Thread& t : th)
    if (t.file != first->file || t.line != first->line) {
      b.error = "threads wait at different __syncthreads: " + describe(b);
      return false;
    }
  for (Thread& t : th) t.state = St::Ready;
  ++b.barrier_gen;
  ++g_stats.barriers;
  return true;
}

// ------------------------------------------------------------ blocks
bool run_block(Block& b, std::vector<Thread>& th) {
  const int n = b.n;
  b.threads = &th;
  b.warp_gen.assign((n + 31) / 32, 0);
  b.warp_sync.assign(2 * ((n + 31) / 32), 0);
  void* dyn = nullptr;
  if (posix_memalign(&dyn, 16, b.dyn_bytes ? b.dyn_bytes : 1)) throw std::bad_alloc();
  b.dyn = static_cast<unsigned char*>(dyn);
  fill_garbage(b.dyn, b.dyn_bytes, b.rng);
#if SIMT_ASAN
  if (b.dyn_bytes == 0) ASAN_POISON_MEMORY_REGION(b.dyn, 1);  // no dynamic shared memory: any access fails
#endif
  for (int i = 0; i < n; ++i) {
    Thread& t = th[i];
    t = Thread{};
    t.linear = i;
    t.tid = dim3(i % b.dim.x, (i / b.dim.x) % b.dim.y, i / (b.dim.x * b.dim.y));
    t.stack = stack_for(i);
#if SIMT_ASAN
    ASAN_UNPOISON_MEMORY_REGION(t.stack, kStackBytes);  // a fiber abandoned by a failed block
#endif
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = t.stack;
    t.ctx.uc_stack.ss_size = kStackBytes;
    t.ctx.uc_link = nullptr;
    makecontext(&t.ctx, fiber_main, 0);
    TSAN(t.fiber = __tsan_create_fiber(0));
  }
  g_block = &b;
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i) order[i] = g_options.schedule == Schedule::Reverse ? n - 1 - i : i;
  std::mt19937_64 shuffle_rng(b.rng);
  bool ok = true;
  for (;;) {
    if (g_options.schedule == Schedule::Random) std::shuffle(order.begin(), order.end(), shuffle_rng);
    bool progress = false;
    for (int i : order) {
      if (th[i].state != St::Ready) continue;
      resume(th[i]);
      progress = true;
      if (!b.error.empty()) break;
      if (th[i].state == St::Coll) resolve_warp(b, i / 32);
      if (!b.error.empty()) break;
    }
    if (!b.error.empty()) {
      ok = false;
      break;
    }
    if (std::all_of(th.begin(), th.begin() + n, [](const Thread& t) { return t.state == St::Done; })) break;
    if (resolve_barrier(b)) continue;
    if (!b.error.empty()) {
      ok = false;
      break;
    }
    if (!progress) {
      bool released = false;
      for (int w = 0; w < (n + 31) / 32 && b.error.empty(); ++w) released = resolve_warp(b, w) || released;
      if (!b.error.empty() || !released) {
        if (b.error.empty()) b.error = "deadlock: " + describe(b);
        ok = false;
        break;
      }
    }
  }
  g_block = nullptr;
  TSAN(__tsan_acquire(&b.end_sync));
  TSAN(for (int i = 0; i < n; ++i) __tsan_destroy_fiber(th[i].fiber));
  if (ok) {  // a failed block's memory is left alone (its fibers never finished)
    for (Alloc& a : b.objects) std::free(a.p);
    std::free(b.dyn);
  }
  g_stats.blocks += 1;
  g_stats.threads += n;
  return ok;
}

void set_error(cudaError_t e, const std::string& msg) {
  g_last_error = e;
  g_last_message = msg;
  g_failure = msg;
}

bool in_shared(const Block& b, const void* p, size_t n) {
  const auto* c = static_cast<const unsigned char*>(p);
  if (c >= b.dyn && c + n <= b.dyn + b.dyn_bytes) return true;
  for (const Alloc& a : b.objects)
    if (c >= a.p && c + n <= a.p + a.n) return true;
  return false;
}

}  // namespace

// ------------------------------------------------------------ built-ins
const dim3& thread_idx() { return me().tid; }
const dim3& block_idx() { me(); return g_block->idx; }
const dim3& block_dim() { me(); return g_block->dim; }
const dim3& grid_dim() { me(); return g_block->grid; }

void syncthreads(const char* file, int line) {
  Thread& t = me();
  Block& b = *g_block;
  unsigned gen;
  {
    Quiet q;
    t.state = St::Barrier;
    t.file = file;
    t.line = line;
    gen = b.barrier_gen;
  }
  TSAN(__tsan_release(&b.bar_sync[gen & 1]));
  {
    Quiet q;
    while (t.state == St::Barrier) yield(t);
  }
  TSAN(__tsan_acquire(&b.bar_sync[gen & 1]));
  (void)gen;
}

uint32_t collective(Op op, unsigned mask, uint32_t value, int arg, int width, const char* file, int line) {
  Thread& t = me();
  Block& b = *g_block;
  const int lane = t.linear % 32, w = t.linear / 32;
  unsigned gen;
  {
    Quiet q;
    if (!((mask >> lane) & 1u)) fault(fmt("calls %s (%s) with mask %08x, which leaves out its own lane", op_name(op),
                                          site(file, line).c_str(), mask));
    if (width < 1 || width > 32 || (width & (width - 1)))
      fault(fmt("%s (%s): width %d is not a power of two <= 32", op_name(op), site(file, line).c_str(), width));
    t.state = St::Coll;
    t.op = op;
    t.mask = mask;
    t.value = value;
    t.arg = arg;
    t.width = width;
    t.file = file;
    t.line = line;
    gen = b.warp_gen[w];
  }
  char* sync = &b.warp_sync[2 * w + (gen & 1)];
  if (op == Op::SyncWarp) {
    TSAN(__tsan_release(sync));
  }
  uint32_t r;
  {
    Quiet q;
    while (t.state == St::Coll) yield(t);
    r = t.result;
  }
  if (op == Op::SyncWarp) {
    TSAN(__tsan_acquire(sync));
  }
  (void)sync;
  return r;
}

void syncwarp(unsigned mask, const char* file, int line) { collective(Op::SyncWarp, mask, 0, 0, 32, file, line); }

void mma_m16n8k16_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, const char* file, int line) {
  Thread& t = me();
  {
    Quiet q;
    for (int i = 0; i < 4; ++i) t.a[i] = a[i], t.c[i] = c[i];
    t.b[0] = b0;
    t.b[1] = b1;
  }
  collective(Op::Mma, kFullMask, 0, 0, 32, file, line);
  Quiet q;
  for (int i = 0; i < 4; ++i) c[i] = t.d[i];
}

void cp_async(void* dst, const void* src, int cp_size, int src_bytes, const char* file, int line) {
  Thread& t = me();
  Quiet q;
  const std::string at = site(file, line);
  if (cp_size != 4 && cp_size != 8 && cp_size != 16) fault("cp.async (" + at + ") copies 4, 8 or 16 bytes");
  if (src_bytes < 0 || src_bytes > cp_size)
    fault(fmt("cp.async (%s): src-size %d outside 0..%d", at.c_str(), src_bytes, cp_size));
  if (reinterpret_cast<uintptr_t>(dst) % cp_size || reinterpret_cast<uintptr_t>(src) % cp_size)
    fault(fmt("cp.async (%s): %d-byte copy from %p to %p is not %d-byte aligned", at.c_str(), cp_size, src, dst,
              cp_size));
  if (!in_shared(*g_block, dst, cp_size))
    fault(fmt("cp.async (%s): destination %p is not inside the block's shared memory", at.c_str(), dst));
#if SIMT_ASAN
  if (src_bytes > 0) {
    if (void* bad = __asan_region_is_poisoned(const_cast<void*>(src), src_bytes))
      fault(fmt("cp.async (%s) reads %p, outside any allocation (source %p, %d bytes)", at.c_str(), bad, src,
                src_bytes));
  }
#endif
  auto* d = static_cast<unsigned char*>(dst);
  fill_garbage(d, cp_size, g_block->rng);  // in flight: what a read before the wait sees
#if SIMT_ASAN
  ASAN_POISON_MEMORY_REGION(d, cp_size);  // ... and under ASan, such a read fails outright
#endif
  t.pending.push_back({d, static_cast<const unsigned char*>(src), src_bytes, cp_size});
  ++g_stats.cp_async;
}

void cp_async_commit() {}

void cp_async_wait_all(const char* /*file*/, int /*line*/) {
  Thread& t = me();
  std::vector<Pending> landed;
  {
    Quiet q;
    landed.swap(t.pending);
    for (const Pending& p : landed) {
#if SIMT_ASAN
      ASAN_UNPOISON_MEMORY_REGION(p.dst, p.cp_size);
#endif
      std::memcpy(p.dst, p.src, p.src_bytes);
      std::memset(p.dst + p.src_bytes, 0, p.cp_size - p.src_bytes);
    }
  }
  // The copy is this thread's access, as far as race detection goes.
  TSAN(for (const Pending& p : landed) {
    if (p.src_bytes) __tsan_read_range(const_cast<unsigned char*>(p.src), p.src_bytes);
    __tsan_write_range(p.dst, p.cp_size);
  });
  Quiet q;
  landed.clear();
}

void* shared_object(const void* tag, size_t bytes) {
  me();
  Quiet q;
  Block& b = *g_block;
  for (const Alloc& a : b.objects)
    if (a.tag == tag) return a.p;
  void* p = nullptr;
  if (posix_memalign(&p, 16, bytes ? bytes : 1)) throw std::bad_alloc();
  fill_garbage(static_cast<unsigned char*>(p), bytes, b.rng);
  b.objects.push_back({tag, static_cast<unsigned char*>(p), bytes});
  b.static_bytes += (bytes + 15) / 16 * 16;
  if (b.static_bytes > g_options.max_static_shared)
    fault(fmt("static shared memory reaches %zu bytes, over the %zu-byte limit", b.static_bytes,
              g_options.max_static_shared));
  return p;
}

unsigned char* dynamic_shared() {
  me();
  return g_block->dyn;
}

// ------------------------------------------------------------ launches
void launch_grid(const void* kernel, const char* name, dim3 grid, dim3 block, size_t smem, const char* file, int line,
                 const std::function<void()>& body) {
  if (g_cur) throw std::logic_error("simt: a launch from inside a kernel");
  ++g_stats.launches;
  const std::string where = fmt("%s (launched at %s)", name, site(file, line).c_str());
  const uint64_t nthreads = uint64_t{block.x} * block.y * block.z;
  if (nthreads < 1 || nthreads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64) {
    set_error(cudaErrorInvalidConfiguration, fmt("%s: block (%u,%u,%u) is not a valid CUDA block", where.c_str(),
                                                 block.x, block.y, block.z));
    return;
  }
  if (grid.x < 1 || grid.y < 1 || grid.z < 1 || grid.x > 0x7FFFFFFFu || grid.y > 65535 || grid.z > 65535) {
    set_error(cudaErrorInvalidConfiguration,
              fmt("%s: grid (%u,%u,%u) is not a valid CUDA grid", where.c_str(), grid.x, grid.y, grid.z));
    return;
  }
  const int limit = max_dynamic_shared(kernel);
  if (smem > static_cast<size_t>(limit)) {
    set_error(cudaErrorInvalidValue,
              fmt("%s: %zu bytes of dynamic shared memory, over the kernel's limit of %d (raise it with "
                  "cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize) before launching)",
                  where.c_str(), smem, limit));
    return;
  }
  TSAN(g_main_fiber = __tsan_get_current_fiber());
  std::vector<Thread> threads(static_cast<size_t>(nthreads));
  uint64_t rng = g_options.seed * 0x9E3779B97F4A7C15ULL + g_stats.launches;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        Block b;
        b.idx = dim3(x, y, z);
        b.dim = block;
        b.grid = grid;
        b.n = static_cast<int>(nthreads);
        b.dyn_bytes = smem;
        b.body = &body;
        b.rng = next_rand(rng) | 1;
        if (!run_block(b, threads)) {
          set_error(cudaErrorLaunchFailure, fmt("%s, block (%u,%u,%u): %s", where.c_str(), x, y, z, b.error.c_str()));
          return;
        }
      }
}

cudaError_t set_max_dynamic_shared(const void* kernel, int bytes) {
  if (bytes < 0 || static_cast<size_t>(bytes) > g_options.device_max_dynamic_shared) return cudaErrorInvalidValue;
  g_dyn_limit[kernel] = bytes;
  return cudaSuccess;
}

int max_dynamic_shared(const void* kernel) {
  auto it = g_dyn_limit.find(kernel);
  return it == g_dyn_limit.end() ? static_cast<int>(kDefaultDynamicLimit) : it->second;
}

cudaError_t last_error_and_clear() {
  const cudaError_t e = g_last_error;
  g_last_error = cudaSuccess;
  return e;
}

const char* error_string(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    default: break;
  }
  if (!g_last_message.empty()) return g_last_message.c_str();
  switch (e) {
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    default: return "unknown error";
  }
}

// ------------------------------------------------------------ control
Options& options() { return g_options; }
Stats& stats() { return g_stats; }
void reset_device() { g_dyn_limit.clear(); }
std::string take_failure() {
  std::string s;
  s.swap(g_failure);
  return s;
}
bool asan_build() { return SIMT_ASAN; }
bool tsan_build() {
#if defined(SIMT_TSAN)
  return true;
#else
  return false;
#endif
}

}  // namespace simt
