"""FBGEMM / dlrm_datasets request files: torch.save((indices, offsets, lengths)).

    indices: int [N]       ids local to their table
    offsets: int [T*B + 1] table-major bag boundaries: bag b of table t is
                           indices[offsets[t*B + b] : offsets[t*B + b + 1]]
    lengths: int [T, B]    bag sizes (optional in FBGEMM's reader: then T must be given)

One file is one request of B samples (FBGEMM's benchmarks replay it `iters` times). Reading cuts
the B samples into batches of batch_size samples (default: all B, one batch); a batch holds its
samples' ids table after table (ids of table t of samples s..s+k, then table t+1, ...); reading
needs torch (torch.load, memory-mapped). Export makes every trace batch one sample: lengths[t, b]
= lookups of table t in batch b, so indices come out table-major: a trace whose batches are
table-major (every imported one) comes back unchanged, and importing a file then exporting it
gives the same indices tensor (lengths summed over each batch's samples).
"""

from __future__ import annotations

import os

import numba
import numpy as np

from ..output import PendingFile
from .format import Chunk, TraceError, open_trace
from .source import BLOCK, FileSource, header_of, table_sizes


def _load(path: str):
    import torch

    open(path, "rb").close()  # (a missing or unreadable file: the OSError that says so)
    try:
        try:
            data = torch.load(path, weights_only=True, mmap=True)
        except RuntimeError:  # legacy (non-zip) files cannot be memory-mapped
            data = torch.load(path, weights_only=True)
    except Exception as e:  # torch.load of what is not a torch file fails in many ways (IndexError, KeyError, ...)
        raise TraceError(f"{path}: not an FBGEMM .pt request file: torch.load failed ({_first_line(e)})") from None
    if not isinstance(data, (tuple, list)) or len(data) < 2 or not all(isinstance(x, torch.Tensor) for x in data[:3]):
        raise TraceError(f"{path}: expected a tuple (indices, offsets[, lengths]) of tensors, got {type(data).__name__}")
    return [x.numpy() for x in data[:3]]


def _first_line(e: Exception) -> str:
    """The error's type and the line that says what failed (torch's weights_only errors run to a
    dozen lines of advice, the failure in the middle)."""
    text = str(e).split("WeightsUnpickler error:", 1)[-1]
    return f"{type(e).__name__}: {next((x.strip() for x in text.splitlines() if x.strip()), '')}"


@numba.njit(cache=True)
def _gather(indices, offsets, base, num_tables, samples, s0, s1, k, out, lengths):
    """Lookups of samples s0..s1, batch after batch of k samples, table after table inside a batch."""
    at = 0
    for nb, b0 in enumerate(range(s0, s1, k)):
        b1 = min(b0 + k, s1)
        start = at
        for t in range(num_tables):
            for p in range(offsets[t * samples + b0], offsets[t * samples + b1]):
                out[at] = indices[p] + base[t]
                at += 1
        lengths[nb] = at - start


def read_pt(path, *, rows=None, batch_size: int | None = None, num_tables: int | None = None) -> FileSource:
    """An FBGEMM request file as a trace: batch_size samples per batch (default all B: one batch);
    num_tables: T when the file has no lengths; rows: table sizes (None: largest id + 1 each)."""
    path = os.fspath(path)
    parts = _load(path)
    indices, offsets = parts[0].astype(np.int64, copy=False), parts[1].astype(np.int64, copy=False)
    if len(parts) > 2 and parts[2].ndim == 2:
        t_count, samples = parts[2].shape
        if num_tables is not None and num_tables != t_count:
            raise TraceError(f"{path}: its lengths tensor [T, B] holds {t_count} tables, not the {num_tables} given")
    elif num_tables:
        t_count, samples = num_tables, (offsets.size - 1) // max(num_tables, 1)
    else:
        raise TraceError(f"{path}: no 2-D lengths tensor [T, B]: give the number of tables (--tables, or num_tables=)")
    if offsets.ndim != 1 or offsets.size != t_count * samples + 1:
        raise TraceError(f"{path}: offsets has {offsets.size} entries, expected T*B + 1 = {t_count * samples + 1} "
                         f"(T = {t_count} tables, B = {samples} samples)")
    if np.any(np.diff(offsets) < 0) or offsets[0] < 0 or offsets[-1] > indices.size:
        raise TraceError(f"{path}: offsets must rise within [0, {indices.size}] (the indices)")
    max_ids = []
    for t in range(t_count):
        seg = indices[offsets[t * samples]:offsets[(t + 1) * samples]]
        if seg.size and seg.min() < 0:
            raise TraceError(f"{path}: id {int(seg.min())} of table {t} is negative (pruned ids are not lookups)")
        max_ids.append(int(seg.max()) if seg.size else -1)
    sizes, how = table_sizes(rows, max_ids, path)
    for t, (m, r) in enumerate(zip(max_ids, sizes)):
        if m >= r:
            raise TraceError(f"{path}: id {m} of table {t} out of range [0, {r})")
    k = samples if batch_size is None else batch_size
    if k < 1:
        raise TraceError(f"{path}: batch size {k} must be >= 1 sample")
    header = header_of(path, "pt", sizes, how, -(-samples // k), int(offsets[-1] - offsets[0]), samples_per_batch=k)

    def read():
        per_sample = max(1, (offsets[-1] - offsets[0]) // max(samples, 1))
        step = max(k, (BLOCK // max(per_sample, 1)) // k * k)  # samples per block, whole batches
        base = header.table_base
        for s0 in range(0, samples, step):
            s1 = min(s0 + step, samples)
            n = int(sum(offsets[t * samples + s1] - offsets[t * samples + s0] for t in range(t_count)))
            out = np.empty(n, np.int64)
            lengths = np.empty(-(-(s1 - s0) // k), np.int64)
            _gather(indices, offsets, base, t_count, samples, s0, s1, k, out, lengths)
            yield Chunk(out, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), s0 // k)

    return FileSource(path, header, read)


def export_pt(src, dst, *, progress: bool = False) -> None:
    """Writes (indices int64 [N], offsets int64 [T*B + 1], lengths int64 [T, B]) with B = batches."""
    import torch

    with open_trace(src) as r:
        c = r.read_all()
        header = r.header
    nb, nt = header.num_batches, len(header.tables)
    batch = np.repeat(np.arange(nb, dtype=np.int64), np.diff(c.batch_offsets))
    table = header.table_of(c.keys)
    bag = table * nb + batch
    order = np.argsort(bag, kind="stable")
    indices = (c.keys - header.table_base[table])[order]
    lengths = np.bincount(bag, minlength=nt * nb).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    with PendingFile(dst) as out:
        torch.save((torch.from_numpy(indices), torch.from_numpy(offsets), torch.from_numpy(lengths.reshape(nt, nb))),
                   out.temp)
