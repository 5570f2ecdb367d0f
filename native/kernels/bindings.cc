// Python bindings of the batch kernels (tieredemb._C): dedup, initial rows, bag pooling forward
// and the fused backward with its optimizer arguments, on rows of float32 or 16-bit weights
// (`weights`: 0 float32, 1 float16, 2 bfloat16; the layout in weights.h).
// Only whole batches cross: 1-D int64 id arrays and 2-D float32 row blocks (DLPack: torch
// tensors pass without copies). Every batch call releases the GIL, its checks included
// (common/bindings.h).
#include <nanobind/stl/optional.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <string>
#include <vector>

#include "common/bindings.h"
#include "common/thread_pool.h"
#include "kernels/dedup.h"
#include "kernels/init.h"
#include "kernels/pooling.h"
#include "kernels/weights.h"

namespace tieredemb {

using namespace nb::literals;

namespace {

// The InitSpec of the binding arguments (kind, a, b, seed, zero_id). Call with the GIL held.
InitSpec init_spec(int kind, double a, double b, uint64_t seed, int64_t zero_id) {
  if (kind < 0 || kind > 2)
    throw nb::value_error(
        ("init kind must be 0 (normal), 1 (uniform) or 2 (zeros), got " + std::to_string(kind)).c_str());
  return InitSpec{static_cast<InitKind>(kind), a, b, seed, zero_id};
}

// The WeightType of a binding's `weights` argument. Call with the GIL held.
WeightType weight_type(int type) {
  if (type < 0 || type > 2)
    throw nb::value_error(
        ("weights type " + std::to_string(type) + " is not 0 (float32), 1 (float16) or 2 (bfloat16)").c_str());
  return static_cast<WeightType>(type);
}

// ValueError unless dim weights of the type fit in rows of `width` words.
void check_dim(int64_t dim, int64_t width, WeightType weights) {
  if (weights == WeightType::kFloat32) {
    if (dim <= 0 || dim > width)
      throw nb::value_error(
          ("dim " + std::to_string(dim) + " must be in [1, row width " + std::to_string(width) + "]").c_str());
  } else if (dim <= 0 || weight_words(weights, dim) > width) {
    throw nb::value_error(("dim " + std::to_string(dim) + " must be in [1, 2 * row width = " +
                           std::to_string(2 * width) + "] for 16-bit weights")
                              .c_str());
  }
}

// The PoolingArgs of a batch, after the checks that take O(1) (with the GIL held).
PoolingArgs pooling_args(const Rows& pool, int64_t dim, const Ids& slots_u, const Ids& inverse, const Ids& offsets,
                         std::optional<Floats> psw, int mode, int64_t skip_u, int weights) {
  if (mode < 0 || mode > 2)
    throw nb::value_error(("mode must be 0 (sum), 1 (mean) or 2 (max), got " + std::to_string(mode)).c_str());
  const WeightType type = weight_type(weights);
  check_dim(dim, static_cast<int64_t>(pool.shape(1)), type);
  if (offsets.shape(0) < 1) throw nb::value_error("offsets must have num_bags + 1 entries, got none");
  PoolingArgs a;
  a.dim = dim;
  a.width = pool.shape(1);
  a.slots_u = slots_u.data();
  a.num_unique = slots_u.shape(0);
  a.inverse = inverse.data();
  a.num_ids = inverse.shape(0);
  a.offsets = offsets.data();
  a.num_bags = offsets.shape(0) - 1;
  if (psw) {
    if (static_cast<int64_t>(psw->shape(0)) != a.num_ids)
      throw nb::value_error(("per_sample_weights has " + std::to_string(psw->shape(0)) + " entries for " +
                             std::to_string(a.num_ids) + " ids").c_str());
    a.per_sample_weights = psw->data();
  }
  a.mode = static_cast<PoolingMode>(mode);
  a.skip_u = skip_u;
  a.weights = type;
  return a;
}

// The O(n) checks of a batch's slots, offsets and inverse (run with the GIL released).
Status check_batch(const PoolingArgs& a, int64_t pool_rows) {
  Status s = check_slots("slots_u: slot", a.slots_u, a.num_unique, pool_rows);
  if (!s.ok()) return s;
  for (int64_t b = 0; b <= a.num_bags; ++b) {
    const int64_t o = a.offsets[b];
    if (o < 0 || o > a.num_ids || (b > 0 && o < a.offsets[b - 1]))
      return Status::ValueError("offsets[" + std::to_string(b) + "] = " + std::to_string(o) +
                                ": offsets must be non-decreasing within [0, " + std::to_string(a.num_ids) + "]");
  }
  return check_slots("inverse: unique index", a.inverse, a.num_ids, a.num_unique);
}

// Where the bags' output rows go in an [rows, cols] block (out_at: [B] starts in floats, or none:
// the block is [B, dim]); the O(B) check of out_at runs in check_out_at, with the GIL released.
void set_out(PoolingArgs* a, const char* what, int64_t rows, int64_t cols, const std::optional<Ids>& out_at) {
  if (!out_at) {
    raise_if_error(check_rows(what, rows, a->num_bags, cols, a->dim));
    return;
  }
  if (static_cast<int64_t>(out_at->shape(0)) != a->num_bags)
    throw nb::value_error((std::string(what) + ": out_at has " + std::to_string(out_at->shape(0)) + " entries for " +
                           std::to_string(a->num_bags) + " bags").c_str());
  a->out_at = out_at->data();
}

// Every bag's output row (dim floats at out_at[b]) inside a block of `size` floats.
Status check_out_at(const PoolingArgs& a, const char* what, int64_t size) {
  if (a.out_at == nullptr) return Status::Ok();
  for (int64_t b = 0; b < a.num_bags; ++b) {
    const int64_t at = a.out_at[b];
    if (at < 0 || at > size - a.dim)
      return Status::IndexError(std::string(what) + ": out_at[" + std::to_string(b) + "] = " + std::to_string(at) +
                                " puts a row of " + std::to_string(a.dim) + " floats outside its " +
                                std::to_string(size) + " floats");
  }
  return Status::Ok();
}

// ValueError unless max pooling has an argmax of num_bags * dim entries.
void check_argmax(const PoolingArgs& a, int64_t argmax_size) {
  if (a.mode == PoolingMode::kMax && argmax_size != a.num_bags * a.dim)
    throw nb::value_error(("max pooling needs an argmax of num_bags * dim = " + std::to_string(a.num_bags * a.dim) +
                           " entries, got " + std::to_string(argmax_size)).c_str());
}

// ids[i] into out[i] as Out, each checked in [0, num_embeddings) in the same pass (a host
// batch's check and its narrowing for the device, one read of the ids): IndexError naming the
// first id out of range (out is written whatever the ids: on an error, the caller's to discard).
// A batch's ids come from memory, not cache (a loader made them a while ago), and one core reads
// memory at a fraction of what several do: the pool's threads take ranges of kGrain ids (the
// issue's 164K ids on 10 of them). On the H200 machine, 2026-11-27, that batch cold from pinned
// memory: 160.6 us on one thread, 68.6 us on 16.
template <class In, class Out>
Status checked_copy(const In* ids, int64_t n, int64_t num_embeddings, Out* out) {
  constexpr int64_t kGrain = 16384;
  std::atomic<uint64_t> largest{0};
  parallel_for(n, kGrain, [&](int64_t begin, int64_t end) {
    // In blocks that stay in L1: the narrowing copy, then the largest id as unsigned (a negative
    // one is huge), each a loop the compiler vectorizes (one loop doing both was 3x slower).
    constexpr int64_t kBlock = 4096;
    uint64_t mine = 0;
    for (int64_t start = begin; start < end; start += kBlock) {
      const int64_t stop = std::min(end, start + kBlock);
      for (int64_t i = start; i < stop; ++i) out[i] = static_cast<Out>(ids[i]);
      for (int64_t i = start; i < stop; ++i)
        mine = std::max(mine, static_cast<uint64_t>(static_cast<int64_t>(ids[i])));
    }
    uint64_t seen = largest.load(std::memory_order_relaxed);
    while (mine > seen && !largest.compare_exchange_weak(seen, mine, std::memory_order_relaxed)) {
    }
  });
  if (n == 0 || largest.load() < static_cast<uint64_t>(num_embeddings)) return Status::Ok();
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= num_embeddings)
      return Status::IndexError("id " + std::to_string(ids[i]) + " out of range [0, " +
                                std::to_string(num_embeddings) + ")");
  }
  return Status::Ok();
}

template <class In, class Out>
void def_checked_copy(nb::module_& m) {
  m.def("checked_copy",
        [](nb::ndarray<const In, nb::ndim<1>, nb::c_contig, nb::device::cpu> ids, int64_t num_embeddings,
           nb::ndarray<Out, nb::ndim<1>, nb::c_contig, nb::device::cpu> out) {
          if (out.shape(0) != ids.shape(0))
            throw nb::value_error(("checked_copy: out has " + std::to_string(out.shape(0)) + " entries, the ids " +
                                   std::to_string(ids.shape(0)))
                                      .c_str());
          if (num_embeddings < 0 || (sizeof(Out) < 8 && num_embeddings > (int64_t{1} << 31)))
            throw nb::value_error(("checked_copy: num_embeddings " + std::to_string(num_embeddings) +
                                   " must be in [0, " + (sizeof(Out) < 8 ? "2^31" : "2^63") + "] for this out")
                                      .c_str());
          const In* src = ids.data();
          Out* dst = out.data();
          const int64_t n = static_cast<int64_t>(ids.shape(0));
          run_without_gil([&] { return checked_copy(src, n, num_embeddings, dst); });
        },
        "ids"_a.noconvert(), "num_embeddings"_a, "out"_a.noconvert(),
        "ids (int64 or int32) copied into out (int32 or int64, as long), each checked in [0, num_embeddings) in "
        "the same pass; IndexError naming the first id out of range");
}

}  // namespace

void register_kernels(nb::module_& m) {
  def_checked_copy<int64_t, int32_t>(m);
  def_checked_copy<int64_t, int64_t>(m);
  def_checked_copy<int32_t, int32_t>(m);
  def_checked_copy<int32_t, int64_t>(m);

  m.def("dedup", [](Ids ids, int64_t num_embeddings, std::optional<Ids> starts, std::optional<Ids> row_ends) {
        std::vector<int64_t> unique, inverse(ids.shape(0));
        if (starts.has_value() != row_ends.has_value())
          throw nb::value_error("dedup: give starts and row_ends together (segments of disjoint id ranges), or neither");
        if (!starts) {
          run_without_gil([&] { return dedup(ids.data(), ids.shape(0), num_embeddings, &unique, inverse.data()); });
        } else {
          const int64_t segments = static_cast<int64_t>(row_ends->shape(0));
          if (static_cast<int64_t>(starts->shape(0)) != segments + 1)
            throw nb::value_error(("dedup: " + std::to_string(segments) + " segments (row_ends) need " +
                                   std::to_string(segments + 1) + " starts, got " + std::to_string(starts->shape(0)))
                                      .c_str());
          run_without_gil([&] {
            return dedup_segments(ids.data(), ids.shape(0), num_embeddings, starts->data(), row_ends->data(), segments,
                                  &unique, inverse.data());
          });
        }
        return nb::make_tuple(to_numpy(std::move(unique)), to_numpy(std::move(inverse)));
      }, "ids"_a.noconvert(), "num_embeddings"_a, "starts"_a.noconvert().none() = nb::none(),
      "row_ends"_a.noconvert().none() = nb::none(),
      "unique ids in order of first occurrence and the inverse map; IndexError for an id out of range. With "
      "starts [S + 1] and row_ends [S]: the ids are S segments, segment k ids[starts[k]:starts[k + 1]] of ids in "
      "[row_ends[k - 1], row_ends[k]) (from 0), each deduplicated alone, in parallel (the same result)");

  m.def("weight_words", [](int type, int64_t dim) { return weight_words(weight_type(type), dim); }, "type"_a, "dim"_a,
        "32-bit words of a row taken by dim weights of the type (0 float32: dim; 1 float16, 2 bfloat16: "
        "(dim + 1) / 2); the optimizer state follows");

  m.def("init_rows", [](Ids ids, Rows out, int64_t dim, int kind, double a, double b, uint64_t seed, int64_t zero_id,
                        int weights) {
        raise_if_error(check_rows("init_rows out", out.shape(0), ids.shape(0), out.shape(1), -1));
        const WeightType type = weight_type(weights);
        check_dim(dim, static_cast<int64_t>(out.shape(1)), type);
        const InitSpec spec = init_spec(kind, a, b, seed, zero_id);
        GilReleased released;
        init_rows(spec, ids.data(), ids.shape(0), dim, out.shape(1), out.data(), type);
      }, "ids"_a.noconvert(), "out"_a.noconvert(), "dim"_a, "kind"_a, "a"_a, "b"_a, "seed"_a, "zero_id"_a,
      "weights"_a = 0,
      "out[i] = the initial row of ids[i]: dim weights (kind 0: normal(a, b), 1: uniform [a, b), 2: zeros; "
      "zeros for zero_id), a function of (seed, id) only, drawn in float32 and stored as `weights` (0 float32, "
      "1 float16, 2 bfloat16: rounded to nearest even), then zero optimizer state");

  m.def("read_or_init", [](ConstRows src, Ids src_rows, Ids ids, Rows dst, Ids dst_rows, int64_t dim, int kind,
                           double a, double b, uint64_t seed, int64_t zero_id, int weights) {
        if (src.shape(1) != dst.shape(1))
          throw nb::value_error(("read_or_init: src rows have " + std::to_string(src.shape(1)) + " floats, dst rows " +
                                 std::to_string(dst.shape(1))).c_str());
        const int64_t n = static_cast<int64_t>(src_rows.shape(0));
        if (static_cast<int64_t>(ids.shape(0)) != n || static_cast<int64_t>(dst_rows.shape(0)) != n)
          throw nb::value_error(("read_or_init: " + std::to_string(n) + " src_rows, " + std::to_string(ids.shape(0)) +
                                 " ids and " + std::to_string(dst_rows.shape(0)) + " dst_rows differ in length")
                                    .c_str());
        const WeightType type = weight_type(weights);
        check_dim(dim, static_cast<int64_t>(dst.shape(1)), type);
        const InitSpec spec = init_spec(kind, a, b, seed, zero_id);
        int64_t copied = 0;
        run_without_gil([&] {
          const int64_t src_limit = static_cast<int64_t>(src.shape(0));
          for (int64_t i = 0; i < n; ++i) {  // a negative src row means "initialize"
            if (src_rows.data()[i] >= src_limit)
              return Status::IndexError("read_or_init src row " + std::to_string(src_rows.data()[i]) +
                                        " out of range [0, " + std::to_string(src_limit) + ")");
          }
          Status s = check_slots("read_or_init dst row", dst_rows.data(), n, static_cast<int64_t>(dst.shape(0)));
          if (s.ok())
            copied = read_or_init(src.data(), src_rows.data(), ids.data(), dst.data(), dst_rows.data(), n, dim,
                                  dst.shape(1), spec, type);
          return s;
        });
        return copied;
      }, "src"_a.noconvert(), "src_rows"_a.noconvert(), "ids"_a.noconvert(), "dst"_a.noconvert(),
      "dst_rows"_a.noconvert(), "dim"_a, "kind"_a, "a"_a, "b"_a, "seed"_a, "zero_id"_a, "weights"_a = 0,
      "dst[dst_rows[i]] = src[src_rows[i]], or the initial row of ids[i] where src_rows[i] < 0 (weights as in "
      "init_rows); returns rows copied");

  m.def("state_width", [](int kind, int64_t dim) { return state_width(static_cast<OptimizerKind>(kind), dim); },
        "kind"_a, "dim"_a, "floats of optimizer state per row");

  m.def("pool_forward", [](Rows pool, int64_t dim, Ids slots_u, Ids inverse, Ids offsets, std::optional<Floats> psw,
                           int mode, int64_t skip_u, Rows out, std::optional<MutIds> argmax, int weights,
                           std::optional<Ids> out_at) {
        PoolingArgs a = pooling_args(pool, dim, slots_u, inverse, offsets, psw, mode, skip_u, weights);
        set_out(&a, "pool_forward out", out.shape(0), out.shape(1), out_at);
        check_argmax(a, argmax ? static_cast<int64_t>(argmax->shape(0)) : -1);
        int64_t* am = argmax ? argmax->data() : nullptr;
        run_without_gil([&] {
          Status s = check_batch(a, static_cast<int64_t>(pool.shape(0)));
          if (s.ok()) s = check_out_at(a, "pool_forward out", static_cast<int64_t>(out.shape(0) * out.shape(1)));
          if (s.ok()) pool_forward(a, pool.data(), out.data(), am);
          return s;
        });
      }, "pool"_a.noconvert(), "dim"_a, "slots_u"_a.noconvert(), "inverse"_a.noconvert(), "offsets"_a.noconvert(),
      "per_sample_weights"_a.noconvert().none(), "mode"_a, "skip_u"_a, "out"_a.noconvert(),
      "argmax"_a.noconvert().none(), "weights"_a = 0, "out_at"_a.noconvert().none() = nb::none(),
      "out[b] = the pooled float32 weights of bag b's rows (pool rows of `weights` type: 0 float32, 1 float16, "
      "2 bfloat16), or with out_at [B] the dim floats of out's flat buffer from out_at[b] (several lookups "
      "side by side in one block); for max pooling argmax[b * dim + d] = the occurrence that gave the max");

  nb::class_<OptimizerArgs>(m, "OptimizerArgs")
      .def(nb::init<>())
      .def_prop_rw("kind", [](const OptimizerArgs& o) { return static_cast<int>(o.kind); },
                   [](OptimizerArgs& o, int k) {
                     if (k < 0 || k > 3)
                       throw nb::value_error(("optimizer kind must be in [0, 3], got " + std::to_string(k)).c_str());
                     o.kind = static_cast<OptimizerKind>(k);
                   })
      .def_rw("lr", &OptimizerArgs::lr)
      .def_rw("eps", &OptimizerArgs::eps)
      .def_rw("one_minus_beta1", &OptimizerArgs::one_minus_beta1)
      .def_rw("one_minus_beta2", &OptimizerArgs::one_minus_beta2)
      .def_rw("adam_step_size", &OptimizerArgs::adam_step_size)
      .def_rw("accumulator_divisor", &OptimizerArgs::accumulator_divisor)
      .def_rw("weight_decay", &OptimizerArgs::weight_decay)
      .def_rw("decoupled_weight_decay", &OptimizerArgs::decoupled_weight_decay)
      .def_rw("stochastic_rounding", &OptimizerArgs::stochastic_rounding)
      .def_rw("sr_seed", &OptimizerArgs::sr_seed)
      .def_rw("step", &OptimizerArgs::step);

  m.def("pool_backward_update", [](Rows pool, int64_t dim, Ids slots_u, Ids inverse, Ids offsets, std::optional<Floats> psw,
                                   int mode, int64_t skip_u, ConstRows grad_out, std::optional<Ids> argmax,
                                   const OptimizerArgs& opt, int64_t frozen_u, std::optional<MutFloats> psw_grad,
                                   int weights, std::optional<Ids> unique_ids, std::optional<Ids> out_at) {
        PoolingArgs a = pooling_args(pool, dim, slots_u, inverse, offsets, psw, mode, skip_u, weights);
        set_out(&a, "grad_output", grad_out.shape(0), grad_out.shape(1), out_at);
        check_argmax(a, argmax ? static_cast<int64_t>(argmax->shape(0)) : -1);
        if (psw_grad && static_cast<int64_t>(psw_grad->shape(0)) != a.num_ids)
          throw nb::value_error(("psw_grad has " + std::to_string(psw_grad->shape(0)) + " entries for " +
                                 std::to_string(a.num_ids) + " ids").c_str());
        if (unique_ids) {
          if (static_cast<int64_t>(unique_ids->shape(0)) != a.num_unique)
            throw nb::value_error(("unique_ids has " + std::to_string(unique_ids->shape(0)) + " entries for " +
                                   std::to_string(a.num_unique) + " unique rows (slots_u)").c_str());
          a.unique_ids = unique_ids->data();
        } else if (opt.stochastic_rounding && a.weights != WeightType::kFloat32) {
          throw nb::value_error(
              "stochastic rounding of 16-bit weights needs unique_ids (the row id of each unique row)");
        }
        const int64_t* am = argmax ? argmax->data() : nullptr;
        float* pg = psw_grad ? psw_grad->data() : nullptr;
        run_without_gil([&] {
          Status s = check_batch(a, static_cast<int64_t>(pool.shape(0)));
          if (s.ok()) s = check_out_at(a, "grad_output", static_cast<int64_t>(grad_out.shape(0) * grad_out.shape(1)));
          if (s.ok()) pool_backward_update(a, pool.data(), grad_out.data(), am, opt, frozen_u, pg);
          return s;
        });
      }, "pool"_a.noconvert(), "dim"_a, "slots_u"_a.noconvert(), "inverse"_a.noconvert(), "offsets"_a.noconvert(),
      "per_sample_weights"_a.noconvert().none(), "mode"_a, "skip_u"_a, "grad_out"_a.noconvert(),
      "argmax"_a.noconvert().none(), "opt"_a, "frozen_u"_a, "psw_grad"_a.noconvert().none(), "weights"_a = 0,
      "unique_ids"_a.noconvert().none() = nb::none(), "out_at"_a.noconvert().none() = nb::none(),
      "sums each unique row's gradient (bag b's: grad_out's row b, or with out_at the dim floats of its flat "
      "buffer from out_at[b]) and applies the optimizer to its row in place (16-bit weights: to the "
      "decoded float32 weights, then written back rounded to nearest even, or stochastically with "
      "opt.stochastic_rounding, which needs unique_ids [U], the row id of each unique row)");
}

}  // namespace tieredemb
