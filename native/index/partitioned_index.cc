#include "index/partitioned_index.h"

#include <algorithm>
#include <utility>

namespace tieredemb {

PartitionedIndex::PartitionedIndex(std::vector<int64_t> ends, std::vector<int64_t> capacities,
                                   const std::string& policy, std::vector<int64_t> overflow_limits)
    : ends_(std::move(ends)) {
  const size_t parts = ends_.size();
  if (parts == 0 || capacities.size() != parts || overflow_limits.size() != parts) {
    error_ = "partitions: ends, capacities and overflow_limits must have the same length >= 1, got " +
             std::to_string(parts) + ", " + std::to_string(capacities.size()) + ", " +
             std::to_string(overflow_limits.size());
    return;
  }
  for (size_t k = 0; k < parts; ++k) {
    const int64_t start = k ? ends_[k - 1] : 0;
    if (ends_[k] <= start) {
      error_ = "partition " + std::to_string(k) + ": end " + std::to_string(ends_[k]) + " must be > its start " +
               std::to_string(start) + " (ends ascend)";
      return;
    }
    if (capacities[k] <= 0 || overflow_limits[k] < 0) {
      error_ = "partition " + std::to_string(k) + ": capacity " + std::to_string(capacities[k]) +
               " must be >= 1 and overflow_limit " + std::to_string(overflow_limits[k]) + " >= 0";
      return;
    }
    auto p = make_policy(policy, capacities[k]);
    if (!p) {
      error_ = "policy '" + policy + "' is not one of 'lru', 'lfu', 'clock'";
      return;
    }
    reg_base_.push_back(capacity_);
    over_base_.push_back(overflow_limit_);
    capacity_ += capacities[k];
    overflow_limit_ += overflow_limits[k];
    parts_.push_back(std::make_unique<CacheIndex>(capacities[k], std::move(p), overflow_limits[k]));
    if (!parts_.back()->error().empty()) {
      error_ = parts_.back()->error();
      return;
    }
  }
  planned_.assign(parts, 0);
  part_ids_.resize(parts);
  part_plans_.resize(parts);
}

int64_t PartitionedIndex::part_of_id(int64_t id) const {
  return std::upper_bound(ends_.begin(), ends_.end(), id) - ends_.begin();
}

int64_t PartitionedIndex::part_of_slot(int64_t slot) const {
  // The last partition whose range starts at or before the slot (empty overflow ranges share
  // their start with the next one, which then owns the slot).
  const auto& base = slot < capacity_ ? reg_base_ : over_base_;
  const int64_t at = slot < capacity_ ? slot : slot - capacity_;
  return std::upper_bound(base.begin(), base.end(), at) - base.begin() - 1;
}

int64_t PartitionedIndex::size() const {
  int64_t n = 0;
  for (const auto& p : parts_) n += p->size();
  return n;
}

int64_t PartitionedIndex::overflow() const {
  int64_t n = 0;
  for (const auto& p : parts_) n += p->overflow();
  return n;
}

int64_t PartitionedIndex::pinned() const {
  int64_t n = 0;
  for (const auto& p : parts_) n += p->pinned();
  return n;
}

Status PartitionedIndex::plan(const int64_t* ids, int64_t n, Plan* plan) {
  const size_t parts = parts_.size();
  for (auto& v : part_ids_) v.clear();
  std::vector<int64_t> where(static_cast<size_t>(n));  // partition of each id
  for (int64_t i = 0; i < n; ++i) {
    where[i] = part_of_id(ids[i]);
    part_ids_[where[i]].push_back(ids[i]);
  }
  plan->slots.resize(n);
  plan->miss_index.clear();
  plan->victim_ids.clear();
  plan->victim_slots.clear();
  plan->victim_dirty.clear();
  plan->from_free = plan->num_overflow = 0;
  plan->version = version_;
  // Partitions the batch uses, and those whose lingering overflow rows this plan evicts.
  for (size_t k = 0; k < parts; ++k) {
    planned_[k] = !part_ids_[k].empty() || parts_[k]->overflow() > 0;
    if (!planned_[k]) continue;
    Status s = parts_[k]->plan(part_ids_[k].data(), static_cast<int64_t>(part_ids_[k].size()), &part_plans_[k]);
    if (!s.ok()) return s;
  }
  // Slots and misses in the batch's order (a miss: the partition's plan says so).
  std::vector<size_t> at(parts, 0), next_miss(parts, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = where[i];
    const Plan& p = part_plans_[k];
    const size_t j = at[k]++;
    plan->slots[i] = to_global(k, p.slots[j]);
    if (next_miss[k] < p.miss_index.size() && p.miss_index[next_miss[k]] == static_cast<int64_t>(j)) {
      ++next_miss[k];
      plan->miss_index.push_back(i);
    }
  }
  // Victims: every partition's policy victims, then every partition's lingering overflow rows.
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t k = 0; k < parts; ++k) {
      if (!planned_[k]) continue;
      const Plan& p = part_plans_[k];
      for (size_t v = 0; v < p.victim_slots.size(); ++v) {
        const bool lingering = p.victim_slots[v] >= parts_[k]->capacity();
        if (lingering != (pass == 1)) continue;
        plan->victim_ids.push_back(p.victim_ids[v]);
        plan->victim_slots.push_back(to_global(k, p.victim_slots[v]));
        plan->victim_dirty.push_back(p.victim_dirty[v]);
      }
    }
  }
  for (size_t k = 0; k < parts; ++k) {
    if (!planned_[k]) continue;
    plan->from_free += part_plans_[k].from_free;
    plan->num_overflow += part_plans_[k].num_overflow;
  }
  return Status::Ok();
}

Status PartitionedIndex::commit(const int64_t* /*ids*/, int64_t n, const Plan& plan, bool pin, bool dirty) {
  if (plan.version != version_ || static_cast<int64_t>(plan.slots.size()) != n) {
    return Status::RuntimeError("stale batch plan: the tier changed between plan and commit");
  }
  ++version_;
  // Each partition commits its own part, planned on the ids the last plan() split out.
  for (size_t k = 0; k < parts_.size(); ++k) {
    if (!planned_[k]) continue;
    Status s = parts_[k]->commit(part_ids_[k].data(), static_cast<int64_t>(part_ids_[k].size()), part_plans_[k],
                                 pin, dirty);
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

Status PartitionedIndex::evict(const Plan& plan) {
  if (plan.version != version_) {
    return Status::RuntimeError("stale batch plan: the tier changed between plan and evict");
  }
  ++version_;
  for (size_t k = 0; k < parts_.size(); ++k) {
    if (!planned_[k]) continue;
    Status s = parts_[k]->evict(part_plans_[k]);
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

void PartitionedIndex::lookup(const int64_t* ids, int64_t n, int64_t* slots) const {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = part_of_id(ids[i]);
    int64_t local;
    parts_[k]->lookup(ids + i, 1, &local);
    slots[i] = local < 0 ? -1 : to_global(k, local);
  }
}

std::vector<std::vector<int64_t>> PartitionedIndex::split_slots(const int64_t* slots, int64_t n) const {
  std::vector<std::vector<int64_t>> local(parts_.size());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = part_of_slot(slots[i]);
    local[k].push_back(to_local(k, slots[i]));
  }
  return local;
}

void PartitionedIndex::unpin(const int64_t* slots, int64_t n) {
  const auto local = split_slots(slots, n);
  for (size_t k = 0; k < parts_.size(); ++k) {
    if (!local[k].empty()) parts_[k]->unpin(local[k].data(), static_cast<int64_t>(local[k].size()));
  }
}

void PartitionedIndex::mark_dirty(const int64_t* slots, int64_t n) {
  const auto local = split_slots(slots, n);
  for (size_t k = 0; k < parts_.size(); ++k) {
    if (!local[k].empty()) parts_[k]->mark_dirty(local[k].data(), static_cast<int64_t>(local[k].size()));
  }
}

void PartitionedIndex::mark_clean(const int64_t* slots, int64_t n) {
  const auto local = split_slots(slots, n);
  for (size_t k = 0; k < parts_.size(); ++k) {
    if (!local[k].empty()) parts_[k]->mark_clean(local[k].data(), static_cast<int64_t>(local[k].size()));
  }
}

void PartitionedIndex::dirty_rows(std::vector<int64_t>* ids, std::vector<int64_t>* slots) const {
  // Regular slots of every partition in partition order ascend, then overflow slots likewise.
  std::vector<std::vector<int64_t>> part_ids(parts_.size()), part_slots(parts_.size());
  for (size_t k = 0; k < parts_.size(); ++k) parts_[k]->dirty_rows(&part_ids[k], &part_slots[k]);
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t k = 0; k < parts_.size(); ++k) {
      const int64_t cap = parts_[k]->capacity();
      for (size_t j = 0; j < part_slots[k].size(); ++j) {
        if ((part_slots[k][j] >= cap) != (pass == 1)) continue;
        ids->push_back(part_ids[k][j]);
        slots->push_back(to_global(k, part_slots[k][j]));
      }
    }
  }
}

void PartitionedIndex::resident_ids(int64_t start, int64_t limit, std::vector<int64_t>* ids) const {
  // Partitions hold ascending id ranges: their sorted ids one after another are sorted.
  for (size_t k = 0; k < parts_.size(); ++k) {
    if (ends_[k] <= start) continue;
    const int64_t have = static_cast<int64_t>(ids->size());
    if (limit >= 0 && have >= limit) return;
    parts_[k]->resident_ids(start, limit < 0 ? -1 : limit - have, ids);
  }
}

Status PartitionedIndex::window_push(const int64_t* ids, int64_t n) {
  std::vector<std::vector<int64_t>> part(parts_.size());
  for (int64_t i = 0; i < n; ++i) part[part_of_id(ids[i])].push_back(ids[i]);
  // Every partition holds the same batches (empty ones included), so a full window fails at the
  // first partition, before any has changed.
  for (size_t k = 0; k < parts_.size(); ++k) {
    Status s = parts_[k]->window_push(part[k].data(), static_cast<int64_t>(part[k].size()));
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

bool PartitionedIndex::window_pop() {
  bool any = false;
  for (auto& p : parts_) any = p->window_pop() || any;
  return any;
}

void PartitionedIndex::window_clear() {
  for (auto& p : parts_) p->window_clear();
}

const TierStats& PartitionedIndex::stats() const {
  sum_ = TierStats{};
  for (const auto& p : parts_) {
    const TierStats& s = p->stats();
    sum_.hits += s.hits;
    sum_.misses += s.misses;
    sum_.writes += s.writes;
    sum_.evictions += s.evictions;
    sum_.dirty_writebacks += s.dirty_writebacks;
    sum_.clean_drops += s.clean_drops;
    sum_.overflow_rows += s.overflow_rows;
  }
  return sum_;
}

void PartitionedIndex::reset_stats() {
  for (auto& p : parts_) p->reset_stats();
}

}  // namespace tieredemb
