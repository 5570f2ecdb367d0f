"""TableStore: one table's layers, top to bottom, and the batches made resident in tier 0.

    ids ─► dedup ─► tier 0 (CacheTier: compute cache, HBM on cuda, host memory on cpu)
                      │ misses / dirty write-backs, through the RowStore interface
                      ▼
                    host cache (CacheTier, optional)
                      │
                      ▼
                    bottom: HostStore (every row, host memory) or an SSD store (ssd_backend)

Thread-safety: every method that plans, moves rows or reads the layers holds the store's lock
(re-entrant), so residencies and other row moves never interleave. release() and tier 0's
mark_dirty() only take one of tier 0's locks (a GPU tier's release: its pool lock, not the index
lock its plans hold across their wait for the device): they act on pinned slots, which no
residency in progress chose or moves, so a backward does not wait for the prefetch worker's
reads. Forward and backward kernels read and write pinned slots of tier 0 without a lock: nothing
else touches a pinned slot. A batch collected while its thread holds one of the package's locks
is released later (locks.py).
"""

from __future__ import annotations

import collections
import functools

import numpy as np
import torch

import ssd_backend

from .. import _C, locks
from .cache import CacheTier
from .host_store import HostStore
from .pools import HostPool, reserve_host_rows
from .rowstore import RowInit, RowStore

# The native core's thread pool runs as many threads as torch's intra-op pool.
_C.set_num_threads(torch.get_num_threads())


def _device_tier0(num_embeddings, width, cache_rows, policy, lower, init, device, lower_is_store, partitions,
                  zero_copy, graphs, words):
    """Tier 0 on a GPU: device-resident (tieredemb.gpu, which needs Triton)."""
    from ..gpu.tier import DeviceTier

    return DeviceTier(num_embeddings, width, cache_rows, policy, lower, init, device, lower_is_store=lower_is_store,
                      partitions=partitions, zero_copy=zero_copy, graphs=graphs, words=words)


def _ids(t: torch.Tensor) -> torch.Tensor:
    return t.to(device="cpu", dtype=torch.int64).contiguous()


def _locked(method):
    """Runs a TableStore method under the store's lock."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    return run


def _between_residencies(method):
    """_locked, and refused inside a residency on the same thread (the lock is re-entrant: a signal
    handler's flush() ran between a residency's row moves and its commit, and wrote the rows moved
    into the victims' slots under the victims' ids)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self.residing:
            raise RuntimeError(f"{method.__name__}() was called from inside a lookup of the same table on the "
                               "same thread (from a signal handler?): call it between steps")
        return method(self, *args, **kwargs)
    return _locked(run)


class ResidentBatch:
    """A batch's distinct ids resident in tier 0 and pinned there until release(): unique (its
    distinct ids in the first `count` entries), inverse [N] (ids[i] == unique[inverse[i]]), groups
    (the dedup's grouping of the occurrences by distinct id, or None: see Deduped), slots (the slot
    of each distinct id), all where tier 0 is (on a GPU, count is a device scalar).

    A batch dropped unreleased (an autograd graph freed without its backward) releases its pins
    through a DropGuard, not __del__: Python's cyclic collector can run __del__ on a batch whose
    backward is still to come (native/drop_guard.cc)."""

    __slots__ = ("store", "unique", "inverse", "count", "groups", "slots", "misses", "event", "released",
                 "_pins", "_guard")

    def __init__(self, store: "TableStore", deduped, slots, misses: int, event):
        self.store = store
        self.unique, self.inverse, self.count, self.groups = deduped[:4]
        self.slots, self.misses, self.event = slots, misses, event
        self.released = False
        self._pins = _Pins(store, slots)
        self._guard = _C.DropGuard(self._pins.dropped)

    @property
    def stream(self):
        """The stream its rows were awaited on, where its release runs (None: tier 0's own)."""
        return self._pins.stream

    def await_rows(self) -> None:
        """Orders the current stream after the batch's rows arrived in tier 0 (a no-op on the CPU);
        its release will run on this stream too."""
        if self.event is not None:
            stream = self._pins.stream = torch.cuda.current_stream(self.slots.device)
            stream.wait_event(self.event)
            for t in (self.unique, self.inverse, self.count, self.slots, *(self.groups or ())):
                t.record_stream(stream)  # (made on tier 0's stream)

    def release(self) -> None:
        """Unpins the batch's rows (once; later calls do nothing)."""
        if not self.released:
            self.released = True
            self._guard.disarm()
            self.store.release(self.slots, self.stream)


class _Pins:
    """What a dropped batch's release needs, without the batch: its store, slots and stream."""

    __slots__ = ("store", "slots", "stream")

    def __init__(self, store: "TableStore", slots):
        self.store, self.slots, self.stream = store, slots, None

    def dropped(self) -> None:
        """Run by the batch's DropGuard as the batch is freed unreleased."""
        try:
            self.store.release_dropped(self.slots, self.stream)
        except Exception:
            pass


class TableStore:
    """The layers of one table. cache_rows: tier 0's capacity (None: the whole table);
    host_rows: the host cache's (None: no host cache); bottom: an SSD store, or None for a
    HostStore; device: where tier 0 lives; words: the words of a row that hold values, the rest
    its pad (RowLayout; None: all)."""

    def __init__(self, *, num_embeddings: int, width: int, init: RowInit, cache_rows: int | None,
                 host_rows: int | None, bottom: RowStore | None, policy: str, device: torch.device,
                 partitions: tuple | None = None, zero_copy: bool = False, cuda_graphs: bool = False,
                 words: int | None = None):
        self.num_embeddings = num_embeddings
        self.width = width
        self.device = device
        self.init = init
        self.host_store = HostStore(num_embeddings, width, init) if bottom is None else None
        self.bottom: RowStore = bottom if bottom is not None else self.host_store
        lower = self.bottom
        self.tiers: list = []  # the cache tiers, top first: tier 0 (CacheTier or DeviceTier), the host cache
        on_host = device.type == "cpu"
        if host_rows is not None and host_rows < num_embeddings:
            # (not pinned under a GPU tier 0 either: rows cross to the GPU through its own pinned
            # staging blocks, and torch's pinned allocator would round the pool up to a power of 2)
            pool = reserve_host_rows(host_rows, width, populate_rows=host_rows)
            lower = CacheTier("host", _C.CacheIndex(host_rows, policy), HostPool(pool), lower, num_embeddings)
            self.tiers.append(lower)
        self.tier0 = (self._host_tier0(num_embeddings, width, cache_rows, policy, lower, partitions) if on_host else
                      _device_tier0(num_embeddings, width, cache_rows, policy, lower, init, device,
                                    lower_is_store=lower is self.bottom, partitions=partitions, zero_copy=zero_copy,
                                    graphs=cuda_graphs, words=words))
        self.tiers.insert(0, self.tier0)
        self.lock = locks.Counted(reentrant=True)
        self.residing = 0  # residencies in progress (under the lock: on its holder's thread)
        # Notified whenever pinned rows are released (releases counts them): a residency
        # waiting for room retries. held: the batches made resident and not yet released.
        self.room = locks.Counted()
        self.releases = 0
        self.held = 0
        # (slots, stream) of batches collected while their thread held one of the package's locks:
        # released by the next residency or release (locks.py). Appended without a lock.
        self.orphans: collections.deque = collections.deque()

    def _host_tier0(self, num_embeddings: int, width: int, cache_rows: int | None, policy: str, lower,
                    partitions: tuple | None) -> CacheTier:
        if partitions is not None:
            # Each partition its own capacity, lending overflow slots up to its own rows.
            ends = np.cumsum([r for r, _ in partitions]).tolist()
            index = _C.PartitionedIndex(ends, [c for _, c in partitions], policy, [r - c for r, c in partitions])
            pool = HostPool(reserve_host_rows(num_embeddings, width, populate_rows=index.capacity))
        elif cache_rows is None or cache_rows >= num_embeddings:
            index = _C.DirectIndex(num_embeddings)
            # the table itself when nothing sits between (no second copy)
            pool = (HostPool(self.host_store.rows) if lower is self.host_store
                    else HostPool(reserve_host_rows(num_embeddings, width, populate_rows=0)))
        else:
            # Overflow slots beyond the capacity serve what pinned rows leave no room for.
            index = _C.CacheIndex(cache_rows, policy, overflow_limit=num_embeddings - cache_rows)
            pool = HostPool(reserve_host_rows(num_embeddings, width, populate_rows=cache_rows))
        return CacheTier("tier0", index, pool, lower, num_embeddings)

    @classmethod
    def from_config(cls, config) -> "TableStore":
        """The layers a TableConfig describes (opening or creating its SSD table, if any)."""
        init = RowInit(config.embedding_dim, config.init.code, config.init.a, config.init.b, config.seed,
                       -1 if config.padding_idx is None else config.padding_idx, config.layout.code)
        bottom = None
        if config.ssd_path is not None:
            bottom = ssd_backend.open_store(config.ssd_path, config.width, init, config.meta(), config.ssd)
        try:
            return cls(num_embeddings=config.num_embeddings, width=config.width, init=init,
                       cache_rows=config.cache_rows, host_rows=config.host_rows, bottom=bottom,
                       policy=config.policy, device=config.device, partitions=config.partitions,
                       zero_copy=config.zero_copy, cuda_graphs=config.cuda_graphs and config.device.type == "cuda",
                       words=config.layout.words)
        except BaseException:
            if bottom is not None:
                bottom.close()
            raise

    @property
    def state(self) -> dict:
        """The record last stored by flush(state) (reopening an SSD table restores it)."""
        return self.bottom.state

    # -- batches ------------------------------------------------------------------------------
    def dedup(self, ids: torch.Tensor, segments=None, *, check=None, in_plan: bool = False):
        """ids: int [N] (any order, duplicates allowed) -> Deduped (tiers/cache.py): the distinct
        ids in unique[:count], ids[i] == unique[inverse[i]], where tier 0 is (see its dedup).
        segments: None, or (starts [S + 1], row_ends [S]) when the ids are runs of disjoint id
        ranges (a collection's tables: native/kernels/dedup.h); the same result. IndexError for an
        id out of range (with in_plan, device ids' may be raised by make_resident instead; check:
        device inputs checked on the device, gpu/checks.py). Changes nothing."""
        return self.tier0.dedup(ids, segments, in_plan=in_plan, check=check)

    @_locked
    def make_resident(self, deduped, *, allow_overflow: bool = True) -> ResidentBatch | None:
        """Makes a deduplicated batch (dedup's Deduped) resident in tier 0, pinned. allow_overflow
        False: returns None, changing nothing, if rows pinned by other batches leave too little
        room. A failure changes no value; at most some rows leave tier 0."""
        self.release_orphans()
        self.residing += 1
        try:
            got = self.tier0.admit(deduped.unique, deduped.count, allow_overflow=allow_overflow, check=deduped.check)
        finally:
            self.residing -= 1
        if got is None:
            return None
        slots, misses, event = got
        self.count_held()
        return ResidentBatch(self, deduped, slots, misses, event)

    def prepare(self, ids: torch.Tensor, segments=None, check=None) -> ResidentBatch:
        """ids: int [N] (segments, check: see dedup). Dedups them and makes them resident in tier
        0, pinned. IndexError for an id out of range, before any tier changes (a device tier 0's
        plan checks device ids in the transfer it makes anyway)."""
        return self.make_resident(self.dedup(ids, segments, check=check, in_plan=True))

    def release(self, slots: torch.Tensor, stream) -> None:
        """A batch's pins released (its slots, on the stream it computed on: see unpin)."""
        try:
            self.unpin(slots, stream)
        finally:
            self.release_orphans()

    def release_dropped(self, slots: torch.Tensor, stream) -> None:
        """The pins of a batch freed unreleased (its autograd graph dropped without a backward), on
        whatever thread freed it: released now, or at the store's next residency or release if this
        thread holds one of the package's locks (see locks.py)."""
        if locks.any_held():
            self.orphans.append((slots, stream))
        else:
            self.release(slots, stream)

    def unpin(self, slots: torch.Tensor, stream) -> None:
        """A batch's slots unpinned in tier 0 (on stream, if given: tier0.unpin), then counted released."""
        try:
            self.tier0.unpin(slots, stream)
        finally:
            self.count_release()

    def count_held(self) -> None:
        """A batch made resident and pinned (by make_resident, or by a replayed graph: gpu/graphed.py)."""
        with self.room:
            self.held += 1

    def count_release(self) -> None:
        """A batch's rows released (unpinned on the device, or queued to be): residencies waiting
        for room try again."""
        with self.room:
            self.releases += 1
            self.held -= 1
            self.room.notify_all()

    def release_orphans(self) -> None:
        """Releases the batches collected while their thread held one of the package's locks."""
        while self.orphans:
            try:
                slots, stream = self.orphans.popleft()
            except IndexError:  # (another thread took the last)
                return
            self.unpin(slots, stream)

    def after_releases(self) -> None:
        """Orders tier 0's next residency after every release so far (on a GPU a release is a
        kernel queued on the stream that computed with its batch): for a residency tried again
        once a release made room."""
        self.tier0.after_releases()

    def batches_held(self) -> int:
        """Batches made resident and not yet released (only they pin rows): counted on the host,
        so asking waits for no device."""
        self.release_orphans()
        with self.room:
            return self.held

    # The lookahead window of every cache tier (see native/index/cache_index.h): the batches
    # expected after the one made resident next.
    @_locked
    def window_push(self, unique, count) -> None:
        """Appends a batch ahead (as dedup gave it) to every cache tier's lookahead window; the
        tiers below tier 0 get its ids on the host."""
        self.tier0.window_push(unique, count)
        if len(self.tiers) > 1:
            ids = self.tier0.host_ids(unique, count)
            for t in self.tiers[1:]:
                t.window_push(ids, len(ids))

    @_locked
    def window_pop(self) -> None:
        for t in self.tiers:
            t.window_pop()

    @_locked
    def window_clear(self) -> None:
        for t in self.tiers:
            t.window_clear()

    # -- rows wherever they live --------------------------------------------------------------
    def _where(self, ids: torch.Tensor):
        """Where unique ids live: ([(cache tier, slots, positions in ids)], positions in no cache
        tier), each id with the highest tier holding it."""
        found, todo = [], np.arange(len(ids))
        for t in self.tiers:
            if not len(todo):
                break
            slots = t.lookup(ids[todo])
            here = slots >= 0
            if here.any():
                found.append((t, torch.from_numpy(slots[here]), torch.from_numpy(todo[here])))
            todo = todo[~here]
        return found, torch.from_numpy(todo)

    @_between_residencies
    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """Current rows (weights ‖ state) of ids: float32 [N, width], CPU. Changes nothing:
        each row comes from the highest layer holding it."""
        unique, inverse = (torch.from_numpy(a) for a in _C.dedup(_ids(ids), self.num_embeddings))
        rows = torch.empty(len(unique), self.width, dtype=torch.float32)
        found, rest = self._where(unique)
        for t, slots, at in found:
            t.copy_out(slots, rows, at)
        if len(rest):
            self.bottom.read_to(unique[rest], rows, rest)
        return rows[inverse]

    @_between_residencies
    def write(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Sets whole rows of unique ids where they live: in place in every cache tier holding
        them (dirty there), in the bottom for the rest. Evicts nothing."""
        ids = _ids(ids)
        rows = rows.to(torch.float32).contiguous()
        found, rest = self._where(ids)
        for t, slots, at in found:
            t.update(slots, rows[at])
        if len(rest):
            self.bottom.write_from(ids[rest], rows, rest)
            self.tier0.below_written(ids[rest])

    # -- durability ---------------------------------------------------------------------------
    @_between_residencies
    def flush(self, state: dict | None = None) -> None:
        """Returns when every update made before it is in the bottom (durable for SSD), with
        state (a small JSON-able record) stored beside them."""
        self.release_orphans()
        self.tier0.flush(state)

    @_between_residencies
    def checkpoint(self, path: str, state: dict | None = None) -> None:
        """flush(state), then a consistent snapshot of the bottom at path (it opens as a table)."""
        self.flush(state)
        self.bottom.checkpoint(path)

    @_between_residencies
    def written_ids(self, start: int, limit: int | None) -> torch.Tensor:
        """Sorted ids >= start of rows ever written, at most limit (dirty cached rows included)."""
        return self.tier0.written_ids(start, limit)

    @_locked
    def stats(self) -> dict:
        out = {t.name: t.stats() for t in self.tiers}
        out["store" if self.host_store is not None else "ssd"] = self.bottom.stats()
        return out

    @_locked
    def reset_stats(self) -> None:
        for t in self.tiers:
            t.reset_stats()
        if self.host_store is not None:
            self.host_store.reset_stats()

    @_locked
    def close(self) -> None:
        self.tier0.close()
