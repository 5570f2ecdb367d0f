// SlotFile: an embedding table's rows in one file of fixed-size slots, the native SSD backend.
//
// Layout: row id i lives at byte offset i * slot_bytes of the data file (slot_bytes >= row_bytes;
// the tail of a slot is zero padding). The file is created sparse with ftruncate, so a
// table of 10^9 rows costs nothing until rows are written; space is reserved (fallocate) a
// 64 KiB chunk at a time when a write first touches it, so a full disk is an error returned
// by Write, never a fault. A "written" bitmap (bit i of byte i / 8, LSB first) in a side file
// says which slots hold a row; a row whose bit is clear has never been written and reads as
// not found (the caller fills it with its initializer).
//
// The data file is memory-mapped: Write copies rows into the mapping (the page cache) and
// buffered reads copy them out; no system call per row. O_DIRECT (direct = true) applies to
// reads: each row is read with pread as the 512-byte-aligned sector range enclosing its slot.
//
// Crash safety. A copy into the mapping cut by kill -9 would leave a row half old, half new,
// so Write first writes the whole batch (ids and rows, with a checksum) to a redo log, then
// copies it into the slots. The log holds the latest Write only; Open replays it when its
// checksum holds (a torn log means its copy never started). Durability: Sync() msyncs the data
// first, then writes and fdatasyncs the bitmap pages that changed, so a bit is durable only
// after the row it stands for.
// Ids are int64 in [0, num_rows), unique within a call; rows are row_bytes bytes, row-major.
// Thread-safety: one Write or Sync at a time; Read may run concurrently with them (the bitmap
// bits are atomic) but a row being written concurrently with its read may read torn.
// I/O runs on this object's own threads.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "ssd/io_threads.h"

namespace tieredemb {

class SlotFile {
 public:
  // Opens (create = false) or creates (create = true) the data file `data_path` and bitmap
  // file `bitmap_path`. Creating truncates both to their sizes (sparse). Opening checks
  // both sizes. Returns: Ok, ValueError (bad argument), RuntimeError (I/O error or a file
  // of the wrong size; the message starts with "corrupted:" for the latter).
  // `log_path` is the redo log (created if missing; replayed if it holds a whole record).
  static Status Open(const std::string& data_path, const std::string& bitmap_path, const std::string& log_path,
                     int64_t num_rows, int64_t row_bytes, int64_t slot_bytes, bool create, bool direct,
                     int io_threads, std::unique_ptr<SlotFile>* out);
  ~SlotFile();

  // Copies the rows of ids into out[r * row_bytes ...] with r = out_rows[k] (k when out_rows is
  // null; the caller checks the rows); found[k] = 1 if row ids[k] was ever written, else 0 and
  // out's row is left as it was. Returns: Ok, IndexError, RuntimeError.
  Status Read(const int64_t* ids, int64_t n, uint8_t* out, const int64_t* out_rows, uint8_t* found);
  // Writes rows[k * row_bytes ...] to the slot of ids[k] and marks them written. On an error
  // (no space for the slots or the redo log, an I/O error) no slot has changed.
  Status Write(const int64_t* ids, int64_t n, const uint8_t* rows);
  // Makes every Write that returned before the call durable (data, then bitmap).
  Status Sync();
  // Sorted ids of written rows >= start, at most limit of them (limit < 0: all).
  std::vector<int64_t> WrittenIds(int64_t start, int64_t limit) const;
  // Rows written so far (a count of the bitmap's bits).
  int64_t num_written() const;
  // Rows the last Open restored from the redo log (0: the log was empty or torn).
  int64_t replayed() const { return replayed_; }
  // Closes the files without a sync; the object then serves no more calls.
  // Returns: Ok, RuntimeError (a file could not be closed).
  Status Close();
  // Bytes of one row.
  int64_t row_bytes() const { return row_bytes_; }

 private:
  SlotFile(int io_threads) : io_(io_threads) {}
  bool is_written(int64_t id) const {
    return (__atomic_load_n(&bitmap_[id >> 3], __ATOMIC_ACQUIRE) >> (id & 7)) & 1;
  }
  Status check_ids(const int64_t* ids, int64_t n) const;
  Status reserve(const int64_t* ids, int64_t n);
  Status write_log(const int64_t* ids, int64_t n, const uint8_t* rows);
  Status replay_log();
  void copy_in(const int64_t* ids, int64_t n, const uint8_t* rows);
  void mark_written(const int64_t* ids, int64_t n);
  std::string io_error(const char* what, int64_t offset, int err) const;

  std::string data_path_, bitmap_path_, log_path_;
  int data_fd_ = -1, direct_fd_ = -1, bitmap_fd_ = -1, log_fd_ = -1;
  uint8_t* map_ = nullptr;            // the data file, mapped shared
  int64_t map_size_ = 0;
  std::vector<uint8_t> reserved_;     // 1 per chunk of the data file known to have its blocks
  int64_t replayed_ = 0;
  int64_t num_rows_ = 0, row_bytes_ = 0, slot_bytes_ = 0;
  bool direct_ = false;
  std::vector<uint8_t> bitmap_;
  std::vector<uint8_t> dirty_pages_;  // 1 per 4 KiB page of bitmap_ changed since the last sync
  std::mutex bitmap_mutex_;           // guards dirty_pages_ and setting bits
  std::mutex sync_mutex_;             // one sync at a time
  IoThreads io_;
};

}  // namespace tieredemb
