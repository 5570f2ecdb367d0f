#include "index/policy.h"

#include <algorithm>
#include <cstdint>
#include <queue>
#include <tuple>

namespace tieredemb {
namespace {

// Least recently used: an intrusive doubly linked list over slots, most recent at the head.
class LruPolicy final : public EvictionPolicy {
 public:
  explicit LruPolicy(int64_t capacity) : links_(capacity) {}
  const char* name() const override { return "lru"; }

  void touch(const int64_t* slots, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) move_to_head(slots[i]);
  }
  void insert(const int64_t* slots, int64_t n) override { touch(slots, n); }
  void remove(int64_t slot) override { unlink(slot); }

  // A batch's slots are random over the tier: each move costs cache misses on the slot's
  // links and its neighbours'. Prefetch the links kAhead slots ahead and, once those have
  // arrived, the neighbours'.
  void use(const int64_t* slots, const uint8_t*, int64_t n) override {
    constexpr int64_t kAhead = 16;
    for (int64_t k = 0; k < n; ++k) {
      if (k + kAhead < n) __builtin_prefetch(&links_[slots[k + kAhead]], 1);
      if (k + kAhead / 2 < n) {
        const Link& l = links_[slots[k + kAhead / 2]];
        if (l.prev >= 0) __builtin_prefetch(&links_[l.prev], 1);
        if (l.next >= 0) __builtin_prefetch(&links_[l.next], 1);
      }
      move_to_head(slots[k]);
    }
  }

  int64_t select(int64_t n, const SlotFilter& evictable, std::vector<int64_t>* out) override {
    int64_t found = 0;
    for (int64_t s = tail_; s != -1 && found < n; s = links_[s].prev) {
      if (evictable(s)) {
        out->push_back(s);
        ++found;
      }
    }
    return found;
  }

  void order(const SlotFilter& keep, std::vector<int64_t>* out) override {
    select(INT64_MAX, keep, out);
  }

 private:
  // A slot's two links side by side: a move touches one cache line per slot, not two.
  // prev == kUnlinked: the slot is not in the list.
  static constexpr int64_t kUnlinked = -2;
  struct Link {
    int64_t prev = kUnlinked, next = -1;
  };

  void unlink(int64_t s) {
    Link& l = links_[s];
    if (l.prev == kUnlinked) return;
    if (l.prev != -1) links_[l.prev].next = l.next; else head_ = l.next;
    if (l.next != -1) links_[l.next].prev = l.prev; else tail_ = l.prev;
    l = Link{};
  }
  void move_to_head(int64_t s) {
    if (head_ == s) return;
    unlink(s);
    links_[s] = Link{-1, head_};
    if (head_ != -1) links_[head_].prev = s;
    head_ = s;
    if (tail_ == -1) tail_ = s;
  }

  std::vector<Link> links_;
  int64_t head_ = -1, tail_ = -1;
};

// Least frequently used with aging. An indexed binary min-heap keyed by (count, last use);
// every aging_period uses all counts halve, so rows hot long ago lose their advantage.
class LfuPolicy final : public EvictionPolicy {
 public:
  explicit LfuPolicy(int64_t capacity)
      : pos_(capacity, -1), count_(capacity, 0), last_(capacity, 0),
        aging_period_(std::max<int64_t>(1024, 8 * capacity)) {}
  const char* name() const override { return "lfu"; }

  void touch(const int64_t* slots, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) {
      int64_t s = slots[i];
      if (count_[s] < (1u << 30)) ++count_[s];
      last_[s] = ++clock_;
      if (pos_[s] >= 0) sift_down(pos_[s]);
    }
    age(n);
  }

  void insert(const int64_t* slots, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) {
      int64_t s = slots[i];
      count_[s] = 1;
      last_[s] = ++clock_;
      if (pos_[s] < 0) {
        pos_[s] = static_cast<int64_t>(heap_.size());
        heap_.push_back(s);
        sift_up(pos_[s]);
      } else {
        sift_down(sift_up(pos_[s]));
      }
    }
    age(n);
  }

  void remove(int64_t slot) override {
    int64_t i = pos_[slot];
    if (i < 0) return;
    int64_t last = heap_.back();
    heap_.pop_back();
    pos_[slot] = -1;
    if (last != slot) {
      heap_[i] = last;
      pos_[last] = i;
      sift_down(sift_up(i));
    }
  }

  // The k smallest evictable entries of a heap, found best-first without changing it.
  int64_t select(int64_t n, const SlotFilter& evictable, std::vector<int64_t>* out) override {
    using Entry = std::tuple<uint32_t, uint64_t, int64_t>;  // count, last use, heap index
    std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> frontier;
    auto push = [&](int64_t i) {
      if (i < static_cast<int64_t>(heap_.size())) frontier.emplace(count_[heap_[i]], last_[heap_[i]], i);
    };
    push(0);
    int64_t found = 0;
    while (!frontier.empty() && found < n) {
      int64_t i = std::get<2>(frontier.top());
      frontier.pop();
      if (evictable(heap_[i])) {
        out->push_back(heap_[i]);
        ++found;
      }
      push(2 * i + 1);
      push(2 * i + 2);
    }
    return found;
  }

  void order(const SlotFilter& keep, std::vector<int64_t>* out) override { select(INT64_MAX, keep, out); }

 private:
  bool less(int64_t a, int64_t b) const {
    return count_[a] != count_[b] ? count_[a] < count_[b] : last_[a] < last_[b];
  }
  void place(int64_t i, int64_t s) {
    heap_[i] = s;
    pos_[s] = i;
  }
  int64_t sift_up(int64_t i) {
    int64_t s = heap_[i];
    while (i > 0) {
      int64_t p = (i - 1) / 2;
      if (!less(s, heap_[p])) break;
      place(i, heap_[p]);
      i = p;
    }
    place(i, s);
    return i;
  }
  int64_t sift_down(int64_t i) {
    int64_t n = static_cast<int64_t>(heap_.size()), s = heap_[i];
    for (;;) {
      int64_t c = 2 * i + 1;
      if (c >= n) break;
      if (c + 1 < n && less(heap_[c + 1], heap_[c])) ++c;
      if (!less(heap_[c], s)) break;
      place(i, heap_[c]);
      i = c;
    }
    place(i, s);
    return i;
  }
  void age(int64_t uses) {
    uses_since_aging_ += uses;
    if (uses_since_aging_ < aging_period_) return;
    uses_since_aging_ = 0;
    for (int64_t s : heap_) count_[s] >>= 1;
    for (int64_t i = static_cast<int64_t>(heap_.size()) / 2 - 1; i >= 0; --i) sift_down(i);
  }

  std::vector<int64_t> heap_, pos_;
  std::vector<uint32_t> count_;
  std::vector<uint64_t> last_;
  uint64_t clock_ = 0;
  int64_t aging_period_, uses_since_aging_ = 0;
};

// CLOCK (second chance): a hand sweeps the slots; a used slot gets its bit cleared once before
// it can be chosen.
class ClockPolicy final : public EvictionPolicy {
 public:
  explicit ClockPolicy(int64_t capacity) : capacity_(capacity), referenced_(capacity, 0) {}
  const char* name() const override { return "clock"; }

  void touch(const int64_t* slots, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) referenced_[slots[i]] = 1;
  }
  void insert(const int64_t* slots, int64_t n) override { touch(slots, n); }
  void remove(int64_t slot) override { referenced_[slot] = 0; }

  int64_t select(int64_t n, const SlotFilter& evictable, std::vector<int64_t>* out) override {
    pending_clear_.clear();
    return sweep(n, evictable, out, &pending_clear_, &pending_hand_);
  }

  void order(const SlotFilter& keep, std::vector<int64_t>* out) override {
    std::vector<int64_t> cleared;
    int64_t hand;
    sweep(INT64_MAX, keep, out, &cleared, &hand);
  }

  void accept() override {
    for (int64_t s : pending_clear_) referenced_[s] = 0;
    hand_ = pending_hand_;
    forget();
  }
  void forget() override {
    pending_clear_.clear();
    pending_hand_ = hand_;
  }

 private:
  // From the hand: lap one takes unreferenced slots and notes the referenced ones to clear;
  // lap two takes what lap one would have cleared. Records what accept() would apply.
  int64_t sweep(int64_t n, const SlotFilter& evictable, std::vector<int64_t>* out, std::vector<int64_t>* clear,
                int64_t* hand) const {
    int64_t found = 0, pos = hand_;
    for (int64_t step = 0; step < 2 * capacity_ && found < n; ++step, pos = (pos + 1) % capacity_) {
      if (!evictable(pos)) continue;
      bool second_lap = step >= capacity_;
      if (referenced_[pos] && !second_lap) {
        clear->push_back(pos);
      } else if (!referenced_[pos] || second_lap) {
        if (second_lap && !referenced_[pos]) continue;  // taken in lap one already
        out->push_back(pos);
        ++found;
      }
    }
    *hand = pos;
    return found;
  }

  int64_t capacity_;
  std::vector<uint8_t> referenced_;
  std::vector<int64_t> pending_clear_;
  int64_t hand_ = 0, pending_hand_ = 0;
};

}  // namespace

std::unique_ptr<EvictionPolicy> make_policy(const std::string& name, int64_t capacity) {
  if (name == "lru") return std::make_unique<LruPolicy>(capacity);
  if (name == "lfu") return std::make_unique<LfuPolicy>(capacity);
  if (name == "clock") return std::make_unique<ClockPolicy>(capacity);
  return nullptr;
}

}  // namespace tieredemb
