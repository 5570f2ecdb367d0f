"""Access traces: batches of (table, row id) lookups, stored as global keys
(key = table_base[table] + id) in a chunked, lz4-compressed file that is read and written as a
stream (format.py documents the layout); other formats are read directly (detect.open_any) or
converted (convert); reuse.py measures a trace's reuse (LRU stack distances).

    with TraceWriter("t.trace", [TableInfo("user", 10**6), TableInfo("item", 10**5)]) as w:
        w.write_batch(keys)                       # int64 global keys of one batch
    with open_any("t.trace") as r:                # or a .oracleGeneral.bin, .csv, .npy, .pt file
        for chunk in r.chunks():                  # whole batches, one chunk in memory at a time
            chunk.keys, chunk.batch_offsets

The names below are imported on first use: `import tieredemb.trace` loads neither numba nor torch.
"""

from .lazy import lazy_exports

# public name -> the submodule that defines it
_EXPORTS = {
    "Chunk": ".format", "TableInfo": ".format", "TraceError": ".format", "TraceHeader": ".format",
    "TraceReader": ".format", "TraceSource": ".format", "TraceWriter": ".format", "open_trace": ".format",
    "open_any": ".detect", "sniff_format": ".detect", "detect_format": ".detect",
    "convert": ".conversion",
    "LocalityGenerator": ".locality", "LocalityLog": ".locality", "profile": ".locality", "profile_trace": ".locality",
    "read_locality_log": ".locality", "synth_locality": ".locality", "write_locality_log": ".locality",
    "Recorder": ".recorder", "record": ".recorder",
    "describe": ".stats",
    "ZipfSampler": ".synth", "synth_zipf": ".synth",
    "DUPLICATE": ".reuse", "FIRST_USE": ".reuse", "stack_distances": ".reuse",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

