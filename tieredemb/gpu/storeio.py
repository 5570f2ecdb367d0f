"""Tier 0's reads and writes below, in stream order: a residency over a store (the log store, the
host store) queued with no wait for the device, as FBGEMM's SSD tier queues its key-value reads.

The waiting path (DeviceTier.resident) plans, waits for the plan's transfer, writes the dirty
victims down, reads the misses, and only then queues their copy to the device: a prefetch worker
spends each residency waiting or copying, and that bounds a table over SSD (ours-ssd10: about 7 ms
a batch of 164K ids on an H100, where the training step takes under 2). Here all of it is queued on
the tier's stream at once, and the host goes on to the next batch:

1. the plan, its counts left on the device (SetIndex.plan_queued);
2. the dirty victims' rows moved out of their slots into a pinned block (moves.move_rows, as many
   as the device counted), and the plan's lists copied into pinned memory;
3. a host call (gpu/hostfunc.py), run by the driver when the stream gets there: it reads the
   counts, writes the victims down (lower.write_from) and reads the misses into a second pinned
   block (lower.read_to; rows never stored left marked, for the device to draw);
4. the misses' rows moved from that block into their slots, the marked ones drawn, the commit.

Every user of the store waits for the host calls queued before it: DeviceTier._after_residencies
(which every read, write, flush and count of the table goes through, under the table's lock, as
every residency is) waits for the tier's stream. So the store still has one caller at a time.

The price: a failed write or read below is raised by the next residency or flush, and every one
after (HostCalls keeps it): by then the commit that followed it has run, so tier 0 holds rows that
were not read, and the table must be dropped (the waiting path leaves tier 0 as it was). And the
two pinned blocks, as large as a batch's ids (and the overflow slots) may be, for the table's life.

On for tables made while ON_STREAM is True (bench/bench_gpu.py's ours-ssd10-os): a measurement
switch, until a GPU says which way is faster.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from . import moves, plan_kernels
from .hostfunc import HostCalls
from .queued import QueuedResidency

ON_STREAM = False


class StoreOnStream(QueuedResidency):
    """A DeviceTier's residencies over the store right below it, with the store's reads and writes
    queued as host calls on the tier's stream (see above)."""

    def __init__(self, tier):
        super().__init__(tier)
        self.calls = HostCalls(tier.stream)
        self.blocks = None  # (rows out, rows in, the plan's lists): pinned on a GPU, grown as batches need
        self.order = torch.empty(0, dtype=torch.int64)  # 0, 1, ... on the host (the blocks' row numbers)
        self.order_device = torch.empty(0, dtype=torch.int64, device=tier.device)
        self.moved = [0, 0]  # rows read and written by the host calls since settle() last looked
        self._moved_lock = threading.Lock()

    def queues(self, check, allow_overflow: bool) -> bool:
        """As QueuedResidency's, allow_overflow aside: a batch is never refused for room, since
        _room grows the overflow slots to the ids pinned and this batch's (bounded by the batches a
        prefetcher holds, which makes its residencies with allow_overflow False: refused, they
        would all wait)."""
        return super().queues(check, True)

    def _blocks(self, n: int, total: int):
        """The pinned blocks for a plan of n ids whose transfer (plan.placed.xfer) holds total
        entries (the counts, n miss ids, then the dirty victims: at most n and the overflow
        slots): grown if too small, after the device is done with the old ones (rare: the first
        batches, a grow of the overflow slots)."""
        tier = self.tier
        victims = total - plan_kernels.KINDS - n
        if self.blocks is None or self.blocks[0].shape[0] < victims or self.blocks[1].shape[0] < n \
                or self.blocks[2].numel() < total:
            if self.blocks is not None and tier.stream is not None:
                tier.stream.synchronize()  # (queued moves and host calls read the old blocks)
            pin = tier.device.type == "cuda"
            self.blocks = (torch.empty(victims, tier.width, pin_memory=pin), torch.empty(n, tier.width, pin_memory=pin),
                           torch.empty(total, dtype=torch.int64, pin_memory=pin))
            self.order = torch.arange(victims)  # (victims >= n)
            self.order_device = self.order.to(tier.device)
        out, into, lists = self.blocks
        return out, into, lists[:total]

    def queued_work(self, unique: torch.Tensor, num_unique: torch.Tensor, pin: bool,
                    captured: bool = False) -> torch.Tensor:
        """A queued residency (see the module's steps) on the current stream, under index_lock:
        its slots. Raises a failed host call's error first (HostCalls)."""
        if captured:
            raise ValueError("a residency over a store reads it on the host: it cannot be captured as a CUDA graph")
        self.calls.raise_error()
        tier = self.tier
        n = unique.numel()
        plan = tier.index.plan_queued(unique, num_unique, tier.num_embeddings)
        xfer = plan.placed.xfer
        out, into, lists = self._blocks(n, xfer.numel())
        fresh, dirty = plan_kernels.FRESH, plan_kernels.DIRTY
        moves.move_rows(tier.pool.rows, plan.dirty_slots, out, self.order_device[:plan.dirty_slots.numel()],
                        count=xfer[dirty:dirty + 1])
        lists.copy_(xfer, non_blocking=True)
        self.calls.queue(lambda: self._below(n, out, into, lists))
        moves.move_rows(into, self.order_device[:n], tier.pool.rows, plan.miss_slots, count=xfer[fresh:fresh + 1])
        if tier.draws_misses:
            tier.draw_marked(plan, xfer[fresh:fresh + 1])
        tier.index.commit_queued(plan, pin)
        return plan.slots

    def _below(self, n: int, out: torch.Tensor, into: torch.Tensor, host: torch.Tensor) -> None:
        """The host call: the plan's dirty victims (rows out[0:D]) written down, then its misses
        read into into[0:F] (a lingering overflow row may be both: written first). No CUDA here."""
        tier, k = self.tier, plan_kernels.KINDS
        counts = host[:k].tolist()
        dirty, fresh = counts[plan_kernels.DIRTY], counts[plan_kernels.FRESH]
        if dirty:
            tier.lower.write_from(host[k + n:k + n + dirty], out, self.order[:dirty])
        if fresh:
            with tier.init.deferred() if tier.draws_misses else contextlib.nullcontext():
                tier.lower.read_to(host[k:k + fresh], into, self.order[:fresh])
        with self._moved_lock:
            self.moved[0] += fresh
            self.moved[1] += dirty

    def wait(self) -> None:
        """Waits for every host call queued so far (the tier's stream), then raises a failed one's
        error. Before the store is touched from here (DeviceTier._after_residencies)."""
        if self.tier.stream is not None:
            self.tier.stream.synchronize()
        self.calls.raise_error()

    def settle(self) -> None:
        """The rows the host calls moved, added to the tier's bytes moved (after wait())."""
        with self._moved_lock:
            (reads, wrote), self.moved = self.moved, [0, 0]
        self.tier.bytes_in += reads * self.tier.row_bytes
        self.tier.bytes_out += wrote * self.tier.row_bytes
