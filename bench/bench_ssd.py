"""SSD tier benchmark: RocksDBStore, SlotFileStore and LogStore against raw disk / memory peers,
in the same run (--backend rocksdb|slots|log|all).

Figures (medians over --repeats runs; 512-byte rows = width 128 float32):
- cold random reads: the store with direct reads (page cache bypassed; RocksDB: 8 MiB block
  cache; slots / log: O_DIRECT preads of the sectors holding each row from --threads native
  threads)
  vs the raw rate of the same disk: 4 KiB O_DIRECT preads at random offsets of a file as
  large as the table, from --threads threads (queue depth = threads). Target >= 0.7x.
- hot random reads: table in RocksDB's caches / the page cache (slots, log) vs torch.index_select
  from a DRAM tensor.
  Target >= 1M rows/s.
- sustained write-back: write() of the whole table plus flush() vs sequential write+fsync
  of the same bytes. Target >= 300K rows/s.
- random write-back (what training does): batches of --batch random ids rewritten in a
  written table, then flush(), vs the same sequential write+fsync peer.

Run: python bench/bench_ssd.py [--backend all] [--dir DIR] [--cold-rows 2000000] [--quick]
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ssd_backend import LogStore, RocksDBStore, SlotFileStore  # noqa: E402

WIDTH = 128  # 512-byte rows


def init_rows(ids, out):
    out.zero_()


def build_table(path, n, backend="rocksdb", batch=65536):
    """Writes n rows through write()+flush(); returns the write-back rate in rows/s."""
    shutil.rmtree(path, ignore_errors=True)
    rows = torch.rand(batch, WIDTH)
    meta = {"num_embeddings": n}
    if backend == "rocksdb":
        store = RocksDBStore(path, WIDTH, init_rows, meta, wal=True)
    elif backend == "log":
        store = LogStore(path, WIDTH, init_rows, meta)
    else:  # created for direct reads: 512-byte slots (= the row size here)
        store = SlotFileStore(path, WIDTH, init_rows, meta, direct_reads=True)
    with store as s:
        t = time.perf_counter()
        for start in range(0, n, batch):
            ids = torch.arange(start, min(n, start + batch))
            s.write(ids, rows[: len(ids)])
        s.flush()
        dt = time.perf_counter() - t
        if backend == "rocksdb":
            s._db.flush(True)  # memtable -> SST so that cold reads hit the disk
            s._db.compact_range(None, None)
    return n / dt


def open_for_reads(backend, path, cold, threads):
    if backend == "rocksdb":
        if cold:
            return RocksDBStore(path, WIDTH, init_rows, None, direct_reads=True,
                                block_cache_bytes=8 << 20, reader_threads=threads)
        return None  # the hot RocksDB store needs its cache sizes: see main()
    cls = LogStore if backend == "log" else SlotFileStore
    return cls(path, WIDTH, init_rows, None, direct_reads=cold, io_threads=threads)


def table_bytes(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.endswith(".sst") or f == "slots.bin" or f.startswith("seg-"))


def raw_write_rate(path, nbytes, row_bytes=512):
    buf = os.urandom(4 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t = time.perf_counter()
    done = 0
    while done < nbytes:
        done += os.write(fd, buf)
    os.fsync(fd)
    dt = time.perf_counter() - t
    os.close(fd)
    os.remove(path)
    return nbytes / row_bytes / dt


def make_raw_file(path, nbytes):
    if os.path.exists(path) and os.path.getsize(path) >= nbytes:
        return
    buf = os.urandom(4 << 20)
    with open(path, "wb") as f:
        for _ in range(-(-nbytes // len(buf))):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())


def raw_cold_rate(path, reads, threads):
    """4 KiB O_DIRECT preads at random aligned offsets from `threads` threads: reads/s."""
    size = os.path.getsize(path)
    blocks = size // 4096
    rng = np.random.default_rng()
    offsets = (rng.integers(0, blocks, reads) * 4096).tolist()
    per = -(-reads // threads)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)

    def worker(chunk):
        buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT needs
        for off in chunk:
            if os.preadv(fd, [buf], off) != 4096:
                raise OSError("short read")

    ths = [threading.Thread(target=worker, args=(offsets[i * per:(i + 1) * per],))
           for i in range(threads)]
    t = time.perf_counter()
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    dt = time.perf_counter() - t
    os.close(fd)
    return reads / dt


def store_read_rate(store, n, reads, batch):
    out = torch.empty(batch, WIDTH)
    rng = np.random.default_rng()
    batches = [torch.from_numpy(rng.choice(n, batch, replace=False).astype(np.int64))
               for _ in range(max(1, reads // batch))]
    t = time.perf_counter()
    for ids in batches:
        store.read(ids, out)
    return len(batches) * batch / (time.perf_counter() - t)


def gather_rate(table, n, reads, batch):
    rng = np.random.default_rng()
    batches = [torch.from_numpy(rng.choice(n, batch, replace=False).astype(np.int64))
               for _ in range(max(1, reads // batch))]
    out = torch.empty(batch, WIDTH)
    t = time.perf_counter()
    for ids in batches:
        torch.index_select(table, 0, ids, out=out)
    return len(batches) * batch / (time.perf_counter() - t)


def report(name, ours, peer_name, peer, target=None):
    line = (f"{name:<28} ours {ours / 1e3:9.1f} K rows/s | {peer_name} {peer / 1e3:9.1f} K/s | "
            f"ratio {ours / peer:5.2f}x")
    if target is not None:
        line += f" | target {target}"
    print(line, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "out", "ssd"))
    ap.add_argument("--cold-rows", type=int, default=2_000_000)
    ap.add_argument("--hot-rows", type=int, default=200_000)
    ap.add_argument("--threads", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--reads", type=int, default=65536, help="rows read per timed run")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--row-cache-mib", type=int, default=1024, help="hot reads: RocksDB row cache")
    ap.add_argument("--hot-threads", type=int, default=16,
                    help="hot reads: RocksDB reader threads / slot-file I/O threads")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.add_argument("--backend", choices=["rocksdb", "slots", "log", "all"], default="all")
    a = ap.parse_args()
    if a.quick:
        a.cold_rows, a.hot_rows, a.reads, a.repeats = 200_000, 50_000, 16384, 2
    os.makedirs(a.dir, exist_ok=True)
    print(f"# torch {torch.__version__}, {os.cpu_count()} cpus, dir {a.dir}, "
          f"threads {a.threads}, batch {a.batch}", flush=True)

    backends = ["rocksdb", "slots", "log"] if a.backend == "all" else [a.backend]
    raw_path = os.path.join(a.dir, "raw.bin")
    for backend in backends:
        print(f"## backend {backend}", flush=True)
        run_backend(a, backend, raw_path)


def run_backend(a, backend, raw_path):
    # Sustained write-back (also builds the cold table).
    cold_path = os.path.join(a.dir, f"cold-{backend}")
    w_ours, w_raw = [], []
    for r in range(max(1, a.repeats // 2)):
        w_ours.append(build_table(cold_path, a.cold_rows, backend))
        w_raw.append(raw_write_rate(os.path.join(a.dir, "seqwrite"), a.cold_rows * 512))
    print(f"# write-back runs ours {[round(x) for x in w_ours]} raw {[round(x) for x in w_raw]}")
    report(f"{backend} write-back (write+flush)", statistics.median(w_ours), "seq write+fsync",
           statistics.median(w_raw), ">= 300K rows/s")

    # Cold random reads.
    nbytes = table_bytes(cold_path)
    make_raw_file(raw_path, max(nbytes, 1 << 30))
    ours, raw = [], []
    with open_for_reads(backend, cold_path, True, a.threads) as s:
        store_read_rate(s, a.cold_rows, a.batch, a.batch)  # open files, load indexes
        for r in range(a.repeats):
            raw.append(raw_cold_rate(raw_path, a.reads, a.threads))
            ours.append(store_read_rate(s, a.cold_rows, a.reads, a.batch))
    ratios = [o / w for o, w in zip(ours, raw)]
    print(f"# cold: table {nbytes / 2**20:.0f} MiB, raw file "
          f"{os.path.getsize(raw_path) / 2**20:.0f} MiB; runs ours {[round(x) for x in ours]} "
          f"raw {[round(x) for x in raw]} per-run ratios {[round(x, 2) for x in ratios]}")
    report(f"{backend} cold random reads (O_DIRECT)", statistics.median(ours),
           "raw 4KiB O_DIRECT pread", statistics.median(raw), ">= 0.7x")

    # Hot random reads.
    hot_path = os.path.join(a.dir, f"hot-{backend}")
    build_table(hot_path, a.hot_rows, backend)
    table = torch.rand(a.hot_rows, WIDTH)
    ours, peer = [], []
    if backend == "rocksdb":
        s = RocksDBStore(hot_path, WIDTH, init_rows, None, block_cache_bytes=1 << 30,
                         row_cache_bytes=a.row_cache_mib << 20, reader_threads=a.hot_threads)
        label = f"rocksdb hot reads (row cache {a.row_cache_mib}M)"
    else:
        s = open_for_reads(backend, hot_path, False, a.hot_threads)
        label = f"{backend} hot reads (page cache)"
    with s:
        out = torch.empty(a.hot_rows, WIDTH)
        s.read(torch.arange(a.hot_rows), out)  # warm the caches
        for r in range(a.repeats):
            ours.append(store_read_rate(s, a.hot_rows, a.reads * 4, a.batch))
            peer.append(gather_rate(table, a.hot_rows, a.reads * 4, a.batch))
    print(f"# hot runs ours {[round(x) for x in ours]} peer {[round(x) for x in peer]}")
    report(label, statistics.median(ours), "torch index_select DRAM",
           statistics.median(peer), ">= 1M rows/s")

    # Random write-back into the written table, as training's evictions do.
    ours, raw = [], []
    with open_for_reads(backend, hot_path, False, a.hot_threads) if backend != "rocksdb" else \
            RocksDBStore(hot_path, WIDTH, init_rows, None) as s:
        rows = torch.rand(a.batch, WIDTH)
        g = torch.Generator().manual_seed(1)
        for r in range(a.repeats):
            t = time.perf_counter()
            for _ in range(max(1, a.reads // a.batch)):
                s.write(torch.randperm(a.hot_rows, generator=g)[:a.batch], rows)
            s.flush()
            ours.append(max(1, a.reads // a.batch) * a.batch / (time.perf_counter() - t))
            raw.append(raw_write_rate(os.path.join(a.dir, "seqwrite"), a.reads * 512))
    print(f"# random write-back runs ours {[round(x) for x in ours]} raw {[round(x) for x in raw]}")
    report(f"{backend} random write-back (write+flush)", statistics.median(ours), "seq write+fsync",
           statistics.median(raw), ">= 300K rows/s")


if __name__ == "__main__":
    main()
