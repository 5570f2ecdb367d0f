#include "ssd/io_threads.h"

#include <algorithm>
#include <string>

namespace tieredemb {

Status IoThreads::check_count(int n) {
  if (n >= 1 && n <= 1024) return Status::Ok();
  return Status::ValueError("io_threads " + std::to_string(n) + " must be in [1, 1024]");
}

IoThreads::IoThreads(int num_threads) {
  for (int i = 0; i < std::max(0, num_threads - 1); ++i) workers_.emplace_back([this] { worker_loop(); });
}

IoThreads::~IoThreads() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void IoThreads::drain() {
  for (int64_t t; (t = next_.fetch_add(1, std::memory_order_relaxed)) < num_tasks_;) (*fn_)(t);
}

void IoThreads::worker_loop() {
  int64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    drain();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--busy_ == 0) done_cv_.notify_all();
    }
  }
}

void IoThreads::run(int64_t num_tasks, const std::function<void(int64_t)>& fn) {
  std::lock_guard<std::mutex> call(call_mutex_);
  if (num_tasks <= 0) return;
  if (num_tasks == 1 || workers_.empty()) {
    for (int64_t t = 0; t < num_tasks; ++t) fn(t);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    fn_ = &fn;
    num_tasks_ = num_tasks;
    next_.store(0, std::memory_order_relaxed);
    busy_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  work_cv_.notify_all();
  drain();
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [&] { return busy_ == 0; });
  fn_ = nullptr;
}

}  // namespace tieredemb
