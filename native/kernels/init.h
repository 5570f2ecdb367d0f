// Initial row values: a row never written reads as a function of (seed, row id) only
// (random.h), whatever tier it is read into and in whatever order.
#pragma once

#include <cstdint>

#include "kernels/weights.h"

namespace tieredemb {

enum class InitKind { kNormal = 0, kUniform = 1, kZeros = 2 };

struct InitSpec {
  InitKind kind = InitKind::kNormal;
  double a = 0.0, b = 1.0;   // normal: mean, std; uniform: low, high
  uint64_t seed = 0;
  int64_t zero_id = -1;      // a row that starts at zero (padding_idx), or -1
};

// out[i] = initial row of ids[i]: dim weights from spec (a function of seed, id and column only,
// drawn in float32, then rounded to nearest even for 16-bit weights), optimizer state zero.
// out is [n, width]; the weights are its first weight_words(weights, dim) words (weights.h).
void init_rows(const InitSpec& spec, const int64_t* ids, int64_t n, int64_t dim, int64_t width, float* out,
               WeightType weights = WeightType::kFloat32);

// dst[dst_rows[i]] = src[src_rows[i]] where src_rows[i] >= 0, else the initial row of ids[i].
// Returns how many rows were copied (the rest were initialized).
int64_t read_or_init(const float* src, const int64_t* src_rows, const int64_t* ids, float* dst,
                     const int64_t* dst_rows, int64_t n, int64_t dim, int64_t width, const InitSpec& spec,
                     WeightType weights = WeightType::kFloat32);

}  // namespace tieredemb
