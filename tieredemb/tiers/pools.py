"""Where a host cache tier keeps its rows: a pool of slots, and how rows cross between the pool
and the layer below it (a RowStore, whose blocks are host memory). (A tier 0 on a GPU keeps its
rows in gpu/tier.py's DeviceRows.)

HostPool: one float32 [slots, width] host tensor. The layer below reads into it and writes from it
in place (no staging copy); the native kernels read and update it directly. Slots are int64 [n]
CPU tensors; `rows` blocks are float32 [n, width].
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
    """A tier's slots as one host tensor."""

    kernels = "native"  # tier 0's lookup math on these rows (tieredemb/kernels.py)

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
