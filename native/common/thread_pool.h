// A small persistent pool for data-parallel loops over whole batches.
// parallel_for(n, grain, fn) calls fn(begin, end) on disjoint ranges covering [0, n) and
// returns when all are done. fn must not depend on how [0, n) is cut or on which thread runs a
// range (results are then the same for any thread count).
//
// Scheduling: the range is cut into up to kChunksPerThread chunks per thread (of at least
// `grain` items), which the caller and the workers take in turn from a shared counter. A thread
// that is descheduled (2 vCPUs shared with I/O threads, other processes) then delays a loop by
// one chunk, not by a fixed share of it; and the caller waits only for workers that took a
// chunk, never for one that had not woken up before the chunks ran out.
// An exception thrown by fn (std::bad_alloc, say) ends the loop: no thread takes another chunk,
// and parallel_for rethrows the first one once every thread has left the loop.
// One loop runs on the pool at a time: a call made while another thread's loop holds the pool
// (the prefetch worker's residency next to the training thread's kernels) runs inline on its
// own thread instead of waiting, and so does a loop started inside a loop.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tieredemb {

class ThreadPool {
 public:
  static constexpr int64_t kChunksPerThread = 8;

  // The pool of this extension module (each module linking native/common has its own).
  // Created on first use with a thread per core; a forked child gets a new one, same size.
  static ThreadPool& instance();
  // Starts num_threads - 1 workers (the caller of a loop is the last thread).
  explicit ThreadPool(int num_threads);
  // Stops and joins the workers.
  ~ThreadPool();
  // Restarts the workers so that loops run on n threads (n < 1: 1).
  // Waits for the loop in progress, if any.
  void set_num_threads(int n);
  int num_threads() const { return num_threads_; }
  // Calls fn(begin, end) on disjoint ranges covering [0, n) of at least grain items (see the
  // top of this file); returns when all have run.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void worker_loop(int64_t seen);
  void run_chunks();  // takes chunks of the current loop until none is left
  void stop_workers();
  void start_workers(int n);

  int num_threads_ = 1;
  std::vector<std::thread> workers_;
  std::mutex call_mutex_;  // held by the loop that has the pool
  std::mutex mutex_;
  std::condition_variable work_cv_, done_cv_;
  // The current loop (written under mutex_ before generation_ moves; read by a worker after it
  // has joined under mutex_).
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, chunk_ = 0, num_chunks_ = 0;
  std::atomic<int64_t> next_chunk_{0};
  std::exception_ptr error_;  // the current loop's first exception (under mutex_)
  int64_t generation_ = 0;
  bool open_ = false;  // workers may still join the current loop
  int active_ = 0;     // workers inside the current loop
  bool stop_ = false;
};

inline void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  ThreadPool::instance().parallel_for(n, grain, fn);
}

}  // namespace tieredemb
