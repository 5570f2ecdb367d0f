"""One table's rows across tiers: make a batch resident, move rows, write back, flush, stats.

    tier 0 (compute cache) ─► host cache (optional) ─► bottom
                                                       a Tier that holds every row (dense host
                                                       array, lazily reserved), or a
                                                       BackingStore (SSD)

Every tier above the bottom is a write-back cache of the one below: an evicted dirty row is
written down before its slot is reused, a clean one is dropped. A Tier with nothing below it
is the bottom: its rows never written read as the table's initializer and are not stored.
A batch is made resident in plan → move data → commit order, so an error while moving rows
(a failed read, a full disk) leaves every index as it was.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Union

import numpy as np
import torch

from . import _C
from .backing import BackingStore

Lower = Union["Tier", BackingStore, None]


def _host_pool(rows: int, width: int, *, populate: bool) -> torch.Tensor:
    """A float32 [rows, width] host pool. populate: faulted in now (bounded caches); else
    reserved lazily (a pool that may hold every row: O(1) to create). Pools that fit in half
    the machine's memory use huge pages (measured: forward and backward about 1.4x faster on
    random rows); larger ones stay on 4 KiB pages, so a sparsely used huge table costs memory
    only for the rows it holds."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return torch.from_numpy(_C.host_pool(rows, width, populate, rows * width * 4 <= total // 2))


def _arange(n: int) -> torch.Tensor:
    """0..n-1 as int64, made by numpy: torch's intra-op threads make even this cost
    milliseconds on a busy 2-core machine, in a path taken several times per batch."""
    return torch.from_numpy(np.arange(n, dtype=np.int64))


def _ids(t: torch.Tensor) -> torch.Tensor:
    return t.to(device="cpu", dtype=torch.int64).contiguous()


class RowInit:
    """The table's initializer: rows never written, as a function of (seed, id) only."""

    def __init__(self, dim: int, kind: int, a: float, b: float, seed: int, zero_id: int):
        self.args = (dim, kind, a, b, seed, zero_id)

    def __call__(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """ids int64 [n] -> out float32 [n, width] (weights from the spec, optimizer state 0)."""
        if len(ids):
            _C.init_rows(ids, out, *self.args)

    def fill_rows(self, ids: torch.Tensor, out: torch.Tensor, rows: torch.Tensor) -> None:
        """The rows of ids into out[rows] (no temporary: a store calls this for the rows of a
        read it did not find)."""
        if len(ids):
            _C.read_or_init(out, torch.full((len(ids),), -1, dtype=torch.int64), ids, out, rows, *self.args)


class Tier:
    """A tier: a native index (ids → slots, pins, dirty bits, policy) and a pool of rows.

    In a cache tier a dirty row is newer than the tier below; in the bottom tier (nothing below)
    it is a row ever written, which is what export lists.

    Rows move between host tiers in place (a lower tier reads straight into the upper tier's
    slots, and takes write-backs straight from them); so do the native SSD stores (read_to,
    write_from) under a host tier. A tier on a GPU, or above RocksDB, moves them through a
    staging block instead."""

    def __init__(self, name: str, index, pool: torch.Tensor, lower: Lower, init: RowInit):
        self.name = name
        self.index = index
        self.pool = pool  # float32 [capacity, width] on the tier's device
        self.lower = lower
        self.init = init
        self.width = pool.shape[1]
        self.row_bytes = self.width * pool.element_size()
        self.bytes_in = 0
        self.bytes_out = 0
        self.read_hits = 0  # reads served by the bottom without making rows resident
        self.read_misses = 0
        self._host = pool.device.type == "cpu"
        self._blocks: dict[str, torch.Tensor] = {}
        # Held around each index call that may run beside a residency in progress on another
        # thread (plan and commit here; unpin and mark_dirty by the training thread), so that
        # releasing a batch never waits for another batch's rows to be read. Re-entrant: a
        # batch freed by the garbage collector unpins from whichever thread runs it.
        self.index_lock = threading.RLock()
        # In place: both this pool and whatever is below (a host Tier, or the initializer).
        self._in_place = self._host and (lower is None or isinstance(lower, Tier))

    # -- data movement within this tier's pool ------------------------------------------------
    # On a GPU, rows cross on a side stream: it waits for the compute stream before touching
    # the pool (a slot's old row may still be read by queued kernels), and the compute stream
    # waits for it before the next kernel reads the pool.
    def gather(self, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows at slots, as a CPU float32 [n, width] tensor (into out when given)."""
        if out is None:
            out = (torch.empty(len(slots), self.width, dtype=torch.float32) if self._host
                   else self._staging(len(slots)))
        if self._host:
            _C.copy_rows(self.pool, slots, out, _arange(len(slots)))
            return out
        side = self._side_stream()
        side.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(side):
            out.copy_(self.pool.index_select(0, slots.to(self.pool.device)), non_blocking=True)
        side.synchronize()
        return out

    def scatter(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        if self._host:
            _C.copy_rows(rows.contiguous(), _arange(len(slots)), self.pool, slots)
            return
        dev = self.pool.device
        main, side = torch.cuda.current_stream(dev), self._side_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self.pool.index_copy_(0, slots.to(dev, non_blocking=True), rows.to(dev, non_blocking=True))
        main.wait_stream(side)

    def _side_stream(self):
        if getattr(self, "_side", None) is None:
            self._side = torch.cuda.Stream(self.pool.device)
        return self._side

    def _staging(self, n: int, role: str = "read") -> torch.Tensor:
        """A block for n rows in transit, valid until the next call with the same role ("read":
        rows coming up; "write": write-backs going down, which the tier below copies before
        write() returns). On the host each role's block is reused, grown to the largest batch
        seen (a fresh large block costs a page fault per 4 KiB on every batch, and steady
        training allocates nothing); pinned blocks for a GPU come from torch's caching
        allocator, which tracks the copies still reading them."""
        if not self._host:
            return torch.empty(n, self.width, dtype=torch.float32, pin_memory=torch.cuda.is_available())
        block = self._blocks.get(role)
        if block is None or block.shape[0] < n:
            block = self._blocks[role] = torch.empty(max(n, 1024), self.width, dtype=torch.float32)
        return block[:n]

    # -- batch operations ---------------------------------------------------------------------
    def resident(self, ids: torch.Tensor, *, pin: bool, fill=None) -> torch.Tensor:
        """Makes unique ids resident and returns their slots (int64 [n], CPU).

        fill(slots) given: it writes the rows' new values into those slots (a write: the rows
        become dirty); else missing rows are read from below. Dirty victims are written down
        before their slots are reused. Reads that can fail (a BackingStore, a GPU copy) happen
        before the index changes, through a staging block; a store with read_to (the native
        SSD stores) reads straight into the slots after the write-backs instead, and if that
        fails the plan's victims leave the tier (written down already, so no value is lost)."""
        with self.index_lock:
            plan = self.index.plan(ids)
        num_misses = plan.num_misses if fill is None else 0
        staging = None
        into_slots = num_misses and not self._in_place and self._host and hasattr(self.lower, "read_to")
        if num_misses and not self._in_place and not into_slots:
            staging = self._staging(num_misses)
            self.read_below(torch.from_numpy(plan.miss_ids), staging)
        if plan.num_dirty:
            dirty_ids, dirty_slots = torch.from_numpy(plan.dirty_ids), torch.from_numpy(plan.dirty_slots)
            if self._host and hasattr(self.lower, "write_from"):  # a host Tier or the log store
                self.lower.write_from(dirty_ids, self.pool, dirty_slots)  # straight from the pool
            else:
                self.lower.write(dirty_ids, self.gather(dirty_slots, self._staging(plan.num_dirty, "write")))
            self.bytes_out += plan.num_dirty * self.row_bytes
        if into_slots:
            try:
                self.lower.read_to(torch.from_numpy(plan.miss_ids), self.pool, torch.from_numpy(plan.miss_slots))
            except BaseException:
                with self.index_lock:
                    self.index.evict(plan)
                raise
        with self.index_lock:
            self.index.commit(ids, plan, pin, fill is not None)
        slots = torch.from_numpy(plan.slots)
        if fill is not None:
            fill(slots)
            self.bytes_in += len(ids) * self.row_bytes
        elif num_misses:
            miss_ids, miss_slots = torch.from_numpy(plan.miss_ids), torch.from_numpy(plan.miss_slots)
            if staging is not None:
                self.scatter(miss_slots, staging)
            elif self.lower is None:
                self.init.fill_rows(miss_ids, self.pool, miss_slots)
            elif self._in_place:  # a host tier below (into_slots: read above already)
                self.lower.read_to(miss_ids, self.pool, miss_slots)
            self.bytes_in += num_misses * self.row_bytes
        return slots

    def read_below(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        if self.lower is None:
            self.init(ids, out)
        else:
            self.lower.read(ids, out)

    # -- the interface a tier above sees (a BackingStore's, plus in-place variants) -----------
    def read(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """Current rows of unique ids into out [n, width]."""
        self.read_to(ids, out, _arange(len(ids)))

    def read_to(self, ids: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
        """Current rows of unique ids into dst[dst_rows] (a host pool). A cache keeps what it
        read (inclusive); the bottom does not store rows that were only read."""
        if self.lower is None:
            found = _C.read_or_init(self.pool, torch.from_numpy(self.index.lookup(ids)), ids, dst, dst_rows,
                                    *self.init.args)
            self.read_hits += found
            self.read_misses += len(ids) - found
            return
        slots = self.resident(ids, pin=False)
        _C.copy_rows(self.pool, slots, dst, dst_rows)

    def write(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        self.resident(ids, pin=False, fill=lambda slots: self.scatter(slots, rows))

    def write_from(self, ids: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor) -> None:
        """Takes rows src[src_rows] (a host pool) as the new values of unique ids."""
        self.resident(ids, pin=False, fill=lambda slots: _C.copy_rows(src, src_rows, self.pool, slots))

    def peek(self, ids: torch.Tensor, out: torch.Tensor) -> int:
        """Current rows of unique ids into out, wherever they live; changes nothing.
        Returns how many were in this tier."""
        slots = torch.from_numpy(self.index.lookup(ids))
        here = slots >= 0
        if bool(here.all()):
            out.copy_(self.gather(slots))
            return len(ids)
        if bool(here.any()):
            out[here] = self.gather(slots[here])
        below = ~here
        rows = torch.empty(int(below.sum()), self.width, dtype=torch.float32)
        if self.lower is None:
            self.init(ids[below], rows)
        elif isinstance(self.lower, Tier):
            self.lower.peek(ids[below], rows)
        else:
            self.lower.read(ids[below], rows)
        out[below] = rows
        return len(ids) - rows.shape[0]

    def update(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Writes whole rows where they live: in place in every tier that holds them (dirty),
        and at the bottom for the rest. Evicts nothing."""
        slots = torch.from_numpy(self.index.lookup(ids))
        here = slots >= 0
        if bool(here.any()):
            self.scatter(slots[here], rows[here])
            self.index.mark_dirty(slots[here])
        rest = ~here
        if not bool(rest.any()):
            return
        if self.lower is None:
            self.write(ids[rest], rows[rest])
        elif isinstance(self.lower, Tier):
            self.lower.update(ids[rest], rows[rest])
        else:
            self.lower.write(ids[rest], rows[rest])

    def flush(self) -> None:
        if self.lower is None:
            return
        ids, slots = (torch.from_numpy(a) for a in self.index.dirty_rows())
        chunk = max(1, min(self.index.capacity, 1 << 16))
        for start in range(0, len(ids), chunk):
            rows = self.gather(slots[start:start + chunk])
            self.lower.write(ids[start:start + chunk], rows)
            self.index.mark_clean(slots[start:start + chunk])
            self.bytes_out += rows.shape[0] * self.row_bytes
        self.lower.flush()

    def stats(self) -> dict:
        s = dict(self.index.stats())
        s["hits"] += self.read_hits
        s["misses"] += self.read_misses
        lookups = s["hits"] + s["misses"]
        s.update(capacity=self.index.capacity, resident=self.index.size,
                 hit_rate=s["hits"] / lookups if lookups else 0.0,
                 bytes_in=self.bytes_in, bytes_out=self.bytes_out,
                 bytes_moved=self.bytes_in + self.bytes_out)
        return s

    def reset_stats(self) -> None:
        self.index.reset_stats()
        self.bytes_in = self.bytes_out = self.read_hits = self.read_misses = 0


def _locked(method):
    """Runs a TableStore method under the store's lock."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    return run


class TableStore:
    """The tiers of one table, top to bottom.

    Thread-safety: every method that plans, moves rows or reads the tiers holds the store's lock
    (re-entrant), so residencies and other row moves never interleave. release() and mark_dirty()
    only take tier 0's index_lock: they act on pinned slots, which no residency in progress
    chose or moves, so a backward does not wait for the prefetch worker's reads. Forward and
    backward kernels read and write pinned slots of tier 0 without a lock: nothing else touches
    a pinned slot."""

    def __init__(self, *, num_embeddings: int, width: int, init: RowInit, cache_rows: int | None,
                 host_rows: int | None, backing: BackingStore | None, policy: str, device: torch.device):
        self.num_embeddings = num_embeddings
        self.width = width
        self.device = device
        self.backing = backing
        on_host = device.type == "cpu"
        whole_in_tier0 = cache_rows is None or cache_rows >= num_embeddings

        lower: Lower = backing
        store_tier = None
        if lower is None and (host_rows is not None or not (whole_in_tier0 and on_host)):
            # The bottom: a dense host array holding every row, reserved lazily.
            store_tier = lower = Tier("store", _C.DirectIndex(num_embeddings),
                                      _host_pool(num_embeddings, width, populate=False), None, init)
        self.tiers: list[Tier] = []
        # Bounded caches are faulted in at construction (they fill up anyway); pools that may
        # hold every row stay lazily reserved, so a huge table is created in O(1).
        if host_rows is not None and host_rows < num_embeddings:
            pin = not on_host and torch.cuda.is_available()
            pool = (torch.empty(host_rows, width, pin_memory=True) if pin
                    else _host_pool(host_rows, width, populate=True))
            lower = Tier("host", _C.CacheIndex(host_rows, policy), pool, lower, init)
            self.tiers.append(lower)
        if whole_in_tier0:
            index = _C.DirectIndex(num_embeddings)
            pool = (_host_pool(num_embeddings, width, populate=False) if on_host
                    else torch.empty(num_embeddings, width, device=device))
        else:
            index = _C.CacheIndex(cache_rows, policy)
            pool = (_host_pool(cache_rows, width, populate=True) if on_host
                    else torch.empty(cache_rows, width, device=device))
        self.tier0 = Tier("tier0", index, pool, lower, init)
        self.tiers.insert(0, self.tier0)
        if store_tier is not None:
            self.tiers.append(store_tier)
        self.bottom = self.tiers[-1] if backing is None else backing
        self.lock = threading.RLock()

    def dedup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids: int64 [N] (any order, duplicates allowed) -> (unique [U] in order of first
        occurrence, inverse [N]). IndexError for an id out of range. Changes nothing."""
        unique, inverse = _C.dedup(_ids(ids), self.num_embeddings)
        return torch.from_numpy(unique), torch.from_numpy(inverse)

    @_locked
    def make_resident(self, unique: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Makes unique ids resident in tier 0, pinned. Returns (slots [U], how many of them
        were not in tier 0). A failure changes no value; at most some rows leave tier 0
        (see Tier.resident)."""
        misses = self.tier0.index.stats()["misses"]
        slots = self.tier0.resident(unique, pin=True)
        return slots, self.tier0.index.stats()["misses"] - misses

    def prepare(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids: int64 [N]. Makes them resident in tier 0, pinned. Returns (unique [U],
        inverse [N], slots [U]). IndexError for an id out of range, before any tier changes."""
        unique, inverse = self.dedup(ids)
        return unique, inverse, self.make_resident(unique)[0]

    def release(self, slots: torch.Tensor) -> None:
        with self.tier0.index_lock:
            self.tier0.index.unpin(slots)

    def mark_dirty(self, slots: torch.Tensor) -> None:
        """Tier-0 slots (pinned) whose rows were updated in place (by backward)."""
        with self.tier0.index_lock:
            self.tier0.index.mark_dirty(slots)

    # The lookahead window of every cache tier (see native/cache_index.h): the batches expected
    # after the one made resident next.
    @_locked
    def window_push(self, unique: torch.Tensor) -> None:
        for t in self.tiers:
            t.index.window_push(unique)

    @_locked
    def window_pop(self) -> None:
        for t in self.tiers:
            t.index.window_pop()

    @_locked
    def window_clear(self) -> None:
        for t in self.tiers:
            t.index.window_clear()

    @_locked
    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """Current rows (weights ‖ state) of ids: float32 [N, width], CPU. Changes nothing."""
        unique, inverse = self.dedup(ids)
        rows = torch.empty(len(unique), self.width, dtype=torch.float32)
        if len(unique):
            self.tier0.peek(unique, rows)
        return rows[inverse]

    @_locked
    def write(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Sets whole rows of unique ids, where they live."""
        if len(ids):
            self.tier0.update(_ids(ids), rows.to(torch.float32).contiguous())

    @_locked
    def flush(self) -> None:
        """Returns when every update made before it is in the bottom (durable for SSD)."""
        self.tier0.flush()

    @_locked
    def written_ids(self, start: int, limit: int) -> torch.Tensor:
        """Sorted ids >= start of rows ever written (flush first), at most limit."""
        if isinstance(self.bottom, Tier):
            # At the bottom nothing is below to write to: a dirty bit there means "written".
            return torch.from_numpy(self.bottom.index.dirty_ids(start, limit))
        return self.bottom.written_ids(start, limit)

    @_locked
    def stats(self) -> dict:
        out = {t.name: t.stats() for t in self.tiers}
        if self.backing is not None:
            out["ssd"] = self.backing.stats()
        return out

    @_locked
    def reset_stats(self) -> None:
        for t in self.tiers:
            t.reset_stats()

    @_locked
    def close(self) -> None:
        self.flush()
        if self.backing is not None:
            self.backing.close()
