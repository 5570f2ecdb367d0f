"""Training throughput with pipelined prefetch: an SSD-backed table at prefetch depth 0, 1, 2, 4
against FBGEMM's CPU TBE with the whole table in memory, on the same batches.

One step = forward of B bags x L ids, backward of a fixed [B, D] upstream gradient, row-wise
Adagrad fused in backward (both systems). tieredemb: TieredEmbeddingBag(rows, D) with tier 0 =
--cache-fraction of the rows in host memory over an SSD store (--ssd-backend), one fresh table
per depth; depth 0 is plain training (no prefetch), depth k >= 1 iterates a PrefetchLoader(depth=k,
lookahead=k, or --lookahead). Every system trains on the same batches, interleaved run by run in
one process; each run of a prefetching system is a fresh PrefetchLoader over that run's batches, so the
pipeline fill (the first batch's rows) is inside the timed window. Reported: lookups/s = B * L *
batches / seconds, median (min, max) over runs, the ratio to FBGEMM and to depth 0; the tier-0
hit rate and the prefetch counters of the last run; whether every depth produced the same outputs
(bit for bit) as depth 0.

    python bench/bench_prefetch.py --ssd-path /tmp/pfbench                    # the issue's workload
    python bench/bench_prefetch.py --ssd-path /tmp/pfbench --ssd-backend rocksdb   # or slots
    python bench/bench_prefetch.py --ssd-path /tmp/pfbench --quick            # smoke test, < 2 min
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import build_fbgemm, machine  # noqa: E402
from workload import BatchSource, Workload, add_workload_args, upstream_grad, workload_from_args  # noqa: E402

ISSUE = Workload(rows=10_000_000, dim=128, bags=8192, ids_per_bag=20, alpha=1.05, batches=30)
QUICK = Workload(rows=300_000, dim=128, bags=512, ids_per_bag=20, alpha=1.05, batches=20)
DEPTHS = (0, 1, 2, 4)


class Ours:
    """One SSD-backed table trained at one prefetch depth."""

    def __init__(self, depth: int, w: Workload, a: argparse.Namespace, grad: torch.Tensor):
        import tieredemb

        self.depth = depth
        self.lookahead = a.lookahead  # None: the loader's default (= depth)
        self.name = f"depth {depth}"
        path = os.path.join(a.ssd_path, f"depth{depth}")
        shutil.rmtree(path, ignore_errors=True)
        self.emb = tieredemb.TieredEmbeddingBag(
            w.rows, w.dim, mode="sum", cache_rows=max(1, int(w.rows * a.cache_fraction)), ssd_path=path,
            ssd_options={"backend": a.ssd_backend}, optimizer=tieredemb.RowWiseAdagrad(lr=a.lr, eps=a.eps),
            seed=a.table_seed)
        self.grad = grad

    def run(self, batches: list) -> torch.Tensor:
        """Trains on the batches; returns the last output."""
        import tieredemb

        emb, out = self.emb, None
        if self.depth == 0:
            for ids, offsets in batches:
                out = emb(ids, offsets)
                out.backward(self.grad)
            return out.detach()
        loader = tieredemb.PrefetchLoader(batches, [emb], depth=self.depth, ids_fn=lambda b: {emb: b},
                                          lookahead=self.lookahead)
        for ids, offsets in loader:
            out = emb(ids, offsets)
            out.backward(self.grad)
        return out.detach()

    def counters(self) -> str:
        s = self.emb.stats()
        t0, p = s["tier0"], s["prefetch"]
        self.emb.reset_stats()
        hit = t0["hits"] / max(1, t0["hits"] + t0["misses"])
        return (f"hit {hit:.3f}; misses/batch {t0['misses'] / max(1, p['forwards']):.0f}; prefetched "
                f"{p['prefetched_rows']}, late {p['late_rows']}, demand {p['demand_misses']} rows; "
                f"waited {p['wait_seconds']:.2f} s")


class Fbgemm:
    def __init__(self, w: Workload, a: argparse.Namespace, grad: torch.Tensor):
        self.name = "fbgemm"
        self.trainer = build_fbgemm(w, a, grad)

    def run(self, batches: list) -> torch.Tensor:
        out = None
        for ids, offsets in batches:
            out = self.trainer.step(ids, offsets)
        return out

    def counters(self) -> str:
        return "whole table in memory"


def timed(system, batches) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = system.run(batches)
    return time.perf_counter() - start, out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p, ISSUE)
    p.add_argument("--quick", action="store_true", help=f"smoke test: {QUICK.rows} rows, {QUICK.bags} bags")
    p.add_argument("--ssd-path", required=True, help="the SSD tables go in subdirectories of this")
    p.add_argument("--ssd-backend", default="log", choices=["rocksdb", "slots", "log"])
    p.add_argument("--depths", default=",".join(map(str, DEPTHS)), help="prefetch depths (0: no prefetch)")
    p.add_argument("--no-fbgemm", action="store_true", help="skip the FBGEMM peer")
    p.add_argument("--lookahead", type=int, default=None,
                   help="batches in the eviction window past the prefetched ones (default: the depth)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up batches per system (default 60; quick 10)")
    p.add_argument("--runs", type=int, default=3, help="timed runs per system (median reported)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads and the native pool")
    p.add_argument("--cache-fraction", type=float, default=0.1, help="tier-0 rows / rows (default 0.1)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--table-seed", type=int, default=0)
    a = p.parse_args(argv)
    w = workload_from_args(a, QUICK if a.quick else ISSUE)
    warmup = a.warmup if a.warmup is not None else (10 if a.quick else 60)
    depths = [int(d) for d in a.depths.split(",")]
    torch.set_num_threads(a.threads)
    import tieredemb

    tieredemb._C.set_num_threads(a.threads)
    warnings.filterwarnings("ignore", message="Sparse invariant checks")

    print(f"workload: {w}; tier 0 = {a.cache_fraction:.0%} of the rows over SSD ({a.ssd_backend}); "
          f"lookahead {'= depth' if a.lookahead is None else a.lookahead}; "
          f"warm-up {warmup} batches, {a.runs} runs x {w.batches} batches; threads {a.threads}")
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.1f} at start")
    src = BatchSource(w)
    grad = upstream_grad(w)
    warm = src.batches(0, warmup)
    runs = [src.batches(warmup + r * w.batches, w.batches) for r in range(a.runs)]
    os.makedirs(a.ssd_path, exist_ok=True)
    systems = [] if a.no_fbgemm else [Fbgemm(w, a, grad)]
    systems += [Ours(d, w, a, grad) for d in depths]
    for s in systems:
        start = time.perf_counter()
        s.run(warm)
        print(f"warmed up {s.name} in {time.perf_counter() - start:.1f}s", flush=True)
        s.counters()
    seconds = {s.name: [] for s in systems}
    outs = {s.name: [] for s in systems}
    notes = {}
    for r, batches in enumerate(runs):
        for s in systems:
            sec, out = timed(s, batches)
            seconds[s.name].append(sec)
            outs[s.name].append(out)
            notes[s.name] = s.counters()
            print(f"  run {r + 1}/{a.runs} {s.name:8s} {w.batches * w.lookups_per_batch / sec / 1e6:7.3f} M lookups/s"
                  f"  ({notes[s.name]}; load {os.getloadavg()[0]:.1f})", flush=True)

    lps = {n: [w.batches * w.lookups_per_batch / t for t in ts] for n, ts in seconds.items()}
    med = {n: statistics.median(v) for n, v in lps.items()}
    base = med.get("fbgemm")
    d0 = med.get("depth 0")
    def paired(name: str, peer: str) -> str:
        """Median over runs of the ratio to the peer's run of the same batches (adjacent in time)."""
        if peer not in lps or name in (peer, "fbgemm"):
            return "-"
        return f"{statistics.median(x / y for x, y in zip(lps[name], lps[peer])):.3f}x"

    print()
    print("lookups/s over runs (median, min-max); ratios of the medians, and paired (median of run-by-run ratios)")
    print(f"{'system':8s} {'median':>9s} {'min':>9s} {'max':>9s} {'vs fbgemm':>10s} {'paired':>8s} "
          f"{'vs depth 0':>11s} {'paired':>8s}  last run")
    for s in systems:
        v = lps[s.name]
        vs_fb = f"{med[s.name] / base:.3f}x" if base else "-"
        vs_d0 = f"{med[s.name] / d0:.3f}x" if d0 and s.name != "fbgemm" else "-"
        print(f"{s.name:8s} {med[s.name] / 1e6:8.3f}M {min(v) / 1e6:8.3f}M {max(v) / 1e6:8.3f}M {vs_fb:>10s} "
              f"{paired(s.name, 'fbgemm'):>8s} {vs_d0:>11s} {paired(s.name, 'depth 0'):>8s}  {notes[s.name]}")
    ours = [s.name for s in systems if s.name != "fbgemm"]
    if len(ours) > 1:
        same = all(torch.equal(x, y) for n in ours[1:] for x, y in zip(outs[n], outs[ours[0]]))
        print(f"every depth's last output of every run bit-identical to {ours[0]}'s: {same}")
    for s in systems:
        if isinstance(s, Ours):
            s.emb.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
