"""Training on a GPU: tieredemb's device-resident tier 0 against FBGEMM's GPU TBE and torch, in
one process, on the same batches.

Workload (the GPU issue's): 10M rows x 128 fp32, batches of 8192 bags x 20 ids, Zipf 1.05 over
permuted rows; forward + backward + row-wise Adagrad. Each system: 20 warm-up batches, then --runs
runs of 20 timed batches (the device synchronized around each run); lookups/s is the median over
runs. The systems are built side by side and their runs interleaved, the order turned round each
run (A B C, C B A, ...): the device machines are shared, and their speed drifts over tens of
seconds (on an H200 on 2026-11-27, one pair run one after the other gave ours-hbm 1.56x FBGEMM,
and again with the order swapped 0.68x), so each ratio is printed both as the ratio of the medians
(the target's) and paired (the median of run-by-run ratios, each pair a few seconds apart). Before
each build and each timed run, every prefetching system's worker is let finish what it may do now,
so its background work falls in no other system's run; its own runs end the same way, inside their
time, so that each holds its worker's work of exactly its batches. After each round of runs the
rates so far are printed and saved (a run cut short keeps them). --apart: one system at a time,
each closed before the next is built (less memory; no paired ratios). Batches are made on the
host, in pinned memory (as a torch DataLoader with pin_memory=True gives them: a copy from
pageable memory may wait for the device, and would slow the peers' steps for want of a loader
option; --pageable-batches gives them pageable), and each system moves them to the device as it
needs, inside the timed step; with --ids-on-device every system is given them on the GPU (ours
then checks them there, gpu/checks.py). Ours' cached systems (tier 0 = 10 %) start with every row
of the table stored below tier 0, so each miss reads its row as FBGEMM's UVM cache's do (a new
table's misses are drawn on the device until the rows come back from below: see
store_every_row; --fresh-table skips it).

Systems:
  fbgemm-hbm     FBGEMM TBE, the table in HBM (EmbeddingLocation.DEVICE), EXACT_ROWWISE_ADAGRAD
  fbgemm-uvm10   FBGEMM TBE, UVM cache holding 10% of the rows (MANAGED_CACHING, LRU)
  torch-ops      plain torch ops, table in HBM: unique, F.embedding_bag, row-wise Adagrad by index_add_
  torch-sparse   torch.nn.EmbeddingBag(sparse=True) + torch.optim.Adagrad
  ours-hbm       TieredEmbeddingBag(cache_rows=None, device="cuda"): its steps replay CUDA graphs
                 (gpu/graphed.py)
  ours-hbm-eager the same with cuda_graphs=False: every kernel launched from Python, as before
  ours-host10    tier 0 = 10% of the rows, over host memory
  ours-host10-zc the same with zero_copy=True: the GPU reads misses from, and writes dirty victims to,
                 the pinned host rows itself (no host copy); its steps replay CUDA graphs too
  ours-host10-zc-eager
                 the same with cuda_graphs=False
  ours-ssd10     tier 0 = 10%, over the SSD log store (--ssd-path), PrefetchLoader depth 2
  ours-ssd10-os  the same with the store read and written in stream order (gpu/storeio.py: its calls
                 queued on tier 0's stream, run by the driver in native code; no residency waits for the device)
  ours-host10-pf2, ours-host10-zc-pf2
                 ours-host10 and ours-host10-zc fed through a PrefetchLoader of depth 2: the next
                 batches' residency (its one wait for the device included) runs on a worker thread
                 and the tier's own stream while the training thread computes

Also the device index alone: lookups and plan+commit (inserts) per second for a batch of 1M ids.
Printed: lookups/s, the ratio to each FBGEMM figure, peak GPU memory (each system's own: building,
warming up or in a timed run), the host's waits for the device per batch (every system's, counted over 5 more
steps under torch's sync debug mode: on the training side, and on a prefetch worker's thread), and
the targets. --json for the record. --stacks DIR and --cprofile DIR: where the host's time goes
(host_time.py). --profile DIR: after the timed runs, each system trains 5 more batches under
torch.profiler: DIR/<system>.txt (the ops and kernels by device time) and DIR/<system>.trace.json
(a Chrome trace), and the wall and kernel time per step are printed (a step whose kernel time is
well under its wall time waits for the host), with the host's time split by trace_steps.py (torch
ops, CUDA calls, the backward's thread, the rest).
--device cpu runs the torch peers and ours on the CPU (FBGEMM's GPU TBE skipped): a check of
this script's plumbing where there is no GPU, not a figure of the GPU path. --ragged: bags of
L/2 to 3L/2 ids, so the number of ids varies from batch to batch (lookups/s counts the ids given).

    python bench/bench_gpu.py                      # everything (about 10 minutes on an H100)
    python bench/bench_gpu.py --only fbgemm-hbm,ours-hbm --runs 3
    python bench/bench_gpu.py --rows 1000000 --quick
    python bench/bench_gpu.py --dtype float16      # 16-bit weights (FBGEMM: weights_precision FP16)
    python bench/bench_gpu.py --only fbgemm-hbm,ours-hbm --ids-on-device
    python bench/bench_gpu.py --only fbgemm-hbm,ours-hbm,ours-hbm-eager --ragged
    python bench/bench_gpu.py --only fbgemm-uvm10,ours-host10-zc --profile $OUT/prof
    python bench/bench_gpu.py --device cpu --rows 20000 --quick --only torch-ops,ours-hbm,ours-host10-pf2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_steps  # noqa: E402
from host_time import (count_waits, cprofile_steps, phase_steps, profile_steps, sample_steps,  # noqa: E402
                       synchronize, train_steps)
from workload import BatchSource, Workload, store_every_row  # noqa: E402

SYSTEMS = ("fbgemm-hbm", "fbgemm-uvm10", "torch-ops", "torch-sparse", "ours-hbm", "ours-hbm-eager", "ours-host10",
           "ours-host10-zc", "ours-host10-zc-eager",
           "ours-host10-pf2", "ours-host10-zc-pf2", "ours-ssd10", "ours-ssd10-os")
# The targets: ours / peer, at least.
TARGETS = {"ours-hbm": ("fbgemm-hbm", 1.0), "ours-hbm-eager": ("fbgemm-hbm", 1.0), "ours-host10": ("fbgemm-uvm10", 1.0),
           "ours-host10-zc": ("fbgemm-uvm10", 1.0), "ours-host10-zc-eager": ("fbgemm-uvm10", 1.0),
           "ours-host10-pf2": ("fbgemm-uvm10", 1.0),
           "ours-host10-zc-pf2": ("fbgemm-uvm10", 1.0), "ours-ssd10": ("fbgemm-uvm10", 0.5),
           "ours-ssd10-os": ("fbgemm-uvm10", 0.5)}
PROFILED_STEPS = 5
SAMPLED_STEPS = 30
CPROFILED_STEPS = 30
PHASED_STEPS = 30
COUNTED_STEPS = 5  # steps after the timed runs whose waits for the device are counted


def prefetched(name: str) -> bool:
    """Whether the system is fed through a PrefetchLoader of depth 2."""
    return name.startswith("ours-ssd10") or name.endswith("-pf2")


def build(name: str, w: Workload, a, dev: torch.device):
    """(step(ids_cpu, offsets_cpu, grad), a description): one training step of a system."""
    lr, eps, rows, dim = a.lr, a.eps, w.rows, w.dim
    offsets_fb = torch.arange(0, w.bags * w.ids_per_bag + 1, w.ids_per_bag, device=dev)
    if name.startswith("fbgemm"):
        if dev.type != "cuda":
            raise ImportError("FBGEMM's GPU TBE needs a GPU")
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (CacheAlgorithm, ComputeDevice,
                                                                          EmbeddingLocation, PoolingMode)
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

        where = EmbeddingLocation.DEVICE if name == "fbgemm-hbm" else EmbeddingLocation.MANAGED_CACHING
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(rows, dim, where, ComputeDevice.CUDA)], optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            learning_rate=lr, eps=eps, pooling_mode=PoolingMode.SUM,
            weights_precision={"float32": SparseType.FP32, "float16": SparseType.FP16, "bfloat16": SparseType.BF16}[a.dtype],
            output_dtype=SparseType.FP32, cache_load_factor=a.cache_fraction, cache_algorithm=CacheAlgorithm.LRU,
            device=dev)

        def step(ids, offsets, grad):
            if a.ragged:  # (TBE takes B + 1 boundaries; fixed bags have them made once, above. Pinned, as
                # ours go over: 8193 pageable int64s pass 64 KiB, past which the copy may wait for the stream)
                fb = torch.cat((offsets, offsets.new_tensor([ids.numel()])))
                fb = (fb.pin_memory() if dev.type == "cuda" else fb).to(dev, non_blocking=True)
            else:
                fb = offsets_fb
            tbe(ids.to(dev, non_blocking=True), fb).backward(grad)
        return step, f"TBE {where.name}, EXACT_ROWWISE_ADAGRAD"
    if name == "torch-ops":
        table = torch.randn(rows, dim, device=dev)
        acc = torch.zeros(rows, device=dev)

        def step(ids, offsets, grad):
            ids = ids.to(dev, non_blocking=True)
            unique, inverse = torch.unique(ids, return_inverse=True)
            leaf = table[unique].requires_grad_(True)
            out = torch.nn.functional.embedding_bag(inverse, leaf, offsets.to(dev), mode="sum")
            (g,) = torch.autograd.grad(out, leaf, grad)
            with torch.no_grad():
                acc.index_add_(0, unique, g.square().mean(1))
                table.index_add_(0, unique, -lr * g / (acc[unique].sqrt() + eps)[:, None])
        return step, "unique + F.embedding_bag + index_add_ row-wise Adagrad"
    if name == "torch-sparse":
        emb = torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, device=dev)
        opt = torch.optim.Adagrad(emb.parameters(), lr=lr, eps=eps)

        def step(ids, offsets, grad):
            emb(ids.to(dev, non_blocking=True), offsets.to(dev, non_blocking=True)).backward(grad)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step, "nn.EmbeddingBag(sparse=True) + optim.Adagrad"

    import tieredemb
    from tieredemb.gpu import storeio

    cache = None if name.startswith("ours-hbm") else int(rows * a.cache_fraction)
    kw = dict(ssd_path=a.ssd_dir, ssd_options={"backend": "log"}) if name.startswith("ours-ssd10") else {}
    zero_copy = name.startswith("ours-host10-zc")
    storeio.ON_STREAM = name.endswith("-os")  # (read when the table is made)
    emb = tieredemb.TieredEmbeddingBag(rows, dim, "sum", cache_rows=cache, device=dev, dtype=getattr(torch, a.dtype),
                                       optimizer=tieredemb.RowWiseAdagrad(lr=lr, eps=eps), zero_copy=zero_copy,
                                       cuda_graphs=not name.endswith("-eager"), row_alignment=a.row_alignment, **kw)

    if cache is not None and not a.fresh_table:
        store_every_row(emb)

    def step(ids, offsets, grad):
        emb(ids, offsets).backward(grad)
    step.module = emb
    return step, (f"TieredEmbeddingBag cache_rows={cache}" + (", log store" if kw else "")
                  + (", cuda_graphs=False" if name.endswith("-eager") else "")
                  + (", zero_copy" if zero_copy else "") + (", prefetch depth 2" if prefetched(name) else "")
                  + (", store I/O on the tier's stream" if storeio.ON_STREAM else "")
                  + (f", row_alignment={a.row_alignment} ({emb.width} words a row)" if a.row_alignment != 4 else ""))


def ragged(source: BatchSource, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch i with bags of L/2 to 3L/2 ids (L on average; drawn for i alone): as many bags, a
    number of ids that varies from batch to batch, as jagged features give."""
    w = source.workload
    lengths = np.random.default_rng([w.seed, 3, i]).integers(w.ids_per_bag // 2, w.ids_per_bag * 3 // 2 + 1, w.bags)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return torch.from_numpy(source.ids.batch(i, int(lengths.sum()))), torch.from_numpy(offsets)


def make_batches(source: BatchSource, a, dev: torch.device) -> list:
    """Every batch a system steps through (each system its own pass over the one list): pinned on
    the host (a DataLoader's pin_memory=True), pageable, or on the device."""
    w, on_gpu = source.workload, dev.type == "cuda"
    profiled = ((PROFILED_STEPS if a.profile else 0) + (SAMPLED_STEPS if a.stacks else 0)
                + (2 * CPROFILED_STEPS if a.cprofile else 0)  # (cProfile's pass, then a prefetch worker's)
                + (PHASED_STEPS if a.phases else 0))
    counted = COUNTED_STEPS if on_gpu else 0
    batches = [ragged(source, i) if a.ragged else source.batch(i)
               for i in range(a.warmup + a.runs * w.batches + counted + profiled)]
    if a.ids_on_device:
        return [(ids.to(dev), offsets.to(dev)) for ids, offsets in batches]
    if on_gpu and not a.pageable_batches:
        return [(ids.pin_memory(), offsets.pin_memory()) for ids, offsets in batches]
    return batches


class System:
    """One system built and warmed up on its pass over the batches, its timed runs' rates kept.
    gpu_bytes: the GPU memory it took at its peak: building and warming up (the systems built
    before it, idle, in the baseline), or in a timed run (what it held after warming up, plus
    the most the run allocated beyond what was allocated when it began)."""

    def __init__(self, name: str, w: Workload, batches: list, a, dev: torch.device):
        self.name, self.w, self.a, self.dev = name, w, a, dev
        self.on_gpu = dev.type == "cuda"
        if self.on_gpu:
            torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev) if self.on_gpu else 0
        self.step, self.what = build(name, w, a, dev)
        self.module = getattr(self.step, "module", None)
        self.loader = None
        try:
            self.grad = torch.randn(w.bags, w.dim, device=dev, generator=torch.Generator(dev).manual_seed(7))
            self.loader = tieredemb_loader(self.module, batches, depth=2) if prefetched(name) else None
            self.stream = iter(self.loader if self.loader is not None else batches)
            train_steps(self.step, self.stream, self.grad, a.warmup)
            self.settle()
        except BaseException:
            self.close()
            raise
        self.held = (torch.cuda.memory_allocated(dev) - before) if self.on_gpu else 0
        self.gpu_bytes = (torch.cuda.max_memory_allocated(dev) - before) if self.on_gpu else 0
        self.rates: list[float] = []

    def timed_run(self) -> None:
        """One timed run of w.batches steps, the device synchronized around it. A prefetching
        system begins it settled (see settle) and ends it settled, inside the time: each run then
        holds the work of exactly w.batches batches, its worker's included."""
        synchronize(self.dev)
        if self.on_gpu:
            torch.cuda.reset_peak_memory_stats(self.dev)
            base = torch.cuda.memory_allocated(self.dev)
        start = time.perf_counter()
        looked = train_steps(self.step, self.stream, self.grad, self.w.batches)
        self.settle()
        synchronize(self.dev)
        self.rates.append(looked / (time.perf_counter() - start))
        if self.on_gpu:
            self.gpu_bytes = max(self.gpu_bytes, self.held + torch.cuda.max_memory_allocated(self.dev) - base)

    def settle(self, cap_s: float = 10.0) -> None:
        """Waits until a prefetching system's worker has nothing it may do now (every batch it
        may make resident is, or it waits for a release: Prefetcher.settled), then for the
        device: its background work then falls in no other system's timed run (nor in a later
        system's peak memory). Past cap_s it says so and goes on."""
        if self.loader is None:
            return
        end = time.perf_counter() + cap_s
        while not all(p.settled() for p in self.module._prefetchers()):
            if time.perf_counter() > end:
                print(f"{self.name}: its prefetch worker did not settle in {cap_s} s", file=sys.stderr)
                break
            time.sleep(0.0002)
        synchronize(self.dev)

    def report(self) -> dict:
        """The timed runs' figures, then the host's waits, the tier's counters and what the
        profiling flags ask for, on more steps: each of those guarded, so that one that fails
        (then named KEY_error) leaves the timing and the others in the results."""
        name, step, stream, grad, a, dev = self.name, self.step, self.stream, self.grad, self.a, self.dev
        out = {"system": name, "config": self.what, "lookups_per_s": statistics.median(self.rates), "runs": self.rates,
               "gpu_bytes": self.gpu_bytes}

        def guarded(key, make):  # (make's value as out[key]; one that fills out itself returns None)
            try:
                value = make()
            except Exception as e:  # (the timing stands without it)
                traceback.print_exc()
                out[f"{key}_error"] = f"{type(e).__name__}: {e}"
            else:
                if value is not None:
                    out[key] = value

        def waits():
            w = count_waits(step, stream, grad, COUNTED_STEPS)
            out["waits_per_batch"], out["worker_waits_per_batch"] = w["training"], w["other"]

        if self.on_gpu:
            guarded("waits", waits)
        if self.module is not None:
            guarded("tier0_hit_rate", lambda: self.module.stats()["tier0"]["hit_rate"])
            graphs = self.module._store.tier0.graphs
            if graphs is not None:
                guarded("graphs", graphs.stats)
        if a.phases and self.module is not None:
            guarded("phases", lambda: phase_steps(self.module, step, stream, PHASED_STEPS, grad, dev))
        if a.stacks:
            guarded("stacks", lambda: sample_steps(name, step, stream, SAMPLED_STEPS, grad, dev, a.stacks))
        if a.cprofile:
            guarded("cprofile", lambda: cprofile_steps(name, step, stream, CPROFILED_STEPS, grad, dev, a.cprofile,
                                                       self.module._prefetchers() if self.loader is not None else ()))
        if a.profile:
            guarded("profile", lambda: profile_steps(name, step, stream, PROFILED_STEPS, grad, dev, a.profile))
        return out

    def close(self) -> None:
        """The loader's workers stopped and the module closed (each even if the other fails)."""
        loader, module, self.loader, self.module, self.step = self.loader, self.module, None, None, None
        try:
            if loader is not None:
                loader.close()
        finally:
            try:
                if module is not None:
                    module.close()
            finally:
                if self.on_gpu:
                    torch.cuda.empty_cache()


def run_group(names: list, w: Workload, batches: list, a, dev: torch.device, tmp: str, results: dict,
              failed: dict, report) -> None:
    """The systems of names built side by side and their timed runs interleaved, the order
    turned round each run (A B, B A, ...): a drift of a shared machine's speed then falls on
    every system alike, and run k of one system sits beside run k of the others (the paired
    ratios). Before each build and each timed run, the prefetching systems' workers settle. A
    system that fails is closed and recorded; the others go on. report(name) prints and saves
    a system's results once they are in results (or its failure in failed); after each round of
    runs, the rates so far are saved and printed (a part stopped by its time limit keeps them)."""
    systems = {}

    def fail(name, e):
        traceback.print_exc()
        failed[name] = f"{type(e).__name__}: {e}"
        system = systems.pop(name, None)
        if system is not None:
            try:
                system.close()
            except Exception as closing:
                failed[name] += f"; then closing it: {type(closing).__name__}: {closing}"
        report(name)

    def settle_all():
        for system in systems.values():
            system.settle()

    try:
        for name in names:
            a.ssd_dir = os.path.join(tmp, name)
            settle_all()
            try:
                systems[name] = System(name, w, batches, a, dev)
            except ImportError as e:
                print(f"{name}: skipped ({e})", file=sys.stderr)
            except Exception as e:  # (the other systems still run, and the JSON keeps what failed)
                fail(name, e)
        for k in range(a.runs):
            for name in list(systems)[::1 if k % 2 == 0 else -1]:
                settle_all()
                try:
                    systems[name].timed_run()
                except Exception as e:
                    fail(name, e)
            for name, system in systems.items():
                results[name] = {"system": name, "partial_runs": system.rates}
            report(None)
            print(f"run {k + 1}/{a.runs}: " + ", ".join(f"{name} {system.rates[-1] / 1e6:.1f}"
                                                     for name, system in systems.items()) + " M lookups/s", flush=True)
        for name in list(systems):
            try:
                results[name] = systems[name].report()
            except Exception as e:
                results.pop(name, None)
                fail(name, e)
                continue
            system = systems.pop(name)
            try:
                system.close()
            except Exception as e:
                failed[name] = f"closing it: {type(e).__name__}: {e}"
            report(name)
    finally:
        for name in list(systems):  # (an interrupted group: its rates so far stay in results)
            try:
                systems.pop(name).close()
            except Exception:
                traceback.print_exc()


def tieredemb_loader(module, batches, depth):
    import tieredemb

    return tieredemb.PrefetchLoader(batches, [module], depth=depth)


def index_speed(dev: torch.device, a) -> dict:
    """The device index alone: lookups (one kernel) and inserts (plan + commit, the plan's counts
    read on the host, not its lists of ids: before 2026-11-26 they were, 16 MB a batch) per
    second, batches of 1M ids."""
    from tieredemb.gpu.index import SetIndex

    n, capacity = 1 << 20, 1 << 23
    index = SetIndex(capacity, "lru", dev)
    g = torch.Generator(dev).manual_seed(3)
    times = {"lookups": [], "inserts": []}
    for k in range(a.runs + 1):
        ids = torch.randint(0, 1 << 40, (n,), device=dev, generator=g).unique()
        count = torch.tensor([ids.numel()], device=dev)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        plan = index.plan(ids, count, 1 << 40, ids_to_host=False)  # (the index's work: its counts only to the host)
        index.commit(plan, pin=False)
        torch.cuda.synchronize(dev)
        t1 = time.perf_counter()
        index.lookup(ids)
        torch.cuda.synchronize(dev)
        t2 = time.perf_counter()
        if k:  # the first run compiles and allocates
            times["inserts"].append(ids.numel() / (t1 - t0))
            times["lookups"].append(ids.numel() / (t2 - t1))
    return {key: statistics.median(v) for key, v in times.items()}


def main(argv=None) -> int:
    from gpu_kernels import move_shape
    from tieredemb import TableConfig
    from tieredemb.gpu import PerMultiprocessor, moves, zerocopy
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(SYSTEMS), help="systems to run, comma-separated")
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--cache-fraction", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--ssd-path", default=None, help="directory for ours-ssd10's log store (default: a temp dir)")
    p.add_argument("--fresh-table", action="store_true",
                   help="ours' cached systems start as a new table, none of its rows stored below tier 0, so their "
                        "first misses are drawn on the device with nothing read (the default stores every row first: "
                        "see store_every_row)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="the weights' type, ours and FBGEMM's (the torch peers stay float32)")
    p.add_argument("--quick", action="store_true", help="5 timed batches, 5 warm-up, 1 run")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help=f"profile {PROFILED_STEPS} more steps of each system into DIR (see above)")
    p.add_argument("--stacks", default=None, metavar="DIR",
                   help=f"{SAMPLED_STEPS} more steps of each system with every thread's Python stack sampled: "
                        "DIR/<system>.stacks.txt (where the host's time goes)")
    p.add_argument("--phases", action="store_true",
                   help="30 steps more with each phase of our tables' steps timed where it runs (host_time.PHASES: "
                        "the plan, its wait, the store's reads and writes, the copies, ...; wall and thread CPU ms "
                        "a step), unprofiled")
    p.add_argument("--cprofile", default=None, metavar="DIR",
                   help=f"{CPROFILED_STEPS} more steps of each system under cProfile, the backward on the training "
                        "thread: DIR/<system>.cprofile.txt (each function's own host time and calls); a prefetching "
                        "system's worker too, by its thread's CPU time: DIR/<system>.worker.cprofile.txt")
    p.add_argument("--ids-on-device", action="store_true",
                   help="every system is given its batches' ids and offsets on the device (as a loader that moves "
                        "them ahead gives them), not on the host")
    p.add_argument("--ragged", action="store_true",
                   help="bags of L/2 to 3L/2 ids (a number of ids that varies from batch to batch)")
    p.add_argument("--pageable-batches", action="store_true",
                   help="host batches in pageable memory, not pinned (the default pins them, as a DataLoader with "
                        "pin_memory=True does)")
    p.add_argument("--apart", action="store_true",
                   help="one system at a time, each closed before the next is built (less memory), not side by "
                        "side with their runs interleaved (then no paired ratios)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a check of this script where there is no GPU (FBGEMM's GPU TBE skipped)")
    p.add_argument("--move-shape", default=None, metavar="RxWxC[xP]",
                   help="zero-copy's move kernels launched with R rows a program, W warps, C words of a row at once, "
                        "P programs per multiprocessor (0: a program a block of rows) for the whole run "
                        "(moves.MOVE_ROWS, MOVE_WARPS, MOVE_COLS, MOVE_PROGRAMS; default: theirs, "
                        f"{'x'.join(map(str, move_shape(f'{moves.MOVE_ROWS}x{moves.MOVE_WARPS}', moves)))})")
    p.add_argument("--write-back-inline", action="store_true",
                   help="zero-copy's swap writes the dirty victims down itself, the lookup waiting for both ways of "
                        "the bus (zerocopy.WRITE_BACK_APART = False; the default writes them down apart, on a stream "
                        "of their own)")
    p.add_argument("--write-back-programs", default=None, metavar="N|Kx",
                   help="the programs of zero-copy's write-back (apart), for the whole run: N in all, or Kx: K per "
                        "multiprocessor (zerocopy.WRITE_BACK_PROGRAMS; default: theirs, "
                        f"{zerocopy.WRITE_BACK_PROGRAMS})")
    p.add_argument("--row-alignment", type=int, default=4, metavar="BYTES",
                   help="our rows padded to a whole number of BYTES (TableConfig.row_alignment; 128: each row on a "
                        "GPU cache line, 160 words a row here, of which zero-copy moves the 129 that hold values)")
    a = p.parse_args(argv)
    try:  # (the table's own rule, checked before any system is built)
        TableConfig(1, 1, row_alignment=a.row_alignment)
    except ValueError as e:
        p.error(f"--row-alignment: {e}")
    if a.write_back_inline:
        zerocopy.WRITE_BACK_APART = False
    if a.write_back_programs is not None:
        spec = a.write_back_programs
        count = spec[:-1] if spec.endswith("x") else spec
        if not count.isdigit() or int(count) < 1:
            p.error(f"--write-back-programs: {spec!r} is neither N (programs in all) nor Kx (per multiprocessor), "
                    "each a positive whole number")
        zerocopy.WRITE_BACK_PROGRAMS = PerMultiprocessor(int(count)) if spec.endswith("x") else int(count)
    if a.move_shape is not None:
        try:
            rows, warps, cols, per_sm = move_shape(a.move_shape, moves)
        except ValueError as e:
            p.error(f"--move-shape: {e}")
        moves.MOVE_ROWS, moves.MOVE_WARPS, moves.MOVE_COLS = rows, warps, cols
        moves.MOVE_PROGRAMS = PerMultiprocessor(per_sm) if per_sm else None
    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; run it on a GPU machine (or --device cpu to check the script)",
              file=sys.stderr)
        return 2
    dev = torch.device(a.device)
    w = Workload(rows=a.rows, dim=128, bags=8192, ids_per_bag=20, alpha=a.alpha, batches=5 if a.quick else 20)
    if a.quick:
        a.runs, a.warmup = 1, 5
    names = a.only.split(",")
    for name in names:
        if name not in SYSTEMS:
            p.error(f"unknown system {name!r}; systems: {', '.join(SYSTEMS)}")
    batches = make_batches(BatchSource(w), a, dev)  # (before any system: not in their GPU memory)
    results, failed = {}, {}

    def report(name):
        write_json(a.json, dev, w, results, failed)  # (after each system: a later one may not finish)
        if "lookups_per_s" in results.get(name, {}):
            print_result(results[name], a)

    for group in ([n] for n in names) if a.apart else [names]:
        with tempfile.TemporaryDirectory(dir=a.ssd_path) as tmp:
            run_group(group, w, batches, a, dev, tmp, results, failed, report)
    fed = (("on the device" if a.ids_on_device else
            "on the host, " + ("pageable" if a.pageable_batches or dev.type != "cuda" else "pinned"))
           + (", ragged bags" if a.ragged else ""))
    print(f"\ndevice: {device_name(dev)}; torch {torch.__version__}; batches given {fed}")
    for ours, (peer, target) in TARGETS.items():
        if "lookups_per_s" in results.get(ours, {}) and "lookups_per_s" in results.get(peer, {}):
            ratio = results[ours]["lookups_per_s"] / results[peer]["lookups_per_s"]
            mine, theirs = results[ours]["runs"], results[peer]["runs"]
            paired = (f", paired {statistics.median(x / y for x, y in zip(mine, theirs)):.2f}x"
                      if not a.apart and len(mine) == len(theirs) else "")
            verdict = "met" if ratio >= target else "NOT met"
            print(f"{ours} / {peer}: {ratio:.2f}x{paired} (target >= {target}x: {verdict})")
    idx = None
    if dev.type == "cuda":
        idx = index_speed(dev, a)
        print(f"device index, 1M ids: {idx['lookups'] / 1e9:.2f} G lookups/s, {idx['inserts'] / 1e9:.3f} G inserts/s")
    write_json(a.json, dev, w, results, failed, idx)
    return 1 if failed else 0


def print_result(r: dict, a) -> None:
    name = r["system"]
    runs = ", ".join(f"{x / 1e6:.1f}" for x in r["runs"])
    print(f"{name:18s} {r['lookups_per_s'] / 1e6:8.1f} M lookups/s  (runs {runs})"
          f"  GPU {r['gpu_bytes'] / 2**30:5.2f} GiB"
          + (f"  waits/batch {r['waits_per_batch']:.1f} (+{r['worker_waits_per_batch']:.1f} on the prefetch worker)"
             if "waits_per_batch" in r else "")
          + (f"  tier-0 hit {r['tier0_hit_rate']:.3f}" if "tier0_hit_rate" in r else "")
          + (f"  graphs {r['graphs']}" if "graphs" in r else "")
          + f"  [{r['config']}]", flush=True)
    for key in (k for k in r if k.endswith("_error")):
        print(f"{'':18s} {key}: {r[key]}", flush=True)
    if "phases" in r:
        ph = r["phases"]
        print(f"{'':18s} phases: {ph['wall_ms_per_step']:.3f} ms a step; wall / CPU ms a step (calls), inclusive:",
              flush=True)
        for thread, got in ph["threads"].items():
            times = (f"{phase} {t['wall_ms']:.3f} / {t['cpu_ms']:.3f} ({t['calls']:g})" for phase, t in got.items())
            print(f"{'':18s}   {thread}: " + "; ".join(times), flush=True)
    if "stacks" in r:
        for thread, lines in r["stacks"]["top"].items():
            print(f"{'':18s} stacks of {thread}: " + "; ".join(lines), flush=True)
    if "cprofile" in r:
        cp = r["cprofile"]
        print(f"{'':18s} cProfile: {cp['wall_ms_per_step']:.3f} ms a step; own us a step (calls): "
              + "; ".join(f"{where} {us:.0f} ({calls:g})" for where, us, calls in cp["top"]), flush=True)
        if "worker" in cp:
            wk = cp["worker"]
            print(f"{'':18s} prefetch worker: {wk['wall_ms']:.3f} ms wall, {wk['cpu_ms']:.3f} ms CPU a residency; "
                  "own CPU us a residency (calls): "
                  + "; ".join(f"{where} {us:.0f} ({calls:g})" for where, us, calls in wk["top"]), flush=True)
    if "profile" in r:
        pr = r["profile"]
        print(f"{'':18s} profiled {pr['steps']} steps: {pr['wall_ms_per_step']:.3f} ms a step, kernels "
              f"{pr['kernel_ms_per_step']:.3f} ms a step ({a.profile}/{name}.txt)\n"
              f"{'':18s} {trace_steps.line('', pr['phases']).strip()}\n"
              f"{'':18s} kernels a step: "
              + "; ".join(f"{k} {us:.1f} us" for k, us in pr.get("top_kernels_us_per_step", [])), flush=True)


def device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (a check of the script: no GPU figure)"


def write_json(path, dev: torch.device, w: Workload, results: dict, failed: dict, index=None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"device": device_name(dev), "workload": vars(w) if hasattr(w, "__dict__") else str(w),
                       "systems": results, "failed": failed, "index": index}, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
