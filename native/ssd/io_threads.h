// The I/O threads of a native SSD file (SlotFile, LogFile): each file runs its reads and
// writes on its own threads.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "common/status.h"

namespace tieredemb {

// Threads that block in pread/pwrite (separate from the compute ThreadPool: an I/O thread
// spends its time waiting on the disk, so there are many more of them than cores).
class IoThreads {
 public:
  // Ok if n threads may serve a file ([1, 1024]), else ValueError naming n.
  static Status check_count(int n);
  // Starts num_threads - 1 threads (the caller of run() is the last one).
  explicit IoThreads(int num_threads);
  // Stops and joins the threads.
  ~IoThreads();
  // Calls fn(task) for every task in [0, num_tasks) on the I/O threads and the caller;
  // returns when all are done. Calls from several threads at once are serialized.
  void run(int64_t num_tasks, const std::function<void(int64_t)>& fn);

 private:
  void worker_loop();
  void drain();

  std::vector<std::thread> workers_;
  std::mutex call_mutex_, mutex_;
  std::condition_variable work_cv_, done_cv_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t num_tasks_ = 0;
  std::atomic<int64_t> next_{0};
  int64_t generation_ = 0;
  int busy_ = 0;
  bool stop_ = false;
};

}  // namespace tieredemb
