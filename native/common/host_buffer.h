// Zero-filled host memory reserved lazily: an anonymous MAP_NORESERVE mapping, so a buffer
// for a 10^9-row table costs address space only until rows are touched (or a prefix of it is
// faulted in at once: a cache's regular slots, not its rarely used overflow slots).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace tieredemb {

class HostBuffer {
 public:
  HostBuffer() = default;
  ~HostBuffer();
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  // Maps `bytes` zero bytes. Returns an error message, empty on success.
  // The first populate_bytes are faulted in now (a cache that fills up anyway then pays no page
  // faults in use); the rest stay reserved lazily. The first huge_bytes are advised to
  // transparent huge pages, so random row access misses the TLB far less; a touched row then
  // makes its whole 2 MiB resident, so only for a part that is touched densely or fits in memory.
  std::string allocate(size_t bytes, size_t populate_bytes = 0, size_t huge_bytes = 0);
  // The mapping (null before allocate() or after a failed one).
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// A bit per row over a lazily mapped buffer, all clear at first; bit i is bit i % 64 of word i / 64.
class Bitmap {
 public:
  // Maps bits [0, bits). Returns an error message, empty on success.
  std::string allocate(int64_t bits) { return buf_.allocate(static_cast<size_t>((bits + 63) / 64) * 8 + 8); }
  bool test(int64_t i) const { return (words()[i >> 6] >> (i & 63)) & 1; }
  void set(int64_t i) { words()[i >> 6] |= uint64_t{1} << (i & 63); }
  void clear(int64_t i) { words()[i >> 6] &= ~(uint64_t{1} << (i & 63)); }
  uint64_t* words() const { return static_cast<uint64_t*>(buf_.data()); }

 private:
  HostBuffer buf_;
};

}  // namespace tieredemb
