"""CSV traces: one lookup per line, columns batch, table, id.

A header line names the columns (any order; table may be left out for one table, batch may be
left out when a batch size is given); without a header the columns are batch,table,id. A new
batch starts wherever the batch value changes; ids are local to their table (an int index).
Export writes "batch,table,id" with batch indices.
"""

from __future__ import annotations

import itertools
import os

import numpy as np

from ..output import PendingFile
from .format import TraceError, open_trace
from .source import BLOCK, Batcher, FileSource, fixed_labels, header_of, local_to_keys, read_batched, table_sizes

COLUMNS = ("batch", "table", "id")


def csv_columns(path: str, first: str) -> tuple[dict[str, int], bool]:
    """Column index of batch / table / id, and whether the first line is a header. Raises
    TraceError when `first` is neither a header naming those columns nor three integers."""
    cells = [c.strip().lower() for c in first.split(",")]
    if all(c.lstrip("-").isdigit() for c in cells):
        if len(cells) != 3:
            raise TraceError(f"{path}: line 1 has {len(cells)} columns; without a header the columns are batch,table,id")
        return {"batch": 0, "table": 1, "id": 2}, False
    unknown = [c for c in cells if c not in COLUMNS]
    if unknown or "id" not in cells or len(set(cells)) != len(cells):
        raise TraceError(f"{path}: header {first.strip()!r} must name the columns batch, table, id "
                         f"(id required; unknown: {unknown})")
    return {c: i for i, c in enumerate(cells)}, True


def _blocks(path: str):
    """Yields (first line number, int64 [n, columns], column map) blocks of the CSV file; raises
    TraceError for a file that is not text."""
    try:
        yield from _text_blocks(path)
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not a CSV of batch,table,id lines: it holds bytes that are not UTF-8 text "
                         f"({e.reason}: {e.object[e.start:e.start + 4]!r})") from None


def _text_blocks(path: str):
    with open(path, encoding="utf-8-sig") as f:  # (a byte-order mark, as Excel's "CSV UTF-8" has, left out)
        first = f.readline()
        if not first.strip():
            raise TraceError(f"{path}: empty CSV file")
        cols, header = csv_columns(path, first)
        line = 2 if header else 1
        lines = itertools.chain([] if header else [first], f)
        while block := list(itertools.islice(lines, BLOCK)):
            try:
                data = np.loadtxt(block, delimiter=",", dtype=np.int64, ndmin=2)
                if data.shape[1] != len(cols):
                    raise ValueError(f"{data.shape[1]} columns")
            except ValueError as e:
                for j, text in enumerate(block):
                    cells = text.split(",")
                    if len(cells) != len(cols) or not all(_int64(c) for c in cells):
                        raise TraceError(f"{path}: line {line + j} ({text.strip()!r}) is not {len(cols)} "
                                         f"integers (int64) separated by commas") from None
                raise TraceError(f"{path}: lines {line}-{line + len(block) - 1}: {e}") from None
            yield line, data, cols
            line += len(block)


def _int64(cell: str) -> bool:
    """Whether a cell reads as an int64 (as numpy's loadtxt reads it: signs and spaces allowed)."""
    try:
        return -2**63 <= int(cell) < 2**63
    except ValueError:
        return False


def _labels(data, cols, seen: int, batch_size, path: str) -> np.ndarray:
    return data[:, cols["batch"]] if "batch" in cols else fixed_labels(seen, len(data), batch_size, path)


def read_csv(path, *, rows=None, batch_size: int | None = None) -> FileSource:
    """A CSV file as a trace. rows: table sizes (None: each table's largest id + 1, an int for
    every table, or one per table); batch_size: lookups per batch when there is no batch column."""
    path = os.fspath(path)
    max_ids: list[int] = []
    counter, n, batches = Batcher(), 0, 0
    for _, data, cols in _blocks(path):  # first pass: tables, largest ids, batches
        t = data[:, cols["table"]] if "table" in cols else np.zeros(len(data), np.int64)
        if t.size and t.min() < 0:
            raise TraceError(f"{path}: table index {int(t.min())} is negative")
        m = np.full(int(t.max()) + 1 if t.size else 0, -1, np.int64)
        np.maximum.at(m, t, data[:, cols["id"]])
        max_ids = [max(a, b) for a, b in itertools.zip_longest(max_ids, m.tolist(), fillvalue=-1)]
        batches += counter.count(_labels(data, cols, n, batch_size, path))
        n += len(data)
    sizes, how = table_sizes(rows, max_ids or [0], path)
    header = header_of(path, "csv", sizes, how, batches, n)

    def blocks():
        seen = 0
        for line, data, cols in _blocks(path):
            t = data[:, cols["table"]] if "table" in cols else 0
            keys = local_to_keys(header, t, data[:, cols["id"]], lambda i, line=line: f"{path}: line {line + i}")
            yield _labels(data, cols, seen, batch_size, path), keys
            seen += len(data)

    return FileSource(path, header, lambda: read_batched(blocks()))


def export_csv(src, dst, *, progress: bool = False) -> None:
    """Writes the trace at src as "batch,table,id" lines (batch: its index in the trace); on an
    error dst stays as it was (tieredemb.output.PendingFile), as for every exporter."""
    from tqdm import tqdm

    with open_trace(src) as r, PendingFile(dst) as out, open(out.temp, "w") as f:
        f.write("batch,table,id\n")
        base = r.header.table_base
        for c in tqdm(r.chunks(), total=None, desc="csv", unit="chunk", disable=not progress):
            batch = c.first_batch + np.repeat(np.arange(c.num_batches), np.diff(c.batch_offsets))
            t = r.header.table_of(c.keys)
            np.savetxt(f, np.stack([batch, t, c.keys - base[t]], axis=1), fmt="%d", delimiter=",")
