// One process-wide pool of worker threads, sized to the cores.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace emlx {

class Pool {
 public:
  // Threads: EMLX_AXON_CPU_THREADS, else the cores this process may run on.
  static Pool& shared();

  // Participants in a run, the calling thread included.
  int size() const { return (int)workers_.size() + 1; }

  // Calls fn(0..tasks-1) across the pool and the caller, and returns when all
  // are done. A run submitted while another is in progress (another MLX
  // stream) runs on its own thread rather than waiting.
  void run(int tasks, const std::function<void(int)>& fn);

 private:
  explicit Pool(int threads);
  void worker_loop();
  void drain();

  std::vector<std::thread> workers_;
  std::mutex submit_;
  std::mutex m_;
  std::condition_variable cv_;
  std::atomic<unsigned long> epoch_{0};
  std::atomic<int> next_{0};
  std::atomic<int> active_{0};
  const std::function<void(int)>* fn_ = nullptr;
  int tasks_ = 0;
};

int configured_threads();

}  // namespace emlx
