#include "ssd/log_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>

#include "ssd/file_io.h"
#include "common/row_moves.h"

namespace tieredemb {

namespace {

constexpr int64_t kReadTask = 8;  // ids per read task: many reads in flight
constexpr uint64_t kMarkMagic1 = 0x316b72616d676f6cULL;  // "logmark1": the newest segment and its end
constexpr uint64_t kMarkMagic2 = 0x326b72616d676f6cULL;  // "logmark2": every segment and its end
constexpr uint64_t kOffsetBits = 40;
constexpr uint64_t kOffsetMask = (uint64_t{1} << kOffsetBits) - 1;
constexpr size_t kMaxSlot = (size_t{1} << (64 - kOffsetBits)) - 2;  // (the +1 of a location must not wrap)
constexpr int64_t kMaxMarkBytes = int64_t{1} << 30;

// The flush mark, as read at open: how long each segment was when the log was last durable.
// logmark2 (written now): {magic, n, n x {seq, end}, checksum}, every segment with records, in
// seq order. logmark1 (older tables): {magic, seq, end, checksum}, the newest segment only, every
// older one flushed whole (its length then was not kept).
struct FlushedLog {
  std::vector<std::pair<uint32_t, int64_t>> ends;  // (seq, flushed end), in seq order
  uint32_t whole_below = 0;                        // logmark1: segments before it were flushed whole
  // How far the segment `seq` (of `capacity` bytes now) was flushed: 0 if not at all.
  int64_t end_of(uint32_t seq, int64_t capacity) const {
    if (seq < whole_below) return capacity;
    auto it = std::lower_bound(ends.begin(), ends.end(), std::make_pair(seq, int64_t{0}));
    return it != ends.end() && it->first == seq ? it->second : 0;
  }
};

// Parses a mark file's bytes; an empty FlushedLog (trust nothing) for one that is damaged.
FlushedLog parse_mark(const std::vector<uint8_t>& bytes) {
  FlushedLog out;
  const size_t words = bytes.size() / 8;
  if (bytes.size() % 8 != 0 || words < 3) return out;
  std::vector<uint64_t> w(words);
  std::memcpy(w.data(), bytes.data(), bytes.size());
  if (checksum(bytes.data(), bytes.size() - 8, w[0]) != w.back()) return out;
  if (w[0] == kMarkMagic1 && words == 4) {
    if (w[2] > 0 && w[1] <= UINT32_MAX) {
      out.whole_below = static_cast<uint32_t>(w[1]);
      out.ends.emplace_back(static_cast<uint32_t>(w[1]), static_cast<int64_t>(w[2]));
    }
    return out;
  }
  if (w[0] != kMarkMagic2 || w[1] != (words - 3) / 2 || words != 3 + 2 * w[1]) return out;
  for (uint64_t k = 0; k < w[1]; ++k) {
    const uint64_t seq = w[2 + 2 * k], end = w[3 + 2 * k];
    if (seq > UINT32_MAX || end > kOffsetMask || (!out.ends.empty() && seq <= out.ends.back().first))
      return FlushedLog{};
    out.ends.emplace_back(static_cast<uint32_t>(seq), static_cast<int64_t>(end));
  }
  return out;
}

std::string segment_name(uint32_t seq) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "seg-%010u.log", seq);
  return buf;
}

bool parse_segment_name(const char* name, uint32_t* seq) {
  unsigned v = 0;
  int used = 0;
  if (std::sscanf(name, "seg-%10u.log%n", &v, &used) != 1 || name[used] != '\0' || std::strlen(name) != 18) return false;
  *seq = v;
  return true;
}

int fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno;
  int err = ::fsync(fd) != 0 ? errno : 0;
  ::close(fd);
  return err;
}

}  // namespace

Status LogFile::Open(const std::string& dir, int64_t num_rows, int64_t row_bytes, int64_t segment_bytes, bool create,
                     bool direct, int io_threads, std::unique_ptr<LogFile>* out) {
  if (num_rows <= 0 || num_rows > INT64_MAX / 8)  // (the row index: 8 bytes a row)
    return Status::ValueError("num_rows " + std::to_string(num_rows) + " must be in [1, 2^60)");
  if (row_bytes <= 0) return Status::ValueError("row_bytes " + std::to_string(row_bytes) + " must be > 0");
  if (segment_bytes < 2 * record_bytes(1, row_bytes) || segment_bytes < (64 << 10) ||
      segment_bytes > static_cast<int64_t>(kOffsetMask))
    return Status::ValueError("segment_bytes " + std::to_string(segment_bytes) +
                              " must be in [64 KiB, 2^40) and hold two records of one row");
  if (Status s = IoThreads::check_count(io_threads); !s.ok()) return s;
  std::unique_ptr<LogFile> f(new LogFile(io_threads));
  f->dir_ = dir;
  f->num_rows_ = num_rows;
  f->row_bytes_ = row_bytes;
  f->segment_bytes_ = segment_bytes;
  f->max_record_rows_ = std::max<int64_t>(1, (segment_bytes / 2 - record_bytes(0, row_bytes)) / (8 + row_bytes));
  f->direct_ = direct;
  void* loc = ::mmap(nullptr, static_cast<size_t>(num_rows) * 8, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (loc == MAP_FAILED)
    return Status::RuntimeError("cannot reserve the row index of " + std::to_string(num_rows) + " rows: " +
                                errno_text(errno));
  f->loc_ = static_cast<uint64_t*>(loc);

  std::vector<uint32_t> seqs;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return Status::RuntimeError("cannot list " + dir + ": " + errno_text(errno));
  for (dirent* e; (e = ::readdir(d)) != nullptr;) {
    uint32_t seq;
    if (parse_segment_name(e->d_name, &seq)) seqs.push_back(seq);
  }
  ::closedir(d);
  std::sort(seqs.begin(), seqs.end());
  const std::string mark_path = dir + "/flushed";
  if (create) {
    // A creation cut short may have left files: a new table starts from nothing.
    for (uint32_t seq : seqs) ::unlink((dir + "/" + segment_name(seq)).c_str());
    ::unlink(mark_path.c_str());
    f->writer_ = std::thread([p = f.get()] { p->writer_loop(); });
    *out = std::move(f);
    return Status::Ok();
  }
  // The mark saves checksum work, and says which flushed records must be there. One that is
  // missing or damaged trusts nothing (every record is replayed while its checksum holds).
  FlushedLog flushed;
  int mfd = ::open(mark_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (mfd >= 0) {
    struct stat st;
    int err = ::fstat(mfd, &st) != 0 ? errno : 0;
    if (err == 0 && st.st_size > kMaxMarkBytes) err = EFBIG;
    std::vector<uint8_t> bytes(err == 0 ? static_cast<size_t>(st.st_size) : 0);
    if (err == 0) err = pread_full(mfd, bytes.data(), static_cast<int64_t>(bytes.size()), 0);
    ::close(mfd);
    if (err != 0) return Status::RuntimeError("cannot read " + mark_path + ": " + errno_text(err));
    flushed = parse_mark(bytes);
  } else if (errno != ENOENT) {
    return Status::RuntimeError("cannot open " + mark_path + ": " + errno_text(errno));
  }
  // A flushed segment that is gone was lost, not cut by a crash: compaction removes a segment only
  // once a mark without it is durable.
  for (const auto& [seq, end] : flushed.ends) {
    if (end > 0 && !std::binary_search(seqs.begin(), seqs.end(), seq))
      return Status::RuntimeError("corrupted: " + dir + ": the flushed log holds " + segment_name(seq) + " (" +
                                  std::to_string(end) + " bytes, the mark in " + mark_path + "), which is missing");
  }
  for (uint32_t seq : seqs) {
    Segment* seg;
    Status s = f->open_segment(seq, false, &seg);
    if (!s.ok()) return s;
    s = f->replay(seg, flushed.end_of(seq, seg->capacity));
    if (!s.ok()) return s;
    // A reopened table never appends to an old segment (a checkpoint may link to it).
    if (seg->end == 0) {
      f->drop_segment(seg, true);
    } else if (Status t = f->seal(seg); !t.ok()) {
      return t;
    }
  }
  if (!seqs.empty()) f->next_seq_ = uint64_t{seqs.back()} + 1;
  // Records recovered past the mark are in the page cache only: make them durable now.
  if (f->replayed_ > 0) {
    Status s = f->Sync();
    if (!s.ok()) return s;
  }
  f->writer_ = std::thread([p = f.get()] { p->writer_loop(); });
  *out = std::move(f);
  return Status::Ok();
}

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
    h->checksum = checksum(payload + n * 8, static_cast<size_t>(n * row_bytes_),
                           checksum(payload, static_cast<size_t>(n) * 8, h->n));
    int err = pwrite_full(staged_seg_->fd, staged_.data(), static_cast<int64_t>(staged_.size()), staged_off_);
    lock.lock();
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

Status LogFile::replay(Segment* seg, int64_t flushed) {
  int64_t off = 0, trusted_end = 0;
  const int64_t header = record_bytes(0, row_bytes_);
  while (off + header <= seg->capacity) {
    LogHeader h;
    std::memcpy(&h, seg->map + off, sizeof h);
    if (h.magic != kLogMagic || h.row_bytes != static_cast<uint64_t>(row_bytes_) || h.n == 0 ||
        h.n > static_cast<uint64_t>(seg->capacity))
      break;
    const int64_t n = static_cast<int64_t>(h.n), rec = record_bytes(n, row_bytes_);
    if (off + rec > seg->capacity) break;
    const uint8_t* payload = seg->map + off + header;
    const bool trusted = off + rec <= flushed;
    if (!trusted && !record_intact(h, payload, row_bytes_)) break;  // cut by a crash: the log ends here
    const auto* ids = reinterpret_cast<const int64_t*>(payload);
    Status s = check_ids(ids, n);
    if (!s.ok()) {
      if (trusted) return Status::RuntimeError("corrupted: " + seg->path + " at offset " + std::to_string(off) + ": " +
                                               s.message);
      break;
    }
    for (int64_t k = 0; k < n; ++k) place(ids[k], seg, off + header + n * 8 + k * row_bytes_);
    if (trusted) trusted_end = off + rec; else replayed_ += n;
    off += rec;
  }
  // Every flushed record must be there: a log that ends before (a file cut, a record damaged) is
  // not a crash's.
  if (off < flushed)
    return Status::RuntimeError("corrupted: " + seg->path + ": its records end at byte " + std::to_string(off) +
                                ", before the flushed log's " + std::to_string(flushed) +
                                " (the file is cut or damaged)");
  seg->end = off;
  seg->synced = trusted_end;
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
  s = drain();  // one append in flight at a time; the staging block is reused
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
  if (!s.ok()) return s;
  return maybe_compact();
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

Status LogFile::write_mark(const std::string& dir) const {
  // Every segment with records and its end, written whole to a new file that then replaces the
  // mark: a crash or a power loss leaves the old mark or the new one, never a torn one.
  std::vector<std::pair<uint32_t, int64_t>> ends;  // (in the order of their numbers, as the mark has them)
  for (const auto& seg : segments_)
    if (seg && seg->end > 0) ends.emplace_back(seg->seq, seg->end);
  std::sort(ends.begin(), ends.end());
  std::vector<uint64_t> w{kMarkMagic2, 0};
  for (const auto& [seq, end] : ends) {
    w.push_back(seq);
    w.push_back(static_cast<uint64_t>(end));
  }
  w[1] = (w.size() - 2) / 2;
  w.push_back(checksum(reinterpret_cast<const uint8_t*>(w.data()), w.size() * 8, kMarkMagic2));
  const std::string path = dir + "/flushed", tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::RuntimeError("cannot create " + tmp + ": " + errno_text(errno));
  int err = pwrite_full(fd, reinterpret_cast<const uint8_t*>(w.data()), static_cast<int64_t>(w.size() * 8), 0);
  if (err == 0 && ::fdatasync(fd) != 0) err = errno;
  ::close(fd);
  if (err == 0 && ::rename(tmp.c_str(), path.c_str()) != 0) err = errno;
  if (err == 0) err = fsync_dir(dir);
  if (err != 0) return Status::RuntimeError("cannot write " + path + ": " + errno_text(err));
  return Status::Ok();
}

Status LogFile::Sync() {
  if (loc_ == nullptr) return Status::RuntimeError(dir_ + ": the log store is closed");
  if (writer_.joinable()) {
    Status s = drain();
    if (!s.ok()) return s;
  }
  for (auto& seg : segments_) {
    if (!seg) continue;
    if (seg->end > seg->synced || seg->synced == 0) {
      if (::fdatasync(seg->fd) != 0)
        return Status::RuntimeError("cannot fdatasync " + seg->path + ": " + errno_text(errno));
      seg->synced = std::max<int64_t>(seg->end, 1);  // 1: the file itself is durable
    }
  }
  return write_mark(dir_);  // (it syncs the directory: new segments' entries too)
}

Status LogFile::Checkpoint(const std::string& dst_dir) {
  Status s = Sync();
  if (!s.ok()) return s;
  for (auto& seg : segments_) {
    if (!seg) continue;
    const std::string dst = dst_dir + "/" + segment_name(seg->seq);
    if (::link(seg->path.c_str(), dst.c_str()) == 0) continue;
    if (errno != EXDEV) return Status::RuntimeError("cannot link " + seg->path + " to " + dst + ": " + errno_text(errno));
    // Another filesystem: copy the records (the copy's end is its capacity: never appended).
    int out = ::open(dst.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (out < 0) return Status::RuntimeError("cannot create " + dst + ": " + errno_text(errno));
    int err = pwrite_full(out, seg->map, seg->end, 0);
    if (err == 0 && ::fsync(out) != 0) err = errno;
    ::close(out);
    if (err != 0) return Status::RuntimeError("cannot copy " + seg->path + " to " + dst + ": " + errno_text(err));
  }
  s = write_mark(dst_dir);
  if (!s.ok()) return s;
  // The linked files are never appended to again.
  if (current_ != nullptr) {
    current_->capacity = current_->end;
    current_ = nullptr;
  }
  return Status::Ok();
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
