#include "common/row_moves.h"

#include <cstring>

#include "common/thread_pool.h"

namespace tieredemb {

namespace {

// Rows are scattered over pools far larger than the caches: copies prefetch every line of the
// rows a few ahead, so they overlap their memory latencies.
constexpr int64_t kRowsAhead = 6;

void prefetch_bytes(const void* p, int64_t bytes, int rw) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) {
    if (rw) {
      __builtin_prefetch(c + off, 1);
    } else {
      __builtin_prefetch(c + off, 0);
    }
  }
}

}  // namespace

void copy_rows(const float* src, const int64_t* src_rows, float* dst, const int64_t* dst_rows, int64_t n,
               int64_t width) {
  const int64_t bytes = static_cast<int64_t>(sizeof(float)) * width;
  parallel_for(n, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (i + kRowsAhead < end) {
        prefetch_bytes(src + src_rows[i + kRowsAhead] * width, bytes, 0);
        prefetch_bytes(dst + dst_rows[i + kRowsAhead] * width, bytes, 1);
      }
      std::memcpy(dst + dst_rows[i] * width, src + src_rows[i] * width, static_cast<size_t>(bytes));
    }
  });
}

void gather_rows(const uint8_t* src, int64_t src_stride, const int64_t* src_rows, int64_t n, uint8_t* dst,
                 int64_t row_bytes) {
  parallel_for(n, 1024, [&](int64_t begin, int64_t end) {
    auto row = [&](int64_t k) { return src + (src_rows != nullptr ? src_rows[k] : k) * src_stride; };
    for (int64_t k = begin; k < end; ++k) {
      if (k + kRowsAhead < end) prefetch_bytes(row(k + kRowsAhead), row_bytes, 0);
      std::memcpy(dst + k * row_bytes, row(k), static_cast<size_t>(row_bytes));
    }
  });
}

}  // namespace tieredemb
