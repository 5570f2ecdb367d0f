// A tier split by id range into partitions, each with its own capacity and eviction order: the
// tier 0 of a collection's group of tables, where a plan gives every table its own share
// (tieredemb.planner). Table t's rows are the group's ids [start_t, end_t); its partition is a
// CacheIndex of its own, so one table's misses never evict another's rows, and each table's
// hit ratio is its own curve's at its own capacity.
//
// Slots: the partitions' regular slots one after another ([0, capacity), partition k's from
// the sum of the capacities before it), then their overflow slots one after another (from
// capacity, partition k's from capacity + the overflow limits before it). A plan, commit or
// evict covers every partition the batch touches (and those holding overflow rows to evict) in
// one call, so a batch is still one plan -> move -> commit for the caller.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "index/cache_index.h"

namespace tieredemb {

class PartitionedIndex final : public TierIndex {
 public:
  // Partition k holds ids [ends[k-1], ends[k]) (ends ascending, from 0), capacities[k] >= 1
  // regular slots and overflow_limits[k] >= 0 overflow slots, ordered by `policy`.
  // error() is not empty if the arguments break these rules (naming the value) or memory could
  // not be reserved.
  PartitionedIndex(std::vector<int64_t> ends, std::vector<int64_t> capacities, const std::string& policy,
                   std::vector<int64_t> overflow_limits);
  PartitionedIndex(const PartitionedIndex&) = delete;
  PartitionedIndex& operator=(const PartitionedIndex&) = delete;
  int64_t capacity() const override { return capacity_; }
  int64_t size() const override;
  int64_t overflow_limit() const override { return overflow_limit_; }
  int64_t overflow() const override;
  Status plan(const int64_t* ids, int64_t n, Plan* plan) override;
  Status commit(const int64_t* ids, int64_t n, const Plan& plan, bool pin, bool dirty) override;
  Status evict(const Plan& plan) override;
  void lookup(const int64_t* ids, int64_t n, int64_t* slots) const override;
  void unpin(const int64_t* slots, int64_t n) override;
  void mark_dirty(const int64_t* slots, int64_t n) override;
  void mark_clean(const int64_t* slots, int64_t n) override;
  void dirty_rows(std::vector<int64_t>* ids, std::vector<int64_t>* slots) const override;
  void resident_ids(int64_t start, int64_t limit, std::vector<int64_t>* ids) const override;
  int64_t pinned() const override;
  Status window_push(const int64_t* ids, int64_t n) override;
  bool window_pop() override;
  void window_clear() override;
  int64_t window_batches() const override { return parts_.empty() ? 0 : parts_[0]->window_batches(); }
  const TierStats& stats() const override;
  void reset_stats() override;
  int64_t partitions() const override { return static_cast<int64_t>(parts_.size()); }
  // One partition's counters, capacity and rows held (k in [0, partitions())).
  const TierStats& partition_stats(int64_t k) const override { return parts_[k]->stats(); }
  int64_t partition_capacity(int64_t k) const override { return parts_[k]->capacity(); }
  int64_t partition_size(int64_t k) const override { return parts_[k]->size(); }

 private:
  int64_t part_of_id(int64_t id) const;     // the partition holding id
  int64_t part_of_slot(int64_t slot) const;  // the partition owning a (global) slot
  int64_t to_global(int64_t k, int64_t local) const {
    const int64_t cap = parts_[k]->capacity();
    return local < cap ? reg_base_[k] + local : capacity_ + over_base_[k] + (local - cap);
  }
  int64_t to_local(int64_t k, int64_t slot) const {
    return slot < capacity_ ? slot - reg_base_[k] : parts_[k]->capacity() + (slot - capacity_ - over_base_[k]);
  }
  // Global slots split by partition into local ones (a vector per partition; its own per call,
  // so calls that change nothing shared may come from different threads).
  std::vector<std::vector<int64_t>> split_slots(const int64_t* slots, int64_t n) const;

  std::vector<int64_t> ends_, reg_base_, over_base_;
  std::vector<std::unique_ptr<CacheIndex>> parts_;
  int64_t capacity_ = 0, overflow_limit_ = 0;
  // The last plan(): which partitions it covers, their ids and plans.
  std::vector<uint8_t> planned_;
  std::vector<std::vector<int64_t>> part_ids_;
  std::vector<Plan> part_plans_;
  mutable TierStats sum_;
};

}  // namespace tieredemb
