// Python bindings of the native core (the private module tieredemb._C).
// Only whole batches cross: 1-D int64 id arrays and 2-D float32 row blocks (DLPack: torch
// tensors pass without copies). Every batch call releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>

#include <memory>
#include <optional>
#include <nanobind/stl/optional.h>
#include <stdexcept>
#include <vector>

#include "cache_index.h"
#include "host_buffer.h"
#include "kernels.h"
#include "row_moves.h"
#include "thread_pool.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace tieredemb;

void register_ssd(nb::module_& m);  // slot_file_bindings.cc: the native SSD backend
void register_random(nb::module_& m);  // random_bindings.cc: counter-based initial-value draws

namespace {

using Ids = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using MutIds = nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Rows = nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using ConstRows = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Floats = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using MutFloats = nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Int64Array = nb::ndarray<nb::numpy, int64_t, nb::ndim<1>>;

void raise(const Status& s) {
  switch (s.code) {
    case Status::kOk: return;
    case Status::kIndexError: throw nb::index_error(s.message.c_str());
    case Status::kValueError: throw nb::value_error(s.message.c_str());
    case Status::kRuntimeError: throw std::runtime_error(s.message);
  }
}

template <typename T>
nb::ndarray<nb::numpy, T, nb::ndim<1>> to_numpy(std::vector<T>&& v) {
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T, nb::ndim<1>>(heap->data(), {heap->size()}, owner);
}

void check_rows(const char* what, int64_t got_rows, int64_t want_rows, int64_t got_width, int64_t want_width) {
  if (got_rows != want_rows || (want_width >= 0 && got_width != want_width)) {
    throw nb::value_error((std::string(what) + ": expected [" + std::to_string(want_rows) + ", " +
                           std::to_string(want_width) + "] rows, got [" + std::to_string(got_rows) + ", " +
                           std::to_string(got_width) + "]").c_str());
  }
}

void check_slots(const char* what, const int64_t* slots, int64_t n, int64_t rows) {
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] < 0 || slots[i] >= rows) {
      throw nb::index_error((std::string(what) + ": row " + std::to_string(slots[i]) + " out of range [0, " +
                             std::to_string(rows) + ")").c_str());
    }
  }
}

PoolingArgs pooling_args(const Rows& pool, int64_t dim, const Ids& slots_u, const Ids& inverse, const Ids& offsets,
                         std::optional<Floats> psw, int mode, int64_t skip_u) {
  if (mode < 0 || mode > 2) throw nb::value_error("mode must be 0 (sum), 1 (mean) or 2 (max)");
  if (dim <= 0 || dim > static_cast<int64_t>(pool.shape(1))) throw nb::value_error("dim does not fit the pool width");
  if (offsets.shape(0) < 1) throw nb::value_error("offsets must have num_bags + 1 entries");
  check_slots("slots", slots_u.data(), slots_u.shape(0), pool.shape(0));
  PoolingArgs a;
  a.dim = dim;
  a.width = pool.shape(1);
  a.slots_u = slots_u.data();
  a.num_unique = slots_u.shape(0);
  a.inverse = inverse.data();
  a.num_ids = inverse.shape(0);
  a.offsets = offsets.data();
  a.num_bags = offsets.shape(0) - 1;
  for (int64_t b = 0; b <= a.num_bags; ++b) {
    if (a.offsets[b] < 0 || a.offsets[b] > a.num_ids || (b > 0 && a.offsets[b] < a.offsets[b - 1]))
      throw nb::value_error("offsets must be non-decreasing within [0, num_ids]");
  }
  for (int64_t i = 0; i < a.num_ids; ++i) {
    if (a.inverse[i] < 0 || a.inverse[i] >= a.num_unique) throw nb::index_error("inverse out of range");
  }
  if (psw) {
    if (static_cast<int64_t>(psw->shape(0)) != a.num_ids) throw nb::value_error("per_sample_weights must have num_ids entries");
    a.per_sample_weights = psw->data();
  }
  a.mode = static_cast<PoolingMode>(mode);
  a.skip_u = skip_u;
  return a;
}

// Bound wrapper of a Plan with its arrays as numpy copies.
// A Plan as Python sees it, with what the caller moves precomputed: the missing rows (their ids
// and new slots) and the victims that must be written down (dirty ones).
struct PyPlan {
  Plan plan;
  std::vector<int64_t> miss_ids, miss_slots, dirty_ids, dirty_slots;

  void derive(const int64_t* ids) {
    for (int64_t i : plan.miss_index) {
      miss_ids.push_back(ids[i]);
      miss_slots.push_back(plan.slots[i]);
    }
    for (size_t v = 0; v < plan.victim_slots.size(); ++v) {
      if (plan.victim_dirty[v]) {
        dirty_ids.push_back(plan.victim_ids[v]);
        dirty_slots.push_back(plan.victim_slots[v]);
      }
    }
  }
};

// A numpy view of a vector owned by a bound object (no copy; writable only because torch
// warns on read-only arrays: nothing writes to it).
nb::ndarray<nb::numpy, int64_t, nb::ndim<1>> view(const std::vector<int64_t>& v, nb::handle owner) {
  return nb::ndarray<nb::numpy, int64_t, nb::ndim<1>>(const_cast<int64_t*>(v.data()), {v.size()}, owner);
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "tieredemb native core: tier indexes, eviction policies, batch kernels";
  // Tables alive at interpreter exit (module globals, autograd graphs) are not leaks.
  nb::set_leak_warnings(false);

  m.attr("MAX_WINDOW_BATCHES") = LookaheadWindow::kMaxBatches;
  m.def("set_num_threads", [](int n) { ThreadPool::instance().set_num_threads(n); }, "n"_a);
  m.def("get_num_threads", [] { return ThreadPool::instance().num_threads(); });

  m.def("dedup", [](Ids ids, int64_t num_embeddings) {
        std::vector<int64_t> unique, inverse(ids.shape(0));
        Status s;
        {
          nb::gil_scoped_release release;
          s = dedup(ids.data(), ids.shape(0), num_embeddings, &unique, inverse.data());
        }
        raise(s);
        return nb::make_tuple(to_numpy(std::move(unique)), to_numpy(std::move(inverse)));
      }, "ids"_a.noconvert(), "num_embeddings"_a,
      "unique ids in order of first occurrence and the inverse map; IndexError for an id out of range");

  m.def("host_pool", [](int64_t rows, int64_t width, bool populate, bool huge_pages) {
        if (rows < 0 || width <= 0) throw nb::value_error("host_pool needs rows >= 0 and width > 0");
        auto* buf = new HostBuffer();
        std::string err;
        {
          nb::gil_scoped_release release;
          err = buf->allocate(static_cast<size_t>(rows) * width * sizeof(float), populate, huge_pages);
        }
        if (!err.empty()) {
          delete buf;
          throw std::runtime_error(err);
        }
        nb::capsule owner(buf, [](void* p) noexcept { delete static_cast<HostBuffer*>(p); });
        return nb::ndarray<nb::numpy, float, nb::ndim<2>>(buf->data(), {static_cast<size_t>(rows), static_cast<size_t>(width)}, owner);
      }, "rows"_a, "width"_a, "populate"_a = false, "huge_pages"_a = false,
      "a zero-filled float32 [rows, width] array, reserved lazily (O(1) to create) unless populate");

  m.def("init_rows", [](Ids ids, Rows out, int64_t dim, int kind, double a, double b, uint64_t seed, int64_t zero_id) {
        check_rows("init_rows out", out.shape(0), ids.shape(0), out.shape(1), -1);
        if (dim > static_cast<int64_t>(out.shape(1))) throw nb::value_error("dim exceeds the row width");
        if (kind < 0 || kind > 2) throw nb::value_error("init kind must be 0 (normal), 1 (uniform) or 2 (zeros)");
        InitSpec spec{static_cast<InitKind>(kind), a, b, seed, zero_id};
        nb::gil_scoped_release release;
        init_rows(spec, ids.data(), ids.shape(0), dim, out.shape(1), out.data());
      }, "ids"_a.noconvert(), "out"_a.noconvert(), "dim"_a, "kind"_a, "a"_a, "b"_a, "seed"_a, "zero_id"_a);

  m.def("copy_rows", [](ConstRows src, Ids src_rows, Rows dst, Ids dst_rows) {
        if (src.shape(1) != dst.shape(1)) throw nb::value_error("copy_rows: src and dst widths differ");
        if (src_rows.shape(0) != dst_rows.shape(0)) throw nb::value_error("copy_rows: row lists differ in length");
        check_slots("copy_rows src", src_rows.data(), src_rows.shape(0), src.shape(0));
        check_slots("copy_rows dst", dst_rows.data(), dst_rows.shape(0), dst.shape(0));
        nb::gil_scoped_release release;
        copy_rows(src.data(), src_rows.data(), dst.data(), dst_rows.data(), src_rows.shape(0), src.shape(1));
      }, "src"_a.noconvert(), "src_rows"_a.noconvert(), "dst"_a.noconvert(), "dst_rows"_a.noconvert(),
      "dst[dst_rows[i]] = src[src_rows[i]]");

  m.def("read_or_init", [](ConstRows src, Ids src_rows, Ids ids, Rows dst, Ids dst_rows, int64_t dim, int kind,
                           double a, double b, uint64_t seed, int64_t zero_id) {
        if (src.shape(1) != dst.shape(1)) throw nb::value_error("read_or_init: src and dst widths differ");
        int64_t n = src_rows.shape(0);
        if (static_cast<int64_t>(ids.shape(0)) != n || static_cast<int64_t>(dst_rows.shape(0)) != n)
          throw nb::value_error("read_or_init: src_rows, ids and dst_rows differ in length");
        if (dim > static_cast<int64_t>(dst.shape(1))) throw nb::value_error("dim exceeds the row width");
        if (kind < 0 || kind > 2) throw nb::value_error("init kind must be 0 (normal), 1 (uniform) or 2 (zeros)");
        for (int64_t i = 0; i < n; ++i) {
          if (src_rows.data()[i] >= static_cast<int64_t>(src.shape(0)))
            throw nb::index_error("read_or_init: src row out of range");
        }
        check_slots("read_or_init dst", dst_rows.data(), n, dst.shape(0));
        InitSpec spec{static_cast<InitKind>(kind), a, b, seed, zero_id};
        nb::gil_scoped_release release;
        return read_or_init(src.data(), src_rows.data(), ids.data(), dst.data(), dst_rows.data(), n, dim,
                            dst.shape(1), spec);
      }, "src"_a.noconvert(), "src_rows"_a.noconvert(), "ids"_a.noconvert(), "dst"_a.noconvert(),
      "dst_rows"_a.noconvert(), "dim"_a, "kind"_a, "a"_a, "b"_a, "seed"_a, "zero_id"_a,
      "dst[dst_rows[i]] = src[src_rows[i]], or the initial row of ids[i] where src_rows[i] < 0; returns rows copied");

  m.def("state_width", [](int kind, int64_t dim) { return state_width(static_cast<OptimizerKind>(kind), dim); });

  m.def("pool_forward", [](Rows pool, int64_t dim, Ids slots_u, Ids inverse, Ids offsets, std::optional<Floats> psw,
                           int mode, int64_t skip_u, Rows out, std::optional<MutIds> argmax) {
        PoolingArgs a = pooling_args(pool, dim, slots_u, inverse, offsets, psw, mode, skip_u);
        check_rows("pool_forward out", out.shape(0), a.num_bags, out.shape(1), dim);
        if (a.mode == PoolingMode::kMax && (!argmax || static_cast<int64_t>(argmax->shape(0)) != a.num_bags * dim))
          throw nb::value_error("max pooling needs argmax of num_bags * dim entries");
        int64_t* am = argmax ? argmax->data() : nullptr;
        nb::gil_scoped_release release;
        pool_forward(a, pool.data(), out.data(), am);
      }, "pool"_a.noconvert(), "dim"_a, "slots_u"_a.noconvert(), "inverse"_a.noconvert(), "offsets"_a.noconvert(),
      "per_sample_weights"_a.noconvert().none(), "mode"_a, "skip_u"_a, "out"_a.noconvert(), "argmax"_a.noconvert().none());

  nb::class_<OptimizerArgs>(m, "OptimizerArgs")
      .def(nb::init<>())
      .def_prop_rw("kind", [](const OptimizerArgs& o) { return static_cast<int>(o.kind); },
                   [](OptimizerArgs& o, int k) {
                     if (k < 0 || k > 3) throw nb::value_error("optimizer kind must be in [0, 3]");
                     o.kind = static_cast<OptimizerKind>(k);
                   })
      .def_rw("lr", &OptimizerArgs::lr)
      .def_rw("eps", &OptimizerArgs::eps)
      .def_rw("beta1", &OptimizerArgs::beta1)
      .def_rw("beta2", &OptimizerArgs::beta2)
      .def_rw("adam_step_size", &OptimizerArgs::adam_step_size);

  m.def("pool_backward_update", [](Rows pool, int64_t dim, Ids slots_u, Ids inverse, Ids offsets, std::optional<Floats> psw,
                                   int mode, int64_t skip_u, ConstRows grad_out, std::optional<Ids> argmax,
                                   const OptimizerArgs& opt, int64_t frozen_u, std::optional<MutFloats> psw_grad) {
        PoolingArgs a = pooling_args(pool, dim, slots_u, inverse, offsets, psw, mode, skip_u);
        check_rows("grad_output", grad_out.shape(0), a.num_bags, grad_out.shape(1), dim);
        if (a.mode == PoolingMode::kMax && (!argmax || static_cast<int64_t>(argmax->shape(0)) != a.num_bags * dim))
          throw nb::value_error("max pooling needs the argmax of its forward");
        if (psw_grad && static_cast<int64_t>(psw_grad->shape(0)) != a.num_ids)
          throw nb::value_error("psw_grad must have num_ids entries");
        const int64_t* am = argmax ? argmax->data() : nullptr;
        float* pg = psw_grad ? psw_grad->data() : nullptr;
        nb::gil_scoped_release release;
        pool_backward_update(a, pool.data(), grad_out.data(), am, opt, frozen_u, pg);
      }, "pool"_a.noconvert(), "dim"_a, "slots_u"_a.noconvert(), "inverse"_a.noconvert(), "offsets"_a.noconvert(),
      "per_sample_weights"_a.noconvert().none(), "mode"_a, "skip_u"_a, "grad_out"_a.noconvert(),
      "argmax"_a.noconvert().none(), "opt"_a, "frozen_u"_a, "psw_grad"_a.noconvert().none());

  nb::class_<PyPlan>(m, "Plan")
      .def_prop_ro("slots", [](nb::handle self) { return view(nb::cast<PyPlan&>(self).plan.slots, self); })
      .def_prop_ro("miss_index", [](nb::handle self) { return view(nb::cast<PyPlan&>(self).plan.miss_index, self); })
      .def_prop_ro("miss_ids", [](nb::handle self) { return view(nb::cast<PyPlan&>(self).miss_ids, self); })
      .def_prop_ro("miss_slots", [](nb::handle self) { return view(nb::cast<PyPlan&>(self).miss_slots, self); })
      .def_prop_ro("victim_ids", [](nb::handle self) { return view(nb::cast<PyPlan&>(self).plan.victim_ids, self); })
      .def_prop_ro("victim_slots", [](nb::handle self) { return view(nb::cast<PyPlan&>(self).plan.victim_slots, self); })
      .def_prop_ro("victim_dirty", [](const PyPlan& p) { return to_numpy(std::vector<uint8_t>(p.plan.victim_dirty)); }, nb::rv_policy::move)
      .def_prop_ro("dirty_ids", [](nb::handle self) { return view(nb::cast<PyPlan&>(self).dirty_ids, self); })
      .def_prop_ro("dirty_slots", [](nb::handle self) { return view(nb::cast<PyPlan&>(self).dirty_slots, self); })
      .def_prop_ro("num_misses", [](const PyPlan& p) { return p.plan.miss_index.size(); })
      .def_prop_ro("num_victims", [](const PyPlan& p) { return p.plan.victim_slots.size(); })
      .def_prop_ro("num_dirty", [](const PyPlan& p) { return p.dirty_ids.size(); });

  nb::class_<TierIndex>(m, "TierIndex")
      .def_prop_ro("capacity", &TierIndex::capacity)
      .def_prop_ro("size", &TierIndex::size)
      .def_prop_ro("pinned", &TierIndex::pinned)
      .def("plan", [](TierIndex& t, Ids ids) {
            auto p = std::make_unique<PyPlan>();
            Status s;
            {
              nb::gil_scoped_release release;
              s = t.plan(ids.data(), ids.shape(0), &p->plan);
              if (s.ok()) p->derive(ids.data());
            }
            raise(s);
            return p;
          }, "ids"_a.noconvert(), "chooses slots for unique ids without changing the index")
      .def("commit", [](TierIndex& t, Ids ids, const PyPlan& p, bool pin, bool dirty) {
            Status s;
            {
              nb::gil_scoped_release release;
              s = t.commit(ids.data(), ids.shape(0), p.plan, pin, dirty);
            }
            raise(s);
          }, "ids"_a.noconvert(), "plan"_a, "pin"_a, "dirty"_a)
      .def("evict", [](TierIndex& t, const PyPlan& p) { raise(t.evict(p.plan)); }, "plan"_a,
           "applies only the plan's evictions (its victims leave; their slots become free)")
      .def("lookup", [](const TierIndex& t, Ids ids) {
            std::vector<int64_t> slots(ids.shape(0));
            {
              nb::gil_scoped_release release;
              t.lookup(ids.data(), ids.shape(0), slots.data());
            }
            return to_numpy(std::move(slots));
          }, "ids"_a.noconvert(), "slot of each id, -1 where not resident")
      .def("unpin", [](TierIndex& t, Ids slots) {
            check_slots("unpin", slots.data(), slots.shape(0), t.capacity());
            t.unpin(slots.data(), slots.shape(0));
          }, "slots"_a.noconvert())
      .def("mark_dirty", [](TierIndex& t, Ids slots) {
            check_slots("mark_dirty", slots.data(), slots.shape(0), t.capacity());
            t.mark_dirty(slots.data(), slots.shape(0));
          }, "slots"_a.noconvert())
      .def("mark_clean", [](TierIndex& t, Ids slots) {
            check_slots("mark_clean", slots.data(), slots.shape(0), t.capacity());
            t.mark_clean(slots.data(), slots.shape(0));
          }, "slots"_a.noconvert())
      .def("dirty_rows", [](const TierIndex& t) {
            std::vector<int64_t> ids, slots;
            t.dirty_rows(&ids, &slots);
            return nb::make_tuple(to_numpy(std::move(ids)), to_numpy(std::move(slots)));
          }, "(ids, slots) of every dirty row")
      .def("resident_ids", [](const TierIndex& t, int64_t start, int64_t limit) {
            std::vector<int64_t> ids;
            t.resident_ids(start, limit, &ids);
            return to_numpy(std::move(ids));
          }, "start"_a, "limit"_a, "sorted resident ids >= start, at most limit (-1: all)")
      .def("window_push", [](TierIndex& t, Ids ids) {
            Status s;
            {
              nb::gil_scoped_release release;
              s = t.window_push(ids.data(), ids.shape(0));
            }
            raise(s);
          }, "ids"_a.noconvert(), "appends a future batch (unique ids) to the lookahead window")
      .def("window_pop", [](TierIndex& t) {
            nb::gil_scoped_release release;
            return t.window_pop();
          }, "drops the window's oldest batch; False if it was empty")
      .def("window_clear", &TierIndex::window_clear)
      .def_prop_ro("window_batches", &TierIndex::window_batches)
      .def("stats", [](const TierIndex& t) {
            const TierStats& s = t.stats();
            nb::dict d;
            d["hits"] = s.hits;
            d["misses"] = s.misses;
            d["writes"] = s.writes;
            d["evictions"] = s.evictions;
            d["dirty_writebacks"] = s.dirty_writebacks;
            d["clean_drops"] = s.clean_drops;
            return d;
          })
      .def("reset_stats", &TierIndex::reset_stats);

  nb::class_<CacheIndex, TierIndex>(m, "CacheIndex")
      .def("__init__", [](CacheIndex* self, int64_t capacity, const std::string& policy) {
            if (capacity <= 0) throw nb::value_error(("cache capacity must be > 0 rows, got " + std::to_string(capacity)).c_str());
            auto p = make_policy(policy, capacity);
            if (!p) throw nb::value_error(("policy '" + policy + "' is not one of 'lru', 'lfu', 'clock'").c_str());
            new (self) CacheIndex(capacity, std::move(p));
          }, "capacity"_a, "policy"_a)
      .def_prop_ro("policy", &CacheIndex::policy_name);

  nb::class_<DirectIndex, TierIndex>(m, "DirectIndex")
      .def("__init__", [](DirectIndex* self, int64_t num_rows) {
            if (num_rows <= 0) throw nb::value_error(("num_rows must be > 0, got " + std::to_string(num_rows)).c_str());
            new (self) DirectIndex(num_rows);
            if (!self->error().empty()) {
              std::string err = self->error();
              self->~DirectIndex();
              throw std::runtime_error(err);
            }
          }, "num_rows"_a)
      .def("dirty_ids", [](const DirectIndex& t, int64_t start, int64_t limit) {
            std::vector<int64_t> ids;
            t.dirty_ids(start, limit, &ids);
            return to_numpy(std::move(ids));
          }, "start"_a, "limit"_a, "sorted dirty ids >= start, at most limit (-1: all)");

  register_ssd(m);
  register_random(m);
}
