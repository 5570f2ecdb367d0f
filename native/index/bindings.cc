// Python bindings of the tier index (tieredemb._C): TierIndex and its kinds, CacheIndex,
// PartitionedIndex and DirectIndex, the Plan of a batch, and MAX_WINDOW_BATCHES.
// Only whole batches cross (1-D int64 id and slot arrays); every batch call releases the GIL,
// its checks included (common/bindings.h).
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <string>
#include <vector>

#include "common/bindings.h"
#include "index/cache_index.h"
#include "index/partitioned_index.h"

namespace tieredemb {

using namespace nb::literals;

namespace {

// A Plan as Python sees it, with what the caller moves precomputed: the missing rows (their ids
// and new slots) and the victims that must be written down (dirty ones).
struct PyPlan {
  Plan plan;
  std::vector<int64_t> miss_ids, miss_slots, dirty_ids, dirty_slots;

  void derive(const int64_t* ids) {
    miss_ids.reserve(plan.miss_index.size());
    miss_slots.reserve(plan.miss_index.size());
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
template <typename T>
nb::ndarray<nb::numpy, T, nb::ndim<1>> view(const std::vector<T>& v, nb::handle owner) {
  return nb::ndarray<nb::numpy, T, nb::ndim<1>>(const_cast<T*>(v.data()), {v.size()}, owner);
}

// Applies op to slots after checking that each is a slot of the tier; with the GIL released.
template <class Op>
void on_slots(TierIndex& t, const char* what, const Ids& slots, Op op) {
  run_without_gil([&] {
    const int64_t n = static_cast<int64_t>(slots.shape(0));
    Status s = check_slots(std::string(what) + ": slot", slots.data(), n, t.num_slots());
    if (s.ok()) op(slots.data(), n);
    return s;
  });
}

nb::dict stats_dict(const TierStats& s) {
  nb::dict d;
  d["hits"] = s.hits;
  d["misses"] = s.misses;
  d["writes"] = s.writes;
  d["evictions"] = s.evictions;
  d["dirty_writebacks"] = s.dirty_writebacks;
  d["clean_drops"] = s.clean_drops;
  d["overflow_rows"] = s.overflow_rows;
  return d;
}

}  // namespace

void register_index(nb::module_& m) {
  m.attr("MAX_WINDOW_BATCHES") = LookaheadWindow::kMaxBatches;

  nb::class_<PyPlan>(m, "Plan")
      .def_prop_ro("slots", [](nb::handle self) { return view(nb::cast<PyPlan&>(self).plan.slots, self); })
      .def_prop_ro("miss_index", [](nb::handle self) { return view(nb::cast<PyPlan&>(self).plan.miss_index, self); })
      .def_prop_ro("miss_ids", [](nb::handle self) { return view(nb::cast<PyPlan&>(self).miss_ids, self); })
      .def_prop_ro("miss_slots", [](nb::handle self) { return view(nb::cast<PyPlan&>(self).miss_slots, self); })
      .def_prop_ro("victim_ids", [](nb::handle self) { return view(nb::cast<PyPlan&>(self).plan.victim_ids, self); })
      .def_prop_ro("victim_slots", [](nb::handle self) { return view(nb::cast<PyPlan&>(self).plan.victim_slots, self); })
      .def_prop_ro("victim_dirty", [](nb::handle self) { return view(nb::cast<PyPlan&>(self).plan.victim_dirty, self); })
      .def_prop_ro("dirty_ids", [](nb::handle self) { return view(nb::cast<PyPlan&>(self).dirty_ids, self); })
      .def_prop_ro("dirty_slots", [](nb::handle self) { return view(nb::cast<PyPlan&>(self).dirty_slots, self); })
      .def_prop_ro("num_misses", [](const PyPlan& p) { return p.plan.miss_index.size(); })
      .def_prop_ro("num_victims", [](const PyPlan& p) { return p.plan.victim_slots.size(); })
      .def_prop_ro("num_dirty", [](const PyPlan& p) { return p.dirty_ids.size(); })
      .def_prop_ro("num_overflow", [](const PyPlan& p) { return p.plan.num_overflow; },
                   "misses given overflow slots (a caller may wait for room instead of committing)");

  nb::class_<TierIndex>(m, "TierIndex")
      .def_prop_ro("capacity", &TierIndex::capacity, "regular slots: [0, capacity)")
      .def_prop_ro("size", &TierIndex::size, "rows held, overflow slots included")
      .def_prop_ro("pinned", &TierIndex::pinned)
      .def_prop_ro("overflow", &TierIndex::overflow, "overflow slots in use")
      .def_prop_ro("overflow_limit", &TierIndex::overflow_limit, "most overflow slots in use at once")
      .def("plan", [](TierIndex& t, Ids ids) {
            auto p = std::make_unique<PyPlan>();
            run_without_gil([&] {
              Status s = t.plan(ids.data(), ids.shape(0), &p->plan);
              if (s.ok()) p->derive(ids.data());
              return s;
            });
            return p;
          }, "ids"_a.noconvert(), "chooses slots for unique ids without changing the index")
      .def("commit", [](TierIndex& t, Ids ids, const PyPlan& p, bool pin, bool dirty) {
            run_without_gil([&] { return t.commit(ids.data(), ids.shape(0), p.plan, pin, dirty); });
          }, "ids"_a.noconvert(), "plan"_a, "pin"_a, "dirty"_a)
      .def("evict", [](TierIndex& t, const PyPlan& p) { run_without_gil([&] { return t.evict(p.plan); }); }, "plan"_a,
           "applies only the plan's evictions (its victims leave; their slots become free)")
      .def("lookup", [](const TierIndex& t, Ids ids) {
            std::vector<int64_t> slots(ids.shape(0));
            {
              GilReleased released;
              t.lookup(ids.data(), ids.shape(0), slots.data());
            }
            return to_numpy(std::move(slots));
          }, "ids"_a.noconvert(), "slot of each id, -1 where not resident")
      .def("unpin", [](TierIndex& t, Ids slots) {
            on_slots(t, "unpin", slots, [&](const int64_t* s, int64_t n) { t.unpin(s, n); });
          }, "slots"_a.noconvert(),
          "drops a pin of each slot (in [0, capacity + overflow_limit)); free slots are ignored")
      .def("mark_dirty", [](TierIndex& t, Ids slots) {
            on_slots(t, "mark_dirty", slots, [&](const int64_t* s, int64_t n) { t.mark_dirty(s, n); });
          }, "slots"_a.noconvert(), "marks the rows in these slots dirty; free slots are ignored")
      .def("mark_clean", [](TierIndex& t, Ids slots) {
            on_slots(t, "mark_clean", slots, [&](const int64_t* s, int64_t n) { t.mark_clean(s, n); });
          }, "slots"_a.noconvert(), "marks the rows in these slots clean; free slots are ignored")
      .def("dirty_rows", [](const TierIndex& t) {
            std::vector<int64_t> ids, slots;
            {
              GilReleased released;
              t.dirty_rows(&ids, &slots);
            }
            return nb::make_tuple(to_numpy(std::move(ids)), to_numpy(std::move(slots)));
          }, "(ids, slots) of every dirty row, in increasing slot order")
      .def("resident_ids", [](const TierIndex& t, int64_t start, int64_t limit) {
            std::vector<int64_t> ids;
            {
              GilReleased released;
              t.resident_ids(start, limit, &ids);
            }
            return to_numpy(std::move(ids));
          }, "start"_a, "limit"_a, "sorted resident ids >= start, at most limit (-1: all)")
      .def("window_push", [](TierIndex& t, Ids ids) {
            run_without_gil([&] { return t.window_push(ids.data(), ids.shape(0)); });
          }, "ids"_a.noconvert(), "appends a future batch (unique ids) to the lookahead window")
      .def("window_pop", &TierIndex::window_pop, nb::call_guard<GilReleased>(),
           "drops the window's oldest batch; False if it was empty")
      .def("window_clear", &TierIndex::window_clear, nb::call_guard<GilReleased>())
      .def_prop_ro("window_batches", &TierIndex::window_batches)
      .def("stats", [](const TierIndex& t) {
            TierStats s;
            {
              GilReleased released;
              s = t.stats();
            }
            return stats_dict(s);
          }, "counters since construction or reset_stats(); overflow_rows: rows placed in overflow slots")
      .def("reset_stats", &TierIndex::reset_stats, nb::call_guard<GilReleased>())
      .def_prop_ro("partitions", &TierIndex::partitions, "parts with their own capacity and eviction order (0: not split)")
      .def("partition_stats", [](const TierIndex& t) {
            nb::list out;
            for (int64_t k = 0; k < t.partitions(); ++k) {
              nb::dict d = stats_dict(t.partition_stats(k));
              d["capacity"] = t.partition_capacity(k);
              d["resident"] = t.partition_size(k);
              out.append(d);
            }
            return out;
          }, "each part's counters, capacity and resident rows, in part (id) order");

  nb::class_<CacheIndex, TierIndex>(m, "CacheIndex")
      .def("__init__", [](CacheIndex* self, int64_t capacity, const std::string& policy, int64_t overflow_limit) {
            if (capacity <= 0)
              throw nb::value_error(("cache capacity must be > 0 rows, got " + std::to_string(capacity)).c_str());
            if (overflow_limit < 0)
              throw nb::value_error(
                  ("overflow_limit must be >= 0 rows, got " + std::to_string(overflow_limit)).c_str());
            bool known;
            {
              GilReleased released;  // O(capacity)
              auto p = make_policy(policy, capacity);
              known = p != nullptr;
              if (known) new (self) CacheIndex(capacity, std::move(p), overflow_limit);
            }
            if (!known) throw nb::value_error(("policy '" + policy + "' is not one of 'lru', 'lfu', 'clock'").c_str());
            if (!self->error().empty()) {
              std::string err = self->error();
              self->~CacheIndex();
              throw std::runtime_error(err);
            }
          }, "capacity"_a, "policy"_a, "overflow_limit"_a = 0,
          "a tier of capacity regular slots ordered by policy, lending up to overflow_limit overflow slots "
          "(capacity, capacity + 1, ...) to batches that do not fit; 0: such a batch is a ValueError")
      .def_prop_ro("policy", &CacheIndex::policy_name);

  nb::class_<PartitionedIndex, TierIndex>(m, "PartitionedIndex")
      .def("__init__", [](PartitionedIndex* self, std::vector<int64_t> ends, std::vector<int64_t> capacities,
                          const std::string& policy, std::vector<int64_t> overflow_limits) {
            {
              GilReleased released;  // O(capacity)
              new (self) PartitionedIndex(std::move(ends), std::move(capacities), policy, std::move(overflow_limits));
            }
            if (!self->error().empty()) {
              std::string err = self->error();
              self->~PartitionedIndex();
              throw nb::value_error(err.c_str());
            }
          }, "ends"_a, "capacities"_a, "policy"_a, "overflow_limits"_a,
          "a tier split by id range: partition k holds ids [ends[k-1], ends[k]) in capacities[k] regular "
          "slots of its own, ordered by policy, lending up to overflow_limits[k] overflow slots");

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
            {
              GilReleased released;
              t.dirty_ids(start, limit, &ids);
            }
            return to_numpy(std::move(ids));
          }, "start"_a, "limit"_a, "sorted dirty ids >= start, at most limit (-1: all)");
}

}  // namespace tieredemb
