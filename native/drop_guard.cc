// tieredemb._C.DropGuard: calls a function when it is freed, unless disarmed first; what releases
// the pins of a batch, or of a replayed forward, whose autograd graph was dropped without a backward
// (tieredemb/tiers/table.py ResidentBatch, tieredemb/gpu/graphed.py).
//
// Native so that Python's cyclic garbage collector does not track it, on purpose. That collector
// can judge live objects unreachable: torch's traversal of a tensor visits its autograd node's
// context only while the tensor and the node have one owner each, and another thread, without the
// GIL, can add an owner between the collector's two passes (a view of a custom Function's output
// made while another thread collects: bench/gc_race.py shows it with torch alone). The collector
// then finalizes what hangs off the context, __del__ and weakref callbacks included, though the
// graph is alive and its backward still to come: a batch's pins went before its backward ran. It
// resurrects those objects afterwards, but the finalizers have run. An untracked object is never in
// the collector's sets: it is freed only when its last reference goes, by reference counting, and
// then its function runs. So nothing the function reaches may lead back to the guard's owner: the
// collector could not break that cycle (a batch's function reaches its store, which holds no batch;
// a flight's reaches its shape and tables, which hold no autograd graph).
#include "common/bindings.h"

namespace tieredemb {

namespace {

class DropGuard {
 public:
  explicit DropGuard(nb::object fn) : fn_(std::move(fn)) {}
  DropGuard(const DropGuard&) = delete;
  DropGuard& operator=(const DropGuard&) = delete;

  ~DropGuard() {  // (freed by Python: the GIL is held)
    if (!fn_.is_valid()) return;
    // Freed while an exception propagates (a forward's output a temporary of an expression that
    // raised): that exception is set aside for the call and restored after, as CPython does around
    // __del__ (calling Python with it set turned it into a SystemError, or crashed).
    nb::error_scope pending;
    nb::object fn = std::move(fn_);
    try {
      fn();
    } catch (nb::python_error& e) {
      e.discard_as_unraisable("tieredemb DropGuard: the function run as its guard was freed");
    } catch (...) {
    }
  }

  void disarm() { fn_.reset(); }
  bool armed() const { return fn_.is_valid(); }

 private:
  nb::object fn_;  // (invalid once disarmed or run)
};

}  // namespace

void register_drop_guard(nb::module_& m) {
  using namespace nb::literals;
  nb::class_<DropGuard>(m, "DropGuard",
                        "calls fn() once when freed, unless disarm() came first; not tracked by the cyclic "
                        "garbage collector (see native/drop_guard.cc)")
      .def(nb::init<nb::object>(), "fn"_a)
      .def("disarm", &DropGuard::disarm, "fn will not be called (its reference is dropped now)")
      .def_prop_ro("armed", &DropGuard::armed);
}

}  // namespace tieredemb
