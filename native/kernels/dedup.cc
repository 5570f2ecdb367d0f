#include "kernels/dedup.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <string>

#include "common/flat_map.h"
#include "common/thread_pool.h"

namespace tieredemb {
namespace {

// An open-addressing table from id to a 32-bit index, kept between calls and left empty after
// each: sized from the entries of the previous call (not from the batch), so it stays in cache,
// and only the entries a call filled are cleared. Key and index share one entry (one cache line
// per probe); Key is uint32_t when every id fits, else int64_t.
template <class Key>
class IdTable {
 public:
  // Empties the table (if a call ended early) and sizes it for this call, at most 2 * n slots.
  void begin(int64_t n) {
    uint64_t bound = 1024;
    while (bound < static_cast<uint64_t>(n) * 2) bound <<= 1;
    uint64_t size = 1024;
    while (size < static_cast<uint64_t>(last_size_) * 4 && size < bound) size <<= 1;
    if (entries_.size() != size || !clean_) entries_.assign(size, Entry{kEmpty, 0});
    mask_ = size - 1;
    used_.clear();
    clean_ = false;
  }
  // Clears the entries of this call.
  void end() {
    for (uint64_t h : used_) entries_[h].key = kEmpty;
    last_size_ = static_cast<int64_t>(used_.size());
    clean_ = true;
  }
  void prefetch(int64_t id) const { __builtin_prefetch(&entries_[FlatMap::hash(id) & mask_]); }
  // The index of id, inserting `fresh` if id is absent (then returns fresh).
  int64_t find_or_insert(int64_t id, int64_t fresh) {
    Key key = static_cast<Key>(id);
    uint64_t h = slot(id, key);
    if (entries_[h].key == key) return entries_[h].index;
    entries_[h] = Entry{key, static_cast<int32_t>(fresh)};
    used_.push_back(h);
    if (used_.size() * 2 > entries_.size()) grow();
    return fresh;
  }

 private:
  static constexpr Key kEmpty = static_cast<Key>(-1);  // no id: ids are < 2^32 - 1 or >= 0
  struct Entry {
    Key key;
    int32_t index;
  };

  uint64_t slot(int64_t id, Key key) const {
    uint64_t h = FlatMap::hash(id) & mask_;
    while (entries_[h].key != kEmpty && entries_[h].key != key) h = (h + 1) & mask_;
    return h;
  }
  __attribute__((noinline, cold)) void grow() {
    std::vector<Entry> filled;
    filled.reserve(used_.size());
    for (uint64_t h : used_) filled.push_back(entries_[h]);
    entries_.assign(entries_.size() * 2, Entry{kEmpty, 0});
    mask_ = entries_.size() - 1;
    used_.clear();
    for (const Entry& e : filled) {
      uint64_t h = slot(static_cast<int64_t>(e.key), e.key);
      entries_[h] = e;
      used_.push_back(h);
    }
  }

  std::vector<Entry> entries_;
  std::vector<uint64_t> used_;  // positions filled this call
  uint64_t mask_ = 0;
  int64_t last_size_ = 0;
  bool clean_ = true;  // false only if a call ended early (an allocation failed)
};

// The calling thread's table. Not inlined: in a shared object each use of a thread_local is a
// call to __tls_get_addr, which GCC made again at each use (4 a id) rather than keep the address;
// a reference a call returns stays in a register (dedup 1.7x faster, measured).
template <class Key>
[[gnu::noinline]] IdTable<Key>& thread_table() {
  thread_local IdTable<Key> table;
  return table;
}

template <class Key>
void dedup_with(const int64_t* ids, int64_t n, std::vector<int64_t>* unique, int64_t* inverse) {
  // One thread: splitting the batch and merging the parts' lists measured slower on 2 cores
  // (dedup_segments splits where no merge is needed).
  IdTable<Key>& table = thread_table<Key>();
  table.begin(n);
  unique->clear();
  constexpr int64_t kAhead = 16;  // hash slots prefetched ahead
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) table.prefetch(ids[i + kAhead]);
    int64_t fresh = static_cast<int64_t>(unique->size());
    int64_t j = table.find_or_insert(ids[i], fresh);
    if (j == fresh) unique->push_back(ids[i]);
    inverse[i] = j;
  }
  table.end();
}

}  // namespace

Status dedup(const int64_t* ids, int64_t n, int64_t num_embeddings, std::vector<int64_t>* unique, int64_t* inverse) {
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= num_embeddings) {
      return Status::IndexError("id " + std::to_string(ids[i]) + " out of range [0, " +
                                std::to_string(num_embeddings) + ")");
    }
  }
  if (n >= std::numeric_limits<int32_t>::max())
    return Status::ValueError("batch of " + std::to_string(n) + " ids: dedup takes fewer than 2^31 - 1");
  if (num_embeddings < static_cast<int64_t>(std::numeric_limits<uint32_t>::max())) {
    dedup_with<uint32_t>(ids, n, unique, inverse);
  } else {
    dedup_with<int64_t>(ids, n, unique, inverse);
  }
  return Status::Ok();
}

Status dedup_segments(const int64_t* ids, int64_t n, int64_t num_embeddings, const int64_t* starts,
                      const int64_t* row_ends, int64_t segments, std::vector<int64_t>* unique, int64_t* inverse) {
  if (segments < 1) return Status::ValueError("dedup: segments need at least one (starts has 2 entries or more)");
  if (starts[0] != 0 || starts[segments] != n)
    return Status::ValueError("dedup: segment starts must run from 0 to the " + std::to_string(n) + " ids, got " +
                              std::to_string(starts[0]) + " .. " + std::to_string(starts[segments]));
  for (int64_t k = 0; k < segments; ++k) {
    const int64_t lo = k > 0 ? row_ends[k - 1] : 0;
    if (starts[k + 1] < starts[k])
      return Status::ValueError("dedup: segment starts must be non-decreasing, got starts[" + std::to_string(k + 1) +
                                "] = " + std::to_string(starts[k + 1]) + " after " + std::to_string(starts[k]));
    if (row_ends[k] < lo || row_ends[k] > num_embeddings)
      return Status::ValueError("dedup: row_ends must ascend within [0, " + std::to_string(num_embeddings) +
                                "], got row_ends[" + std::to_string(k) + "] = " + std::to_string(row_ends[k]));
  }
  for (int64_t k = 0; k < segments; ++k) {
    const int64_t lo = k > 0 ? row_ends[k - 1] : 0;
    for (int64_t i = starts[k]; i < starts[k + 1]; ++i) {
      if (ids[i] < lo || ids[i] >= row_ends[k])
        return Status::IndexError("id " + std::to_string(ids[i]) + " out of range [" + std::to_string(lo) + ", " +
                                  std::to_string(row_ends[k]) + ") of its segment " + std::to_string(k));
    }
  }
  if (n >= std::numeric_limits<int32_t>::max())
    return Status::ValueError("batch of " + std::to_string(n) + " ids: dedup takes fewer than 2^31 - 1");
  // Largest segments first: the threads take them in turn (thread_pool.h), so the last ones
  // taken are the small ones.
  std::vector<int64_t> order(segments);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return starts[a + 1] - starts[a] > starts[b + 1] - starts[b];
  });
  std::vector<std::vector<int64_t>> parts(segments);
  const bool narrow = num_embeddings < static_cast<int64_t>(std::numeric_limits<uint32_t>::max());
  parallel_for(segments, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t k = order[j], first = starts[k], count = starts[k + 1] - first;
      if (narrow) {
        dedup_with<uint32_t>(ids + first, count, &parts[k], inverse + first);
      } else {
        dedup_with<int64_t>(ids + first, count, &parts[k], inverse + first);
      }
    }
  });
  std::vector<int64_t> base(segments + 1, 0);
  for (int64_t k = 0; k < segments; ++k) base[k + 1] = base[k] + static_cast<int64_t>(parts[k].size());
  unique->resize(base[segments]);
  parallel_for(segments, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      std::copy(parts[k].begin(), parts[k].end(), unique->begin() + base[k]);
      if (base[k] == 0) continue;
      for (int64_t i = starts[k]; i < starts[k + 1]; ++i) inverse[i] += base[k];
    }
  });
  return Status::Ok();
}

}  // namespace tieredemb
