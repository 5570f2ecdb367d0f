"""Where a cache tier keeps its rows: a pool of slots, and how rows cross between the pool and
the layer below it (a RowStore, whose blocks are host memory).

- HostPool: one float32 [slots, width] host tensor. The layer below reads into it and writes
  from it in place (no staging copy); the native kernels read and update it directly.
- DevicePool: a tier on a GPU. Slots [0, capacity) are a device tensor; overflow slots (see
  CacheIndex: slots that exist only while a batch in flight pins them) are host memory. Rows
  cross PCIe through pinned staging blocks on a side stream: it waits for the compute stream
  before touching the pool (a slot's old row may still be read by queued kernels), and the
  compute stream waits for it before the next kernel reads the pool.

Slots are int64 [n] CPU tensors; `rows` blocks are float32 [n, width].
"""

from __future__ import annotations

import os

import numpy as np
import torch

from .. import _C


def arange(n: int) -> torch.Tensor:
    """0..n-1 as int64, made by numpy: torch's intra-op threads make even this cost
    milliseconds on a busy 2-core machine, in a path taken several times per batch."""
    return torch.from_numpy(np.arange(n, dtype=np.int64))


def reserve_host_rows(rows: int, width: int, *, populate_rows: int) -> torch.Tensor:
    """A zero float32 [rows, width] host tensor, reserved lazily (O(1) to create) except its first
    populate_rows rows, faulted in now (a bounded cache fills up anyway). Rows that fit in half
    the machine's memory use huge pages (measured: forward and backward about 1.4x faster on
    random rows); beyond that, 4 KiB pages, so a sparsely used huge table costs memory only for
    the rows it holds."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    huge = rows if rows * width * 4 <= total // 2 else populate_rows
    return torch.from_numpy(_C.host_pool(rows, width, populate_rows=populate_rows, huge_pages_rows=huge))


class HostPool:
    """A tier's slots as one host tensor (pinned when a GPU tier sits above it)."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows  # float32 [slots, width], CPU, contiguous
        self.width = rows.shape[1]
        self.device = rows.device

    def fill_from(self, lower, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """The rows of ids, read from lower, into slots."""
        lower.read_to(ids, self.rows, slots)

    def drain_to(self, lower, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """The rows in slots, written to lower as the rows of ids."""
        lower.write_from(ids, self.rows, slots)

    def copy_out(self, slots: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
        _C.copy_rows(self.rows, slots, dst, dst_rows)

    def copy_in(self, slots: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor) -> None:
        _C.copy_rows(src, src_rows, self.rows, slots)

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows in slots, as a new [n, width] tensor on the pool's device."""
        out = torch.empty(len(slots), self.width, dtype=torch.float32)
        _C.copy_rows(self.rows, slots, out, arange(len(slots)))
        return out

    def scatter(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """rows [n, width] (on the pool's device) into slots."""
        _C.copy_rows(rows.contiguous(), arange(len(slots)), self.rows, slots)


class DevicePool:
    """A GPU tier's slots: capacity rows on the device, overflow slots in host memory."""

    def __init__(self, rows: torch.Tensor, overflow: torch.Tensor | None):
        self.rows = rows  # float32 [capacity, width] on a CUDA device
        self.overflow = overflow  # float32 [overflow_limit, width] host, lazily reserved; or None
        self.capacity = rows.shape[0]
        self.width = rows.shape[1]
        self.device = rows.device
        self._side = None

    def _split(self, slots: torch.Tensor):
        """(positions and slots in the device part, positions and rows of the host overflow)."""
        s = slots.numpy()
        over = s >= self.capacity
        if not over.any():
            return None
        return (torch.from_numpy(np.flatnonzero(~over)), torch.from_numpy(s[~over]),
                torch.from_numpy(np.flatnonzero(over)), torch.from_numpy(s[over] - self.capacity))

    def _side_stream(self):
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows in slots, as a new [n, width] tensor on the device."""
        parts = self._split(slots)
        if parts is None:
            return self.rows.index_select(0, slots.to(self.device))
        at_dev, dev_slots, at_host, host_rows = parts
        out = torch.empty(len(slots), self.width, dtype=torch.float32, device=self.device)
        out.index_copy_(0, at_dev.to(self.device), self.rows.index_select(0, dev_slots.to(self.device)))
        block = torch.empty(len(host_rows), self.width, dtype=torch.float32)
        _C.copy_rows(self.overflow, host_rows, block, arange(len(host_rows)))
        out.index_copy_(0, at_host.to(self.device), block.to(self.device))
        return out

    def scatter(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """rows [n, width] (on the device) into slots."""
        parts = self._split(slots)
        if parts is None:
            self.rows.index_copy_(0, slots.to(self.device), rows)
            return
        at_dev, dev_slots, at_host, host_rows = parts
        self.rows.index_copy_(0, dev_slots.to(self.device), rows.index_select(0, at_dev.to(self.device)))
        block = rows.index_select(0, at_host.to(self.device)).cpu()
        _C.copy_rows(block, arange(len(host_rows)), self.overflow, host_rows)

    def _to_host(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows in slots in a pinned host block (complete when this returns)."""
        side = self._side_stream()
        side.wait_stream(torch.cuda.current_stream(self.device))
        staging = torch.empty(len(slots), self.width, dtype=torch.float32, pin_memory=True)
        with torch.cuda.stream(side):
            staging.copy_(self.gather(slots), non_blocking=True)
        side.synchronize()
        return staging

    def _from_host(self, slots: torch.Tensor, block: torch.Tensor) -> None:
        """block (pinned host rows) into slots, ordered before the next kernel on the compute stream."""
        main, side = torch.cuda.current_stream(self.device), self._side_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self.scatter(slots, block.to(self.device, non_blocking=True))
        main.wait_stream(side)

    def fill_from(self, lower, ids: torch.Tensor, slots: torch.Tensor) -> None:
        staging = torch.empty(len(ids), self.width, dtype=torch.float32, pin_memory=True)
        lower.read_to(ids, staging, arange(len(ids)))
        self._from_host(slots, staging)

    def drain_to(self, lower, ids: torch.Tensor, slots: torch.Tensor) -> None:
        lower.write_from(ids, self._to_host(slots), arange(len(ids)))

    def copy_out(self, slots: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
        _C.copy_rows(self._to_host(slots), arange(len(slots)), dst, dst_rows)

    def copy_in(self, slots: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor) -> None:
        block = torch.empty(len(slots), self.width, dtype=torch.float32, pin_memory=True)
        _C.copy_rows(src, src_rows, block, arange(len(slots)))
        self._from_host(slots, block)
