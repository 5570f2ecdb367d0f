"""DeviceTier: tier 0 on a GPU, device-resident. Its index (gpu/index.py, gpu/direct_index.py), pins, dirty bits and
policy state live in device memory; a batch's dedup, hits and misses, victims and slots are
computed on the device over the whole batch; only the miss ids and the dirty victims cross to the
host, as blocks through pinned staging, and the layer below (a RowStore: the host cache, the host
store or an SSD store) reads and writes them there.

Streams: a batch is made resident on the tier's own stream (a prefetch worker's residency then
overlaps the compute of the batch before); its rows are ready for the compute stream once that
stream waits for the batch's event (ResidentBatch.await_rows). Releases run on the stream that
computed with the batch, so a row is unpinned only after every kernel that reads it. A plan waits
for the device once (its one device-to-host transfer); a table held whole in tier 0 whose misses
are initialized on the device waits for nothing, and neither does a zero-copy residency of host
ids (its counts stay on the device: gpu/zerocopy.py), nor one over a log store whose reads and
writes are queued on the stream (gpu/storeio.py, while it is a measurement switch).

The same code runs on CPU tensors (device "cpu", no streams): that is how the tests check it.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from .. import _C, locks
from ..tiers.cache import Deduped
from ..tiers.rowstore import DEFERRED_MARK
from . import current_device, rowinit, to_device
from .checks import check_on_device, checked_ids
from .dedup import dedup as device_dedup
from .graphed import StepGraphs
from .direct_index import DirectIndex
from . import storeio
from .index import SetIndex
from .zerocopy import ZeroCopy

_ROWS_PER_MOVE = 1 << 16  # write-backs at flush: staging blocks of at most this many rows
_DIRTY_SLACK = 64  # dirty rows a plan's transfer carries beyond the last batch's count


class DeviceRows:
    """A device tier's slots: a float32 [slots, width] device tensor (the kernels read and update
    it in place), and its moves to and from host blocks."""

    kernels = "triton"  # tier 0's lookup math on these rows (tieredemb/kernels.py)

    def __init__(self, rows: torch.Tensor):
        self.rows = rows
        self.width = rows.shape[1]
        self.device = rows.device

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        return self.rows.index_select(0, slots.to(self.device))

    def scatter(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        self.rows.index_copy_(0, slots.to(self.device), rows.to(self.device))

    def to_host(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows in slots as a host block (pinned on a GPU), complete on return."""
        rows = self.gather(slots)
        if self.device.type == "cpu":
            return rows
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return host

    def from_host(self, slots: torch.Tensor, block: torch.Tensor) -> None:
        """block (host rows; pinned on a GPU) into slots, on the current stream."""
        self.scatter(slots, to_device(block, self.device, owned=True))

    def staging(self, n: int) -> torch.Tensor:
        """A host block for n rows in transit (pinned on a GPU)."""
        return torch.empty(n, self.width, dtype=torch.float32, pin_memory=self.device.type == "cuda")

    def copy_out(self, slots: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
        block = self.to_host(slots).contiguous()
        _C.copy_rows(block, torch.arange(len(slots)), dst, dst_rows)

    def copy_in(self, slots: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor) -> None:
        block = torch.empty(len(slots), self.width, dtype=torch.float32)
        _C.copy_rows(src, src_rows, block, torch.arange(len(slots)))
        self.from_host(slots, block)


class DeviceTier:
    """Tier 0 on a device: capacity rows (None: every row, slot = id), policy 'lru' or 'lfu',
    lower: the RowStore below it. init: the table's RowInit (rows never written are drawn on the
    device, bit for bit as on the host, when nothing below can hold them). zero_copy: the layer
    below is the table's host rows (a HostStore), pinned and mapped into the device: the misses
    are read from them and the dirty victims written into them by kernels (gpu/moves.py), with no
    staging block and no host copy."""

    name = "tier0"

    def __init__(self, num_embeddings: int, width: int, capacity: int | None, policy: str, lower, init,
                 device: torch.device, *, lower_is_store: bool = True, partitions: tuple | None = None,
                 zero_copy: bool = False, graphs: bool = False, words: int | None = None):
        self.num_embeddings = num_embeddings
        self.width = width
        self.words = width if words is None else words  # a row's words that hold values (the rest: pad, zero)
        self.device = device
        self.lower = lower
        self.init = init
        if partitions is not None:
            self.index = SetIndex(sum(c for _, c in partitions), policy, device, partitions=partitions)
        elif capacity is None or capacity >= num_embeddings:
            self.index = DirectIndex(num_embeddings, device)
        else:
            self.index = SetIndex(capacity, policy, device)
        self.pool = DeviceRows(torch.zeros(self.index.slots_total, width, device=device))
        # the bytes a row moved to or from below counts: zero-copy's moves leave a row's pad out
        self.row_bytes = (self.words if zero_copy else width) * 4
        self.bytes_in = self.bytes_out = 0
        self.dirty_guess = _DIRTY_SLACK
        # Misses of a whole-table tier are rows it never held: when nothing was ever stored below
        # (a new table), they are drawn on the device; set False once rows reach the layer below
        # from elsewhere (TableStore.write).
        self.init_misses_here = isinstance(self.index, DirectIndex) and _stores_nothing(lower)
        # The store below leaves the misses it never stored for this tier to draw (RowInit.deferred);
        # a host cache between would keep such rows, so then the host draws them.
        self.draws_misses = lower_is_store
        self._released = None  # an event after the last release's unpin (a GPU's; see after_releases)
        self._computed_on: dict = {}  # the streams batches were computed on (a GPU's; see _after_residencies)
        self._queued = False  # work was queued on the tier's stream since after_queued() last looked
        self._graphed_on = None  # the stream of replayed lookups the tier's stream is yet to wait for
        self._replayed_on = None  # the stream of the last replayed lookup (the next replay's waits for it)
        self.pinned_ids = 0  # ids of the batches pinned here and not yet released (see ZeroCopy.residency)
        # zero_copy: the host rows below, mapped, which the kernels read and write (gpu/zerocopy.py)
        self.zero_copy = ZeroCopy(self, lower, lower_is_store) if zero_copy else None
        # (torch hands streams out of a pool of 32 a device, round robin: past 32 tables, or beside
        # a user's own torch.cuda.Stream, one may be shared; that orders more, never less)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # the log store right below read and written in stream order (gpu/storeio.py)
        io = storeio.stream_io(lower) if (storeio.ON_STREAM and not zero_copy and lower_is_store
                                          and isinstance(self.index, SetIndex) and partitions is None) else None
        self.on_stream = storeio.StoreOnStream(self, io) if io is not None else None
        self.queued = self.zero_copy or self.on_stream  # (a residency queued without a wait: gpu/queued.py)
        self._before_residencies()  # (the pool's and the index's zeros are in place before any residency)
        self.index_lock = locks.Counted(reentrant=True)  # as CacheTier's (the worker plans while training releases)
        # Held around each kernel launch on the pool, the index's dirty bits or its pins, and while
        # they are replaced by larger ones (_plan), so no kernel is queued on a tensor being replaced.
        self.pool_lock = locks.Counted()
        # Lookups captured as CUDA graphs and replayed (gpu/graphed.py): a table held whole here, or
        # a zero-copy one (see graph_kind); generation: how many times the pool and the index's
        # state tensors were replaced by larger ones (a graph captured before reads the old ones)
        self.generation = 0
        self.graphs = StepGraphs(self) if graphs and (isinstance(self.index, DirectIndex) or zero_copy) else None

    @property
    def state(self) -> dict:
        return self.lower.state

    def _on_stream(self):
        if self.stream is None:
            return contextlib.nullcontext()
        self._queued = True
        if self._graphed_on is not None:  # (after the replayed lookups' draws and updates: see before_next)
            self.stream.wait_stream(self._graphed_on)
            self._graphed_on = None
        return torch.cuda.stream(self.stream)

    def after_queued(self) -> None:
        """Orders the current stream after the work queued on the tier's stream since the last
        call (a residency's draws), if any, and after the last replayed lookup's stream if it was
        another (gpu/graphed.py's replays, which do not use the tier's stream: two of them on two
        streams must not plan at once on one index)."""
        if self.stream is None:
            return
        current = torch.cuda.current_stream(self.device)
        if self._queued:
            self._queued = False
            current.wait_stream(self.stream)
        if self._replayed_on is not None and self._replayed_on != current:
            current.wait_stream(self._replayed_on)

    def before_next(self, stream) -> None:
        """Work queued on stream (replayed lookups: gpu/graphed.py) comes before the next work
        queued on the tier's stream (a residency must see the rows they drew and updated); the
        wait is queued then, not now. A flush or a read waits for stream too."""
        self._graphed_on = self._replayed_on = stream
        if stream is not None:
            self.computed_on(stream)

    # -- batches ------------------------------------------------------------------------------
    def dedup(self, ids: torch.Tensor, segments=None, *, in_plan: bool = False, check=None):
        """ids int [N] (any device) -> Deduped (gpu/dedup.py: unique [N], the distinct ids
        ascending in the first U entries; inverse [N]; U as an int64 [1] tensor; the grouping the
        backward reuses), computed on the tier's stream, without waiting for the device.
        IndexError for an id out of range: checked on the host for host ids (the cheap way); for
        device ids on the device (gpu/checks.py), the verdict read with one wait here, or, with
        in_plan (the batch is made resident next, here or by a prefetch worker), by that residency
        (Deduped.check), in the transfer its plan makes anyway. Changes nothing. check: the
        verdict on ids already checked on the device (by the module, with their offsets). Device
        ids may come from the caller's stream: the tier's stream waits for it then (only then:
        host ids let residency run beside the compute queued before). segments (a collection's
        runs of disjoint id ranges) are not needed: one sort dedups the whole batch on the
        device."""
        on_device = check is not None or self._on_device(ids)
        if not on_device:  # (checked and narrowed on the host, in one pass)
            host_ids = checked_ids(ids, self.num_embeddings, pin=self.device.type == "cuda")
        if self.stream is not None and on_device:  # (ids on another GPU: its stream made them)
            self.stream.wait_stream(torch.cuda.current_stream(ids.device if ids.is_cuda else self.device))
            ids.record_stream(self.stream)  # (the caller's tensor, read on the tier's stream)
        with self._on_stream():
            if not on_device:
                ids = host_ids.to(self.device, non_blocking=True)
            elif check is None:  # (the check writes them as the sort takes them, narrowed where they fit)
                ids, _, check = check_on_device(ids.to(self.device, non_blocking=True), None, self.num_embeddings)
            if ids.numel() == 0:
                empty = torch.empty(0, dtype=torch.int64, device=self.device)
                deduped = Deduped(empty, empty, torch.zeros(1, dtype=torch.int64, device=self.device))
            else:
                deduped = device_dedup(ids, None if check is None else check.sentinel)
            if check is None:
                return deduped
            if in_plan:
                return deduped._replace(check=check)
            check.resolve()  # (on the tier's stream, which the verdict was written on or waited for)
            return deduped

    @staticmethod
    def _on_device(ids: torch.Tensor) -> bool:
        """Whether ids are checked on the device (gpu/checks.py) rather than on the host."""
        return ids.device.type != "cpu"

    def resident(self, unique: torch.Tensor, num_unique: torch.Tensor, *, pin: bool, allow_overflow: bool = True,
                 check=None):
        """Makes the distinct ids unique[:U] resident, on the tier's stream. Returns (slots [N] on
        the device, misses (an int; 0 when only the device counted them), the event after which the
        rows are in place), or None (nothing changed) if the batch needs overflow slots and
        allow_overflow is False. The dirty victims are written down, then the misses read from
        below, and only then does tier 0 change: a failed write or read leaves it as it was (the
        victims written down already stay dirty in it). check: the verdict on the batch's device
        inputs (Deduped.check), read before anything changes: in the plan's transfer, or, with no
        plan to make, with one wait of its own; the inputs' error raised if they break a rule."""
        if self.on_stream is not None:  # (a failed queued store call left tier 0 unusable)
            self.on_stream.raise_error()
        with self._on_stream():
            if self.init_misses_here:  # every miss drawn here: the whole residency is one launch
                if check is not None:
                    check.resolve()
                with self.index_lock:
                    slots = self.draw(unique, num_unique)
                # (it counts its misses on the device: see stats())
                return slots, 0, self.record()
            if self.queued is not None:
                if self.queued.queues(check, allow_overflow):
                    return self.queued.residency(unique, num_unique, pin, allow_overflow)
                self.queued.forget_done_releases()  # (a plan that waits: the releases done dropped, not to pile up)
            with self.index_lock:
                plan = self._plan(unique, num_unique, check)
            if plan.num_overflow and not allow_overflow:
                return None
            dirty, misses = plan.num_dirty, plan.num_misses
            moved = False  # (rows moved into the misses' slots: then a failure empties those slots)
            try:
                if self.zero_copy is not None:  # (both ways at once: see ZeroCopy.move)
                    self.zero_copy.move(plan)
                elif dirty:  # (first: a lingering overflow row may leave and come back)
                    rows = plan.dirty_rows if plan.dirty_rows is not None else self.pool.to_host(plan.dirty_slots)
                    self.lower.write_from(plan.dirty_ids, rows, torch.arange(dirty))
                self.bytes_out += dirty * self.row_bytes
                # the next plan's transfer carries this many dirty rows: a quarter more than these
                self.dirty_guess = dirty + dirty // 4 + _DIRTY_SLACK
                if misses:
                    if self.zero_copy is None:
                        block = self.pool.staging(misses)
                        with self.init.deferred() if self.draws_misses else contextlib.nullcontext():
                            self.lower.read_to(plan.miss_ids, block, torch.arange(misses))
                        moved = True
                        self.pool.from_host(plan.miss_slots, block)
                    if self.draws_misses:
                        self.draw_marked(plan)
                    self.bytes_in += misses * self.row_bytes
                with self.index_lock:
                    self.index.commit(plan, pin)
            except BaseException:
                # The victims' ids still named slots that now held other rows (a flush then wrote
                # those under the victims' ids). The dirty victims were written down already.
                if moved or (self.zero_copy is not None and self.zero_copy.swapped is plan):
                    with self.index_lock:
                        self.index.forget(plan)
                raise
            return plan.slots, misses, self.record()

    def graph_kind(self) -> str | None:
        """How a lookup's residency here is captured as a CUDA graph (gpu/graphed.py): "draw" (a
        whole table whose misses are drawn here: DirectIndex.draw), "queued" (a zero-copy
        residency queued without a wait, no lookahead window: ZeroCopy.queued_work), or None
        (the ordinary path only)."""
        if isinstance(self.index, DirectIndex):
            return "draw" if self.init_misses_here else None
        zc = self.zero_copy
        return "queued" if zc is not None and zc.queues(None, True) and not self.index.window else None

    def draw_marked(self, plan, count: torch.Tensor | None = None) -> None:
        """The misses marked never stored, drawn here, bit for bit as the host would."""
        rowinit.init_rows(plan.miss_ids_device, self.pool.rows, plan.miss_slots, *self.init.args,
                          weights=self.init.weights, marked=DEFERRED_MARK, count=count)

    def draw(self, unique: torch.Tensor, num_unique: torch.Tensor) -> torch.Tensor:
        """A whole-table tier's residency, when every miss is drawn here (init_misses_here): one
        launch on the current stream, which waits for nothing (DirectIndex.draw). Returns slots."""
        return self.index.draw(unique, num_unique, self.pool.rows, self.init)

    def record(self):
        """An event after the work queued on the tier's stream so far (None on the CPU)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def _plan(self, unique: torch.Tensor, num_unique: torch.Tensor, check=None):
        """The index's plan, after adding the overflow slots it asks for (rare: the first batches
        wider than any before). Growing replaces the pool and the index's state tensors: under
        pool_lock, which every kernel launch on them takes, and after the device is idle, so no
        kernel queued before writes to the old ones."""
        while True:
            # (the transfer brings dirty rows for the host to write down; zero-copy writes them from the device)
            rows = self.pool.rows if self.zero_copy is None else None
            plan = self.index.plan(unique, num_unique, self.num_embeddings, rows, self.dirty_guess, check,
                                   ids_to_host=self.zero_copy is None)
            if not isinstance(plan, int):
                return plan
            self.grow(plan)

    def grow(self, slots: int) -> None:
        """Adds overflow slots to the index and the pool: under pool_lock, after the device is idle.
        The graphs captured over the old tensors are dropped (a batch in flight from one runs its
        backward's kernels one by one: see generation)."""
        with self.pool_lock:  # (a replay checks generation under it: see graphed.py's backward)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            # (the pool first: out of memory there changes nothing; after the index had grown, the
            # next batch's slots were past the pool's end)
            grown = torch.zeros(self.index.slots_total + slots, self.width, device=self.device)
            self.generation += 1
            if self.graphs is not None:
                self.graphs.drop_shapes()
            self.index.grow(slots)
            grown[:self.pool.rows.shape[0]] = self.pool.rows
            self.pool.rows = grown
            if self.device.type == "cuda":  # (the copies are in place before a kernel on another stream reads them)
                torch.cuda.synchronize(self.device)

    def admit(self, unique: torch.Tensor, count: torch.Tensor, *, allow_overflow: bool = True, check=None):
        """A batch's distinct ids made resident and pinned: see resident()."""
        got = self.resident(unique, count, pin=True, allow_overflow=allow_overflow, check=check)
        if got is not None:
            with self.pool_lock:  # (as unpin's, on the thread that releases)
                self.pinned_ids += unique.numel()
        return got

    def mark_dirty(self, slots: torch.Tensor) -> None:
        """Slots whose rows were updated in place (the Triton backward marks them itself)."""
        with self.index_lock:
            slots = slots.to(self.device)
            self.index.dirty[torch.where(slots >= 0, slots, self.index.slots_total)] = 1

    def below_written(self, ids: torch.Tensor) -> None:
        """The rows of ids (host int64) reached the layer below from elsewhere: misses must now be
        read from it (and with zero_copy, those rows read as written)."""
        self.init_misses_here = False
        if self.zero_copy is not None and len(ids):
            self._after_residencies()
            self.zero_copy.mark_written(ids)
            self._before_residencies()

    def _settle(self) -> None:
        """Queued residencies: the store below told what the device wrote into its host rows
        (zero_copy), the rows moved counted (QueuedResidency.settle). Waits for the device. The
        caller has ordered the current stream after the residencies (_after_residencies)."""
        if self.queued is None:
            return
        try:
            self.queued.settle()
        finally:  # (what was read and zeroed there, before the next residency adds to it)
            self._before_residencies()

    def unpin(self, slots: torch.Tensor, stream=None) -> None:
        """Unpins a batch's slots, on stream (the one its kernels ran on) if given, else on the
        tier's (a batch never computed with: after its residency, on the stream that made it)."""
        ctx = torch.cuda.stream(stream) if stream is not None else self._on_stream()
        # (not the index lock, which a plan holds across its wait for the device: a backward's
        # release would wait for the prefetch worker's plan; the pins only must not be replaced
        # meanwhile, which a grow does under the pool lock. A plan's kernels read the pins once
        # each and take a release landing between them, as they must on a GPU anyway.)
        with ctx, self.pool_lock:
            self.index.unpin(slots)
            self.count_release(slots.numel())
        if stream is not None:
            self.computed_on(stream)

    def count_release(self, n: int) -> None:
        """A release of n ids queued on the current stream (under pool_lock): no longer counted as
        pinned, and an event after it (a GPU's) for the plans that must see it."""
        self.pinned_ids -= n
        if self.stream is not None:  # (queued on that stream: a plan retried for room waits for it)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._released = event
            if self.queued is not None:  # (a queued residency waits for each: see QueuedResidency.residency)
                self.queued.releases_since.append(event)

    def computed_on(self, stream) -> None:
        """Notes that batches were computed on stream (a flush or a read then waits for it)."""
        self._computed_on[stream] = True

    def after_releases(self) -> None:
        """Orders the tier's stream after the last release's unpin (queued on the stream that
        computed with its batch): a plan that found no room beside the pinned rows and is tried
        again after a release must see that release's pins gone. It waits for an event recorded
        just after that unpin, not for the whole stream: compute queued there since (the next
        forward and backward) does not hold the retried plan back."""
        released = self._released
        if released is not None:
            self.stream.wait_event(released)

    @property
    def dirty(self) -> torch.Tensor:
        """uint8 [slots] on the device: the backward kernel marks the rows it updates."""
        return self.index.dirty

    # -- what TableStore reads and writes in place --------------------------------------------
    def _after_residencies(self) -> None:
        """Orders the current stream after every residency queued on the tier's stream (their
        index updates and row copies), and after what was queued on every stream batches were
        computed on (their backwards' updates: a flush, read or write from the default stream
        while training runs on a side stream must see them), before it reads or writes the index
        or the pool, and after zero-copy's write-backs (before the host rows are read). A stream
        is known once a batch computed on it was released: a flush from another thread while the
        first batch on a new stream is in flight does not wait for it."""
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.stream)
            for computed in list(self._computed_on):
                if computed != current:
                    current.wait_stream(computed)
            if self.zero_copy is not None:  # (the victims' rows written down apart: in the host rows)
                self.zero_copy.after_write_backs(current)
        if self.on_stream is not None:  # (the store is touched next: its queued calls done first)
            self.on_stream.wait()

    def lookup(self, ids: torch.Tensor) -> np.ndarray:
        """Each id's slot here, or -1 (TableStore reads the rest from the store below: told first
        of what zero_copy moved)."""
        self._after_residencies()
        self._settle()
        with self.index_lock, current_device(self.device):  # (its kernel launches on the current device)
            return self.index.lookup(ids.to(self.device)).cpu().numpy()

    def update_in_place(self, slots: torch.Tensor, update) -> None:
        """update() changes the pinned rows in slots in place (the torch-ops twin's optimizer step;
        the Triton kernels mark their rows themselves), then they are marked dirty: after pool_lock
        (mark_dirty takes index_lock, which a grow takes before pool_lock)."""
        with self.pool_lock:
            update()
        self.mark_dirty(slots)

    def copy_out(self, slots: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
        """The resident rows in slots into dst[dst_rows] (host), copied on the current stream."""
        self.pool.copy_out(slots, dst, dst_rows)

    def update(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        self._after_residencies()
        self.pool.scatter(slots, rows)
        with self.index_lock:
            self.index.dirty[slots.to(self.device)] = 1
        self._before_residencies()

    def _before_residencies(self) -> None:
        """Orders the tier's stream after what the current stream queued on the pool or the index
        (a residency must see those rows and dirty bits: it may evict them; and so must a replayed
        lookup: see after_queued)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            self._queued = True

    def write_back(self) -> None:
        """Writes every dirty row down (they stay resident, now clean). Each part is marked clean
        before it is copied (queued before the copy on this stream): a backward queued meanwhile
        on this stream by another thread leaves its rows dirty (see CacheTier.write_back; one on
        another stream is not ordered with this at all). A copy that fails marks its part dirty
        again."""
        self._after_residencies()
        self._settle()
        with self.index_lock:
            ids, slots = self.index.dirty_rows()
        for start in range(0, ids.numel(), _ROWS_PER_MOVE):
            part_ids, part_slots = ids[start:start + _ROWS_PER_MOVE], slots[start:start + _ROWS_PER_MOVE]
            with self.index_lock:
                self.index.mark_clean(part_slots)
            try:
                if self.zero_copy is not None:  # (its copy of the written bits; a failure leaves the
                    self.zero_copy.written[part_ids] = 1  # rows dirty here, so never read below)
                self.lower.write_from(part_ids.cpu(), self.pool.to_host(part_slots), torch.arange(part_ids.numel()))
            except BaseException:
                self.mark_dirty(part_slots)
                raise
            self.bytes_out += part_ids.numel() * self.row_bytes
        self._before_residencies()

    def host_ids(self, unique: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """A batch's distinct ids (as dedup gave them) on the host: waits for the tier's stream."""
        with self._on_stream():
            return unique[:int(count)].cpu()

    # The lookahead window: unique ids of the batches ahead, as dedup gives them.
    def window_push(self, unique: torch.Tensor, num_unique: torch.Tensor) -> None:
        with self._on_stream(), self.index_lock:  # (after the dedup that wrote them; read by plans there)
            self.index.window_push(unique.to(self.device), num_unique.to(self.device))

    def window_pop(self) -> None:
        with self.index_lock:
            self.index.window_pop()

    def window_clear(self) -> None:
        with self.index_lock:
            self.index.window_clear()

    # -- RowStore, as the others (nothing sits above tier 0, but flush and close come through) ---
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
        self._after_residencies()
        self._settle()  # (TableStore reads the store's stats next)
        with self.index_lock:
            s = self.index.stats()
            s.update(capacity=self.index.capacity, resident=self.index.size, overflow=self.index.overflow_in_use)
            parts = self.index.part_stats() if self.index.partitions else None
        self._before_residencies()  # (queued residencies' counters, read and zeroed here, before the next adds)
        lookups = s["hits"] + s["misses"]
        s.update(hit_rate=s["hits"] / lookups if lookups else 0.0, bytes_in=self.bytes_in,
                 bytes_out=self.bytes_out, bytes_moved=self.bytes_in + self.bytes_out)
        if parts is not None:  # a partitioned tier 0: each part's counters too
            for p in parts:
                looked = p["hits"] + p["misses"]
                p["hit_rate"] = p["hits"] / looked if looked else 0.0
            s["partitions"] = parts
        return s

    def reset_stats(self) -> None:
        self._after_residencies()  # (the counts of residencies queued before are before the reset)
        self._settle()  # (TableStore resets the store's counters next)
        with self.index_lock:
            self.index.reset_stats()
        self._before_residencies()  # (the counters' new zeros are in place before the next residency)
        self.bytes_in = self.bytes_out = 0

    def close(self) -> None:
        self.graphs = None  # (their buffers and graphs' memory)
        try:
            self.flush()
        finally:  # (the store's files and lock let go even when the flush failed)
            try:
                self.lower.close()
            finally:
                if self.queued is not None:  # (after the device is done with the host rows, the pinned blocks)
                    self.queued.close()


def on_cpu_tensors(table, cache_rows: int | None, policy: str = "lru", partitions=None, zero_copy: bool = False,
                   graphs: bool = False):
    """A CPU table (TieredEmbeddingBag / TieredEmbedding) with its tier 0 replaced by a DeviceTier
    on CPU tensors over the same layers below: the GPU path run on a CPU, its Triton kernels under
    TRITON_INTERPRET=1 (tests/test_gpu_tier.py, bench/gpu_ops.py). graphs: its lookups go through
    gpu/graphed.py (whose graphs are then recorded and replayed: gpu/recorded.py). Returns the table."""
    st = table._store
    lower = st.tier0.lower
    tier = DeviceTier(table.num_embeddings, table.width, cache_rows, policy, lower, st.init, torch.device("cpu"),
                      lower_is_store=lower is st.bottom, partitions=partitions, zero_copy=zero_copy, graphs=graphs,
                      words=table.layout.words)
    st.tier0 = st.tiers[0] = tier
    return table


def collection_on_cpu_tensors(collection, graphs: bool = False):
    """A collection (collection.py) with every group's tier 0 replaced by a DeviceTier on CPU
    tensors, as on_cpu_tensors does for one table (each table's share of tier 0 kept; graphs as
    its). Returns the collection."""
    for engine in collection.engines:
        parts = engine.config.partitions
        on_cpu_tensors(engine, None if parts is None else sum(c for _, c in parts), partitions=parts, graphs=graphs)
    return collection


def _stores_nothing(store) -> bool:
    """Whether the layer below holds no row (a new table): its first written id, if any."""
    return len(store.written_ids(0, 1)) == 0
