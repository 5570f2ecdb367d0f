"""The backing-store interface: the lowest tier, which holds every row ever written.

A row is a float32 vector of `width` = embedding_dim + optimizer-state floats
(weights ‖ state, see optim.py). A row never written reads as `initializer(ids, out)`:
a deterministic function of (seed, row id), so a store never has to hold unwritten rows.

Contract shared by every implementation (dense host array, SSD):
- ids are int64 [n] on the CPU, unique within a call; rows are float32 [n, width], contiguous, CPU.
- write() may queue; a later read() sees every write made before it (read-your-writes). It
  keeps no reference to rows: the caller reuses that buffer as soon as write() returns.
- flush() returns only when every write made before it is durable (for a volatile store:
  visible to read()).
- A call that raises changes nothing that read() can see.
- Optional, for a host tier above the store to move rows without a staging block:
  read_to(ids, dst, dst_rows) reads into dst[dst_rows] and write_from(ids, src, src_rows) stores
  src[src_rows] (dst, src: float32 host pools). The native SSD stores have them.
"""

from __future__ import annotations

import abc
from typing import Callable

import torch

# initializer(ids int64 [n], out float32 [n, width]) fills out with the rows' initial values.
Initializer = Callable[[torch.Tensor, torch.Tensor], None]


class BackingStore(abc.ABC):
    width: int

    @abc.abstractmethod
    def read(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """ids: int64 [n]; out: float32 [n, width]. Fills out with the current rows."""

    @abc.abstractmethod
    def write(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """ids: int64 [n]; rows: float32 [n, width]. Stores the rows (may be queued)."""

    @abc.abstractmethod
    def flush(self) -> None:
        """Returns when every write made before the call is durable."""

    def close(self) -> None:
        """Flushes and releases resources. The store is unusable afterwards."""
        self.flush()

    def stats(self) -> dict:
        """Counters of this store (reads, writes, bytes ...); implementation-defined keys."""
        return {}

    def written_ids(self, start: int = 0, limit: int | None = None) -> torch.Tensor:
        """Sorted int64 ids of rows ever written with id >= start, at most `limit` of them.

        Used by the chunked export; rows not listed read as their initial values."""
        raise NotImplementedError(f"{type(self).__name__} cannot list its rows")
