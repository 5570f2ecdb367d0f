#include "common/thread_pool.h"

#include <unistd.h>

#include <algorithm>
#include <utility>

namespace tieredemb {

// One pool per process. A child made by fork() has none of its parent's worker threads (and
// may hold copies of locked mutexes), so it gets a fresh pool; the parent's copy is leaked in
// the child on purpose: destroying it would join threads that do not exist there.
ThreadPool& ThreadPool::instance() {
  static ThreadPool* pool = nullptr;
  static pid_t owner = 0;
  static int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (pool == nullptr || owner != getpid()) {
    if (pool != nullptr) threads = pool->num_threads_;
    pool = new ThreadPool(threads);
    owner = getpid();
  }
  return *pool;
}

ThreadPool::ThreadPool(int num_threads) { start_workers(num_threads); }

ThreadPool::~ThreadPool() { stop_workers(); }

void ThreadPool::start_workers(int n) {
  num_threads_ = std::max(1, n);
  stop_ = false;
  // The calling thread takes chunks too, so n threads need n - 1 workers. A worker starts at
  // the current generation, so it never joins a loop that began before it existed.
  int64_t generation = generation_;
  for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this, generation] { worker_loop(generation); });
}

void ThreadPool::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
}

void ThreadPool::set_num_threads(int n) {
  std::lock_guard<std::mutex> call(call_mutex_);
  if (std::max(1, n) == num_threads_) return;
  stop_workers();
  start_workers(n);
}

namespace {
// Set while a thread runs chunks of a loop: a loop started inside one runs inline (and never
// touches call_mutex_, which this thread may hold).
thread_local bool t_in_loop = false;
}  // namespace

void ThreadPool::run_chunks() {
  t_in_loop = true;
  for (;;) {
    int64_t c = next_chunk_.fetch_add(1, std::memory_order_relaxed);
    if (c >= num_chunks_) break;
    int64_t begin = c * chunk_;
    try {
      (*fn_)(begin, std::min(n_, begin + chunk_));
    } catch (...) {  // the first error ends the loop: no thread takes another chunk
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
      next_chunk_.store(num_chunks_, std::memory_order_relaxed);
      break;
    }
  }
  t_in_loop = false;
}

void ThreadPool::worker_loop(int64_t seen) {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      if (!open_) continue;  // the caller already ran out of chunks: nothing to join
      ++active_;
    }
    run_chunks();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--active_ == 0 && !open_) done_cv_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (t_in_loop) {
    fn(0, n);
    return;
  }
  grain = std::max<int64_t>(grain, 1);
  const int64_t most_chunks = (n + grain - 1) / grain;
  std::unique_lock<std::mutex> call(call_mutex_, std::try_to_lock);
  if (!call.owns_lock() || num_threads_ <= 1 || most_chunks <= 1) {
    if (call.owns_lock()) call.unlock();
    fn(0, n);
    return;
  }
  const int64_t num_chunks = std::min<int64_t>(most_chunks, num_threads_ * kChunksPerThread);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    fn_ = &fn;
    n_ = n;
    chunk_ = (n + num_chunks - 1) / num_chunks;
    num_chunks_ = (n + chunk_ - 1) / chunk_;
    next_chunk_.store(0, std::memory_order_relaxed);
    open_ = true;
    ++generation_;
  }
  work_cv_.notify_all();
  run_chunks();
  std::unique_lock<std::mutex> lock(mutex_);
  open_ = false;
  done_cv_.wait(lock, [&] { return active_ == 0; });
  std::exception_ptr error = std::exchange(error_, nullptr);
  lock.unlock();
  if (error) std::rethrow_exception(error);
}

}  // namespace tieredemb
