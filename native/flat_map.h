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
    if (want <= keys_.size()) return;
    std::vector<int64_t> old_keys = std::move(keys_), old_vals = std::move(vals_);
    keys_.assign(want, kEmpty);
    vals_.assign(want, 0);
    mask_ = want - 1;
    size_ = 0;
    for (size_t i = 0; i < old_keys.size(); ++i)
      if (old_keys[i] != kEmpty) insert(old_keys[i], old_vals[i]);
  }

  void clear() {
    std::fill(keys_.begin(), keys_.end(), kEmpty);
    size_ = 0;
  }

  int64_t size() const { return size_; }

  // Returns the value of key, or kEmpty.
  int64_t find(int64_t key) const {
    for (uint64_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
      if (keys_[i] == key) return vals_[i];
      if (keys_[i] == kEmpty) return kEmpty;
    }
  }

  // Inserts key -> val if absent. Returns the value now stored and whether it was inserted.
  std::pair<int64_t, bool> insert(int64_t key, int64_t val) {
    if ((size_ + 1) * 2 > static_cast<int64_t>(keys_.size())) reserve(static_cast<int64_t>(keys_.size()));
    for (uint64_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
      if (keys_[i] == key) return {vals_[i], false};
      if (keys_[i] == kEmpty) {
        keys_[i] = key;
        vals_[i] = val;
        ++size_;
        return {val, true};
      }
    }
  }

  // Sets key -> val, inserting key if absent.
  void assign(int64_t key, int64_t val) {
    if ((size_ + 1) * 2 > static_cast<int64_t>(keys_.size())) reserve(static_cast<int64_t>(keys_.size()));
    for (uint64_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
      if (keys_[i] == key) {
        vals_[i] = val;
        return;
      }
      if (keys_[i] == kEmpty) {
        keys_[i] = key;
        vals_[i] = val;
        ++size_;
        return;
      }
    }
  }

  // Removes key if present. Returns whether it was present.
  bool erase(int64_t key) {
    uint64_t i = hash(key) & mask_;
    while (keys_[i] != key) {
      if (keys_[i] == kEmpty) return false;
      i = (i + 1) & mask_;
    }
    // Backward-shift: pull later members of the probe run into the hole.
    uint64_t hole = i;
    for (uint64_t j = (hole + 1) & mask_; keys_[j] != kEmpty; j = (j + 1) & mask_) {
      uint64_t home = hash(keys_[j]) & mask_;
      bool movable = hole <= j ? (home <= hole || home > j) : (home <= hole && home > j);
      if (movable) {
        keys_[hole] = keys_[j];
        vals_[hole] = vals_[j];
        hole = j;
      }
    }
    keys_[hole] = kEmpty;
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
  std::vector<int64_t> keys_, vals_;
  uint64_t mask_ = 0;
  int64_t size_ = 0;
};

}  // namespace tieredemb
