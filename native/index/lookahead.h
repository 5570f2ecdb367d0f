// The lookahead window of a cache tier: the batches expected after the one planned next, oldest
// first, and for every row id they use, the first of them that uses it.
//
// Batches are numbered in push order from 0 (a sequence number, never reused). Ids within one
// pushed batch must be unique (the caller deduplicates). Memory is bounded by the largest
// window held: popped batches' buffers are reused, nothing grows with the number of batches.
// Thread-safety: none of its own; the owning index is called by one thread at a time.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "common/flat_map.h"

namespace tieredemb {

class LookaheadWindow {
 public:
  // The most batches a window holds (sequence numbers are kept modulo 2^16 in the map).
  static constexpr int64_t kMaxBatches = (int64_t{1} << 16) - 1;

  // Appends a future batch of unique ids. ValueError if the window holds kMaxBatches already.
  Status push(const int64_t* ids, int64_t n);
  // Drops the oldest batch. Returns false if the window was empty.
  bool pop();
  // Drops every batch; sequence numbers go on from where they were.
  void clear();
  // Batches held now.
  int64_t batches() const { return count_; }
  bool empty() const { return count_ == 0; }
  // Sequence number of the first window batch that uses id, or -1 if none does.
  int64_t next_use(int64_t id) const {
    const int64_t* use = uses_.find_value(id);
    return use == nullptr ? -1 : full_seq(first_of(*use));
  }

 private:
  struct Batch {
    int64_t seq = 0;
    std::vector<int64_t> ids;
    std::vector<int64_t> next;  // next[i]: sequence number of the next batch using ids[i], or -1
  };
  // An id's uses in the window, in one map value: the first and the last window batch using it
  // (sequence numbers modulo 2^16) and its index in the last one. One probe per id to push or
  // pop a batch.
  static int64_t pack(int64_t first, int64_t last, int64_t index) {
    return static_cast<int64_t>((static_cast<uint64_t>(first & 0xffff) << 48) |
                                (static_cast<uint64_t>(last & 0xffff) << 32) | static_cast<uint32_t>(index));
  }
  static int64_t first_of(int64_t use) { return static_cast<int64_t>(static_cast<uint64_t>(use) >> 48); }
  static int64_t last_of(int64_t use) { return static_cast<int64_t>((static_cast<uint64_t>(use) >> 32) & 0xffff); }
  static int64_t index_of(int64_t use) { return static_cast<int64_t>(static_cast<uint32_t>(use)); }
  // The window's sequence number whose low 16 bits are s16.
  int64_t full_seq(int64_t s16) const { return next_seq_ - count_ + ((s16 - (next_seq_ - count_)) & 0xffff); }
  Batch& batch_of(int64_t seq) { return ring_[(head_ + (seq - ring_[head_].seq)) % ring_.size()]; }

  std::vector<Batch> ring_;  // count_ batches from head_, circularly
  int64_t head_ = 0, count_ = 0, next_seq_ = 0;
  FlatMap uses_;  // id -> pack(first, last, index) of its uses in the window
};

}  // namespace tieredemb
