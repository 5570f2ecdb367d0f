// tieredemb._C.CountedLock: the package's lock (tieredemb/locks.py), plain or reentrant, whose holds
// are counted per thread, with a condition of its own (wait, wait_for, notify_all: threading.Condition's).
//
// Native so that a Python signal handler cannot run inside it. Every method is one call into C with
// the GIL held on entry and on return: a handler runs only between bytecodes, so it sees either the
// lock and its counts before the call or after it, never between. `with lock:` calls __enter__
// inside the with statement's own instruction, so an exception raised right after it still runs
// __exit__. (A Python wrapper had windows: the lock taken but not counted, or counted but not taken;
// so had threading.Condition's Python __enter__ and wait around any lock.)
//
// State (owner, holds, the notify count) is guarded by mu_; mu_ is held only briefly, never while
// waiting for the GIL. A blocked acquire or wait waits with the GIL released and looks for signals
// every 20 ms, so Ctrl-C interrupts it, as it does threading's: an acquire then has taken nothing, a
// wait has taken its holds back (as threading.Condition's does) before the exception leaves it.
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <nanobind/stl/optional.h>

#include "common/bindings.h"

namespace tieredemb {

using namespace nb::literals;

namespace {

thread_local int64_t held_by_this_thread = 0;  // holds of every CountedLock, by the calling thread

// A timeout in seconds as threading's locks take it: -1 (or None) none, else in [0, TIMEOUT_MAX].
void check_timeout(double timeout) {
  constexpr double kTimeoutMax = 9223372036.0;  // (threading.TIMEOUT_MAX on Linux)
  if (std::isnan(timeout)) throw nb::value_error("timeout must be a number, got nan");
  if (timeout < 0 && timeout != -1) throw nb::value_error("timeout value must be a non-negative number");
  if (timeout > kTimeoutMax) {
    PyErr_SetString(PyExc_OverflowError, "timeout value is too large");
    throw nb::python_error();
  }
}

class CountedLock {
 public:
  explicit CountedLock(bool reentrant) : reentrant_(reentrant) {}

  // threading.Lock's acquire(blocking, timeout); a plain lock taken again by its holder raises
  // (it would wait for itself) unless blocking is false.
  bool acquire(bool blocking, double timeout) {
    if (!blocking && timeout != -1) throw nb::value_error("can't specify a timeout for a non-blocking call");
    check_timeout(timeout);
    const unsigned long me = PyThread_get_thread_ident();
    {
      std::lock_guard<std::mutex> g(mu_);
      if (holds_ > 0 && owner_ == me) {
        if (!reentrant_) {
          if (!blocking) return false;
          throw std::runtime_error(
              "a table was called from inside its own update on the same thread (from a signal handler?): it "
              "would wait for itself. Call it between steps");
        }
        ++holds_;
        ++held_by_this_thread;
        return true;
      }
      if (holds_ == 0) {
        take(me, 1);
        return true;
      }
    }
    if (!blocking) return false;
    return wait_and_take(me, 1, timeout, true);
  }

  void release() {
    std::lock_guard<std::mutex> g(mu_);
    check_held("release");
    --held_by_this_thread;
    if (--holds_ == 0) free_.notify_one();
  }

  bool is_owned() {
    std::lock_guard<std::mutex> g(mu_);
    return holds_ > 0 && owner_ == PyThread_get_thread_ident();
  }

  // threading.Condition's wait(timeout): gives up every hold of the calling thread until notify_all
  // or the timeout (seconds; negative: none), then takes them back. Returns false at timeout.
  bool wait(double timeout) {
    using Clock = std::chrono::steady_clock;
    check_timeout(timeout);
    const unsigned long me = PyThread_get_thread_ident();
    const auto deadline = after(timeout);
    int64_t holds;
    uint64_t called;
    {
      std::lock_guard<std::mutex> g(mu_);
      check_held("wait on");
      holds = holds_;
      called = notified_;
      held_by_this_thread -= holds;
      holds_ = 0;
      free_.notify_one();
    }
    bool woken = false;
    std::optional<nb::python_error> interrupted;  // (taken from Python's error indicator at once)
    for (;;) {
      bool late = false;
      {
        GilReleased unlocked;
        std::unique_lock<std::mutex> g(mu_);
        auto until = Clock::now() + kSlice;
        if (timeout >= 0 && deadline < until) until = deadline;
        woken = notify_.wait_until(g, until, [&] { return notified_ != called; });
        late = !woken && timeout >= 0 && Clock::now() >= deadline;
      }
      if (woken || late) break;
      if (PyErr_CheckSignals() != 0) {
        interrupted.emplace();
        break;
      }
    }
    {
      std::unique_lock<std::mutex> g(mu_);
      if (holds_ == 0) {
        take(me, holds);
      } else {
        g.unlock();
        wait_and_take(me, holds, -1, false);  // (not interruptible: the caller's holds must come back)
      }
    }
    if (interrupted) throw *interrupted;
    return woken;
  }

  // threading.Condition's wait_for: waits until predicate() is true or the timeout (seconds; None: no
  // limit) has passed; returns the predicate's last value. The predicate runs with the lock held.
  nb::object wait_for(nb::callable predicate, std::optional<double> timeout) {
    using Clock = std::chrono::steady_clock;
    if (timeout) check_timeout(std::max(*timeout, 0.0));  // (one of 0 or less: the predicate once)
    const auto deadline = after(timeout ? *timeout : -1);
    nb::object result = predicate();
    while (!truth(result)) {
      double left = -1;
      if (timeout) {
        left = std::chrono::duration<double>(deadline - Clock::now()).count();
        if (left <= 0) break;
      }
      wait(left);
      result = predicate();
    }
    return result;
  }

  // Wakes every thread waiting in wait() on this lock; the caller holds it.
  void notify_all() {
    std::lock_guard<std::mutex> g(mu_);
    check_held("notify on");
    ++notified_;
    notify_.notify_all();
  }

 private:
  static constexpr std::chrono::milliseconds kSlice{20};  // how often a blocked wait looks for signals

  static std::chrono::steady_clock::time_point after(double seconds) {
    using Clock = std::chrono::steady_clock;
    return Clock::now() +
           std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds < 0 ? 0 : seconds));
  }

  static bool truth(const nb::object& value) {
    const int t = PyObject_IsTrue(value.ptr());
    if (t < 0) throw nb::python_error();
    return t == 1;
  }

  // Called with mu_ held and the lock free.
  void take(unsigned long me, int64_t holds) {
    owner_ = me;
    holds_ = holds;
    held_by_this_thread += holds;
  }

  void check_held(const char* what) {
    if (holds_ == 0 || owner_ != PyThread_get_thread_ident())
      throw std::runtime_error(std::string("cannot ") + what + " a lock not held by this thread");
  }

  // Waits with the GIL released until the lock is free, then takes it (holds times); returns false at
  // timeout (seconds; -1 none). With interruptible, a pending signal's handler runs every 20 ms and its
  // exception is raised, nothing taken.
  bool wait_and_take(unsigned long me, int64_t holds, double timeout, bool interruptible) {
    using Clock = std::chrono::steady_clock;
    const auto deadline = after(timeout);
    for (;;) {
      bool got = false;
      bool late = false;
      PyThreadState* state = PyEval_SaveThread();
      {
        std::unique_lock<std::mutex> g(mu_);
        auto until = Clock::now() + kSlice;
        if (timeout >= 0 && deadline < until) until = deadline;
        got = free_.wait_until(g, until, [&] { return holds_ == 0; });
        if (got) {
          owner_ = me;
          holds_ = holds;
        } else {
          late = timeout >= 0 && Clock::now() >= deadline;
        }
      }  // (mu_ is let go before the GIL is taken back; a thread parked at exit gives the lock back first)
      restore_or_park(state, got ? &CountedLock::let_go : nullptr, this);
      if (got) {
        held_by_this_thread += holds;
        return true;
      }
      if (late) return false;
      if (interruptible && PyErr_CheckSignals() != 0) throw nb::python_error();
    }
  }

  static void let_go(void* lock) {
    auto* self = static_cast<CountedLock*>(lock);
    std::lock_guard<std::mutex> g(self->mu_);
    self->holds_ = 0;
    self->free_.notify_one();
  }


  const bool reentrant_;
  std::mutex mu_;
  std::condition_variable free_;    // the lock was let go
  std::condition_variable notify_;  // notify_all was called
  unsigned long owner_ = 0;
  int64_t holds_ = 0;
  uint64_t notified_ = 0;  // notify_all calls so far
};

// Every lock of a sequence held while inside `with group:`: taken in their order, given up in the
// reverse. One call each way (no window for a signal handler, as CountedLock's); an interrupted enter
// gives up what it took. Keeps no state between enter and exit, so threads may share one group.
class LockGroup {
 public:
  explicit LockGroup(nb::iterable locks) {
    for (nb::handle h : locks) {
      held_.push_back(nb::borrow(h));
      locks_.push_back(nb::cast<CountedLock*>(h));
    }
  }

  void enter() {
    size_t taken = 0;
    try {
      for (; taken < locks_.size(); ++taken) locks_[taken]->acquire(true, -1);
    } catch (...) {
      while (taken > 0) locks_[--taken]->release();
      throw;
    }
  }

  void exit() {
    for (size_t i = locks_.size(); i > 0; --i) locks_[i - 1]->release();
  }

 private:
  std::vector<nb::object> held_;  // (keeps the locks alive)
  std::vector<CountedLock*> locks_;
};

}  // namespace

void register_locks(nb::module_& m) {
  nb::class_<CountedLock>(m, "CountedLock",
                          "threading.Lock (reentrant=False) or RLock whose holds are counted per thread "
                          "(locks_held), with threading.Condition's wait, wait_for and notify_all")
      .def(nb::init<bool>(), "reentrant"_a = false)
      .def("acquire", &CountedLock::acquire, "blocking"_a = true, "timeout"_a = -1.0)
      .def("release", &CountedLock::release)
      .def("__enter__", [](CountedLock& l) { return l.acquire(true, -1); })
      .def("__exit__", [](CountedLock& l, nb::args) { l.release(); })
      .def("owned", &CountedLock::is_owned, "whether the calling thread holds it")
      .def("wait", [](CountedLock& l, std::optional<double> timeout) { return l.wait(timeout ? *timeout : -1); },
           "timeout"_a = nb::none())
      .def("wait_for", &CountedLock::wait_for, "predicate"_a, "timeout"_a = nb::none())
      .def("notify_all", &CountedLock::notify_all);
  nb::class_<LockGroup>(m, "LockGroup", "every CountedLock of a sequence, held inside `with`")
      .def(nb::init<nb::iterable>(), "locks"_a)
      .def("__enter__", &LockGroup::enter)
      .def("__exit__", [](LockGroup& g, nb::args) { g.exit(); });
  m.def("locks_held", [] { return held_by_this_thread; }, "the calling thread's holds of every CountedLock");
}

}  // namespace tieredemb
