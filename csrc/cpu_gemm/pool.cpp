// Persistent thread pool for the fused CPU GEMM.
//
// A decode step calls the kernel once per linear layer, and one call can take
// well under a millisecond, so threads are created once (grown on demand) and
// parked between calls. A worker spins briefly for the next job (calls come in
// quick succession while a model runs) and then sleeps on a condition
// variable, so an idle process does not burn the cores.
#include <pthread.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "zipserv/cpu_gemm.h"

namespace zipserv {
namespace cpu {
namespace {

class Pool {
 public:
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      ++generation_;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  void run(int64_t items, int threads, void (*fn)(void*, int64_t, int64_t), void* ctx) {
    std::lock_guard<std::mutex> call_lock(call_mu_);  // one job at a time
    if (threads < 1) threads = 1;
    if (threads > items) threads = static_cast<int>(items);
    if (threads <= 1) {
      if (items > 0) fn(ctx, 0, items);
      return;
    }
    grow(threads - 1);
    fn_ = fn;
    ctx_ = ctx;
    items_ = items;
    next_.store(0);
    participants_ = threads - 1;
    pending_.store(threads - 1);
    {
      std::lock_guard<std::mutex> lk(mu_);
      ++generation_;
      gen_atomic_.store(generation_, std::memory_order_release);
    }
    cv_.notify_all();
    work();
    while (pending_.load(std::memory_order_acquire) != 0) {
      std::this_thread::yield();
    }
  }

 private:
  void grow(int n) {
    while (static_cast<int>(workers_.size()) < n) {
      int id = static_cast<int>(workers_.size());
      workers_.emplace_back([this, id] { loop(id); });
    }
  }

  void work() {
    for (;;) {
      int64_t i = next_.fetch_add(1);
      if (i >= items_) break;
      fn_(ctx_, i, i + 1);
    }
  }

  void loop(int id) {
    uint64_t seen = 0;
    for (;;) {
      // Spin a little for the next job, then sleep.
      for (int spin = 0; spin < 20000 && gen_atomic_.load(std::memory_order_acquire) == seen; ++spin) {
        __builtin_ia32_pause();
      }
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return generation_ != seen; });
        seen = generation_;
        if (stop_) return;
      }
      if (id < participants_) {
        work();
        pending_.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
  }

  std::mutex call_mu_, mu_;
  std::condition_variable cv_;
  std::vector<std::thread> workers_;
  uint64_t generation_ = 0;
  std::atomic<uint64_t> gen_atomic_{0};
  bool stop_ = false;
  void (*fn_)(void*, int64_t, int64_t) = nullptr;
  void* ctx_ = nullptr;
  int64_t items_ = 0;
  int participants_ = 0;
  std::atomic<int64_t> next_{0};
  std::atomic<int> pending_{0};
};

// The pool is never destroyed (no joining threads at interpreter exit). A
// forked child has none of the parent's worker threads, so it must not use the
// parent's pool (it would wait for them forever): the atfork handler makes the
// child build a fresh one on first use, leaking the old object untouched.
std::atomic<Pool*> g_pool{nullptr};
std::mutex g_pool_mu;

void forget_pool_in_child() { g_pool.store(nullptr); }

Pool& pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p) return *p;
  std::lock_guard<std::mutex> lk(g_pool_mu);
  static bool registered = false;
  if (!registered) {
    pthread_atfork(nullptr, nullptr, forget_pool_in_child);
    registered = true;
  }
  p = g_pool.load();
  if (!p) {
    p = new Pool();
    g_pool.store(p, std::memory_order_release);
  }
  return *p;
}

}  // namespace

void parallel_for(int64_t items, int threads, void (*fn)(void*, int64_t, int64_t), void* ctx) {
  pool().run(items, threads, fn, ctx);
}

}  // namespace cpu
}  // namespace zipserv
