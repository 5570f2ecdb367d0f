"""HostStore: the bottom layer of a table with no SSD store, every row in host memory.

One float32 [num_embeddings, width] array, reserved lazily (O(1) to create whatever the table's
size: a page becomes memory when a row on it is first written), and a bit per row saying it was
written (a DirectIndex: its dirty bit). A row never written reads as the table's initial value.
When tier 0 holds the whole table on the CPU it shares this array (no second copy): tier 0 then
reads a row into the very place it already is, which only initializes rows never written.

Zero-copy (a GPU tier 0 with zero_copy): tier 0 pins the array and maps it into the GPU, and its
kernels read their misses from it and write their dirty victims into it (gpu/moves.py). The tier
keeps a copy of the written bits on the device for its kernels, and tells this store of the rows it
wrote and read (wrote_in_place, count_moved) before anything here is read.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import _C
from .pools import reserve_host_rows
from .rowstore import RowInit


class HostStore:
    name = "store"

    def __init__(self, num_embeddings: int, width: int, init: RowInit):
        self.width = width
        self.init = init
        self.rows = reserve_host_rows(num_embeddings, width, populate_rows=0)
        self.index = _C.DirectIndex(num_embeddings)  # a row is resident and dirty once written
        self.state: dict = {}
        self.reads = self.rows_found = self.rows_written = 0

    def read_to(self, ids: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
        # (numpy, not torch, for the masks: torch's intra-op threads cost milliseconds per batch
        # on a busy 2-core machine, measured.)
        found = self.locate(ids)  # the row's place here, or -1
        shared = dst.data_ptr() == self.rows.data_ptr()  # tier 0 holds the table in these rows (dst_rows == ids)
        if not shared and not self.init.is_deferred():
            self.init.read_or_init(self.rows, found, ids, dst, dst_rows)
            return
        found = found.numpy()
        fresh = found < 0
        if not shared:  # deferred: the stored rows copied, the others marked for the reader to draw
            here = ~fresh
            _C.copy_rows(self.rows, torch.from_numpy(found[here]), dst, torch.from_numpy(dst_rows.numpy()[here]))
        at = np.flatnonzero(fresh)
        if len(at) == len(ids):  # (the usual case: tier 0 reads the rows it never held)
            self.init(ids, dst, dst_rows)
        else:
            self.init(torch.from_numpy(ids.numpy()[at]), dst, torch.from_numpy(dst_rows.numpy()[at]))

    def write_from(self, ids: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor) -> None:
        if src.data_ptr() != self.rows.data_ptr():  # else the rows are in place already
            _C.copy_rows(src, src_rows, self.rows, ids)
        self.wrote_in_place(ids)

    # -- where rows are, rows written in place (also for a zero-copy GPU tier 0, which moves them) --
    def locate(self, ids: torch.Tensor) -> torch.Tensor:
        """Where the rows of ids are in the rows (int64 [n] host: the id itself), -1 for a row never
        written (it reads as its initial value); counted as reads (read_to's, and a zero-copy
        tier 0's, which reads the rows itself)."""
        found = self.index.lookup(ids)
        self.reads += len(ids)
        self.rows_found += int(np.count_nonzero(found >= 0))
        return torch.from_numpy(found)

    def wrote_in_place(self, ids: torch.Tensor, *, count: bool = True) -> None:
        """The rows of ids were written into the rows in place (by write_from, or by a GPU tier 0
        that mapped the rows): they now read as written. count: add them to rows_written (a
        zero-copy tier 0 counts its writes itself: count_moved)."""
        plan = self.index.plan(ids)
        self.index.commit(ids, plan, False, True)
        if count:
            self.rows_written += len(ids)

    def count_moved(self, reads: int, found: int, written: int) -> None:
        """Rows a zero-copy tier 0 read from the rows (found of them ever written) and wrote into
        them, counted as locate and write_from count theirs."""
        self.reads += reads
        self.rows_found += found
        self.rows_written += written

    def flush(self, state: dict | None = None) -> None:
        if state is not None:
            self.state = dict(state)

    def checkpoint(self, path: str) -> None:
        raise RuntimeError(f"cannot checkpoint to {path}: this table keeps its rows in host memory; "
                           "use export_rows(dir), or give the table an ssd_path")

    def written_ids(self, start: int = 0, limit: int | None = None) -> torch.Tensor:
        return torch.from_numpy(self.index.dirty_ids(start, -1 if limit is None else limit))

    def stats(self) -> dict:
        """reads: rows read; rows_found: of them, rows ever written (the rest were initialized);
        rows_written: rows written; rows_stored: distinct rows ever written. (The SSD stores
        count the same under the same names.)"""
        return {"reads": self.reads, "rows_found": self.rows_found, "rows_written": self.rows_written,
                "rows_stored": self.index.size, "hit_rate": self.rows_found / self.reads if self.reads else 0.0}

    def reset_stats(self) -> None:
        self.reads = self.rows_found = self.rows_written = 0

    def close(self) -> None:
        pass
