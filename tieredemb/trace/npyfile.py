""".npy traces: one table's ids, either a 2-D int array [batches, lookups] (one row per batch) or
a 1-D one cut into batches of a given batch size. Export writes global keys: 2-D when every batch
has the same length, else 1-D. Read through a memory map, a block at a time.
"""

from __future__ import annotations

import os

import numpy as np

from ..output import PendingFile
from .format import Chunk, TraceError, open_trace
from .source import (
    BLOCK,
    FileSource,
    fixed_labels,
    header_of,
    local_to_keys,
    need_batch_size,
    read_batched,
    table_sizes,
)


def read_npy(path, *, rows=None, batch_size: int | None = None) -> FileSource:
    """A .npy array as a trace of one table. rows: its size (None: the largest id + 1);
    batch_size: lookups per batch of a 1-D array (a 2-D array's rows are its batches)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic != b"\x93NUMPY":  # (np.load reads other files too: .npz archives, pickles)
        raise TraceError(f"{path}: not a .npy array: it starts with {magic!r}, a .npy file with b'\\x93NUMPY'")
    try:
        a = np.load(path, mmap_mode="r")
    except (ValueError, OSError) as e:
        raise TraceError(f"{path}: not a .npy array ({e})") from None
    if a.dtype.kind not in "iu" or a.ndim not in (1, 2):
        raise TraceError(f"{path}: expected a 1-D or 2-D integer array, got {a.ndim}-D {a.dtype}")
    width = a.shape[1] if a.ndim == 2 else None
    if width is not None and batch_size is not None:
        raise TraceError(f"{path}: a 2-D array's rows are its batches ({a.shape[0]} of {width} lookups); "
                         f"batch size {batch_size} does not apply")
    flat = a.reshape(-1)
    max_id = max((int(flat[i:i + BLOCK].max()) for i in range(0, flat.size, BLOCK)), default=-1)
    sizes, how = table_sizes(rows, [max_id], path)
    batches = a.shape[0] if width is not None else -(-flat.size // need_batch_size(batch_size, path))
    header = header_of(path, "npy", sizes, how, batches, flat.size)

    def ids(i: int, n: int) -> np.ndarray:
        return local_to_keys(header, 0, np.asarray(flat[i:i + n], dtype=np.int64), lambda j: f"{path}: element {i + j}")

    def rows_as_batches():
        if width == 0:  # rows of zero lookups: empty batches
            if batches:
                yield Chunk(np.zeros(0, np.int64), np.zeros(batches + 1, np.int64), 0)
            return
        step = max(1, BLOCK // width) * width
        for i in range(0, flat.size, step):
            keys = ids(i, step)
            yield Chunk(keys, np.arange(0, keys.size + 1, width, dtype=np.int64), i // width)

    def blocks():
        for i in range(0, flat.size, BLOCK):
            keys = ids(i, BLOCK)
            yield fixed_labels(i, keys.size, batch_size, path), keys

    return FileSource(path, header, rows_as_batches if width is not None else lambda: read_batched(blocks()))


def export_npy(src, dst, *, progress: bool = False) -> None:
    """Writes the trace at src as an int64 .npy of global keys (2-D when its batches are equal)."""
    with open_trace(src) as r:
        lengths = np.concatenate([np.diff(c.batch_offsets) for c in r.chunks()] or [np.zeros(0, np.int64)])
        equal = lengths.size > 0 and bool(np.all(lengths == lengths[0]))
        shape = (lengths.size, int(lengths[0])) if equal else (r.header.num_lookups,)
        with PendingFile(dst) as pending:
            out = np.lib.format.open_memmap(pending.temp, mode="w+", dtype=np.int64, shape=shape)
            flat, at = out.reshape(-1), 0
            for c in r.chunks():
                flat[at:at + c.keys.size] = c.keys
                at += c.keys.size
            out.flush()
            del out, flat
