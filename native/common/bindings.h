// What the bindings of every group share (common/, index/, kernels/ and ssd/ bindings.cc): the
// array types that cross, Status -> Python exception, vector -> numpy, and the checks of row and
// slot arguments.
//
// Every batch call releases the GIL for all of its work, its O(n) checks included: a check in
// the released region returns a Status, and the binding raises it once it holds the GIL again
// (run_without_gil). Nothing is thrown while the GIL is released.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#ifdef __GLIBCXX__
#include <cxxabi.h>  // (abi::__forced_unwind)
#endif

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/status.h"

namespace tieredemb {

namespace nb = nanobind;

using Ids = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using MutIds = nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Rows = nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using ConstRows = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Floats = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using MutFloats = nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Bytes = nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using ConstBytes = nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// Throws the Python exception of an error (IndexError, ValueError, RuntimeError); nothing for Ok.
// Call with the GIL held.
inline void raise_if_error(const Status& s) {
  switch (s.code) {
    case Status::kOk: return;
    case Status::kIndexError: throw nb::index_error(s.message.c_str());
    case Status::kValueError: throw nb::value_error(s.message.c_str());
    case Status::kRuntimeError: throw std::runtime_error(s.message);
  }
}

// Takes the GIL back after PyEval_SaveThread. Python 3.11-3.13 end a thread that takes it while
// the interpreter finalizes in another (a daemon thread in a native call at exit) with pthread_exit,
// whose unwinding aborts the process when it meets a frame that may not throw or a catch (...), as
// nanobind's calls have: "terminate called without an active exception", rc 134. Such a thread is
// parked for good instead, as Python 3.14 does itself; before_parking(arg) first lets go of what it
// holds that the finalizing thread may need.
inline void restore_or_park(PyThreadState* state, void (*before_parking)(void*) = nullptr,
                            void* arg = nullptr) noexcept {
#ifdef __GLIBCXX__
  try {
    PyEval_RestoreThread(state);
  } catch (abi::__forced_unwind&) {
    if (before_parking != nullptr) before_parking(arg);
    for (;;) std::this_thread::sleep_for(std::chrono::hours(24));
  }
#else
  PyEval_RestoreThread(state);
#endif
}

// nb::gil_scoped_release, with restore_or_park: every native call of both modules lets the GIL go
// through it (also as nb::call_guard<GilReleased>).
class GilReleased {
 public:
  GilReleased() : state_(PyEval_SaveThread()) {}
  ~GilReleased() { restore_or_park(state_); }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  PyThreadState* state_;
};

// Runs fn() -> Status with the GIL released, then raises its error with the GIL held.
// fn must not throw (it returns its errors).
template <class Fn>
void run_without_gil(Fn&& fn) {
  Status s;
  {
    GilReleased released;
    s = fn();
  }
  raise_if_error(s);
}

// A numpy array that owns v's buffer (no copy).
template <typename T>
nb::ndarray<nb::numpy, T, nb::ndim<1>> to_numpy(std::vector<T>&& v) {
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T, nb::ndim<1>>(heap->data(), {heap->size()}, owner);
}

// Ok if a block is [want_rows, want_width] (want_width < 0: any width), else ValueError naming
// both shapes.
inline Status check_rows(const std::string& what, int64_t got_rows, int64_t want_rows, int64_t got_width,
                         int64_t want_width) {
  if (got_rows == want_rows && (want_width < 0 || got_width == want_width)) return Status::Ok();
  return Status::ValueError(what + ": expected [" + std::to_string(want_rows) + ", " +
                            (want_width < 0 ? std::string("any") : std::to_string(want_width)) + "] rows, got [" +
                            std::to_string(got_rows) + ", " + std::to_string(got_width) + "]");
}

// Ok if every slots[i] is in [0, rows), else IndexError naming the first that is not:
// "<what> <slot> out of range [0, <rows>)". O(n): call it with the GIL released.
inline Status check_slots(const std::string& what, const int64_t* slots, int64_t n, int64_t rows) {
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] < 0 || slots[i] >= rows)
      return Status::IndexError(what + " " + std::to_string(slots[i]) + " out of range [0, " + std::to_string(rows) +
                                ")");
  }
  return Status::Ok();
}

// The bindings of common/ (thread count, host pools, copy_rows), registered into both
// extension modules.
void register_common(nb::module_& m);

}  // namespace tieredemb
