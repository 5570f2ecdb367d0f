"""DirectIndex: the index of a tier 0 that holds every row of its table (slot = id), in device
memory. It only tracks which rows it holds and which are dirty; it never evicts, so it needs no
pins and no policy. Its plan() and commit() keep SetIndex's contract (index.py), and a table
whose rows were never stored below has its whole residency drawn by one launch (draw()).
"""

from __future__ import annotations

import torch

from . import plan_kernels
from .index import DevicePlan, _compact, _to_host


class DirectIndex:
    """A tier 0 that holds every row (slot = id): it only tracks which rows it holds and which are
    dirty. It never evicts, so it needs no pins and no policy."""

    partitions = None  # it holds every row: nothing to split
    overflow_slots = 0
    overflow_in_use = 0

    def __init__(self, num_rows: int, device: torch.device):
        self.capacity = self.slots_total = num_rows
        self.device = device
        self.version = 0
        self.held = torch.zeros(num_rows + 1, dtype=torch.bool, device=device)  # (+1: a dummy slot)
        self.dirty = torch.zeros(num_rows + 1, dtype=torch.uint8, device=device)
        self.drawn = torch.zeros(2, dtype=torch.int64, device=device)  # rows draw() drew, ids it saw
        self.reset_stats()

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.where(self.held[ids], ids, -1)

    def plan(self, ids: torch.Tensor, num_unique: torch.Tensor, num_embeddings: int, rows=None,
             guess: int = 0, check=None, ids_to_host: bool = True) -> DevicePlan:
        """The misses of ids[:U] (rows not held yet), their ids on the host (the caller reads them
        from below; not with ids_to_host False), with one wait for the device. IndexError for an
        id out of range. Changes nothing. (rows, guess, check: SetIndex.plan's; this tier evicts
        nothing.)"""
        n, dev = ids.numel(), self.device
        valid = torch.arange(n, device=dev) < num_unique
        slots = torch.where(valid, ids, -1)
        bad = valid & ((ids < 0) | (ids >= num_embeddings))
        fresh = valid & ~bad & ~self.held[torch.where(valid & ~bad, ids, self.slots_total)]
        miss_slots = _compact(fresh, ids, n)
        none = torch.empty(0, dtype=torch.int64, device=dev)
        counts = torch.stack([fresh.sum(), valid.sum(), bad.sum()])
        host, *fault = _to_host(torch.cat([counts, miss_slots]) if ids_to_host else counts,
                                *([check.fault] if check is not None else []))
        if check is not None:
            check.raise_if(bool(fault[0].any()))
        n_miss, n_valid, n_bad = host[:3].tolist()
        if n_bad:
            raise IndexError(f"id {int(ids[bad][0])} out of range [0, {num_embeddings})")
        miss_ids, miss_slots = host[3:3 + n_miss] if ids_to_host else None, miss_slots[:n_miss]  # (slot = id)
        return DevicePlan(ids=ids, valid=valid, slots=slots, fresh=fresh, victim_slots=none, miss_ids=miss_ids,
                          miss_ids_device=miss_slots, miss_slots=miss_slots, dirty_ids=none.cpu(),
                          dirty_ids_device=none, dirty_slots=none, num_overflow=0, num_victims=0, num_unique=n_valid,
                          version=self.version, num_misses=n_miss)

    def forget(self, plan: DevicePlan, count: torch.Tensor | None = None) -> None:
        """A plan whose residency failed after its rows were moved in: nothing to empty (a slot
        only ever holds its own id's row; those not held stay so); the plan made stale."""
        self.version += 1

    def commit(self, plan: DevicePlan, pin: bool) -> None:
        self.version += 1
        at = torch.where(plan.fresh, plan.slots, self.slots_total)
        self.held[at] = True
        self.dirty[at] = 0
        self.counts["misses"] += plan.num_misses
        self.counts["hits"] += plan.num_unique - plan.num_misses

    def draw(self, ids: torch.Tensor, num_unique: torch.Tensor, rows: torch.Tensor, init) -> torch.Tensor:
        """A batch's residency when no row was ever stored below (a new table), in one kernel
        launch that waits for nothing: the rows of ids[:U] not held yet are drawn into `rows` (the
        pool) by RowInit init, bit for bit as the host draws them, and held from now on (their
        count is read when stats are asked for). Returns slots int64 [N] (the ids; -1 past U).
        The ids must be in range (the caller checked them)."""
        self.version += 1
        slots = torch.empty(ids.numel(), dtype=torch.int64, device=self.device)
        plan_kernels.draw(ids, num_unique, self, rows, init, slots)
        return slots

    def unpin(self, slots: torch.Tensor) -> None:
        pass

    def mark_clean(self, slots: torch.Tensor) -> None:
        self.dirty[slots] = 0

    def dirty_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        at = torch.nonzero(self.dirty[:self.slots_total] != 0).squeeze(1)
        return at, at

    def window_push(self, ids: torch.Tensor, num_unique: torch.Tensor) -> None:
        pass

    def window_pop(self) -> bool:
        return False

    def window_clear(self) -> None:
        pass

    def stats(self) -> dict:
        """The counters, with the draws' (counted on the device since the last reset)."""
        fresh, seen = (now - then for now, then in zip(self.drawn.tolist(), self.drawn_base))
        s = dict(self.counts)
        s["misses"] += fresh
        s["hits"] += seen - fresh
        return s

    def reset_stats(self) -> None:
        self.counts = dict.fromkeys(("hits", "misses", "writes", "evictions", "dirty_writebacks", "clean_drops",
                                     "overflow_rows"), 0)
        self.drawn_base = self.drawn.tolist()

    pinned = 0

    @property
    def size(self) -> int:
        return int(self.held[:self.slots_total].sum())
