"""What new memory costs on this machine: first touch of memory the process never used against a
second touch of the same memory, and appending to a file (the page cache grows) against a plain
memcpy of the same bytes.

Why it is here: on the project's VM (firecracker, virtio-balloon with free page reporting)
memory the guest has not used recently is backed by the host only when first touched, at a cost
of milliseconds per MB, and freed memory goes back to the host within seconds. Training with an
SSD tier adds every written-back row to the page cache, so this cost falls on its write-backs;
a table held in memory from construction (the peers in bench_train) pays it before timing.

    python bench/vm_memory.py            # 2 GB touched, 40 appends of 13 MB
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time

import numpy as np


def touch(n: int) -> tuple[float, float]:
    """Seconds to write one byte per 4 KiB page of n fresh anonymous bytes, then again."""
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, dtype=np.uint8)
    times = []
    for value in (1, 2):
        t = time.perf_counter()
        a[::4096] = value
        times.append(time.perf_counter() - t)
    del a
    m.close()
    return times[0], times[1]


def appends(directory: str, chunk: int, count: int) -> tuple[list[float], list[float]]:
    """CPU seconds per pwrite of `chunk` bytes appended to a new file, and per memcpy of the same."""
    buf = np.random.default_rng(0).integers(0, 255, chunk, dtype=np.uint8)
    dst = np.empty_like(buf)
    path = os.path.join(directory, "vm_memory.dat")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    writes, copies = [], []
    try:
        for i in range(count):
            c = time.process_time()
            os.pwrite(fd, buf, i * chunk)
            writes.append(time.process_time() - c)
            c = time.process_time()
            np.copyto(dst, buf)
            copies.append(time.process_time() - c)
    finally:
        os.close(fd)
        os.unlink(path)
    return writes, copies


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--touch-gb", type=float, default=2.0)
    p.add_argument("--chunk-mb", type=float, default=13.0, help="one SSD training batch's write-back")
    p.add_argument("--appends", type=int, default=40)
    p.add_argument("--dir", default=tempfile.gettempdir())
    a = p.parse_args()
    n = int(a.touch_gb * (1 << 30))
    first, second = touch(n)
    print(f"touch {a.touch_gb:g} GB of fresh memory: first {first:.2f} s ({first / (n >> 20) * 1e3:.2f} ms/MB), "
          f"again {second:.2f} s ({second / (n >> 20) * 1e3:.3f} ms/MB): {first / second:.0f}x")
    chunk = int(a.chunk_mb * (1 << 20))
    writes, copies = appends(a.dir, chunk, a.appends)
    w, c = statistics.median(writes), statistics.median(copies)
    print(f"append {a.chunk_mb:g} MB to a new file (page cache grows): median {w * 1e3:.1f} ms CPU "
          f"(min {min(writes) * 1e3:.1f}, max {max(writes) * 1e3:.1f}); memcpy of the same bytes: {c * 1e3:.2f} ms: "
          f"{w / c:.0f}x")


if __name__ == "__main__":
    main()
