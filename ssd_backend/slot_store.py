"""SlotFileStore: the SSD tier as a file of fixed-size slots addressed by row id (native code).

Layout on disk (one directory per table):
- slots.bin    row i at byte offset i * slot_bytes, `width` values in `storage_dtype`, native
               byte order, zero-padded to slot_bytes. Created sparse (ftruncate), so its
               blocks are allocated only for rows that were written.
- written.bin  bitmap, 1 bit per row (bit i of byte i // 8, LSB first): 1 = the slot holds a
               row; 0 = never written, reads as initializer(ids, rows).
- slots.json   {"format", "width", "storage_dtype", "num_rows", "row_bytes", "slot_bytes",
               "meta"}, written last when a table is created (its presence = a table).
- redo.log     the latest write() (ids, rows, checksum), replayed at open when whole.
- LOCK         fcntl.flock'ed while a store has the table open.
(The lock, the record, read/write/flush and stats: native_store.py.)
slot_bytes is row_bytes rounded up to a multiple of 512 when the table is created with
direct_reads=True (each row is then whole sectors: one O_DIRECT read of slot_bytes, no
neighbour's bytes), else row_bytes (no padding: the page cache holds more rows). Either
layout can be opened with either direct_reads setting; an O_DIRECT read of an unpadded slot
reads the 512-byte sectors that enclose it.
Writes are synchronous and cost no system call per row: slots.bin is memory-mapped, a write
appends nothing but one redo record (a sequential write of the batch) and copies the rows into
the mapping (the page cache; the kernel writes them back). Space is reserved with fallocate
64 KiB at a time before a write touches it, so a full disk raises StoreWriteError from
write() with nothing changed, never a fault.
Durability: flush() msyncs slots.bin, then fdatasyncs the bitmap pages that changed, so a
row's bit is durable only after its bytes are; a flushed row survives kill -9 and power loss.
A write cut by kill -9 is either not in the redo log (its copy never began: the rows keep their
old values) or replayed whole from it at the next open: no row reads torn.

Threading: read/write/flush may be called from one thread at a time (the engine's); native
I/O threads serve each read (many O_DIRECT reads in flight, or parallel page faults).
"""

from __future__ import annotations

import os

from .common import copy_sparse
from .native_store import NativeStore, native

FORMAT = "tieredemb.ssd.slots/1"
META_FILE = "slots.json"
DATA_FILE = "slots.bin"
BITMAP_FILE = "written.bin"
LOG_FILE = "redo.log"
_SECTOR = 512


def is_slot_table(path: str) -> bool:
    return SlotFileStore.is_table(path)


class SlotFileStore(NativeStore):
    """An embedding table's rows in a slot file (native, memory-mapped): the SSD tier for
    dense id ranges and read-heavy use (inference, cold reads with O_DIRECT). For training,
    whose write-back dirties a page per row here, LogStore appends instead.
    Arguments: NativeStore's. A write cut short by an error stored nothing."""

    FORMAT = FORMAT
    META_FILE = META_FILE
    KIND = "slot table"
    LAYOUT_FIELDS = ("slot_bytes",)
    BACKEND = "slots"

    def _layout(self, row_bytes: int, num_rows: int) -> dict:
        return {"slot_bytes": -(-row_bytes // _SECTOR) * _SECTOR if self.direct_reads else row_bytes}

    def _is_own_file(self, name: str) -> bool:
        return name in (DATA_FILE, BITMAP_FILE, LOG_FILE)

    def _open_native(self, record: dict, create: bool) -> None:
        try:
            self._file = native().SlotFile.open(
                os.path.join(self.path, DATA_FILE), os.path.join(self.path, BITMAP_FILE),
                os.path.join(self.path, LOG_FILE), record["num_rows"], record["row_bytes"],
                record["slot_bytes"], create, self.direct_reads, self.io_threads)
        except RuntimeError as e:
            raise self._classify("open the table", e) from None
        self.slot_bytes = record["slot_bytes"]

    def checkpoint(self, path) -> None:
        """Writes a consistent snapshot of the table (every write() before the call
        included) to path, a new directory; it opens as a table. flush(), then copies the
        files keeping holes (`cp --reflink=auto --sparse=always` semantics: copy_file_range
        per data extent, a reflink on filesystems that share extents; not the redo log:
        after the flush it holds nothing new), the metadata last."""
        def copy(to: str) -> None:
            for name in (DATA_FILE, BITMAP_FILE):
                copy_sparse(os.path.join(self.path, name), os.path.join(to, name))

        self._checkpoint(path, copy)
