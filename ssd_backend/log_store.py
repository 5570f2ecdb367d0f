"""LogStore: the SSD tier as append-only segment files (native code), for training.

A training step writes back thousands of evicted rows at random ids; in place (SlotFileStore)
each dirties its own page (a fault or a buffered write: ~2-3 us of kernel time per row), here
a batch is one sequential record (~0.1 us per row). Reads copy rows from the segments'
mappings (or pread them with O_DIRECT), located by an in-memory index of 8 bytes per row.
Stale copies are reclaimed by compaction (native/ssd/log_file.h): at most ~2x the live bytes plus
one segment on disk.

Layout on disk (one directory per table):
- seg-<seq>.log  segments of segment_bytes (reserved when created), each a run of batch
                 records: header {magic, n, row_bytes, checksum}, n int64 ids, n rows.
- flushed        every segment's length at the last flush (those records are trusted at open,
                 and a segment missing or shorter is refused; later records are replayed while
                 their checksum holds); replaced whole through flushed.tmp and a rename.
- log.json       {"format", "width", "storage_dtype", "num_rows", "row_bytes",
                 "segment_bytes", "meta"}, written last when a table is created.
- LOCK           fcntl.flock'ed while a store has the table open.
Durability: flush() fdatasyncs the segments written since the last flush, then replaces the
flush mark (a new file renamed over it). A write cut by kill -9 is either whole in the log or not
at all: no row reads torn. Checkpoints are hard links to the segments (free on one filesystem).
"""

from __future__ import annotations

import re

import torch

from .native_store import NativeStore, native

FORMAT = "tieredemb.ssd.log/1"
META_FILE = "log.json"
_SEGMENT = re.compile(r"seg-[0-9]{10}\.log")
_OWN = {"flushed", "flushed.tmp"}


class LogStore(NativeStore):
    """An embedding table's rows in append-only segment files: the SSD tier for training.
    Arguments: NativeStore's; settings are LogOptions' (segment_bytes: the size of a segment
    file, for a new table; default: an eighth of the table's bytes, between 1 MiB and 256 MiB).
    Write-behind: write() stages the batch in memory (readable at once) and a native thread
    appends it while the caller goes on; the next write/flush waits for it. A failed append
    (disk full) raises StoreWriteError from that next call and from every call after it (the
    rows of unflushed writes may be lost; data flushed before is intact)."""

    FORMAT = FORMAT
    META_FILE = META_FILE
    KIND = "log table"
    LAYOUT_FIELDS = ("segment_bytes",)
    BACKEND = "log"

    def _layout(self, row_bytes: int, num_rows: int) -> dict:
        size = self.options.segment_bytes or min(256 << 20, max(1 << 20, num_rows * row_bytes // 8))
        return {"segment_bytes": size}

    def _is_own_file(self, name: str) -> bool:
        return name in _OWN or _SEGMENT.fullmatch(name) is not None

    def _open_native(self, record: dict, create: bool) -> None:
        try:
            self._file = native().LogFile.open(self.path, record["num_rows"], record["row_bytes"],
                                               record["segment_bytes"], create, self.direct_reads,
                                               self.io_threads)
        except (RuntimeError, ValueError) as e:
            raise self._classify("open the table", e) from None
        self.segment_bytes = record["segment_bytes"]

    def checkpoint(self, path) -> None:
        """Writes a consistent snapshot of the table (every write() before the call
        included) to path, a new directory; it opens as a table. flush(), then hard links
        to the segments (copies across filesystems) with a flush mark, the metadata last.
        The table appends to a new segment afterwards: a linked file is never written."""
        self._checkpoint(path, lambda to: self._file.checkpoint(to))

    def write_from(self, ids: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor) -> None:
        """Stores src[src_rows] (a float32 host block, e.g. a cache tier's pool) as the rows of
        unique ids: packed straight into the log's record when stored as float32."""
        if self.storage_dtype != torch.float32:  # converted on the way: through a block
            super().write_from(ids, src, src_rows)
            return
        rows_np = self._check_block_rows("src", src, src_rows, len(ids))
        ids_np = self._check_ids(ids)
        if ids_np.size == 0:
            return
        self._write_native(lambda: self._file.write_from(ids_np, src.view(torch.uint8), rows_np), ids_np.size)

    def stream_io(self, kinds: int, fresh: int, dirty: int, mark: int):
        """A native StreamIo over this table's files (native/ssd/stream_io.h): a GPU tier 0's
        reads and writes queued on a CUDA stream (tieredemb/gpu/storeio.py); its counts go to
        count_queued(). None where rows are stored converted (not float32): it moves rows as they
        are stored. The caller touches the store only after the calls it queued have run."""
        if self.storage_dtype != torch.float32:
            return None
        self._check_open()
        return native().StreamIo.open(self._file, kinds, fresh, dirty, mark)

    def count_queued(self, counts: dict) -> None:
        """What a StreamIo's calls did (its take_counts()), counted as write_from and read_to
        count theirs (a row never written, left marked, as initialized)."""
        st, found = self._stats, counts["rows_found"]
        if counts["rows_written"]:
            st["writes"] += counts["writes"]
            st["rows_written"] += counts["rows_written"]
            st["bytes_written"] += counts["rows_written"] * self._row_bytes
        st["rows_initialized"] += counts["rows_marked"]
        st["rows_found"] += found
        st["bytes_read"] += found * self._row_bytes
        st["reads"] += counts["reads"]

    def stats(self) -> dict:
        s = super().stats()
        if not self._closed:
            s.update(self._file.log_stats())
        return s
