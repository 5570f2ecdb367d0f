#include "index/lookahead.h"

#include <utility>

namespace tieredemb {

namespace {
constexpr int64_t kAhead = 16;  // map buckets loaded this many ids ahead
}  // namespace

Status LookaheadWindow::push(const int64_t* ids, int64_t n) {
  if (count_ >= kMaxBatches)
    return Status::ValueError("lookahead window: it holds " + std::to_string(count_) +
                              " batches, the most it can (" + std::to_string(kMaxBatches) + ")");
  if (n > int64_t{UINT32_MAX})
    return Status::ValueError("lookahead window: a batch of " + std::to_string(n) + " ids; at most 2^32 - 1");
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
    // ids are random over the table: start loading their buckets early
    if (i + kAhead < n) uses_.prefetch(ids[i + kAhead]);
    auto [use, inserted] = uses_.emplace(ids[i], pack(b.seq, b.seq, i));
    if (!inserted) {
      batch_of(full_seq(last_of(*use))).next[index_of(*use)] = b.seq;
      *use = pack(first_of(*use), b.seq, i);
    }
  }
  return Status::Ok();
}

bool LookaheadWindow::pop() {
  if (count_ == 0) return false;
  const Batch& b = ring_[head_];
  const size_t n = b.ids.size();
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) uses_.prefetch(b.ids[i + kAhead]);
    if (b.next[i] < 0) {
      uses_.erase(b.ids[i]);  // this oldest batch was its first and last use
    } else {
      int64_t* use = uses_.find_value(b.ids[i]);
      *use = pack(b.next[i], last_of(*use), index_of(*use));
    }
  }
  head_ = (head_ + 1) % static_cast<int64_t>(ring_.size());
  --count_;
  return true;
}

void LookaheadWindow::clear() {
  uses_.clear();
  count_ = 0;
}

}  // namespace tieredemb
