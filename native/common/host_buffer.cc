#include "common/host_buffer.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace tieredemb {

HostBuffer::~HostBuffer() {
  if (data_ != nullptr) munmap(data_, bytes_);
}

std::string HostBuffer::allocate(size_t bytes, size_t populate_bytes, size_t huge_bytes) {
  if (data_ != nullptr) munmap(data_, bytes_);
  data_ = nullptr;
  bytes_ = 0;
  const size_t len = bytes == 0 ? 1 : bytes;
  populate_bytes = std::min(populate_bytes, bytes);
  huge_bytes = std::min(huge_bytes, bytes);
  // Reserved lazily (MAP_NORESERVE) unless all of it is faulted in now anyway.
  const int lazy = populate_bytes < bytes ? MAP_NORESERVE : 0;
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | lazy, -1, 0);
  if (p == MAP_FAILED) {
    return "cannot reserve " + std::to_string(bytes) + " bytes of host memory: " + std::strerror(errno);
  }
  // Advice before the first touch, so populating already gets huge pages. Both are advisory:
  // where THP is off or MADV_POPULATE_WRITE is unknown (before Linux 5.14), pages are touched.
  if (huge_bytes > 0) madvise(p, huge_bytes, MADV_HUGEPAGE);
  if (populate_bytes > 0) {
#ifdef MADV_POPULATE_WRITE
    bool done = madvise(p, populate_bytes, MADV_POPULATE_WRITE) == 0;
#else
    bool done = false;
#endif
    if (!done) {
      volatile char* bytes_ptr = static_cast<volatile char*>(p);
      for (size_t off = 0; off < populate_bytes; off += 4096) bytes_ptr[off] = 0;
    }
  }
  data_ = p;
  bytes_ = len;
  return {};
}

}  // namespace tieredemb
