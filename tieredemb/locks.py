"""The package's locks, counted per thread.

A batch whose rows are pinned releases them when it is collected (ResidentBatch.__del__). The
garbage collector may run that on any thread, at any allocation, also while the thread holds one
of these locks; a release then takes others (tier 0's, the store's room), in an order no other
code uses, and could deadlock. So a collected batch releases at once only on a thread that holds
none of them (any_held() False: the usual case, a graph dropped by the training loop), and else
is handed to its store, which releases it at its next residency or release.
"""

from __future__ import annotations

import threading

_held = threading.local()


def any_held() -> bool:
    """Whether the calling thread holds one of the package's locks."""
    return getattr(_held, "count", 0) > 0


def _add(n: int) -> None:
    _held.count = getattr(_held, "count", 0) + n


class Counted:
    """threading.Lock (reentrant=False) or RLock whose holds are counted per thread; usable under
    a threading.Condition."""

    def __init__(self, reentrant: bool = False):
        self._lock = threading.RLock() if reentrant else threading.Lock()
        self._reentrant = reentrant
        self._owner = None  # (a plain lock's holder: its own second acquire would never return)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._reentrant and blocking and self._owner == threading.get_ident():
            raise RuntimeError("a table was called from inside its own update on the same thread (from a signal "
                               "handler?): it would wait for itself. Call it between steps")
        got = self._lock.acquire(blocking, timeout)
        if got:
            self._owner = threading.get_ident()
            _add(1)
        return got

    def release(self) -> None:
        self._owner = None
        self._lock.release()
        _add(-1)

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # (a Condition's wait releases every hold of a reentrant lock, then takes them back)
    def _is_owned(self) -> bool:
        if self._reentrant:
            return self._lock._is_owned()
        if self._lock.acquire(False):
            self._lock.release()
            return False
        return True

    def _release_save(self):
        if self._reentrant:
            state = self._lock._release_save()
            _add(-state[0])
            return state
        self.release()
        return None

    def _acquire_restore(self, state) -> None:
        if self._reentrant:
            self._lock._acquire_restore(state)
            _add(state[0])
        else:
            self.acquire()
