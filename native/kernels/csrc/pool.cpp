#include "pool.h"

#include <chrono>
#include <cstdlib>
#include <string>
#if defined(__linux__)
#include <sched.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace emlx {

namespace {

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Waking a sleeping thread costs tens of microseconds, about the length of
// one decode-step projection, so workers spin a while before sleeping.
std::chrono::microseconds spin_time() {
  long us = 300;
  if (const char* env = std::getenv("EMLX_AXON_POOL_SPIN_US")) us = std::strtol(env, nullptr, 10);
  return std::chrono::microseconds(us < 0 ? 0 : us);
}

}  // namespace

int configured_threads() {
  if (const char* env = std::getenv("EMLX_AXON_CPU_THREADS")) {
    char* end = nullptr;
    long n = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && n >= 1 && n <= 1024) return (int)n;
  }
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n >= 1) return n;
  }
#endif
  unsigned n = std::thread::hardware_concurrency();
  return n >= 1 ? (int)n : 1;
}

Pool& Pool::shared() {
  // Leaked on purpose: worker threads must outlive every static destructor
  // that could still run a product at exit.
  static Pool* pool = new Pool(configured_threads());
  return *pool;
}

Pool::Pool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
  for (auto& t : workers_) t.detach();
}

void Pool::drain() {
  for (;;) {
    int i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= tasks_) return;
    (*fn_)(i);
  }
}

void Pool::worker_loop() {
  unsigned long seen = 0;
  const auto spin = spin_time();
  for (;;) {
    unsigned long e = epoch_.load(std::memory_order_acquire);
    if (e == seen) {
      const auto until = std::chrono::steady_clock::now() + spin;
      int spins = 0;
      // Yielding while spinning: on a machine with as many cores as pool
      // threads, MLX's own threads (the one building and dispatching the
      // graph) need the core more than a waiting worker (~15% faster decode
      // on 2 cores than pausing).
      while ((e = epoch_.load(std::memory_order_acquire)) == seen) {
        std::this_thread::yield();
        if (++spins % 64 == 0 && std::chrono::steady_clock::now() > until) break;
      }
    }
    if (e == seen) {
      std::unique_lock<std::mutex> lock(m_);
      cv_.wait(lock, [&] { return epoch_.load(std::memory_order_acquire) != seen; });
      e = epoch_.load(std::memory_order_acquire);
    }
    seen = e;
    drain();
    active_.fetch_sub(1, std::memory_order_release);
  }
}

void Pool::run(int tasks, const std::function<void(int)>& fn) {
  if (tasks <= 1 || workers_.empty() || !submit_.try_lock()) {
    for (int i = 0; i < tasks; ++i) fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(m_);
    fn_ = &fn;
    tasks_ = tasks;
    next_.store(0, std::memory_order_relaxed);
    active_.store((int)workers_.size(), std::memory_order_relaxed);
    epoch_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_all();
  drain();
  for (int spins = 0; active_.load(std::memory_order_acquire) != 0; ++spins) {
    if (spins < 64)
      cpu_relax();
    else
      std::this_thread::yield();
  }
  submit_.unlock();
}

}  // namespace emlx
