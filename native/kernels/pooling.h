// Bag pooling on host rows: the forward, and the fused backward that sums the gradient of each
// unique row and applies the optimizer to it in place.
//
// Pools are float32 [rows, width], row-major; a row is weights ‖ optimizer state, the weights
// float32 or 16-bit (weights.h). The kernels compute in float32: they pool the decoded weights,
// and the optimizer updates the decoded weights with the float32 state, then rounds them back.
// Pooling inputs describe a batch after dedup: occurrence i of the batch reads unique row
// inverse[i], which lives in pool slot slots_u[inverse[i]]. Bags are offsets[b]..offsets[b+1]
// (offsets has num_bags + 1 entries).
#pragma once

#include <cstdint>

#include "kernels/weights.h"

namespace tieredemb {

enum class PoolingMode { kSum = 0, kMean = 1, kMax = 2 };
enum class OptimizerKind { kSGD = 0, kAdagrad = 1, kRowWiseAdagrad = 2, kAdam = 3 };

struct PoolingArgs {
  int64_t dim = 0, width = 0;
  const int64_t* slots_u = nullptr;  // [U]
  int64_t num_unique = 0;
  const int64_t* inverse = nullptr;  // [N]
  int64_t num_ids = 0;
  const int64_t* offsets = nullptr;  // [B + 1]
  int64_t num_bags = 0;
  const float* per_sample_weights = nullptr;  // [N] or null
  PoolingMode mode = PoolingMode::kSum;
  int64_t skip_u = -1;  // unique index left out of every bag (EmbeddingBag's padding_idx), or -1
  WeightType weights = WeightType::kFloat32;  // of the pool's rows (weights.h)
  const int64_t* unique_ids = nullptr;  // [U] the row id of each unique row (stochastic rounding), or null
  // [B]: where bag b's output row starts in out (and its gradient in grad_out), in floats; null:
  // at b * dim (out is [B, dim]). Lets several lookups write one [B, sum of dims] block.
  const int64_t* out_at = nullptr;
  int64_t out_row(int64_t b) const { return out_at != nullptr ? out_at[b] : b * dim; }
};

// out + out_row(b) = pooled rows of bag b (dim floats). For max, argmax[b * dim + d] = the occurrence that
// gave the max (-1 for an empty bag); ties go to the first.
void pool_forward(const PoolingArgs& a, const float* pool, float* out, int64_t* argmax);

struct OptimizerArgs {
  OptimizerKind kind = OptimizerKind::kSGD;
  // Adam's 1 - beta1 and 1 - beta2, taken in double by the caller (as torch's SparseAdam takes them):
  // 1.f - 0.999f is off by a relative 1.3e-5.
  float lr = 0.01f, eps = 1e-8f, one_minus_beta1 = 0.1f, one_minus_beta2 = 0.001f;
  float adam_step_size = 0.f;  // lr * sqrt(1 - beta2^t) / (1 - beta1^t), set per step
  // Row-wise Adagrad divides its accumulator by this before the square root: 1 for plain
  // row-wise Adagrad, c for momentum-scaled row-wise Adagrad (tieredemb/optim.py).
  float accumulator_divisor = 1.f;
  // Weight decay of the rows a step touches: L2 (g += weight_decay * w before the step) or, if
  // decoupled_weight_decay, w *= 1 - lr * weight_decay before a step with g as it is.
  float weight_decay = 0.f;
  bool decoupled_weight_decay = false;
  // 16-bit weights are written back rounded to nearest even, or stochastically with the random
  // bits of rounding_key(sr_seed, row id, step) (weights.h): the same result on every run.
  bool stochastic_rounding = false;
  uint64_t sr_seed = 0;
  int64_t step = 0;
};

// Floats of optimizer state per row, after its weights: SGD 0, Adagrad dim, row-wise Adagrad 1,
// Adam 2 * dim.
int64_t state_width(OptimizerKind kind, int64_t dim);

// Sums the gradient of every unique row (duplicates in occurrence order) and applies the
// optimizer to its row in place, except unique index frozen_u (padding). If psw_grad is not
// null, first writes the gradient of each per-sample weight ([N]), from the rows before update.
// Stochastic rounding of 16-bit weights (opt.stochastic_rounding) needs a.unique_ids.
void pool_backward_update(const PoolingArgs& a, float* pool, const float* grad_out, const int64_t* argmax,
                          const OptimizerArgs& opt, int64_t frozen_u, float* psw_grad);

}  // namespace tieredemb
