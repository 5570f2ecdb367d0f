// File helpers shared by the native SSD backends (slot_file.cc, log_file.cc, log_durable.cc): full
// pread/pwrite loops, aligned buffers for O_DIRECT, errno text, and the batch record both
// write (a header, n int64 ids, n rows) with its checksum.
#pragma once

#include <fcntl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

namespace tieredemb {

constexpr uint64_t kLogMagic = 0x31676f6c6f646572ULL;  // "redolog1"

// The redo log: this header, then n int64 ids, then n rows of row_bytes.
struct LogHeader {
  uint64_t magic, n, row_bytes, checksum;
};

// A 64-bit checksum of a byte range: four independent multiply-rotate lanes over 8-byte
// words (about 10 GB/s), merged at the end. It detects a log record cut short by a crash.
inline uint64_t checksum(const uint8_t* p, size_t len, uint64_t seed) {
  constexpr uint64_t kMul1 = 0x9E3779B185EBCA87ULL, kMul2 = 0xC2B2AE3D27D4EB4FULL;
  auto mix = [](uint64_t h, uint64_t w) {
    h += w * kMul2;
    h = (h << 31) | (h >> 33);
    return h * kMul1;
  };
  uint64_t lane[4] = {seed + kMul1, seed ^ kMul2, seed - kMul1, ~seed};
  size_t i = 0;
  for (; i + 32 <= len; i += 32) {
    uint64_t w[4];
    std::memcpy(w, p + i, 32);
    for (int k = 0; k < 4; ++k) lane[k] = mix(lane[k], w[k]);
  }
  uint64_t h = len * kMul1;
  for (int k = 0; k < 4; ++k) h = mix(h ^ lane[k], static_cast<uint64_t>(k));
  for (; i < len; ++i) h = mix(h, p[i]);
  return h ^ (h >> 29);
}

struct AlignedBuffer {
  void* p = nullptr;
  size_t size = 0;
  ~AlignedBuffer() { free(p); }
  uint8_t* get(size_t n) {
    if (n > size) {
      free(p);
      p = nullptr;
      size = 0;
      if (posix_memalign(&p, 4096, n) != 0) return nullptr;
      size = n;
    }
    return static_cast<uint8_t*>(p);
  }
};

// pread/pwrite until done; returns 0 or an errno (EIO for an unexpected end of file).
// pread_full is done once `need` bytes were read: an O_DIRECT read of the last slot of an
// unpadded file asks for whole sectors past its end and gets a short read.
inline int pread_full(int fd, uint8_t* buf, int64_t len, int64_t off, int64_t need = -1) {
  if (need < 0) need = len;
  for (int64_t got = 0; got < need;) {
    ssize_t r = ::pread(fd, buf, static_cast<size_t>(len), off);
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (r == 0) return EIO;
    buf += r;
    len -= r;
    off += r;
    got += r;
  }
  return 0;
}

inline int pwrite_full(int fd, const uint8_t* buf, int64_t len, int64_t off) {
  while (len > 0) {
    ssize_t r = ::pwrite(fd, buf, static_cast<size_t>(len), off);
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    buf += r;
    len -= r;
    off += r;
  }
  return 0;
}

inline std::string errno_text(int err) { return std::string(strerror(err)) + " (errno " + std::to_string(err) + ")"; }


// Reads the row_bytes at byte `off` through an O_DIRECT descriptor into dst: the 512-byte
// sectors that enclose them go to this thread's aligned buffer (the last row of an unpadded
// file asks for sectors past its end and gets a short read). Returns 0 or an errno.
inline int pread_row_direct(int fd, int64_t off, int64_t row_bytes, uint8_t* dst) {
  constexpr int64_t kSector = 512;
  thread_local AlignedBuffer buffer;
  const int64_t start = off & ~(kSector - 1);
  const int64_t len = ((off + row_bytes + kSector - 1) & ~(kSector - 1)) - start;
  uint8_t* buf = buffer.get(static_cast<size_t>(len));
  if (buf == nullptr) return ENOMEM;
  if (int err = pread_full(fd, buf, len, start, off + row_bytes - start)) return err;
  std::memcpy(dst, buf + (off - start), static_cast<size_t>(row_bytes));
  return 0;
}

// Writes one batch record (header, ids, rows) at offset `off` as one gathered write, resumed
// where a partial write stopped. Returns 0 or an errno.
inline int write_record(int fd, int64_t off, const int64_t* ids, int64_t n, const uint8_t* rows, int64_t row_bytes) {
  const size_t id_bytes = static_cast<size_t>(n) * 8, row_total = static_cast<size_t>(n * row_bytes);
  const auto* id_ptr = reinterpret_cast<const uint8_t*>(ids);
  LogHeader h{kLogMagic, static_cast<uint64_t>(n), static_cast<uint64_t>(row_bytes),
              checksum(rows, row_total, checksum(id_ptr, id_bytes, static_cast<uint64_t>(n)))};
  const uint8_t* parts[3] = {reinterpret_cast<const uint8_t*>(&h), id_ptr, rows};
  const size_t sizes[3] = {sizeof h, id_bytes, row_total};
  int64_t done = 0;
  for (;;) {
    struct iovec iov[3];
    int count = 0;
    int64_t skip = done;
    for (int k = 0; k < 3; ++k) {
      if (skip >= static_cast<int64_t>(sizes[k])) {
        skip -= static_cast<int64_t>(sizes[k]);
        continue;
      }
      iov[count++] = {const_cast<uint8_t*>(parts[k]) + skip, sizes[k] - static_cast<size_t>(skip)};
      skip = 0;
    }
    if (count == 0) return 0;
    ssize_t r = ::pwritev(fd, iov, count, off + done);
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    done += r;
  }
}

// Whether the record whose header is `h` holds its checksum (payload: ids then rows).
inline bool record_intact(const LogHeader& h, const uint8_t* payload, int64_t row_bytes) {
  const size_t id_bytes = static_cast<size_t>(h.n) * 8;
  return checksum(payload + id_bytes, static_cast<size_t>(h.n) * static_cast<size_t>(row_bytes),
                  checksum(payload, id_bytes, h.n)) == h.checksum;
}

inline int64_t record_bytes(int64_t n, int64_t row_bytes) {
  return static_cast<int64_t>(sizeof(LogHeader)) + n * (8 + row_bytes);
}

}  // namespace tieredemb
