"""libCacheSim's oracleGeneral binary trace: one 24-byte little-endian record per request,

    u32 clock_time, u64 obj_id, u32 obj_size, i64 next_access_vtime

next_access_vtime is the 1-based position of the next request for the same object, -1 if none
(what libCacheSim's traceConv writes). One lookup = one request.

Recognized by content (looks_like_oracle), whatever the file is named: libCacheSim's own traces
are named *.oracleGeneral.bin.

Export: clock_time = batch index, obj_id = global key, obj_size = obj_size (default 1: caches
sized in rows), next_access_vtime computed in one backward pass over the trace (memory: one
entry per distinct key). Read (read_oracle; importing = reading, then writing a .trace): a new
batch where clock_time changes, or batches of batch_size requests; records of size 0 are skipped,
as libCacheSim's reader does; one table, ids as they are (table size: rows, or the largest id + 1)
or, with remap, renumbered 0, 1, ... in order of first use (for hashed 64-bit ids).
"""

from __future__ import annotations

import os

import numba
import numpy as np
from numba import types
from numba.typed import Dict

from ..output import PendingFile
from .format import TraceError, open_trace
from .source import BLOCK, Batcher, FileSource, fixed_labels, header_of, read_batched, table_sizes

RECORD = np.dtype([("time", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])
assert RECORD.itemsize == 24


def _blocks(path: str):
    """Yields (index of the first record, records) blocks; the size must be a multiple of 24."""
    size = os.path.getsize(path)
    if size % RECORD.itemsize:
        raise TraceError(f"{path}: truncated record at byte {size - size % RECORD.itemsize}: the file size "
                         f"{size} is not a multiple of {RECORD.itemsize} (oracleGeneral records)")
    with open(path, "rb") as f:
        first = 0
        while (rec := np.fromfile(f, dtype=RECORD, count=BLOCK)).size:
            yield first, rec
            first += rec.size


@numba.njit(cache=True)
def _first_use_ids(ids, mapping):
    for k in ids:
        if k not in mapping:
            mapping[k] = len(mapping)


@numba.njit(cache=True)
def _apply(ids, mapping, out):
    for i in range(ids.size):
        out[i] = mapping[ids[i]]


def read_oracle(path, *, rows=None, batch_size: int | None = None, remap: bool = False) -> FileSource:
    """An oracleGeneral file as a trace of one table (see the module docstring): batches by
    clock_time, or of batch_size requests; rows: the table size (None: the largest id + 1, or with
    remap the number of distinct ids)."""
    path = os.fspath(path)
    mapping = Dict.empty(types.int64, types.int64) if remap else None
    max_id, skipped, n, batches, counter = -1, 0, 0, 0, Batcher()
    for first, block in _blocks(path):  # first pass: ids, counts
        rec, where = _requests(block)
        ids = rec["id"]
        skipped += block.size - rec.size
        if remap:
            _first_use_ids(ids.view(np.int64), mapping)
        elif ids.size:
            big = ids >= np.uint64(2**63 - 1)
            if big.any():
                i = int(where(np.argmax(big)))
                raise TraceError(f"{path}: id {int(block['id'][i])} of record {first + i} (byte {(first + i) * 24}) "
                                 f"does not fit a table (keys are int64); read it with remap (--remap)")
            max_id = max(max_id, int(ids.max()))
        batches += counter.count(_labels(rec, n, batch_size, path))
        n += ids.size
    sizes, how = table_sizes(rows, [len(mapping) - 1 if remap else max_id], path)
    if remap and rows is None:  # (renumbered 0, 1, ...: their largest + 1 is their count)
        how = "distinct ids (remapped)"
    if remap and len(mapping) > sizes[0]:  # (the ids read without it are checked as they are read)
        raise TraceError(f"{path}: {len(mapping)} distinct ids, renumbered 0..{len(mapping) - 1} (remap), do not "
                         f"fit the table's {sizes[0]} rows given")
    header = header_of(path, "oracle", sizes, how, batches, n, remap=remap, skipped_size_zero=skipped)

    def blocks():
        seen = 0
        for _, block in _blocks(path):
            rec, _ = _requests(block)
            if remap:
                keys = np.empty(rec.size, np.int64)
                _apply(rec["id"].view(np.int64), mapping, keys)
            else:
                keys = rec["id"].astype(np.int64)
                if keys.size and keys.max() >= sizes[0]:
                    i = int(np.argmax(keys >= sizes[0]))
                    raise TraceError(f"{path}: id {int(keys[i])} of request {seen + i} out of range [0, {sizes[0]}) "
                                     f"(the table's rows)")
            yield _labels(rec, seen, batch_size, path), keys
            seen += rec.size

    return FileSource(path, header, lambda: read_batched(blocks()))


def _requests(block: np.ndarray):
    """The records of a block that are requests (size > 0, as libCacheSim reads them; the block
    itself when all are), and a function from an index among them to the index in the block."""
    kept = block["size"] > 0
    if kept.all():
        return block, lambda i: i
    return block[kept], lambda i: np.flatnonzero(kept)[i]


def _labels(rec, seen: int, batch_size: int | None, path: str) -> np.ndarray:
    """A batch per clock_time, or batches of batch_size requests."""
    return rec["time"].astype(np.int64) if batch_size is None else fixed_labels(seen, rec.size, batch_size, path)


def looks_like_oracle(head: bytes, size: int) -> bool:
    """Whether a file of `size` bytes starting with `head` reads as oracleGeneral records: the
    size is a whole number of records, clock_time never goes back in `head`, and every
    next_access_vtime there is -1 (or INT64_MAX) or points forward to a request for the same object
    when that request is in `head` too."""
    if size == 0 or size % RECORD.itemsize:
        return False
    rec = np.frombuffer(head[:len(head) - len(head) % RECORD.itemsize], RECORD)
    if rec.size == 0:
        return False
    if np.any(np.diff(rec["time"].astype(np.int64)) < 0):  # (a trace's clock does not go back)
        return False
    pos = np.arange(1, rec.size + 1)  # 1-based, as next_access_vtime counts
    nxt = rec["next"]
    none = (nxt == -1) | (nxt == np.iinfo(np.int64).max)
    if np.any(~none & (nxt <= pos)):
        return False
    inside = ~none & (nxt <= rec.size)
    return bool(np.all(rec["id"][nxt[inside] - 1] == rec["id"][inside]))


@numba.njit(cache=True)
def _next_access(keys, start, later, out):
    """out[i] = 1-based position of the next use of keys[i] (-1 if none); later maps a key to
    the 1-based position of its earliest use after this chunk, and is updated to this chunk."""
    for i in range(keys.size - 1, -1, -1):
        k = keys[i]
        out[i] = later.get(k, -1)
        later[k] = start + i + 1


def _check_obj_size(obj_size: int) -> None:
    if not 0 < obj_size < 2**32:
        raise TraceError(f"obj_size {obj_size} must lie in [1, 2**32)")


def write_keys(path, keys, *, obj_size: int = 1) -> None:
    """Writes an in-memory key sequence as oracleGeneral, one request per key (clock_time = its
    position): what export_oracle writes for a trace of one-lookup batches, without the trace."""
    _check_obj_size(obj_size)
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    n = keys.size
    if n >= 2**32:
        raise TraceError(f"{n} requests do not fit oracleGeneral's u32 clock_time")
    if n and keys.min() < 0:
        raise TraceError(f"key {int(keys.min())} is negative (oracleGeneral ids are unsigned)")
    nxt = np.empty(n, np.int64)
    _next_access(keys, 0, Dict.empty(types.int64, types.int64), nxt)
    rec = np.zeros(n, RECORD)
    rec["time"] = np.arange(n)
    rec["id"] = keys
    rec["size"] = obj_size
    rec["next"] = nxt
    with PendingFile(path) as out:
        rec.tofile(out.temp)


def export_oracle(src, dst, *, obj_size: int = 1, progress: bool = False) -> None:
    _check_obj_size(obj_size)
    with open_trace(src) as r:
        n = r.header.num_lookups
        if r.header.num_batches >= 2**32:
            raise TraceError(f"{src}: {r.header.num_batches} batches do not fit oracleGeneral's u32 clock_time")
        with PendingFile(dst) as pending:
            with open(pending.temp, "wb") as f:
                f.truncate(n * RECORD.itemsize)
            if n:
                _fill_oracle(r, np.memmap(pending.temp, dtype=RECORD, mode="r+", shape=(n,)), obj_size, progress)


def _fill_oracle(r, out: np.memmap, obj_size: int, progress: bool) -> None:
    """Writes the records of the trace r reads into out, last chunk first (next_access_vtime)."""
    from tqdm import tqdm

    later = Dict.empty(types.int64, types.int64)
    end = out.size
    for c in tqdm(r.chunks(reverse=True), desc="oracleGeneral", unit="chunk", disable=not progress):
        start = end - c.keys.size
        nxt = np.empty(c.keys.size, np.int64)
        _next_access(c.keys, start, later, nxt)
        block = out[start:end]
        block["time"] = c.first_batch + np.repeat(np.arange(c.num_batches), np.diff(c.batch_offsets))
        block["id"] = c.keys
        block["size"] = obj_size
        block["next"] = nxt
        end = start
    out.flush()
