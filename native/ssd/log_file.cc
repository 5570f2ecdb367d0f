#include "ssd/log_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>

#include "ssd/file_io.h"
#include "ssd/log_format.h"
#include "common/row_moves.h"

namespace tieredemb {

namespace {

constexpr int64_t kReadTask = 8;  // ids per read task: many reads in flight

int64_t elapsed_ns(std::chrono::steady_clock::time_point since) {
  return static_cast<int64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - since).count());
}

}  // namespace

using log_format::fsync_dir;
using log_format::kMaxSlot;
using log_format::kOffsetBits;
using log_format::kOffsetMask;
using log_format::segment_name;

LogFile::~LogFile() { Close(); }

Status LogFile::Close() {
  Status s = Status::Ok();
  if (writer_.joinable()) {
    s = drain();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    writer_.join();
  }
  for (auto& seg : segments_) {
    if (!seg) continue;
    if (seg->map != nullptr) ::munmap(seg->map, static_cast<size_t>(seg->mapped));
    if (seg->fd >= 0) ::close(seg->fd);
    if (seg->direct_fd >= 0) ::close(seg->direct_fd);
  }
  segments_.clear();
  free_slots_.clear();
  current_ = nullptr;
  if (loc_ != nullptr) {
    ::munmap(loc_, static_cast<size_t>(num_rows_) * 8);
    loc_ = nullptr;
  }
  return s;
}

void LogFile::writer_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || staged_busy_; });
    if (!staged_busy_) return;
    lock.unlock();
    // The checksum is computed here too, off the caller's thread.
    auto* h = reinterpret_cast<LogHeader*>(staged_.data());
    const int64_t n = static_cast<int64_t>(h->n);
    const uint8_t* payload = staged_.data() + sizeof(LogHeader);
    const auto start = std::chrono::steady_clock::now();
    h->checksum = checksum(payload + n * 8, static_cast<size_t>(n * row_bytes_),
                           checksum(payload, static_cast<size_t>(n) * 8, h->n));
    int err = pwrite_full(staged_seg_->fd, staged_.data(), static_cast<int64_t>(staged_.size()), staged_off_);
    const int64_t took = elapsed_ns(start);
    lock.lock();
    ++times_.appends;
    times_.append_ns += took;
    times_.appended_bytes += static_cast<int64_t>(staged_.size());
    if (err != 0 && writer_error_.ok())
      writer_error_ = Status::RuntimeError("cannot write " + staged_seg_->path + " at offset " +
                                           std::to_string(staged_off_) + ": " + errno_text(err));
    staged_busy_ = false;
    cv_.notify_all();
  }
}

Status LogFile::drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [&] { return !staged_busy_; });
  return writer_error_;
}

Status LogFile::check_ids(const int64_t* ids, int64_t n) const {
  if (loc_ == nullptr) return Status::RuntimeError(dir_ + ": the log store is closed");
  for (int64_t k = 0; k < n; ++k) {
    if (ids[k] < 0 || ids[k] >= num_rows_)
      return Status::IndexError("id " + std::to_string(ids[k]) + " out of range [0, " + std::to_string(num_rows_) + ")");
  }
  return Status::Ok();
}

Status LogFile::open_segment(uint32_t seq, bool create, Segment** out) {
  // The slot it takes in segments_ (and in loc_'s entries): a free one, else a new one.
  const size_t slot = free_slots_.empty() ? segments_.size() : free_slots_.back();
  if (slot > kMaxSlot)
    return Status::RuntimeError(dir_ + ": the log would hold more than " + std::to_string(kMaxSlot + 1) +
                                " segments at once; reopen it with a larger segment_bytes");
  auto seg = std::make_unique<Segment>();
  seg->seq = seq;
  seg->path = dir_ + "/" + segment_name(seq);
  seg->fd = ::open(seg->path.c_str(), O_RDWR | O_CLOEXEC | (create ? O_CREAT | O_EXCL : 0), 0644);
  if (seg->fd < 0) return Status::RuntimeError("cannot open " + seg->path + ": " + errno_text(errno));
  if (create) {
    // Appends grow the file (a full disk fails the write that needs the space); the mapping
    // covers the whole segment from the start and is read below the end of what was written.
    seg->capacity = segment_bytes_;
  } else {
    struct stat st;
    if (::fstat(seg->fd, &st) != 0) {
      ::close(seg->fd);
      return Status::RuntimeError("cannot stat " + seg->path + ": " + errno_text(errno));
    }
    seg->capacity = st.st_size;
  }
  if (seg->capacity > 0) {
    void* map = ::mmap(nullptr, static_cast<size_t>(seg->capacity), PROT_READ, MAP_SHARED, seg->fd, 0);
    if (map == MAP_FAILED) {
      ::close(seg->fd);
      return Status::RuntimeError("cannot map " + seg->path + ": " + errno_text(errno));
    }
    seg->map = static_cast<uint8_t*>(map);
    seg->mapped = seg->capacity;
    ::madvise(map, static_cast<size_t>(seg->capacity), MADV_RANDOM);
  }
  if (direct_) {
    seg->direct_fd = ::open(seg->path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
    if (seg->direct_fd < 0) {
      Status s = Status::RuntimeError("cannot open " + seg->path + " with O_DIRECT (the filesystem may not " +
                                      "support direct I/O, e.g. tmpfs; use direct_reads=False): " + errno_text(errno));
      if (seg->map != nullptr) ::munmap(seg->map, static_cast<size_t>(seg->mapped));
      ::close(seg->fd);
      return s;
    }
  }
  seg->slot = slot;
  *out = seg.get();
  if (slot == segments_.size()) {
    segments_.push_back(std::move(seg));
  } else {
    free_slots_.pop_back();
    segments_[slot] = std::move(seg);
  }
  return Status::Ok();
}

Status LogFile::seal(Segment* seg) {
  // Nothing is ever appended to it again (a checkpoint may link to it). A file longer than
  // its records (a record torn by a crash) is cut to them, durably, so that once trusted
  // the segment still ends there.
  if (current_ == seg) current_ = nullptr;
  if (seg->capacity == seg->end) return Status::Ok();
  if (::ftruncate(seg->fd, seg->end) != 0 || ::fsync(seg->fd) != 0)
    return Status::RuntimeError("cannot truncate " + seg->path + " to " + std::to_string(seg->end) + " bytes: " +
                                errno_text(errno));
  seg->capacity = seg->end;
  return Status::Ok();
}

void LogFile::place(int64_t id, Segment* seg, int64_t row_offset) {
  const uint64_t old = loc_[id];
  if (old != 0) {
    Segment* prev = segment_of(old - 1);
    if (prev != nullptr) prev->live -= row_bytes_;
    live_bytes_ -= row_bytes_;
  } else {
    ++num_written_;
  }
  loc_[id] = ((static_cast<uint64_t>(seg->slot) << kOffsetBits) | static_cast<uint64_t>(row_offset)) + 1;
  seg->live += row_bytes_;
  live_bytes_ += row_bytes_;
}

Status LogFile::make_room(int64_t rec) {
  if (current_ != nullptr && current_->end + rec <= current_->capacity) return Status::Ok();
  if (current_ != nullptr) current_->capacity = current_->end;  // sealed: its file ends there
  if (next_seq_ > UINT32_MAX)
    return Status::RuntimeError(dir_ + ": the log has used up its segment numbers (" + std::to_string(UINT32_MAX) +
                                "); export its rows into a new table");
  Segment* seg;
  Status s = open_segment(static_cast<uint32_t>(next_seq_), true, &seg);
  if (!s.ok()) return s;
  ++next_seq_;
  current_ = seg;
  return Status::Ok();
}

Status LogFile::append_record(const int64_t* ids, int64_t n, const uint8_t* rows) {
  const int64_t rec = record_bytes(n, row_bytes_);
  Status s = make_room(rec);
  if (!s.ok()) return s;
  if (int err = write_record(current_->fd, current_->end, ids, n, rows, row_bytes_)) {
    // What it wrote is cut off again: a segment's file is its records (Open refuses a segment
    // before the flush mark's that holds more), and the table goes on after this error.
    std::string cut;
    if (::ftruncate(current_->fd, current_->end) != 0) {
      cut = "; cutting it back to " + std::to_string(current_->end) + " bytes failed too: " + errno_text(errno);
      current_->capacity = current_->end;  // (sealed: nothing more is appended to it)
    }
    return Status::RuntimeError("cannot write " + current_->path + " at offset " + std::to_string(current_->end) + ": " +
                                errno_text(err) + cut);
  }
  const int64_t first_row = current_->end + record_bytes(0, row_bytes_) + n * 8;
  for (int64_t k = 0; k < n; ++k) place(ids[k], current_, first_row + k * row_bytes_);
  current_->end += rec;
  return Status::Ok();
}

Status LogFile::append(const int64_t* ids, int64_t n, const uint8_t* rows) {
  for (int64_t a = 0; a < n; a += max_record_rows_) {
    const int64_t m = std::min(max_record_rows_, n - a);
    Status s = append_record(ids + a, m, rows + a * row_bytes_);
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

Status LogFile::Write(const int64_t* ids, int64_t n, const uint8_t* rows) {
  return WriteFrom(ids, n, rows, row_bytes_, nullptr);
}

Status LogFile::WriteFrom(const int64_t* ids, int64_t n, const uint8_t* src, int64_t src_stride,
                          const int64_t* src_rows) {
  Status s = check_ids(ids, n);
  if (!s.ok() || n == 0) return s;
  auto start = std::chrono::steady_clock::now();
  s = drain();  // one append in flight at a time; the staging block is reused
  const int64_t drained = elapsed_ns(start);
  start = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++times_.writes;
    times_.drain_ns += drained;
  }
  if (!s.ok()) return s;
  const int64_t rec = record_bytes(n, row_bytes_);
  if (n > max_record_rows_) {
    // Several records: synchronously, from contiguous rows.
    std::vector<uint8_t> gathered;
    const uint8_t* rows = src;
    if (src_rows != nullptr || src_stride != row_bytes_) {
      gathered.resize(static_cast<size_t>(n * row_bytes_));
      gather_rows(src, src_stride, src_rows, n, gathered.data(), row_bytes_);
      rows = gathered.data();
    }
    s = append(ids, n, rows);
  } else {
    s = make_room(rec);  // a new segment if this one is full
    if (!s.ok()) return s;
    const size_t id_bytes = static_cast<size_t>(n) * 8;
    staged_.resize(static_cast<size_t>(rec));
    LogHeader h{kLogMagic, static_cast<uint64_t>(n), static_cast<uint64_t>(row_bytes_), 0};
    std::memcpy(staged_.data(), &h, sizeof h);
    std::memcpy(staged_.data() + sizeof h, ids, id_bytes);
    gather_rows(src, src_stride, src_rows, n, staged_.data() + sizeof h + id_bytes, row_bytes_);
    staged_seg_ = current_;
    staged_off_ = current_->end;
    const int64_t first_row = current_->end + record_bytes(0, row_bytes_) + n * 8;
    for (int64_t k = 0; k < n; ++k) place(ids[k], current_, first_row + k * row_bytes_);
    current_->end += rec;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      staged_busy_ = true;
    }
    cv_.notify_all();
  }
  const int64_t staged = elapsed_ns(start);
  start = std::chrono::steady_clock::now();
  if (s.ok()) s = maybe_compact();
  std::lock_guard<std::mutex> lock(mutex_);
  times_.stage_ns += staged;
  times_.compact_ns += elapsed_ns(start);
  return s;
}

LogFile::WriteTimes LogFile::TakeWriteTimes() {
  std::lock_guard<std::mutex> lock(mutex_);
  WriteTimes t = times_;
  times_ = WriteTimes{};
  return t;
}

int64_t LogFile::log_bytes() const {
  int64_t total = 0;
  for (const auto& seg : segments_)
    if (seg) total += seg->end;
  return total;
}

int64_t LogFile::num_segments() const {
  int64_t count = 0;
  for (const auto& seg : segments_) count += seg != nullptr;
  return count;
}

Status LogFile::maybe_compact() {
  for (;;) {
    const int64_t garbage = log_bytes() - live_bytes_;
    if (garbage <= std::max(live_bytes_, segment_bytes_)) return Status::Ok();
    // The sealed segment with the largest share of stale bytes, if at least half of it is.
    Segment* victim = nullptr;
    double best = 0.5;
    for (const auto& seg : segments_) {
      if (!seg || seg.get() == current_ || seg->end == 0) continue;
      const double stale = 1.0 - static_cast<double>(seg->live) / static_cast<double>(seg->end);
      if (stale >= best) {
        best = stale;
        victim = seg.get();
      }
    }
    if (victim == nullptr) return Status::Ok();
    Status s = drain();
    if (!s.ok()) return s;
    s = compact(victim);
    if (!s.ok()) return s;
  }
}

Status LogFile::compact(Segment* seg) {
  // Its live rows are appended again (the newest copy of each), made durable, then the file
  // goes: a crash before the removal leaves an older copy that the newer one overrides.
  const int64_t header = record_bytes(0, row_bytes_);
  std::vector<int64_t> ids;
  std::vector<uint8_t> rows;
  int64_t moved = 0;
  auto flush_batch = [&]() -> Status {
    Status s = append(ids.data(), static_cast<int64_t>(ids.size()), rows.data());
    moved += static_cast<int64_t>(ids.size());
    ids.clear();
    rows.clear();
    return s;
  };
  for (int64_t off = 0; off < seg->end;) {
    LogHeader h;
    std::memcpy(&h, seg->map + off, sizeof h);
    const int64_t n = static_cast<int64_t>(h.n);
    const auto* rec_ids = reinterpret_cast<const int64_t*>(seg->map + off + header);
    const int64_t first_row = off + header + n * 8;
    for (int64_t k = 0; k < n; ++k) {
      const int64_t row_off = first_row + k * row_bytes_;
      const uint64_t here = ((static_cast<uint64_t>(seg->slot) << kOffsetBits) | static_cast<uint64_t>(row_off)) + 1;
      if (loc_[rec_ids[k]] != here) continue;
      ids.push_back(rec_ids[k]);
      rows.insert(rows.end(), seg->map + row_off, seg->map + row_off + row_bytes_);
      if (static_cast<int64_t>(ids.size()) == max_record_rows_) {
        Status s = flush_batch();
        if (!s.ok()) return s;
      }
    }
    off += record_bytes(n, row_bytes_);
  }
  if (!ids.empty()) {
    Status s = flush_batch();
    if (!s.ok()) return s;
  }
  // The file goes once a mark without it is durable (Open refuses a flushed segment that is
  // missing). Should the sync fail, the file stays: the next open replays it, and the newer copies
  // of its rows, if durable, override it.
  const std::string path = seg->path;
  drop_segment(seg, false);
  Status s = Sync();
  if (!s.ok()) return s;
  if (::unlink(path.c_str()) != 0) return Status::RuntimeError("cannot remove " + path + ": " + errno_text(errno));
  if (int err = fsync_dir(dir_)) return Status::RuntimeError("cannot sync " + dir_ + ": " + errno_text(err));
  ++compactions_;
  rows_compacted_ += moved;
  return Status::Ok();
}

void LogFile::drop_segment(Segment* seg, bool remove_file) {
  const uint32_t slot = seg->slot;  // (no row's location names it: its live rows were moved first)
  if (seg->map != nullptr) ::munmap(seg->map, static_cast<size_t>(seg->mapped));
  if (seg->fd >= 0) ::close(seg->fd);
  if (seg->direct_fd >= 0) ::close(seg->direct_fd);
  if (remove_file) ::unlink(seg->path.c_str());
  if (current_ == seg) current_ = nullptr;
  if (staged_seg_ == seg) staged_seg_ = nullptr;
  segments_[slot].reset();
  free_slots_.push_back(slot);
}

Status LogFile::Read(const int64_t* ids, int64_t n, uint8_t* out, const int64_t* out_rows, uint8_t* found) {
  Status s = check_ids(ids, n);
  if (!s.ok()) return s;
  std::mutex err_mutex;
  io_.run((n + kReadTask - 1) / kReadTask, [&](int64_t task) {
    const int64_t end = std::min(n, (task + 1) * kReadTask);
    for (int64_t k = task * kReadTask; k < end; ++k) {
      const uint64_t loc = loc_[ids[k]];
      found[k] = loc != 0;
      if (loc == 0) continue;
      const Segment* seg = segment_of(loc - 1);
      const int64_t off = static_cast<int64_t>((loc - 1) & kOffsetMask);
      uint8_t* dst = out + (out_rows ? out_rows[k] : k) * row_bytes_;
      if (seg == staged_seg_ && off >= staged_off_ && off < staged_off_ + static_cast<int64_t>(staged_.size())) {
        // Staged by the last Write: read from the staging block (it may not be in the file yet).
        std::memcpy(dst, staged_.data() + (off - staged_off_), static_cast<size_t>(row_bytes_));
        continue;
      }
      if (!direct_) {
        std::memcpy(dst, seg->map + off, static_cast<size_t>(row_bytes_));
        continue;
      }
      if (int err = pread_row_direct(seg->direct_fd, off, row_bytes_, dst)) {
        std::lock_guard<std::mutex> lock(err_mutex);
        if (s.ok()) s = Status::RuntimeError("cannot read (O_DIRECT) " + seg->path + " at offset " + std::to_string(off) +
                                             ": " + errno_text(err));
        return;
      }
    }
  });
  return s;
}

std::vector<int64_t> LogFile::WrittenIds(int64_t start, int64_t limit) const {
  std::vector<int64_t> out;
  if (limit == 0 || loc_ == nullptr) return out;
  for (int64_t id = std::max<int64_t>(0, start); id < num_rows_; ++id) {
    if (loc_[id] == 0) continue;
    out.push_back(id);
    if (limit > 0 && static_cast<int64_t>(out.size()) >= limit) break;
  }
  return out;
}

}  // namespace tieredemb
