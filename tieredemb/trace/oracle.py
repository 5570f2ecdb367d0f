"""libCacheSim's oracleGeneral binary trace: one 24-byte little-endian record per request,

    u32 clock_time, u64 obj_id, u32 obj_size, i64 next_access_vtime

next_access_vtime is the 1-based position of the next request for the same object, -1 if none
(what libCacheSim's traceConv writes). One lookup = one request.

Export: clock_time = batch index, obj_id = global key, obj_size = obj_size (default 1: caches
sized in rows), next_access_vtime computed in one backward pass over the trace (memory: one
entry per distinct key). Import: a new batch where clock_time changes, or batches of batch_size
requests; records of size 0 are skipped, as libCacheSim's reader does; one table, ids as they
are (table size: rows, or the largest id + 1) or, with remap, renumbered 0, 1, ... in order of
first use (for hashed 64-bit ids).
"""

from __future__ import annotations

import os

import numba
import numpy as np
from numba import types
from numba.typed import Dict

from .convert import Batcher, fixed_labels, table_sizes
from .format import TableInfo, TraceError, TraceHeader, TraceWriter, open_trace

RECORD = np.dtype([("time", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])
assert RECORD.itemsize == 24
_BLOCK = 1 << 20


def _blocks(path: str):
    """Yields (index of the first record, records) blocks; the size must be a multiple of 24."""
    size = os.path.getsize(path)
    if size % RECORD.itemsize:
        raise TraceError(f"{path}: truncated record at byte {size - size % RECORD.itemsize}: the file size "
                         f"{size} is not a multiple of {RECORD.itemsize} (oracleGeneral records)")
    with open(path, "rb") as f:
        first = 0
        while (rec := np.fromfile(f, dtype=RECORD, count=_BLOCK)).size:
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


def import_oracle(src, dst, *, rows=None, batch_size: int | None = None, remap: bool = False,
                  chunk_lookups: int = 1 << 20, progress: bool = False) -> TraceHeader:
    from tqdm import tqdm

    src = os.fspath(src)
    mapping = Dict.empty(types.int64, types.int64) if remap else None
    max_id, skipped = -1, 0
    for first, rec in _blocks(src):
        ids = rec["id"][rec["size"] > 0]
        skipped += rec.size - ids.size
        if remap:
            _first_use_ids(ids.view(np.int64), mapping)
        elif ids.size:
            big = ids >= np.uint64(2**63 - 1)
            if big.any():
                i = int(np.flatnonzero(rec["size"] > 0)[np.argmax(big)])
                raise TraceError(f"{src}: id {int(rec['id'][i])} of record {first + i} (byte {(first + i) * 24}) "
                                 f"does not fit a table (keys are int64); import with remap")
            max_id = max(max_id, int(ids.max()))
    sizes, how = table_sizes(rows, [len(mapping) - 1 if remap else max_id], src)
    meta = {"source": os.path.basename(src), "format": "oracle", "rows": how, "remap": remap,
            "skipped_size_zero": skipped}
    with TraceWriter(dst, [TableInfo("table0", sizes[0])], chunk_lookups=chunk_lookups, meta=meta) as w:
        batcher, seen = Batcher(w), 0
        for first, rec in tqdm(_blocks(src), desc="oracleGeneral", unit="block", disable=not progress):
            rec = rec[rec["size"] > 0]
            if remap:
                keys = np.empty(rec.size, np.int64)
                _apply(rec["id"].view(np.int64), mapping, keys)
            else:
                keys = rec["id"].astype(np.int64)
                if keys.size and keys.max() >= sizes[0]:
                    i = int(np.argmax(keys >= sizes[0]))
                    raise TraceError(f"{src}: id {int(keys[i])} of request {seen + i} out of range [0, {sizes[0]}) "
                                     f"(the table's rows)")
            labels = rec["time"].astype(np.int64) if batch_size is None else fixed_labels(seen, rec.size, batch_size, src)
            batcher.add(labels, keys)
            seen += rec.size
        batcher.close()
    return w.header


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
    rec.tofile(os.fspath(path))


def export_oracle(src, dst, *, obj_size: int = 1, progress: bool = False) -> None:
    from tqdm import tqdm

    _check_obj_size(obj_size)
    with open_trace(src) as r:
        n = r.header.num_lookups
        if r.header.num_batches >= 2**32:
            raise TraceError(f"{src}: {r.header.num_batches} batches do not fit oracleGeneral's u32 clock_time")
        with open(dst, "wb") as f:
            f.truncate(n * RECORD.itemsize)
        if n == 0:
            return
        out = np.memmap(dst, dtype=RECORD, mode="r+", shape=(n,))
        later = Dict.empty(types.int64, types.int64)
        end = n
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
        del out
