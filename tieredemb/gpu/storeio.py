"""Tier 0's reads and writes of the log store below it, in stream order: a residency queued with no
wait for the device, as FBGEMM's SSD tier queues its key-value reads on the stream.

The waiting path (DeviceTier.resident) plans, waits for the plan's transfer, writes the dirty
victims down, reads the misses, and only then queues their copy to the device: a prefetch worker
spends each residency waiting or copying, and that bounds a table over SSD (ours-ssd10: about 7 ms
a batch of 164K ids on an H100, where the training step takes under 2). Here all of it is queued on
the tier's stream at once, and the host goes on to the next batch:

1. the plan, its counts left on the device (SetIndex.plan_queued);
2. the dirty victims' rows moved out of their slots into a pinned block (moves.move_rows, as many
   as the device counted), and the plan's transfer copied into pinned memory;
3. the store's part, a host function the driver runs when the stream gets there (the log store's
   native StreamIo, native/ssd/stream_io.h: no Python, no GIL): it reads the counts, writes the
   victims down and reads the misses into a second pinned block, a row never stored marked for
   the device to draw;
4. the misses' rows moved from that block into their slots, the marked ones drawn, the commit.

Every user of the store waits for the calls queued before it: DeviceTier._after_residencies, which
every read, write, flush and count of the table goes through (under the table's lock, as every
residency is), waits for the tier's stream. So the store still has one caller at a time.

The price: a failed write or read below is raised by the next residency or flush, and every one
after: by then the commit that followed it has run, so tier 0 holds rows that were not read, and
the table must be dropped (the waiting path leaves tier 0 as it was). And two pinned blocks as
large as a batch's ids (and the overflow slots) may need, for the table's life.

For tables made while ON_STREAM is True, over a log store right below tier 0 that stores float32
(bench/bench_gpu.py's ours-ssd10-os): a measurement switch, until a GPU says which way is faster.
"""

from __future__ import annotations

import weakref

import torch

from ..tiers.rowstore import DEFERRED_MARK
from . import moves, plan_kernels
from .queued import QueuedResidency

ON_STREAM = False


def stream_io(lower):
    """The store's native StreamIo for a tier's plans (their transfer's layout), or None where the
    store has none (only the log store, storing float32, has one)."""
    make = getattr(lower, "stream_io", None)
    if make is None:
        return None
    return make(plan_kernels.KINDS, plan_kernels.FRESH, plan_kernels.DIRTY, DEFERRED_MARK)


class StoreOnStream(QueuedResidency):
    """A DeviceTier's residencies over the log store right below it (io: its StreamIo), the store's
    reads and writes queued on the tier's stream (see above)."""

    def __init__(self, tier, io):
        super().__init__(tier)
        self.io = io
        self.queued_calls = 0
        self.order_device = torch.empty(0, dtype=torch.int64, device=tier.device)  # 0, 1, ...: the blocks' rows
        # What the queued calls use (the blocks: rows out, rows in, the plan's transfer; pinned on a
        # GPU, grown as batches need), held here until the stream is past them, even if the table is
        # dropped without a flush (an exception unwinding a training loop): the calls hold raw pointers.
        self._held = {"io": io, "blocks": None}
        weakref.finalize(self, _after_the_stream, tier.stream, self._held)

    def queues(self, check, allow_overflow: bool) -> bool:
        """As QueuedResidency's, allow_overflow aside: a prefetcher makes its residencies with
        allow_overflow False, and refused they would all wait for the device; residency() refuses
        only a batch that would take the overflow slots past tier 0's capacity."""
        return super().queues(check, True)

    def residency(self, unique, num_unique, pin: bool, allow_overflow: bool = True):
        """QueuedResidency.residency, or None (nothing changed) for a batch not allowed overflow
        that would grow the overflow slots past tier 0's capacity (the rows pinned by the batches
        a prefetcher holds, and this one's ids: a deep prefetch waits for a release there)."""
        if not allow_overflow:
            index, tier = self.tier.index, self.tier
            with tier.pool_lock:
                short = tier.pinned_ids + unique.numel() - index.overflow_slots
            if short > 0 and index.overflow_slots + max(short, index.overflow_slots) > index.capacity:
                return None
        return super().residency(unique, num_unique, pin)

    def _blocks(self, n: int, total: int):
        """The pinned blocks for a plan of n ids whose transfer (plan.placed.xfer) holds total
        entries (the counts, n miss ids, then the dirty victims: at most n and the overflow
        slots): grown if too small, after the device is done with the old ones (rare: the first
        batches, a grow of the overflow slots)."""
        tier, blocks = self.tier, self._held.get("blocks")
        victims = total - plan_kernels.KINDS - n
        if blocks is None or blocks[0].shape[0] < victims or blocks[1].shape[0] < n or blocks[2].numel() < total:
            if blocks is not None:  # (never smaller than before: mixed batches would regrow them again and again)
                if tier.stream is not None:
                    tier.stream.synchronize()  # (queued moves and store calls read the old blocks)
                victims, n, total = (max(victims, blocks[0].shape[0]), max(n, blocks[1].shape[0]),
                                     max(total, blocks[2].numel()))
            pin = tier.device.type == "cuda"
            blocks = (torch.empty(victims, tier.width, pin_memory=pin), torch.empty(n, tier.width, pin_memory=pin),
                      torch.empty(total, dtype=torch.int64, pin_memory=pin))
            self.order_device = torch.arange(victims, device=tier.device)  # (victims: n and the overflow slots)
            self._held["blocks"] = blocks
        out, into, lists = blocks
        return out, into, lists[:total]

    def queued_work(self, unique: torch.Tensor, num_unique: torch.Tensor, pin: bool,
                    captured: bool = False) -> torch.Tensor:
        """A queued residency (see the module's steps) on the current stream, under index_lock:
        its slots. Raises a failed store call's error first."""
        if captured:
            raise ValueError("a residency over a log store reads it on the host: it cannot be captured as a CUDA graph")
        self.raise_error()
        tier = self.tier
        n = unique.numel()
        plan = tier.index.plan_queued(unique, num_unique, tier.num_embeddings)
        xfer = plan.placed.xfer
        out, into, lists = self._blocks(n, xfer.numel())
        fresh, dirty = plan_kernels.FRESH, plan_kernels.DIRTY
        moves.move_rows(tier.pool.rows, plan.dirty_slots, out, self.order_device[:plan.dirty_slots.numel()],
                        count=xfer[dirty:dirty + 1])
        lists.copy_(xfer, non_blocking=True)
        as_bytes = (out.view(torch.uint8), into.view(torch.uint8))
        if tier.stream is None:  # (CPU tensors: at once, on this thread)
            self.io.queue(None, lists, n, *as_bytes)
        else:
            with torch.cuda.device(tier.device):  # (the driver's call needs the device's context current)
                self.io.queue(torch.cuda.current_stream(tier.device).cuda_stream, lists, n, *as_bytes)
        self.queued_calls += 1
        moves.move_rows(into, self.order_device[:n], tier.pool.rows, plan.miss_slots, count=xfer[fresh:fresh + 1])
        try:  # (the misses' rows are in the victims' slots now: see DeviceTier.resident's failure)
            if tier.draws_misses:
                tier.draw_marked(plan, xfer[fresh:fresh + 1])
            tier.index.commit_queued(plan, pin)
        except BaseException:
            tier.index.forget(plan, xfer[fresh])
            raise
        return plan.slots

    def raise_error(self) -> None:
        """A failed store call's error (RuntimeError), if one failed: then, and after, every time."""
        error = self.io.error()
        if error:
            raise RuntimeError(f"tier 0's reads and writes of the log store below, queued on its stream: {error} "
                               "(tier 0 went on without them: drop the table)")

    def wait(self) -> None:
        """Waits for every store call queued so far (the tier's stream), then raises a failed one's
        error. Before the store is touched from here (DeviceTier._after_residencies)."""
        if self.tier.stream is not None:
            self.tier.stream.synchronize()
        self.raise_error()

    def close(self) -> None:
        """After the stream is past the queued calls, lets their blocks go (the table is closed)."""
        _after_the_stream(self.tier.stream, self._held)

    def settle(self) -> None:
        """What the store calls did, counted: the tier's bytes moved, the store's counters (after
        wait())."""
        counts = self.io.take_counts()
        tier = self.tier
        tier.bytes_in += counts["reads"] * tier.row_bytes
        tier.bytes_out += counts["rows_written"] * tier.row_bytes
        tier.lower.count_queued(counts)


def _after_the_stream(stream, held: dict) -> None:
    """A dropped StoreOnStream's last act: what its queued calls use let go once the stream is past them."""
    if stream is not None:
        stream.synchronize()
    held.clear()
