#include "kernels/pooling.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "common/thread_pool.h"

namespace tieredemb {
namespace {

constexpr int64_t kRowGrain = 256;

// sum over d of x[d] * y[d], in eight interleaved partial sums added in a fixed order, so it
// vectorizes and gives the same result on every machine.
inline float dot(const float* __restrict x, const float* __restrict y, int64_t n) {
  float part[8] = {};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int j = 0; j < 8; ++j) part[j] += x[d + j] * y[d + j];
  for (int j = 0; d < n; ++d, ++j) part[j] += x[d] * y[d];
  return ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
}

// One optimizer step on weights w[0, dim) with gradient g (L2 weight decay adds to it) and the
// row's state.
inline void apply_optimizer(const OptimizerArgs& o, int64_t dim, float* __restrict w, float* __restrict state,
                            float* __restrict g) {
  if (o.weight_decay != 0.f) {
    if (o.decoupled_weight_decay) {
      const float keep = 1.f - o.lr * o.weight_decay;
      for (int64_t d = 0; d < dim; ++d) w[d] *= keep;
    } else {
      for (int64_t d = 0; d < dim; ++d) g[d] += o.weight_decay * w[d];
    }
  }
  switch (o.kind) {
    case OptimizerKind::kSGD:
      for (int64_t d = 0; d < dim; ++d) w[d] += -o.lr * g[d];
      break;
    case OptimizerKind::kAdagrad: {
      float* __restrict sum = state;
      for (int64_t d = 0; d < dim; ++d) {
        sum[d] += g[d] * g[d];
        w[d] += -o.lr * (g[d] / (std::sqrt(sum[d]) + o.eps));
      }
      break;
    }
    case OptimizerKind::kRowWiseAdagrad: {
      state[0] += dot(g, g, dim) / static_cast<float>(dim);
      float multiplier = o.lr / (std::sqrt(state[0] / o.accumulator_divisor) + o.eps);
      for (int64_t d = 0; d < dim; ++d) w[d] -= multiplier * g[d];
      break;
    }
    case OptimizerKind::kAdam: {
      // Lazy Adam with torch.optim.SparseAdam's arithmetic, step by step.
      float* __restrict m = state;
      float* __restrict v = state + dim;
      for (int64_t d = 0; d < dim; ++d) {
        float m_update = (g[d] - m[d]) * o.one_minus_beta1;
        float v_update = (g[d] * g[d] - v[d]) * o.one_minus_beta2;
        float numer = m_update + m[d];
        float vv = v_update + v[d];
        m[d] = numer;
        v[d] = vv;
        w[d] += -o.adam_step_size * (numer / (std::sqrt(vv) + o.eps));
      }
      break;
    }
  }
}

// Rows a pooling kernel reads, in the order it adds them: row(k), whose weights are of type
// kWeights, and, for a weighted sum, scale(k).
template <WeightType W>
struct RowList {
  static constexpr WeightType kWeights = W;
  const float* const* rows;
  const float* scales;
  const float* row(int64_t k) const { return rows[k]; }
  float scale(int64_t k) const { return scales[k]; }
};

// out[c] = sum over k of scale(k) * row(k)[c] (or row(k)[c]), for c in [col, col + 8 * NV), the
// terms added in order k = 0, 1, ... into one accumulator per column, held in registers.
template <int NV, bool kScaled, class Rows>
inline void sum_rows_block(const Rows& src, int64_t n, int64_t col, float* __restrict out) {
  constexpr WeightType W = Rows::kWeights;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[NV];
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) acc[v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < n; ++k) {
    const WeightBits<W>* r = stored_weights<W>(src.row(k)) + col;
    if constexpr (kScaled) {
      __m256 s = _mm256_set1_ps(src.scale(k));
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[v] = _mm256_fmadd_ps(s, load8_weights<W>(r + 8 * v), acc[v]);
    } else {
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[v] = _mm256_add_ps(acc[v], load8_weights<W>(r + 8 * v));
    }
  }
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out + col + 8 * v, acc[v]);
#else
  float acc[8 * NV] = {};
  for (int64_t k = 0; k < n; ++k) {
    const WeightBits<W>* r = stored_weights<W>(src.row(k)) + col;
    float s = kScaled ? src.scale(k) : 1.f;
    for (int c = 0; c < 8 * NV; ++c) {
      float x = weight_value<W>(r + c);
      acc[c] = kScaled ? std::fma(s, x, acc[c]) : acc[c] + x;
    }
  }
  std::memcpy(out + col, acc, sizeof(acc));
#endif
}

// out[0, dim) = the (scaled) sum of n rows, each column summed in order k = 0, 1, ..., so the
// result depends only on the rows and their order. Columns go in register-sized blocks.
// Always inlined: the backward of every weight type sums its gradient rows with it, and GCC
// leaves a function of several callers out of line (a call per row update).
template <bool kScaled, class Rows>
__attribute__((always_inline)) inline void sum_rows(const Rows& src, int64_t n, int64_t dim, float* __restrict out) {
  // 16 ymm registers: 16 accumulators for a plain sum, 8 when a broadcast scale needs one too.
  constexpr int kWide = kScaled ? 8 : 16;
  int64_t col = 0;
  for (; col + 8 * kWide <= dim; col += 8 * kWide) sum_rows_block<kWide, kScaled>(src, n, col, out);
  if constexpr (kWide > 8) {
    if (dim - col >= 64) sum_rows_block<8, kScaled>(src, n, col, out), col += 64;
  }
  if (dim - col >= 32) sum_rows_block<4, kScaled>(src, n, col, out), col += 32;
  if (dim - col >= 16) sum_rows_block<2, kScaled>(src, n, col, out), col += 16;
  if (dim - col >= 8) sum_rows_block<1, kScaled>(src, n, col, out), col += 8;
  for (; col < dim; ++col) {
    float acc = 0.f;
    for (int64_t k = 0; k < n; ++k) {
      float x = weight_value<Rows::kWeights>(stored_weights<Rows::kWeights>(src.row(k)) + col);
      acc = kScaled ? std::fma(src.scale(k), x, acc) : acc + x;
    }
    out[col] = acc;
  }
}

// Asks for the cache lines of floats [p, p + n) ahead of use.
inline void prefetch_floats(const float* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  const char* e = reinterpret_cast<const char*>(p + n);
  for (; c < e; c += 64) __builtin_prefetch(c);
  __builtin_prefetch(e - 1);
}

// Occurrences ahead of the one being added whose rows are prefetched: enough to cover a DRAM
// miss with a few rows in flight.
constexpr int64_t kPrefetchAhead = 16;
// Row updates ahead of the current one whose rows (weights and state) are prefetched.
constexpr int64_t kRowsAhead = 8;

// The weights of a row as float32: the row itself, or (16-bit weights) decoded into buf[dim].
template <WeightType W>
inline const float* row_weights(const float* row, int64_t dim, float* buf) {
  if constexpr (W == WeightType::kFloat32) {
    return row;
  } else {
    decode_weights<W>(row, dim, buf);
    return buf;
  }
}

// One optimizer step on unique row u (its row in the pool is `row`) with gradient g (a scratch
// row: weight decay may add to it). 16-bit weights are decoded into buf[dim], updated there, and
// written back rounded (opt).
template <WeightType W>
inline void update_row(const OptimizerArgs& opt, const PoolingArgs& a, int64_t u, float* row, float* g,
                       float* buf) {
  if constexpr (W == WeightType::kFloat32) {
    apply_optimizer(opt, a.dim, row, row + a.dim, g);
  } else {
    decode_weights<W>(row, a.dim, buf);
    apply_optimizer(opt, a.dim, buf, row + weight_words(W, a.dim), g);
    if (opt.stochastic_rounding) {
      encode_weights_stochastic<W>(buf, a.dim, rounding_key(opt.sr_seed, a.unique_ids[u], opt.step), row);
    } else {
      encode_weights<W>(buf, a.dim, row);
    }
  }
}

}  // namespace

int64_t state_width(OptimizerKind kind, int64_t dim) {
  switch (kind) {
    case OptimizerKind::kSGD: return 0;
    case OptimizerKind::kAdagrad: return dim;
    case OptimizerKind::kRowWiseAdagrad: return 1;
    case OptimizerKind::kAdam: return 2 * dim;
  }
  return 0;
}

namespace {

template <WeightType W>
void pool_forward_typed(const PoolingArgs& a, const float* pool, float* out, int64_t* argmax) {
  const int64_t dim = a.dim, words = weight_words(W, dim);
  const bool weighted = a.per_sample_weights != nullptr;
  parallel_for(a.num_bags, 64, [&](int64_t begin, int64_t end) {
    const int64_t stream_end = a.offsets[end];
    auto row_of = [&](int64_t i) { return pool + a.slots_u[a.inverse[i]] * a.width; };
    std::vector<const float*> rows;
    std::vector<float> scales;
    std::vector<float> decoded(W == WeightType::kFloat32 ? 0 : dim);
    for (int64_t b = begin; b < end; ++b) {
      float* __restrict o = out + a.out_row(b);
      if (a.mode == PoolingMode::kMax) {
        std::fill(o, o + dim, 0.f);
        int64_t* __restrict am = argmax + b * dim;
        std::fill(am, am + dim, int64_t{-1});
        bool empty = true;
        for (int64_t i = a.offsets[b]; i < a.offsets[b + 1]; ++i) {
          if (i + kPrefetchAhead < stream_end) prefetch_floats(row_of(i + kPrefetchAhead), words);
          if (a.inverse[i] == a.skip_u) continue;
          const float* __restrict row = row_weights<W>(row_of(i), dim, decoded.data());
          if (empty) {
            std::copy(row, row + dim, o);
            std::fill(am, am + dim, i);
            empty = false;
            continue;
          }
          for (int64_t d = 0, n = dim; d < n; ++d) {  // branch-free, so it vectorizes
            bool greater = row[d] > o[d];
            o[d] = greater ? row[d] : o[d];
            am[d] = greater ? i : am[d];
          }
        }
        continue;
      }
      rows.clear();
      scales.clear();
      for (int64_t i = a.offsets[b]; i < a.offsets[b + 1]; ++i) {
        if (i + kPrefetchAhead < stream_end) prefetch_floats(row_of(i + kPrefetchAhead), words);
        if (a.inverse[i] == a.skip_u) continue;
        rows.push_back(row_of(i));
        if (weighted) scales.push_back(a.per_sample_weights[i]);
      }
      RowList<W> src{rows.data(), scales.data()};
      int64_t count = static_cast<int64_t>(rows.size());
      if (weighted) {
        sum_rows<true>(src, count, dim, o);
      } else {
        sum_rows<false>(src, count, dim, o);
      }
      if (a.mode == PoolingMode::kMean && count > 0) {
        float scale = 1.f / static_cast<float>(count);
        for (int64_t d = 0; d < dim; ++d) o[d] *= scale;
      }
    }
  });
}

}  // namespace

void pool_forward(const PoolingArgs& a, const float* pool, float* out, int64_t* argmax) {
  dispatch_weight_type(a.weights, [&](auto w) { pool_forward_typed<decltype(w)::value>(a, pool, out, argmax); });
}

namespace {

// One occurrence of a unique row in the backward: its bag and the factor on that bag's gradient.
struct GradTerm {
  int32_t bag;
  float scale;
};

// Gradient rows of one unique row's occurrences, for sum_rows.
struct GradTerms {
  static constexpr WeightType kWeights = WeightType::kFloat32;
  const GradTerm* terms;
  const float* grad_out;
  const PoolingArgs* a;
  const float* row(int64_t k) const { return grad_out + a->out_row(terms[k].bag); }
  float scale(int64_t k) const { return terms[k].scale; }
};

// The first index of part p (n for p = parts) when [0, n) is cut into parts of about equal
// cost, item i costing prefix(i + 1) - prefix(i) (prefix non-decreasing, prefix(0) = 0).
template <class Prefix>
int64_t balanced_cut(int64_t n, int64_t parts, int64_t p, const Prefix& prefix) {
  if (p <= 0) return 0;
  if (p >= parts) return n;
  double target = static_cast<double>(prefix(n)) * static_cast<double>(p) / static_cast<double>(parts);
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    int64_t mid = lo + (hi - lo) / 2;
    if (static_cast<double>(prefix(mid)) < target) lo = mid + 1; else hi = mid;
  }
  return lo;
}

template <WeightType W>
void pool_backward_update_typed(const PoolingArgs& a, float* pool, const float* grad_out, const int64_t* argmax,
                                const OptimizerArgs& opt, int64_t frozen_u, float* psw_grad) {
  const int64_t dim = a.dim, n = a.num_ids, num_u = a.num_unique, num_bags = a.num_bags;
  const int64_t first = num_bags > 0 ? a.offsets[0] : 0, last = num_bags > 0 ? a.offsets[num_bags] : 0;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(ThreadPool::instance().num_threads(), num_bags));
  // Part p of the batch: bags [bag_cut[p], bag_cut[p + 1]), about equal numbers of occurrences.
  std::vector<int64_t> bag_cut(parts + 1);
  for (int64_t p = 0; p <= parts; ++p)
    bag_cut[p] = balanced_cut(num_bags, parts, p, [&](int64_t b) { return a.offsets[b] - first; });

  if (psw_grad != nullptr) {
    for (int64_t i = 0; i < n; ++i)
      if (i < first || i >= last) psw_grad[i] = 0.f;
    parallel_for(num_bags, 64, [&](int64_t begin, int64_t end) {
      const int64_t stream_end = a.offsets[end];
      std::vector<float> decoded(W == WeightType::kFloat32 ? 0 : dim);
      for (int64_t b = begin; b < end; ++b) {
        const float* g = grad_out + a.out_row(b);
        for (int64_t i = a.offsets[b]; i < a.offsets[b + 1]; ++i) {
          if (i + kPrefetchAhead < stream_end)
            prefetch_floats(pool + a.slots_u[a.inverse[i + kPrefetchAhead]] * a.width, weight_words(W, dim));
          int64_t u = a.inverse[i];
          if (u == a.skip_u) {
            psw_grad[i] = 0.f;
            continue;
          }
          const float* row = row_weights<W>(pool + a.slots_u[u] * a.width, dim, decoded.data());
          psw_grad[i] = dot(g, row, dim);
        }
      }
    });
  }

  if (a.mode == PoolingMode::kMax) {
    std::vector<float> grad_u(static_cast<size_t>(num_u) * dim, 0.f);
    for (int64_t b = 0; b < num_bags; ++b) {
      for (int64_t d = 0; d < dim; ++d) {
        int64_t i = argmax[b * dim + d];
        if (i >= 0) grad_u[a.inverse[i] * dim + d] += grad_out[a.out_row(b) + d];
      }
    }
    parallel_for(num_u, kRowGrain, [&](int64_t begin, int64_t end) {
      std::vector<float> weights(W == WeightType::kFloat32 ? 0 : dim);
      for (int64_t u = begin; u < end; ++u) {
        if (u == frozen_u || u == a.skip_u) continue;
        update_row<W>(opt, a, u, pool + a.slots_u[u] * a.width, grad_u.data() + u * dim, weights.data());
      }
    });
    return;
  }

  // Occurrences grouped by unique row, in occurrence order (a counting sort of inverse, each part
  // counting and placing its own occurrences), so the sum of each row's gradient has a fixed
  // order whatever the slots or threads.
  std::vector<std::vector<int64_t>> place(parts);
  parallel_for(parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      place[p].assign(num_u, 0);
      int64_t* count = place[p].data();
      for (int64_t i = a.offsets[bag_cut[p]]; i < a.offsets[bag_cut[p + 1]]; ++i) ++count[a.inverse[i]];
    }
  });
  std::vector<int64_t> start(num_u + 1);
  int64_t total = 0;
  for (int64_t u = 0; u < num_u; ++u) {
    start[u] = total;
    for (int64_t p = 0; p < parts; ++p) {
      int64_t c = place[p][u];
      place[p][u] = total;
      total += c;
    }
  }
  start[num_u] = total;
  std::vector<GradTerm> terms(total);
  const bool weighted = a.per_sample_weights != nullptr;
  parallel_for(parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      int64_t* next = place[p].data();
      for (int64_t b = bag_cut[p]; b < bag_cut[p + 1]; ++b) {
        float bag_scale = 1.f;
        if (a.mode == PoolingMode::kMean) {
          int64_t count = 0;
          for (int64_t i = a.offsets[b]; i < a.offsets[b + 1]; ++i) count += a.inverse[i] != a.skip_u;
          if (count > 0) bag_scale = 1.f / static_cast<float>(count);
        }
        for (int64_t i = a.offsets[b]; i < a.offsets[b + 1]; ++i)
          terms[next[a.inverse[i]]++] = GradTerm{static_cast<int32_t>(b), weighted ? a.per_sample_weights[i] : bag_scale};
      }
    }
  });

  // The updates are cut into several pieces per thread, each of unique rows of about equal work:
  // the rows' occurrences plus a fixed cost per row update (its row is a likely cache and TLB
  // miss: measured about 16 occurrences). Threads take pieces in turn (thread_pool.h).
  constexpr int64_t kRowCost = 16;
  auto work = [&](int64_t u) { return start[u] + kRowCost * u; };
  const bool unit_scale = !weighted && a.mode == PoolingMode::kSum;
  const int64_t pieces = std::max<int64_t>(1, std::min<int64_t>(num_u, parts * ThreadPool::kChunksPerThread));
  parallel_for(pieces, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> buf(dim), weights(W == WeightType::kFloat32 ? 0 : dim);
    float* __restrict g = buf.data();
    for (int64_t p = p0; p < p1; ++p) {
      int64_t u_end = balanced_cut(num_u, pieces, p + 1, work);
      int64_t u_begin = balanced_cut(num_u, pieces, p, work);
      int64_t u_ahead = u_begin, k_ahead = start[u_begin], k_stop = start[u_end];
      for (int64_t u = u_begin; u < u_end; ++u) {
        // Keep the rows of the next few updates, and the gradient rows of the next few
        // occurrences, on their way into the cache.
        for (; u_ahead < std::min(u + kRowsAhead, u_end); ++u_ahead)
          prefetch_floats(pool + a.slots_u[u_ahead] * a.width, a.width);
        int64_t k0 = start[u], k1 = start[u + 1];
        for (k_ahead = std::max(k_ahead, k0); k_ahead < std::min(k1 + kPrefetchAhead, k_stop); ++k_ahead)
          prefetch_floats(grad_out + a.out_row(terms[k_ahead].bag), dim);
        if (u == frozen_u || u == a.skip_u) continue;
        GradTerms src{terms.data() + k0, grad_out, &a};
        if (unit_scale) {
          sum_rows<false>(src, k1 - k0, dim, g);
        } else {
          sum_rows<true>(src, k1 - k0, dim, g);
        }
        update_row<W>(opt, a, u, pool + a.slots_u[u] * a.width, g, weights.data());
      }
    }
  });
}

}  // namespace

void pool_backward_update(const PoolingArgs& a, float* pool, const float* grad_out, const int64_t* argmax,
                          const OptimizerArgs& opt, int64_t frozen_u, float* psw_grad) {
  dispatch_weight_type(a.weights, [&](auto w) {
    pool_backward_update_typed<decltype(w)::value>(a, pool, grad_out, argmax, opt, frozen_u, psw_grad);
  });
}

}  // namespace tieredemb
