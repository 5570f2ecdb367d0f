"""Trace conversion: our format <-> FBGEMM request files (.pt), libCacheSim oracleGeneral, CSV,
.npy, and (trace -> log) DLRM locality logs.

Importing a file is reading it (detect.open_any: the format from its content, each reader's
options) and writing what it reads into a .trace, so a file and its conversion give the same
batches to every tool. Table sizes: formats that do not store them (pt, oracleGeneral, CSV, npy)
take `rows` (an int for every table, or one per table); without it a table's size is its largest
id + 1. The formats themselves: csvfile.py, npyfile.py, oracle.py, fbgemm.py, locality.py.
"""

from __future__ import annotations

import os

from .detect import detect_format, open_any, source_format
from .format import TraceError, TraceHeader, TraceSource, TraceWriter


def write_trace(source: TraceSource, dst, *, chunk_lookups: int = 1 << 20, progress: bool = False) -> TraceHeader:
    """Writes every batch of `source` into a new .trace at dst (its tables and meta too)."""
    from tqdm import tqdm

    h = source.header
    with TraceWriter(dst, h.tables, chunk_lookups=chunk_lookups, meta=h.meta) as w, \
            tqdm(total=h.num_lookups, unit="lookup", unit_scale=True, desc=h.meta.get("format", "trace"),
                 disable=not progress) as bar:
        for c in source.chunks():
            w.write_batches(c.keys, c.batch_offsets)
            bar.update(c.keys.size)
    return w.header


def export_logs(src, dst, *, progress: bool = False) -> list[str]:
    """One dlrm locality log per table: dst as given for one table, else dst with '{}' replaced by
    the table index (or _<index> inserted before the extension)."""
    from .locality import profile_trace, write_locality_log

    _, logs = profile_trace(src, progress=progress)
    if all(log is None for log in logs):  # (no file, and exit 0: a review found it said nothing)
        raise TraceError(f"{os.fspath(src)}: no table is ever looked up: a locality log profiles a table's lookups")
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


def _exporters():
    from .csvfile import export_csv
    from .fbgemm import export_pt
    from .npyfile import export_npy
    from .oracle import export_oracle

    return {"csv": export_csv, "npy": export_npy, "pt": export_pt, "oracle": export_oracle, "log": export_logs}


def convert(src, dst, *, src_format: str | None = None, dst_format: str | None = None, progress: bool = False,
            chunk_lookups: int = 1 << 20, **options):
    """Converts src to dst; one side must be our trace format. src's format: src_format, else its
    content's (detect.source_format); dst's: dst_format, else its extension's. Importing: options
    go to src's reader (rows, batch_size, num_tables, remap: detect.READ_OPTIONS), chunk_lookups to
    the written trace; returns its header. Exporting: options go to the exporter (oracle: obj_size)."""
    b = detect_format(dst, dst_format)
    a = source_format(src, src_format)
    if a == "trace" and b == "trace":
        raise TraceError(f"{src} and {dst} are both tieredemb traces: nothing to convert")
    if a == "trace":
        if options and b != "oracle":
            raise TraceError(f"exporting to {b}: {', '.join(sorted(options))} "
                             f"{'applies' if len(options) == 1 else 'apply'} to an oracleGeneral export only")
        return _exporters()[b](src, dst, progress=progress, **options)
    if b != "trace":
        raise TraceError(f"one side must be a tieredemb trace (.trace): got {a} -> {b}")
    with open_any(src, a, **options) as source:
        return write_trace(source, dst, chunk_lookups=chunk_lookups, progress=progress)
