"""RocksDBStore: the SSD tier as an embedded RocksDB table (through rocksdict).

Layout on disk (one RocksDB database per table, raw mode):
- key   = row id as 8 bytes big-endian (so key order is id order); ids are in [0, 2**63).
- value = the row's `width` floats (weights ‖ optimizer state) in `storage_dtype`, native
  byte order; optional lz4 is RocksDB's block compression, transparent to this code.
- one extra key, META_KEY (not 8 bytes long, sorts after every id), holds a JSON record:
  {"format", "width", "storage_dtype", "meta"}; `meta` is the engine's table metadata.
Rows never written are not stored: read() fills them with initializer(ids, rows).

Threading: read/write/flush may be called from one thread at a time (the engine's);
a pool of reader threads serves each read, one background writer drains the write queue.
"""

from __future__ import annotations

import functools
import json
import os
import struct
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import rocksdict
import torch

from .common import (DTYPE_BY_NAME, MAX_ID, STORAGE_DTYPES, QueuedStore, StoreCorruptedError,
                     StoreError, StoreLockedError, StoreWriteError, WriteBehind, check_record,
                     build_directory, check_width, initialize, locked_error, new_stats, normalize_meta)
from .options import make_options

FORMAT = "tieredemb.ssd.rocksdb/1"
# Not 8 bytes long and starting with 0xff: never a row key, sorts after every row key.
META_KEY = b"\xff\xfftieredemb.meta"
_STORAGE_DTYPES = STORAGE_DTYPES
_DTYPE_BY_NAME = DTYPE_BY_NAME
_PACK_ID = struct.Struct(">Q").pack
# A read is split over reader threads in chunks of at least this many ids: small chunks
# keep many disk reads in flight (direct reads: each row is a disk read), large chunks cost
# less per-call overhead when the rows are cached (measured on 2 cores, bench_ssd.py).
_MIN_READ_CHUNK_DIRECT = 128
_MIN_READ_CHUNK_CACHED = 4096
# The background writer combines queued batches into one WriteBatch of at most this many rows.
_MAX_WRITE_BATCH_ROWS = 65536


# The error classes live in common.py (shared with SlotFileStore); re-exported here.
__all__ = ["RocksDBStore", "StoreError", "StoreLockedError", "StoreCorruptedError",
           "StoreWriteError"]


def _classify(path: str, what: str, exc: Exception) -> Exception:
    """Turns a rocksdict exception (plain Exception with RocksDB's status text) into ours."""
    msg = str(exc)
    low = msg.lower()
    if "lock" in low and ("hold" in low or "held" in low or "resource temporarily" in low
                          or "no locks" in low or "lock file" in low):
        return locked_error(path, os.path.join(path, "LOCK"), what, msg)
    if "corruption" in low or "checksum" in low or "truncated" in low or "no such file" in low \
            or "bad magic" in low or "sst file" in low or "manifest" in low:
        return StoreCorruptedError(
            f"ssd_path {path}: cannot {what}: the table's files are corrupted, truncated or "
            f"missing: {msg}")
    if "no space" in low or "nospc" in low:
        return StoreWriteError(f"ssd_path {path}: cannot {what}: disk full: {msg}")
    return StoreError(f"ssd_path {path}: cannot {what}: {msg}")


def _is_table_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "CURRENT"))


class RocksDBStore(QueuedStore):
    """An embedding table's rows in RocksDB: the SSD tier.

    path: a directory (created if missing or empty; otherwise it must hold a table).
    width: floats per row (None: adopt the stored width). initializer(ids, out, rows=None)
    fills rows never written. meta: the table's JSON-able metadata (None: adopt what is stored);
    on an existing table every field must equal the stored one (ValueError naming the field).
    settings: RocksDBOptions' fields (storage_dtype, compression, block_cache_bytes,
    row_cache_bytes, direct_reads, wal, reader_threads, write_queue_rows; see there). The row
    cache (0: off) pays off only when the store is read directly: the tiers above cache hot rows.
    """

    def __init__(self, path: str | os.PathLike, width: int | None, initializer, meta: dict | None = None,
                 **settings):
        self.path = os.path.abspath(os.fspath(path))
        self._db = None
        self._closed = True
        check_width(width)
        self.options = o = make_options("rocksdb", settings)
        storage_dtype, direct_reads, compression, wal = o.storage_dtype, o.direct_reads, o.compression, o.wal
        reader_threads, write_queue_rows = o.reader_threads, o.write_queue_rows
        block_cache_bytes, row_cache_bytes = o.block_cache_bytes, o.row_cache_bytes

        self.initializer = initializer
        self.wal = wal
        self.direct_reads = direct_reads
        self.compression = compression
        self.reader_threads = reader_threads
        self.write_queue_rows = write_queue_rows

        exists = os.path.isdir(self.path) and bool(os.listdir(self.path))
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise ValueError(f"ssd_path {self.path}: exists and is not a directory")
        if exists and not _is_table_dir(self.path):
            raise ValueError(
                f"ssd_path {self.path}: not an SSD table (no RocksDB CURRENT file) and not "
                f"empty; refusing to create a table in a directory that holds other files")

        opts = self._options(block_cache_bytes, row_cache_bytes, direct_reads, compression,
                             create=not exists)
        try:
            self._db = rocksdict.Rdict(self.path, opts)
        except Exception as e:  # rocksdict raises plain Exception with RocksDB's status
            raise _classify(self.path, "open the table", e) from None
        self._closed = False
        try:
            self._adopt_or_check(exists, width, storage_dtype, meta)
        except BaseException:
            self._db.close()
            self._db = None
            self._closed = True
            raise

        self._row_bytes = self.width * self.storage_dtype.itemsize
        self._write_opts = rocksdict.WriteOptions()
        self._write_opts.disable_wal = not wal
        self._readers = ThreadPoolExecutor(reader_threads, thread_name_prefix="ssd-reader")

        self._stats = new_stats()
        self._wb = WriteBehind(self.path, weakref.WeakMethod(self._apply_batches),
                               functools.partial(_classify, self.path, "write rows"),
                               write_queue_rows, _MAX_WRITE_BATCH_ROWS, self._stats)
        weakref.finalize(self, self._wb.stop)  # (dropped unclosed: the thread ends, the files close)

    # ----------------------------------------------------------------------------- opening

    @staticmethod
    def _options(block_cache_bytes, row_cache_bytes, direct_reads, compression,
                 create) -> rocksdict.Options:
        opts = rocksdict.Options(raw_mode=True)
        opts.create_if_missing(create)
        opts.set_paranoid_checks(True)
        opts.increase_parallelism(max(2, os.cpu_count() or 2))
        opts.set_max_open_files(-1)
        opts.set_keep_log_file_num(2)  # (RocksDB's own info logs: each open rolled one, 1000 kept by default)
        opts.set_use_direct_reads(direct_reads)
        opts.set_compression_type(rocksdict.DBCompressionType.lz4() if compression == "lz4"
                                  else rocksdict.DBCompressionType.none())
        if row_cache_bytes > 0:
            opts.set_row_cache(rocksdict.Cache(row_cache_bytes))
        table = rocksdict.BlockBasedOptions()
        if block_cache_bytes > 0:
            table.set_block_cache(rocksdict.Cache(block_cache_bytes))
        else:
            table.disable_cache()
        table.set_bloom_filter(10, False)
        table.set_data_block_index_type(rocksdict.DataBlockIndexType.binary_and_hash())
        opts.set_block_based_table_factory(table)
        return opts

    def _adopt_or_check(self, exists, width, storage_dtype, meta) -> None:
        try:
            raw = self._db.get(META_KEY)
        except Exception as e:
            raise _classify(self.path, "read the table metadata", e) from None
        requested_meta = None if meta is None else normalize_meta(meta)
        if raw is None:
            if exists:
                raise ValueError(
                    f"ssd_path {self.path}: a RocksDB database without the tieredemb metadata "
                    f"key; not an SSD table")
            if width is None:
                raise ValueError(f"ssd_path {self.path}: new table needs a width (got None)")
            if requested_meta is not None and "width" in requested_meta \
                    and requested_meta["width"] != width:
                raise ValueError(f"ssd_path {self.path}: meta width {requested_meta['width']} "
                                 f"!= width argument {width}")
            record = {"format": FORMAT, "width": width,
                      "storage_dtype": _STORAGE_DTYPES[storage_dtype],
                      "meta": requested_meta if requested_meta is not None else {}, "state": {}}
            self._put_record(record)
        else:
            record = self._parse_record(self.path, raw)
            check_record(self.path, record, width, storage_dtype, meta)
        self.record = record
        self.width, self.storage_dtype = record["width"], _DTYPE_BY_NAME[record["storage_dtype"]]
        self.meta, self.state = record["meta"], record.get("state", {})

    def _put_record(self, record: dict) -> None:
        """The table's record under META_KEY, synced (atomic: one key)."""
        wo = rocksdict.WriteOptions()
        wo.sync = True
        try:
            self._db.put(META_KEY, json.dumps(record, sort_keys=True).encode(), wo)
        except Exception as e:
            raise _classify(self.path, "write the table metadata", e) from None

    @staticmethod
    def _parse_record(path: str, raw: bytes) -> dict:
        try:
            record = json.loads(raw)
            ok = (record.get("format") == FORMAT and isinstance(record.get("width"), int)
                  and record.get("storage_dtype") in _DTYPE_BY_NAME
                  and isinstance(record.get("meta"), dict))
        except (ValueError, AttributeError):
            ok = False
        if not ok:
            raise StoreCorruptedError(f"ssd_path {path}: the table metadata record is not "
                                      f"valid {FORMAT} JSON: {raw[:200]!r}")
        return record

    @classmethod
    def read_meta(cls, path: str | os.PathLike) -> dict:
        """The stored record of the table at path, without locking it:
        {"format", "width", "storage_dtype", "meta": {...}}. Raises ValueError if not a table."""
        path = os.path.abspath(os.fspath(path))
        if not _is_table_dir(path):
            raise ValueError(f"ssd_path {path}: not an SSD table (no RocksDB CURRENT file)")
        try:
            db = rocksdict.Rdict(path, rocksdict.Options(raw_mode=True),
                                 access_type=rocksdict.AccessType.read_only(False))
        except Exception as e:
            raise _classify(path, "open the table read-only", e) from None
        try:
            raw = db.get(META_KEY)
        finally:
            db.close()
        if raw is None:
            raise ValueError(f"ssd_path {path}: a RocksDB database without the tieredemb "
                             f"metadata key; not an SSD table")
        return cls._parse_record(path, raw)

    # ------------------------------------------------------------------------------- reads

    def _id_limit(self) -> int:
        return self.meta.get("num_embeddings") or MAX_ID

    def _get_chunk(self, keys: list) -> tuple[list | None, bytearray, list]:
        """One batched MultiGet (rocksdict releases the GIL inside it). Returns
        (indices found, or None when all were found; their rows joined; the raw values).
        Joining here, per chunk, keeps buffers small enough for malloc to reuse (a fresh
        32 MiB buffer per read costs more in page faults than the copy itself)."""
        values = self._db.get(keys)
        if None in values:
            found = [k for k, v in enumerate(values) if v is not None]
            return found, bytearray().join([values[k] for k in found]), values
        return None, bytearray().join(values), values

    def read(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """ids: int64 [n] unique; out: float32 [n, width] contiguous. Fills out with the rows:
        queued value if a write is still queued, else the stored row, else initializer."""
        # 1. Rows still queued for writing (read-your-writes).
        begun = self._begin_read(ids, out)
        if begun is None:
            return
        ids_np, id_list, todo = begun
        n = ids_np.size

        # 2. Stored rows: batched MultiGets on the reader pool, then 3. the initializer.
        m = todo.size
        if m:
            todo_ids = id_list if m == n else ids_np[todo].tolist()
            keys = list(map(_PACK_ID, todo_ids))
            min_chunk = _MIN_READ_CHUNK_DIRECT if self.direct_reads else _MIN_READ_CHUNK_CACHED
            nchunks = min(self.reader_threads, max(1, m // min_chunk))
            step = -(-m // nchunks)
            try:
                if nchunks == 1:
                    chunks = [self._get_chunk(keys)]
                else:
                    futs = [self._readers.submit(self._get_chunk, keys[s:s + step])
                            for s in range(0, m, step)]
                    chunks = [f.result() for f in futs]
            except Exception as e:
                raise _classify(self.path, "read rows", e) from None
            for c, (found, buf, values) in enumerate(chunks):
                self._fill(ids_np, todo[c * step:c * step + len(values)], found, buf, values,
                           out, whole=(m == n and found is None))
        self._stats["reads"] += n

    def _fill(self, ids_np, todo, found, buf, values, out, whole) -> None:
        """Puts one chunk's rows at out[todo]; rows not found get the initializer."""
        m = len(values)
        nfound = m if found is None else len(found)
        if len(buf) != nfound * self._row_bytes:
            bad = next(k for k, v in enumerate(values)
                       if v is not None and len(v) != self._row_bytes)
            raise StoreCorruptedError(
                f"ssd_path {self.path}: row {int(ids_np[todo[bad]])} has "
                f"{len(values[bad])} bytes, expected {self._row_bytes} "
                f"(width {self.width} x {self.storage_dtype})")
        if nfound:
            rows = torch.frombuffer(buf, dtype=self.storage_dtype).view(nfound, self.width)
            if whole:  # todo is a contiguous range of out: plain copy
                out[int(todo[0]):int(todo[0]) + m].copy_(rows)
            else:
                dest = torch.from_numpy(todo if found is None else todo[found])
                out[dest] = rows.to(torch.float32)
        if nfound < m:
            missing = todo[[k for k, v in enumerate(values) if v is None]]
            self._initialize(ids_np, missing, out)
        self._stats["rows_found"] += nfound
        self._stats["bytes_read"] += nfound * self._row_bytes

    def _initialize(self, ids_np, positions: np.ndarray, out: torch.Tensor) -> None:
        self._stats["rows_initialized"] += initialize(self.path, self.initializer, ids_np,
                                                      positions, out)

    # ------------------------------------------------------------------------------ writes

    def _apply_batches(self, batches: list) -> int:
        """Writer thread: the batches as one RocksDB WriteBatch (not yet synced)."""
        wb = rocksdict.WriteBatch(raw_mode=True)
        put = wb.put
        nbytes = 0
        rb = self._row_bytes
        for b in batches:
            data = b.rows.view(torch.uint8).numpy().tobytes()
            for j, key in enumerate(map(_PACK_ID, b.ids.tolist())):
                put(key, data[j * rb:(j + 1) * rb])
            nbytes += len(data)
        self._db.write(wb, self._write_opts)
        return nbytes

    def _drain(self) -> None:
        """Waits until every write() made before the call is in RocksDB (not yet durable)."""
        self._wb.drain()

    def flush(self, state: dict | None = None) -> None:
        """Returns when every write() made before the call is durable: in the synced WAL
        (wal=True) or in an SST file (wal=False). Survives kill -9 once it returned.
        state: stored in the table's record (one key, synced), after the rows."""
        self._check_open()
        self._drain()
        try:
            if self.wal:
                self._db.flush_wal(True)
            else:
                self._db.flush(True)
        except Exception as e:
            self._wb.set_error(_classify(self.path, "flush", e))
            self._raise_error()
        if state is not None and normalize_meta(state) != self.state:
            record = {**self.record, "state": normalize_meta(state)}
            self._put_record(record)
            self.record, self.state = record, record["state"]
        self._stats["flushes"] += 1

    # --------------------------------------------------------------------- export, snapshot

    def written_ids(self, start: int = 0, limit: int | None = None) -> torch.Tensor:
        """Sorted int64 ids of rows ever written with id >= start, at most `limit` of them
        (queued writes included)."""
        self._begin_written_ids(start, limit)
        out = []
        if limit == 0 or start >= MAX_ID:
            return torch.empty(0, dtype=torch.int64)
        it = self._db.iter()
        try:
            it.seek(_PACK_ID(start))
            while it.valid():
                key = it.key()
                if len(key) != 8 or key[0] >= 0x80:
                    break
                out.append(key)
                if limit is not None and len(out) >= limit:
                    break
                it.next()
            it.status()
        except Exception as e:
            raise _classify(self.path, "list written rows", e) from None
        finally:
            del it
        ids = np.frombuffer(b"".join(out), dtype=">u8").astype(np.int64)
        return torch.from_numpy(ids)

    def checkpoint(self, path: str | os.PathLike) -> None:
        """Writes a consistent snapshot of the table (every write() before the call
        included) to path, a new directory, as RocksDB hard links; it opens as a table."""
        self._check_open()
        path = os.path.abspath(os.fspath(path))
        if os.path.exists(path):
            raise ValueError(f"checkpoint path {path}: already exists; give a new directory")
        self.flush()
        try:  # (built beside path and renamed to it whole: a crash leaves no directory at path)
            build_directory(path, lambda to: rocksdict.Checkpoint(self._db).create_checkpoint(to))
        except Exception as e:
            raise _classify(self.path, f"write checkpoint {path}", e) from None

    # ------------------------------------------------------------------------------- admin

    def _close_files(self) -> Exception | None:
        self._readers.shutdown(wait=True)
        err = None
        try:
            self._db.close()
        except Exception as e:  # a DB in background-error state fails to close, yet unlocks
            err = _classify(self.path, "close the table", e)
        self._db = None
        return err

    def __repr__(self) -> str:
        return (f"RocksDBStore({self.path!r}, width={self.width}, "
                f"storage_dtype={self.storage_dtype}, closed={self._closed})")
