#include "kernels/init.h"

#include <algorithm>
#include <vector>

#include "common/row_moves.h"
#include "common/thread_pool.h"
#include "kernels/random.h"

namespace tieredemb {

void init_rows(const InitSpec& spec, const int64_t* ids, int64_t n, int64_t dim, int64_t width, float* out,
               WeightType weights) {
  // The draws (random.h) are bit-reproducible on every machine and build: a table reopened
  // elsewhere reads its unwritten rows as the same values.
  dispatch_weight_type(weights, [&](auto type) {
    constexpr WeightType W = decltype(type)::value;
    const int64_t words = weight_words(W, dim);
    parallel_for(n, 64, [&](int64_t begin, int64_t end) {
      std::vector<float> drawn(W == WeightType::kFloat32 ? 0 : dim);
      for (int64_t i = begin; i < end; ++i) {
        float* row = out + i * width;
        std::fill(row + words, row + width, 0.f);
        float* w = W == WeightType::kFloat32 ? row : drawn.data();  // float32 weights are drawn in place
        if (spec.kind == InitKind::kZeros || ids[i] == spec.zero_id) {
          std::fill(w, w + dim, 0.f);
        } else if (spec.kind == InitKind::kUniform) {
          fill_uniform(row_key(spec.seed, ids[i]), w, dim, static_cast<float>(spec.a), static_cast<float>(spec.b));
        } else {
          fill_normal(row_key(spec.seed, ids[i]), w, dim, static_cast<float>(spec.a), static_cast<float>(spec.b));
        }
        if constexpr (W != WeightType::kFloat32) encode_weights<W>(w, dim, row);
      }
    });
  });
}

int64_t read_or_init(const float* src, const int64_t* src_rows, const int64_t* ids, float* dst,
                     const int64_t* dst_rows, int64_t n, int64_t dim, int64_t width, const InitSpec& spec,
                     WeightType weights) {
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
    init_rows(spec, absent_ids.data(), m, dim, width, block.data(), weights);
    copy_rows(block.data(), packed.data(), dst, absent_dst.data(), m, width);
  }
  return static_cast<int64_t>(copy_src.size());
}

}  // namespace tieredemb
