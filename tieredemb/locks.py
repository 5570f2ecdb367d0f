"""The package's locks, counted per thread.

A batch whose rows are pinned releases them when it is freed unreleased (its DropGuard: see
tiers/table.py ResidentBatch). That may happen on any thread, at any allocation (the garbage
collector freeing a dropped autograd graph), also while the thread holds one of these locks; a
release then takes others (tier 0's, the store's room), in an order no other code uses, and could
deadlock. So a freed batch releases at once only on a thread that holds none of them (any_held()
False: the usual case, a graph dropped by the training loop), and else is handed to its store,
which releases it at its next residency or release.

The lock is native (native/counted_lock.cc): taking or giving up a hold and counting it is one call,
so a signal handler's exception (Ctrl-C, a save-on-SIGTERM handler) cannot fall between the two, and
`with lock:` always runs its exit once its enter returned. It is its own condition too (wait,
wait_for, notify_all), for threading.Condition's Python enter and wait had the same windows. A plain
lock taken again by its holder raises, where threading.Lock would wait for ever: a signal handler
calling a table inside its own update. Only the holder releases.
"""

from __future__ import annotations

from tieredemb import _C

Counted = _C.CountedLock  # Counted(reentrant=False): threading.Lock or RLock and a Condition over it
Group = _C.LockGroup  # Group(locks): `with` holds every one, taken in their order (a Python loop had windows)


def any_held() -> bool:
    """Whether the calling thread holds one of the package's locks."""
    return _C.locks_held() > 0
