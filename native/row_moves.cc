#include "row_moves.h"

#include <cstring>
#include <vector>

#include "thread_pool.h"

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

int64_t read_or_init(const float* src, const int64_t* src_rows, const int64_t* ids, float* dst,
                     const int64_t* dst_rows, int64_t n, int64_t dim, int64_t width, const InitSpec& spec) {
  std::vector<int64_t> absent;
  std::vector<int64_t> copy_src, copy_dst;
  copy_src.reserve(n);
  copy_dst.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    if (src_rows[i] >= 0) {
      copy_src.push_back(src_rows[i]);
      copy_dst.push_back(dst_rows[i]);
    } else {
      absent.push_back(i);
    }
  }
  copy_rows(src, copy_src.data(), dst, copy_dst.data(), static_cast<int64_t>(copy_src.size()), width);
  if (!absent.empty()) {
    // init_rows is itself parallel (and a loop inside a loop runs on one thread): initialize
    // into a packed block, then place the rows.
    int64_t m = static_cast<int64_t>(absent.size());
    std::vector<int64_t> absent_ids(m), absent_dst(m), packed(m);
    for (int64_t k = 0; k < m; ++k) {
      absent_ids[k] = ids[absent[k]];
      absent_dst[k] = dst_rows[absent[k]];
      packed[k] = k;
    }
    std::vector<float> block(static_cast<size_t>(m) * width);
    init_rows(spec, absent_ids.data(), m, dim, width, block.data());
    copy_rows(block.data(), packed.data(), dst, absent_dst.data(), m, width);
  }
  return static_cast<int64_t>(copy_src.size());
}

}  // namespace tieredemb
