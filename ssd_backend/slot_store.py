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

import errno
import fcntl
import json
import os
import shutil

import torch

from .common import (DTYPE_BY_NAME, STORAGE_DTYPES, StoreBase, StoreCorruptedError,
                     StoreError, StoreWriteError, check_record, check_store_args, copy_sparse,
                     fsync_dir, initialize, locked_error, new_stats, normalize_meta)

FORMAT = "tieredemb.ssd.slots/1"
META_FILE = "slots.json"
DATA_FILE = "slots.bin"
BITMAP_FILE = "written.bin"
LOG_FILE = "redo.log"
LOCK_FILE = "LOCK"
_OUR_FILES = {META_FILE, DATA_FILE, BITMAP_FILE, LOG_FILE, LOCK_FILE, META_FILE + ".tmp"}
_SECTOR = 512


def is_slot_table(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META_FILE))


def _native():
    from tieredemb import _C
    return _C


class SlotFileStore(StoreBase):
    """An embedding table's rows in a slot file (native pread/pwrite): the SSD tier for
    dense id ranges.

    path: a directory (created if missing or empty; otherwise it must hold a slot table).
    width: floats per row (None: adopt the stored width). initializer(ids, out) fills rows
    never written. meta: the table's JSON-able metadata (None: adopt what is stored); a new
    table takes num_rows from meta["num_embeddings"]; on an existing table every field must
    equal the stored one (ValueError naming the field).
    storage_dtype: float32 / float16 / bfloat16 on disk; rows are float32 in memory.
    direct_reads: read with O_DIRECT (bypass the page cache; ValueError-free fallback is not
    attempted: a filesystem without O_DIRECT, e.g. tmpfs, raises StoreError at open).
    io_threads: native threads per read (queue depth of O_DIRECT reads, parallel faults).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        width: int | None,
        initializer,
        meta: dict | None = None,
        *,
        storage_dtype: torch.dtype = torch.float32,
        direct_reads: bool = False,
        io_threads: int = 32,
    ):
        self.path = os.path.abspath(os.fspath(path))
        self._closed = True
        self._file = None
        self._lock_fd = None
        check_store_args(width, storage_dtype, 1)
        if not 1 <= io_threads <= 1024:
            raise ValueError(f"io_threads {io_threads} must be in [1, 1024]")
        self.initializer = initializer
        self.direct_reads = bool(direct_reads)
        self.io_threads = io_threads

        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise ValueError(f"ssd_path {self.path}: exists and is not a directory")
        os.makedirs(self.path, exist_ok=True)
        self._lock()
        try:
            self._open_or_create(width, storage_dtype, meta)
        except BaseException:
            self._release()
            raise
        self._closed = False
        self._row_bytes = self.width * self.storage_dtype.itemsize
        self._stats = new_stats()
        del self._stats["rows_queued_hits"]  # no write queue
        self._stats["rows_replayed"] = self._file.replayed

    # ----------------------------------------------------------------------------- opening

    def _lock(self) -> None:
        lock_path = os.path.join(self.path, LOCK_FILE)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise locked_error(self.path, lock_path, "open the table", str(e)) from None
            raise StoreError(f"ssd_path {self.path}: cannot lock {lock_path}: {e}") from None
        self._lock_fd = fd

    def _release(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            finally:
                self._file = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _classify(self, what: str, exc: Exception) -> Exception:
        msg = str(exc)
        if msg.startswith("corrupted:") or "No such file" in msg:
            return StoreCorruptedError(f"ssd_path {self.path}: cannot {what}: the table's files "
                                       f"are corrupted, truncated or missing: {msg}")
        if "No space left" in msg:
            return StoreWriteError(f"ssd_path {self.path}: cannot {what}: disk full: {msg}")
        return StoreError(f"ssd_path {self.path}: cannot {what}: {msg}")

    def _open_native(self, record: dict, create: bool) -> None:
        try:
            self._file = _native().SlotFile.open(
                os.path.join(self.path, DATA_FILE), os.path.join(self.path, BITMAP_FILE),
                os.path.join(self.path, LOG_FILE), record["num_rows"], record["row_bytes"], record["slot_bytes"], create,
                self.direct_reads, self.io_threads)
        except RuntimeError as e:
            raise self._classify("open the table", e) from None

    def _open_or_create(self, width, storage_dtype, meta) -> None:
        if is_slot_table(self.path):
            record = self.read_meta(self.path)
            check_record(self.path, record, width, storage_dtype, meta)
            self._open_native(record, create=False)
        else:
            others = sorted(set(os.listdir(self.path)) - _OUR_FILES)
            if others:
                raise ValueError(
                    f"ssd_path {self.path}: not a slot table (no {META_FILE}) and not empty "
                    f"({others[:3]}); refusing to create a table in a directory that holds "
                    f"other files")
            # Empty, or a creation cut short before slots.json: (re)create under the lock.
            if width is None:
                raise ValueError(f"ssd_path {self.path}: new table needs a width (got None)")
            requested = normalize_meta(meta) if meta is not None else {}
            num_rows = requested.get("num_embeddings")
            if not isinstance(num_rows, int) or num_rows <= 0:
                raise ValueError(f"ssd_path {self.path}: a new slot table needs "
                                 f"meta['num_embeddings'] (the number of slots), a positive "
                                 f"int; got {num_rows!r}")
            if "width" in requested and requested["width"] != width:
                raise ValueError(f"ssd_path {self.path}: meta width {requested['width']} "
                                 f"!= width argument {width}")
            row_bytes = width * storage_dtype.itemsize
            slot_bytes = -(-row_bytes // _SECTOR) * _SECTOR if self.direct_reads else row_bytes
            record = {"format": FORMAT, "width": width,
                      "storage_dtype": STORAGE_DTYPES[storage_dtype], "num_rows": num_rows,
                      "row_bytes": row_bytes, "slot_bytes": slot_bytes, "meta": requested}
            self._open_native(record, create=True)
            tmp = os.path.join(self.path, META_FILE + ".tmp")
            with open(tmp, "w") as f:
                json.dump(record, f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(self.path, META_FILE))
            fsync_dir(self.path)
        self.width = record["width"]
        self.storage_dtype = DTYPE_BY_NAME[record["storage_dtype"]]
        self.meta = record["meta"]
        self.num_rows = record["num_rows"]
        self.slot_bytes = record["slot_bytes"]

    @staticmethod
    def read_meta(path: str | os.PathLike) -> dict:
        """The stored record of the table at path, without locking it. Raises ValueError if
        not a slot table, StoreCorruptedError if the record is damaged."""
        path = os.path.abspath(os.fspath(path))
        meta_path = os.path.join(path, META_FILE)
        if not os.path.isfile(meta_path):
            raise ValueError(f"ssd_path {path}: not a slot table (no {META_FILE})")
        with open(meta_path, "rb") as f:
            raw = f.read()
        try:
            r = json.loads(raw)
            ok = (r.get("format") == FORMAT and isinstance(r.get("width"), int)
                  and r.get("storage_dtype") in DTYPE_BY_NAME and isinstance(r.get("meta"), dict)
                  and all(isinstance(r.get(k), int) and r[k] > 0
                          for k in ("num_rows", "row_bytes", "slot_bytes"))
                  and r["row_bytes"] == r["width"] * DTYPE_BY_NAME[r["storage_dtype"]].itemsize
                  and r["slot_bytes"] >= r["row_bytes"])
        except (ValueError, AttributeError, TypeError):
            ok = False
        if not ok:
            raise StoreCorruptedError(f"ssd_path {path}: the table metadata record {meta_path} "
                                      f"is not valid {FORMAT} JSON: {raw[:200]!r}")
        return r

    # ------------------------------------------------------------------------------- reads

    def _id_limit(self) -> int:
        return self.num_rows

    def read(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """ids: int64 [n] unique; out: float32 [n, width] contiguous. Fills out with the rows:
        the stored row, else the initializer's."""
        ids_np = self._check_read(ids, out)
        n = ids_np.size
        if n == 0:
            return
        direct_out = self.storage_dtype == torch.float32
        buf = out if direct_out else torch.empty(n, self.width, dtype=self.storage_dtype)
        try:
            found = self._file.read(ids_np, buf.view(torch.uint8)).view(bool)
        except RuntimeError as e:
            raise self._classify("read rows", e) from None
        nfound = int(found.sum())
        if not direct_out and nfound:
            if nfound == n:
                out.copy_(buf)
            else:
                f = torch.from_numpy(found)
                out[f] = buf[f].to(torch.float32)
        if nfound < n:
            self._stats["rows_initialized"] += initialize(
                self.path, self.initializer, ids_np, (~found).nonzero()[0], out)
        self._stats["rows_found"] += nfound
        self._stats["bytes_read"] += nfound * self._row_bytes
        self._stats["reads"] += n

    # ------------------------------------------------------------------------------ writes

    def write(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """ids: int64 [n] unique; rows: float32 [n, width]. Stores the rows before returning
        (in the page cache; durable at the next flush()). StoreWriteError (e.g. disk full)
        means nothing was written; the store stays usable."""
        self._check_open()
        ids_np = self._check_ids(ids)
        n = ids_np.size
        self._check_rows(rows, n, "rows")
        if n == 0:
            return
        stored = rows.to(self.storage_dtype).contiguous()
        try:
            self._file.write(ids_np, stored.view(torch.uint8))
        except RuntimeError as e:
            raise self._classify("write rows", e) from None
        self._stats["writes"] += 1
        self._stats["rows_written"] += n
        self._stats["bytes_written"] += n * self._row_bytes

    def flush(self) -> None:
        """Returns when every write() made before the call is durable (slots msync'ed, then
        the written bitmap). Survives kill -9 and power loss once it returned."""
        self._check_open()
        try:
            self._file.sync()
        except RuntimeError as e:
            raise self._classify("flush", e) from None
        self._stats["flushes"] += 1

    # --------------------------------------------------------------------- export, snapshot

    def written_ids(self, start: int = 0, limit: int | None = None) -> torch.Tensor:
        """Sorted int64 ids of rows ever written with id >= start, at most `limit` of them
        (queued writes included)."""
        self._check_written_ids_args(start, limit)
        return torch.from_numpy(self._file.written_ids(start, -1 if limit is None else limit))

    def checkpoint(self, path: str | os.PathLike) -> None:
        """Writes a consistent snapshot of the table (every write() before the call
        included) to path, a new directory; it opens as a table. flush(), then copies the
        files keeping holes (not the redo log: after the flush it holds nothing new) (`cp --reflink=auto --sparse=always` semantics: copy_file_range
        per data extent, a reflink on filesystems that share extents), the metadata last."""
        self._check_open()
        path = os.path.abspath(os.fspath(path))
        if os.path.exists(path):
            raise ValueError(f"checkpoint path {path}: already exists; give a new directory")
        self.flush()  # the caller's thread is the only writer: nothing changes while we copy
        try:
            os.makedirs(path)
            for name in (DATA_FILE, BITMAP_FILE):
                copy_sparse(os.path.join(self.path, name), os.path.join(path, name))
            tmp = os.path.join(path, META_FILE + ".tmp")
            shutil.copyfile(os.path.join(self.path, META_FILE), tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(path, META_FILE))
            fsync_dir(path)
        except OSError as e:
            raise StoreError(f"ssd_path {self.path}: cannot write checkpoint {path}: {e}") from None

    # ------------------------------------------------------------------------------- admin

    def stats(self) -> dict:
        s = dict(self._stats)
        if not self._closed:
            s["rows_stored"] = self._file.num_written()
        return s

    def close(self) -> None:
        """Flushes and releases the table (its lock). Safe to call twice; if the flush fails
        the table is still released and the error is raised."""
        if self._closed:
            return
        err = None
        try:
            self.flush()
        except StoreError as e:
            err = e
        self._closed = True
        try:
            self._release()
        except RuntimeError as e:
            err = err or self._classify("close the table", e)
        if err is not None:
            raise err

    def __repr__(self) -> str:
        return (f"SlotFileStore({self.path!r}, width={self.width}, num_rows={self.num_rows}, "
                f"storage_dtype={self.storage_dtype}, slot_bytes={self.slot_bytes}, "
                f"direct_reads={self.direct_reads}, closed={self._closed})")
