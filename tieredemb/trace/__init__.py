"""Access traces: batches of (table, row id) lookups, stored as global keys
(key = table_base[table] + id) in a chunked, lz4-compressed file that is read and written as a
stream (format.py documents the layout).

    with TraceWriter("t.trace", [TableInfo("user", 10**6), TableInfo("item", 10**5)]) as w:
        w.write_batch(keys)                       # int64 global keys of one batch
    with open_trace("t.trace") as r:
        for chunk in r.chunks():                  # whole batches, one chunk in memory at a time
            chunk.keys, chunk.batch_offsets
"""

from .convert import convert, detect_format
from .format import (
    Chunk,
    TableInfo,
    TraceError,
    TraceHeader,
    TraceReader,
    TraceWriter,
    open_trace,
)
from .locality import (
    LocalityGenerator,
    LocalityLog,
    profile,
    profile_trace,
    read_locality_log,
    synth_locality,
    write_locality_log,
)
from .recorder import Recorder, record
from .stats import describe
from .synth import ZipfSampler, synth_zipf

__all__ = [
    "Chunk",
    "LocalityGenerator",
    "LocalityLog",
    "Recorder",
    "TableInfo",
    "TraceError",
    "TraceHeader",
    "TraceReader",
    "TraceWriter",
    "ZipfSampler",
    "convert",
    "describe",
    "detect_format",
    "open_trace",
    "profile",
    "profile_trace",
    "read_locality_log",
    "record",
    "synth_locality",
    "synth_zipf",
    "write_locality_log",
]
