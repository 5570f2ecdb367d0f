"""What a trace holds: lookups, unique rows, per-table counts, and a reuse histogram.

The reuse histogram is over batch-mode LRU stack distances (reuse.stack_distances with
the trace's batches): for each lookup that reaches the cache (a batch's repeats of a row do
not), the number of distinct other rows used since the row's last use. An LRU tier of C rows
hits exactly the lookups with distance < C, so the cumulative column is the LRU hit ratio at
C = 1, 2, 4, ... rows. Buckets are log2: [0], [1], [2, 3], [4, 7], ...
"""

from __future__ import annotations

import os

import numpy as np

from .detect import DESCRIPTIONS, open_any, source_format


def _buckets(dist: np.ndarray, cache_lookups: int) -> list[dict]:
    """log2 buckets of distances >= 0, with the LRU hit ratio of a cache of `hi + 1` rows."""
    reach = dist[dist >= 0]
    if reach.size == 0:
        return []
    b = np.zeros(reach.size, np.int64)
    pos = reach > 0
    b[pos] = np.floor(np.log2(reach[pos])).astype(np.int64) + 1
    counts = np.bincount(b)
    out, hits = [], 0
    for k, n in enumerate(counts):
        lo, hi = (0, 0) if k == 0 else (1 << (k - 1), (1 << k) - 1)
        hits += int(n)
        out.append({"lo": lo, "hi": hi, "lookups": int(n), "lru_hit_ratio_at_rows": hits / cache_lookups,
                    "rows": hi + 1})
    return out


def describe(path, *, reuse: bool = True, fmt: str | None = None, **options) -> dict:
    """Counts of a trace file in any format (fmt and options as detect.open_any) as a dict (what
    `tieredemb trace inspect --json` prints). Loads the keys (8 bytes a lookup; the reuse
    histogram needs about 3x that again)."""
    fmt = source_format(path, fmt)
    with open_any(path, fmt, **options) as r:
        h = r.header
        c = r.read_all()
    keys, lengths = c.keys, np.diff(c.batch_offsets)
    table = h.table_of(keys)
    per_table_lookups = np.bincount(table, minlength=len(h.tables))
    info = {"path": os.fspath(path), "format": fmt, "file_bytes": os.path.getsize(path), "num_batches": h.num_batches,
            "num_lookups": h.num_lookups, "total_rows": h.total_rows, "meta": h.meta,
            "batch_lookups": {"min": int(lengths.min()) if lengths.size else 0,
                              "mean": float(lengths.mean()) if lengths.size else 0.0,
                              "max": int(lengths.max()) if lengths.size else 0}}
    if reuse:
        from .reuse import DUPLICATE, FIRST_USE, stack_distances

        dist = stack_distances(keys, c.batch_offsets)
        first = dist == FIRST_USE
        repeats = int((dist == DUPLICATE).sum())
        per_table_unique = np.bincount(table[first], minlength=len(h.tables))
        info["reuse"] = {"kind": "batch-mode LRU stack distance", "first_use": int(first.sum()),
                         "repeat_in_batch": repeats, "buckets": _buckets(dist, keys.size - repeats)}
    else:
        per_table_unique = np.bincount(h.table_of(np.unique(keys)), minlength=len(h.tables))
    info["unique_rows"] = int(per_table_unique.sum())
    info["tables"] = [{"name": t.name, "rows": t.num_rows, "lookups": int(n), "unique": int(u)}
                      for t, n, u in zip(h.tables, per_table_lookups, per_table_unique)]
    return info


def format_description(info: dict) -> str:
    """The human-readable form of describe()'s dict."""
    n = max(info["num_lookups"], 1)
    b = info["batch_lookups"]
    lines = [f"trace: {info['path']} ({DESCRIPTIONS[info['format']]}, {info['file_bytes']:,} bytes, "
             f"{info['file_bytes'] / n:.2f} bytes/lookup)",
             (f"batches: {info['num_batches']:,}   lookups: {info['num_lookups']:,}   "
              f"per batch min/mean/max {b['min']:,} / {b['mean']:,.1f} / {b['max']:,}"),
             (f"unique rows: {info['unique_rows']:,} of {info['total_rows']:,} "
              f"({100 * info['unique_rows'] / max(info['total_rows'], 1):.2f}%)")]
    if info["meta"]:
        lines.append("meta: " + ", ".join(f"{k}={v}" for k, v in sorted(info["meta"].items())))
    lines.append(f"{'table':>16s} {'rows':>15s} {'lookups':>15s} {'unique':>13s}")
    for t in info["tables"]:
        lines.append(f"{t['name']:>16s} {t['rows']:>15,} {t['lookups']:>15,} {t['unique']:>13,}")
    if "reuse" in info:
        r = info["reuse"]
        lines += [(f"reuse: {r['kind']} (distinct other rows used since the row's last use; "
                   f"a batch's unique rows are its cache lookups)"),
                  (f"  first use {r['first_use']:,}   repeat in the same batch (not a cache lookup) "
                   f"{r['repeat_in_batch']:,}"),
                  f"  {'distance':>21s} {'lookups':>13s}   LRU hit ratio of a tier with N rows"]
        for k in r["buckets"]:
            span = f"{k['lo']:,}" if k["lo"] == k["hi"] else f"{k['lo']:,}-{k['hi']:,}"
            lines.append(f"  {span:>21s} {k['lookups']:>13,}   N = {k['rows']:>13,}: "
                         f"{k['lru_hit_ratio_at_rows']:.4f}")
    return "\n".join(lines)
