// LogFile: an embedding table's rows in append-only segment files, the native SSD backend for
// training (write-back heavy).
//
// Why: a training step writes back thousands of evicted rows at random ids. Written in place
// (SlotFile), each one dirties its own 4 KiB page: a page fault or a buffered write of ~2-3 us
// of kernel time per row. Appended as one record per batch, the same rows cost one sequential
// write (~0.1 us per row).
//
// Layout (one directory): seg-<seq>.log, segments of up to `segment_bytes` that grow by
// appends (a full disk is an error from Write), each a sequence of batch records:
// header {magic, n, row_bytes, checksum}, n int64 ids, n rows (file_io.h). A segment is
// appended to by the process that created it only; a reopened table starts a new one.
// `flushed` lists every segment and its length at the last Sync (replaced whole, by a rename):
// those records are trusted at open and must all be there (a listed segment missing or shorter is
// refused as corrupted); records past them are replayed only while their checksum holds (a
// record cut by kill -9 or a power loss ends the segment's log). A missing or damaged mark
// trusts nothing. (Tables flushed before the list kept the newest segment's length only.)
// In memory: per row, where its newest copy lives (segment, offset), 8 bytes per row in a
// lazily reserved array; reads copy from the segments' read-only mappings (or pread with
// O_DIRECT). Rows never written read as not found.
// Compaction: when the bytes of copies that are no longer newest exceed both the live bytes
// and one segment, the sealed segment with the fewest live bytes is compacted: its live rows
// are appended again, made durable with a mark without the segment, and then its file is removed
// (space amplification at most ~2x plus a segment).
// Checkpoint: Sync, then hard links to every segment plus a `flushed` mark in a new
// directory (copies across filesystems); the table then appends to a new segment, so no
// linked file is ever written again.
// Write-behind: a Write that fits in the current segment as one record is staged in memory
// (its rows readable at once) and appended by a background thread while the caller goes on;
// the next Write, Sync, Checkpoint or Close waits for it. An append that fails makes every
// later call return its error (the rows it held may be lost; what was synced is intact).
// Thread-safety: one call at a time; each Read runs its copies on this object's I/O threads.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "ssd/io_threads.h"

namespace tieredemb {

class LogFile {
 public:
  // Opens the table in `dir` (replaying records past the last flush mark while their checksum
  // holds) or creates it (create = true: dir must hold no table). Returns: Ok, ValueError (bad
  // argument), RuntimeError (I/O error; "corrupted: ..." for damaged files).
  static Status Open(const std::string& dir, int64_t num_rows, int64_t row_bytes, int64_t segment_bytes,
                     bool create, bool direct, int io_threads, std::unique_ptr<LogFile>* out);
  ~LogFile();

  // Same contracts as SlotFile's. Write: on an error every row is either stored whole or not
  // at all (a batch split over segments may be stored in part).
  Status Read(const int64_t* ids, int64_t n, uint8_t* out, const int64_t* out_rows, uint8_t* found);
  Status Write(const int64_t* ids, int64_t n, const uint8_t* rows);
  // Write with row k at src + src_rows[k] * src_stride (rows of a cache tier's pool, no gather).
  Status WriteFrom(const int64_t* ids, int64_t n, const uint8_t* src, int64_t src_stride, const int64_t* src_rows);
  // Makes every Write that returned before the call durable (segments, then the flush mark).
  Status Sync();
  // Sync, then a table at dst_dir (a new, empty directory) made of links to the segments.
  Status Checkpoint(const std::string& dst_dir);
  std::vector<int64_t> WrittenIds(int64_t start, int64_t limit) const;
  int64_t num_written() const { return num_written_; }
  int64_t replayed() const { return replayed_; }
  // The log's size: bytes of the newest copies, bytes of all segments (O(segments)), segments,
  // compactions run and rows they moved.
  int64_t live_bytes() const { return live_bytes_; }
  int64_t log_bytes() const;
  int64_t num_segments() const;
  int64_t compactions() const { return compactions_; }
  int64_t rows_compacted() const { return rows_compacted_; }
  int64_t row_bytes() const { return row_bytes_; }
  // Where Write's time went (wall nanoseconds), since the last TakeWriteTimes: the caller waiting
  // for the last staged append (drain), staging the record (its rows gathered, their places taken),
  // compacting; and on the writer thread, appending (checksum and pwrite), with the bytes appended.
  struct WriteTimes {
    int64_t writes = 0, drain_ns = 0, stage_ns = 0, compact_ns = 0, appends = 0, append_ns = 0, appended_bytes = 0;
  };
  WriteTimes TakeWriteTimes();
  // Waits for the staged append, then closes the files without a sync.
  // Returns: Ok, or the error of the staged append.
  Status Close();

 private:
  struct Segment {
    uint32_t seq = 0;   // its file's number: seg-<seq>.log (newer segments have larger ones)
    uint32_t slot = 0;  // its place in segments_ and in loc_'s entries (reused once it is dropped)
    int fd = -1, direct_fd = -1;
    uint8_t* map = nullptr;
    int64_t mapped = 0;  // bytes mapped at open (the file may be truncated below that later)
    int64_t capacity = 0, end = 0, synced = 0, live = 0;
    std::string path;
  };
  explicit LogFile(int io_threads) : io_(io_threads) {}
  Status check_ids(const int64_t* ids, int64_t n) const;
  Status open_segment(uint32_t seq, bool create, Segment** out);
  Status replay(Segment* seg, int64_t flushed);  // flushed: its length at the last flush
  Status append(const int64_t* ids, int64_t n, const uint8_t* rows);
  Status append_record(const int64_t* ids, int64_t n, const uint8_t* rows);
  Status make_room(int64_t rec);  // seals the current segment and opens a new one unless rec fits
  Status maybe_compact();
  Status compact(Segment* seg);
  Status write_mark(const std::string& dir) const;  // every segment's end, as flushed
  Status drain();           // waits for the staged append; its error, if any (sticky)
  void writer_loop();
  void drop_segment(Segment* seg, bool remove_file);
  Status seal(Segment* seg);
  void place(int64_t id, Segment* seg, int64_t row_offset);
  Segment* segment_of(uint64_t loc) const { return segments_[loc >> 40].get(); }  // (loc: loc_[id] - 1)

  std::string dir_;
  int64_t num_rows_ = 0, row_bytes_ = 0, segment_bytes_ = 0, max_record_rows_ = 0;
  bool direct_ = false;
  // loc_[id]: 0 = never written, else (slot << 40 | byte offset of the row in its segment) + 1.
  // Slots, not segment numbers: those only grow (a table's 2^24th segment would have wrapped), while
  // the slots in use are the segments alive, which compaction bounds.
  uint64_t* loc_ = nullptr;
  std::vector<std::unique_ptr<Segment>> segments_;  // indexed by slot; null: free
  std::vector<uint32_t> free_slots_;                  // slots of segments dropped, to reuse
  Segment* current_ = nullptr;                        // the segment appended to (null: none yet)
  uint64_t next_seq_ = 1;
  int64_t num_written_ = 0, live_bytes_ = 0, replayed_ = 0, compactions_ = 0, rows_compacted_ = 0;
  // The staged append: record bytes `staged_` for segment staged_seg_ at staged_off_.
  std::vector<uint8_t> staged_;
  Segment* staged_seg_ = nullptr;
  int64_t staged_off_ = -1;
  bool staged_busy_ = false, stop_ = false;
  Status writer_error_;
  WriteTimes times_;  // (its append fields under mutex_: the writer thread's)
  std::mutex mutex_;
  std::condition_variable cv_;
  std::thread writer_;
  IoThreads io_;
};

}  // namespace tieredemb
