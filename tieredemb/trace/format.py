"""The tieredemb trace file: a header, then lz4-compressed chunks of whole batches, streamed.

Layout (all integers little-endian):

    file header (fixed part, 64 bytes)
      0  8s  magic b"TEMBTRC\\0"
      8  u16 version (1)
     10  u8  key width in bytes (1, 2, 4 or 8: the narrowest that holds total_rows - 1)
     11  u8  reserved (0)
     12  u32 number of tables T
     16  u64 number of batches   } 2**64-1 until the writer closes (an unclosed
     24  u64 number of lookups   } file is rejected as incomplete)
     32  u64 number of chunks    }
     40  u64 data offset (where the first chunk starts)
     48  u32 crc32 of the whole header with this field zeroed
     52  u32 length of the metadata JSON (bytes)
     56  u64 reserved (0)
    variable part
      T x { u64 num_rows, u16 name length, name (utf-8) }
      metadata: a JSON object (utf-8)
    chunks, each
      0  4s  b"TCHK"
      4  u32 compressed payload size
      8  u32 raw payload size
     12  u32 batches in the chunk (b)
     16  u32 lookups in the chunk (n)
     20  u32 crc32 of the compressed payload
     24  u32 crc32 of bytes 0..24 of this chunk header
     28  payload: lz4.block (no stored size) of
           u32[b] batch lengths, then the n global keys as unsigned integers of the key width,
           byte-shuffled (all lowest bytes, then all second bytes, ...) so that the zero high
           bytes of small keys compress away.

Keys are global: key = table_base[t] + id (table_base = exclusive prefix sum of num_rows).
The writer streams: the header is rewritten with the counts at close (the file must be seekable).
Limits: a batch holds at most 2**27 lookups; chunk_lookups is at most 2**26.
Why byte-shuffled narrow keys: on 10M Zipf(1.05) lookups over 10M rows they take 3.0 bytes a
lookup (raw int64 + lz4: 4.1, u4 + lz4: 3.4) and decode at a few hundred million keys/s.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import lz4.block
import numpy as np

from tieredemb.output import PendingFile

MAGIC = b"TEMBTRC\0"
VERSION = 1
_FIXED = struct.Struct("<8sHBBIQQQQIIQ")  # 64 bytes
_CRC_AT = 48
_TABLE = struct.Struct("<QH")
_CHUNK = struct.Struct("<4sIIIIII")  # 28 bytes
_CHUNK_MAGIC = b"TCHK"
_OPEN = 2**64 - 1
# A chunk is cut after the batch that brings it to chunk_lookups, so it holds fewer than
# MAX_CHUNK_LOOKUPS + MAX_BATCH_LOOKUPS lookups: (2**26 + 2**27) * (8 + 4) bytes < lz4.block's 2 GiB.
MAX_CHUNK_LOOKUPS = 1 << 26
MAX_BATCH_LOOKUPS = 1 << 27


class TraceError(ValueError):
    """A trace file or trace content that breaks the format: names the file and byte offset,
    or the value and the rule."""


@dataclass
class TableInfo:
    name: str
    num_rows: int


@dataclass
class TraceHeader:
    """What a trace declares: its tables (in key order), and its batch and lookup counts."""

    tables: list[TableInfo]
    num_batches: int
    num_lookups: int
    meta: dict = field(default_factory=dict)

    @property
    def table_base(self) -> np.ndarray:
        """int64 [T]: key of row 0 of each table (exclusive prefix sum of num_rows)."""
        rows = np.array([t.num_rows for t in self.tables], dtype=np.int64)
        return np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64) if len(rows) else rows

    @property
    def total_rows(self) -> int:
        return sum(t.num_rows for t in self.tables)

    def table_of(self, keys: np.ndarray) -> np.ndarray:
        """int64 [n]: the table index of each global key."""
        return np.searchsorted(self.table_base, keys, "right").astype(np.int64) - 1

    def keys(self, table, ids) -> np.ndarray:
        """Global keys of `ids` local to `table` (an index, or an int array of indices per id).
        Raises TraceError naming the first id outside its table."""
        ids = np.asarray(ids, dtype=np.int64).ravel()
        table = np.asarray(table, dtype=np.int64)
        rows = np.array([t.num_rows for t in self.tables], dtype=np.int64)
        if table.size and (table.min() < 0 or table.max() >= len(rows)):
            bad = int(table.ravel()[(table.ravel() < 0) | (table.ravel() >= len(rows))][0])
            raise TraceError(f"table index {bad} out of range [0, {len(rows)})")
        limit = rows[table]
        bad = (ids < 0) | (ids >= limit)
        if bad.any():
            i = int(np.argmax(bad))
            t = int(table) if table.ndim == 0 else int(table[i])
            raise TraceError(f"id {int(ids[i])} of table {self.tables[t].name!r} (#{t}) out of range "
                             f"[0, {self.tables[t].num_rows})")
        return ids + self.table_base[table]


@dataclass
class Chunk:
    """Whole batches: keys int64 [n]; batch_offsets int64 [b+1], local to the chunk (0 .. n).
    first_batch: index in the trace of the chunk's first batch."""

    keys: np.ndarray
    batch_offsets: np.ndarray
    first_batch: int = 0

    @property
    def num_batches(self) -> int:
        return len(self.batch_offsets) - 1

    def batches(self) -> Iterator[np.ndarray]:
        for i in range(self.num_batches):
            yield self.keys[self.batch_offsets[i]:self.batch_offsets[i + 1]]


def key_width(total_rows: int) -> int:
    for w in (1, 2, 4):
        if total_rows <= 1 << (8 * w):
            return w
    return 8


def _encode(keys: np.ndarray, lengths: np.ndarray, width: int) -> np.ndarray:
    """The raw payload: u32 lengths, then the keys' byte planes (plane j = byte j of every key)."""
    n = keys.size
    raw = np.empty(4 * lengths.size + width * n, dtype=np.uint8)
    raw[:4 * lengths.size] = lengths.astype("<u4").view(np.uint8)
    raw[4 * lengths.size:].reshape(width, n)[:] = keys.astype("<u8").view(np.uint8).reshape(n, 8)[:, :width].T
    return raw


def _decode(raw: bytes, b: int, n: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    buf = np.frombuffer(raw, dtype=np.uint8)
    lengths = buf[:4 * b].view("<u4")
    planes = buf[4 * b:].reshape(width, n)
    keys = planes[0].astype(np.int64)
    for j in range(1, width):  # numpy, not a numba loop: reading a trace needs no compiler start-up
        keys |= planes[j].astype(np.int64) << (8 * j)
    offsets = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return keys, offsets


def _pack_header(tables: list[TableInfo], width: int, counts: tuple[int, int, int], meta: dict) -> bytes:
    var = b"".join(_TABLE.pack(t.num_rows, len(n := t.name.encode())) + n for t in tables)
    meta_bytes = json.dumps(meta, sort_keys=True).encode()
    data_offset = _FIXED.size + len(var) + len(meta_bytes)
    fixed = _FIXED.pack(MAGIC, VERSION, width, 0, len(tables), *counts, data_offset, 0, len(meta_bytes), 0)
    head = fixed + var + meta_bytes
    crc = zlib.crc32(head)
    return head[:_CRC_AT] + struct.pack("<I", crc) + head[_CRC_AT + 4:]


class TraceWriter:
    """Streams batches of global keys into a trace file at `path`.

    Batches are buffered and written as chunks of at least `chunk_lookups` lookups (a chunk always
    holds whole batches; the last may be smaller). Every key must lie in [0, total_rows) of the
    declared tables. The file is written beside `path` and takes its place at close(), which
    writes the last chunk and the counts into the header; abort(), or leaving a `with` block by an
    exception, removes it instead: `path` is then as it was (no half-written trace survives, and
    an existing file there is kept)."""

    def __init__(self, path, tables: list[TableInfo], *, chunk_lookups: int = 1 << 20, meta: dict | None = None):
        self.path = os.fspath(path)
        self.tables = [TableInfo(str(t.name), int(t.num_rows)) for t in tables]
        if not self.tables:
            raise TraceError("a trace needs at least one table")
        for i, t in enumerate(self.tables):
            if t.num_rows <= 0:
                raise TraceError(f"table {t.name!r} (#{i}) has num_rows {t.num_rows}: must be > 0")
        if len({t.name for t in self.tables}) != len(self.tables):
            raise TraceError(f"table names must be unique: {[t.name for t in self.tables]}")
        if not 1 <= chunk_lookups <= MAX_CHUNK_LOOKUPS:
            raise TraceError(f"chunk_lookups {chunk_lookups} out of range [1, {MAX_CHUNK_LOOKUPS}]")
        self.header = TraceHeader(self.tables, 0, 0, dict(meta or {}))
        self._total = self.header.total_rows
        if self._total > 2**63:
            raise TraceError(f"the tables hold {self._total} rows: keys must fit in int64 (at most 2**63 rows)")
        self._width = key_width(self._total)
        self._chunk_lookups = chunk_lookups
        self._keys: list[np.ndarray] = []      # pending batches, not yet in a chunk
        self._lengths: list[np.ndarray] = []
        self._pending = 0
        self._chunks = 0
        self._output = PendingFile(self.path)
        try:
            self._file = open(self._output.temp, "wb")
            self._file.write(_pack_header(self.tables, self._width, (_OPEN, _OPEN, _OPEN), self.header.meta))
        except BaseException:
            self._output.discard()
            raise

    def write_batch(self, keys) -> None:
        """Appends one batch: int [n] global keys, in lookup order."""
        keys = np.asarray(keys).ravel()
        self.write_batches(keys, np.array([0, keys.size], dtype=np.int64))

    def write_batches(self, keys, batch_offsets) -> None:
        """Appends len(batch_offsets) - 1 batches: batch i is keys[batch_offsets[i]:batch_offsets[i+1]]."""
        keys = np.asarray(keys)
        if keys.dtype.kind not in "iu" and keys.size:
            raise TraceError(f"keys must be integers, got dtype {keys.dtype}")
        keys = keys.astype(np.int64).ravel()  # a copy: the caller may reuse its buffer
        off = np.asarray(batch_offsets, dtype=np.int64).ravel()
        if off.size == 0 or off[0] != 0 or off[-1] != keys.size or np.any(np.diff(off) < 0):
            raise TraceError(f"batch_offsets must rise from 0 to len(keys) = {keys.size}; got "
                             f"{off[:3].tolist()}..{off[-3:].tolist()} ({off.size} entries)")
        bad = (keys < 0) | (keys >= self._total)
        if bad.any():
            i = int(np.argmax(bad))
            batch = self.header.num_batches + int(np.searchsorted(off, i, "right")) - 1
            raise TraceError(f"key {int(keys[i])} in batch {batch} out of range [0, {self._total}): keys run "
                             f"over the tables' rows, and the last table {self.tables[-1].name!r} ends at "
                             f"key {self._total - 1}")
        lengths = np.diff(off)
        if lengths.size and lengths.max() > MAX_BATCH_LOOKUPS:
            raise TraceError(f"batch of {int(lengths.max())} lookups exceeds the limit of {MAX_BATCH_LOOKUPS}")
        self._keys.append(keys)
        self._lengths.append(lengths)
        self._pending += keys.size
        self.header.num_batches += lengths.size
        self.header.num_lookups += keys.size
        if self._pending >= self._chunk_lookups:
            self._flush(final=False)

    def _flush(self, final: bool) -> None:
        """Writes pending batches as chunks; unless final, keeps the batches that do not yet fill one."""
        if not self._keys:
            return
        keys = np.concatenate(self._keys) if len(self._keys) > 1 else self._keys[0]
        lengths = np.concatenate(self._lengths) if len(self._lengths) > 1 else self._lengths[0]
        ends = np.cumsum(lengths)
        b0 = k0 = 0
        while b0 < lengths.size:
            # the chunk ends with the first batch that brings it to chunk_lookups
            b1 = int(np.searchsorted(ends, k0 + self._chunk_lookups, "left")) + 1
            if b1 > lengths.size:
                if not final:
                    break
                b1 = lengths.size
            k1 = int(ends[b1 - 1])
            self._write_chunk(keys[k0:k1], lengths[b0:b1])
            b0, k0 = b1, k1
        self._keys, self._lengths = ([keys[k0:]], [lengths[b0:]]) if b0 < lengths.size else ([], [])
        self._pending = keys.size - k0

    def _write_chunk(self, keys: np.ndarray, lengths: np.ndarray) -> None:
        raw = _encode(keys, lengths, self._width)
        comp = lz4.block.compress(raw, store_size=False)
        head = _CHUNK.pack(_CHUNK_MAGIC, len(comp), raw.size, lengths.size, keys.size, zlib.crc32(comp), 0)
        self._file.write(head[:24] + struct.pack("<I", zlib.crc32(head[:24])) + comp)
        self._chunks += 1

    def close(self) -> None:
        """Writes pending batches and the final counts, and moves the trace to `path`."""
        if self._file.closed:
            return
        try:
            self._flush(final=True)
            self._file.seek(0)
            counts = (self.header.num_batches, self.header.num_lookups, self._chunks)
            self._file.write(_pack_header(self.tables, self._width, counts, self.header.meta))
            self._file.close()
            self._output.commit()
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Closes and removes the file being written; `path` stays as it was."""
        if not self._file.closed:
            self._file.close()
        self._output.discard()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class TraceSource:
    """A trace being read, in any format (tieredemb.trace.open_any): `header` declares its tables
    and counts; chunks() yields its whole batches of global keys in trace order, one chunk in
    memory at a time, and starts over at each call. `path` names the file. A context manager."""

    path: str
    header: TraceHeader

    def chunks(self) -> Iterator[Chunk]:
        raise NotImplementedError

    def batches(self) -> Iterator[np.ndarray]:
        """Yields each batch's int64 global keys."""
        for chunk in self.chunks():
            yield from chunk.batches()

    def read_all(self) -> Chunk:
        """The whole trace as one Chunk (for traces that fit in memory)."""
        keys, lengths = [], []
        for c in self.chunks():
            keys.append(c.keys)
            lengths.append(np.diff(c.batch_offsets))
        offsets = np.zeros(sum(x.size for x in lengths) + 1, dtype=np.int64)
        if lengths:
            np.cumsum(np.concatenate(lengths), out=offsets[1:])
        return Chunk(np.concatenate(keys) if keys else np.zeros(0, np.int64), offsets, 0)

    def close(self) -> None:
        """Releases the file (reading again afterwards is an error)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TraceReader(TraceSource):
    """Reads a tieredemb trace file chunk by chunk; memory stays bounded by one chunk."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self._file = open(self.path, "rb")
        try:
            self.header = self._read_header()
        except BaseException:
            self._file.close()
            raise

    def _fail(self, offset: int, what: str) -> TraceError:
        return TraceError(f"{self.path}: {what} at byte {offset}")

    def _read_exact(self, offset: int, n: int, what: str) -> bytes:
        self._file.seek(offset)
        data = self._file.read(n)
        if len(data) != n:
            raise self._fail(offset, f"truncated {what}: expected {n} bytes, file has {len(data)}")
        return data

    def _read_header(self) -> TraceHeader:
        head = self._file.read(_FIXED.size)
        if len(head) < 8 or head[:8] != MAGIC:
            raise self._fail(0, f"not a tieredemb trace: magic {head[:8]!r}, expected {MAGIC!r}")
        if len(head) < _FIXED.size:
            raise self._fail(0, f"truncated header: expected {_FIXED.size} bytes, file has {len(head)}")
        _, version, width, _, ntables, nb, nl, nc, data_offset, crc, meta_len, _ = _FIXED.unpack(head)
        if version != VERSION:
            raise self._fail(8, f"unsupported trace version {version} (this reader knows {VERSION})")
        if not _FIXED.size <= data_offset <= 2**32:
            raise self._fail(40, f"corrupt header: data offset {data_offset}")
        var = self._read_exact(_FIXED.size, data_offset - _FIXED.size, "header")
        if zlib.crc32(head[:_CRC_AT] + b"\0\0\0\0" + head[_CRC_AT + 4:] + var) != crc:
            raise self._fail(0, f"header checksum mismatch (header bytes 0..{data_offset})")
        if nb == _OPEN:
            raise self._fail(16, "incomplete trace: the writer was not closed (no batch count)")
        tables, pos = [], 0
        for _ in range(ntables):
            rows, name_len = _TABLE.unpack_from(var, pos)
            pos += _TABLE.size
            tables.append(TableInfo(var[pos:pos + name_len].decode(), rows))
            pos += name_len
        meta = json.loads(var[pos:pos + meta_len].decode())
        self._width, self._num_chunks, self._data_offset = width, nc, data_offset
        return TraceHeader(tables, nb, nl, meta)

    def _chunk_header(self, offset: int) -> tuple[int, int, int, int, int]:
        """(compressed size, raw size, batches, lookups, payload crc) of the chunk at offset."""
        head = self._read_exact(offset, _CHUNK.size, "chunk header")
        magic, csize, rsize, b, n, pcrc, hcrc = _CHUNK.unpack(head)
        if magic != _CHUNK_MAGIC:
            raise self._fail(offset, f"corrupt chunk header: magic {magic!r}, expected {_CHUNK_MAGIC!r}")
        if zlib.crc32(head[:24]) != hcrc:
            raise self._fail(offset, "chunk header checksum mismatch")
        if rsize != 4 * b + n * self._width:
            raise self._fail(offset, f"corrupt chunk header: raw size {rsize} != 4*{b} + {n}*{self._width}")
        return csize, rsize, b, n, pcrc

    def _read_chunk(self, offset: int, first_batch: int) -> tuple[Chunk, int]:
        """The chunk at offset, and the offset of the next one."""
        csize, rsize, b, n, pcrc = self._chunk_header(offset)
        comp = self._read_exact(offset + _CHUNK.size, csize, "chunk payload")
        if zlib.crc32(comp) != pcrc:
            raise self._fail(offset + _CHUNK.size, "chunk payload checksum mismatch")
        try:
            raw = lz4.block.decompress(comp, uncompressed_size=rsize)
        except lz4.block.LZ4BlockError as e:
            raise self._fail(offset + _CHUNK.size, f"chunk payload does not decompress ({e})") from None
        keys, offsets = _decode(raw, b, n, self._width)
        if offsets[-1] != n:
            raise self._fail(offset, f"corrupt chunk: batch lengths sum to {offsets[-1]}, not {n}")
        return Chunk(keys, offsets, first_batch), offset + _CHUNK.size + csize

    def _check_end(self, offset: int, batches: int, lookups: int) -> None:
        """After the last chunk: no bytes left over, and the header's counts match the chunks'."""
        self._file.seek(0, os.SEEK_END)
        end = self._file.tell()
        if end < offset:
            raise TraceError(f"{self.path}: truncated file: it ends at byte {end}, its last chunk at byte {offset}")
        if end != offset:
            raise self._fail(offset, f"{end - offset} unexpected bytes after the last chunk")
        if (batches, lookups) != (self.header.num_batches, self.header.num_lookups):
            raise self._fail(16, f"header says {self.header.num_batches} batches and {self.header.num_lookups} "
                                 f"lookups, the chunks hold {batches} and {lookups}")

    def chunks(self, reverse: bool = False) -> Iterator[Chunk]:
        """Yields the trace's chunks in order, or the last chunk first with reverse=True (batches
        keep their order inside a chunk). Each call starts over; one chunk is in memory at a time."""
        offset, batch, lookups = self._data_offset, 0, 0
        if not reverse:
            for _ in range(self._num_chunks):
                chunk, offset = self._read_chunk(offset, batch)
                batch += chunk.num_batches
                lookups += chunk.keys.size
                yield chunk
            self._check_end(offset, batch, lookups)
            return
        index = []  # (offset, first batch) from the chunk headers alone
        for _ in range(self._num_chunks):
            csize, _, b, n, _ = self._chunk_header(offset)
            index.append((offset, batch))
            offset += _CHUNK.size + csize
            batch += b
            lookups += n
        self._check_end(offset, batch, lookups)
        for offset, batch in reversed(index):
            yield self._read_chunk(offset, batch)[0]

    def close(self) -> None:
        self._file.close()


def open_trace(path) -> TraceReader:
    """Opens a tieredemb trace file (this format only; open_any reads every supported format) for
    streaming reads (use as a context manager)."""
    return TraceReader(path)
