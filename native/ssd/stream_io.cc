#include "ssd/stream_io.h"

#include <dlfcn.h>

#include <chrono>
#include <cstring>
#include <exception>
#include <vector>

namespace tieredemb {

namespace {

// The two driver entry points used, found in libcuda at the first queued call.
struct Driver {
  int (*launch_host_func)(void* stream, void (*fn)(void*), void* data) = nullptr;
  int (*stream_is_capturing)(void* stream, int* status) = nullptr;
  std::string missing;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      d.missing = "libcuda.so.1 cannot be loaded";
      return d;
    }
    d.launch_host_func = reinterpret_cast<decltype(d.launch_host_func)>(dlsym(lib, "cuLaunchHostFunc"));
    d.stream_is_capturing = reinterpret_cast<decltype(d.stream_is_capturing)>(dlsym(lib, "cuStreamIsCapturing"));
    if (d.launch_host_func == nullptr || d.stream_is_capturing == nullptr)
      d.missing = "libcuda.so.1 has no cuLaunchHostFunc or cuStreamIsCapturing";
    return d;
  }();
  return d;
}

}  // namespace

Status StreamIo::Queue(bool now, uintptr_t stream, const int64_t* xfer, int64_t xfer_len, int64_t n,
                       const uint8_t* out, int64_t out_rows, uint8_t* into, int64_t in_rows) {
  if (n < 0 || xfer_len < kinds_ + n || in_rows < n)
    return Status::ValueError("a plan of " + std::to_string(n) + " ids with a transfer of " + std::to_string(xfer_len) +
                              " entries and a block of " + std::to_string(in_rows) +
                              " rows for its misses: both must hold at least its ids");
  auto* job = new Job{this, xfer, xfer_len, n, out, out_rows, into, in_rows};
  if (now) {
    Run(job);
    return Status::Ok();
  }
  const Driver& d = driver();
  if (!d.missing.empty()) {
    delete job;
    return Status::RuntimeError(d.missing);
  }
  void* s = reinterpret_cast<void*>(stream);
  int capturing = 0;
  int code = d.stream_is_capturing(s, &capturing);
  if (code == 0 && capturing != 0) {
    delete job;
    return Status::RuntimeError("the store's I/O cannot be queued while the stream is captured as a CUDA graph");
  }
  if (code == 0) code = d.launch_host_func(s, &StreamIo::Run, job);
  if (code != 0) {
    delete job;
    return Status::RuntimeError("cuLaunchHostFunc failed: CUDA driver error " + std::to_string(code));
  }
  return Status::Ok();
}

void StreamIo::Run(void* data) {
  Job* job = static_cast<Job*>(data);
  StreamIo* io = job->io;
  {
    std::lock_guard<std::mutex> lock(io->mutex_);
    ++io->counts_.calls;
    if (!io->error_.empty()) {  // (after a failure nothing more is done)
      delete job;
      return;
    }
  }
  Status s;
  try {  // (nothing may leave a host function: the driver's thread would end the process)
    s = io->Do(*job);
  } catch (const std::exception& e) {
    s = Status::RuntimeError(std::string("a store call failed: ") + e.what());
  } catch (...) {
    s = Status::RuntimeError("a store call failed");
  }
  delete job;
  if (!s.ok()) {
    std::lock_guard<std::mutex> lock(io->mutex_);
    if (io->error_.empty()) io->error_ = s.message.empty() ? "error" : s.message;
  }
}

Status StreamIo::Do(const Job& job) {
  LogFile* file = file_->get();
  if (file == nullptr) return Status::RuntimeError("the log store was closed with its reads and writes still queued");
  const int64_t dirty = job.xfer[dirty_], fresh = job.xfer[fresh_];
  if (dirty < 0 || dirty > job.out_rows || kinds_ + job.n + dirty > job.xfer_len || fresh < 0 || fresh > job.n)
    return Status::RuntimeError("a plan's counts out of its blocks: " + std::to_string(fresh) + " misses, " +
                                std::to_string(dirty) + " dirty victims");
  const int64_t row_bytes = file->row_bytes();
  using Clock = std::chrono::steady_clock;
  const auto ns = [](Clock::time_point a, Clock::time_point b) {
    return static_cast<int64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count());
  };
  const auto start = Clock::now();
  Counts c;
  if (dirty > 0) {  // (first: a row lingering in an overflow slot may leave and come back in one plan)
    Status s = file->WriteFrom(job.xfer + kinds_ + job.n, dirty, job.out, row_bytes, nullptr);
    if (!s.ok()) return s;
    c.writes = 1;
    c.rows_written = dirty;
  }
  const auto written = Clock::now();
  if (fresh > 0) {
    std::vector<uint8_t> found(static_cast<size_t>(fresh));
    Status s = file->Read(job.xfer + kinds_, fresh, job.into, nullptr, found.data());
    if (!s.ok()) return s;
    c.reads = fresh;
    for (int64_t k = 0; k < fresh; ++k) {
      if (found[k]) {
        ++c.rows_found;
      } else {
        std::memcpy(job.into + k * row_bytes, &mark_, sizeof mark_);
        ++c.rows_marked;
      }
    }
  }
  const auto read = Clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  times_.write_ns += ns(start, written);
  times_.read_ns += ns(written, read);
  ++times_.calls;
  counts_.writes += c.writes;
  counts_.rows_written += c.rows_written;
  counts_.reads += c.reads;
  counts_.rows_found += c.rows_found;
  counts_.rows_marked += c.rows_marked;
  return Status::Ok();
}

std::string StreamIo::error() {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

StreamIo::Times StreamIo::TakeTimes() {
  std::lock_guard<std::mutex> lock(mutex_);
  Times t = times_;
  times_ = Times{};
  return t;
}

StreamIo::Counts StreamIo::TakeCounts() {
  std::lock_guard<std::mutex> lock(mutex_);
  Counts c = counts_;
  counts_ = Counts{};
  return c;
}

}  // namespace tieredemb
