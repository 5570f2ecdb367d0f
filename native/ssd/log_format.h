// The log store's on-disk names and its row locations, shared by log_file.cc (writes, reads,
// compaction) and log_durable.cc (open, the flush mark, Sync, Checkpoint). Internal to LogFile.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <string>

namespace tieredemb {
namespace log_format {

// A row's location: (slot of its segment << kOffsetBits | byte offset) + 1; 0: never written.
inline constexpr uint64_t kOffsetBits = 40;
inline constexpr uint64_t kOffsetMask = (uint64_t{1} << kOffsetBits) - 1;
inline constexpr size_t kMaxSlot = (size_t{1} << (64 - kOffsetBits)) - 2;  // (the +1 of a location must not wrap)

inline std::string segment_name(uint32_t seq) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "seg-%010u.log", seq);
  return buf;
}

// 0, or the errno of opening or syncing the directory.
inline int fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno;
  int err = ::fsync(fd) != 0 ? errno : 0;
  ::close(fd);
  return err;
}

}  // namespace log_format
}  // namespace tieredemb
