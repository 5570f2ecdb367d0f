// SlotSet: a set of slots (or row ids) in [0, size) that lists its members without scanning
// [0, size): a bit per slot, plus a bit per 64-slot word that is set where the word is not zero,
// plus a bit per word of those. insert, erase and contains are O(1); listing the members, in
// increasing order, costs O(members + size / 2^18) words read.
// Memory is lazily reserved (Bitmap): O(1) to create, pages only where members are or were.
// Thread-safety: none of its own; the owning index is called by one thread at a time.
#pragma once

#include <cstdint>
#include <string>

#include "common/host_buffer.h"

namespace tieredemb {

class SlotSet {
 public:
  // Reserves room for slots [0, size). Returns an error message, empty on success.
  std::string allocate(int64_t size) {
    std::string err = bits_.allocate(size);
    if (err.empty()) err = words_.allocate((size + 63) / 64);
    if (err.empty()) err = groups_.allocate((size + 4095) / 4096);
    size_ = size;
    return err;
  }
  int64_t size() const { return count_; }
  bool contains(int64_t s) const { return bits_.test(s); }
  // Adds s. Returns false if it was a member already.
  bool insert(int64_t s) {
    if (bits_.test(s)) return false;
    bits_.set(s);
    words_.set(s >> 6);
    groups_.set(s >> 12);
    ++count_;
    return true;
  }
  // Removes s. Returns false if it was not a member.
  bool erase(int64_t s) {
    if (!bits_.test(s)) return false;
    bits_.clear(s);
    if (bits_.words()[s >> 6] == 0) {
      words_.clear(s >> 6);
      if (words_.words()[s >> 12] == 0) groups_.clear(s >> 12);
    }
    --count_;
    return true;
  }
  // Calls fn(s) for each member s >= start in increasing order while fn returns true.
  template <class Fn>
  void for_each(int64_t start, Fn&& fn) const {
    if (count_ == 0 || start >= size_) return;
    start = start < 0 ? 0 : start;
    const uint64_t* groups = groups_.words();
    const uint64_t* words = words_.words();
    const uint64_t* bits = bits_.words();
    for (int64_t g = start >> 18; g * (int64_t{1} << 18) < size_; ++g) {
      for (uint64_t gb = from(groups[g], g, start >> 12); gb != 0; gb &= gb - 1) {
        const int64_t m = g * 64 + __builtin_ctzll(gb);
        for (uint64_t wb = from(words[m], m, start >> 6); wb != 0; wb &= wb - 1) {
          const int64_t w = m * 64 + __builtin_ctzll(wb);
          for (uint64_t b = from(bits[w], w, start); b != 0; b &= b - 1) {
            if (!fn(w * 64 + __builtin_ctzll(b))) return;
          }
        }
      }
    }
  }

 private:
  // The bits of word `index` (which covers children [64 * index, 64 * index + 64)) for the
  // children >= first.
  static uint64_t from(uint64_t word, int64_t index, int64_t first) {
    const int64_t skip = first - index * 64;
    if (skip <= 0) return word;
    return skip >= 64 ? 0 : word & (~uint64_t{0} << skip);
  }

  Bitmap bits_, words_, groups_;  // a bit per slot; per word of bits_; per word of words_
  int64_t size_ = 0, count_ = 0;
};

}  // namespace tieredemb
