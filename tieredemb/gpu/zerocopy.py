"""A zero-copy tier 0 (DeviceTier(zero_copy=True)): the table's host rows right below it (a
HostStore's) are pinned and mapped into the device, and the tier's kernels read the misses from
them and write the dirty victims into them (gpu/moves.py): no staging block, no host copy.

Which host rows were ever written is kept on the device too (a uint8 per id), and the rows moved
are counted there; the store is told of both later, in one pass (settle). A residency of host ids
then needs nothing from the host but the plan's counts, so it is queued with no wait at all
(ZeroCopy.residency), and a lookup's whole device work can be captured as a CUDA graph
(gpu/graphed.py calls room_for_graph, queued_work, take_captured, write_back, graphed_admitted and
graphed_released).

The dirty victims' rows are written down apart (WRITE_BACK_APART): the swap puts them in a
staging block in device memory as it reads the misses in, and their write over the bus is queued
on a stream of its own (write_back), beside the batch's lookup and backward, where the swap
made the lookup wait for both directions. The next residency waits for it before its moves (a
row written down may be its miss; the staging block may be reused), and so does anything that
reads the host rows (DeviceTier._after_residencies). The price: a staging block as large as the
residency's lists, in device memory, until its write-back is done (a captured residency's, in
its graph's memory, for as long as the graph is kept).
"""

from __future__ import annotations

import contextlib

import torch

from ..tiers.rowstore import DEFERRED_MARK
from . import hostmap, moves, plan_kernels, to_device
from .queued import QueuedResidency

# Whether the victims' rows are written down apart (see above), or by the swap itself, both ways
# of the bus at once before the lookup goes on. Not yet timed end to end on a GPU (twenty-fifth
# session): the moves alone, on an H100, read 20K rows of 129 words in 237-314 us and swapped them
# both ways in 415-566. A module constant, so that bench_gpu.py --write-back-inline can time the other.
WRITE_BACK_APART = True
# The write-back's programs: few, as it runs beside the batch's lookup and backward. Its stores to
# the host rows slow the kernels beside it on every multiprocessor it holds (a step profiled on an
# H200 at 2 programs a multiprocessor: the backward's 4 MB gradient copy took 286 us against 2.6
# alone, its prep kernel 267 us against 9), and too few programs leave the bus idle. Zero-copy's
# step (bench_gpu.py --write-back-programs, tier 0 = 10 %, medians of 5 runs, one process each, on
# an H200): 2 a multiprocessor (264) 90.3 M lookups/s, 1 (132) 91.0, 16 in all 95.7, 4 in all 74.4.
WRITE_BACK_PROGRAMS = 16


class ZeroCopy(QueuedResidency):
    """A DeviceTier's zero-copy part. rows: the host rows below (mapped on a GPU); written: uint8
    [rows] on the device (moves.WROTE: written by the device, the store not yet told); the rows
    moved since the store was last told: counted on the host (moved: read, written) by residencies
    that waited for their plan, on the device (moved_queued) by queued ones."""

    def __init__(self, tier, store, lower_is_store: bool):
        if not (lower_is_store and hasattr(store, "locate")):
            below = getattr(store, "name", store)
            raise ValueError(f"zero_copy needs the table's rows in host memory right below tier 0, not {below!r} "
                             "(no ssd_path, no host cache)")
        super().__init__(tier)
        self.store = store
        device = tier.device
        # (on a GPU, pinned and mapped: Triton kernels take the host tensor as it is; on CPU
        # tensors, the tests', the host rows themselves)
        self._unmap = hostmap.pin_and_map(store, store.rows, device) if device.type == "cuda" else None
        self.rows = store.rows
        self.written = torch.zeros(tier.num_embeddings, dtype=torch.uint8, device=device)
        stored = store.written_ids(0, None)
        if len(stored):
            self.written[to_device(stored, device)] = 1
        self.found = torch.zeros(1, dtype=torch.int64, device=device)  # misses' rows that were written below
        self.moved = [0, 0]
        self.moved_queued = torch.zeros(2, dtype=torch.int64, device=device)
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None  # the write-backs' stream
        self.landed = None  # an event after the last write-back queued there (None: none yet, or no GPU)
        self.captured = None  # the write-back a captured residency leaves each replay of it (take_captured)
        self.swapped = None  # the plan whose swap was launched last (a failure after it: see move)

    # -- the moves ------------------------------------------------------------------------------
    def move(self, plan, queued: bool = False, captured: bool = False) -> None:
        """A plan's rows moved (queued: a queued plan's, whose lists are whole and whose totals
        stay on the device, plan.placed.xfer[:KINDS]; else the lists are cut to the totals). First
        the dirty rows lingering in overflow slots are written down (one may be a miss of this
        batch, read back next); then each miss's slot has its dirty victim written down (or put
        in a staging block, and written down apart: write_back) and the miss read into it, by one
        kernel (moves.swap_rows); misses never written below are marked for the tier to draw
        (DeviceTier.draw_marked). After the write-backs queued before (captured: a residency
        captured in a graph, whose replays wait for them before: room_for_graph; its write-back
        is left for take_captured, not queued)."""
        tier = self.tier
        pool, totals = tier.pool.rows, plan.placed.xfer if queued else None
        fresh, dirty = plan_kernels.FRESH, plan_kernels.DIRTY
        if not captured and self.side is not None:
            self.after_write_backs(torch.cuda.current_stream(tier.device))
        if queued or plan.lingering:
            moves.move_rows(pool, plan.dirty_slots, self.rows, plan.dirty_ids_device, written=self.written,
                            count=totals[dirty:dirty + 1] if queued else None, src_from=tier.index.capacity,
                            words=tier.words)
        count = totals[fresh:fresh + 1] if queued else None
        victims, n = plan.miss_victims, plan.miss_slots.numel()
        staging = (torch.empty(n, tier.width, device=tier.device)
                   if WRITE_BACK_APART and victims is not None and n else None)
        # From the swap on, a failure leaves the misses' rows in the victims' slots: the caller
        # empties those slots (swapped names the plan), and the staged dirty victims are written down.
        self.swapped = None
        moves.swap_rows(pool, plan.miss_slots, victims, self.rows, plan.miss_ids_device, mark=DEFERRED_MARK,
                        written=self.written, found=self.found, count=count, staging=staging, words=tier.words)
        self.swapped = plan
        pending = None if staging is None else (staging, torch.arange(n, device=tier.device), victims, count)
        if captured:
            self.captured = pending
        elif pending is not None:
            try:
                self.write_back(pending)
            except BaseException:
                self.write_back(pending)  # (again: an interrupt may have cut the first short)
                raise
        if queued:  # (counted on the device: read by settle)
            self.moved_queued += totals[fresh:dirty + 1:dirty - fresh]
        else:
            self.moved[0] += plan.num_misses
            self.moved[1] += plan.num_dirty

    def write_back(self, pending: tuple, replayed: bool = False) -> None:
        """The victims' rows a staged swap left (pending: the staging block, its rows' numbers,
        the victims' ids, the count on the device or None) written down into the host rows, on
        the write-backs' stream after the current stream's work so far; `landed` then follows it
        (on CPU tensors: at once). replayed: pending is a captured residency's (its tensors the
        graph's, kept with it), after a replay of it."""
        staging, order, victims, count = pending
        down = dict(count=count, programs=WRITE_BACK_PROGRAMS, words=self.tier.words)
        if self.side is None:
            moves.move_rows(staging, order, self.rows, victims, **down)
            return
        self.side.wait_stream(torch.cuda.current_stream(self.tier.device))
        with torch.cuda.stream(self.side):
            moves.move_rows(staging, order, self.rows, victims, **down)
            landed = torch.cuda.Event()
            landed.record(self.side)
        if not replayed:  # (freed by the residency's stream: not reused before the write-back is done)
            for t in pending:
                if t is not None:
                    t.record_stream(self.side)
        self.landed = landed

    def after_write_backs(self, stream) -> None:
        """Orders stream after every write-back queued so far (their rows are in the host rows)."""
        if self.landed is not None:
            stream.wait_event(self.landed)

    def take_captured(self) -> tuple | None:
        """The write-back a residency just captured left (None: it left none), for write_back(...,
        replayed=True) after each replay."""
        pending, self.captured = self.captured, None
        return pending

    # -- a residency queued without a wait for the device (gpu/queued.py) ------------------------
    def room_for_graph(self, n: int) -> list:
        """Before a replayed queued residency of n ids (under its store's lock, which every other
        residency takes): residency's grow (then the shape's graphs are stale), and the events
        the replay's stream is to wait for, returned: the releases (forgotten by
        graphed_admitted, once the replay is queued after them) and the last write-back."""
        return self._room(n, forget=False) + ([self.landed] if self.landed is not None else [])

    def queued_work(self, unique: torch.Tensor, num_unique: torch.Tensor, pin: bool,
                    captured: bool = False) -> torch.Tensor:
        """A queued residency's device work on the current stream (the plan, the rows moved, the
        commit; made room for: _room), under index_lock: its slots. Every count stays on the
        device. Also what a captured graph replays (gpu/graphed.py; captured: then every replay's
        find searches the overflow rows, whatever the host knows of them now, and the victims'
        write-back is left for take_captured): nothing here reads a host value that changes from
        batch to batch."""
        tier = self.tier
        if captured:
            tier.index.overflow_known = False
        plan = tier.index.plan_queued(unique, num_unique, tier.num_embeddings)
        try:  # (once swapped, the misses' rows are in the victims' slots: see DeviceTier.resident's failure)
            self.move(plan, queued=True, captured=captured)
            if tier.draws_misses:
                tier.draw_marked(plan, plan.placed.xfer[plan_kernels.FRESH:plan_kernels.FRESH + 1])
            tier.index.commit_queued(plan, pin)
        except BaseException:
            if not captured and self.swapped is plan:
                tier.index.forget(plan, plan.placed.xfer[plan_kernels.FRESH])
            raise
        return plan.slots

    def graphed_admitted(self, n: int, waited: list) -> None:
        """After a replayed queued residency of n ids (pinned), queued after the releases waited
        (room_for_graph's): what its capture did on the host."""
        tier = self.tier
        with tier.pool_lock:
            tier.pinned_ids += n
            if waited:
                gone = {id(e) for e in waited}
                self.releases_since = [e for e in self.releases_since if id(e) not in gone]
        tier.index.queued_replayed()

    def graphed_released(self, n: int, stream) -> None:
        """After a replayed backward's graph released its batch of n ids, on stream (None on the
        CPU): the host's part of DeviceTier.unpin()."""
        tier = self.tier
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(), tier.pool_lock:
            tier.count_release(n)
        if stream is not None:
            tier.computed_on(stream)

    # -- the store told ------------------------------------------------------------------------
    def mark_written(self, ids: torch.Tensor) -> None:
        """The rows of ids (host int64) reached the host rows from elsewhere: misses read them."""
        self.written[to_device(ids, self.tier.device)] = 1

    def settle(self) -> None:
        """Tells the store of the rows the device wrote into its host rows (the written bits) and
        of the rows it read and wrote (the counters) since the last time, so that what the store
        holds and counts is current; the device's counts added to the tier's bytes moved. Waits
        for the device; the caller has ordered the current stream after the residencies."""
        tier = self.tier
        queued = self.moved_queued.tolist()
        if any(queued):
            self.moved_queued.zero_()
            self.moved = [a + b for a, b in zip(self.moved, queued)]
            tier.bytes_in += queued[0] * tier.row_bytes
            tier.bytes_out += queued[1] * tier.row_bytes
        if not any(self.moved):
            return
        reads, wrote = self.moved
        ids = torch.nonzero(self.written == moves.WROTE).squeeze(1) if wrote else None
        found = int(self.found.item())
        if ids is not None:  # (the store told first: a failure before this leaves the bits to tell again)
            self.store.wrote_in_place(ids.cpu(), count=False)
        self.store.count_moved(reads, found, wrote)
        self.moved = [0, 0]
        if ids is not None:
            self.written[ids] = 1
        self.found.zero_()

    def close(self) -> None:
        """Unmaps the host rows (after the device is done with them)."""
        if self._unmap is not None:
            self.rows = None
            self._unmap()
