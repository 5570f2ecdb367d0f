"""Typed settings of each SSD backend: one frozen dataclass per backend, checked once, here.

    RocksDBOptions(compression="lz4", block_cache_bytes=1 << 30)   # backend "rocksdb" (default)
    LogOptions(segment_bytes=64 << 20)                              # backend "log" (training)
    SlotOptions(direct_reads=True)                                  # backend "slots" (read-heavy)

parse_options() turns the dict form ({"backend": "log", "segment_bytes": ...}) into one and
rejects unknown names with the list of valid ones.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

STORAGE_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _check(name: str, value, rule: str, ok: bool) -> None:
    if not ok:
        raise ValueError(f"{name} {value!r}: must be {rule}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class StoreOptions:
    """Settings every backend takes. storage_dtype: how rows are stored on disk (float32,
    float16 or bfloat16; the tiers above hold float32)."""

    backend: ClassVar[str] = ""
    storage_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        _check("storage_dtype", self.storage_dtype, f"one of {list(STORAGE_DTYPES)}",
               self.storage_dtype in STORAGE_DTYPES)
        for f in dataclasses.fields(self):  # (a string "false" would be true)
            if f.type == "bool":
                _check(f.name, getattr(self, f.name), "True or False", isinstance(getattr(self, f.name), bool))

    def settings(self) -> dict:
        """The settings as keyword arguments of the backend's store."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class RocksDBOptions(StoreOptions):
    """RocksDB (through rocksdict): sparse 64-bit ids, only written rows take space.
    compression: None or "lz4" (RocksDB block compression). block_cache_bytes: RocksDB's block
    cache; row_cache_bytes: its row cache (0: off). direct_reads: O_DIRECT reads. wal: write-ahead
    log on (flush syncs it) or off (flush writes the memtable to an SST file). reader_threads:
    parallel MultiGet calls per read. write_queue_rows: rows queued for the background writer
    before a write blocks (backpressure)."""

    backend: ClassVar[str] = "rocksdb"
    compression: str | None = None
    block_cache_bytes: int = 256 << 20
    row_cache_bytes: int = 0
    direct_reads: bool = False
    wal: bool = True
    reader_threads: int = 16
    write_queue_rows: int = 1 << 18

    def __post_init__(self):
        super().__post_init__()
        _check("compression", self.compression, "None or 'lz4'", self.compression in (None, "lz4"))
        for name in ("block_cache_bytes", "row_cache_bytes"):
            v = getattr(self, name)
            _check(name, v, "an int >= 0", _is_int(v) and v >= 0)
        _check("reader_threads", self.reader_threads, "an int >= 1",
               _is_int(self.reader_threads) and self.reader_threads >= 1)
        _check("write_queue_rows", self.write_queue_rows, "an int >= 1",
               _is_int(self.write_queue_rows) and self.write_queue_rows >= 1)


@dataclasses.dataclass(frozen=True)
class NativeFileOptions(StoreOptions):
    """What the native file stores (log, slots) share. direct_reads: read with O_DIRECT (bypass
    the page cache; a filesystem without it, e.g. tmpfs, refuses at open). io_threads: native
    threads per read (O_DIRECT reads in flight, parallel page faults)."""

    direct_reads: bool = False
    io_threads: int = 32

    def __post_init__(self):
        super().__post_init__()
        _check("io_threads", self.io_threads, "an int in [1, 1024]",
               _is_int(self.io_threads) and 1 <= self.io_threads <= 1024)


@dataclasses.dataclass(frozen=True)
class LogOptions(NativeFileOptions):
    """Append-only segments: the backend for training. segment_bytes: the size of a segment
    file, for a new table (None: an eighth of the table's bytes, between 1 MiB and 256 MiB)."""

    backend: ClassVar[str] = "log"
    segment_bytes: int | None = None

    def __post_init__(self):
        super().__post_init__()
        _check("segment_bytes", self.segment_bytes, "None or an int in [65536, 2**40) (a row's offset has 40 bits)",
               self.segment_bytes is None or (_is_int(self.segment_bytes) and 1 << 16 <= self.segment_bytes < 1 << 40))


@dataclasses.dataclass(frozen=True)
class SlotOptions(NativeFileOptions):
    """A file of fixed-size slots addressed by row id: dense ids, read-heavy use."""

    backend: ClassVar[str] = "slots"


OPTIONS = {cls.backend: cls for cls in (RocksDBOptions, LogOptions, SlotOptions)}
DEFAULT_BACKEND = "rocksdb"  # for a new table whose options name no backend


def make_options(backend: str, settings: dict) -> StoreOptions:
    """The options of backend from keyword settings. ValueError naming an unknown backend or
    setting, with the valid ones."""
    if backend not in OPTIONS:
        raise ValueError(f"ssd backend {backend!r} is not one of {sorted(OPTIONS)}")
    cls = OPTIONS[backend]
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(settings) - set(valid))
    if unknown:
        raise ValueError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                         f"for the {backend!r} ssd backend; valid options: {', '.join(valid)}")
    return cls(**settings)


def parse_options(options, unnamed_backend: str) -> StoreOptions | None:
    """ssd_options as given: None, a StoreOptions, or a dict {"backend": name, **settings}; a
    dict that names no backend is for unnamed_backend (the one the table directory holds, or
    the default for a new table)."""
    if options is None or isinstance(options, StoreOptions):
        return options
    if not isinstance(options, dict):
        raise TypeError(f"ssd_options must be a dict or a StoreOptions (RocksDBOptions, LogOptions, "
                        f"SlotOptions), got {type(options).__name__}")
    settings = dict(options)
    return make_options(settings.pop("backend", None) or unnamed_backend, settings)