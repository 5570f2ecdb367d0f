"""What the readers of other formats share (csvfile, npyfile, oracle, fbgemm): table sizes, local
ids to global keys, cutting a stream of lookups into batches, and the TraceSource they return.

A reader makes one pass over its file when it opens (the header: tables, largest ids, counts)
and one more at each chunks() call (the keys), BLOCK lookups at a time: the file is never whole
in memory. Converting a file (tieredemb.trace.convert) writes exactly the chunks that reading it
gives, so a simulation of the file and of its conversion see the same batches.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import numpy as np

from .format import Chunk, TableInfo, TraceError, TraceHeader, TraceSource

BLOCK = 1 << 20  # lookups per block read from a source file


def table_sizes(rows, max_ids: list[int], where: str) -> tuple[list[int], str]:
    """Each table's num_rows from `rows` (None, an int, or one per table) and the largest ids seen;
    and how they were chosen ("given" or "largest id + 1", what a converted trace's meta says)."""
    if rows is None:
        sizes, how = [max(m + 1, 1) for m in max_ids], "largest id + 1"
    else:
        sizes, how = [int(rows)] * len(max_ids) if np.isscalar(rows) else [int(r) for r in rows], "given"
        if len(sizes) != len(max_ids):
            raise TraceError(f"{where}: {len(sizes)} table sizes given for {len(max_ids)} tables")
    total = 0
    for t, size in enumerate(sizes):
        if size < 1:
            raise TraceError(f"{where}: table {t}: rows must be >= 1, got {size}")
        total += size
        if total > 2**63 - 1:  # (keys, each table's first row's after the rows before it, are int64)
            named = f"largest id {max_ids[t]}" if how == "largest id + 1" else f"{size} rows"
            raise TraceError(f"{where}: table {t}'s {named} takes the tables' keys past int64 (at most 2**63 - 1 "
                             f"rows in all): renumber its ids 0, 1, ... (hashed 64-bit ids, say)")
    return sizes, how


def local_to_keys(header: TraceHeader, tables, ids, locate: Callable[[int], str]) -> np.ndarray:
    """header.keys(tables, ids), with the error prefixed by locate(i) of the first bad lookup."""
    try:
        return header.keys(tables, ids)
    except TraceError as e:
        ids = np.asarray(ids).ravel()
        t = np.broadcast_to(np.asarray(tables), ids.shape)
        nt = len(header.tables)
        rows = np.array([tb.num_rows for tb in header.tables])[np.clip(t, 0, nt - 1)]
        i = int(np.argmax((t < 0) | (t >= nt) | (ids < 0) | (ids >= rows)))
        raise TraceError(f"{locate(i)}: {e}") from None


def need_batch_size(batch_size: int | None, where: str) -> int:
    """batch_size, for an input that has no batches of its own; TraceError when missing or < 1."""
    if batch_size is None or batch_size < 1:
        raise TraceError(f"{where}: batch size {batch_size} must be given and >= 1 (this input has no batches: "
                         f"give the lookups per batch, batch_size or --batch-size)")
    return int(batch_size)


def fixed_labels(start: int, n: int, batch_size: int | None, where: str) -> np.ndarray:
    """Batch labels of lookups start..start+n cut into batches of batch_size lookups."""
    return (start + np.arange(n, dtype=np.int64)) // need_batch_size(batch_size, where)


class Batcher:
    """Cuts a stream of lookups into whole batches: a batch ends where the label changes (labels
    are compared across blocks too). Memory: the batch not yet complete."""

    def __init__(self):
        self._pending: list[np.ndarray] = []  # keys of the batch not yet complete
        self._label = None                    # its label
        self.batches = 0                      # batches returned so far

    def count(self, labels: np.ndarray) -> int:
        """Batches that these labels start (the first block's first label starts one)."""
        if labels.size == 0:
            return 0
        n = int(np.count_nonzero(labels[1:] != labels[:-1])) + (self._label is None or labels[0] != self._label)
        self._label = labels[-1]
        return n

    def add(self, labels: np.ndarray, keys: np.ndarray) -> Chunk | None:
        """The batches that this block completes, as a Chunk (None if it completes none)."""
        if labels.size == 0:
            return None
        starts = np.flatnonzero(labels[1:] != labels[:-1]) + 1
        if self._pending and labels[0] != self._label:
            starts = np.concatenate([[0], starts])
        self._label = labels[-1]
        if starts.size == 0:
            self._pending.append(keys)
            return None
        done = sum(p.size for p in self._pending)
        body = np.concatenate(self._pending + [keys[:starts[-1]]])
        offsets = np.concatenate([[0], done + starts])  # starts[0] == 0: the pending batch ends here
        return self._emit(body, offsets, [keys[starts[-1]:]])

    def close(self) -> Chunk | None:
        """The last batch (None if there is none)."""
        if not self._pending:
            return None
        body = np.concatenate(self._pending)
        return self._emit(body, np.array([0, body.size], np.int64), [])

    def _emit(self, body, offsets, pending) -> Chunk:
        chunk = Chunk(body.astype(np.int64, copy=False), offsets.astype(np.int64, copy=False), self.batches)
        self.batches += chunk.num_batches
        self._pending = pending
        return chunk


def read_batched(blocks: Iterator[tuple[np.ndarray, np.ndarray]]) -> Iterator[Chunk]:
    """Chunks of whole batches from (labels, keys) blocks (Batcher's rule)."""
    batcher = Batcher()
    for labels, keys in blocks:
        if (chunk := batcher.add(labels, keys)) is not None:
            yield chunk
    if (chunk := batcher.close()) is not None:
        yield chunk


class FileSource(TraceSource):
    """A file of another format read as a trace: `header` from the reader's first pass; chunks()
    calls read() for a new pass. A file that changed between passes raises TraceError."""

    def __init__(self, path: str, header: TraceHeader, read: Callable[[], Iterator[Chunk]]):
        self.path, self.header, self._read = path, header, read

    def chunks(self) -> Iterator[Chunk]:
        batches = lookups = 0
        for chunk in self._read():
            batches += chunk.num_batches
            lookups += chunk.keys.size
            yield chunk
        h = self.header
        if (batches, lookups) != (h.num_batches, h.num_lookups):
            raise TraceError(f"{self.path}: changed while it was read: {batches} batches and {lookups} lookups, "
                             f"the first pass found {h.num_batches} and {h.num_lookups}")


def header_of(path: str, fmt: str, sizes: list[int], how: str, num_batches: int, num_lookups: int,
              **meta) -> TraceHeader:
    """The header a reader declares: tables table0, table1, ... of `sizes` rows; meta names the
    source file, its format and how the sizes were chosen (and what `meta` adds)."""
    tables = [TableInfo(f"table{t}", r) for t, r in enumerate(sizes)]
    return TraceHeader(tables, num_batches, num_lookups,
                       {"source": os.path.basename(path), "format": fmt, "rows": how, **meta})
