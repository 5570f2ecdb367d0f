"""Tier 0's index in device memory, its operations over whole batches (no loop over ids, no Python
per id, and one device-to-host transfer per plan, or none: plan_queued): a plan's two hot steps
(each id's slot; each set's misses given its victims) are Triton kernels (plan_kernels.py), the
rest torch ops.

SetIndex, a bounded cache: ids -> slots through sets of `ways` slots (FBGEMM's cache layout: a
row's set is a hash of its id; a batch's misses in one set take that set's victims), per-slot pins,
dirty bits and policy state (LRU: the last batch that used the row; LFU: its uses, ties by LRU),
and overflow slots after the sets, for rows that find no room in their set beside pinned rows:
they exist only while pinned, and the next plan evicts them once released (a batch that uses such
a row again reads it back after its write-back). DirectIndex (direct_index.py): a tier that holds
every row (slot = id); it only tracks which rows it holds.

The contract is native/index/cache_index.h's: plan() chooses slots and victims and changes
nothing; the caller moves rows (dirty victims down, misses up); commit() applies the plan (a
plan never committed, after a failed move, leaves the index as it was). Victims are never pinned
rows, nor rows of the batch. The lookahead window (window_push / window_pop) ranks victims as the native one does:
rows no window batch uses first, in the policy's order, then the farthest next use first.

Batches are given as id buffers of length N whose first U entries are the batch's distinct ids;
U may be a device scalar (a batch deduplicated on the device).
"""

from __future__ import annotations

import dataclasses

import torch

from . import launch_turn, plan_kernels
from .plan_kernels import HASH as _HASH, NEVER as _NEVER, USES_CAP as _USES_CAP, WINDOW_KEY as _WINDOW_KEY


@dataclasses.dataclass
class DevicePlan:
    """What plan() chose, on the device (slots [N]: each id's slot, -1 past U) and on the host (the
    ids and slots that must move: miss_ids / miss_slots, dirty victims; counts). miss_ids and
    dirty_ids are None when the plan was asked not to bring ids to the host (their counts are
    num_misses and num_dirty either way)."""

    ids: torch.Tensor
    valid: torch.Tensor          # bool [N]: u < U
    slots: torch.Tensor          # int64 [N] device
    fresh: torch.Tensor          # bool [N]: the id gets a new slot (a miss)
    victim_slots: torch.Tensor   # int64 device: slots whose row leaves (regular and overflow)
    miss_ids: torch.Tensor | None  # int64 host
    miss_ids_device: torch.Tensor  # the same, on the device
    miss_slots: torch.Tensor     # int64 device
    dirty_ids: torch.Tensor | None  # int64 host
    dirty_ids_device: torch.Tensor  # the same, on the device
    dirty_slots: torch.Tensor    # int64 device
    num_overflow: int
    num_victims: int
    num_unique: int
    version: int
    num_misses: int = 0
    num_dirty: int = 0
    lingering: int = 0           # overflow rows left unpinned, evicted by this plan
    dirty_rows: torch.Tensor | None = None  # the dirty victims' rows on the host, if the transfer held them
    placed: plan_kernels.Placed | None = None  # the lists the plan was read from (what commit applies)
    # int64 device, beside miss_slots: the id of the dirty victim each miss's slot holds (written
    # down before the miss comes in), -1 for none; None: no miss has one (DirectIndex)
    miss_victims: torch.Tensor | None = None


class SetIndex:
    """A bounded tier-0 index on `device`. capacity is rounded up to whole sets of `ways` slots;
    overflow: overflow slots to start with (more are added when a plan needs them). A plan's
    find and assign steps run as Triton kernels (plan_kernels.py), or with kernels = "torch" as
    their torch-ops twin (the tests compare the two).

    partitions ((rows, capacity), ...) in id order (PartitionedIndex's, native/index): each part
    has sets of its own (its capacity rounded up to whole sets), so one part's misses never evict
    another's rows; capacity is then the sum. Each part's counters are kept too. Every set has the
    ways of the largest part (up to `ways`): a small part gets one whole set, more slots than its
    capacity, rather than every other part sets of its few ways (a 1-row part made a collection's
    every table direct-mapped)."""

    kernels = "triton"

    def __init__(self, capacity: int, policy: str, device: torch.device, *, ways: int = 32, overflow: int = 1024,
                 partitions: tuple | None = None):
        if policy not in ("lru", "lfu"):
            raise ValueError(f"policy {policy!r} is not one a GPU tier 0 has: 'lru' or 'lfu' "
                             "(clock is for CPU tiers)")
        caps = [c for _, c in partitions] if partitions else [capacity]
        self.ways = min(ways, max(caps))
        part_sets = [-(-c // self.ways) for c in caps]
        self.sets = sum(part_sets)
        self.capacity = self.sets * self.ways
        self.partitions = partitions
        if partitions:
            self.part_ends = torch.tensor([sum(r for r, _ in partitions[:k + 1]) for k in range(len(partitions))],
                                          dtype=torch.int64, device=device)
            self.part_sets = torch.tensor(part_sets, dtype=torch.int64, device=device)
            self.part_base = torch.cumsum(self.part_sets, 0) - self.part_sets
            self.part_capacity = [n * self.ways for n in part_sets]
        self.policy = policy
        self.device = device
        # The plans made (int64 [1] on the device, counted there: a replayed graph's plans
        # count too): the last one's step is the tag it gave its batch's slots (tags) and the LRU
        # stamp it gives them
        self.step = torch.zeros(1, dtype=torch.int64, device=device)
        self.version = 0
        self.overflow_in_use = 0  # rows in overflow slots (lingering ones too), as far as the host knows;
        self.overflow_known = True  # False after a queued plan, until stats() counts them on the device
        self.overflow_slots = 0
        self.window: list[tuple[torch.Tensor, torch.Tensor]] = []  # (ids [N], valid [N]) of batches ahead
        self._alloc(overflow)
        self.reset_stats()

    # -- state -------------------------------------------------------------------------------
    def _alloc(self, overflow: int) -> None:
        """Sizes the per-slot state for capacity + overflow slots, keeping what is there. Each
        state tensor has one more entry, a dummy slot: writes meant for no slot go there."""
        total, dev = self.capacity + overflow + 1, self.device
        old = getattr(self, "slot_id", None)
        grown = {"slot_id": torch.full((total,), -1, dtype=torch.int64, device=dev),
                 "pins": torch.zeros(total, dtype=torch.int32, device=dev),
                 "dirty": torch.zeros(total, dtype=torch.uint8, device=dev),
                 "stamp": torch.zeros(total, dtype=torch.int64, device=dev),
                 "uses": torch.zeros(total, dtype=torch.int64, device=dev),
                 # the last plan that found the row in the slot (plan_kernels: the batch's rows)
                 "tags": torch.zeros(total, dtype=torch.int64, device=dev)}
        if old is not None:
            for name, t in grown.items():
                t[:old.numel() - 1] = getattr(self, name)[:-1]
        for name, t in grown.items():
            setattr(self, name, t)
        self.overflow_slots = overflow
        self._directory()

    @property
    def slots_total(self) -> int:
        """Slots a pool must hold: the sets, then the overflow slots."""
        return self.capacity + self.overflow_slots

    def _directory(self) -> None:
        """The overflow rows in use, sorted by id, to find them by binary search: ovf_ids and
        ovf_slot, rewritten in place (a captured graph's plans read and write the same tensors;
        grow() makes new ones)."""
        ids = self.slot_id[self.capacity:self.slots_total]
        ids = torch.where(ids >= 0, ids, torch.iinfo(torch.int64).max)
        if getattr(self, "ovf_ids", None) is None or self.ovf_ids.numel() != ids.numel():
            self.ovf_ids, self._ovf_order, self.ovf_slot = torch.empty_like(ids), torch.empty_like(ids), \
                torch.empty_like(ids)
        torch.sort(ids, out=(self.ovf_ids, self._ovf_order))
        torch.add(self._ovf_order, self.capacity, out=self.ovf_slot)

    def _set_of(self, ids: torch.Tensor) -> torch.Tensor:
        if self.partitions is None:
            return torch.remainder((ids * _HASH) >> 29, self.sets)
        part = self._part_of(ids)
        return self.part_base[part] + torch.remainder((ids * _HASH) >> 29, self.part_sets[part])

    def _part_of(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(self.part_ends, ids, right=True).clamp_(max=len(self.partitions) - 1)

    # -- lookups ------------------------------------------------------------------------------
    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot of each id (int64 [n], device), -1 where not resident. Changes nothing. One kernel
        (plan_kernels.lookup), or with kernels = "torch" its torch-ops twin."""
        if self.kernels == "triton":
            slots = torch.empty(ids.numel(), dtype=torch.int64, device=self.device)
            plan_kernels.lookup(ids, self, slots)
            return slots
        base = self._set_of(ids) * self.ways
        way_slots = base[:, None] + torch.arange(self.ways, device=self.device)
        match = self.slot_id[way_slots] == ids[:, None]
        slots = torch.where(match.any(1), base + match.to(torch.int8).argmax(1), -1)
        if self.overflow_in_use or not self.overflow_known:
            pos = torch.searchsorted(self.ovf_ids, ids).clamp_(max=self.ovf_ids.numel() - 1)
            slots = torch.where((slots < 0) & (self.ovf_ids[pos] == ids), self.ovf_slot[pos], slots)
        return slots

    # -- residency ----------------------------------------------------------------------------
    def plan(self, ids: torch.Tensor, num_unique: torch.Tensor, num_embeddings: int, rows: torch.Tensor | None = None,
             guess: int = 0, check=None, ids_to_host: bool = True) -> DevicePlan | int:
        """Slots for the distinct ids[:U] (U = num_unique, int64 [1] on the device) and the victims
        that make room; overflow slots for the misses that find none. Changes nothing. Returns the
        plan, or the number of overflow slots to add (grow(), then plan again) when there are too
        few. IndexError for an id out of [0, num_embeddings). Ends with its one device-to-host
        transfer. rows (the tier's pool) and guess: that transfer also carries the rows of the
        first `guess` dirty victims; plan.dirty_rows holds them when they are all of them (so
        writing them down waits for nothing more), else None. check: a DeviceCheck whose verdict
        the transfer carries too (its error raised first). ids_to_host False: the transfer is the
        counts only (the caller moves rows by their device lists: zero-copy)."""
        plan, need, free = self._plan(ids, num_unique, num_embeddings, rows, guess, check, ids_to_host)
        return plan if need <= free else max(self.overflow_slots, need - free)

    def grow(self, slots: int) -> None:
        """Adds overflow slots (the caller makes sure no queued kernel uses the state tensors)."""
        self._alloc(self.overflow_slots + slots)

    def plan_queued(self, ids: torch.Tensor, num_unique: torch.Tensor, num_embeddings: int) -> DevicePlan:
        """plan() without its transfer and without a wait: for ids the host checked (host ids in
        range), into an index with no partitions whose overflow slots are at least the ids of
        every batch pinned and of this one (then no plan needs more than are free: a batch's
        misses that find no room in their sets are at most its distinct ids, and the overflow
        rows other batches pin at most theirs). The counts stay on the device: the plan's
        totals (placed.xfer[:KINDS]; the lists after them are as long as they may be), added up
        by commit_queued for stats(). The plan's ints are 0; its lists are whole, their ends
        those totals (the move kernels read them: gpu/moves.py's count)."""
        n = ids.numel()
        self.step += 1
        found, sets = self._find(ids, num_unique, None)
        in_set, order = torch.sort(sets, stable=True)
        chosen = torch.full((n,), -1, dtype=torch.int64, device=self.device)
        plan_kernels.assign(in_set, order, self, self._window_sorted(), chosen)
        placed = plan_kernels.place(ids, num_unique, num_embeddings, self, found, chosen, None, 0)
        plan_kernels.bind(placed, None)
        k = plan_kernels.KINDS
        return DevicePlan(ids=ids, valid=placed.valid, slots=placed.slots, fresh=placed.fresh,
                          victim_slots=placed.victims, miss_ids=None, miss_ids_device=placed.xfer[k:k + n],
                          miss_slots=placed.miss_slots, dirty_ids=None, dirty_ids_device=placed.xfer[k + n:],
                          dirty_slots=placed.dirty_slots, num_overflow=0, num_victims=0, num_unique=0,
                          version=self.version, placed=placed, miss_victims=placed.miss_victims)

    def commit_queued(self, plan: DevicePlan, pin: bool) -> None:
        """Applies a plan_queued() plan (the rows moved already), without a wait: its totals are
        added to the device's counters, which stats() reads."""
        self._check(plan)
        plan_kernels.commit(plan.ids, plan.placed, self, True, pin)  # (any overflow row may leave)
        self.queued_replayed()  # (its host part: a replay of it does that alone)
        self._directory()
        self.queued_counts += plan.placed.xfer[:plan_kernels.KINDS]

    def queued_replayed(self) -> None:
        """What commit_queued does on the host (alone after a replay of it: gpu/graphed.py)."""
        self.version += 1
        self.overflow_known = False

    def _plan(self, ids, num_unique, num_embeddings, rows=None, guess=0, check=None, ids_to_host=True):
        n, dev = ids.numel(), self.device
        guess = min(guess, n + self.overflow_slots) if rows is not None else 0
        self.step += 1  # (find tags the batch's slots with it: assign and place pass them over)
        if self.kernels == "triton":
            found, sets = self._find(ids, num_unique, None)
            in_set, order = torch.sort(sets, stable=True)
            chosen = torch.full((n,), -1, dtype=torch.int64, device=dev)
            plan_kernels.assign(in_set, order, self, self._window_sorted(), chosen)
            placed = plan_kernels.place(ids, num_unique, num_embeddings, self, found, chosen, rows, guess)
        else:
            placed = self._place_twin(ids, num_unique, rows, guess, num_embeddings)
        k = plan_kernels.KINDS
        host, *guessed = _to_host(placed.xfer if ids_to_host else placed.xfer[:k], *([placed.guessed] if guess else []),
                                  *([check.fault] if check is not None else []))
        if check is not None:
            check.raise_if(bool(guessed.pop().any()))
        c = host[:k].tolist()
        if c[plan_kernels.BAD]:
            valid = torch.arange(n, device=dev) < num_unique
            raise IndexError(f"id {int(ids[valid & ((ids < 0) | (ids >= num_embeddings))][0])} out of range "
                             f"[0, {num_embeddings})")
        n_need, n_free, n_valid, n_miss, n_victims, n_dirty, _, n_lingering = c
        if self.kernels == "triton" and n_need <= n_free:
            plan_kernels.bind(placed, n_need)
        plan = DevicePlan(ids=ids, valid=placed.valid, slots=placed.slots, fresh=placed.fresh,
                          victim_slots=placed.victims[:n_victims],
                          miss_ids=host[k:k + n_miss] if ids_to_host else None,
                          miss_ids_device=placed.xfer[k:k + n_miss], miss_slots=placed.miss_slots[:n_miss],
                          dirty_ids=host[k + n:k + n + n_dirty] if ids_to_host else None,
                          dirty_ids_device=placed.xfer[k + n:k + n + n_dirty], dirty_slots=placed.dirty_slots[:n_dirty],
                          num_overflow=n_need, num_victims=n_victims, num_unique=n_valid, version=self.version,
                          num_misses=n_miss, num_dirty=n_dirty, lingering=n_lingering,
                          dirty_rows=guessed[0][:n_dirty] if guess and n_dirty <= guess else None, placed=placed,
                          miss_victims=placed.miss_victims[:n_miss])
        return plan, n_need, n_free

    def _place_twin(self, ids, num_unique, rows, guess, num_embeddings) -> plan_kernels.Placed:
        """plan_kernels.place's lists, after the twins of find and assign, by torch ops."""
        n, dev, cap = ids.numel(), self.device, self.capacity
        total = self.slots_total
        valid = torch.arange(n, device=dev) < num_unique
        slots, sets = self._find(ids, num_unique, valid)
        fresh = valid & (slots < 0)
        used = _mask(torch.where(slots >= 0, slots, total), total + 1)
        # The misses of each set, in batch order, take the set's candidates, best first.
        in_set, order = torch.sort(sets, stable=True)
        chosen = self._assign(in_set, order, used[:cap])
        # The rest take overflow slots: free ones, and those of lingering (unpinned) rows, lowest first.
        # (Not the batch's own: on a GPU a release on the compute stream may unpin a row between
        # _find's read of the pins and this one; a row _find found stays the batch's.)
        need = fresh & (chosen < 0)
        ovf_ids = self.slot_id[cap:total]
        lingering = (ovf_ids >= 0) & (self.pins[cap:total] == 0) & ~used[cap:total]
        free = (ovf_ids < 0) | lingering
        if self.overflow_slots:
            free_slots = torch.sort((~free).to(torch.int8), stable=True).indices + cap
            k = (torch.cumsum(need, 0) - 1).clamp(0, self.overflow_slots - 1)
            chosen = torch.where(need, free_slots[k], chosen)
        slots = torch.where(fresh, chosen, slots)
        # Victims: the rows in the regular slots the misses take, in batch order, then every
        # lingering overflow row, in slot order.
        evict = fresh & (chosen >= 0) & (chosen < cap)
        evict &= self.slot_id[torch.where(evict, chosen, total)] >= 0
        at = torch.cat([torch.where(evict, chosen, total), torch.arange(cap, total, device=dev)])
        victim = torch.cat([evict, lingering])
        dirty_victim = victim & (self.dirty[at] != 0)
        bad = valid & ((ids < 0) | (ids >= num_embeddings))
        counts = torch.stack([need.sum(), free.sum(), valid.sum(), fresh.sum(), victim.sum(), dirty_victim.sum(),
                              bad.sum(), lingering.sum()])
        most = n + self.overflow_slots
        dirty_slots = _compact(dirty_victim, at, most)
        xfer = torch.cat([counts, _compact(fresh, ids, n), _compact(dirty_victim, self.slot_id[at], most)])
        miss_victims = _compact(fresh, torch.where(dirty_victim[:n], self.slot_id[at[:n]], -1), n)
        return plan_kernels.Placed(xfer, slots, valid, fresh, _compact(fresh, slots, n), miss_victims,
                                   _compact(victim, at, most), dirty_slots, (), None,
                                   rows.index_select(0, dirty_slots[:guess]) if guess else None)

    def _find(self, ids, num_unique, valid):
        """(slots, sets): each id's slot (-1: a miss, or past U) and each miss's set (else
        self.sets). An overflow row the batch uses again but nobody pins any more leaves and comes
        back (written down first if dirty): overflow rows stay rows in flight."""
        if self.kernels == "triton":  # (sets int32; the slots found get the plan's tag)
            slots, sets = torch.empty_like(ids), torch.empty(ids.numel(), dtype=torch.int32, device=self.device)
            plan_kernels.find(ids, num_unique, self, slots, sets)
            return slots, sets
        slots = torch.where(valid, self.lookup(ids.clamp(min=0)), -1)
        pinned = self.pins[slots.clamp(min=0)] > 0
        slots = torch.where((slots >= self.capacity) & ~pinned, -1, slots)
        return slots, torch.where(valid & (slots < 0), self._set_of(ids.clamp(min=0)), self.sets)

    def _assign(self, in_set, order, used):
        """plan_kernels.assign's twin: the slot each miss takes in its set (-1: none left): the
        misses sorted by set (in_set, order: in batch order within a set), the r-th of a set taking
        its r-th best candidate (_victim_key's order; ties: the lower way); used: the batch's slots."""
        n, dev = in_set.numel(), self.device
        chosen = torch.full((n,), -1, dtype=torch.int64, device=dev)
        first = torch.ones(n, dtype=torch.bool, device=dev)
        first[1:] = in_set[1:] != in_set[:-1]
        pos = torch.arange(n, device=dev)
        rank = pos - torch.cummax(torch.where(first, pos, 0), 0).values
        home = in_set.clamp(max=self.sets - 1)
        key = self._victim_key(used)
        cand_key, cand_way = torch.sort(key.view(self.sets, self.ways)[home], dim=1, stable=True)
        rank_c = rank.clamp(max=self.ways - 1)[:, None]
        placed = (in_set < self.sets) & (rank < self.ways) & (cand_key.gather(1, rank_c)[:, 0] < _NEVER)
        chosen[order] = torch.where(placed, home * self.ways + cand_way.gather(1, rank_c)[:, 0], -1)
        return chosen

    def commit(self, plan: DevicePlan, pin: bool) -> None:
        """Applies a plan made by the last plan() (the rows moved already). pin: pin the batch's rows."""
        self._check(plan)
        self.version += 1
        if self.partitions is not None:
            self._count_parts(plan)
        if self.kernels == "triton":
            plan_kernels.commit(plan.ids, plan.placed, self, plan.lingering > 0, pin)
        else:
            self._evict_rows(plan)
            fresh_at = torch.where(plan.fresh, plan.slots, self.slots_total)  # (the dummy slot elsewhere)
            self.slot_id[fresh_at] = plan.ids
            self.dirty[fresh_at] = 0
            self.uses[fresh_at] = 0
            at = torch.where(plan.valid, plan.slots, self.slots_total)
            if pin:
                with launch_turn():  # (as the kernels' pins: a release may add to them at once)
                    self.pins.index_add_(0, at, torch.ones_like(at, dtype=torch.int32))
            self.stamp[at] = self.step
            self.uses.index_add_(0, at, torch.ones_like(at))
        self.overflow_in_use += plan.num_overflow - plan.lingering
        if plan.num_overflow or plan.lingering or not self.overflow_known:  # (else the overflow rows are as they were)
            self._directory()
        s = self.counts
        s["hits"] += plan.num_unique - plan.num_misses
        s["misses"] += plan.num_misses
        s["evictions"] += plan.num_victims
        s["dirty_writebacks"] += plan.num_dirty
        s["clean_drops"] += plan.num_victims - plan.num_dirty
        s["overflow_rows"] += plan.num_overflow

    def _count_parts(self, plan: DevicePlan) -> None:
        """Each part's hits, misses, overflow rows, evictions and dirty write-backs, added up on
        the device (read when stats are asked for)."""
        part = self._part_of(plan.ids.clamp(min=0))
        fresh = plan.fresh
        per_id = torch.stack([plan.valid & ~fresh, fresh, fresh & (plan.slots >= self.capacity)], 1)
        self.part_counts[:, :3].index_add_(0, part, per_id.to(torch.int64))
        gone = self.slot_id[plan.victim_slots]
        per_victim = torch.stack([torch.ones_like(gone), (self.dirty[plan.victim_slots] != 0).to(torch.int64)], 1)
        self.part_counts[:, 3:].index_add_(0, self._part_of(gone.clamp(min=0)), per_victim)

    def part_stats(self) -> list[dict]:
        """Each part's counters, capacity and rows held (partitioned indexes only)."""
        counts = self.part_counts.tolist()
        held = self.slot_id[:self.slots_total]
        resident = torch.bincount(self._part_of(held[held >= 0]), minlength=len(self.partitions)).tolist()
        return [{"hits": c[0], "misses": c[1], "writes": 0, "evictions": c[3], "dirty_writebacks": c[4],
                 "clean_drops": c[3] - c[4], "overflow_rows": c[2], "capacity": cap, "resident": r}
                for c, cap, r in zip(counts, self.part_capacity, resident)]

    def forget(self, plan: DevicePlan, count: torch.Tensor | None = None) -> None:
        """A plan whose residency failed after rows were moved into its misses' slots: those slots
        emptied (whatever they held was written down or was clean), the plan made stale. count: a
        queued plan's misses (on the device: read here, a wait), the length of its list in use."""
        self.version += 1
        at = plan.miss_slots if count is None else plan.miss_slots[:int(count)]
        self.slot_id[at] = -1
        self.dirty[at] = 0
        self._directory()

    def _evict_rows(self, plan: DevicePlan) -> None:
        self.slot_id[plan.victim_slots] = -1
        self.dirty[plan.victim_slots] = 0

    def _check(self, plan: DevicePlan) -> None:
        if plan.version != self.version:
            raise RuntimeError("stale batch plan: the tier changed between plan and commit")

    def unpin(self, slots: torch.Tensor) -> None:
        """Unpins the rows in slots (int64 [n], device; entries < 0 are ignored), on the current stream."""
        if self.kernels == "triton":
            plan_kernels.release(slots, self.pins)
            return
        at = torch.where(slots >= 0, slots, self.slots_total)
        with launch_turn():  # (a commit may add to the pins at once: see commit)
            self.pins.index_add_(0, at, torch.full_like(at, -1, dtype=torch.int32))

    def mark_clean(self, slots: torch.Tensor) -> None:
        self.dirty[slots] = 0

    def dirty_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, slots) of every dirty row, on the device."""
        total = self.slots_total
        at = torch.nonzero((self.dirty[:total] != 0) & (self.slot_id[:total] >= 0)).squeeze(1)
        return self.slot_id[at], at

    # -- the lookahead window -----------------------------------------------------------------
    def window_push(self, ids: torch.Tensor, num_unique: torch.Tensor) -> None:
        self.window.append((ids, torch.arange(ids.numel(), device=self.device) < num_unique))

    def window_pop(self) -> bool:
        return bool(self.window) and self.window.pop(0) is not None

    def window_clear(self) -> None:
        self.window.clear()

    def _window_sorted(self):
        """The window's ids (-1 past each batch's U) sorted, each with the first window batch that
        uses it (its position in the window), or None for a window without ids."""
        if not self.window or not sum(i.numel() for i, _ in self.window):
            return None
        wid = torch.cat([torch.where(v, i, -1) for i, v in self.window])
        batch = torch.cat([torch.full_like(i, j) for j, (i, _) in enumerate(self.window)])
        order = torch.sort(wid, stable=True).indices  # by id, batches in order
        return wid[order], batch[order]

    def _victim_key(self, used: torch.Tensor) -> torch.Tensor:
        """Per regular slot, the order victims are taken in (smallest first): empty slots, then rows
        no window batch uses in the policy's order, then window rows, farthest next use first;
        _NEVER for pinned rows and rows of the batch."""
        cap = self.capacity
        sid = self.slot_id[:cap]
        key = self.stamp[:cap] if self.policy == "lru" else self.uses[:cap].clamp(max=_USES_CAP) * (1 << 32) + \
            self.stamp[:cap]
        window = self._window_sorted()
        if window is not None:
            wid, batch = window
            pos = torch.searchsorted(wid, sid).clamp(max=wid.numel() - 1)
            in_window = (wid[pos] == sid) & (sid >= 0)
            key = torch.where(in_window, _WINDOW_KEY - batch[pos], key)
        key = torch.where(sid < 0, -1, key)
        return torch.where((self.pins[:cap] > 0) | used, _NEVER, key)

    # -- counters -----------------------------------------------------------------------------
    def stats(self) -> dict:
        """The counters, with the queued plans' (added up on the device: read here, with a wait)."""
        if not self.overflow_known:  # (what queued plans left in the overflow slots, counted)
            self.overflow_in_use = int((self.slot_id[self.capacity:self.slots_total] >= 0).sum())
            self.overflow_known = True
        t = self.queued_counts.tolist()
        self.queued_counts.zero_()
        kinds = plan_kernels
        s = self.counts
        s["hits"] += t[kinds.VALID] - t[kinds.FRESH]
        s["misses"] += t[kinds.FRESH]
        s["evictions"] += t[kinds.VICTIM]
        s["dirty_writebacks"] += t[kinds.DIRTY]
        s["clean_drops"] += t[kinds.VICTIM] - t[kinds.DIRTY]
        s["overflow_rows"] += t[kinds.NEED]
        return dict(s)

    def reset_stats(self) -> None:
        self.counts = dict.fromkeys(("hits", "misses", "writes", "evictions", "dirty_writebacks", "clean_drops",
                                     "overflow_rows"), 0)
        if getattr(self, "queued_counts", None) is None:  # (zeroed in place after: a captured graph adds to it)
            self.queued_counts = torch.zeros(plan_kernels.KINDS, dtype=torch.int64, device=self.device)
        self.queued_counts.zero_()
        if self.partitions is not None:
            self.part_counts = torch.zeros(len(self.partitions), 5, dtype=torch.int64, device=self.device)

    @property
    def pinned(self) -> int:
        return int((self.pins[:self.slots_total] > 0).sum())

    @property
    def size(self) -> int:
        return int((self.slot_id[:self.slots_total] >= 0).sum())


def _mask(at: torch.Tensor, size: int) -> torch.Tensor:
    """A bool [size] tensor, True at the positions at (the last position is a dummy target)."""
    m = torch.zeros(size, dtype=torch.bool, device=at.device)
    m[at] = True
    return m


def _compact(mask: torch.Tensor, values: torch.Tensor, size: int) -> torch.Tensor:
    """values[mask] packed in order into the first entries of an int64 [size] buffer, without a
    device-to-host sync (the count is mask.sum())."""
    k = torch.cumsum(mask, 0) - 1
    out = torch.zeros(size + 1, dtype=torch.int64, device=mask.device)
    out[torch.where(mask, k, size)] = values
    return out[:size]


def _to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors on the host; from a GPU through pinned memory, with one wait (a plan's)."""
    if tensors[0].device.type == "cpu":
        return list(tensors)
    hosts = []
    for t in tensors:
        hosts.append(torch.empty(t.shape, dtype=t.dtype, pin_memory=True))
        hosts[-1].copy_(t, non_blocking=True)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return hosts
