#include "ssd/slot_file.h"

#include "ssd/file_io.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>

namespace tieredemb {

namespace {

constexpr int64_t kBitmapPage = 4096;        // bitmap bytes written back as one unit
constexpr int64_t kReadTask = 8;             // ids per read task: many reads in flight
constexpr int64_t kCopyTask = 512;           // rows per task of a copy into the mapping
constexpr int64_t kChunk = 64 << 10;         // data file bytes reserved (fallocate) at a time
}  // namespace

std::string SlotFile::io_error(const char* what, int64_t offset, int err) const {
  return std::string("cannot ") + what + " " + data_path_ + " at offset " + std::to_string(offset) + ": " +
         errno_text(err);
}

Status SlotFile::Open(const std::string& data_path, const std::string& bitmap_path, const std::string& log_path,
                      int64_t num_rows, int64_t row_bytes, int64_t slot_bytes, bool create, bool direct,
                      int io_threads, std::unique_ptr<SlotFile>* out) {
  if (num_rows <= 0) return Status::ValueError("num_rows " + std::to_string(num_rows) + " must be > 0");
  if (row_bytes <= 0 || slot_bytes < row_bytes)
    return Status::ValueError("row_bytes " + std::to_string(row_bytes) + " must be > 0 and <= slot_bytes " +
                              std::to_string(slot_bytes));
  if (num_rows > INT64_MAX / slot_bytes)
    return Status::ValueError("num_rows " + std::to_string(num_rows) + " x slot_bytes " +
                              std::to_string(slot_bytes) + " overflows a file offset");
  if (Status s = IoThreads::check_count(io_threads); !s.ok()) return s;
  std::unique_ptr<SlotFile> f(new SlotFile(io_threads));
  f->data_path_ = data_path;
  f->bitmap_path_ = bitmap_path;
  f->log_path_ = log_path;
  f->num_rows_ = num_rows;
  f->row_bytes_ = row_bytes;
  f->slot_bytes_ = slot_bytes;
  f->direct_ = direct;
  const int64_t data_size = num_rows * slot_bytes;
  const int64_t bitmap_size = (num_rows + 7) / 8;
  const int flags = O_RDWR | O_CLOEXEC | (create ? O_CREAT | O_TRUNC : 0);
  f->data_fd_ = ::open(data_path.c_str(), flags, 0644);
  if (f->data_fd_ < 0) return Status::RuntimeError("cannot open " + data_path + ": " + errno_text(errno));
  f->bitmap_fd_ = ::open(bitmap_path.c_str(), flags, 0644);
  if (f->bitmap_fd_ < 0) return Status::RuntimeError("cannot open " + bitmap_path + ": " + errno_text(errno));
  if (create) {
    // Sparse: no blocks are allocated until slots are written.
    if (::ftruncate(f->data_fd_, data_size) != 0)
      return Status::RuntimeError("cannot size " + data_path + " to " + std::to_string(data_size) +
                                  " bytes: " + errno_text(errno));
    if (::ftruncate(f->bitmap_fd_, bitmap_size) != 0)
      return Status::RuntimeError("cannot size " + bitmap_path + ": " + errno_text(errno));
    if (::fsync(f->data_fd_) != 0 || ::fsync(f->bitmap_fd_) != 0)
      return Status::RuntimeError("cannot sync " + data_path + ": " + errno_text(errno));
  }
  struct stat st;
  if (::fstat(f->data_fd_, &st) != 0) return Status::RuntimeError("cannot stat " + data_path + ": " + errno_text(errno));
  if (st.st_size != data_size)
    return Status::RuntimeError("corrupted: " + data_path + " has " + std::to_string(st.st_size) +
                                " bytes, expected " + std::to_string(data_size) + " (" + std::to_string(num_rows) +
                                " rows x " + std::to_string(slot_bytes) + " byte slots): truncated or not this table's");
  if (::fstat(f->bitmap_fd_, &st) != 0)
    return Status::RuntimeError("cannot stat " + bitmap_path + ": " + errno_text(errno));
  if (st.st_size != bitmap_size)
    return Status::RuntimeError("corrupted: " + bitmap_path + " has " + std::to_string(st.st_size) +
                                " bytes, expected " + std::to_string(bitmap_size) + " (1 bit per row of " +
                                std::to_string(num_rows) + "): truncated or not this table's");
  f->bitmap_.assign(static_cast<size_t>(bitmap_size), 0);
  if (int err = pread_full(f->bitmap_fd_, f->bitmap_.data(), bitmap_size, 0))
    return Status::RuntimeError("cannot read " + bitmap_path + ": " + errno_text(err));
  if (num_rows % 8 != 0 && (f->bitmap_.back() >> (num_rows % 8)) != 0)
    return Status::RuntimeError("corrupted: " + bitmap_path + " marks rows >= num_rows " + std::to_string(num_rows) +
                                " as written");
  f->dirty_pages_.assign(static_cast<size_t>((bitmap_size + kBitmapPage - 1) / kBitmapPage), 0);
  if (direct) {
    f->direct_fd_ = ::open(data_path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
    if (f->direct_fd_ < 0)
      return Status::RuntimeError("cannot open " + data_path + " with O_DIRECT (the filesystem may not support " +
                                  "direct I/O, e.g. tmpfs; use direct_reads=False): " + errno_text(errno));
  }
  void* map = ::mmap(nullptr, static_cast<size_t>(data_size), PROT_READ | PROT_WRITE, MAP_SHARED, f->data_fd_, 0);
  if (map == MAP_FAILED) return Status::RuntimeError("cannot map " + data_path + ": " + errno_text(errno));
  f->map_ = static_cast<uint8_t*>(map);
  f->map_size_ = data_size;
  ::madvise(map, static_cast<size_t>(data_size), MADV_RANDOM);  // rows are read one by one: no readahead
  f->reserved_.assign(static_cast<size_t>((data_size + kChunk - 1) / kChunk), 0);
  f->log_fd_ = ::open(log_path.c_str(), O_RDWR | O_CLOEXEC | O_CREAT | (create ? O_TRUNC : 0), 0644);
  if (f->log_fd_ < 0) return Status::RuntimeError("cannot open " + log_path + ": " + errno_text(errno));
  if (!create) {
    Status s = f->replay_log();
    if (!s.ok()) return s;
  }
  *out = std::move(f);
  return Status::Ok();
}

Status SlotFile::replay_log() {
  LogHeader h;
  struct stat st;
  if (::fstat(log_fd_, &st) != 0) return Status::RuntimeError("cannot stat " + log_path_ + ": " + errno_text(errno));
  if (st.st_size < static_cast<off_t>(sizeof h)) return Status::Ok();
  if (int err = pread_full(log_fd_, reinterpret_cast<uint8_t*>(&h), sizeof h, 0))
    return Status::RuntimeError("cannot read " + log_path_ + ": " + errno_text(err));
  if (h.magic != kLogMagic || h.row_bytes != static_cast<uint64_t>(row_bytes_) || h.n == 0 ||
      h.n > static_cast<uint64_t>(num_rows_) ||
      static_cast<uint64_t>(st.st_size) < sizeof h + h.n * (8 + h.row_bytes))
    return Status::Ok();  // empty, or cut short before its header was whole: its copy never began
  const int64_t n = static_cast<int64_t>(h.n);
  std::vector<uint8_t> payload(static_cast<size_t>(n * (8 + row_bytes_)));
  if (int err = pread_full(log_fd_, payload.data(), static_cast<int64_t>(payload.size()), sizeof h))
    return Status::RuntimeError("cannot read " + log_path_ + ": " + errno_text(err));
  const uint8_t* log_rows = payload.data() + n * 8;
  if (!record_intact(h, payload.data(), row_bytes_)) return Status::Ok();  // torn: its copy never began
  std::vector<int64_t> ids(static_cast<size_t>(n));
  std::memcpy(ids.data(), payload.data(), static_cast<size_t>(n) * 8);
  Status s = check_ids(ids.data(), n);
  if (!s.ok()) return Status::RuntimeError("corrupted: " + log_path_ + ": " + s.message);
  s = reserve(ids.data(), n);
  if (!s.ok()) return s;
  copy_in(ids.data(), n, log_rows);
  mark_written(ids.data(), n);
  replayed_ = n;
  return Sync();
}

SlotFile::~SlotFile() { Close(); }

Status SlotFile::Close() {
  Status s;
  if (map_ != nullptr) {
    ::munmap(map_, static_cast<size_t>(map_size_));
    map_ = nullptr;
  }
  for (int* fd : {&data_fd_, &direct_fd_, &bitmap_fd_, &log_fd_}) {
    if (*fd >= 0 && ::close(*fd) != 0 && s.ok())
      s = Status::RuntimeError("cannot close " + data_path_ + ": " + errno_text(errno));
    *fd = -1;
  }
  return s;
}

Status SlotFile::check_ids(const int64_t* ids, int64_t n) const {
  if (data_fd_ < 0) return Status::RuntimeError(data_path_ + ": the slot file is closed");
  for (int64_t k = 0; k < n; ++k) {
    if (ids[k] < 0 || ids[k] >= num_rows_)
      return Status::IndexError("id " + std::to_string(ids[k]) + " out of range [0, " + std::to_string(num_rows_) + ")");
  }
  return Status::Ok();
}

Status SlotFile::Read(const int64_t* ids, int64_t n, uint8_t* out, const int64_t* out_rows, uint8_t* found) {
  Status s = check_ids(ids, n);
  if (!s.ok()) return s;
  std::mutex err_mutex;
  const int64_t num_tasks = (n + kReadTask - 1) / kReadTask;
  io_.run(num_tasks, [&](int64_t task) {
    const int64_t end = std::min(n, (task + 1) * kReadTask);
    for (int64_t k = task * kReadTask; k < end; ++k) {
      const int64_t id = ids[k];
      found[k] = is_written(id);
      if (!found[k]) continue;
      const int64_t off = id * slot_bytes_;
      uint8_t* dst = out + (out_rows ? out_rows[k] : k) * row_bytes_;
      int err = 0;
      if (direct_) {
        err = pread_row_direct(direct_fd_, off, row_bytes_, dst);
      } else {
        std::memcpy(dst, map_ + off, static_cast<size_t>(row_bytes_));
      }
      if (err) {
        std::lock_guard<std::mutex> lock(err_mutex);
        if (s.ok()) s = Status::RuntimeError(io_error(direct_ ? "read (O_DIRECT)" : "read", off, err));
        return;
      }
    }
  });
  return s;
}

Status SlotFile::Write(const int64_t* ids, int64_t n, const uint8_t* rows) {
  Status s = check_ids(ids, n);
  if (!s.ok() || n == 0) return s;
  s = reserve(ids, n);
  if (s.ok()) s = write_log(ids, n, rows);
  if (!s.ok()) return s;
  copy_in(ids, n, rows);
  mark_written(ids, n);
  return s;
}

Status SlotFile::reserve(const int64_t* ids, int64_t n) {
  // The chunks these rows touch that have no blocks yet, reserved run by run of consecutive
  // chunks: a full disk fails here, before any slot changes, instead of faulting in a copy.
  std::vector<int64_t> chunks;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t off = ids[k] * slot_bytes_;
    for (int64_t c = off / kChunk; c <= (off + row_bytes_ - 1) / kChunk; ++c)
      if (!reserved_[static_cast<size_t>(c)]) chunks.push_back(c);
  }
  if (chunks.empty()) return Status::Ok();
  std::sort(chunks.begin(), chunks.end());
  chunks.erase(std::unique(chunks.begin(), chunks.end()), chunks.end());
  for (size_t a = 0; a < chunks.size();) {
    size_t b = a + 1;
    while (b < chunks.size() && chunks[b] == chunks[b - 1] + 1) ++b;
    const int64_t off = chunks[a] * kChunk;
    const int64_t len = std::min(chunks[b - 1] * kChunk + kChunk, map_size_) - off;
    if (::fallocate(data_fd_, 0, off, len) != 0) {
      const int err = errno;
      if (err != EOPNOTSUPP) return Status::RuntimeError(io_error("reserve space in", off, err));
    }
    for (size_t k = a; k < b; ++k) reserved_[static_cast<size_t>(chunks[k])] = 1;
    a = b;
  }
  return Status::Ok();
}

Status SlotFile::write_log(const int64_t* ids, int64_t n, const uint8_t* rows) {
  // One record at offset 0: the log holds the latest write only.
  if (int err = write_record(log_fd_, 0, ids, n, rows, row_bytes_))
    return Status::RuntimeError("cannot write " + log_path_ + ": " + errno_text(err));
  return Status::Ok();
}

void SlotFile::copy_in(const int64_t* ids, int64_t n, const uint8_t* rows) {
  io_.run((n + kCopyTask - 1) / kCopyTask, [&](int64_t task) {
    const int64_t end = std::min(n, (task + 1) * kCopyTask);
    for (int64_t k = task * kCopyTask; k < end; ++k)
      std::memcpy(map_ + ids[k] * slot_bytes_, rows + k * row_bytes_, static_cast<size_t>(row_bytes_));
  });
}

void SlotFile::mark_written(const int64_t* ids, int64_t n) {
  std::lock_guard<std::mutex> lock(bitmap_mutex_);
  for (int64_t k = 0; k < n; ++k) {
    const int64_t id = ids[k];
    __atomic_fetch_or(&bitmap_[id >> 3], static_cast<uint8_t>(1u << (id & 7)), __ATOMIC_RELEASE);
    dirty_pages_[(id >> 3) / kBitmapPage] = 1;
  }
}

Status SlotFile::Sync() {
  if (data_fd_ < 0) return Status::RuntimeError(data_path_ + ": the slot file is closed");
  std::lock_guard<std::mutex> sync_lock(sync_mutex_);
  // Snapshot the changed bitmap pages first: every bit in them stands for a row whose
  // pwrite returned, so the fdatasync below makes those rows durable before their bits.
  std::vector<int64_t> pages;
  std::vector<uint8_t> copy;
  {
    std::lock_guard<std::mutex> lock(bitmap_mutex_);
    for (size_t p = 0; p < dirty_pages_.size(); ++p) {
      if (!dirty_pages_[p]) continue;
      dirty_pages_[p] = 0;
      pages.push_back(static_cast<int64_t>(p));
      const int64_t a = static_cast<int64_t>(p) * kBitmapPage;
      const int64_t b = std::min<int64_t>(a + kBitmapPage, static_cast<int64_t>(bitmap_.size()));
      copy.insert(copy.end(), bitmap_.begin() + a, bitmap_.begin() + b);
    }
  }
  auto fail = [&](const std::string& msg) {
    std::lock_guard<std::mutex> lock(bitmap_mutex_);
    for (int64_t p : pages) dirty_pages_[static_cast<size_t>(p)] = 1;
    return Status::RuntimeError(msg);
  };
  if (::msync(map_, static_cast<size_t>(map_size_), MS_SYNC) != 0)
    return fail("cannot msync " + data_path_ + ": " + errno_text(errno));
  if (::fdatasync(data_fd_) != 0) return fail("cannot fdatasync " + data_path_ + ": " + errno_text(errno));
  size_t pos = 0;
  for (int64_t p : pages) {
    const int64_t a = p * kBitmapPage;
    const int64_t len = std::min<int64_t>(kBitmapPage, static_cast<int64_t>(bitmap_.size()) - a);
    if (int err = pwrite_full(bitmap_fd_, copy.data() + pos, len, a))
      return fail("cannot write " + bitmap_path_ + ": " + errno_text(err));
    pos += static_cast<size_t>(len);
  }
  if (!pages.empty() && ::fdatasync(bitmap_fd_) != 0)
    return fail("cannot fdatasync " + bitmap_path_ + ": " + errno_text(errno));
  return Status::Ok();
}

std::vector<int64_t> SlotFile::WrittenIds(int64_t start, int64_t limit) const {
  std::vector<int64_t> out;
  if (limit == 0) return out;
  for (int64_t id = std::max<int64_t>(0, start); id < num_rows_;) {
    if ((id & 7) == 0 && __atomic_load_n(&bitmap_[id >> 3], __ATOMIC_ACQUIRE) == 0) {
      id += 8;
      continue;
    }
    if (is_written(id)) {
      out.push_back(id);
      if (limit > 0 && static_cast<int64_t>(out.size()) >= limit) break;
    }
    ++id;
  }
  return out;
}

int64_t SlotFile::num_written() const {
  int64_t count = 0;
  for (size_t i = 0; i < bitmap_.size(); ++i) count += __builtin_popcount(__atomic_load_n(&bitmap_[i], __ATOMIC_RELAXED));
  return count;
}

}  // namespace tieredemb
