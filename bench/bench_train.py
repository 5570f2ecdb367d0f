"""Training throughput and peak memory: tieredemb against FBGEMM's CPU TBE and torch.nn.EmbeddingBag.

One step = forward of B bags x L ids, backward of a fixed [B, D] upstream gradient, and a
row-wise Adagrad update (torch: its element-wise sparse Adagrad, the closest stock optimizer).
All systems train on the same batches, in the same process, interleaved run by run so that
noise on a shared machine hits them alike. Reported: lookups/s = B * L * batches / seconds,
median (min, max) over runs, and the ratio to FBGEMM.

Peak RSS is measured per system in a fresh subprocess (`--only NAME --rss`): the peak resident
set after the table is built and trained minus the resident set just before it is built (after
imports, batch generation and the gradient), against the bytes of rows plus optimizer state
the system holds.

    python bench/bench_train.py               # the issue's workload (2M x 128, 8192 x 20, alpha 1.15)
    python bench/bench_train.py --quick       # smoke test, well under a minute
    python bench/bench_train.py --only fbgemm,tieredemb-full --no-rss
    python bench/bench_train.py --preinit     # tieredemb rows written once before timing, as the peers'
    python bench/bench_train.py --check       # correctness: every system vs a float64 reference
    python bench/bench_train.py --rows 10000000 --alpha 1.05 --ssd-path /mnt/nvme/t  # later benches
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import (QUICK, BatchSource, Workload, add_workload_args, store_every_row, upstream_grad,  # noqa: E402
                      workload_flags, workload_from_args)

FP32 = 4
SYSTEMS = ("fbgemm", "torch", "tieredemb-full", "tieredemb-cached")
BASELINE = "fbgemm"
# Targets from the issue: throughput ratio to FBGEMM (at least), peak RSS / bytes held (at most).
SPEED_TARGETS = {"tieredemb-full": 1.0, "tieredemb-cached": 0.7}
SSD_TARGET = 0.5  # tieredemb-cached over the SSD tier (--ssd-path): the SSD issue's target
RSS_TARGET = 1.3
# --check: small enough for a float64 reference, the cache still 10 % of the rows and larger
# than a batch's unique ids.
CHECK = Workload(rows=100_000, bags=256, batches=10)


# ---------------------------------------------------------------------------------------------
# Systems: each builds one table and exposes step(indices, offsets) -> pooled output [B, D].


@dataclass
class Trainer:
    name: str
    config: str
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    held_bytes: int  # rows + optimizer state the system keeps resident, by construction
    hit_rate: Callable[[], str] | None = None  # tier-0 hit rate since the last call, for printing
    module: object = None


def build_fbgemm(w: Workload, a: argparse.Namespace, grad: torch.Tensor) -> Trainer:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import ComputeDevice, EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(w.rows, w.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        pooling_mode=PoolingMode.SUM,
        weights_precision=SparseType.FP32,
        output_dtype=SparseType.FP32,
        learning_rate=a.lr,
        eps=a.eps,
    )
    # FBGEMM wants B + 1 offsets (the last one is the total); every batch has the same.
    offsets_fb = torch.arange(0, w.bags * w.ids_per_bag + 1, w.ids_per_bag, dtype=torch.int64)

    def step(indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        out = tbe(indices, offsets_fb)
        out.backward(grad)  # the fused optimizer updates the rows here
        return out.detach()

    return Trainer("fbgemm", "TBE CPU, EXACT_ROWWISE_ADAGRAD", step, w.rows * (w.dim + 1) * FP32, module=tbe)


def build_torch(w: Workload, a: argparse.Namespace, grad: torch.Tensor) -> Trainer:
    emb = torch.nn.EmbeddingBag(w.rows, w.dim, mode="sum", sparse=True)
    opt = torch.optim.Adagrad(emb.parameters(), lr=a.lr, eps=a.eps)

    def step(indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        out = emb(indices, offsets)
        out.backward(grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.detach()

    # Adagrad's state is element-wise (a full [rows, dim] sum), created at construction.
    return Trainer("torch", "EmbeddingBag sparse + Adagrad", step, 2 * w.rows * w.dim * FP32, module=emb)


def _tier0_hit_rate(emb) -> Callable[[], str]:
    """Tier-0 hit rate over the interval since the previous call, from emb.stats()."""
    last = {"hits": 0, "misses": 0}

    def tier0(stats: dict) -> dict:
        # stats() is a dict per tier; take the one that names tier 0, else the first.
        for key, value in stats.items():
            if isinstance(value, dict) and str(key).lower().replace("_", "").replace(" ", "") in ("0", "tier0", "compute", "cache", "tier0cache"):
                return value
        return next(v for v in stats.values() if isinstance(v, dict))

    def rate() -> str:
        try:
            t0 = tier0(emb.stats())
            hits, misses = int(t0["hits"]), int(t0["misses"])
        except Exception as e:  # the stats layout is the engine's; never fail the benchmark over it
            return f"n/a ({type(e).__name__}: {e})"
        dh, dm = hits - last["hits"], misses - last["misses"]
        last["hits"], last["misses"] = hits, misses
        return f"{dh / (dh + dm):.4f}" if dh + dm else "n/a"

    return rate


def build_tieredemb(cached: bool) -> Callable[[Workload, argparse.Namespace, torch.Tensor], Trainer]:
    def build(w: Workload, a: argparse.Namespace, grad: torch.Tensor) -> Trainer:
        import tieredemb

        cache_rows = max(1, int(w.rows * a.cache_fraction)) if cached else None
        extra = {}
        if a.ssd_path is not None:
            # A fresh table per configuration (two open tables cannot share a path).
            import shutil

            path = os.path.join(a.ssd_path, "cached" if cached else "full")
            shutil.rmtree(path, ignore_errors=True)
            extra["ssd_path"] = path
            extra["ssd_options"] = {"backend": a.ssd_backend}
        if a.host_rows is not None:
            extra["host_rows"] = a.host_rows
        emb = tieredemb.TieredEmbeddingBag(
            w.rows, w.dim, mode="sum", cache_rows=cache_rows,
            optimizer=tieredemb.RowWiseAdagrad(lr=a.lr, eps=a.eps), seed=a.table_seed, **extra,
        )

        if a.preinit:
            store_every_row(emb, chunk=1 << 14)  # (small chunks: the temporaries stay out of the peak RSS)
            emb.flush()
            emb.reset_stats()

        def step(indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
            out = emb(indices, offsets)
            out.backward(grad)  # the fused optimizer updates the rows here; no optimizer.step()
            return out.detach()

        # Bytes of rows (weights + row-wise state) held in memory, tier by tier: tier 0, the
        # host cache if any, and the dense host backing store unless the rows live on SSD.
        row_bytes = (w.dim + 1) * FP32
        tier0_rows = cache_rows if cached else w.rows
        host_cache_rows = a.host_rows if a.host_rows is not None and a.host_rows < w.rows else 0
        dense_store = a.ssd_path is None and (cached or a.host_rows is not None)
        store_rows = w.rows if dense_store else 0
        held = (tier0_rows + host_cache_rows + store_rows) * row_bytes
        config = f"cache_rows={cache_rows}" if cached else "cache_rows=None (tier 0)"
        if a.preinit:
            config += ", preinit"
        if extra:
            config += ", " + ", ".join(f"{k}={v}" for k, v in extra.items())
        name = "tieredemb-cached" if cached else "tieredemb-full"
        return Trainer(name, config, step, held, hit_rate=_tier0_hit_rate(emb), module=emb)

    return build


BUILDERS = {
    "fbgemm": build_fbgemm,
    "torch": build_torch,
    "tieredemb-full": build_tieredemb(cached=False),
    "tieredemb-cached": build_tieredemb(cached=True),
}


# ---------------------------------------------------------------------------------------------
# Memory


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def current_rss() -> int:
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    import psutil

    return psutil.Process().memory_info().rss


def reset_peak_rss() -> bool:
    """Resets the kernel's peak-RSS mark (VmHWM) to the current RSS; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# ---------------------------------------------------------------------------------------------
# Timing


def run_batches(t: Trainer, batches: list) -> tuple[float, torch.Tensor]:
    """Seconds for the batches, and the last pooled output."""
    out = None
    start = time.perf_counter()
    for indices, offsets in batches:
        out = t.step(indices, offsets)
    return time.perf_counter() - start, out


def measure(trainers: list[Trainer], src: BatchSource, a: argparse.Namespace, progress: bool = True) -> dict:
    """Warm-up, then `runs` runs of `batches` distinct batches per system, interleaved by run."""
    w = src.workload
    n = w.batches
    warm = src.batches(0, a.warmup)
    runs = [src.batches(a.warmup + r * n, n) for r in range(a.runs)]
    res = {t.name: {"seconds": [], "hit_rate": [], "last_out": []} for t in trainers}
    for t in trainers:
        run_batches(t, warm)
        if t.hit_rate:
            t.hit_rate()  # start the counters after warm-up
    for r, batches in enumerate(runs):
        for t in trainers:
            sec, out = run_batches(t, batches)
            res[t.name]["seconds"].append(sec)
            res[t.name]["last_out"].append(out)
            if t.hit_rate:
                res[t.name]["hit_rate"].append(t.hit_rate())
            if progress:
                print(f"  run {r + 1}/{a.runs} {t.name:17s} {n * w.lookups_per_batch / sec / 1e6:8.2f} M lookups/s", flush=True)
    for t in trainers:
        lps = [n * w.lookups_per_batch / s for s in res[t.name]["seconds"]]
        res[t.name]["lookups_per_s"] = lps
    return res


# ---------------------------------------------------------------------------------------------
# Correctness: every system against a plain-torch row-wise Adagrad, from the same initial rows


def check(a: argparse.Namespace) -> int:
    """Trains each system from tieredemb's initial rows (or a seeded normal table without it) on
    the same batches; compares pooled outputs step by step and the final rows with a reference."""
    w = a.workload
    src = BatchSource(w)
    grad = upstream_grad(w)
    batches = src.batches(0, w.batches)
    trainers = {}
    for name in a.systems:
        if name == "torch":
            continue  # element-wise Adagrad: a different optimizer, nothing to compare
        try:
            trainers[name] = BUILDERS[name](w, a, grad)
        except Exception as e:
            print(f"skipped {name}: {type(e).__name__}: {e}")
    all_ids = torch.arange(w.rows)
    tiered = [t for n, t in trainers.items() if n.startswith("tieredemb")]
    w0 = tiered[0].module.read_rows(all_ids).clone() if tiered else torch.randn(w.rows, w.dim, generator=torch.Generator().manual_seed(0))
    for t in tiered[1:]:
        if not torch.equal(t.module.read_rows(all_ids), w0):
            print(f"{t.name}: initial rows differ from {tiered[0].name}'s (same seed)")
    if "fbgemm" in trainers:
        tbe = trainers["fbgemm"].module
        tbe.split_embedding_weights()[0].copy_(w0)

    # Reference: FBGEMM's EXACT_ROWWISE_ADAGRAD arithmetic, float64.
    ref_w, ref_m = w0.double(), torch.zeros(w.rows, dtype=torch.float64)
    offsets_full = torch.cat([src.offsets, torch.tensor([w.lookups_per_batch])])
    bag_of_id = torch.repeat_interleave(torch.arange(w.bags), offsets_full.diff())
    worst = {n: 0.0 for n in trainers}
    for k, (indices, offsets) in enumerate(batches):
        ref_out = torch.nn.functional.embedding_bag(indices, ref_w, offsets, mode="sum")
        for n, t in trainers.items():
            out = t.step(indices, offsets)
            err = ((out.double() - ref_out).abs().max() / ref_out.abs().max().clamp_min(1e-30)).item()
            worst[n] = max(worst[n], err)
        g = torch.zeros(w.rows, w.dim, dtype=torch.float64).index_add_(0, indices, grad.double()[bag_of_id])
        touched = torch.unique(indices)
        gt = g[touched]
        ref_m[touched] += gt.square().mean(1)
        ref_w[touched] -= a.lr * gt / (ref_m[touched].sqrt() + a.eps).unsqueeze(1)
    ok = True
    print(f"check: {w.batches} batches of {w.bags} x {w.ids_per_bag} over {w.rows} rows, lr {a.lr}; "
          "errors relative to the largest reference value")
    for n, t in trainers.items():
        final = t.module.read_rows(all_ids) if n.startswith("tieredemb") else t.module.split_embedding_weights()[0]
        err_w = ((final.double() - ref_w).abs().max() / ref_w.abs().max()).item()
        state = (t.module.read_optimizer_state(all_ids)[:, 0] if n.startswith("tieredemb")
                 else t.module.split_optimizer_states()[0][0])
        err_m = ((state.double() - ref_m).abs().max() / ref_m.abs().max()).item()
        good = max(worst[n], err_w, err_m) < 1e-5
        ok &= good
        print(f"  {n:17s} outputs {worst[n]:.2e}  final rows {err_w:.2e}  row-wise state {err_m:.2e}  {'ok' if good else 'WRONG'}")
    if "tieredemb-full" in trainers and "tieredemb-cached" in trainers:
        same = torch.equal(trainers["tieredemb-full"].module.read_rows(all_ids),
                           trainers["tieredemb-cached"].module.read_rows(all_ids))
        ok &= same
        print(f"  tieredemb-full and tieredemb-cached final rows bit-identical: {same}")
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------
# Driver


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--quick", action="store_true", help=f"smoke test: {QUICK.rows} rows, {QUICK.bags} bags, few batches")
    p.add_argument("--only", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--warmup", type=int, default=None, help="warm-up batches per system (default 5; quick 2)")
    p.add_argument("--runs", type=int, default=None, help="timed runs per system, median reported (default 5; quick 3)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--table-seed", type=int, default=0, help="tieredemb init seed")
    p.add_argument("--cache-fraction", type=float, default=0.1, help="tieredemb-cached: tier-0 rows / rows (default 0.1)")
    p.add_argument("--ssd-path", default=None, help="tieredemb: SSD tables go in subdirectories of this")
    p.add_argument("--ssd-backend", default="rocksdb", choices=["rocksdb", "slots", "log"],
                   help="tieredemb: ssd_options={'backend': ...} (default rocksdb)")
    p.add_argument("--host-rows", type=int, default=None, help="tieredemb: passed through as host_rows=")
    p.add_argument("--preinit", action="store_true",
                   help="tieredemb: write every row once before timing (untimed), as the peers do at construction")
    p.add_argument("--rss", action="store_true", help="child mode: one system (--only), print a RESULT json line")
    p.add_argument("--no-rss", action="store_true", help="skip the per-system peak-RSS subprocesses")
    p.add_argument("--rss-systems", default=None, help="systems to measure RSS for (default: all selected)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--check", action="store_true",
                   help=f"correctness instead of speed: {CHECK.rows} rows, outputs and rows vs a reference")
    a = p.parse_args(argv)
    defaults = CHECK if a.check else QUICK if a.quick else Workload(batches=50)
    a.workload = workload_from_args(a, defaults)
    if a.warmup is None:
        a.warmup = 2 if a.quick else 5
    if a.runs is None:
        a.runs = 3 if a.quick else 5
    a.systems = [s.strip() for s in a.only.split(",") if s.strip()]
    for s in a.systems:
        if s not in BUILDERS:
            p.error(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    return a


def rss_child(a: argparse.Namespace) -> None:
    """One system in this process: bytes above the pre-build baseline at the peak."""
    (name,) = a.systems
    w = a.workload
    if name.startswith("tieredemb"):
        import tieredemb  # noqa: F401  (imports are in the baseline)
    elif name == "fbgemm":
        import fbgemm_gpu.split_table_batched_embeddings_ops_training  # noqa: F401
    src = BatchSource(w)
    grad = upstream_grad(w)
    warm = src.batches(0, a.warmup)
    runs = [src.batches(a.warmup + r * w.batches, w.batches) for r in range(a.runs)]
    baseline = current_rss()
    exact = reset_peak_rss()
    t = BUILDERS[name](w, a, grad)
    built = current_rss()
    run_batches(t, warm)
    secs = [run_batches(t, b)[0] for b in runs]
    peak = peak_rss()
    result = {
        "system": name, "config": t.config, "held_bytes": t.held_bytes, "baseline_rss": baseline,
        "after_build_rss": built, "peak_rss": peak, "peak_above_baseline": peak - baseline,
        "ratio": (peak - baseline) / t.held_bytes, "peak_reset": exact,
        "median_lookups_per_s": statistics.median(w.batches * w.lookups_per_batch / s for s in secs),
    }
    if name.startswith("tieredemb"):
        # Rows actually materialized: the engine reserves its pools lazily, so untouched rows
        # cost no memory (and are not in the peak).
        result["resident_rows"] = {tier: s.get("resident") for tier, s in t.module.stats().items() if isinstance(s, dict)}
    print("RESULT " + json.dumps(result), flush=True)


def rss_in_subprocess(name: str, a: argparse.Namespace) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--rss", f"--only={name}", *workload_flags(a.workload),
           f"--warmup={a.warmup}", f"--runs={a.runs}", f"--threads={a.threads}", f"--lr={a.lr!r}",
           f"--eps={a.eps!r}", f"--table-seed={a.table_seed}", f"--cache-fraction={a.cache_fraction!r}"]
    if a.ssd_path is not None:
        cmd.append(f"--ssd-path={a.ssd_path}")
        cmd.append(f"--ssd-backend={a.ssd_backend}")
    if a.host_rows is not None:
        cmd.append(f"--host-rows={a.host_rows}")
    if a.preinit:
        cmd.append("--preinit")
    return run_worker(cmd, name)


def run_worker(cmd: list[str], name: str) -> dict:
    """Runs a benchmark worker process; returns the JSON of its `RESULT ` line, or {"system": name,
    "error": its exit status and last lines} (torch's glog warnings, "W1124 12:00:00...", left out)."""
    p = subprocess.run(cmd, capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = [x for x in (p.stderr or p.stdout).strip().splitlines() if not re.match(r"W\d{4} ", x)][-5:]
    return {"system": name, "error": f"exit {p.returncode}: " + " | ".join(tail)}


def machine() -> str:
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{os.cpu_count()} cpus ({model}), torch {torch.__version__}, {platform.python_implementation()} {platform.python_version()}"


def fmt_m(x: float) -> str:
    return f"{x / 1e6:.2f}M"


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    if a.check:
        return check(a)
    if a.rss:
        if len(a.systems) != 1:
            raise SystemExit("--rss measures one system: pass --only NAME")
        rss_child(a)
        return 0

    w = a.workload
    print(f"workload: {w}; warm-up {a.warmup} batches, {a.runs} runs x {w.batches} batches; threads {a.threads}")
    print(f"machine: {machine()}; {datetime.datetime.now().isoformat(timespec='seconds')}")
    src = BatchSource(w)
    grad = upstream_grad(w)

    trainers, failed = [], {}
    for name in a.systems:
        t0 = time.perf_counter()
        try:
            trainers.append(BUILDERS[name](w, a, grad))
            print(f"built {name} in {time.perf_counter() - t0:.1f}s")
        except Exception as e:  # e.g. tieredemb not importable yet: measure the peers anyway
            failed[name] = f"{type(e).__name__}: {e}"
            print(f"skipped {name}: {failed[name]}")
    res = measure(trainers, src, a)

    # Invariant 6 of the engine: the cache size must not change the results (bit for bit on CPU).
    same = None
    if "tieredemb-full" in res and "tieredemb-cached" in res:
        same = all(torch.equal(x, y) for x, y in zip(res["tieredemb-full"]["last_out"], res["tieredemb-cached"]["last_out"]))

    base = statistics.median(res[BASELINE]["lookups_per_s"]) if BASELINE in res else None
    rows = []
    print()
    print("lookups/s over runs; ratios to FBGEMM: of the medians (the figure), median of run-by-run ratios "
          "(paired), of the best runs (best)")
    print(f"{'system':17s} {'config':44s} {'median':>8s} {'min':>8s} {'max':>8s} {'ratio':>7s} {'paired':>7s} {'best':>7s} {'target':>11s}  tier-0 hits")
    for t in trainers:
        r = res[t.name]
        lps = r["lookups_per_s"]
        med = statistics.median(lps)
        ratio = med / base if base else None
        # Paired ratio: run k of this system against run k of FBGEMM (adjacent in time).
        paired = statistics.median(x / y for x, y in zip(lps, res[BASELINE]["lookups_per_s"])) if base else None
        best = max(lps) / max(res[BASELINE]["lookups_per_s"]) if base else None
        target = SPEED_TARGETS.get(t.name)
        if t.name == "tieredemb-cached" and a.ssd_path is not None:
            target = SSD_TARGET
        hit = r["hit_rate"][-1] if r["hit_rate"] else ""
        verdict = "" if target is None or ratio is None else (f">={target} ok" if ratio >= target else f">={target} MISS")
        print(f"{t.name:17s} {t.config[:44]:44s} {fmt_m(med):>8s} {fmt_m(min(lps)):>8s} {fmt_m(max(lps)):>8s} "
              f"{(f'{ratio:.3f}x' if ratio else '-'):>7s} {(f'{paired:.3f}x' if paired else '-'):>7s} "
              f"{(f'{best:.3f}x' if best else '-'):>7s} {verdict:>11s}  {hit}")
        rows.append({"system": t.name, "config": t.config, "lookups_per_s": lps, "median": med,
                     "ratio_vs_fbgemm": ratio, "paired_ratio": paired, "best_ratio": best, "hit_rates": r["hit_rate"]})
    for name, why in failed.items():
        print(f"{name:17s} not measured: {why}")
    if same is not None:
        print(f"tieredemb-full and tieredemb-cached outputs bit-identical on the last batch of every run: {same}")

    rss_rows = []
    if not a.no_rss:
        rss_names = [s.strip() for s in (a.rss_systems or ",".join(t.name for t in trainers)).split(",") if s.strip()]
        print()
        print("peak RSS, one fresh process per system: (peak RSS - RSS before the table is built) / bytes held")
        print(f"{'system':17s} {'held':>10s} {'above base':>11s} {'ratio':>7s} {'target':>9s}")
        for name in rss_names:
            r = rss_in_subprocess(name, a)
            rss_rows.append(r)
            if "error" in r:
                print(f"{name:17s} failed: {r['error']}")
                continue
            target = f"<={RSS_TARGET} " + ("ok" if r["ratio"] <= RSS_TARGET else "MISS") if name.startswith("tieredemb") else ""
            print(f"{name:17s} {r['held_bytes'] / 2**20:9.1f}M {r['peak_above_baseline'] / 2**20:10.1f}M "
                  f"{r['ratio']:7.3f} {target:>9s}" + ("" if r["peak_reset"] else "  (peak mark not reset: ru_maxrss)")
                  + (f"  rows resident: {r['resident_rows']}" if r.get("resident_rows") else ""))

    if a.json:
        with open(a.json, "w") as f:
            json.dump({"workload": dataclasses.asdict(w), "machine": machine(), "argv": sys.argv,
                       "date": datetime.datetime.now().isoformat(timespec="seconds"),
                       "throughput": rows, "not_measured": failed, "tieredemb_outputs_identical": same,
                       "rss": rss_rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
