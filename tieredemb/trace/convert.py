"""Trace conversion: our format <-> FBGEMM request files (.pt), libCacheSim oracleGeneral, CSV,
.npy, and (trace -> log) DLRM locality logs. Formats are named by extension or explicitly.

Table sizes: formats that do not store them (pt, oracleGeneral, CSV, npy) take `rows` (an int
for every table, or one per table); without it a table's size is its largest id + 1.

CSV: a header line naming the columns batch, table, id (any order; table may be left out for
one table, batch may be left out when batch_size is given); without a header the columns are
batch,table,id. One lookup per line; a new batch starts wherever the batch value changes; ids
are local to their table (an int index). Export writes "batch,table,id" with batch indices.
npy: a 2-D int array [batches, lookups] (one row per batch) or a 1-D one cut into batches of
batch_size; one table. Export writes global keys: 2-D when every batch has the same length,
else 1-D.
"""

from __future__ import annotations

import itertools
import os

import numpy as np

from .format import TableInfo, TraceError, TraceHeader, TraceWriter, open_trace

FORMATS = ("trace", "pt", "oracle", "csv", "npy", "log")
_EXTENSIONS = {".trace": "trace", ".pt": "pt", ".oraclegeneral": "oracle", ".oraclegeneral.bin": "oracle",
               ".csv": "csv", ".npy": "npy", ".log": "log"}
_BLOCK = 1 << 20  # lookups per block when streaming a source file


def detect_format(path, given: str | None = None) -> str:
    """The format `given`, or the one named by the file's extension."""
    if given is not None:
        if given not in FORMATS:
            raise TraceError(f"unknown trace format {given!r} (known: {', '.join(FORMATS)})")
        return given
    name = os.fspath(path).lower()
    for ext, fmt in sorted(_EXTENSIONS.items(), key=lambda e: -len(e[0])):
        if name.endswith(ext):
            return fmt
    raise TraceError(f"{path}: cannot tell the format from the extension (known: "
                     f"{', '.join(sorted(_EXTENSIONS))}); name it with --from/--to")


def table_sizes(rows, max_ids: list[int], where: str) -> tuple[list[int], str]:
    """Each table's num_rows from `rows` (None, an int, or one per table) and the largest ids seen."""
    if rows is None:
        return [max(m + 1, 1) for m in max_ids], "largest id + 1"
    sizes = [int(rows)] * len(max_ids) if np.isscalar(rows) else [int(r) for r in rows]
    if len(sizes) != len(max_ids):
        raise TraceError(f"{where}: {len(sizes)} table sizes given for {len(max_ids)} tables")
    return sizes, "given"


def local_to_keys(header: TraceHeader, tables, ids, locate) -> np.ndarray:
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


class Batcher:
    """Cuts a stream of lookups into batches: a batch ends where the label changes."""

    def __init__(self, writer: TraceWriter):
        self.writer = writer
        self._labels = np.zeros(0, np.int64)
        self._keys = np.zeros(0, np.int64)

    def add(self, labels: np.ndarray, keys: np.ndarray) -> None:
        labels = np.concatenate([self._labels, labels])
        keys = np.concatenate([self._keys, keys])
        starts = np.flatnonzero(labels[1:] != labels[:-1]) + 1
        if starts.size:  # all but the last batch are complete
            self.writer.write_batches(keys[:starts[-1]], np.concatenate([[0], starts]))
            labels, keys = labels[starts[-1]:], keys[starts[-1]:]
        self._labels, self._keys = labels, keys

    def close(self) -> None:
        if self._keys.size:
            self.writer.write_batch(self._keys)
        self._labels = self._keys = np.zeros(0, np.int64)


def fixed_labels(start: int, n: int, batch_size: int | None, where: str) -> np.ndarray:
    """Batch labels of lookups start..start+n cut into batches of batch_size."""
    if batch_size is None or batch_size < 1:
        raise TraceError(f"{where}: batch size {batch_size} must be given and >= 1 (this input has no batches)")
    return (start + np.arange(n, dtype=np.int64)) // batch_size


# ---- CSV ----

def _csv_columns(path: str, first: str) -> tuple[dict[str, int], bool]:
    """Column index of batch / table / id, and whether the first line is a header."""
    cells = [c.strip().lower() for c in first.split(",")]
    if all(c.lstrip("-").isdigit() for c in cells):
        if len(cells) != 3:
            raise TraceError(f"{path}: line 1 has {len(cells)} columns; without a header the columns are batch,table,id")
        return {"batch": 0, "table": 1, "id": 2}, False
    unknown = [c for c in cells if c not in ("batch", "table", "id")]
    if unknown or "id" not in cells or len(set(cells)) != len(cells):
        raise TraceError(f"{path}: header {first.strip()!r} must name the columns batch, table, id "
                         f"(id required; unknown: {unknown})")
    return {c: i for i, c in enumerate(cells)}, True


def _csv_blocks(path: str):
    """Yields (first line number, int64 [n, columns], column map) blocks of the CSV file."""
    with open(path) as f:
        first = f.readline()
        if not first.strip():
            raise TraceError(f"{path}: empty CSV file")
        cols, header = _csv_columns(path, first)
        line = 2 if header else 1
        lines = itertools.chain([] if header else [first], f)
        while block := list(itertools.islice(lines, _BLOCK)):
            try:
                data = np.loadtxt(block, delimiter=",", dtype=np.int64, ndmin=2)
                if data.shape[1] != len(cols):
                    raise ValueError(f"{data.shape[1]} columns")
            except ValueError:
                for j, text in enumerate(block):
                    cells = text.split(",")
                    if len(cells) != len(cols) or not all(c.strip().lstrip("-").isdigit() for c in cells):
                        raise TraceError(f"{path}: line {line + j} ({text.strip()!r}) is not {len(cols)} "
                                         f"integers separated by commas") from None
                raise
            yield line, data, cols
            line += len(block)


def import_csv(src, dst, *, rows=None, batch_size: int | None = None, chunk_lookups: int = 1 << 20,
               progress: bool = False) -> TraceHeader:
    src = os.fspath(src)
    max_ids: list[int] = []
    for _, data, cols in _csv_blocks(src):  # first pass: how many tables, largest ids
        t = data[:, cols["table"]] if "table" in cols else np.zeros(len(data), np.int64)
        if t.size and t.min() < 0:
            raise TraceError(f"{src}: table index {int(t.min())} is negative")
        m = np.full(int(t.max()) + 1 if t.size else 0, -1, np.int64)
        np.maximum.at(m, t, data[:, cols["id"]])
        max_ids = [max(a, b) for a, b in itertools.zip_longest(max_ids, m.tolist(), fillvalue=-1)]
    sizes, how = table_sizes(rows, max_ids or [0], src)
    tables = [TableInfo(f"table{t}", r) for t, r in enumerate(sizes)]
    meta = {"source": os.path.basename(src), "format": "csv", "rows": how}
    with TraceWriter(dst, tables, chunk_lookups=chunk_lookups, meta=meta) as w:
        batcher, seen = Batcher(w), 0
        for line, data, cols in _csv_blocks(src):
            t = data[:, cols["table"]] if "table" in cols else 0
            keys = local_to_keys(w.header, t, data[:, cols["id"]], lambda i, line=line: f"{src}: line {line + i}")
            labels = data[:, cols["batch"]] if "batch" in cols else fixed_labels(seen, len(data), batch_size, src)
            batcher.add(labels, keys)
            seen += len(data)
        batcher.close()
    return w.header


def export_csv(src, dst, *, progress: bool = False) -> None:
    from tqdm import tqdm

    with open_trace(src) as r, open(dst, "w") as f:
        f.write("batch,table,id\n")
        base = r.header.table_base
        for c in tqdm(r.chunks(), total=None, desc="csv", unit="chunk", disable=not progress):
            batch = c.first_batch + np.repeat(np.arange(c.num_batches), np.diff(c.batch_offsets))
            t = r.header.table_of(c.keys)
            np.savetxt(f, np.stack([batch, t, c.keys - base[t]], axis=1), fmt="%d", delimiter=",")


# ---- npy ----

def import_npy(src, dst, *, rows=None, batch_size: int | None = None, chunk_lookups: int = 1 << 20,
               progress: bool = False) -> TraceHeader:
    src = os.fspath(src)
    try:
        a = np.load(src, mmap_mode="r")
    except (ValueError, OSError) as e:
        raise TraceError(f"{src}: not a .npy array ({e})") from None
    if a.dtype.kind not in "iu" or a.ndim not in (1, 2):
        raise TraceError(f"{src}: expected a 1-D or 2-D integer array, got {a.ndim}-D {a.dtype}")
    flat = a.reshape(-1)
    step = _BLOCK
    max_id = max((int(flat[i:i + step].max()) for i in range(0, flat.size, step)), default=-1)
    sizes, how = table_sizes(rows, [max_id], src)
    width = a.shape[1] if a.ndim == 2 else None
    meta = {"source": os.path.basename(src), "format": "npy", "rows": how}
    with TraceWriter(dst, [TableInfo("table0", sizes[0])], chunk_lookups=chunk_lookups, meta=meta) as w:
        batcher = Batcher(w)
        if width is not None:
            step = max(1, _BLOCK // max(width, 1)) * max(width, 1)
        for i in range(0, flat.size, step):
            ids = np.asarray(flat[i:i + step], dtype=np.int64)
            keys = local_to_keys(w.header, 0, ids, lambda j, i=i: f"{src}: element {i + j}")
            if width is None:
                batcher.add(fixed_labels(i, ids.size, batch_size, src), keys)
            else:
                batcher.add((i + np.arange(ids.size)) // width, keys)
        batcher.close()
        if width == 0:  # rows of zero lookups: empty batches
            w.write_batches(np.zeros(0, np.int64), np.zeros(a.shape[0] + 1, np.int64))
    return w.header


def export_npy(src, dst, *, progress: bool = False) -> None:
    with open_trace(src) as r:
        lengths = np.concatenate([np.diff(c.batch_offsets) for c in r.chunks()] or [np.zeros(0, np.int64)])
        equal = lengths.size > 0 and bool(np.all(lengths == lengths[0]))
        shape = (lengths.size, int(lengths[0])) if equal else (r.header.num_lookups,)
        out = np.lib.format.open_memmap(os.fspath(dst), mode="w+", dtype=np.int64, shape=shape)
        flat, at = out.reshape(-1), 0
        for c in r.chunks():
            flat[at:at + c.keys.size] = c.keys
            at += c.keys.size
        out.flush()
        del out


# ---- dispatch ----

def _importers():
    from . import fbgemm, oracle

    return {"csv": import_csv, "npy": import_npy, "pt": fbgemm.import_pt, "oracle": oracle.import_oracle}


def _exporters():
    from . import fbgemm, oracle

    return {"csv": export_csv, "npy": export_npy, "pt": fbgemm.export_pt, "oracle": oracle.export_oracle,
            "log": export_logs}


def export_logs(src, dst, *, progress: bool = False) -> list[str]:
    """One dlrm locality log per table: dst as given for one table, else dst with '{}' replaced by
    the table index (or _<index> inserted before the extension)."""
    from .locality import profile_trace, write_locality_log

    _, logs = profile_trace(src, progress=progress)
    dst = os.fspath(dst)
    if len(logs) == 1:
        paths = [dst]
    elif "{}" in dst:
        paths = [dst.replace("{}", str(t)) for t in range(len(logs))]
    else:
        stem, ext = os.path.splitext(dst)
        paths = [f"{stem}_{t}{ext}" for t in range(len(logs))]
    written = []
    for path, log in zip(paths, logs):
        if log is not None:
            write_locality_log(path, log)
            written.append(path)
    return written


def convert(src, dst, *, src_format: str | None = None, dst_format: str | None = None, progress: bool = False,
            **options):
    """Converts src to dst. One side must be our trace format; options go to the importer
    (rows, batch_size, chunk_lookups, num_tables, remap, ...) or the exporter (obj_size)."""
    a, b = detect_format(src, src_format), detect_format(dst, dst_format)
    if not os.path.exists(src):
        raise TraceError(f"{src}: no such file")
    if a == "trace" and b == "trace":
        raise TraceError(f"{src} and {dst} are both tieredemb traces: nothing to convert")
    if a == "trace":
        if b not in _exporters():
            raise TraceError(f"cannot export to {b!r}")
        return _exporters()[b](src, dst, progress=progress, **options)
    if b != "trace":
        raise TraceError(f"one side must be a tieredemb trace (.trace): got {a} -> {b}")
    if a == "log":
        raise TraceError(f"{src}: a locality log becomes a trace with `tieredemb trace synth --logs` "
                         f"(it needs a batch count and batch size)")
    return _importers()[a](src, dst, progress=progress, **options)
