// StreamIo: a GPU tier 0's reads and writes of the log store right below it, queued on a CUDA
// stream as host functions (the driver's cuLaunchHostFunc), so that no thread of ours waits for the
// device (tieredemb/gpu/storeio.py). The driver runs each on its own thread when the stream gets
// there, and the stream's later work waits until it returns: no GIL, no Python.
//
// One queued call is one residency's I/O, read from the plan's transfer block (pinned host memory
// the stream copied it into before): counts[kinds] first, then the miss ids from `kinds`, then the
// dirty victims' ids from kinds + n. It writes the victims down (their rows out[0, D), in order),
// then reads the misses into into[0, F) (a row never written gets the deferred mark in its first
// word, for the device to draw it: tiers/rowstore.py's DEFERRED_MARK).
//
// libcuda is found at run time (dlopen of libcuda.so.1): nothing CUDA to build against. On a
// machine without it, a call can only be run at once, on the caller's thread (now).
//
// Errors: a failed write or read is kept (the first one), and every later call does nothing; the
// caller reads it with error(). Counts: what the calls did since take_counts() last looked.
// Thread-safety: queue() from one thread at a time; the LogFile is used by no one else while
// calls are queued (the caller waits for the stream before it touches the store).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "common/status.h"
#include "ssd/log_file.h"

namespace tieredemb {

class StreamIo {
 public:
  struct Counts {
    int64_t writes = 0, rows_written = 0, reads = 0, rows_found = 0, rows_marked = 0, calls = 0;
  };
  // Where the calls' time went (wall nanoseconds on the driver's thread): writing and reading.
  struct Times {
    int64_t write_ns = 0, read_ns = 0, calls = 0;
  };
  // file: the holder of the store's LogFile (null once the store is closed: a call then fails);
  // kinds: the counts at the head of a transfer block; fresh, dirty: which of them are the
  // misses' and the dirty victims'; mark: the int32 written into a never-written row's first word.
  StreamIo(const std::unique_ptr<LogFile>* file, int64_t kinds, int64_t fresh, int64_t dirty, uint32_t mark)
      : file_(file), kinds_(kinds), fresh_(fresh), dirty_(dirty), mark_(mark) {}

  // Queues one residency's I/O on stream (a CUstream: 0 is the legacy default stream), or runs
  // it now on this thread (now: CPU tensors, no stream): xfer, the transfer block (xfer_len
  // entries) of a plan of n ids, pinned, read when the call runs; out, into: blocks of out_rows
  // and in_rows rows of the file's row_bytes. Every pointer must stay valid until the call has run
  // (the caller waits for the stream before it frees them). Returns an error only if it could not
  // be queued (then nothing is).
  Status Queue(bool now, uintptr_t stream, const int64_t* xfer, int64_t xfer_len, int64_t n, const uint8_t* out,
               int64_t out_rows, uint8_t* into, int64_t in_rows);
  std::string error();  // the first failed call's error ("" for none)
  Counts TakeCounts();
  Times TakeTimes();  // (apart from the counts: a profile takes these without taking the counts)

 private:
  struct Job {
    StreamIo* io;
    const int64_t* xfer;
    int64_t xfer_len, n;
    const uint8_t* out;
    int64_t out_rows;
    uint8_t* into;
    int64_t in_rows;
  };
  static void Run(void* job);
  Status Do(const Job& job);

  const std::unique_ptr<LogFile>* file_;
  const int64_t kinds_, fresh_, dirty_;
  const uint32_t mark_;
  std::mutex mutex_;
  std::string error_;
  Counts counts_;
  Times times_;
};

}  // namespace tieredemb
