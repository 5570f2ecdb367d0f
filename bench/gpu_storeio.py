"""A residency's store reads and writes queued on the stream (tieredemb/gpu/storeio.py: the log
store's native StreamIo, a host function the driver runs in stream order) against waiting for the
device first, as tier 0 over SSD does today (DeviceTier.resident: the plan's transfer waits, then
the host writes and reads, then the rows go over), alone, on one GPU, in one process.

The store holds --rows rows of 129 words (dim 128 and row-wise Adagrad's accumulator), every one
written first (as bench_gpu.py's ours-ssd10 stores every row). Each of --batches batches is --misses
distinct ids to read and as many others to write (a residency's misses and dirty victims: ours-ssd10
has about 20K of each), made on the device as a plan leaves them, with the pool slots they go to
and come from. Both ways move the rows the same: the victims from the pool into a pinned block and
the misses from a second pinned block into the pool, by the zero-copy move kernel (moves.move_rows);
the store writes from the first and reads into the second.

- wait:   the victims moved out, the ids copied to the host, which waits for them (.cpu()), then
          the store written and read, then the misses moved in;
- queued: the victims moved out, the ids (and the counts, as a plan's transfer lays them out)
          copied into pinned memory, the store's part queued (StreamIo.queue), the misses moved in
          after it: the host waits for nothing and goes on to the next batch at once.

Then both again with the host busy in Python for --busy-us after each batch (as a prefetch worker
goes on to plan the next): the queued way's store part runs in native code on the driver's thread
and needs no GIL, so it should hide behind that work.

Printed: per batch, the wall time (all batches queued, then one wait, over their number) and the
host's time (what the loop took before that wait), medians of --runs runs, the ways interleaved;
the ratios (paired too); the pool's rows checked against the store's. Then what a queued store call
that does nothing costs the stream: --calls tiny kernels each followed by one, against the kernels
alone.

    python bench/gpu_storeio.py --json $OUT/storeio.json
    TRITON_INTERPRET=1 python bench/gpu_storeio.py --device cpu --rows 20000 --misses 300 --batches 2 --runs 1 \\
        --calls 5 --busy-us 100   (a check of the script on a machine without a GPU: no figure)
"""

from __future__ import annotations

import argparse
import contextlib
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
    p.add_argument("--misses", type=int, default=20_000, help="rows read, and as many written, a batch")
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--calls", type=int, default=200, help="empty store calls timed for their own cost")
    p.add_argument("--busy-us", type=float, default=2000.0,
                   help="the host's Python work after each batch, in the busy ways (microseconds)")
    p.add_argument("--dir", default=None, help="where the store is made (default: a temporary folder in /tmp)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a check of this script under TRITON_INTERPRET=1 (no GPU figure)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_storeio: no CUDA device here (--device cpu checks the script)", file=sys.stderr)
        return 2
    if not 0 < 2 * a.misses <= a.rows:
        raise SystemExit(f"gpu_storeio: --misses {a.misses}: two batches' worth must fit in --rows {a.rows}")
    with tempfile.TemporaryDirectory(dir=a.dir) as folder:
        return run(a, folder)


def run(a, folder: str) -> int:
    from ssd_backend.log_store import LogStore
    from tieredemb.gpu import moves, plan_kernels, storeio

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
    name = torch.cuda.get_device_name(dev) if gpu else "cpu (a check of the script)"
    print(f"device: {name}; torch {torch.__version__}; store of {a.rows} rows x {WIDTH} written in "
          f"{time.perf_counter() - t0:.1f} s; {a.misses} rows read and {a.misses} written a batch, {a.batches} "
          f"batches a run, medians of {a.runs} runs")

    n, k = a.misses, plan_kernels.KINDS
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(k, dtype=torch.int64)
    counts[plan_kernels.FRESH] = counts[plan_kernels.DIRTY] = n
    batches = []
    for _ in range(a.batches):
        picked = torch.randperm(a.rows, generator=g)[:2 * n]
        read_ids, write_ids = torch.sort(picked[:n]).values, torch.sort(picked[n:]).values
        in_slots, out_slots = torch.randperm(4 * n, generator=g)[:2 * n].split(n)
        xfer = torch.cat([counts, read_ids, write_ids])  # (as a plan's transfer: counts, misses, dirty victims)
        batches.append(tuple(t.to(dev) for t in (xfer, in_slots, out_slots)))
    pool = torch.rand(4 * n, WIDTH, device=dev)
    out, into = (torch.empty(n, WIDTH, pin_memory=gpu) for _ in range(2))
    lists = torch.empty(k + 2 * n, dtype=torch.int64, pin_memory=gpu)
    order_host, order = torch.arange(n), torch.arange(n, device=dev)
    io = storeio.stream_io(store)

    def queue(xfer_host, m):  # (on the current stream: a side stream, as tier 0's; on the CPU, at once)
        handle = torch.cuda.current_stream(dev).cuda_stream if gpu else None
        io.queue(handle, xfer_host, m, out.view(torch.uint8), into.view(torch.uint8))

    def wait_way(xfer, in_slots, out_slots):
        moves.move_rows(pool, out_slots, out, order)
        ids = xfer[k:].cpu()  # (waits for the device: the work queued before, the move out)
        store.write_from(ids[n:], out, order_host)
        store.read_to(ids[:n], into, order_host)
        moves.move_rows(into, order, pool, in_slots)

    def queued_way(xfer, in_slots, out_slots):
        moves.move_rows(pool, out_slots, out, order)
        lists.copy_(xfer, non_blocking=True)
        queue(lists, n)
        moves.move_rows(into, order, pool, in_slots)

    def busy(way):
        def run(*batch):
            way(*batch)
            end = time.perf_counter() + a.busy_us * 1e-6
            while time.perf_counter() < end:  # (Python, holding the GIL)
                pass
        return run

    def sync():
        if gpu:
            torch.cuda.synchronize(dev)
        if io.error():
            raise SystemExit(f"gpu_storeio: a queued store call failed: {io.error()}")

    def one_run(way) -> tuple[float, float]:
        sync()
        t0 = time.perf_counter()
        for batch in batches:
            way(*batch)
        host = time.perf_counter() - t0
        sync()
        return (time.perf_counter() - t0) / len(batches) * 1e6, host / len(batches) * 1e6

    ways = {"wait": wait_way, "queued": queued_way, "wait+busy": busy(wait_way), "queued+busy": busy(queued_way)}
    side = torch.cuda.Stream(dev) if gpu else None  # (everything on a stream of its own, as a tier's residencies)
    on_side = (lambda: torch.cuda.stream(side)) if gpu else contextlib.nullcontext
    with on_side():
        for way in ways.values():  # (compiles the moves; warms the store's pages)
            one_run(way)
    got = {w: [] for w in ways}
    compactions = dict.fromkeys(ways, 0)  # (a compaction rewrites a segment: it lands in whichever way ran it)
    call_times = {"write_seconds": 0.0, "read_seconds": 0.0, "calls": 0}  # (the queued ways' store calls)
    io.take_times()
    store._file.take_write_times()
    for _ in range(a.runs):
        for w, way in ways.items():
            before = store.stats()["compactions"]
            with on_side():
                got[w].append(one_run(way))
            compactions[w] += store.stats()["compactions"] - before
            for key, value in io.take_times().items():
                call_times[key] += value
            xfer, in_slots, out_slots = batches[-1]  # (read in, written down: disjoint rows, disjoint slots)
            for ids, slots, what in ((xfer[k:k + n], in_slots, "read into the pool"),
                                     (xfer[k + n:], out_slots, "written down from the pool")):
                want = torch.empty(n, WIDTH)
                store.read(ids.cpu(), want)
                if not torch.equal(pool[slots].cpu(), want):
                    raise SystemExit(f"gpu_storeio: the {w} way's last batch: the rows {what} are not the store's")
    store.count_queued(io.take_counts())
    result = {"device": name, "rows": a.rows, "misses": n, "batches": a.batches, "runs": a.runs, "busy_us": a.busy_us}
    for w in ways:
        wall = statistics.median(x for x, _ in got[w])
        host = statistics.median(h for _, h in got[w])
        result[w] = {"wall_us": wall, "host_us": host, "runs": got[w], "compactions": compactions[w]}
        print(f"{w:>12}: {wall:9.1f} us a batch, the host busy {host:9.1f} us of it ({compactions[w]} compactions "
              f"in its runs)")
    for slow, fast in (("wait", "queued"), ("wait+busy", "queued+busy")):
        paired = statistics.median(x / y for (x, _), (y, _) in zip(got[slow], got[fast]))
        ratio = result[slow]["wall_us"] / result[fast]["wall_us"]
        result[f"{slow} / {fast}"] = {"ratio": ratio, "paired": paired}
        print(f"{slow} / {fast}: {ratio:.2f}x a batch (paired {paired:.2f}x)")
    print("after every run, the last batch's rows read into the pool and written down from it are the store's")
    calls = max(call_times["calls"], 1)
    result["store_call_ms"] = {"write": call_times["write_seconds"] * 1e3 / calls,
                               "read": call_times["read_seconds"] * 1e3 / calls, "calls": call_times["calls"]}
    print(f"a queued store call, on the driver's thread: write {result['store_call_ms']['write']:.2f} ms, read "
          f"{result['store_call_ms']['read']:.2f} ms (means of {call_times['calls']})")
    w = store._file.take_write_times()  # (every way's writes: where a write's time went, in the log store)
    per = lambda key, count: w[key] * 1e3 / max(w[count], 1)  # noqa: E731
    result["log_write_ms"] = {"waiting for the last append": per("drain_seconds", "writes"),
                              "staging": per("stage_seconds", "writes"), "compaction": per("compact_seconds", "writes"),
                              "append (writer thread)": per("append_seconds", "appends"),
                              "append MB": w["appended_bytes"] / max(w["appends"], 1) / 1e6, "writes": w["writes"]}
    print("a log store write, every way's (ms a write): " + ", ".join(
        f"{k} {v:.2f}" for k, v in result["log_write_ms"].items() if k != "writes") + f" (means of {w['writes']})")
    with on_side():
        result["empty_call"] = call_cost(a, dev, io, k, queue)
    store.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def call_cost(a, dev: torch.device, io, k: int, queue) -> dict:
    """What a queued store call that does nothing (its counts zero) costs: --calls tiny kernels,
    each followed by one, against the kernels alone (microseconds a call, medians of --runs)."""
    x = torch.zeros(1, device=dev)
    empty = torch.zeros(k, dtype=torch.int64, pin_memory=dev.type == "cuda")

    def kernels(with_calls: bool) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(a.calls):
            x.add_(1)
            if with_calls:
                queue(empty, 0)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return (time.perf_counter() - t0) / a.calls * 1e6

    kernels(True)
    alone, called = [], []
    for _ in range(a.runs):
        alone.append(kernels(False))
        called.append(kernels(True))
    out = {"kernel_us": statistics.median(alone), "kernel_and_call_us": statistics.median(called)}
    print(f"a tiny kernel {out['kernel_us']:.1f} us a launch; with an empty store call queued after each "
          f"{out['kernel_and_call_us']:.1f} us ({a.calls} in a row, medians of {a.runs})")
    return out


if __name__ == "__main__":
    sys.exit(main())
