"""What the SSD backends share: errors, the metadata record check, argument checks, the atomic
write of a JSON record, and the background writer (a write queue with backpressure and
read-your-writes).

A backend supplies how a batch reaches its files (WriteBehind's `apply`) and how it reads
stored rows; everything a caller can observe about queueing, errors and metadata is here, so
RocksDBStore and SlotFileStore behave the same.
"""

from __future__ import annotations

import atexit
import errno
import itertools
import json
import os
import shutil
import threading
import weakref
from collections import deque
from typing import Callable

import numpy as np
import torch

from .options import STORAGE_DTYPES

DTYPE_BY_NAME = {v: k for k, v in STORAGE_DTYPES.items()}
MAX_ID = 2**63


class StoreError(RuntimeError):
    """Base class of the errors the SSD store raises about its files (not its arguments)."""


class StoreLockedError(StoreError):
    """The table's lock file is held by another process or another open store."""


class StoreCorruptedError(StoreError):
    """A file of the table is missing, truncated or fails its checksum."""


class StoreWriteError(StoreError):
    """The background writer failed (e.g. disk full); writes queued after the last
    successful flush() may be lost, data flushed before is intact."""


def locked_error(path: str, lock_file: str, what: str, detail: str) -> StoreLockedError:
    return StoreLockedError(
        f"ssd_path {path}: cannot {what}: the table's lock file {lock_file} is held by another "
        f"process or by a store of this process that is still open (close it first): {detail}")


def normalize_meta(meta: dict) -> dict:
    """JSON round trip, so tuples compare equal to the lists they are stored as."""
    try:
        return json.loads(json.dumps(meta, sort_keys=True))
    except TypeError as e:
        raise ValueError(f"meta must be JSON-serializable: {e}") from None


def check_record(path: str, record: dict, width, storage_dtype, meta) -> None:
    """Raises ValueError naming the first field where the requested (width, storage_dtype,
    meta) differ from a stored record. width None: adopt; meta None: adopt meta and, with
    width given, the storage dtype too."""
    checks = [("width", record["width"], width),
              ("storage_dtype", record["storage_dtype"], STORAGE_DTYPES[storage_dtype])]
    if width is None:
        checks = checks[1:]
    if meta is None:
        checks = checks[:-1] if width is not None else []  # adopt the stored dtype too
    differs = [] if meta is None else _meta_differs(record["meta"], normalize_meta(meta))
    for field, stored, requested in checks:
        if stored != requested:  # (with the table's field that makes the rows' width differ, where one does)
            why = next((f" (stored {f} {s!r} != requested {r!r})" for f, s, r in differs if f != "width"), "")
            raise ValueError(f"ssd_path {path}: stored {field} {stored} != requested {requested}{why}")
    for field, s, r in differs:
        raise ValueError(f"ssd_path {path}: stored {field} {s!r} != requested {r!r}")


def _meta_differs(stored: dict, requested: dict) -> list:
    """(field, stored, requested) of every field where two tables' meta differ, by name."""
    out = []
    for field in sorted(set(stored) | set(requested)):
        s, r = stored.get(field, "<absent>"), requested.get(field, "<absent>")
        if s != r:
            out.append((field, s, r))
    return out


def check_width(width) -> None:
    if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width <= 0):
        raise ValueError(f"width {width!r} must be a positive int")


def check_ids(ids: torch.Tensor, limit: int, name: str = "ids") -> np.ndarray:
    """ids: int64 [n] CPU tensor with every id in [0, limit). Returns it as a numpy array."""
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1 \
            or ids.device.type != "cpu":
        raise ValueError(f"{name} must be an int64 [n] CPU tensor, got "
                         f"{getattr(ids, 'dtype', type(ids))} {tuple(getattr(ids, 'shape', ()))}")
    ids_np = ids.contiguous().numpy()
    if ids_np.size:
        lo, hi = int(ids_np.min()), int(ids_np.max())
        if lo < 0 or hi >= limit:
            bad = lo if lo < 0 else hi
            raise IndexError(f"id {bad} out of range [0, {limit})")
    return ids_np


def check_rows(rows: torch.Tensor, n: int, width: int, name: str) -> None:
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.float32 \
            or tuple(rows.shape) != (n, width) or rows.device.type != "cpu":
        raise ValueError(f"{name} must be a float32 [{n}, {width}] CPU tensor, got "
                         f"{getattr(rows, 'dtype', type(rows))} "
                         f"{tuple(getattr(rows, 'shape', ()))}")


def initialize(path: str, initializer, ids_np: np.ndarray, positions: np.ndarray,
               out: torch.Tensor, out_rows: np.ndarray | None = None) -> int:
    """Fills out[r] with the initial row of ids[p] for each p in positions, r = out_rows[p] (p
    when out_rows is None); returns how many rows. The initializer's contract:
    initializer(ids, out, rows=None) fills out (or out[rows]) with the initial rows of ids."""
    if initializer is None:
        raise RuntimeError(f"ssd_path {path}: {positions.size} rows were never written "
                           f"and the store has no initializer")
    k = positions.size
    if out_rows is None and k == out.shape[0]:
        initializer(torch.from_numpy(ids_np), out)
    else:
        dst = (positions if out_rows is None else out_rows[positions]).astype(np.int64, copy=False)
        initializer(torch.from_numpy(ids_np[positions]), out, torch.from_numpy(dst))
    return k


class QueuedBatch:
    """A write() waiting for the background writer. rows: storage dtype [n, width]."""

    __slots__ = ("seq", "ids", "rows", "done", "_order")

    def __init__(self, seq: int, ids: np.ndarray, rows: torch.Tensor):
        self.seq = seq
        self.ids = ids
        self.rows = rows
        self.done = False
        self._order = None

    def rows_of(self, ids: list) -> torch.Tensor:
        """float32 rows of these ids (each one in the batch)."""
        if self._order is None:
            self._order = np.argsort(self.ids, kind="stable")
        sorted_ids = self.ids[self._order]
        pos = self._order[np.searchsorted(sorted_ids, np.asarray(ids, dtype=np.int64))]
        return self.rows[torch.from_numpy(pos)].to(torch.float32)


# Writers still running at interpreter exit are stopped (their queue applied) before Python
# finalizes: a daemon thread killed inside a native write would abort the process.
_LIVE_WRITERS: "weakref.WeakSet[WriteBehind]" = weakref.WeakSet()


@atexit.register
def _stop_writers_at_exit() -> None:
    for wb in list(_LIVE_WRITERS):
        try:
            wb.stop()
        except Exception:
            pass


class WriteBehind:
    """The write queue and its background thread, shared by the SSD backends.

    apply: a weakref.WeakMethod of the store's apply(batches), which writes a list of QueuedBatch
    to the backend's files (not yet durable): the thread does not keep the store alive, so a store
    dropped unclosed is collected (its files closed, its lock let go) and its queue with it, as
    writes not flushed may be. classify(exc) turns apply's exception into a StoreError.
    max_batch_rows bounds the rows handed to one apply() call. stats: the store's counter dict (writes, rows_written,
    bytes_written, rows_queued_hits are counted here).
    Threading: enqueue/take_queued/drain from the store's caller thread; apply runs on
    the writer thread. After apply fails the error sticks: every later call raises it.
    """

    def __init__(self, path: str, apply: "weakref.WeakMethod[Callable[[list], int]]",
                 classify: Callable[[Exception], Exception], queue_rows: int,
                 max_batch_rows: int, stats: dict, name: str = "ssd-writer"):
        self.path = path
        self._apply = apply
        self._classify = classify
        self.queue_rows = queue_rows
        self._max_batch_rows = max_batch_rows
        self._stats = stats
        # _lock guards _queue, _pending, counters and error; _cond signals changes.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: deque[QueuedBatch] = deque()
        self._pending: dict[int, QueuedBatch] = {}  # id -> newest batch holding it
        self._queued_rows = 0
        self._enqueued_seq = 0
        self._written_seq = 0
        self.error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        _LIVE_WRITERS.add(self)

    def raise_error(self) -> None:
        err = self.error
        raise StoreWriteError(
            f"ssd_path {self.path}: the background writer failed; writes queued since the last "
            f"successful flush() may be lost (data flushed before is intact; reopen the table "
            f"after fixing the cause): {err}") from err

    def set_error(self, err: BaseException) -> None:
        with self._cond:
            if self.error is None:
                self.error = err
            self._cond.notify_all()

    def enqueue(self, ids_np: np.ndarray, stored: torch.Tensor) -> None:
        """Queues a copy-owned batch; blocks while the queue is over queue_rows rows."""
        n = ids_np.size
        id_list = ids_np.tolist()
        with self._cond:
            while self._queued_rows > 0 and self._queued_rows + n > self.queue_rows \
                    and self.error is None:
                self._cond.wait()
            if self.error is not None:
                self.raise_error()
            self._enqueued_seq += 1
            batch = QueuedBatch(self._enqueued_seq, ids_np, stored)
            self._queue.append(batch)
            self._queued_rows += n
            self._pending.update(zip(id_list, itertools.repeat(batch)))
            self._stats["writes"] += 1
            self._cond.notify_all()

    def take_queued(self, id_list: list, out: torch.Tensor) -> np.ndarray:
        """Read-your-writes: fills out[k] for every id still queued; returns the positions
        k (int64 array) of the ids that must be read from the files."""
        n = len(id_list)
        with self._lock:
            pending = self._pending
            hits = [pending.get(i) for i in id_list] if pending else None
        if hits is None:
            return np.arange(n)
        by_batch: dict[int, tuple[QueuedBatch, list, list]] = {}
        miss = []
        for k, b in enumerate(hits):
            if b is None or b.done:  # a done batch is in the files: read it there
                miss.append(k)
            else:
                entry = by_batch.get(b.seq)
                if entry is None:
                    entry = by_batch[b.seq] = (b, [], [])
                entry[1].append(k)
                entry[2].append(id_list[k])
        for batch, ks, bids in by_batch.values():
            out[torch.tensor(ks)] = batch.rows_of(bids)
        self._stats["rows_queued_hits"] += n - len(miss)
        return np.asarray(miss, dtype=np.int64)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return  # stopping and drained
                batches, rows = [], 0
                while self._queue and (not batches or rows + len(self._queue[0].ids)
                                       <= self._max_batch_rows):
                    b = self._queue.popleft()
                    batches.append(b)
                    rows += len(b.ids)
            apply = self._apply()
            if apply is None:
                return  # the store was dropped unclosed: its queue goes with it
            try:
                nbytes = apply(batches)
            except BaseException as e:  # noqa: BLE001 - any failure must reach the caller
                with self._cond:
                    self.error = self._classify(e) if isinstance(e, Exception) else e
                    # Put the batches back so that read() still sees them (read-your-writes).
                    self._queue.extendleft(reversed(batches))
                    self._cond.notify_all()
                return
            with self._cond:
                for b in batches:
                    b.done = True
                    self._queued_rows -= len(b.ids)
                self._written_seq = batches[-1].seq
                self._stats["rows_written"] += rows
                self._stats["bytes_written"] += nbytes
                if not self._queue:
                    self._pending.clear()  # every entry's batch is done
                elif len(self._pending) > 2 * self.queue_rows:
                    self._pending = {k: b for k, b in self._pending.items() if not b.done}
                self._cond.notify_all()
            del apply

    def drain(self) -> None:
        """Waits until every enqueue() made before the call has been applied."""
        with self._cond:
            target = self._enqueued_seq
            while self._written_seq < target and self.error is None:
                self._cond.wait()
            if self.error is not None:
                self.raise_error()

    def queue_stats(self) -> dict:
        with self._lock:
            return {"queue_rows": self._queued_rows, "queue_batches": len(self._queue),
                    "writer_error": None if self.error is None else str(self.error)}

    def stop(self) -> None:
        """Lets the thread finish the queue and exit (after an error it has exited)."""
        if threading.current_thread() is self._thread:
            # (its store, dropped in a reference cycle, finalized by a collection on this thread,
            # maybe inside _loop's hold of _cond: no lock taken; the loop sees the flag)
            self._stopping = True
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self.error is None:
            self._thread.join()


class StoreBase:
    """What the SSD backends share above their files: the RowStore interface's block moves
    (read_to / write_from through read / write; a backend may move rows in place instead),
    argument checks and the context manager. A subclass sets path, width, state and _closed and
    implements read(ids, out), write(ids, rows) and _id_limit() (ids are in [0, limit))."""

    def read_to(self, ids: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
        """Rows of unique ids into dst[dst_rows] (dst: a float32 [rows, width] CPU block, e.g. a
        cache tier's pool). On an error some of those dst rows may have been overwritten."""
        rows_np = self._check_block_rows("dst", dst, dst_rows, len(ids))
        block = torch.empty(len(ids), self.width, dtype=torch.float32)
        self.read(ids, block)
        _copy_rows(block, np.arange(len(rows_np), dtype=np.int64), dst, rows_np)

    def write_from(self, ids: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor) -> None:
        """Stores src[src_rows] as the rows of unique ids (as write() does)."""
        rows_np = self._check_block_rows("src", src, src_rows, len(ids))
        block = torch.empty(len(ids), self.width, dtype=torch.float32)
        _copy_rows(src, rows_np, block, np.arange(len(rows_np), dtype=np.int64))
        self.write(ids, block)

    def _check_block_rows(self, name: str, block, rows: torch.Tensor, n: int) -> np.ndarray:
        """read_to's / write_from's block (a contiguous float32 [rows, width] CPU tensor) and its
        row numbers (int64 [n], each inside the block). Returns the row numbers as numpy."""
        self._check_open()
        if not isinstance(block, torch.Tensor) or block.dtype != torch.float32 or block.dim() != 2 \
                or block.shape[1] != self.width or not block.is_contiguous() or block.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous float32 [rows, {self.width}] CPU tensor, got "
                             f"{getattr(block, 'dtype', type(block))} {tuple(getattr(block, 'shape', ()))}")
        rows_np = rows.to(torch.int64).contiguous().numpy()
        if rows_np.shape != (n,):
            raise ValueError(f"{name}_rows has {rows_np.size} entries for {n} ids")
        if n and (rows_np.min() < 0 or rows_np.max() >= block.shape[0]):
            bad = int(rows_np.min()) if rows_np.min() < 0 else int(rows_np.max())
            raise IndexError(f"{name} row {bad} out of range [0, {block.shape[0]})")
        return rows_np

    def _id_limit(self) -> int:
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"ssd_path {self.path}: the store is closed")

    def _check_ids(self, ids: torch.Tensor, name: str = "ids") -> np.ndarray:
        return check_ids(ids, self._id_limit(), name)

    def _check_rows(self, rows: torch.Tensor, n: int, name: str) -> None:
        check_rows(rows, n, self.width, name)

    def _check_read(self, ids: torch.Tensor, out: torch.Tensor) -> np.ndarray:
        """Checks read()'s arguments; returns the ids as numpy."""
        self._check_open()
        ids_np = self._check_ids(ids)
        self._check_rows(out, ids_np.size, "out")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
        return ids_np

    def _check_written_ids_args(self, start: int, limit: int | None) -> None:
        self._check_open()
        if start < 0:
            raise ValueError(f"start {start} must be >= 0")
        if limit is not None and limit < 0:
            raise ValueError(f"limit {limit} must be >= 0")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class QueuedStore(StoreBase):
    """A store whose write() goes through a WriteBehind (RocksDBStore): read-your-writes,
    stats() with the queue's figures, close() that stops the writer.

    A subclass also sets storage_dtype, _stats (new_stats()) and _wb (a WriteBehind) and
    implements _close_files() (releases the files and the lock after the writer stopped;
    returns an error or None)."""

    def _close_files(self) -> Exception | None:
        raise NotImplementedError

    def _begin_read(self, ids: torch.Tensor, out: torch.Tensor) -> tuple[np.ndarray, list, np.ndarray] | None:
        """Checks read()'s arguments and serves the rows still queued for writing
        (read-your-writes). Returns None for an empty read, else (ids as numpy, ids as a
        list, positions of the rows still to fetch)."""
        ids_np = self._check_read(ids, out)
        if ids_np.size == 0:
            return None
        id_list = ids_np.tolist()
        return ids_np, id_list, self._wb.take_queued(id_list, out)

    def _begin_written_ids(self, start: int, limit: int | None) -> None:
        """Checks written_ids' arguments, then waits until queued writes are stored."""
        self._check_written_ids_args(start, limit)
        self._wb.drain()

    @property
    def _error(self) -> BaseException | None:
        return self._wb.error

    def _raise_error(self) -> None:
        self._wb.raise_error()

    def write(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """ids: int64 [n] unique; rows: float32 [n, width]. Queues the rows and returns;
        blocks while more than write_queue_rows rows are queued (backpressure).
        Raises StoreWriteError if the background writer failed."""
        self._check_open()
        ids_np = self._check_ids(ids)
        n = ids_np.size
        self._check_rows(rows, n, "rows")
        if self._error is not None:
            self._raise_error()
        if n == 0:
            return
        # Copies: the caller may reuse its buffers as soon as write() returns.
        self._wb.enqueue(ids_np.copy(), rows.to(self.storage_dtype, copy=True).contiguous())

    def stats(self) -> dict:
        s = dict(self._stats)
        s.update(self._wb.queue_stats())
        return s

    def close(self) -> None:
        """Flushes, stops the threads and releases the table (its lock). Safe to call twice;
        if the flush fails the table is still released and the error is raised."""
        if self._closed:
            return
        err = None
        try:
            if self._error is None:
                self.flush()
        except StoreError as e:
            err = e
        self._wb.stop()  # after an error the writer has exited already
        self._closed = True
        err = self._close_files() or err
        if self._error is not None:
            self._raise_error()  # the writer's error is the cause of any later one
        if err is not None:
            raise err


def _copy_rows(src: torch.Tensor, src_rows: np.ndarray, dst: torch.Tensor, dst_rows: np.ndarray) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]], natively (torch's indexing spins its thread pool)."""
    from . import _C

    _C.copy_rows(src, torch.from_numpy(src_rows), dst, torch.from_numpy(dst_rows))


def new_stats() -> dict:
    return dict.fromkeys(
        ("reads", "rows_found", "rows_queued_hits", "rows_initialized", "writes",
         "rows_written", "bytes_read", "bytes_written", "flushes"), 0)


def copy_sparse(src: str, dst: str) -> None:
    """Copies file src to dst (new), keeping holes: each data extent (SEEK_DATA/SEEK_HOLE)
    goes through os.copy_file_range, which reflinks or copies inside the kernel where the
    filesystem can; the same result as `cp --reflink=auto --sparse=always`. fsyncs dst."""
    fin = os.open(src, os.O_RDONLY)
    try:
        fout = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            size = os.fstat(fin).st_size
            os.ftruncate(fout, size)
            pos = 0
            while pos < size:
                try:
                    start = os.lseek(fin, pos, os.SEEK_DATA)
                except OSError:  # ENXIO: no data after pos
                    break
                end = os.lseek(fin, start, os.SEEK_HOLE)
                off = start
                while off < end:
                    try:
                        n = os.copy_file_range(fin, fout, end - off, off, off)
                    except OSError as e:  # across filesystems (EXDEV on some kernels), or not offered
                        if e.errno not in (errno.EXDEV, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                            raise
                        n = _copy_range(fin, fout, min(end - off, 8 << 20), off)
                    if n == 0:
                        raise StoreError(f"cannot copy {src} to {dst}: unexpected end at {off}")
                    off += n
                pos = end
            os.fsync(fout)
        finally:
            os.close(fout)
    finally:
        os.close(fin)


def _copy_range(fin: int, fout: int, n: int, off: int) -> int:
    """Copies up to n bytes at off from fin to fout by reads and writes; returns the bytes copied."""
    data = os.pread(fin, n, off)
    done = 0
    while done < len(data):
        done += os.pwrite(fout, data[done:], off + done)
    return len(data)


def write_json_atomic(path: str, record: dict) -> None:
    """Replaces the file at path by record as JSON, atomically and durably: a temporary file,
    fsync, rename, fsync of the directory. A crash leaves the old file or the new one."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def build_directory(path: str, build) -> None:
    """A new directory at path, whole or not at all: build(tmp) makes and fills tmp, a sibling
    named path + '.partial-<pid>', which is then renamed to path (the parent fsynced). A crash on
    the way leaves no directory at path (only the '.partial' one, to remove); an error removes
    what build made. ValueError if path exists."""
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path):
        raise ValueError(f"checkpoint path {path}: already exists; give a new directory")
    tmp = f"{path}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # (one this process left before)
    try:
        build(tmp)
        fsync_dir(tmp)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(os.path.dirname(path))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
