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

#include "flat_map.h"

namespace tieredemb {

class LookaheadWindow {
 public:
  // Appends a future batch of unique ids.
  void push(const int64_t* ids, int64_t n);
  // Drops the oldest batch. Returns false if the window was empty.
  bool pop();
  void clear();
  int64_t batches() const { return count_; }
  bool empty() const { return count_ == 0; }
  // Sequence number of the first window batch that uses id, or -1 if none does.
  int64_t next_use(int64_t id) const { return first_.find(id); }

 private:
  struct Batch {
    int64_t seq = 0;
    std::vector<int64_t> ids;
    std::vector<int64_t> next;  // next[i]: sequence number of the next batch using ids[i], or -1
  };
  Batch& batch_of(int64_t seq) { return ring_[(head_ + (seq - ring_[head_].seq)) % ring_.size()]; }

  std::vector<Batch> ring_;  // count_ batches from head_, circularly
  int64_t head_ = 0, count_ = 0, next_seq_ = 0;
  FlatMap first_;  // id -> sequence number of the first window batch using it
  FlatMap last_;   // id -> (sequence number << 32) | index, of its last use in the window
};

}  // namespace tieredemb
