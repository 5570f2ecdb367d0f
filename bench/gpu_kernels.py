"""The lookup kernels alone on a GPU, under each launch shape: tier 0's forward pooling and its
backward fused with row-wise Adagrad (tieredemb/gpu/pooling.py), on bench_gpu.py's batch (8192
bags x 20 ids, Zipf 1.05 over 10M rows, dim 128), the rows at random slots of a pool of --rows
rows. For each shape (warps per program, the most occurrences read at once), the device time of
one call, median of --reps calls timed by CUDA events, after a call that compiles it. Where the
defaults (pooling.FORWARD_WARPS, FORWARD_TILE, UPDATE_WARPS, UPDATE_TILE) come from. Then, at
those defaults, the backward + update by its number of programs (pooling.UPDATE_PROGRAMS: one
per occurrence, or --update-programs times the GPU's multiprocessors, each taking unique rows a
grid's stride apart). Last, the whole table's residency (plan_kernels.draw: rows first missed
drawn in place, 40 % of the batch's here) as one id a program and as chunks of 8 and of 64.

With --moves, instead: zero-copy's moves (tieredemb/gpu/moves.py) under each launch shape (rows
a program moves, warps, the most words of a row moved at once, programs per multiprocessor):
--move-rows rows of dim 128 + 1 (or of each of --move-widths words: whether rows that start on a
128-byte line move faster) read from host rows pinned and mapped into the device (as a zero-copy
table's) into a device pool (move_rows), as many written from the pool into the host rows, both
at once on two streams (the rows disjoint), and both by the swap kernel a zero-copy residency
uses (swap_rows: each slot's victim out, then its miss in, by one program); the swap as a
queued residency launches it, its lists as long as a batch's ids and the count on the device
(programs with nothing to do included); last, the swap with the victims staged in device memory,
and their write-back apart (zerocopy.WRITE_BACK_APART: the lookup waits for the first only).
Whether the bus's two directions overlap, and whether the swap gets that: before it, a zero-copy
step moved its rows by two launches one after the other (390 us each on the H200).

    python bench/gpu_kernels.py
    python bench/gpu_kernels.py --rows 1000000 --reps 20 --json $OUT/kernels.json
    python bench/gpu_kernels.py --moves --json $OUT/moves.json
    python bench/gpu_kernels.py --plan --json $OUT/plan.json

With --plan, instead: a zero-copy tier's queued plan and its commit (tieredemb/gpu/index.py
plan_queued, commit_queued: find, the sort by set, assign, tally, place, bind, commit, the
overflow directory) on a tier 0 of --rows / 10 slots, filled by --plan-warmup batches first, a
new batch of the workload each call, by the assign kernel's number of programs
(plan_kernels.ASSIGN_PROGRAMS, as --update-programs).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import BatchSource, Workload  # noqa: E402


@contextlib.contextmanager
def constants(module, **values):
    """The module's constants (a launch shape, a cap: what this script sweeps) set to values
    inside the block, as they were after it."""
    before = {name: getattr(module, name) for name in values}
    try:
        for name, value in values.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in before.items():
            setattr(module, name, value)


def timed(fn, reps: int, dev: torch.device) -> float:
    """Median device microseconds of fn() over reps calls (the first call before, untimed), queued
    behind a spin of about a millisecond so that the host's launch time is not counted; on the CPU
    (a check of the script), wall microseconds."""
    fn()
    times = []
    for _ in range(reps):
        if dev.type != "cuda":
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)  # (the device busy while the host launches: the launches' host time left out)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--bags", type=int, default=8192, help="bags of 20 ids in the batch (fewer: a quick check on a CPU)")
    p.add_argument("--warps", default="1,2,4,8")
    p.add_argument("--tiles", default="4,8,16,32")
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a check of this script under TRITON_INTERPRET=1 (no GPU figure)")
    p.add_argument("--update-programs", default="0,8,16,32,64",
                   help="the update's programs tried, per multiprocessor (0: one per occurrence); with --plan, "
                        "the assign kernel's")
    p.add_argument("--moves", action="store_true", help="instead: the zero-copy move kernel (see above)")
    p.add_argument("--plan", action="store_true", help="instead: a queued plan, by the assign kernel's programs")
    p.add_argument("--plan-warmup", type=int, default=40, help="--plan: batches planned before the timed ones")
    p.add_argument("--move-rows", type=int, default=20_000, help="--moves: rows moved each way a call")
    p.add_argument("--move-host-rows", default="2000000",
                   help="--moves: host rows (at most --rows), comma-separated (pinning makes every page memory: "
                        "about 1 GB a 2M rows)")
    p.add_argument("--move-alloc", default="register",
                   help="--moves: how the host rows are allocated, comma-separated: register (a HostStore's rows, "
                        "pinned and mapped as a zero-copy table's) or pinned (torch's pinned memory)")
    p.add_argument("--move-widths", default="129",
                   help="--moves: words a row, comma-separated (129: dim 128 and row-wise Adagrad's accumulator; "
                        "128 or 160: every row starting on a 128-byte line), each WORDS or WORDS/WIDTH: the first "
                        "WORDS of rows WIDTH words apart (129/160: a row_alignment=128 table's, its pad left out)")
    p.add_argument("--move-shapes", default="16x4x64x0,16x4x64x8,16x4x256x0,16x4x256x8,4x4x256x8,4x4x256x32",
                   help="--moves: the launch shapes tried, rows per program x warps x the most words of a row "
                        "a program moves at once (moves.MOVE_COLS) x programs per multiprocessor (moves.MOVE_PROGRAMS; "
                        "0: a program a block of rows); the last two left out: moves' own")
    p.add_argument("--move-lists", type=int, default=163840,
                   help="--moves: the lists' length in the queued swap (a batch's ids: as long as its distinct ids "
                        "may be), --move-rows of them counted")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device here (--device cpu checks the script)", file=sys.stderr)
        return 2
    if a.moves:
        return sweep_moves(a)
    if a.plan:
        return sweep_plan(a)
    import tieredemb
    from tieredemb.gpu import PerMultiprocessor, multiprocessors, pooling

    dev = torch.device(a.device)
    w = Workload(rows=a.rows, dim=128, bags=a.bags, ids_per_bag=20, alpha=1.05, batches=1)
    ids, offsets = (t.to(dev) for t in BatchSource(w).batch(0))
    unique, inverse = torch.unique(ids, return_inverse=True)
    n, u = ids.numel(), unique.numel()
    width = w.dim + 1  # (row-wise Adagrad: the weights and one accumulator)
    pool = torch.randn(a.rows, width, device=dev) * 0.01
    pool[:, w.dim] = 0.0
    slots = torch.randperm(a.rows, device=dev)[:u]
    count = torch.tensor([u], device=dev)
    dirty = torch.zeros(a.rows, dtype=torch.uint8, device=dev)
    grad = torch.randn(w.bags, w.dim, device=dev)
    opt = tieredemb.RowWiseAdagrad(lr=1e-6)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (a check of the script)"
    print(f"device: {name}; torch {torch.__version__}; {n} ids, {u} distinct; pool "
          f"{a.rows} x {width}; median of {a.reps} calls, microseconds")
    results = []
    for warps, tile in itertools.product(map(int, a.warps.split(",")), map(int, a.tiles.split(","))):
        with constants(pooling, FORWARD_WARPS=warps, UPDATE_WARPS=warps, FORWARD_TILE=tile, UPDATE_TILE=tile):
            fwd = timed(lambda: pooling.forward(pool, w.dim, slots, unique, inverse, offsets, None, 0, -1), a.reps, dev)
            bwd = timed(lambda: pooling.backward_update(pool, dirty, w.dim, slots, unique, count, inverse, offsets,
                                                        None, 0, -1, -1, grad, None, opt, 1, False), a.reps, dev)
        results.append({"warps": warps, "max_tile": tile, "forward_us": fwd, "backward_update_us": bwd})
        print(f"warps {warps}  max tile {tile:2d}:  forward {fwd:8.1f} us   backward+update {bwd:8.1f} us",
              flush=True)
    sms = multiprocessors(dev)
    by_programs = []
    for per_sm in map(int, a.update_programs.split(",")):
        with constants(pooling, UPDATE_PROGRAMS=PerMultiprocessor(per_sm) if per_sm else None):
            bwd = timed(lambda: pooling.backward_update(pool, dirty, w.dim, slots, unique, count, inverse, offsets,
                                                        None, 0, -1, -1, grad, None, opt, 1, False), a.reps, dev)
        by_programs.append({"update_programs": per_sm * sms or None, "backward_update_us": bwd})
        print(f"update programs {'one per occurrence' if not per_sm else f'{per_sm} x {sms} = {per_sm * sms}':>20}:  "
              f"backward+update {bwd:8.1f} us", flush=True)
    by_draw = draw_by_chunks(a, dev, pool, unique, n, w.dim)
    best_f = min(results, key=lambda r: r["forward_us"])
    best_b = min(results, key=lambda r: r["backward_update_us"])
    print(f"fastest forward: warps {best_f['warps']}, max tile {best_f['max_tile']} ({best_f['forward_us']:.1f} us); "
          f"fastest backward+update: warps {best_b['warps']}, max tile {best_b['max_tile']} "
          f"({best_b['backward_update_us']:.1f} us)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": name, "ids": n, "distinct": u, "rows": a.rows,
                       "results": results, "by_update_programs": by_programs, "draw": by_draw}, f, indent=1)
    return 0


def draw_by_chunks(a, dev, pool, unique, n: int, dim: int) -> list:
    """The whole table's residency (plan_kernels.draw) on the batch's distinct ids (a buffer of n,
    U of them live), 40 % of their rows not held yet, so drawn: as one id a program (about the
    launch before 5fd6ff6: one program per id), as the default chunks of 8, and as chunks of 64.
    Each call first resets the held bits (a copy, timed alone too)."""
    from tieredemb.gpu import PerMultiprocessor, plan_kernels
    from tieredemb.gpu.direct_index import DirectIndex
    from tieredemb.tiers.rowstore import RowInit

    index = DirectIndex(pool.shape[0], dev)
    held = torch.rand(index.held.shape, generator=torch.Generator().manual_seed(5)).to(dev) < 0.6
    ids = torch.full((n,), -1, dtype=torch.int64, device=dev)
    ids[:unique.numel()] = unique
    count = torch.tensor([unique.numel()], device=dev)
    init = RowInit(dim, 0, 0.0, 0.01, 7, -1)
    slots = torch.empty(n, dtype=torch.int64, device=dev)
    reset = timed(lambda: index.held.copy_(held), a.reps, dev)
    out = []

    def draw():
        index.held.copy_(held)
        plan_kernels.draw(ids, count, index, pool, init, slots)

    for label, chunk, cap in (("one id a program", 1, None), ("8 ids a program, 32 per SM", 8, PerMultiprocessor(32)),
                              ("64 ids a program, 32 per SM", 64, PerMultiprocessor(32))):
        with constants(plan_kernels, DRAW_CHUNK=chunk, DRAW_PROGRAMS=cap):
            us = timed(draw, a.reps, dev) - reset
        out.append({"draw": label, "us": us})
        print(f"draw {label:>27}:  {us:8.1f} us (the held bits' reset, {reset:.1f} us, taken off)", flush=True)
    return out


def sweep_plan(a) -> int:
    """--plan: see the module's docstring."""
    from tieredemb.gpu import PerMultiprocessor, multiprocessors, plan_kernels
    from tieredemb.gpu.dedup import dedup
    from tieredemb.gpu.index import SetIndex

    dev = torch.device(a.device)
    w = Workload(rows=a.rows, dim=128, bags=a.bags, ids_per_bag=20, alpha=1.05, batches=a.plan_warmup + a.reps + 1)
    source = BatchSource(w)
    batches = [dedup(source.batch(k)[0].to(dev)) for k in range(a.plan_warmup + a.reps + 1)]
    sms = multiprocessors(dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (a check of the script)"
    print(f"device: {name}; torch {torch.__version__}; tier 0 of {a.rows // 10} slots, batches of "
          f"{batches[0].unique.numel()} ids; a queued plan and its commit, median of {a.reps} calls, microseconds")
    results = []
    for per_sm in map(int, a.update_programs.split(",")):
        with constants(plan_kernels, ASSIGN_PROGRAMS=PerMultiprocessor(per_sm) if per_sm else None):
            index = SetIndex(a.rows // 10, "lru", dev)
            index.grow(batches[0].unique.numel())  # (a queued plan's room: see SetIndex.plan_queued)
            left = iter(batches)

            def plan():
                d = next(left)
                index.commit_queued(index.plan_queued(d.unique, d.count, a.rows), False)

            for _ in range(a.plan_warmup):  # (tier 0 filled: its victims as in training, not empty slots)
                plan()

            us = timed(plan, a.reps, dev)
        results.append({"assign_programs": per_sm * sms or None, "plan_us": us})
        print(f"assign programs {'one per position' if not per_sm else f'{per_sm} x {sms} = {per_sm * sms}':>20}:  "
              f"plan + commit {us:8.1f} us", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": name, "rows": a.rows, "results": results}, f, indent=1)
    return 0


def sweep_moves(a) -> int:
    """--moves: see the module's docstring."""
    allocs = a.move_alloc.split(",")
    for alloc in allocs:  # (before any sweep: a bad name stops nothing half done)
        if alloc not in ("register", "pinned"):
            raise SystemExit(f"gpu_kernels: --move-alloc {alloc!r}: register or pinned")
    results = []
    widths = []
    for item in a.move_widths.split(","):  # (all checked before any sweep)
        parts = item.split("/")
        if not (1 <= len(parts) <= 2 and all(x.isdigit() for x in parts)) or not 1 <= int(parts[0]) <= int(parts[-1]):
            raise SystemExit(f"gpu_kernels: --move-widths {item!r}: WORDS or WORDS/WIDTH, 1 <= WORDS <= WIDTH")
        widths.append((int(parts[0]), int(parts[-1])))
    for host_rows, alloc, (words, width) in itertools.product(map(int, a.move_host_rows.split(",")), allocs, widths):
        results += _sweep_moves_of(a, min(a.rows, host_rows), alloc, width, words)
        if a.json:  # (after each: a sweep stopped by a time limit keeps what it measured)
            with open(a.json, "w") as f:
                json.dump({"device": _device_name(torch.device(a.device)), "rows_moved": a.move_rows,
                           "results": results}, f, indent=1)
    return 0


def move_shape(shape: str, moves) -> tuple:
    """RxWxC[xP] (C and P left out: moves' own): rows a program, warps, words of a row at once
    (each a power of two), programs per multiprocessor (0: a program a block of rows). ValueError
    naming a shape that is not one."""
    own = moves.MOVE_PROGRAMS.count if moves.MOVE_PROGRAMS is not None else 0
    parts = shape.split("x")
    if not 2 <= len(parts) <= 4 or not all(x.isdigit() for x in parts):
        raise ValueError(f"move shape {shape!r}: RxWxC[xP], as 16x4x64x8")
    got = tuple(map(int, parts + [str(moves.MOVE_COLS), str(own)][len(parts) - 2:]))
    if not all(x > 0 and x & (x - 1) == 0 for x in got[:3]):
        raise ValueError(f"move shape {shape!r}: R, W and C must be powers of two")
    return got


def _device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (a check of the script)"


def _sweep_moves_of(a, host_rows: int, alloc: str, width: int, words: int) -> list:
    """The launch shapes of --move-shapes, moving the first words of rows of width words (each
    row at width * 4 bytes from the last: 129, a row of dim 128 and row-wise Adagrad's
    accumulator, starts 4 bytes further into a 128-byte line than the row before it; 128 and 160
    start every row on one; 129 of 160: a row_alignment=128 table's rows, their pad left out)
    between the device and host_rows host rows (how many: whether the GPU's reach into a larger
    range of host memory costs it), allocated as alloc: "register", a HostStore's rows (huge
    pages where they fit) pinned and mapped by hostmap.pin_and_map, as a zero-copy table's; or
    "pinned", torch's pinned memory (cudaHostAlloc), which a kernel reads through the same address."""
    from tieredemb.gpu import PerMultiprocessor, hostmap, moves, zerocopy
    from tieredemb.tiers.pools import reserve_host_rows

    dev = torch.device(a.device)
    n = a.move_rows
    unmap = None
    if alloc == "pinned" and dev.type == "cuda":
        store = argparse.Namespace(rows=torch.zeros(host_rows, width, pin_memory=True))
    else:
        store = argparse.Namespace(rows=reserve_host_rows(host_rows, width, populate_rows=0))  # (a HostStore's rows)
        unmap = hostmap.pin_and_map(store, store.rows, dev) if dev.type == "cuda" else None
    pool = torch.randn(4 * n, width, device=dev)
    g = torch.Generator().manual_seed(0)
    picked = torch.randperm(host_rows, generator=g)[:2 * n].to(dev)  # (distinct: reads and writes disjoint)
    read_ids, write_ids = picked[:n], picked[n:]
    read_slots, write_slots = torch.randperm(4 * n, device=dev)[:2 * n].split(n)
    side = torch.cuda.Stream(dev) if dev.type == "cuda" else None
    mb = n * words * 4 / 1e6

    def read():
        moves.move_rows(store.rows, read_ids, pool, read_slots, words=words)

    def write():
        moves.move_rows(pool, write_slots, store.rows, write_ids, words=words)

    written, found = torch.ones(host_rows, dtype=torch.uint8, device=dev), torch.zeros(1, dtype=torch.int64, device=dev)

    def swap():
        moves.swap_rows(pool, read_slots, write_ids, store.rows, read_ids, mark=0, written=written, found=found,
                        words=words)

    # the victims staged in device memory (the lookup waits for this), then written down apart
    staging, order = torch.empty(n, width, device=dev), torch.arange(n, device=dev)

    def swap_staged():
        moves.swap_rows(pool, read_slots, write_ids, store.rows, read_ids, mark=0, written=written, found=found,
                        staging=staging, words=words)

    def write_back():  # (with as few programs as a zero-copy tier's write-back)
        moves.move_rows(staging, order, store.rows, write_ids, programs=zerocopy.WRITE_BACK_PROGRAMS, words=words)

    # as a queued residency swaps them: lists as long as the batch's ids, the count on the device
    longer = max(a.move_lists - n, 0)
    queued = [torch.cat([t, torch.full((longer,), -1, dtype=t.dtype, device=dev)])
              for t in (read_slots, write_ids, read_ids)]
    count = torch.tensor([n], device=dev)

    def swap_queued():
        moves.swap_rows(pool, queued[0], queued[1], store.rows, queued[2], mark=0, written=written, found=found,
                        count=count, words=words)

    def both():
        if side is None:
            read()
            write()
            return
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            write()
        read()
        torch.cuda.current_stream(dev).wait_stream(side)

    of = f"{words} of {width}" if words < width else f"{width}"
    print(f"device: {_device_name(dev)}; torch {torch.__version__}; {n} rows of {of} floats ({mb:.1f} MB) each way, "
          f"host rows {host_rows} x {width} ({alloc}); median of {a.reps} calls, microseconds (GB/s)")
    results = []
    try:
        for shape in a.move_shapes.split(","):
            rows, warps, cols, per_sm = move_shape(shape, moves)
            with constants(moves, MOVE_ROWS=rows, MOVE_WARPS=warps, MOVE_COLS=cols,
                           MOVE_PROGRAMS=PerMultiprocessor(per_sm) if per_sm else None):
                got = {what: timed(fn, a.reps, dev) for what, fn in (
                    ("read", read), ("write", write), ("both", both), ("swap", swap), ("swap_queued", swap_queued),
                    ("swap_staged", swap_staged), ("write_back", write_back))}
            one_way_each = got["read"] + got["write"]
            results.append({"width": width, "words": words, "host_rows": host_rows, "alloc": alloc,
                            "rows_per_program": rows,
                            "warps": warps, "cols": cols, "programs_per_sm": per_sm,
                            **{f"{k}_us": v for k, v in got.items()}})
            print(f"rows {rows:3d} x warps {warps} x cols {cols:3d} x programs {per_sm or 'a block':>7}:  host->device "
                  f"{got['read']:7.1f} us ({mb / got['read'] / 1e-3:5.1f})   device->host {got['write']:7.1f} us "
                  f"({mb / got['write'] / 1e-3:5.1f})   both at once {got['both']:7.1f} us, swapped "
                  f"{got['swap']:7.1f} us (both, swap / (read + write): {got['both'] / one_way_each:.2f}, "
                  f"{got['swap'] / one_way_each:.2f}); swapped as queued (lists of {n + longer}) "
                  f"{got['swap_queued']:7.1f} us; staged {got['swap_staged']:7.1f} us, then written down apart "
                  f"{got['write_back']:7.1f} us", flush=True)
    finally:
        if unmap is not None:
            unmap()
    return results


if __name__ == "__main__":
    sys.exit(main())
