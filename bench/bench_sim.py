"""Cache-simulator benchmarks: speed against libCacheSim, the one-pass LRU curve, lookahead-k.

1. LRU on a Zipf trace (default: 10M lookups, alpha 1.05 over a permuted 10M-row table, cache
   1% of the rows), request mode, against libCacheSim's LRU on the same trace in the same run.
   Runs alternate (ours, theirs, ours, ...) so that noise on a shared machine hits both alike;
   medians of --runs. libCacheSim is timed on process_trace() alone (its own simulation, reading
   its oracleGeneral file); the file is written before timing. Ours: the whole simulate() call
   (input checks, state, the pass), plus the general list kernel (Simulator, the multi-tier path)
   for reference. Hit counts must agree exactly.
2. The exact LRU miss-ratio curve at 100 sizes (one pass) against single-size runs: simulate()
   (for one LRU tier, an O(1)-per-lookup kernel) and the general list kernel.
3. Hit ratio of lookahead-k (k = 1, 2, 4, 8, 32, 128) against belady and lru at 1% and 10% of the rows,
   batch mode, on the engine workload's batches (bench/workload.py; 2048 bags x 20 ids so that a
   batch's unique rows fit in 1% of a 2M-row table).
4. From the command line, whole processes (start-up included): `tieredemb simulate` on the trace
   (our format, and the oracleGeneral file itself) against a Python process that imports
   libcachesim and runs its LRU on the oracleGeneral file (`--libcachesim FILE`, below), in turn.

The trace of 1, 2 and 4 is tieredemb.trace.ZipfSampler's batch 0 (the project's one Zipf sampler).

    python bench/bench_sim.py                  # everything, the issue's sizes
    python bench/bench_sim.py --quick          # smoke test (1M lookups, 40 batches)
    python bench/bench_sim.py --json bench/out/sim.json
    python bench/bench_sim.py --libcachesim z.oracleGeneral.bin --capacity 100000   # libCacheSim alone, one
                                               # process (what section 4 times; for timing with other tools)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

# Lazy packages: the names below load numba (and workload.py torch) on first use, so that
# `--libcachesim` times libCacheSim's process without them.
import tieredemb.sim as sim
import tieredemb.trace as trace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SPEED_TARGET = 5.0       # ours / libCacheSim, lookups/s
CURVE_TARGET = 2.0       # 100-size curve time / single-size run time, at most
LOOKAHEAD_GAP_PP = 0.5   # belady - lookahead-k, percentage points (the prefetch issue's target)
LOOKAHEADS = (1, 2, 4, 8, 32, 128)  # windows in batches


def zipf_trace(lookups: int, rows: int, alpha: float, seed: int) -> np.ndarray:
    """int64 [lookups] ids: ZipfSampler(rows, alpha, seed)'s batch 0."""
    return trace.ZipfSampler(rows, alpha, seed=seed).batch(0, lookups)


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def median_rate(seconds: list[float], n: int) -> float:
    return n / statistics.median(seconds)


def fmt(seconds: list[float]) -> str:
    return f"{statistics.median(seconds):.3f} s (min {min(seconds):.3f}, max {max(seconds):.3f})"


def bench_speed(keys: np.ndarray, cap: int, runs: int) -> dict:
    import libcachesim as lcs

    from tieredemb.trace.oracle import write_keys

    n = keys.size
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.oracleGeneral")
        write_keys(path, keys)
        sim.simulate(keys[:1000], None, "lru", [10], mode="request")  # compile / load the kernels
        times = {"ours": [], "ours_list": [], "libcachesim": []}
        hits = {}
        def list_kernel():
            s = sim.Simulator("lru", [cap], int(keys.max()) + 1, mode="request")
            s.feed(keys)
            return s.result()

        def libcachesim_run():
            reader = lcs.TraceReader(path, lcs.TraceType.ORACLE_GENERAL_TRACE)
            cache = lcs.LRU(cap)
            t, (miss_ratio, _) = timed(lambda: cache.process_trace(reader))  # its simulation alone
            return t, round((1 - miss_ratio) * n)

        for _ in range(runs):
            t, r = timed(lambda: sim.simulate(keys, None, "lru", [cap], mode="request"))
            times["ours"].append(t)
            hits["ours"] = r.tiers[0].hits
            t, r = timed(list_kernel)
            times["ours_list"].append(t)
            hits["ours_list"] = r.tiers[0].hits
            t, hits["libcachesim"] = libcachesim_run()
            times["libcachesim"].append(t)
    if len(set(hits.values())) != 1:
        raise SystemExit(f"hit counts differ: {hits}")
    rates = {k: median_rate(v, n) for k, v in times.items()}
    ratio = rates["ours"] / rates["libcachesim"]
    print(f"LRU, {n:,} lookups, cache {cap:,} rows, request mode; hit ratio {hits['ours'] / n:.4f} in all three")
    for name, label in (("ours", "tieredemb simulate (lru)"), ("ours_list", "tieredemb list kernel (lru)"),
                        ("libcachesim", "libCacheSim LRU")):
        print(f"  {label:30s} {fmt(times[name])}  {rates[name] / 1e6:7.2f} M lookups/s")
    print(f"  ratio ours / libCacheSim: {ratio:.2f}x (list kernel {rates['ours_list'] / rates['libcachesim']:.2f}x); "
          f"target >= {SPEED_TARGET:g}x: {'met' if ratio >= SPEED_TARGET else 'NOT met'}")
    return {"lookups": n, "capacity": cap, "hit_ratio": hits["ours"] / n, "seconds": times,
                "lookups_per_s": rates, "ratio": ratio, "ratio_list_kernel": rates["ours_list"] / rates["libcachesim"]}


def bench_curve(keys: np.ndarray, cap: int, runs: int) -> dict:
    """The 100-size curve against one simulate() run at one size (lru: the O(1) boundary
    kernel) and one run of the general list kernel."""
    sim.mrc(keys[:1000], None, mode="request", points=5)
    one, one_list, curve = [], [], []
    c = None
    for _ in range(runs):
        one.append(timed(lambda: sim.simulate(keys, None, "lru", [cap], mode="request"))[0])
        one_list.append(timed(lambda: sim.Simulator("lru", [cap], int(keys.max()) + 1, mode="request").feed(keys))[0])
        t, c = timed(lambda: sim.mrc(keys, None, mode="request", points=100))
        curve.append(t)
    for size in c.sizes[:: max(1, len(c.sizes) // 4)]:  # spot-check the curve against single runs
        assert c.miss_ratio[list(c.sizes).index(size)] == sim.simulate(keys, None, "lru", [int(size)],
                                                                   mode="request").tiers[0].miss_ratio
    ratio = statistics.median(curve) / statistics.median(one)
    ratio_list = statistics.median(curve) / statistics.median(one_list)
    print(f"exact LRU curve, {len(c.sizes)} sizes ({c.sizes[0]:,} .. {c.sizes[-1]:,} rows) in one pass: {fmt(curve)}")
    print(f"  one size, simulate(): {fmt(one)}; one size, list kernel: {fmt(one_list)}")
    print(f"  curve / one simulate() run: {ratio:.2f}, curve / one list-kernel run: {ratio_list:.2f} "
          f"(target <= {CURVE_TARGET:g} single-size runs: {'met' if ratio <= CURVE_TARGET else 'NOT met'} against "
          f"simulate(), {'met' if ratio_list <= CURVE_TARGET else 'NOT met'} against the list kernel)")
    return {"sizes": len(c.sizes), "seconds_curve": curve, "seconds_one": one, "seconds_one_list_kernel": one_list,
            "ratio": ratio, "ratio_list_kernel": ratio_list}


def bench_lookahead(w) -> dict:
    """w: a workload.Workload."""
    from workload import BatchSource

    src = BatchSource(w)
    keys = np.concatenate([src.indices(i).numpy() for i in range(w.batches)])
    offsets = np.arange(0, keys.size + 1, w.lookups_per_batch)
    rows = {}
    print(f"lookahead-k vs belady, batch mode: {w.batches} batches of {w.bags} x {w.ids_per_bag} ids, "
          f"{w.rows:,} rows, alpha {w.alpha}")
    print(f"  {'capacity':>16s} {'lru':>7s} " + " ".join(f"{'la-' + str(k):>7s}" for k in LOOKAHEADS)
          + f" {'belady':>7s}  gap belady - la-k (pp)")
    for pct in (1, 10):
        cap = w.rows * pct // 100
        hit = {p: sim.simulate(keys, offsets, p, [cap]).hit_ratio for p in ("lru", "belady")}
        for k in LOOKAHEADS:
            hit[f"lookahead-{k}"] = sim.simulate(keys, offsets, "lookahead", [cap], lookahead=k).hit_ratio
        gaps = {k: 100 * (hit["belady"] - hit[f"lookahead-{k}"]) for k in LOOKAHEADS}
        rows[pct] = {"capacity": cap, "hit_ratio": hit, "gap_pp": gaps}
        print(f"  {cap:>10,} ({pct:>2d}%) {hit['lru']:7.4f} " + " ".join(f"{hit[f'lookahead-{k}']:7.4f}" for k in LOOKAHEADS)
              + f" {hit['belady']:7.4f}  " + " ".join(f"{gaps[k]:.2f}" for k in LOOKAHEADS))
    print(f"  (the prefetch issue's target: within {LOOKAHEAD_GAP_PP} pp of belady)")
    return {"workload": dataclasses.asdict(w), "capacities": rows}


def run_libcachesim(path: str, capacity: int) -> dict:
    """libCacheSim's LRU of `capacity` objects over an oracleGeneral file, in this process:
    {"requests", "hits", "seconds" (process_trace alone)}."""
    import libcachesim as lcs

    reader = lcs.TraceReader(path, lcs.TraceType.ORACLE_GENERAL_TRACE)
    n = os.path.getsize(path) // 24
    t, (miss_ratio, _) = timed(lambda: lcs.LRU(capacity).process_trace(reader))
    return {"requests": n, "hits": round((1 - miss_ratio) * n), "seconds": t}


def bench_commands(keys: np.ndarray, rows: int, cap: int, runs: int) -> dict:
    """Whole processes, in turn: `tieredemb simulate` (request mode) on our trace and on the
    oracleGeneral file, and `--libcachesim` on the oracleGeneral file."""
    from tieredemb.trace.oracle import write_keys

    n = keys.size
    with tempfile.TemporaryDirectory() as d:
        trace_path, oracle = os.path.join(d, "z.trace"), os.path.join(d, "z.oracleGeneral.bin")
        with trace.TraceWriter(trace_path, [trace.TableInfo("table0", rows)]) as w:
            w.write_batches(keys, np.unique(np.append(np.arange(0, n, 4096), n)))
        write_keys(oracle, keys)
        simulate_cmd = [sys.executable, "-m", "tieredemb.cli", "simulate", "--capacity", str(cap), "--mode", "request",
                        "--json"]
        commands = {"ours_trace": simulate_cmd + [trace_path], "ours_oracle": simulate_cmd + [oracle],
                    "libcachesim": [sys.executable, os.path.abspath(__file__), "--libcachesim", oracle,
                                    "--capacity", str(cap)]}
        times = {k: [] for k in commands}
        hits, in_process = {}, []
        for r in range(runs + 1):  # the first round warms the page cache and numba's cache: not counted
            for name, cmd in commands.items():
                t, done = timed(lambda: subprocess.run(cmd, capture_output=True, text=True))
                if done.returncode:
                    raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr}")
                out = json.loads(done.stdout)
                hits[name] = out["hits"] if name == "libcachesim" else out[0]["tiers"][0]["hits"]
                if r:
                    times[name].append(t)
                    if name == "libcachesim":
                        in_process.append(out["seconds"])
    if len(set(hits.values())) != 1:
        raise SystemExit(f"hit counts differ: {hits}")
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"command line (whole processes, start-up included), LRU, {n:,} lookups, cache {cap:,} rows, request "
          f"mode; {runs} runs each, in turn; hit ratio {hits['ours_trace'] / n:.4f} in all")
    for name, label in (("ours_trace", "tieredemb simulate z.trace"),
                        ("ours_oracle", "tieredemb simulate z.oracleGeneral.bin"),
                        ("libcachesim", "python: libcachesim LRU")):
        print(f"  {label:40s} {fmt(times[name])}  {n / med[name] / 1e6:7.2f} M lookups/s")
    lcs_in = statistics.median(in_process)
    print(f"  libCacheSim's process_trace alone (in process): {lcs_in:.3f} s")
    print(f"  ratio ours / libCacheSim, whole processes: {med['libcachesim'] / med['ours_trace']:.2f}x (.trace), "
          f"{med['libcachesim'] / med['ours_oracle']:.2f}x (oracleGeneral); our whole process against libCacheSim "
          f"in process: {lcs_in / med['ours_trace']:.2f}x")
    return {"lookups": n, "capacity": cap, "seconds": times, "libcachesim_in_process_seconds": in_process,
            "ratio_whole_process": med["libcachesim"] / med["ours_trace"],
            "ratio_against_in_process": lcs_in / med["ours_trace"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lookups", type=int, default=10_000_000)
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--capacity-pct", type=float, default=1.0, help="LRU cache, percent of the rows (default 1)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--batches", type=int, default=200, help="engine-workload batches for lookahead-k")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--skip", nargs="*", default=[], choices=["speed", "curve", "lookahead", "commands"])
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--libcachesim", metavar="ORACLE_FILE", default=None,
                   help="only run libCacheSim's LRU on this oracleGeneral file (--capacity objects) and print "
                        "{requests, hits, seconds} as JSON: the peer as a command of its own")
    p.add_argument("--capacity", type=int, default=None, help="cache size for --libcachesim (objects)")
    a = p.parse_args(argv)
    if a.libcachesim:
        if not a.capacity or a.capacity < 1:
            p.error(f"--libcachesim needs --capacity N (objects, N >= 1), got {a.capacity}")
        print(json.dumps(run_libcachesim(a.libcachesim, a.capacity)))
        return 0
    if a.quick:
        a.lookups, a.rows, a.runs, a.batches = 1_000_000, 1_000_000, 3, 40
    keys = zipf_trace(a.lookups, a.rows, a.alpha, seed=0)
    cap = max(1, int(a.rows * a.capacity_pct / 100))
    out = {"args": vars(a)}
    if "speed" not in a.skip:
        out["speed"] = bench_speed(keys, cap, a.runs)
    if "curve" not in a.skip:
        out["curve"] = bench_curve(keys, cap, a.runs)
    if "commands" not in a.skip:
        out["commands"] = bench_commands(keys, a.rows, cap, a.runs)
    if "lookahead" not in a.skip:
        from workload import Workload

        out["lookahead"] = bench_lookahead(Workload(bags=2048, batches=a.batches))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
