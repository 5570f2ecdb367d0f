// LogFile, opening and durability: Open (the segments replayed from the flush mark), the mark
// written by Sync, and Checkpoint. The rest of LogFile is in log_file.cc; the layout in log_file.h.
#include "ssd/log_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "ssd/file_io.h"
#include "ssd/log_format.h"

namespace tieredemb {

namespace {

constexpr uint64_t kMarkMagic1 = 0x316b72616d676f6cULL;  // "logmark1": the newest segment and its end
constexpr uint64_t kMarkMagic2 = 0x326b72616d676f6cULL;  // "logmark2": every segment and its end
constexpr int64_t kMaxMarkBytes = int64_t{1} << 30;

using log_format::fsync_dir;
using log_format::kOffsetMask;
using log_format::segment_name;

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

bool parse_segment_name(const char* name, uint32_t* seq) {
  unsigned v = 0;
  int used = 0;
  if (std::sscanf(name, "seg-%10u.log%n", &v, &used) != 1 || name[used] != '\0' || std::strlen(name) != 18) return false;
  *seq = v;
  return true;
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

}  // namespace tieredemb
