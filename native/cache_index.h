// The index of one tier: which row ids it holds and in which slot, which slots are pinned by
// batches in flight, which are dirty (newer than the tier below), and the eviction policy.
//
// A batch is made resident in two steps so that a failure in between changes nothing:
//   plan()   chooses slots for the ids and the victims to evict, without changing the index;
//   commit() applies the plan. Between the two the caller moves data: it reads the missing
//            rows from below and writes the dirty victims down.
// Ids passed to plan() must be unique and in range; the caller (dedup) guarantees both.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "flat_map.h"
#include "host_buffer.h"
#include "lookahead.h"
#include "policy.h"

namespace tieredemb {

// hits / misses count rows looked up for reading; writes counts rows written into the tier
// (write-backs from the tier above, write_rows); both can evict.
struct TierStats {
  int64_t hits = 0, misses = 0, writes = 0, evictions = 0, dirty_writebacks = 0, clean_drops = 0;
};

struct Plan {
  std::vector<int64_t> slots;         // [n] slot of each id
  std::vector<int64_t> miss_index;    // positions (into ids) of the ids not resident
  std::vector<int64_t> victim_ids;    // rows evicted to make room, with their slots
  std::vector<int64_t> victim_slots;
  std::vector<uint8_t> victim_dirty;  // 1: the victim must be written down before its slot is reused
  int64_t version = -1;               // the index version the plan was made against
};

class TierIndex {
 public:
  virtual ~TierIndex() = default;
  virtual int64_t capacity() const = 0;
  virtual int64_t size() const = 0;
  // Chooses slots for unique ids. Returns ValueError if the tier cannot hold them all
  // (too many pinned); then nothing changed.
  virtual Status plan(const int64_t* ids, int64_t n, Plan* plan) = 0;
  // Applies a plan made by the last plan() call. pin: pin every row of the batch.
  // dirty: mark every row of the batch dirty (the caller writes whole rows into the slots).
  virtual Status commit(const int64_t* ids, int64_t n, const Plan& plan, bool pin, bool dirty) = 0;
  // Applies only the evictions of a plan made by the last plan() call: its victims leave the
  // tier and their slots become free (for a caller whose data move failed after it had written
  // the dirty victims down and reused their slots). The plan cannot be committed after.
  virtual Status evict(const Plan& plan) = 0;
  // slot of each id, or -1. Changes nothing.
  virtual void lookup(const int64_t* ids, int64_t n, int64_t* slots) const = 0;
  virtual void unpin(const int64_t* slots, int64_t n) = 0;
  virtual void mark_dirty(const int64_t* slots, int64_t n) = 0;
  virtual void mark_clean(const int64_t* slots, int64_t n) = 0;
  // ids and slots of every dirty row.
  virtual void dirty_rows(std::vector<int64_t>* ids, std::vector<int64_t>* slots) const = 0;
  // Resident ids >= start in increasing order, at most limit of them.
  virtual void resident_ids(int64_t start, int64_t limit, std::vector<int64_t>* ids) const = 0;
  virtual int64_t pinned() const = 0;
  // The lookahead window: batches (unique ids each) expected after the one planned next, oldest
  // first. plan() then chooses victims among the evictable rows (resident, unpinned, not in the
  // batch) first from rows no window batch uses, in the policy's order; then, if it needs more,
  // the row whose first use in the window is farthest, ties in the policy's order. A tier that
  // never evicts keeps no window.
  virtual Status window_push(const int64_t* /*ids*/, int64_t /*n*/) { return Status::Ok(); }
  virtual bool window_pop() { return false; }  // drops the oldest batch; false if none
  virtual void window_clear() {}
  virtual int64_t window_batches() const { return 0; }
  const TierStats& stats() const { return stats_; }
  void reset_stats() { stats_ = TierStats{}; }

 protected:
  TierStats stats_;
  int64_t version_ = 0;
};

// A bounded cache: ids map to slots through a hash map; full slots are reclaimed by a policy.
class CacheIndex final : public TierIndex {
 public:
  CacheIndex(int64_t capacity, std::unique_ptr<EvictionPolicy> policy);
  int64_t capacity() const override { return capacity_; }
  int64_t size() const override { return map_.size(); }
  Status plan(const int64_t* ids, int64_t n, Plan* plan) override;
  Status commit(const int64_t* ids, int64_t n, const Plan& plan, bool pin, bool dirty) override;
  Status evict(const Plan& plan) override;
  void lookup(const int64_t* ids, int64_t n, int64_t* slots) const override;
  void unpin(const int64_t* slots, int64_t n) override;
  void mark_dirty(const int64_t* slots, int64_t n) override;
  void mark_clean(const int64_t* slots, int64_t n) override;
  void dirty_rows(std::vector<int64_t>* ids, std::vector<int64_t>* slots) const override;
  void resident_ids(int64_t start, int64_t limit, std::vector<int64_t>* ids) const override;
  int64_t pinned() const override { return pinned_; }
  Status window_push(const int64_t* ids, int64_t n) override { return window_.push(ids, n); }
  bool window_pop() override { return window_.pop(); }
  void window_clear() override { window_.clear(); }
  int64_t window_batches() const override { return window_.batches(); }
  const char* policy_name() const { return policy_->name(); }

 private:
  // Appends up to need victims among evictable slots, by the window rule. Returns how many.
  int64_t select_victims(int64_t need, const SlotFilter& evictable, std::vector<int64_t>* out);
  void forget_victim(const Plan& plan, size_t v);  // victim v leaves the map, counted as an eviction

  int64_t capacity_;
  std::unique_ptr<EvictionPolicy> policy_;
  FlatMap map_;                     // id -> slot
  std::vector<int64_t> slot_id_;    // slot -> id, -1 when free
  std::vector<int32_t> pins_;
  std::vector<uint8_t> dirty_;
  std::vector<uint64_t> batch_mark_;  // slot -> stamp of the last plan that used it
  std::vector<uint8_t> used_fresh_;   // commit scratch: 1 where the batch inserts a new row
  std::vector<int64_t> free_;         // free slots, popped from the back
  LookaheadWindow window_;
  std::vector<std::pair<int64_t, int64_t>> ranked_;  // scratch of select_victims: (next use, slot)
  uint64_t stamp_ = 0;
  int64_t pinned_ = 0;
};

// A tier that can hold every row: slot = id, a resident bit and a dirty bit per row over lazily
// mapped memory, so creating it is O(1) whatever num_embeddings is. It never evicts.
class DirectIndex final : public TierIndex {
 public:
  explicit DirectIndex(int64_t num_rows);
  std::string error() const { return error_; }
  int64_t capacity() const override { return num_rows_; }
  int64_t size() const override { return resident_count_; }
  Status plan(const int64_t* ids, int64_t n, Plan* plan) override;
  Status commit(const int64_t* ids, int64_t n, const Plan& plan, bool pin, bool dirty) override;
  Status evict(const Plan&) override { return Status::Ok(); }  // it never evicts
  void lookup(const int64_t* ids, int64_t n, int64_t* slots) const override;
  void unpin(const int64_t*, int64_t) override {}
  void mark_dirty(const int64_t* slots, int64_t n) override;
  void mark_clean(const int64_t* slots, int64_t n) override;
  void dirty_rows(std::vector<int64_t>* ids, std::vector<int64_t>* slots) const override;
  void resident_ids(int64_t start, int64_t limit, std::vector<int64_t>* ids) const override;
  // Dirty ids >= start in increasing order, at most limit of them (-1: all). At the bottom of
  // the tiers, where nothing is below to write to, dirty means "ever written".
  void dirty_ids(int64_t start, int64_t limit, std::vector<int64_t>* ids) const;
  int64_t pinned() const override { return 0; }

 private:
  int64_t num_rows_;
  int64_t resident_count_ = 0;
  int64_t dirty_count_ = 0;
  Bitmap resident_, dirty_;
  std::string error_;
};

}  // namespace tieredemb
