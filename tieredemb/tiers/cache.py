"""CacheTier: a write-back cache of the layer below it (tier 0, and the optional host cache).

A native index (ids -> slots, pins, dirty bits, eviction policy; native/index) over a pool of
rows (pools.py). Rows are made resident a batch at a time, in plan -> move rows -> commit order:
  plan    chooses a slot for every id and the victims to evict; changes nothing;
  move    writes the dirty victims down, then reads the missing rows from below into their slots;
  commit  applies the plan (pins the batch's rows when asked).
A failure while writing victims down changes nothing in this tier; a failed read leaves the
plan's victims evicted (written down already: no value is lost) and the batch not resident.

Tier 0 is the only tier whose rows are pinned (by batches in flight). When a batch's rows do not
fit beside the pinned ones, its index gives the rest overflow slots (slots >= capacity, which
exist only while pinned: the next plan evicts them once released), so a batch of any size is
served with the same arithmetic as a table held whole in tier 0.

A CacheTier is itself a RowStore (rowstore.py) for the tier above it: the host cache serves
tier 0's misses and takes its write-backs, in chunks of at most its capacity.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .. import _C, locks
from .pools import arange
from .rowstore import RowStore


class Deduped(NamedTuple):
    """A batch's ids deduplicated by its tier 0: the distinct ids in unique[:count], inverse [N]
    (ids[i] == unique[inverse[i]]), count (an int, or an int64 [1] tensor on the device), and
    groups: None, or (order, row, start) on the device, which the backward would otherwise sort
    for (gpu/dedup.py). check: None, or the verdict on device inputs that the batch's residency
    reads (gpu/checks.py's DeviceCheck)."""

    unique: torch.Tensor
    inverse: torch.Tensor
    count: object
    groups: tuple | None = None
    check: object = None


class CacheTier:
    graphs = None  # (a host tier 0 captures no lookups: see gpu/graphed.py)

    def __init__(self, name: str, index, pool, lower: RowStore, num_embeddings: int):
        self.name = name
        self.num_embeddings = num_embeddings
        self.index = index  # _C.CacheIndex or _C.DirectIndex
        self.pool = pool  # HostPool or DevicePool
        self.lower = lower
        self.width = pool.width
        self.row_bytes = self.width * 4
        self.bytes_in = 0
        self.bytes_out = 0
        # Held around each index call that may run beside a residency in progress on another
        # thread (plan and commit here; unpin and mark_dirty by the training thread), so that
        # releasing a batch never waits for another batch's rows to be read. (A batch the garbage
        # collector frees while its thread holds this lock is released later: see locks.py.)
        self.index_lock = locks.Counted(reentrant=True)
        # Held by a backward's update of its pinned rows and by every copy of rows out of the pool
        # that may run beside it on another thread (write_back's, a read's, a write's): a row is
        # copied whole before or after an update, never half way (a flush or a state_dict() on
        # another thread got rows that mixed two steps).
        self.pool_lock = locks.Counted()

    @property
    def state(self) -> dict:
        return self.lower.state

    # -- tier 0: batches ---------------------------------------------------------------------------
    def dedup(self, ids: torch.Tensor, segments=None, *, in_plan: bool = False, check=None):
        """ids int [N] -> Deduped (unique [U] in order of first occurrence, inverse [N], U); segments
        (starts, row_ends): runs of disjoint id ranges, each deduplicated alone, in parallel.
        IndexError for an id out of range (here, whatever in_plan: see DeviceTier.dedup; check, a
        device tier's verdict on device inputs, never comes to a host tier 0). Changes nothing."""
        unique, inverse = _C.dedup(ids.to(device="cpu", dtype=torch.int64).contiguous(), self.num_embeddings,
                                   *(segments or (None, None)))
        return Deduped(torch.from_numpy(unique), torch.from_numpy(inverse), len(unique))

    def admit(self, unique: torch.Tensor, count: int, *, allow_overflow: bool = True, check=None):
        """A batch's distinct ids made resident and pinned: (slots, misses, None), or None (nothing
        changed) if it needs overflow slots and allow_overflow is False. (check: a device tier's;
        host ids were checked by dedup.)"""
        got = self.resident(unique, pin=True, allow_overflow=allow_overflow)
        return None if got is None else (*got, None)

    def unpin(self, slots: torch.Tensor, stream=None) -> None:
        with self.index_lock:
            self.index.unpin(slots)

    def after_releases(self) -> None:
        """(A release here is done when unpin returns.)"""

    def mark_dirty(self, slots: torch.Tensor) -> None:
        """Pinned slots whose rows were updated in place (by backward)."""
        with self.index_lock:
            self.index.mark_dirty(slots)

    def below_written(self, ids: torch.Tensor) -> None:
        """The rows of ids reached the layer below from elsewhere: nothing to do (misses are read from it)."""

    def host_ids(self, unique: torch.Tensor, count) -> torch.Tensor:
        """A deduplicated batch's distinct ids as a host tensor (they are already)."""
        return unique[:count]

    def window_push(self, unique: torch.Tensor, count) -> None:
        """Appends a batch ahead (its distinct ids: unique[:count]) to the lookahead window."""
        ids = unique[:count].to(dtype=torch.int64).contiguous()
        with self.index_lock:
            self.index.window_push(ids)

    def window_pop(self) -> None:
        with self.index_lock:
            self.index.window_pop()

    def window_clear(self) -> None:
        with self.index_lock:
            self.index.window_clear()

    # -- residency ----------------------------------------------------------------------------
    def resident(self, ids: torch.Tensor, *, pin: bool, fill=None, allow_overflow: bool = True):
        """Makes unique ids resident; returns their slots (int64 [n]) and how many were misses.

        fill(slots) given: it writes the rows' new values into those slots (a write: the rows
        become dirty, nothing is read from below). allow_overflow False: when the batch would
        need overflow slots, returns None and changes nothing (the caller waits for room)."""
        with self.index_lock:
            plan = self.index.plan(ids)
        if plan.num_overflow and not allow_overflow:
            return None
        if plan.num_dirty:
            self.pool.drain_to(self.lower, torch.from_numpy(plan.dirty_ids), torch.from_numpy(plan.dirty_slots))
            self.bytes_out += plan.num_dirty * self.row_bytes
        misses = plan.num_misses
        committed = False
        try:  # (a failure from the fill to the commit, an interrupt included: the victims leave, as written down)
            if fill is None and misses:
                self.pool.fill_from(self.lower, torch.from_numpy(plan.miss_ids), torch.from_numpy(plan.miss_slots))
            with self.index_lock:
                self.index.commit(ids, plan, pin, fill is not None)
                committed = True
        except BaseException:
            if not committed:
                with self.index_lock:
                    try:
                        self.index.evict(plan)
                    except RuntimeError:  # (stale: the commit ran, an interrupt came as it returned:
                        if pin:          # the batch, never handed out, unpinned)
                            self.index.unpin(torch.from_numpy(plan.slots))
            raise
        slots = torch.from_numpy(plan.slots)
        if fill is not None:
            fill(slots)
            self.bytes_in += len(ids) * self.row_bytes
        else:
            self.bytes_in += misses * self.row_bytes
        return slots, misses

    def write_back(self) -> None:
        """Writes every dirty row down (they stay resident, now clean). Each chunk is marked clean
        before it is copied: a backward (which marks its rows after updating them) that updates
        a pinned row meanwhile, on another thread, leaves it dirty, to be written again (marked
        after the copy, it would lose that update); the copy and the update exclude each other
        (pool_lock). A copy that fails marks its chunk dirty again."""
        with self.index_lock:
            ids, slots = (torch.from_numpy(a) for a in self.index.dirty_rows())
        for start in range(0, len(ids), self._chunk()):
            end = start + self._chunk()
            with self.index_lock:
                self.index.mark_clean(slots[start:end])
            try:
                with self.pool_lock:  # (the copy only: a backward does not wait for the write below)
                    block = self.pool.gather(slots[start:end])
                self.lower.write_from(ids[start:end], block, arange(len(block)))
            except BaseException:
                self.mark_dirty(slots[start:end])
                raise
            self.bytes_out += (min(end, len(ids)) - start) * self.row_bytes

    def _chunk(self) -> int:
        """Rows per call for moves that pin nothing: at most the capacity, so a plan always fits."""
        return max(1, min(self.index.capacity, 1 << 16))

    # -- what TableStore reads and writes in place (changes no residency) ---------------------
    def lookup(self, ids: torch.Tensor) -> np.ndarray:
        """Slot of each id, -1 where not resident."""
        with self.index_lock:
            return self.index.lookup(ids)

    def update_in_place(self, slots: torch.Tensor, update) -> None:
        """update() changes the pinned rows in slots in place (a backward's optimizer step): they
        are marked dirty first, under pool_lock with it (a copy out of the pool takes rows whole,
        and an interrupt between the two leaves a row dirty, never an update unmarked: a Ctrl-C
        there lost the update at the row's eviction)."""
        with self.pool_lock:
            self.mark_dirty(slots)
            update()

    def copy_out(self, slots: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
        """The resident rows in slots into dst[dst_rows] (each whole: see pool_lock)."""
        with self.pool_lock:
            self.pool.copy_out(slots, dst, dst_rows)

    def update(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """rows [n, width] (host) become the values of the resident rows in slots (now dirty)."""
        with self.pool_lock:
            self.pool.copy_in(slots, rows, arange(len(slots)))
        with self.index_lock:
            self.index.mark_dirty(slots)

    # -- RowStore, for the tier above ---------------------------------------------------------
    def read_to(self, ids: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
        """Current rows of ids into dst[dst_rows]; they stay here (inclusive cache)."""
        step = self._chunk()
        for start in range(0, len(ids), step):
            slots, _ = self.resident(ids[start:start + step], pin=False)
            self.pool.copy_out(slots, dst, dst_rows[start:start + step])

    def write_from(self, ids: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor) -> None:
        """src[src_rows] become the rows of ids, dirty here (written down when evicted or flushed)."""
        step = self._chunk()
        for start in range(0, len(ids), step):
            rows = src_rows[start:start + step]
            self.resident(ids[start:start + step], pin=False,
                          fill=lambda slots: self.pool.copy_in(slots, src, rows))

    def flush(self, state: dict | None = None) -> None:
        self.write_back()
        self.lower.flush(state)

    def checkpoint(self, path: str) -> None:
        self.write_back()
        self.lower.checkpoint(path)

    def written_ids(self, start: int = 0, limit: int | None = None) -> torch.Tensor:
        self.write_back()
        return self.lower.written_ids(start, limit)

    def stats(self) -> dict:
        """This tier's counters: hits / misses (rows looked up for reading), writes, evictions
        (dirty_writebacks + clean_drops), overflow_rows (rows given overflow slots), bytes moved."""
        with self.index_lock:
            s = dict(self.index.stats())
            s.update(capacity=self.index.capacity, resident=self.index.size, overflow=self.index.overflow)
            parts = self.index.partition_stats() if self.index.partitions else None
        lookups = s["hits"] + s["misses"]
        s.update(hit_rate=s["hits"] / lookups if lookups else 0.0, bytes_in=self.bytes_in,
                 bytes_out=self.bytes_out, bytes_moved=self.bytes_in + self.bytes_out)
        if parts is not None:  # a partitioned tier 0: each partition's counters too
            for p in parts:
                lookups = p["hits"] + p["misses"]
                p["hit_rate"] = p["hits"] / lookups if lookups else 0.0
            s["partitions"] = parts
        return s

    def reset_stats(self) -> None:
        with self.index_lock:
            self.index.reset_stats()
        self.bytes_in = self.bytes_out = 0

    def close(self) -> None:
        try:
            self.flush()
        finally:  # (the layer below let go even when the flush failed: its error is raised)
            self.lower.close()
