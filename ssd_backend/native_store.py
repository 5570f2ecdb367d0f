"""What the two native file stores share (SlotFileStore: slots addressed by id; LogStore:
append-only segments): the lock, the metadata record (<kind>.json, written last when a table
is created: its presence = a table), argument checks, read / write / flush / stats / close
over a native file object from ssd_backend._C with the same methods (read, write, sync,
written_ids, num_written, replayed, close).

Writes are synchronous (no Python runs per row and no write queue): when write() returns the
rows are in the page cache, durable at the next flush(); StoreWriteError (e.g. disk full)
means nothing was written and the store stays usable. Threading: the engine calls from one
thread at a time; calls from several threads at once take turns in the native file (one runs
at a time; the counters of stats() may then miss some). Native I/O threads serve each read.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import weakref

import numpy as np
import torch

from .common import (DTYPE_BY_NAME, STORAGE_DTYPES, StoreBase, StoreCorruptedError, StoreError,
                     StoreWriteError, build_directory, check_record, check_width, initialize, locked_error,
                     new_stats, fsync_dir, normalize_meta, write_json_atomic)
from .options import make_options

LOCK_FILE = "LOCK"
CREATING_FILE = "CREATING"  # present while a table is created, until its record is written


def native():
    from . import _C
    return _C


def _unlock(fd: int, pid: int) -> None:
    """Releases a store's lock: explicitly, since a process forked since shares the lock's file
    description, which closing this descriptor alone would leave locked; but not from such a child
    (pid is the locker's), whose unlock would release its parent's table."""
    try:
        if os.getpid() == pid:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class NativeStore(StoreBase):
    """Base of SlotFileStore and LogStore. A subclass sets FORMAT, META_FILE, KIND (words for
    messages), LAYOUT_FIELDS (int record fields besides num_rows and row_bytes), and
    implements _layout(row_bytes, num_rows) (those fields for a new table), _open_native(record,
    create) (sets self._file) and _is_own_file(name) (files a creation cut short may leave).

    path: a directory (created if missing or empty; otherwise it must hold a table of this
    kind). width: floats per row (None: adopt the stored width). initializer(ids, out, rows=None)
    fills rows never written. meta: the table's JSON-able metadata (None: adopt what is stored);
    a new table takes num_rows from meta["num_embeddings"]; on an existing table every field
    must equal the stored one (ValueError naming the field). settings: the backend's options
    (LogOptions / SlotOptions fields: storage_dtype, direct_reads, io_threads, ...).
    """

    FORMAT = ""
    META_FILE = ""
    KIND = ""
    LAYOUT_FIELDS: tuple = ()
    BACKEND = ""  # its name in ssd_backend.options

    def __init__(self, path, width: int | None, initializer, meta: dict | None = None, **settings):
        self.path = os.path.abspath(os.fspath(path))
        self._closed = True
        self._file = None
        self._unlock_once = None  # (a finalizer that lets the table's lock go, once it is taken)
        check_width(width)
        self.options = make_options(self.BACKEND, settings)
        self.initializer = initializer
        self.direct_reads = bool(self.options.direct_reads)
        self.io_threads = self.options.io_threads
        storage_dtype = self.options.storage_dtype
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

    def _layout(self, row_bytes: int, num_rows: int) -> dict:
        raise NotImplementedError

    def _open_native(self, record: dict, create: bool) -> None:
        raise NotImplementedError

    def _is_own_file(self, name: str) -> bool:
        raise NotImplementedError

    @classmethod
    def is_table(cls, path) -> bool:
        return os.path.isfile(os.path.join(os.fspath(path), cls.META_FILE))

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
        # (a store dropped unclosed lets its table go when collected, as its native files do)
        self._unlock_once = weakref.finalize(self, _unlock, fd, os.getpid())

    def _release(self) -> None:
        """Closes the files, then releases the lock, even when closing the files fails."""
        try:
            if self._file is not None:
                try:
                    self._file.close()
                finally:
                    self._file = None
        finally:
            self._unlock()

    def _unlock(self) -> None:
        if self._unlock_once is not None:  # (a finalizer runs once: a second call does nothing)
            self._unlock_once()

    def _classify(self, what: str, exc: Exception) -> Exception:
        msg = str(exc)
        if msg.startswith("corrupted:") or "No such file" in msg:
            return StoreCorruptedError(f"ssd_path {self.path}: cannot {what}: the table's files "
                                       f"are corrupted, truncated or missing: {msg}")
        if "No space left" in msg:
            return StoreWriteError(f"ssd_path {self.path}: cannot {what}: disk full: {msg}")
        return StoreError(f"ssd_path {self.path}: cannot {what}: {msg}")

    def _open_or_create(self, width, storage_dtype, meta) -> None:
        if self.is_table(self.path):
            record = self.read_meta(self.path)
            check_record(self.path, record, width, storage_dtype, meta)
            self._open_native(record, create=False)
        else:
            names = os.listdir(self.path)
            others = sorted(n for n in names if n not in (LOCK_FILE, CREATING_FILE, self.META_FILE + ".tmp")
                            and not self._is_own_file(n))
            if others:
                raise ValueError(
                    f"ssd_path {self.path}: not a {self.KIND} (no {self.META_FILE}) and not empty "
                    f"({others[:3]}); refusing to create a table in a directory that holds "
                    f"other files")
            own = sorted(n for n in names if self._is_own_file(n))
            creating = os.path.join(self.path, CREATING_FILE)
            if own and not os.path.exists(creating):
                raise StoreCorruptedError(
                    f"ssd_path {self.path}: holds a {self.KIND}'s files ({own[:3]}) but no {self.META_FILE}: a "
                    f"damaged table, or a checkpoint cut short; refusing to open it or to create a table over it "
                    f"(move its files away to create a new table here)")
            # Empty, or a creation cut short before the record (CREATING left): (re)create under the lock.
            if width is None:
                raise ValueError(f"ssd_path {self.path}: new table needs a width (got None)")
            requested = normalize_meta(meta) if meta is not None else {}
            num_rows = requested.get("num_embeddings")
            if not isinstance(num_rows, int) or num_rows <= 0:
                raise ValueError(f"ssd_path {self.path}: a new {self.KIND} needs "
                                 f"meta['num_embeddings'] (the number of rows), a positive "
                                 f"int; got {num_rows!r}")
            if "width" in requested and requested["width"] != width:
                raise ValueError(f"ssd_path {self.path}: meta width {requested['width']} "
                                 f"!= width argument {width}")
            row_bytes = width * storage_dtype.itemsize
            record = {"format": self.FORMAT, "width": width,
                      "storage_dtype": STORAGE_DTYPES[storage_dtype], "num_rows": num_rows,
                      "row_bytes": row_bytes, **self._layout(row_bytes, num_rows), "meta": requested}
            record["state"] = {}
            with open(creating, "w"):
                pass
            fsync_dir(self.path)
            self._open_native(record, create=True)
            write_json_atomic(os.path.join(self.path, self.META_FILE), record)
            os.unlink(creating)
            fsync_dir(self.path)
        self.width = record["width"]
        self.storage_dtype = DTYPE_BY_NAME[record["storage_dtype"]]
        self.meta = record["meta"]
        self.num_rows = record["num_rows"]
        self.state = record.get("state", {})
        self.record = record

    @classmethod
    def read_meta(cls, path) -> dict:
        """The stored record of the table at path, without locking it. Raises ValueError if
        not a table of this kind, StoreCorruptedError if the record is damaged."""
        path = os.path.abspath(os.fspath(path))
        meta_path = os.path.join(path, cls.META_FILE)
        if not os.path.isfile(meta_path):
            raise ValueError(f"ssd_path {path}: not a {cls.KIND} (no {cls.META_FILE})")
        with open(meta_path, "rb") as f:
            raw = f.read()
        try:
            r = json.loads(raw)
            ok = (r.get("format") == cls.FORMAT and isinstance(r.get("width"), int)
                  and r.get("storage_dtype") in DTYPE_BY_NAME and isinstance(r.get("meta"), dict)
                  and all(isinstance(r.get(k), int) and r[k] > 0
                          for k in ("num_rows", "row_bytes") + cls.LAYOUT_FIELDS)
                  and r["row_bytes"] == r["width"] * DTYPE_BY_NAME[r["storage_dtype"]].itemsize)
        except (ValueError, AttributeError, TypeError):
            ok = False
        if not ok:
            raise StoreCorruptedError(f"ssd_path {path}: the table metadata record {meta_path} "
                                      f"is not valid {cls.FORMAT} JSON: {raw[:200]!r}")
        return r

    # ----------------------------------------------------------------------- reads, writes

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
        found = self._read_native(lambda: self._file.read(ids_np, buf.view(torch.uint8)))
        nfound = int(found.sum())
        if not direct_out and nfound:
            if nfound == n:
                out.copy_(buf)
            else:
                f = torch.from_numpy(found)
                out[f] = buf[f].to(torch.float32)
        self._count_read(ids_np, found, out, None)

    def read_to(self, ids: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
        """Rows of unique ids into dst[dst_rows] (a float32 [rows, width] CPU block, e.g. a cache
        tier's pool), straight from the files when rows are stored as float32. On an error some
        of those dst rows may have been overwritten."""
        if self.storage_dtype != torch.float32:  # converted on the way: through a block
            super().read_to(ids, dst, dst_rows)
            return
        rows_np = self._check_block_rows("dst", dst, dst_rows, len(ids))
        ids_np = self._check_ids(ids)
        if ids_np.size == 0:
            return
        found = self._read_native(lambda: self._file.read_to(ids_np, dst.view(torch.uint8), rows_np))
        self._count_read(ids_np, found, dst, rows_np)

    def _read_native(self, call) -> np.ndarray:
        """Runs a native read; returns found (bool [n]); its error as a StoreError."""
        try:
            return call().view(bool)
        except RuntimeError as e:
            raise self._classify("read rows", e) from None

    def _count_read(self, ids_np: np.ndarray, found: np.ndarray, out: torch.Tensor, out_rows) -> None:
        """Initializes the rows a read did not find (in out, at out_rows if given), then the counters."""
        n, nfound = ids_np.size, int(found.sum())
        if nfound < n:
            self._stats["rows_initialized"] += initialize(
                self.path, self.initializer, ids_np, (~found).nonzero()[0], out, out_rows)
        self._stats["rows_found"] += nfound
        self._stats["bytes_read"] += nfound * self._row_bytes
        self._stats["reads"] += n

    # ------------------------------------------------------------------------------ writes

    def write(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """ids: int64 [n] unique; rows: float32 [n, width]. Stores the rows before returning
        (in the page cache; durable at the next flush()). StoreWriteError (e.g. disk full):
        see the subclass for what may have been stored."""
        self._check_open()
        ids_np = self._check_ids(ids)
        n = ids_np.size
        self._check_rows(rows, n, "rows")
        if n == 0:
            return
        stored = rows.to(self.storage_dtype).contiguous()
        self._write_native(lambda: self._file.write(ids_np, stored.view(torch.uint8)), n)

    def _write_native(self, call, n: int) -> None:
        """Runs a native write of n rows: its error as a StoreError, then the counters."""
        try:
            call()
        except RuntimeError as e:
            raise self._classify("write rows", e) from None
        self._stats["writes"] += 1
        self._stats["rows_written"] += n
        self._stats["bytes_written"] += n * self._row_bytes

    def flush(self, state: dict | None = None) -> None:
        """Returns when every write() made before the call is durable: it survives kill -9
        and power loss once this returned. state: stored in the table's record, after the rows
        (the record is replaced atomically: a crash leaves the old state or the new one)."""
        self._check_open()
        try:
            self._file.sync()
        except RuntimeError as e:
            raise self._classify("flush", e) from None
        if state is not None and normalize_meta(state) != self.state:
            record = {**self.record, "state": normalize_meta(state)}
            try:
                write_json_atomic(os.path.join(self.path, self.META_FILE), record)
            except OSError as e:
                raise StoreWriteError(f"ssd_path {self.path}: cannot write the table's record: {e}") from None
            self.record, self.state = record, record["state"]
        self._stats["flushes"] += 1

    def _copy_record(self, path: str) -> None:
        """The table's record into the checkpoint directory path, last (its presence = a table)."""
        write_json_atomic(os.path.join(path, self.META_FILE), self.record)

    # ------------------------------------------------------------------------------ export

    def written_ids(self, start: int = 0, limit: int | None = None) -> torch.Tensor:
        """Sorted int64 ids of rows ever written with id >= start, at most `limit` of them."""
        self._check_written_ids_args(start, limit)
        return torch.from_numpy(self._file.written_ids(start, -1 if limit is None else limit))

    def _checkpoint(self, path, copy) -> None:
        """flush(), then copy(a new directory) and the table's record last, built beside path and
        renamed to it whole (build_directory: ValueError if path exists; a crash or a failure
        leaves no directory at path)."""
        self._check_open()
        path = os.path.abspath(os.fspath(path))
        if os.path.exists(path):
            raise ValueError(f"checkpoint path {path}: already exists; give a new directory")
        self.flush()  # the caller's thread is the only writer: nothing changes while we copy

        def build(to: str) -> None:
            os.makedirs(to)
            copy(to)
            self._copy_record(to)

        try:
            build_directory(path, build)
        except RuntimeError as e:
            raise self._classify("write checkpoint " + path, e) from None
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
        return (f"{type(self).__name__}({self.path!r}, width={self.width}, num_rows={self.num_rows}, "
                f"storage_dtype={self.storage_dtype}, direct_reads={self.direct_reads}, "
                f"closed={self._closed})")
