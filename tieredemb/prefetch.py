"""Prefetch: batches registered ahead of their forward are made resident in tier 0 by a
background worker, and stay pinned until their backward.

Ordering, and why training gives bit for bit the results it gives without prefetch:
- One worker thread per table makes registered batches resident in registration order (FIFO),
  one at a time, under the table's store lock (as every other row move is), so residencies never
  interleave.
- Prefetch never fails for lack of tier-0 slots. When a batch's rows do not fit beside the rows
  pinned by batches in flight, the worker waits for a backward to release some (it pins less far
  ahead), unless the batch's forward is already waiting for it or nothing else is pinned: then
  the batch is made resident at once, the rows that do not fit in overflow slots (see
  tiers/cache.py). Values are the same either way.
- A backward's unpin and mark_dirty touch only its own pinned slots. Every call into a tier's
  index (plan, commit, evict, unpin, mark_dirty, mark_clean, the window's push and pop) holds
  that tier's index lock, so no two index calls interleave, whichever thread makes them.
- A batch's rows are pinned from its residency until its backward has applied its update (or
  its forward ran under no_grad, or its graph was freed). The worker evicts unpinned rows only:
  it never moves a row that a batch in flight reads or updates, and it writes a dirty row back
  only after the backward that dirtied it released it (under the index lock: the update
  happens-before the write-back).
- A row updated by batch t and read by batch t+1 is pinned by both, so it stays in its tier-0
  slot, and t+1's forward runs after t's backward on the training thread (program order).
- The forward of a registered batch must be the oldest registered batch (its ids and offsets
  are compared). Values never depend on when the worker ran: only which rows were evicted can.

Lookahead window: with lookahead L, batch j is made resident once batch j + L is registered
(or when its forward asks for it, or the stream ended: advance()), and every cache tier
plans its evictions with exactly the registered batches j+1 .. j+L as its window (the rule of
native/index/cache_index.h: rows no window batch uses go first, in the policy's order; then the
farthest next use first). The window does not depend on timing. The pins do, slightly: a
batch's rows are unpinned at its backward, which may come before or after a later batch's
residency; such rows are the most recently used, so they matter only to a tier too small for
the batches in flight.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections import deque

import numpy as np
import torch

from . import _C, locks

# Workers still running at interpreter exit are stopped first: a daemon thread ended by the
# interpreter's finalization inside a native call aborted the process (std::terminate).
_LIVE: "weakref.WeakSet[Prefetcher]" = weakref.WeakSet()


@atexit.register
def _stop_workers_at_exit() -> None:
    for p in list(_LIVE):
        if p.worker_pid != os.getpid():  # (a forked child's copies of its parent's are not its to stop)
            continue
        try:
            p.shutdown()
        except Exception:
            pass

_REGISTERED, _PLANNING, _RESIDENT, _FAILED = range(4)
_IDLE_EXIT_S = 1.0  # a worker with nothing to do for this long exits (a later batch restarts one)


class PrefetchOrderError(ValueError):
    """A forward whose batch is not the oldest registered one."""


class _Registered:
    """A batch registered by prefetch(): its ids, dedup, and (once resident) its ResidentBatch."""

    __slots__ = ("seq", "ids", "offsets", "source", "versions", "deduped", "batch", "state", "forced")

    def __init__(self, seq: int, ids: torch.Tensor, offsets: torch.Tensor, source: tuple, deduped):
        self.seq, self.ids, self.offsets = seq, ids, offsets
        self.source, self.versions = source, _versions(source)  # the caller's tensors, as they were
        self.deduped = deduped  # (the store's Deduped)
        self.batch = None
        self.state = _REGISTERED
        self.forced = False  # its forward is waiting: made resident whatever the window and the room

    def given(self, source: tuple) -> bool:
        """Whether source is the very tensors registered, unchanged since (no copy to compare)."""
        return bool(source) and len(source) == len(self.source) and \
            all(a is b for a, b in zip(source, self.source)) and _versions(source) == self.versions


class Prefetcher:
    """One table's registered batches and the worker that makes them resident.

    Threading: register / take / shutdown from the training thread; the worker thread only
    makes batches resident. `cond` guards the queue and counters; the store's locks guard the
    tiers. Lock order: cond, then the store's (never the other way); store.room (notified when
    rows are released) is taken last and holds nothing else."""

    def __init__(self, store):
        self.store = store
        self.cond = locks.Counted(reentrant=True)
        self.queue: deque[_Registered] = deque()  # registered, not yet taken by a forward
        self.next_seq = 0
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.closed = False  # its table was closed: no more batches
        self.room_wait = False  # the worker waits for a release (room for its batch)
        self.lookahead = 0
        self.phantoms = 0  # advance() calls: batches that count as registered for readiness
        self.windowed: deque[int] = deque()  # sequence numbers of the batches in the tiers' windows
        self.reset_stats()

    def set_lookahead(self, k: int) -> None:
        """Batch j is made resident once j + k is registered, with j+1 .. j+k as its window."""
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= _C.MAX_WINDOW_BATCHES:
            raise ValueError(f"lookahead must be an int from 0 to {_C.MAX_WINDOW_BATCHES}, got {k!r}")
        with self.cond:
            if self.queue:
                raise RuntimeError(f"lookahead cannot change while {len(self.queue)} batches are registered")
            self.lookahead = k

    def advance(self, n: int) -> None:
        """Counts n batches as registered, for readiness only: the stream ended, and the batch
        that would have been registered now (letting batch j + 1 - lookahead in) does not exist.
        The registered batches keep being made resident at the pace of training."""
        with self.cond:
            self.phantoms += n
            self.cond.notify_all()

    # -- training thread ----------------------------------------------------------------------
    def register(self, ids: torch.Tensor, offsets: torch.Tensor, check=None, source: tuple = (),
                 segments=None) -> int:
        """Queues a batch (flat ids [N], bag boundaries [B + 1]) for residency; returns its number
        (each registration's is one more). Host ids: IndexError
        for an id out of range, here, before anything changes. Device ids (check: the verdict on
        device inputs, gpu/checks.py) are checked by the worker, without a wait here: their error
        is raised by the next call on this thread (that batch's forward, or a later register),
        before anything changes. source: the caller's tensors
        (the forward's, given again, are recognized without comparing their values). segments:
        the ids' runs, as TableStore.dedup takes them."""
        if self.closed:
            raise RuntimeError("the table is closed (close() let its tiers go): it takes no more batches")
        # Copies (the caller may reuse its tensors); host ones made by numpy: a torch copy this
        # large runs on an OpenMP team of this thread's, whose threads spin between batches and
        # take CPU from the worker (measured: ~10 ms per batch on 2 cores). Device ids stay there
        # (ids and boundaries a device check wrote are copies already).
        if ids.device.type == "cpu" and check is None:
            ids = torch.from_numpy(np.array(ids.numpy(), dtype=np.int64))
        elif check is None:
            ids = ids.to(torch.int64).clone()
        if offsets.device.type == "cpu":
            offsets = torch.from_numpy(offsets.numpy().copy())
        elif check is None:
            offsets = offsets.clone()
        deduped = self.store.dedup(ids, segments, check=check, in_plan=True)
        with self.cond:
            self._raise_error()
            self.queue.append(_Registered(self.next_seq, ids, offsets, tuple(source), deduped))
            self.next_seq += 1
            self.counters["registered"] += 1
            self._ensure_worker()
            return self.next_seq - 1

    def waiting(self, seq: int) -> bool:
        """Whether registered batch number seq is still waiting for its forward."""
        with self.cond:
            return bool(self.queue) and self.queue[0].seq <= seq

    def registered(self, source: tuple):
        """The oldest registered batch's (ids, boundaries, check), as prefetch() took them, if
        source is the very tensors it was registered with, unchanged (else None): a forward given
        them again need not check them again."""
        with self.cond:
            if self.queue and self.queue[0].given(source):
                p = self.queue[0]
                return p.ids, p.offsets, p.deduped.check
        return None

    def idle(self) -> bool:
        """Whether no batch is registered (a forward then makes its own batch resident)."""
        with self.cond:
            return not self.queue

    def settled(self) -> bool:
        """Whether the worker has nothing it may do now: every batch it may make resident yet is
        resident (or failed), or it waits for a backward to release room. (Its device work may
        still be queued.)"""
        with self.cond:
            if self.room_wait or self.error is not None:
                return True
            return self._next_ready() is None and not any(q.state == _PLANNING for q in self.queue)

    def count_forward(self) -> None:
        """Counts a forward that made its batch resident itself, without take() (gpu/graphed.py)."""
        with self.cond:
            self._count(0, "demand_misses", time.perf_counter())

    def take(self, ids: torch.Tensor, offsets: torch.Tensor, segments=None, check=None, source: tuple = ()):
        """A forward's batch, resident and pinned (a ResidentBatch). The oldest registered batch
        (checked: source, the caller's tensors, as register takes them), waited for; else
        (nothing registered) made resident here (segments, check: as TableStore.dedup takes them).
        A background error surfaces here."""
        start = time.perf_counter()
        with self.cond:
            self._raise_error()
            if self.queue:
                p = self.queue[0]
                self._check_order(p, ids, offsets, check, tuple(source))
                found = p.state
                if found != _RESIDENT:  # the worker takes it now, whatever the window and the room
                    p.forced = True
                    self._ensure_worker()
                    self._wake_waiting_worker()
                while p.state != _RESIDENT and self.error is None:
                    self.cond.wait()
                self._raise_error()
                self.queue.popleft()
                self._count(p.batch.misses, "prefetched_rows" if found == _RESIDENT else "late_rows", start)
                batch, p.batch = p.batch, None
                return batch
        batch = self.store.prepare(ids, segments, check)
        with self.cond:
            self._count(batch.misses, "demand_misses", start)
        return batch

    def shutdown(self) -> None:
        """Stops the worker and forgets every registered batch not yet taken (unpins them).
        A pending background error is dropped. Safe to call at any time, and twice. An exception
        from a signal handler on the way (Ctrl-C as a PrefetchLoader's loop ends) left the batches
        registered and pinned, and the next loader refused to start: the steps, each safe to run
        again, are run again, and the exception raised once they are done."""
        interrupted = None
        for _ in range(3):
            try:
                self._stop_and_forget()
                break
            except BaseException as e:
                if interrupted is None:
                    interrupted = e
                else:  # (a real error on the retry is said, not lost; Python 3.10 has no add_note)
                    note = f"then, running shutdown's steps again: {e!r}"
                    interrupted.__notes__ = [*getattr(interrupted, "__notes__", []), note]
        if interrupted is not None:
            raise interrupted

    def _stop_and_forget(self) -> None:
        with self.cond:
            self.stopping = True
            thread = self.thread
            self.cond.notify_all()
        self._wake_waiting_worker()
        if thread is not None and thread.ident is not None:  # (not started: an interrupt in start())
            thread.join()
        with self.cond:
            self.stopping = False
            self.thread = None
            self.error = None
            self._forget_all()

    def stop_soon(self) -> None:
        """Tells the worker to stop, without waiting for it: its module was collected (a batch
        registered and never trained kept it waiting, and so the store alive and locked, for the
        life of the process). It is woken now, unless this thread holds one of the package's locks
        (collected inside one: it then sees this at its next timed wake-up). No join: this may
        run on the worker's own thread."""
        self.stopping = True
        if not locks.any_held():
            with self.cond:
                self.cond.notify_all()
            self._wake_waiting_worker()

    def close(self) -> None:
        """shutdown(), for good: a later register() raises."""
        self.shutdown()
        self.closed = True

    def stats(self) -> dict:
        """registered: batches registered; forwards: forwards run; prefetched_rows: tier-0
        misses of a forward's batch that the worker had made resident before the forward asked;
        late_rows: misses the forward waited on the worker for; demand_misses: misses of forwards
        of batches never registered (made resident by the forward itself); wait_seconds: time
        forwards spent waiting for their rows (late or demand); room_waits: times the worker found
        too little room beside the rows pinned by batches in flight and waited for a backward.
        (A GPU tier 0 holding the whole table draws its misses on the device and counts them
        there, so as not to wait for it, and so does a residency queued with no wait, zero-copy's
        or one over a log store read in stream order (gpu/queued.py): stats()["tier0"] has them,
        the three row counts here leave them out.)"""
        with self.cond:
            return dict(self.counters)

    def reset_stats(self) -> None:
        with self.cond:
            self.counters = dict(registered=0, forwards=0, prefetched_rows=0, late_rows=0, demand_misses=0,
                                 wait_seconds=0.0, room_waits=0)

    # -- worker thread ------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self.cond:
                idle_since = time.monotonic()
                while True:
                    if self.stopping:
                        return
                    p = self._next_ready() if self.error is None else None
                    if p is not None:
                        break
                    if time.monotonic() - idle_since > _IDLE_EXIT_S and not self._waiting():
                        self.thread = None
                        return
                    self.cond.wait(_IDLE_EXIT_S)
                p.state = _PLANNING
                # Its window: p.seq+1 .. upto; the tiers already hold it up to _windowed_upto().
                upto = min(p.seq + self.lookahead, self.next_seq - 1)
                window = [(q.deduped.unique, q.deduped.count) for q in self.queue
                          if max(p.seq, self._windowed_upto()) < q.seq <= upto]
            try:
                self._make_resident(p, window)
            except BaseException as e:  # surfaces on the training thread at its next call
                with self.cond:
                    p.state = _FAILED
                    self.error = e
                    self.cond.notify_all()
                continue
            with self.cond:
                if p.batch is None:  # stopped while waiting for room
                    return
                p.state = _RESIDENT
                self.cond.notify_all()

    def _make_resident(self, p: _Registered, window: list) -> None:
        """Slides the tiers' windows past p (drops p and older, appends window: the unique ids
        of the next batches), then makes p resident: at once if its rows fit beside the pinned
        ones, or its forward waits for it, or nothing else is pinned; else after backwards have
        released enough rows (overflow slots serve a batch that still does not fit)."""
        with self.store.lock:
            while self.windowed and self.windowed[0] <= p.seq:
                self.store.window_pop()
                self.windowed.popleft()
            for unique, count in window:
                self.store.window_push(unique, count)
                self.windowed.append(self._windowed_upto(p.seq) + 1)
        room = self.store.room
        retry = False
        while not self.stopping:
            with room:
                releases = self.store.releases
            if retry:  # (after a release: its unpin done before this plan reads the pins)
                self.store.after_releases()
            retry = True
            batch = self.store.make_resident(p.deduped, allow_overflow=p.forced or self.store.batches_held() == 0)
            if batch is not None:
                p.batch = batch
                return
            with self.cond:
                self.counters["room_waits"] += 1
                self.room_wait = True
            try:
                with room:  # no room: wait for a release (or for p's forward to ask for it). Planned
                    # again only then: each plan on a GPU waits for the device. (A batch collected
                    # under a lock is released at the next residency, without a notify: looked for
                    # every second.)
                    while not room.wait_for(lambda: self.store.releases != releases or p.forced or self.stopping
                                            or bool(self.store.orphans), timeout=_IDLE_EXIT_S):
                        pass
            finally:
                with self.cond:
                    self.room_wait = False

    # -- helpers (cond held) ------------------------------------------------------------------
    def _next_ready(self) -> _Registered | None:
        """The oldest batch not yet made resident, if it may be now."""
        for p in self.queue:
            if p.state == _REGISTERED:
                ready = p.forced or self.next_seq - 1 + self.phantoms >= p.seq + self.lookahead
                return p if ready else None
        return None

    def _windowed_upto(self, seq: int = -1) -> int:
        """The last batch in the tiers' windows (seq when they are empty)."""
        return self.windowed[-1] if self.windowed else seq

    def _waiting(self) -> bool:
        """Whether a registered batch still waits for residency."""
        return any(p.state == _REGISTERED for p in self.queue)

    def _wake_waiting_worker(self) -> None:
        """Wakes a worker waiting for room (p's forward now waits for it, or we stop)."""
        with self.store.room:
            self.store.room.notify_all()

    def _ensure_worker(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._work, name="tieredemb-prefetch", daemon=True)
            self.thread.start()
            self.worker_pid = os.getpid()
            _LIVE.add(self)
        self.cond.notify_all()

    def _check_order(self, p: _Registered, ids: torch.Tensor, offsets: torch.Tensor, check, source: tuple) -> None:
        """Whether the forward's batch is p: the very tensors registered, unchanged since (no
        copy to compare), or the same values (a device comparison waits for the device; a batch
        checked on the device is compared as its ids in bags and its boundaries without the added
        bag, and its verdict is read then too: ids past int32 compare equal to their low bits)."""
        if p.given(source):
            return
        want_ids, want_offsets = _in_bags(p.ids, p.offsets, p.deduped.check)
        got_ids, got_offsets = _in_bags(ids, offsets, check)
        if _equal(want_offsets, got_offsets) and _equal(want_ids, got_ids):
            if check is not None:
                check.resolve()
            return
        got_ids = got_ids.cpu()
        if _equal(want_ids, got_ids):  # (the same ids in other bags: said, or the two would read the same)
            got = (f"the same ids in bags starting at {_head(got_offsets.cpu())}, where {_head(want_offsets.cpu())} "
                   "was prefetched (were its offsets changed in place since prefetch()?)")
        else:
            got = f"{len(got_ids)} ids {_head(got_ids)}, {len(got_offsets) - 1} bags"
        raise PrefetchOrderError(
            f"forward of a batch that is not the oldest prefetched one: expected prefetched batch #{p.seq} "
            f"({len(want_ids)} ids {_head(want_ids)}, {len(want_offsets) - 1} bags), got {got}. Run forwards in the "
            f"order the batches were prefetched ({len(self.queue)} registered)")

    def _raise_error(self) -> None:
        """Raises the worker's error (the original exception, with its traceback) after
        forgetting every registered batch."""
        if self.error is None:
            return
        err, self.error = self.error, None
        self._forget_all()
        raise err

    def _forget_all(self) -> None:
        """Unpins the resident registered batches and empties the queue. No batch is being made
        resident: the worker stopped, or waits after an error."""
        for p in self.queue:
            if p.state == _RESIDENT:
                p.batch.release()
        self.queue.clear()
        self.store.window_clear()
        self.windowed.clear()
        self.phantoms = 0

    def _count(self, misses: int, key: str, start: float) -> None:
        self.counters["forwards"] += 1
        self.counters[key] += misses
        if key != "prefetched_rows":
            self.counters["wait_seconds"] += time.perf_counter() - start


def _versions(tensors: tuple) -> tuple:
    return tuple(None if t is None else version_of(t) for t in tensors)


def version_of(t: torch.Tensor):
    """t's version counter, or for an inference tensor (which keeps none) a new object, equal to
    nothing: such tensors are never recognized unchanged, their values are compared instead."""
    return object() if t.is_inference() else t._version


def _in_bags(ids: torch.Tensor, offsets: torch.Tensor, check) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's ids in bags and its boundaries, as host inputs give them: a device check's added
    empty bag, and the ids after the last bag, left out (reading where the bags end: a wait)."""
    if check is None or not check.extra_bag:
        return ids, offsets
    offsets = offsets[:-1]
    return ids[:int(offsets[-1])], offsets


def _equal(registered: torch.Tensor, given: torch.Tensor) -> bool:
    """Whether a registered copy holds the values given (host tensors compared by numpy, not
    torch.equal: see register; a device tensor's comparison waits for the device)."""
    if len(registered) != len(given):
        return False
    if registered.device.type == "cpu" and given.device.type == "cpu":
        return np.array_equal(registered.numpy(), given.numpy())
    return bool(torch.equal(registered, given.to(registered.device, registered.dtype)))


def _head(ids: torch.Tensor, k: int = 4) -> str:
    return "[" + ", ".join(str(int(i)) for i in ids[:k]) + (", ...]" if len(ids) > k else "]")
