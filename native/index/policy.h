// Eviction policies: runtime strategy objects called once per batch.
//
// A policy orders the occupied regular slots of one cache tier (never its overflow slots). The
// tier tells it which slots were used (touch), which now hold a newly inserted row (insert) and
// which were emptied (remove); it asks for victims with select(), which must not change what a
// later select() would return unless accept() is called: a batch plan that fails half-way
// leaves the policy as it was.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace tieredemb {

using SlotFilter = std::function<bool(int64_t)>;

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  virtual const char* name() const = 0;
  // Records one use of each slot, in order.
  virtual void touch(const int64_t* slots, int64_t n) = 0;
  // Records that each slot now holds a new row (its first use).
  virtual void insert(const int64_t* slots, int64_t n) = 0;
  // Forgets a slot that was emptied without reuse.
  virtual void remove(int64_t slot) = 0;
  // Records a batch's uses in order: slot k is a new row (insert) if fresh[k], else a use of a
  // resident one (touch). Same effect as those calls one by one; a policy may do it faster.
  virtual void use(const int64_t* slots, const uint8_t* fresh, int64_t n) {
    for (int64_t k = 0; k < n; ++k) {
      if (fresh[k]) insert(slots + k, 1); else touch(slots + k, 1);
    }
  }
  // Appends up to n victims, best first, among occupied slots with evictable(slot).
  // Returns how many were appended.
  virtual int64_t select(int64_t n, const SlotFilter& evictable, std::vector<int64_t>* out) = 0;
  // Appends every occupied slot with keep(slot), in the order select() would take them.
  // Changes nothing (a later select() or accept() is not affected).
  virtual void order(const SlotFilter& keep, std::vector<int64_t>* out) = 0;
  // Applies the side effects of the last select() (e.g. CLOCK's hand movement).
  virtual void accept() {}
  // Drops them (the plan that selected was not committed): a later accept() applies nothing.
  virtual void forget() {}
};

// Names: "lru", "lfu" (frequency with aging: counts halve every aging_period uses), "clock".
// Returns null for an unknown name.
std::unique_ptr<EvictionPolicy> make_policy(const std::string& name, int64_t capacity);

}  // namespace tieredemb
