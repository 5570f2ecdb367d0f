"""A batch's misses read from the log store in stream order (tieredemb/gpu/hostfunc.py) against
waiting for the device first, as tier 0 over SSD does today (DeviceTier.resident: the plan's
transfer waits, then the host reads, then the rows go over), on one GPU, in one process.

The store holds --rows rows of 129 words (dim 128 and row-wise Adagrad's accumulator), every one
written first (as bench_gpu.py's ours-ssd10 stores every row). Each of --batches batches is
--misses distinct ids made on the device (as a plan leaves its misses) and the pool slots they go
to. Two ways, each batch's rows read by the same store call into one pinned block, then moved into
the pool by the zero-copy move kernel (moves.move_rows, reading the pinned block over the bus):

- wait:   the ids copied to the host, which waits for them (.cpu()), then read, then the move queued;
- queued: the ids copied into a pinned buffer, the read queued as a host call on the stream, the
          move queued after it: the host waits for nothing, and goes on to the next batch at once.

And each way again with the host busy in Python for --busy-us after queuing each batch (as a
prefetch worker goes on to plan the next): a host call runs Python on the driver's thread, so it
needs the GIL, which a thread running Python lets go only every sys.getswitchinterval() (5 ms by
default) unless it waits on something; "queued+busy" shows what that costs, and "queued+busy, 0.2
ms switch" with the interval at 200 us.

Printed: per batch, the wall time (all batches queued, then one wait, divided by their number) and
the host's time (what the loop took before that wait: the time a prefetch worker would have for
the next plan), medians of --runs runs, the two ways interleaved; the ratio; and the pool's rows
checked against the store's. Then what a host call itself costs the stream: --calls tiny kernels
each followed by a host call that does nothing, against the same kernels alone.

    python bench/gpu_hostcalls.py --json $OUT/hostcalls.json
    TRITON_INTERPRET=1 python bench/gpu_hostcalls.py --device cpu --rows 20000 --misses 300 --batches 2 --runs 1 \
        --calls 5   (a check of the script on a machine without a GPU: no figure)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

WIDTH = 129


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2_000_000, help="rows in the store (about 1 GB a 2M)")
    p.add_argument("--misses", type=int, default=20_000, help="rows read a batch (ours-ssd10's are about 20K)")
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--calls", type=int, default=200, help="host calls timed for their own cost")
    p.add_argument("--busy-us", type=float, default=2000.0,
                   help="the host's Python work after queuing each batch, in the busy ways (microseconds)")
    p.add_argument("--dir", default=None, help="where the store is made (default: a temporary folder in /tmp)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a check of this script under TRITON_INTERPRET=1 (no GPU figure)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_hostcalls: no CUDA device here (--device cpu checks the script)", file=sys.stderr)
        return 2
    if not 0 < a.misses <= a.rows:
        raise SystemExit(f"gpu_hostcalls: --misses {a.misses} must be in [1, --rows {a.rows}]")
    with tempfile.TemporaryDirectory(dir=a.dir) as folder:
        return run(a, folder)


def run(a, folder: str) -> int:
    from ssd_backend.log_store import LogStore
    from tieredemb.gpu import moves
    from tieredemb.gpu.hostfunc import HostCalls

    dev = torch.device(a.device)
    gpu = dev.type == "cuda"
    store = LogStore(folder + "/t", WIDTH, lambda i, o, r=None: o.zero_() if r is None else o.index_fill_(0, r, 0.0),
                     {"num_embeddings": a.rows})
    t0 = time.perf_counter()
    chunk = 65536
    block = torch.empty(chunk, WIDTH)
    for start in range(0, a.rows, chunk):  # (every row stored: each read finds its row)
        ids = torch.arange(start, min(a.rows, start + chunk))
        block[:len(ids)] = torch.rand(len(ids), 1) + torch.arange(WIDTH) * 1e-3
        store.write_from(ids, block, torch.arange(len(ids)))
    store.flush()
    print(f"device: {torch.cuda.get_device_name(dev) if gpu else 'cpu (a check of the script)'}; torch "
          f"{torch.__version__}; store of {a.rows} rows x {WIDTH} written in {time.perf_counter() - t0:.1f} s; "
          f"{a.misses} misses a batch, {a.batches} batches a run, medians of {a.runs} runs")

    n = a.misses
    g = torch.Generator().manual_seed(0)
    batches = [(torch.sort(torch.randperm(a.rows, generator=g)[:n]).values.to(dev),
                torch.randperm(4 * n, generator=g)[:n].to(dev)) for _ in range(a.batches)]
    pool = torch.zeros(4 * n, WIDTH, device=dev)
    staged = torch.empty(n, WIDTH, pin_memory=gpu)  # (the block the store reads into; the move reads it)
    ids_host = torch.empty(n, dtype=torch.int64, pin_memory=gpu)
    rows_host, rows_dev = torch.arange(n), torch.arange(n, device=dev)
    stream = torch.cuda.current_stream(dev) if gpu else None
    calls = HostCalls(stream)

    def read_into_staged(ids):
        store.read_to(ids, staged, rows_host)

    def wait_way(ids, slots):
        read_into_staged(ids.cpu())  # (waits for the device: the work queued before, the last move)
        moves.move_rows(staged, rows_dev, pool, slots)

    def queued_way(ids, slots):
        ids_host.copy_(ids, non_blocking=True)
        calls.queue(lambda: read_into_staged(ids_host))
        moves.move_rows(staged, rows_dev, pool, slots)

    def sync():
        if gpu:
            torch.cuda.synchronize(dev)
        calls.raise_error()

    def busy(way):
        def run(ids, slots):
            way(ids, slots)
            end = time.perf_counter() + a.busy_us * 1e-6
            while time.perf_counter() < end:  # (Python, holding the GIL but at the switch interval)
                pass
        return run

    def switched(way, seconds):
        def run(ids, slots):
            before = sys.getswitchinterval()
            sys.setswitchinterval(seconds)
            try:
                way(ids, slots)
            finally:
                sys.setswitchinterval(before)
        return run

    def one_run(way) -> tuple[float, float]:
        sync()
        t0 = time.perf_counter()
        for ids, slots in batches:
            way(ids, slots)
        host = time.perf_counter() - t0
        sync()
        return (time.perf_counter() - t0) / len(batches) * 1e6, host / len(batches) * 1e6

    ways = {"wait": wait_way, "queued": queued_way, "wait+busy": busy(wait_way), "queued+busy": busy(queued_way),
            "queued+busy, 0.2 ms switch": switched(busy(queued_way), 2e-4)}
    for way in ways.values():  # (compiles the move; warms the store's pages)
        one_run(way)
    got = {name: [] for name in ways}
    for _ in range(a.runs):
        for name, way in ways.items():
            got[name].append(one_run(way))
            ids, slots = batches[-1]
            want = torch.empty(n, WIDTH)
            store.read(ids.cpu(), want)
            if not torch.equal(pool[slots].cpu(), want):
                raise SystemExit(f"gpu_hostcalls: the {name} way left rows in the pool that are not the store's")
    result = {"device": torch.cuda.get_device_name(dev) if gpu else "cpu", "rows": a.rows, "misses": n,
              "batches": a.batches, "runs": a.runs}
    for name in ways:
        wall = statistics.median(w for w, _ in got[name])
        host = statistics.median(h for _, h in got[name])
        result[name] = {"wall_us": wall, "host_us": host, "runs": got[name]}
        print(f"{name:>26}: {wall:9.1f} us a batch, the host busy {host:9.1f} us of it")
    for slow, fast in (("wait", "queued"), ("wait+busy", "queued+busy"), ("wait+busy", "queued+busy, 0.2 ms switch")):
        paired = statistics.median(w / q for (w, _), (q, _) in zip(got[slow], got[fast]))
        ratio = result[slow]["wall_us"] / result[fast]["wall_us"]
        result[f"{slow} / {fast}"] = {"ratio": ratio, "paired": paired}
        print(f"{slow} / {fast}: {ratio:.2f}x a batch (paired {paired:.2f}x)")
    print("the pool's rows equal the store's after every run")
    result["host_call"] = call_cost(a, dev, calls)
    store.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def call_cost(a, dev: torch.device, calls) -> dict:
    """What a host call costs the stream: --calls tiny kernels, each followed by a host call that
    does nothing, against the kernels alone (microseconds a call, medians of --runs)."""
    x = torch.zeros(1, device=dev)

    def kernels(with_calls: bool) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(a.calls):
            x.add_(1)
            if with_calls:
                calls.queue(lambda: None)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return (time.perf_counter() - t0) / a.calls * 1e6

    kernels(True)
    alone, called = [], []
    for _ in range(a.runs):
        alone.append(kernels(False))
        called.append(kernels(True))
    calls.raise_error()
    out = {"kernel_us": statistics.median(alone), "kernel_and_call_us": statistics.median(called)}
    print(f"a tiny kernel {out['kernel_us']:.1f} us a launch; with a host call after each "
          f"{out['kernel_and_call_us']:.1f} us ({a.calls} in a row, medians of {a.runs})")
    return out


if __name__ == "__main__":
    sys.exit(main())
