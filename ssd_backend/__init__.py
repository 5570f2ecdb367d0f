"""The SSD tier of tieredemb: backing stores that keep rows on disk.

- RocksDBStore (RocksDB through rocksdict, rocksdb_store.py) is the default: sparse 64-bit ids,
  tables where most rows are never written, optional lz4 compression.
- LogStore (native append-only segments, log_store.py): training. Write-back is one sequential
  record per batch; reads come from the segments' mappings. Dense ids [0, num_embeddings).
- SlotFileStore (native fixed-size slots addressed by row id, slot_store.py): dense id ranges,
  read-heavy use and cold reads (O_DIRECT); writes dirty a page per row.
open_store() picks one by name, or by what an existing table directory holds.
"""

from __future__ import annotations

import os

import torch

from . import _C
from .common import StoreCorruptedError, StoreError, StoreLockedError, StoreWriteError
from .rocksdb_store import RocksDBStore
from .log_store import LogStore
from .slot_store import SlotFileStore

from .options import DEFAULT_BACKEND, LogOptions, RocksDBOptions, SlotOptions, StoreOptions, parse_options

_C.set_num_threads(torch.get_num_threads())  # the native files' pool: as many threads as torch's

BACKENDS = {"rocksdb": RocksDBStore, "slots": SlotFileStore, "log": LogStore}


def detect_backend(path) -> str | None:
    """'rocksdb', 'slots' or 'log' for a directory that holds that kind of table, else None."""
    path = os.fspath(path)
    if SlotFileStore.is_table(path):
        return "slots"
    if LogStore.is_table(path):
        return "log"
    if os.path.isfile(os.path.join(path, "CURRENT")):
        return "rocksdb"
    return None


def open_store(path, width, initializer, meta=None, options: StoreOptions | dict | None = None):
    """Opens (or creates) an SSD table. options: the backend and its settings (RocksDBOptions,
    LogOptions, SlotOptions, or {"backend": name, **settings}); None or a dict naming no backend:
    the kind the directory holds, or RocksDB for a new table. Naming a backend other than the one
    an existing table uses is a ValueError."""
    found = detect_backend(path)
    options = parse_options({} if options is None else options, found or DEFAULT_BACKEND)
    if found is not None and found != options.backend:
        raise ValueError(f"ssd_path {os.path.abspath(os.fspath(path))}: holds a {found!r} "
                         f"table, requested backend {options.backend!r}")
    return BACKENDS[options.backend](path, width, initializer, meta, **options.settings())


__all__ = ["RocksDBStore", "SlotFileStore", "LogStore", "open_store", "detect_backend", "BACKENDS",
           "StoreOptions", "RocksDBOptions", "LogOptions", "SlotOptions", "DEFAULT_BACKEND",
           "StoreError", "StoreLockedError", "StoreCorruptedError", "StoreWriteError"]
