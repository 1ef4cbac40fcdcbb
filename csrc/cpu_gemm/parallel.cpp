// Work splitting of the fused CPU GEMM over torch's own OpenMP threads.
//
// The extension is built with -fopenmp against libgomp.so.1. torch's CPU
// build ships and loads a libgomp.so.1 first (zipserv_vllm imports torch
// before the extension), and the dynamic loader resolves by soname, so these
// parallel regions run on the very threads torch's intra-op parallelism (and
// vLLM's CPU worker, which binds them to cores) uses. An earlier version ran
// its own std::thread pool: after every torch op torch's OpenMP workers keep
// spinning for a while, and on a machine with as many threads as cores the
// two sets of threads took the cores from each other (a synthetic decode
// step: 0.51x of BF16 with the pool, docs/CPU.md).
//
// GNU OpenMP cannot start a parallel region in a process forked from one
// whose threads have run (it waits for workers that do not exist in the
// child; torch's own ops hang there too). A forked child therefore runs the
// kernel on its calling thread only.
#include <omp.h>
#include <pthread.h>

#include <atomic>
#include <mutex>

#include "zipserv/cpu_gemm.h"

namespace zipserv {
namespace cpu {
namespace {

std::atomic<bool> g_forked{false};
std::once_flag g_atfork_once;

void mark_forked() { g_forked.store(true); }

// The team size a call of `items` gets from `threads` asked, or 0 where it runs on the calling
// thread: nothing to do, one thread, a forked child, or already inside a parallel region.
int team_for(int64_t items, int threads) {
  install_fork_guard();  // (also at module import: a fork before the first call must be seen too)
  if (items <= 0) return 0;
  if (threads > items) threads = static_cast<int>(items);
  if (threads <= 1 || g_forked.load(std::memory_order_relaxed) || omp_in_parallel()) return 0;
  return threads;
}

}  // namespace

void install_fork_guard() {
  std::call_once(g_atfork_once, [] { pthread_atfork(nullptr, nullptr, mark_forked); });
}

void parallel_for(int64_t items, int threads, void (*fn)(void*, int64_t, int64_t), void* ctx) {
  threads = team_for(items, threads);
  if (threads == 0) {
    if (items > 0) fn(ctx, 0, items);
    return;
  }
  // Tile rows handed out one at a time (their cost varies with the tile
  // contents and with what else the cores are doing).
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads)
  {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < items;
         i = next.fetch_add(1, std::memory_order_relaxed))
      fn(ctx, i, i + 1);
  }
}

void parallel_claims(int64_t items, int threads, void (*fn)(void*, int64_t, int64_t), void* ctx) {
  threads = team_for(items, threads);
  if (threads == 0) {
    for (int64_t i = 0; i < items; ++i) fn(ctx, i, i + 1 < items ? i + 1 : -1);
    return;
  }
  // The first items are dealt out, not taken from the counter (a thread that took its first item
  // and its next one before the others started could leave one idle: with as many items as
  // threads, two would run one after the other): with at least two items per thread, thread t
  // runs items 2t and 2t + 1 first (neighbours in memory, so the hardware's stream prefetch runs
  // on from one into the other), else item t; the rest come from the counter, one claimed ahead
  // per thread. The team's real size counts, as OpenMP may give fewer threads than asked.
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads)
  {
    const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
    const bool pairs = items >= 2 * team;
    const int64_t dealt = pairs ? 2 * team : team;
    int64_t i = pairs ? 2 * t : t;
    bool second = pairs;  // the next item is i + 1, dealt
    while (i < items) {
      const int64_t j = second ? i + 1 : dealt + next.fetch_add(1, std::memory_order_relaxed);
      second = false;
      fn(ctx, i, j < items ? j : -1);
      i = j;
    }
  }
}

}  // namespace cpu
}  // namespace zipserv
