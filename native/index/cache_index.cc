#include "index/cache_index.h"

#include <algorithm>
#include <iterator>
#include <string>

namespace tieredemb {

// Slots and map buckets are random over the tier: each loop below starts loading what it will
// touch this many entries ahead, so that many cache misses are in flight at once.
constexpr int64_t kAhead = 16;

void TierIndex::count_commit(int64_t n, int64_t misses, int64_t overflow, bool dirty) {
  if (dirty) {
    stats_.writes += n;
  } else {
    stats_.hits += n - misses;
    stats_.misses += misses;
  }
  stats_.overflow_rows += overflow;
}

CacheIndex::CacheIndex(int64_t capacity, std::unique_ptr<EvictionPolicy> policy, int64_t overflow_limit)
    : capacity_(capacity), overflow_limit_(overflow_limit), policy_(std::move(policy)), map_(capacity),
      slots_end_(capacity), slot_id_(capacity, -1), pins_(capacity, 0), batch_mark_(capacity, 0) {
  free_.reserve(capacity);
  for (int64_t s = capacity - 1; s >= 0; --s) free_.push_back(s);
  for (SlotSet* set : {&dirty_, &overflow_used_, &overflow_free_}) {
    if (error_.empty()) error_ = set->allocate(capacity + overflow_limit);
  }
}

Status CacheIndex::plan(const int64_t* ids, int64_t n, Plan* plan) {
  policy_->forget();  // (an earlier plan's selection, never committed: raised, or evicted instead)
  ++stamp_;
  plan->slots.resize(n);
  plan->miss_index.clear();
  plan->victim_ids.clear();
  plan->victim_slots.clear();
  plan->victim_dirty.clear();
  plan->version = version_;
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) map_.prefetch(ids[i + kAhead]);
    int64_t slot = map_.find(ids[i]);
    plan->slots[i] = slot;
    if (slot == FlatMap::kEmpty) {
      plan->miss_index.push_back(i);
    } else {
      batch_mark_[slot] = stamp_;
    }
  }
  const uint64_t stamp = stamp_;
  const int64_t misses = static_cast<int64_t>(plan->miss_index.size());
  const int64_t from_free = std::min<int64_t>(misses, static_cast<int64_t>(free_.size()));
  int64_t need = misses - from_free;
  if (need > 0) {
    auto evictable = [this, stamp](int64_t s) {
      return slot_id_[s] >= 0 && pins_[s] == 0 && batch_mark_[s] != stamp;
    };
    need -= select_victims(need, evictable, &plan->victim_slots);
  }
  const int64_t regular_victims = static_cast<int64_t>(plan->victim_slots.size());
  // Overflow rows that no batch pins and this one does not use leave now, whatever it needs.
  std::vector<int64_t> lingering;
  overflow_used_.for_each(capacity_, [&](int64_t s) {
    if (pins_[s] == 0 && batch_mark_[s] != stamp) lingering.push_back(s);
    return true;
  });
  const int64_t overflow_room = overflow_limit_ - (overflow_used_.size() - static_cast<int64_t>(lingering.size()));
  if (need > overflow_room) {
    plan->victim_slots.clear();
    std::string overflow_clause, advice = "give the tier more rows or use smaller batches";
    if (overflow_limit_ > 0) {
      overflow_clause = " and " + std::to_string(overflow_room) + " of its " + std::to_string(overflow_limit_) +
                        " overflow slots are free";
      advice = "give the tier more rows or overflow slots, or use smaller batches";
    }
    return Status::ValueError(
        "a batch needs " + std::to_string(misses) + " new rows in a tier of capacity " + std::to_string(capacity_) +
        " but only " + std::to_string(from_free + regular_victims) + " slots are free or evictable" + overflow_clause +
        " (" + std::to_string(n - misses) + " rows of the batch resident, " + std::to_string(pinned_) +
        " slots pinned by batches in flight); " + advice);
  }
  std::vector<int64_t> overflow_slots;
  if (need > 0) choose_overflow(need, lingering, &overflow_slots);
  for (int64_t k = 0; k < misses; ++k) {
    int64_t slot;
    if (k < from_free) {
      slot = free_[free_.size() - 1 - k];
    } else if (k < from_free + regular_victims) {
      slot = plan->victim_slots[k - from_free];
    } else {
      slot = overflow_slots[k - from_free - regular_victims];
    }
    plan->slots[plan->miss_index[k]] = slot;
  }
  plan->victim_slots.insert(plan->victim_slots.end(), lingering.begin(), lingering.end());
  for (int64_t s : plan->victim_slots) {
    plan->victim_ids.push_back(slot_id_[s]);
    plan->victim_dirty.push_back(dirty_.contains(s));
  }
  plan->from_free = from_free;
  plan->num_overflow = need;
  return Status::Ok();
}

int64_t CacheIndex::select_victims(int64_t need, const SlotFilter& evictable, std::vector<int64_t>* out) {
  if (window_.empty()) return policy_->select(need, evictable, out);
  int64_t got = policy_->select(need, [&](int64_t s) { return evictable(s) && window_.next_use(slot_id_[s]) < 0; },
                                out);
  if (got == need) return got;
  // Every row outside the window is taken: rank the rest, farthest next use first. The policy
  // lists them in its order and the sort is stable, so ties keep that order.
  std::vector<int64_t> in_window;
  policy_->order([&](int64_t s) { return evictable(s) && window_.next_use(slot_id_[s]) >= 0; }, &in_window);
  ranked_.clear();
  for (int64_t s : in_window) ranked_.emplace_back(window_.next_use(slot_id_[s]), s);
  std::stable_sort(ranked_.begin(), ranked_.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (size_t k = 0; k < ranked_.size() && got < need; ++k, ++got) out->push_back(ranked_[k].second);
  return got;
}

void CacheIndex::choose_overflow(int64_t need, const std::vector<int64_t>& lingering, std::vector<int64_t>* out) const {
  std::vector<int64_t> free_now;
  overflow_free_.for_each(capacity_, [&](int64_t s) {
    free_now.push_back(s);
    return static_cast<int64_t>(free_now.size()) < need;
  });
  std::merge(free_now.begin(), free_now.end(), lingering.begin(), lingering.end(), std::back_inserter(*out));
  if (static_cast<int64_t>(out->size()) > need) out->resize(need);
  for (int64_t next = slots_end_; static_cast<int64_t>(out->size()) < need; ++next) out->push_back(next);
}

Status CacheIndex::commit(const int64_t* ids, int64_t n, const Plan& plan, bool pin, bool dirty) {
  if (plan.version != version_ || static_cast<int64_t>(plan.slots.size()) != n) {
    return Status::RuntimeError("stale batch plan: the tier changed between plan and commit");
  }
  ++version_;
  policy_->accept();
  const int64_t misses = static_cast<int64_t>(plan.miss_index.size());
  free_.resize(free_.size() - plan.from_free);
  const size_t victims = plan.victim_slots.size();
  for (size_t v = 0; v < victims; ++v) {
    if (v + kAhead < victims) map_.prefetch(plan.victim_ids[v + kAhead]);
    forget_victim(plan, v);
    // A regular victim's slot goes to a miss below; an overflow victim's is freed, and may be
    // taken again just after.
    if (plan.victim_slots[v] >= capacity_) free_slot(plan.victim_slots[v]);
  }
  if (plan.num_overflow > 0) {
    // The plan's overflow slots ascend: the last one tells how many slots now exist.
    const int64_t last = plan.slots[plan.miss_index[misses - 1]];
    if (last >= slots_end_) {
      slots_end_ = last + 1;
      slot_id_.resize(slots_end_, -1);
      pins_.resize(slots_end_, 0);
      batch_mark_.resize(slots_end_, 0);
    }
    for (int64_t k = misses - plan.num_overflow; k < misses; ++k) {
      const int64_t slot = plan.slots[plan.miss_index[k]];
      overflow_free_.erase(slot);
      overflow_used_.insert(slot);
    }
  }
  // The policy sees the batch's rows in batch order, hits and new rows interleaved as they
  // come: with LRU the cache after every batch is then the `capacity` most recently used rows,
  // whatever the capacity (a stack algorithm), so one pass over a trace gives its hit ratio at
  // every size (tieredemb.sim).
  used_fresh_.assign(static_cast<size_t>(n), 0);
  size_t next_miss = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      map_.prefetch(ids[i + kAhead]);
      __builtin_prefetch(&pins_[plan.slots[i + kAhead]], 1);
    }
    int64_t slot = plan.slots[i];
    if (next_miss < plan.miss_index.size() && plan.miss_index[next_miss] == i) {
      ++next_miss;
      map_.insert(ids[i], slot);
      slot_id_[slot] = ids[i];
      if (!dirty) dirty_.erase(slot);  // the victim's flag
      used_fresh_[static_cast<size_t>(i)] = 1;
    }
    if (dirty) dirty_.insert(slot);
    if (pin && pins_[slot]++ == 0) ++pinned_;
  }
  if (overflow_used_.size() == 0) {
    policy_->use(plan.slots.data(), used_fresh_.data(), n);
  } else {
    // The policy orders the regular slots only.
    policy_slots_.clear();
    policy_fresh_.clear();
    for (int64_t i = 0; i < n; ++i) {
      if (plan.slots[i] < capacity_) {
        policy_slots_.push_back(plan.slots[i]);
        policy_fresh_.push_back(used_fresh_[static_cast<size_t>(i)]);
      }
    }
    policy_->use(policy_slots_.data(), policy_fresh_.data(), static_cast<int64_t>(policy_slots_.size()));
  }
  count_commit(n, misses, plan.num_overflow, dirty);
  return Status::Ok();
}

void CacheIndex::forget_victim(const Plan& plan, size_t v) {
  map_.erase(plan.victim_ids[v]);
  ++stats_.evictions;
  if (plan.victim_dirty[v]) ++stats_.dirty_writebacks; else ++stats_.clean_drops;
}

void CacheIndex::free_slot(int64_t slot) {
  slot_id_[slot] = -1;
  dirty_.erase(slot);
  if (slot < capacity_) {
    policy_->remove(slot);
    free_.push_back(slot);
  } else {
    overflow_used_.erase(slot);
    overflow_free_.insert(slot);
  }
}

Status CacheIndex::evict(const Plan& plan) {
  if (plan.version != version_) {
    return Status::RuntimeError("stale batch plan: the tier changed between plan and evict");
  }
  ++version_;
  for (size_t v = 0; v < plan.victim_slots.size(); ++v) {
    forget_victim(plan, v);
    free_slot(plan.victim_slots[v]);
  }
  return Status::Ok();
}

void CacheIndex::lookup(const int64_t* ids, int64_t n, int64_t* slots) const {
  for (int64_t i = 0; i < n; ++i) slots[i] = map_.find(ids[i]);
}

void CacheIndex::unpin(const int64_t* slots, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    int64_t s = slots[i];
    if (s < slots_end_ && pins_[s] > 0 && --pins_[s] == 0) --pinned_;
  }
}

void CacheIndex::mark_dirty(const int64_t* slots, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (holds_row(slots[i])) dirty_.insert(slots[i]);
}

void CacheIndex::mark_clean(const int64_t* slots, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dirty_.erase(slots[i]);  // a slot holding no row is never dirty
}

void CacheIndex::dirty_rows(std::vector<int64_t>* ids, std::vector<int64_t>* slots) const {
  dirty_.for_each(0, [&](int64_t s) {
    ids->push_back(slot_id_[s]);
    slots->push_back(s);
    return true;
  });
}

void CacheIndex::resident_ids(int64_t start, int64_t limit, std::vector<int64_t>* ids) const {
  std::vector<int64_t> all;
  for (int64_t s = 0; s < slots_end_; ++s)
    if (slot_id_[s] >= start) all.push_back(slot_id_[s]);
  std::sort(all.begin(), all.end());
  if (limit >= 0 && static_cast<int64_t>(all.size()) > limit) all.resize(limit);
  ids->insert(ids->end(), all.begin(), all.end());
}

namespace {

// Appends the members of set >= start in increasing order, at most limit of them (-1: all).
void list_members(const SlotSet& set, int64_t start, int64_t limit, std::vector<int64_t>* ids) {
  if (limit == 0) return;
  int64_t found = 0;
  set.for_each(start, [&](int64_t s) {
    ids->push_back(s);
    return limit < 0 || ++found < limit;
  });
}

}  // namespace

DirectIndex::DirectIndex(int64_t num_rows) : num_rows_(num_rows) {
  error_ = resident_.allocate(num_rows);
  if (error_.empty()) error_ = dirty_.allocate(num_rows);
}

Status DirectIndex::plan(const int64_t* ids, int64_t n, Plan* plan) {
  plan->slots.assign(ids, ids + n);
  plan->miss_index.clear();
  plan->victim_ids.clear();
  plan->victim_slots.clear();
  plan->victim_dirty.clear();
  plan->num_overflow = 0;
  plan->version = version_;
  for (int64_t i = 0; i < n; ++i)
    if (!resident_.contains(ids[i])) plan->miss_index.push_back(i);
  plan->from_free = static_cast<int64_t>(plan->miss_index.size());  // each takes its own slot
  return Status::Ok();
}

Status DirectIndex::commit(const int64_t* ids, int64_t n, const Plan& plan, bool, bool dirty) {
  if (plan.version != version_ || static_cast<int64_t>(plan.slots.size()) != n) {
    return Status::RuntimeError("stale batch plan: the tier changed between plan and commit");
  }
  ++version_;
  for (int64_t i : plan.miss_index) resident_.insert(ids[i]);
  if (dirty) mark_dirty(ids, n);
  count_commit(n, static_cast<int64_t>(plan.miss_index.size()), 0, dirty);
  return Status::Ok();
}

void DirectIndex::lookup(const int64_t* ids, int64_t n, int64_t* slots) const {
  for (int64_t i = 0; i < n; ++i) slots[i] = resident_.contains(ids[i]) ? ids[i] : -1;
}

void DirectIndex::mark_dirty(const int64_t* slots, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dirty_.insert(slots[i]);
}

void DirectIndex::mark_clean(const int64_t* slots, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dirty_.erase(slots[i]);
}

void DirectIndex::dirty_rows(std::vector<int64_t>* ids, std::vector<int64_t>* slots) const {
  list_members(dirty_, 0, -1, ids);
  slots->insert(slots->end(), ids->end() - dirty_.size(), ids->end());
}

void DirectIndex::dirty_ids(int64_t start, int64_t limit, std::vector<int64_t>* ids) const {
  list_members(dirty_, start, limit, ids);
}

void DirectIndex::resident_ids(int64_t start, int64_t limit, std::vector<int64_t>* ids) const {
  list_members(resident_, start, limit, ids);
}

}  // namespace tieredemb
