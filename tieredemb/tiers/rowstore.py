"""The one interface below every tier: what a tier sees of the layer under it.

Whatever sits below a cache tier implements it: the host cache (tiers/cache.py), the dense host
store (tiers/host_store.py), and each SSD store (ssd_backend). A tier reaches the layer below
only through these methods.

Conventions (every method):
- A row is `width` float32 values: embedding_dim weights ‖ optimizer state (see optim.py).
- ids: int64 [n] CPU tensor, unique within a call, each in [0, num_embeddings).
- Blocks (dst, src) are float32 [rows, width] contiguous CPU tensors (a cache tier's pool or a
  staging block, pinned or not); dst_rows / src_rows: int64 [n] row numbers into them.
- A row never written reads as the table's initial value: a function of (seed, row id).
- A call that raises leaves every value as it was (a store that cannot promise this for a
  failed write says so: see StoreWriteError in ssd_backend).
- Threading: one caller at a time (the table's store lock serializes them).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from .. import _C


@runtime_checkable
class RowStore(Protocol):
    width: int
    state: dict  # the record last given to flush(state) (as stored: reopening restores it); {} when new

    def read_to(self, ids: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
        """Current rows of ids into dst[dst_rows], including writes still queued.
        Changes no value; a cache may keep what it read."""

    def write_from(self, ids: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor) -> None:
        """Takes src[src_rows] as the new rows of ids (they may be queued; a later read sees them).
        The caller may reuse src as soon as this returns."""

    def flush(self, state: dict | None = None) -> None:
        """Returns when every write made before it is durable (for a volatile store: readable).
        state: the table's small mutable record (e.g. the step count), stored atomically with it."""

    def checkpoint(self, path: str) -> None:
        """Flushes, then writes a consistent snapshot to the new directory path, which opens as a
        table. A store that cannot (volatile memory) raises RuntimeError naming the alternative."""

    def written_ids(self, start: int = 0, limit: int | None = None) -> torch.Tensor:
        """Sorted int64 ids >= start of rows ever written (queued writes included), at most limit.
        Rows not listed read as their initial values."""

    def stats(self) -> dict:
        """Counters of this layer (reads, writes, bytes, hits ...), JSON-able."""

    def close(self) -> None:
        """Flushes and releases the layer's resources (files, locks). Safe to call twice."""


# The mark of a row left for its reader to draw (RowInit.deferred): this float32 NaN in column 0.
# Arithmetic never makes it (its NaNs carry no payload, or an operand's), so no stored row holds it
# unless written so on purpose.
DEFERRED_MARK = 0x7FA55A5A


class RowInit:
    """The table's initial rows: a function of (seed, row id) only, optimizer state zero.
    Every store gets one for the rows it never stored."""

    def __init__(self, dim: int, kind: int, a: float, b: float, seed: int, zero_id: int, weights: int = 0):
        self.args = (dim, kind, a, b, seed, zero_id)  # as the native and Triton init take them
        self.weights = weights  # the weights' type code (optim.WEIGHT_TYPES): drawn in float32, then rounded
        self._local = threading.local()

    def __call__(self, ids: torch.Tensor, out: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """ids int64 [n] -> their initial rows in out float32 [n, width], or in out[rows] (no
        temporary). Inside deferred() (on this thread): only marked, column 0 = DEFERRED_MARK."""
        if not len(ids):
            return
        if self.is_deferred():
            marks = out.view(torch.int32)
            marks[slice(None) if rows is None else rows, 0] = DEFERRED_MARK
        elif rows is None:
            _C.init_rows(ids, out, *self.args, weights=self.weights)
        else:
            self.read_or_init(out, torch.from_numpy(np.full(len(ids), -1, dtype=np.int64)), ids, out, rows)

    def read_or_init(self, src, src_rows, ids, dst, dst_rows) -> int:
        """dst[dst_rows[i]] = src[src_rows[i]], or the initial row of ids[i] where src_rows[i] < 0
        (drawn here, even inside deferred()). Returns the rows copied."""
        return _C.read_or_init(src, src_rows, ids, dst, dst_rows, *self.args, weights=self.weights)

    def is_deferred(self) -> bool:
        return getattr(self._local, "deferred", False)

    @contextlib.contextmanager
    def deferred(self):
        """Within (on the calling thread), the rows a store initializes are marked instead of drawn:
        a device tier reading its misses draws them itself, on the device (gpu/rowinit.py)."""
        self._local.deferred = True
        try:
            yield
        finally:
            self._local.deferred = False
