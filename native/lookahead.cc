#include "lookahead.h"

#include <utility>

namespace tieredemb {

namespace {
constexpr int kIndexBits = 32;
constexpr int64_t kIndexMask = (int64_t{1} << kIndexBits) - 1;
constexpr int64_t kAhead = 16;  // map buckets loaded this many ids ahead
}  // namespace

void LookaheadWindow::push(const int64_t* ids, int64_t n) {
  if (count_ == static_cast<int64_t>(ring_.size())) {
    // Full: grow, oldest batch first (batch_of() only needs head_ and the sequence numbers).
    std::vector<Batch> grown(ring_.size() ? 2 * ring_.size() : 4);
    for (int64_t k = 0; k < count_; ++k) grown[k] = std::move(ring_[(head_ + k) % ring_.size()]);
    ring_ = std::move(grown);
    head_ = 0;
  }
  Batch& b = ring_[(head_ + count_) % ring_.size()];
  ++count_;
  b.seq = next_seq_++;
  b.ids.assign(ids, ids + n);
  b.next.assign(n, -1);
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {  // ids are random over the table: start loading their buckets early
      last_.prefetch(ids[i + kAhead]);
      first_.prefetch(ids[i + kAhead]);
    }
    const int64_t previous = last_.exchange(ids[i], (b.seq << kIndexBits) | i);
    if (previous != FlatMap::kEmpty) {
      batch_of(previous >> kIndexBits).next[previous & kIndexMask] = b.seq;
    } else {
      first_.assign(ids[i], b.seq);
    }
  }
}

bool LookaheadWindow::pop() {
  if (count_ == 0) return false;
  const Batch& b = ring_[head_];
  const size_t n = b.ids.size();
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      first_.prefetch(b.ids[i + kAhead]);
      if (b.next[i + kAhead] < 0) last_.prefetch(b.ids[i + kAhead]);
    }
    if (b.next[i] < 0) {
      first_.erase(b.ids[i]);
      last_.erase(b.ids[i]);
    } else {
      first_.assign(b.ids[i], b.next[i]);
    }
  }
  head_ = (head_ + 1) % static_cast<int64_t>(ring_.size());
  --count_;
  return true;
}

void LookaheadWindow::clear() {
  first_.clear();
  last_.clear();
  count_ = 0;
}

}  // namespace tieredemb
