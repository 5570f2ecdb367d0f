#include "cache_index.h"

#include <algorithm>

namespace tieredemb {

// Slots and map buckets are random over the tier: each loop below starts loading what it will
// touch this many entries ahead, so that many cache misses are in flight at once.
constexpr int64_t kAhead = 16;

CacheIndex::CacheIndex(int64_t capacity, std::unique_ptr<EvictionPolicy> policy)
    : capacity_(capacity), policy_(std::move(policy)), map_(capacity), slot_id_(capacity, -1),
      pins_(capacity, 0), dirty_(capacity, 0), batch_mark_(capacity, 0) {
  free_.reserve(capacity);
  for (int64_t s = capacity - 1; s >= 0; --s) free_.push_back(s);
}

Status CacheIndex::plan(const int64_t* ids, int64_t n, Plan* plan) {
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
  int64_t misses = static_cast<int64_t>(plan->miss_index.size());
  int64_t from_free = std::min<int64_t>(misses, static_cast<int64_t>(free_.size()));
  int64_t need = misses - from_free;
  if (need > 0) {
    uint64_t stamp = stamp_;
    auto evictable = [this, stamp](int64_t s) {
      return slot_id_[s] >= 0 && pins_[s] == 0 && batch_mark_[s] != stamp;
    };
    int64_t got = select_victims(need, evictable, &plan->victim_slots);
    if (got < need) {
      plan->victim_slots.clear();
      return Status::ValueError(
          "a batch needs " + std::to_string(misses) + " new rows in a tier of capacity " +
          std::to_string(capacity_) + " but only " + std::to_string(from_free + got) +
          " slots are free or evictable (" + std::to_string(n - misses) + " rows of the batch resident, " +
          std::to_string(pinned_) + " slots pinned by batches in flight); give the tier more rows or use smaller batches");
    }
  }
  for (int64_t k = 0; k < misses; ++k) {
    int64_t slot = k < from_free ? free_[free_.size() - 1 - k] : plan->victim_slots[k - from_free];
    plan->slots[plan->miss_index[k]] = slot;
  }
  for (int64_t s : plan->victim_slots) {
    plan->victim_ids.push_back(slot_id_[s]);
    plan->victim_dirty.push_back(dirty_[s]);
  }
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

Status CacheIndex::commit(const int64_t* ids, int64_t n, const Plan& plan, bool pin, bool dirty) {
  if (plan.version != version_ || static_cast<int64_t>(plan.slots.size()) != n) {
    return Status::RuntimeError("stale batch plan: the tier changed between plan and commit");
  }
  ++version_;
  policy_->accept();
  int64_t misses = static_cast<int64_t>(plan.miss_index.size());
  int64_t from_free = misses - static_cast<int64_t>(plan.victim_slots.size());
  free_.resize(free_.size() - from_free);
  const size_t victims = plan.victim_slots.size();
  for (size_t v = 0; v < victims; ++v) {
    if (v + kAhead < victims) map_.prefetch(plan.victim_ids[v + kAhead]);
    forget_victim(plan, v);
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
      dirty_[slot] = 0;
      used_fresh_[static_cast<size_t>(i)] = 1;
    }
    if (dirty) dirty_[slot] = 1;
    if (pin && pins_[slot]++ == 0) ++pinned_;
  }
  policy_->use(plan.slots.data(), used_fresh_.data(), n);
  if (dirty) {
    stats_.writes += n;
  } else {
    stats_.hits += n - misses;
    stats_.misses += misses;
  }
  return Status::Ok();
}

void CacheIndex::forget_victim(const Plan& plan, size_t v) {
  map_.erase(plan.victim_ids[v]);
  ++stats_.evictions;
  if (plan.victim_dirty[v]) ++stats_.dirty_writebacks; else ++stats_.clean_drops;
}

Status CacheIndex::evict(const Plan& plan) {
  if (plan.version != version_) {
    return Status::RuntimeError("stale batch plan: the tier changed between plan and evict");
  }
  ++version_;
  for (size_t v = 0; v < plan.victim_slots.size(); ++v) {
    const int64_t s = plan.victim_slots[v];
    forget_victim(plan, v);
    policy_->remove(s);
    slot_id_[s] = -1;
    dirty_[s] = 0;
    free_.push_back(s);
  }
  return Status::Ok();
}

void CacheIndex::lookup(const int64_t* ids, int64_t n, int64_t* slots) const {
  for (int64_t i = 0; i < n; ++i) slots[i] = map_.find(ids[i]);
}

void CacheIndex::unpin(const int64_t* slots, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    int64_t s = slots[i];
    if (pins_[s] > 0 && --pins_[s] == 0) --pinned_;
  }
}

void CacheIndex::mark_dirty(const int64_t* slots, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dirty_[slots[i]] = 1;
}

void CacheIndex::mark_clean(const int64_t* slots, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dirty_[slots[i]] = 0;
}

void CacheIndex::dirty_rows(std::vector<int64_t>* ids, std::vector<int64_t>* slots) const {
  for (int64_t s = 0; s < capacity_; ++s) {
    if (slot_id_[s] >= 0 && dirty_[s]) {
      ids->push_back(slot_id_[s]);
      slots->push_back(s);
    }
  }
}

void CacheIndex::resident_ids(int64_t start, int64_t limit, std::vector<int64_t>* ids) const {
  std::vector<int64_t> all;
  for (int64_t s = 0; s < capacity_; ++s)
    if (slot_id_[s] >= start) all.push_back(slot_id_[s]);
  std::sort(all.begin(), all.end());
  if (limit >= 0 && static_cast<int64_t>(all.size()) > limit) all.resize(limit);
  ids->insert(ids->end(), all.begin(), all.end());
}

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
  plan->version = version_;
  for (int64_t i = 0; i < n; ++i)
    if (!resident_.test(ids[i])) plan->miss_index.push_back(i);
  return Status::Ok();
}

Status DirectIndex::commit(const int64_t* ids, int64_t n, const Plan& plan, bool, bool dirty) {
  if (plan.version != version_ || static_cast<int64_t>(plan.slots.size()) != n) {
    return Status::RuntimeError("stale batch plan: the tier changed between plan and commit");
  }
  ++version_;
  for (int64_t i : plan.miss_index) {
    resident_.set(ids[i]);
    ++resident_count_;
  }
  if (dirty) mark_dirty(ids, n);
  int64_t misses = static_cast<int64_t>(plan.miss_index.size());
  if (dirty) {
    stats_.writes += n;
  } else {
    stats_.hits += n - misses;
    stats_.misses += misses;
  }
  return Status::Ok();
}

void DirectIndex::lookup(const int64_t* ids, int64_t n, int64_t* slots) const {
  for (int64_t i = 0; i < n; ++i) slots[i] = resident_.test(ids[i]) ? ids[i] : -1;
}

void DirectIndex::mark_dirty(const int64_t* slots, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (!dirty_.test(slots[i])) {
      dirty_.set(slots[i]);
      ++dirty_count_;
    }
  }
}

void DirectIndex::mark_clean(const int64_t* slots, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (dirty_.test(slots[i])) {
      dirty_.clear(slots[i]);
      --dirty_count_;
    }
  }
}

void DirectIndex::dirty_rows(std::vector<int64_t>* ids, std::vector<int64_t>* slots) const {
  if (dirty_count_ == 0) return;
  const uint64_t* words = dirty_.words();
  for (int64_t w = 0; w * 64 < num_rows_; ++w) {
    for (uint64_t bits = words[w]; bits != 0; bits &= bits - 1) {
      int64_t id = w * 64 + __builtin_ctzll(bits);
      ids->push_back(id);
      slots->push_back(id);
    }
  }
}

namespace {

void scan_bits(const uint64_t* words, int64_t num_rows, int64_t start, int64_t limit, std::vector<int64_t>* ids) {
  int64_t found = 0;
  for (int64_t w = std::max<int64_t>(start, 0) / 64; w * 64 < num_rows; ++w) {
    for (uint64_t bits = words[w]; bits != 0; bits &= bits - 1) {
      int64_t id = w * 64 + __builtin_ctzll(bits);
      if (id < start) continue;
      if (limit >= 0 && found >= limit) return;
      ids->push_back(id);
      ++found;
    }
  }
}

}  // namespace

void DirectIndex::dirty_ids(int64_t start, int64_t limit, std::vector<int64_t>* ids) const {
  scan_bits(dirty_.words(), num_rows_, start, limit, ids);
}

void DirectIndex::resident_ids(int64_t start, int64_t limit, std::vector<int64_t>* ids) const {
  scan_bits(resident_.words(), num_rows_, start, limit, ids);
}

}  // namespace tieredemb
