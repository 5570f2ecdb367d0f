// The index of one tier: which row ids it holds and in which slot, which slots are pinned by
// batches in flight, which are dirty (newer than the tier below), and the eviction policy.
//
// A batch is made resident in two steps so that a failure in between changes nothing:
//   plan()   chooses slots for the ids and the victims to evict, without changing the index;
//   commit() applies the plan. Between the two the caller moves data: it writes the dirty
//            victims down, then reads the missing rows from below into their slots.
// Ids passed to plan() must be unique and in range; the caller (dedup) guarantees both.
//
// Overflow slots (CacheIndex with overflow_limit > 0). Slots [0, capacity) are the regular
// slots, ordered by the policy. A batch whose new rows do not fit in them (too many slots pinned
// by batches in flight, or a batch larger than the tier) gets overflow slots capacity,
// capacity + 1, ... (at most overflow_limit in use at once), which the policy never sees. An
// overflow slot holds its row only while a batch pins it: the next plan() lists every unpinned
// overflow row that its batch does not use as a victim, and its slot is freed by commit() or
// evict(). An overflow row that the batch uses is a hit and stays where it is.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "common/flat_map.h"
#include "index/lookahead.h"
#include "index/policy.h"
#include "index/slot_set.h"

namespace tieredemb {

// hits / misses count rows looked up for reading; writes counts rows written into the tier
// (write-backs from the tier above, write_rows); both can evict. overflow_rows counts rows
// placed in overflow slots.
struct TierStats {
  int64_t hits = 0, misses = 0, writes = 0, evictions = 0, dirty_writebacks = 0, clean_drops = 0, overflow_rows = 0;
};

struct Plan {
  std::vector<int64_t> slots;         // [n] slot of each id
  std::vector<int64_t> miss_index;    // positions (into ids) of the ids not resident
  std::vector<int64_t> victim_ids;    // rows that leave, with their slots: the policy's victims
  std::vector<int64_t> victim_slots;  // (its order), then lingering overflow rows (slot order)
  std::vector<uint8_t> victim_dirty;  // 1: the victim must be written down before its slot is reused
  int64_t from_free = 0;              // misses given free regular slots (the first ones)
  int64_t num_overflow = 0;           // misses given overflow slots (the last ones)
  int64_t version = -1;               // the index version the plan was made against
};

class TierIndex {
 public:
  virtual ~TierIndex() = default;
  // Regular slots: [0, capacity).
  virtual int64_t capacity() const = 0;
  // Rows held now, in regular and overflow slots.
  virtual int64_t size() const = 0;
  // Most overflow slots in use at once; slots are in [0, capacity + overflow_limit).
  virtual int64_t overflow_limit() const { return 0; }
  // Overflow slots in use now.
  virtual int64_t overflow() const { return 0; }
  // Slot arguments are in [0, num_slots()).
  int64_t num_slots() const { return capacity() + overflow_limit(); }
  // Chooses slots for unique ids: misses take free regular slots, then the policy's victims,
  // then overflow slots (freed ones lowest first, then new ones). Changes nothing.
  // Returns: Ok, ValueError (the tier cannot hold them all, overflow slots included).
  virtual Status plan(const int64_t* ids, int64_t n, Plan* plan) = 0;
  // Applies a plan made by the last plan() call. pin: pin every row of the batch.
  // dirty: mark every row of the batch dirty (the caller writes whole rows into the slots).
  virtual Status commit(const int64_t* ids, int64_t n, const Plan& plan, bool pin, bool dirty) = 0;
  // Applies only the evictions of a plan made by the last plan() call: its victims leave the
  // tier and their slots become free (for a caller whose data move failed after it had written
  // the dirty victims down and reused their slots). The plan cannot be committed after.
  virtual Status evict(const Plan& plan) = 0;
  // slot of each id, or -1.
  // Changes nothing.
  virtual void lookup(const int64_t* ids, int64_t n, int64_t* slots) const = 0;
  // Drops one pin of each slot (slots in [0, num_slots())).
  // A slot that holds no row, or is not pinned, is left as it is.
  virtual void unpin(const int64_t* slots, int64_t n) = 0;
  // Marks the rows in these slots dirty (newer than the tier below).
  // A slot that holds no row is left as it is.
  virtual void mark_dirty(const int64_t* slots, int64_t n) = 0;
  // Marks the rows in these slots clean (the tier below has them).
  // A slot that holds no row is left as it is.
  virtual void mark_clean(const int64_t* slots, int64_t n) = 0;
  // Appends the ids and slots of every dirty row, in increasing slot order.
  // O(dirty rows + num_slots / 2^18): no scan of the whole tier.
  virtual void dirty_rows(std::vector<int64_t>* ids, std::vector<int64_t>* slots) const = 0;
  // Appends the resident ids >= start in increasing order, at most limit of them (-1: all).
  // Changes nothing.
  virtual void resident_ids(int64_t start, int64_t limit, std::vector<int64_t>* ids) const = 0;
  // Slots pinned now (each counted once, however many pins it holds).
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
  // Counters since construction or the last reset_stats().
  virtual const TierStats& stats() const { return stats_; }
  virtual void reset_stats() { stats_ = TierStats{}; }
  // Parts of the tier with their own capacity and eviction order (PartitionedIndex); 0: the
  // tier is not split.
  virtual int64_t partitions() const { return 0; }
  virtual const TierStats& partition_stats(int64_t /*k*/) const { return stats(); }
  virtual int64_t partition_capacity(int64_t /*k*/) const { return capacity(); }
  virtual int64_t partition_size(int64_t /*k*/) const { return size(); }
  // Why construction failed (memory could not be reserved), or empty.
  const std::string& error() const { return error_; }

 protected:
  // Counts a committed batch of n rows, misses of them new and overflow of those in overflow
  // slots: as writes if the caller wrote the rows (dirty), else as hits and misses.
  void count_commit(int64_t n, int64_t misses, int64_t overflow, bool dirty);

  TierStats stats_;
  int64_t version_ = 0;
  std::string error_;
};

// A bounded cache: ids map to slots through a hash map; full slots are reclaimed by a policy,
// and batches that do not fit borrow overflow slots (see the top of this file).
class CacheIndex final : public TierIndex {
 public:
  // A tier of `capacity` regular slots ordered by `policy` (sized to capacity) and up to
  // overflow_limit overflow slots (0: a batch that does not fit is a ValueError). error() is
  // not empty if memory could not be reserved.
  CacheIndex(int64_t capacity, std::unique_ptr<EvictionPolicy> policy, int64_t overflow_limit = 0);
  int64_t capacity() const override { return capacity_; }
  int64_t size() const override { return map_.size(); }
  int64_t overflow_limit() const override { return overflow_limit_; }
  int64_t overflow() const override { return overflow_used_.size(); }
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
  // The policy's name: "lru", "lfu" or "clock".
  const char* policy_name() const { return policy_->name(); }

 private:
  // Appends up to need victims among evictable slots, by the window rule. Returns how many.
  int64_t select_victims(int64_t need, const SlotFilter& evictable, std::vector<int64_t>* out);
  // Chooses `need` overflow slots for a plan, lowest first among the free ones and those its
  // lingering victims (sorted) leave, then new ones.
  void choose_overflow(int64_t need, const std::vector<int64_t>& lingering, std::vector<int64_t>* out) const;
  void forget_victim(const Plan& plan, size_t v);  // victim v leaves the map, counted as an eviction
  // An emptied slot becomes free: a regular one leaves the policy, an overflow one its in-use set.
  void free_slot(int64_t slot);
  bool holds_row(int64_t slot) const { return slot < slots_end_ && slot_id_[slot] >= 0; }

  int64_t capacity_, overflow_limit_;
  std::unique_ptr<EvictionPolicy> policy_;
  FlatMap map_;                       // id -> slot
  // Per slot, for the regular slots and the overflow slots created so far ([0, slots_end_)).
  int64_t slots_end_;
  std::vector<int64_t> slot_id_;      // slot -> id, -1 when free
  std::vector<int32_t> pins_;
  std::vector<uint64_t> batch_mark_;  // slot -> stamp of the last plan that used it
  SlotSet dirty_;                     // slots whose row is dirty
  std::vector<int64_t> free_;         // free regular slots, popped from the back
  SlotSet overflow_used_, overflow_free_;  // overflow slots holding a row; created and free
  std::vector<uint8_t> used_fresh_;   // commit scratch: 1 where the batch inserts a new row
  std::vector<int64_t> policy_slots_;  // commit scratch: the batch's regular slots (overflow in use)
  std::vector<uint8_t> policy_fresh_;
  LookaheadWindow window_;
  std::vector<std::pair<int64_t, int64_t>> ranked_;  // scratch of select_victims: (next use, slot)
  uint64_t stamp_ = 0;
  int64_t pinned_ = 0;
};

// A tier that can hold every row: slot = id, the resident and the dirty rows as SlotSets over
// lazily mapped memory, so creating it is O(1) whatever num_embeddings is. It never evicts or
// overflows.
class DirectIndex final : public TierIndex {
 public:
  // Slots (= ids) [0, num_rows), all empty. error() is not empty if memory could not be
  // reserved.
  explicit DirectIndex(int64_t num_rows);
  int64_t capacity() const override { return num_rows_; }
  int64_t size() const override { return resident_.size(); }
  Status plan(const int64_t* ids, int64_t n, Plan* plan) override;
  Status commit(const int64_t* ids, int64_t n, const Plan& plan, bool pin, bool dirty) override;
  Status evict(const Plan&) override { return Status::Ok(); }  // it never evicts
  void lookup(const int64_t* ids, int64_t n, int64_t* slots) const override;
  void unpin(const int64_t*, int64_t) override {}
  // Unlike CacheIndex, marks any row, resident or not: at the bottom of the tiers, where
  // nothing is below to write to, dirty means "ever written".
  void mark_dirty(const int64_t* slots, int64_t n) override;
  void mark_clean(const int64_t* slots, int64_t n) override;
  void dirty_rows(std::vector<int64_t>* ids, std::vector<int64_t>* slots) const override;
  void resident_ids(int64_t start, int64_t limit, std::vector<int64_t>* ids) const override;
  // Appends the dirty ids >= start in increasing order, at most limit of them (-1: all).
  // Changes nothing.
  void dirty_ids(int64_t start, int64_t limit, std::vector<int64_t>* ids) const;
  int64_t pinned() const override { return 0; }

 private:
  int64_t num_rows_;
  SlotSet resident_, dirty_;
};

}  // namespace tieredemb
