// Open-addressing hash map from non-negative int64 keys to int64 values.
// Linear probing, power-of-two table, backward-shift deletion (no tombstones), so lookups stay
// short however many inserts and erases a long-running cache makes.
#pragma once

#include <cstdint>
#include <algorithm>
#include <utility>
#include <vector>

namespace tieredemb {

class FlatMap {
 public:
  static constexpr int64_t kEmpty = -1;

  explicit FlatMap(int64_t expected = 16) { reserve(expected); }

  // Makes room for `expected` keys at load factor <= 1/2. Drops nothing.
  void reserve(int64_t expected) {
    uint64_t want = 16;
    while (want < static_cast<uint64_t>(expected) * 2) want <<= 1;
    if (want <= slots_.size()) return;
    std::vector<Entry> old = std::move(slots_);
    slots_.assign(want, Entry{});
    mask_ = want - 1;
    size_ = 0;
    for (const Entry& e : old)
      if (e.key != kEmpty) insert(e.key, e.val);
  }

  void clear() {
    std::fill(slots_.begin(), slots_.end(), Entry{});
    size_ = 0;
  }

  int64_t size() const { return size_; }

  // Starts loading key's home bucket (a caller about to look up keys at random, some ahead).
  void prefetch(int64_t key) const { __builtin_prefetch(&slots_[hash(key) & mask_]); }

  // The value of key, where it is stored (valid until the next insert or erase), or null.
  int64_t* find_value(int64_t key) {
    for (uint64_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
      if (slots_[i].key == key) return &slots_[i].val;
      if (slots_[i].key == kEmpty) return nullptr;
    }
  }
  const int64_t* find_value(int64_t key) const { return const_cast<FlatMap*>(this)->find_value(key); }

  // Inserts key -> val if absent (one probe). Returns where key's value is stored (valid until
  // the next insert or erase) and whether it was inserted.
  std::pair<int64_t*, bool> emplace(int64_t key, int64_t val) {
    if ((size_ + 1) * 2 > static_cast<int64_t>(slots_.size())) reserve(static_cast<int64_t>(slots_.size()));
    for (uint64_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
      if (slots_[i].key == key) return {&slots_[i].val, false};
      if (slots_[i].key == kEmpty) {
        slots_[i] = Entry{key, val};
        ++size_;
        return {&slots_[i].val, true};
      }
    }
  }

  // Returns the value of key, or kEmpty.
  int64_t find(int64_t key) const {
    const int64_t* val = find_value(key);
    return val == nullptr ? kEmpty : *val;
  }

  // Inserts key -> val if absent. Returns the value now stored and whether it was inserted.
  std::pair<int64_t, bool> insert(int64_t key, int64_t val) {
    auto [stored, inserted] = emplace(key, val);
    return {*stored, inserted};
  }

  // Sets key -> val. Returns the value it replaced, or kEmpty if key was absent (one probe).
  int64_t exchange(int64_t key, int64_t val) {
    auto [stored, inserted] = emplace(key, val);
    if (inserted) return kEmpty;
    const int64_t old = *stored;
    *stored = val;
    return old;
  }

  // Sets key -> val, inserting key if absent.
  void assign(int64_t key, int64_t val) { exchange(key, val); }

  // Removes key if present. Returns whether it was present.
  bool erase(int64_t key) {
    uint64_t i = hash(key) & mask_;
    while (slots_[i].key != key) {
      if (slots_[i].key == kEmpty) return false;
      i = (i + 1) & mask_;
    }
    // Backward-shift: pull later members of the probe run into the hole.
    uint64_t hole = i;
    for (uint64_t j = (hole + 1) & mask_; slots_[j].key != kEmpty; j = (j + 1) & mask_) {
      uint64_t home = hash(slots_[j].key) & mask_;
      bool movable = hole <= j ? (home <= hole || home > j) : (home <= hole && home > j);
      if (movable) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole].key = kEmpty;
    --size_;
    return true;
  }

  static uint64_t hash(int64_t key) {
    uint64_t x = static_cast<uint64_t>(key);
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return x;
  }

 private:
  // Key and value side by side: a lookup touches one cache line, not two.
  struct Entry {
    int64_t key = kEmpty;
    int64_t val = 0;
  };
  std::vector<Entry> slots_;
  uint64_t mask_ = 0;
  int64_t size_ = 0;
};

}  // namespace tieredemb
