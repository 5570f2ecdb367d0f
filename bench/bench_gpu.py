"""Training on a GPU: tieredemb's device-resident tier 0 against FBGEMM's GPU TBE and torch, in
one process, on the same batches.

Workload (the GPU issue's): 10M rows x 128 fp32, batches of 8192 bags x 20 ids, Zipf 1.05 over
permuted rows; forward + backward + row-wise Adagrad. Each system: 20 warm-up batches, then
--runs runs of 20 timed batches (the device synchronized around each run); lookups/s is the
median over runs. Batches are made on the host, in pinned memory (as a torch DataLoader with
pin_memory=True gives them: a copy from pageable memory may wait for the device, and would slow
the peers' steps for want of a loader option; --pageable-batches gives them pageable), and each
system moves them to the device as it needs, inside the timed step; with --ids-on-device every
system is given them on the GPU (ours then checks them there, gpu/checks.py).

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
  ours-host10-pf2, ours-host10-zc-pf2
                 ours-host10 and ours-host10-zc fed through a PrefetchLoader of depth 2: the next
                 batches' residency (its one wait for the device included) runs on a worker thread
                 and the tier's own stream while the training thread computes

Also the device index alone: lookups and plan+commit (inserts) per second for a batch of 1M ids.
Printed: lookups/s, the ratio to each FBGEMM figure, peak GPU memory, the host's waits for the
device per batch (every system's, counted over 5 more steps under torch's sync debug mode: on the
training side, and on a prefetch worker's thread), and the targets.
--json for the record. --profile DIR: after the timed runs, each system trains 5 more batches
under torch.profiler: DIR/<system>.txt (the ops and kernels by device time) and
DIR/<system>.trace.json (a Chrome trace), and the wall and kernel time per step are printed (a
step whose kernel time is well under its wall time waits for the host), with the host's time
split by trace_steps.py (torch ops, CUDA calls, the backward's thread, the rest).
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
from workload import BatchSource, Workload  # noqa: E402

SYSTEMS = ("fbgemm-hbm", "fbgemm-uvm10", "torch-ops", "torch-sparse", "ours-hbm", "ours-hbm-eager", "ours-host10",
           "ours-host10-zc", "ours-host10-zc-eager",
           "ours-host10-pf2", "ours-host10-zc-pf2", "ours-ssd10")
# The targets: ours / peer, at least.
TARGETS = {"ours-hbm": ("fbgemm-hbm", 1.0), "ours-hbm-eager": ("fbgemm-hbm", 1.0), "ours-host10": ("fbgemm-uvm10", 1.0),
           "ours-host10-zc": ("fbgemm-uvm10", 1.0), "ours-host10-zc-eager": ("fbgemm-uvm10", 1.0),
           "ours-host10-pf2": ("fbgemm-uvm10", 1.0),
           "ours-host10-zc-pf2": ("fbgemm-uvm10", 1.0), "ours-ssd10": ("fbgemm-uvm10", 0.5)}
PROFILED_STEPS = 5
SAMPLED_STEPS = 30
CPROFILED_STEPS = 30


def prefetched(name: str) -> bool:
    """Whether the system is fed through a PrefetchLoader of depth 2."""
    return name == "ours-ssd10" or name.endswith("-pf2")


def synchronize(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def train_steps(step, stream, grad, steps: int) -> int:
    """`steps` training steps of a system, on the next batches of stream. Returns the ids looked up."""
    looked = 0
    for _ in range(steps):
        ids, offsets = next(stream)[:2]
        step(ids, offsets, grad)
        looked += ids.numel()
    return looked


COUNTED_STEPS = 5  # steps after the timed runs whose waits for the device are counted


def count_waits(step, stream, grad, steps: int) -> dict:
    """`steps` more training steps with every wait of the host for the device counted, by thread:
    the implicit ones torch's sync debug mode warns of (.item(), a copy to pageable host memory,
    a stream's or the device's synchronize, ...) and Event.synchronize (which it does not see).
    Not in the timed runs: a warning costs host time. Returns waits per step on the training
    side (the training thread, and autograd's device thread, which runs a CUDA backward) and on
    the prefetch worker's thread."""
    import threading
    import warnings

    counts = {"training": 0, "other": 0}

    def seen():
        counts["other" if threading.current_thread().name == "tieredemb-prefetch" else "training"] += 1

    event_sync = torch.cuda.Event.synchronize
    torch.cuda.Event.synchronize = lambda self: (seen(), event_sync(self))[1]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = lambda message, *a, **k: seen() if "synchroniz" in str(message) else None
            torch.cuda.set_sync_debug_mode("warn")
            try:
                train_steps(step, stream, grad, steps)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        torch.cuda.Event.synchronize = event_sync
    return {k: v / steps for k, v in counts.items()}


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
            if a.ragged:  # (TBE takes B + 1 boundaries; fixed bags have them made once, above)
                fb = torch.cat((offsets, offsets.new_tensor([ids.numel()]))).to(dev, non_blocking=True)
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

    cache = None if name.startswith("ours-hbm") else int(rows * a.cache_fraction)
    kw = dict(ssd_path=a.ssd_dir, ssd_options={"backend": "log"}) if name == "ours-ssd10" else {}
    zero_copy = name.startswith("ours-host10-zc")
    emb = tieredemb.TieredEmbeddingBag(rows, dim, "sum", cache_rows=cache, device=dev, dtype=getattr(torch, a.dtype),
                                       optimizer=tieredemb.RowWiseAdagrad(lr=lr, eps=eps), zero_copy=zero_copy,
                                       cuda_graphs=not name.endswith("-eager"), **kw)

    def step(ids, offsets, grad):
        emb(ids, offsets).backward(grad)
    step.module = emb
    return step, (f"TieredEmbeddingBag cache_rows={cache}" + (", log store" if kw else "")
                  + (", cuda_graphs=False" if name.endswith("-eager") else "")
                  + (", zero_copy" if zero_copy else "") + (", prefetch depth 2" if prefetched(name) else ""))


def ragged(source: BatchSource, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch i with bags of L/2 to 3L/2 ids (L on average; drawn for i alone): as many bags, a
    number of ids that varies from batch to batch, as jagged features give."""
    w = source.workload
    lengths = np.random.default_rng([w.seed, 3, i]).integers(w.ids_per_bag // 2, w.ids_per_bag * 3 // 2 + 1, w.bags)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return torch.from_numpy(source.ids.batch(i, int(lengths.sum()))), torch.from_numpy(offsets)


def run_system(name: str, w: Workload, source: BatchSource, a, dev: torch.device) -> dict:
    on_gpu = dev.type == "cuda"
    profiled = ((PROFILED_STEPS if a.profile else 0) + (SAMPLED_STEPS if a.stacks else 0)
                + (CPROFILED_STEPS if a.cprofile else 0))
    counted = COUNTED_STEPS if on_gpu else 0
    batches = [ragged(source, i) if a.ragged else source.batch(i)
               for i in range(a.warmup + a.runs * w.batches + counted + profiled)]
    if a.ids_on_device:  # (staged before the memory baseline: the batches are not the system's)
        batches = [(ids.to(dev), offsets.to(dev)) for ids, offsets in batches]
    elif on_gpu and not a.pageable_batches:  # (a DataLoader's pin_memory=True)
        batches = [(ids.pin_memory(), offsets.pin_memory()) for ids, offsets in batches]
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev) if on_gpu else 0
    step, what = build(name, w, a, dev)
    grad = torch.randn(w.bags, w.dim, device=dev, generator=torch.Generator(dev).manual_seed(7))
    module = getattr(step, "module", None)
    loader = tieredemb_loader(module, batches, depth=2) if prefetched(name) else None
    try:
        return measure(name, what, step, module, iter(loader if loader is not None else batches), grad, w, a, dev,
                       before)
    finally:
        if loader is not None:
            loader.close()
        if module is not None:
            module.close()
        del step
        if on_gpu:
            torch.cuda.empty_cache()


def measure(name, what, step, module, stream, grad, w: Workload, a, dev: torch.device, before: int) -> dict:
    on_gpu = dev.type == "cuda"
    train_steps(step, stream, grad, a.warmup)
    rates = []
    for _ in range(a.runs):
        synchronize(dev)
        start = time.perf_counter()
        looked = train_steps(step, stream, grad, w.batches)
        synchronize(dev)
        seconds = time.perf_counter() - start
        rates.append(looked / seconds)
    out = {"system": name, "config": what, "lookups_per_s": statistics.median(rates), "runs": rates,
           "gpu_bytes": (torch.cuda.max_memory_allocated(dev) - before) if on_gpu else 0}
    if on_gpu:
        waits = count_waits(step, stream, grad, COUNTED_STEPS)
        out["waits_per_batch"], out["worker_waits_per_batch"] = waits["training"], waits["other"]
    if module is not None:
        out["tier0_hit_rate"] = module.stats()["tier0"]["hit_rate"]
        graphs = module._store.tier0.graphs
        if graphs is not None:
            out["graphs"] = graphs.stats()
    if a.stacks:
        out["stacks"] = sample_steps(name, step, stream, SAMPLED_STEPS, grad, dev, a.stacks)
    if a.cprofile:
        out["cprofile"] = cprofile_steps(name, step, stream, CPROFILED_STEPS, grad, dev, a.cprofile)
    if a.profile:
        try:
            out["profile"] = profile_steps(name, step, stream, PROFILED_STEPS, grad, dev, a.profile)
        except Exception as e:  # (the timing stands without it)
            traceback.print_exc()
            out["profile_error"] = f"{type(e).__name__}: {e}"
    return out


def profile_steps(name: str, step, stream, steps: int, grad, dev: torch.device, out_dir: str) -> dict:
    """`steps` more training steps under torch.profiler: the ops and kernels by device time in
    out_dir/<name>.txt, a Chrome trace in out_dir/<name>.trace.json; returns the wall time and the
    kernels' time per step (kernels on several streams may overlap: their sum can pass the wall)."""
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(out_dir, exist_ok=True)
    on_gpu = dev.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    synchronize(dev)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            ids, offsets = next(stream)[:2]
            with torch.profiler.record_function(trace_steps.STEP):  # (trace_steps.py splits the trace by it)
                step(ids, offsets, grad)
        synchronize(dev)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    sort_by = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    with open(os.path.join(out_dir, f"{name}.txt"), "w") as f:
        f.write(events.table(sort_by=sort_by, row_limit=40))
    trace = os.path.join(out_dir, f"{name}.trace.json")
    prof.export_chrome_trace(trace)
    kernels = [e for e in events if e.device_type.name == "CUDA"]
    kernel_us = sum(e.self_device_time_total for e in kernels)
    top = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:8]  # (for the log)
    return {"steps": steps, "wall_ms_per_step": wall * 1e3 / steps, "kernel_ms_per_step": kernel_us / 1e3 / steps,
            "phases": trace_steps.summarize(trace),
            "top_kernels_us_per_step": [(e.key[:60], e.self_device_time_total / steps) for e in top]}


def sample_steps(name: str, step, stream, steps: int, grad, dev: torch.device, out_dir: str) -> dict:
    """`steps` more training steps with every thread's Python stack sampled each half millisecond
    (autograd runs a CUDA backward on a thread of its own, which cProfile would not see): where
    the host's time goes, in out_dir/<name>.stacks.txt: each function's share of the samples at
    the top of a stack (its own time, what it calls in C included) and anywhere in one (its
    cumulative time), by thread. Returns the wall time per step."""
    import collections
    import sys
    import threading

    os.makedirs(out_dir, exist_ok=True)
    own, anywhere, per_thread = collections.Counter(), collections.Counter(), collections.Counter()
    done = threading.Event()
    names = {}

    def sample():
        me = threading.get_ident()
        while not done.wait(0.0005):
            for tid, frame in sys._current_frames().items():
                if tid == me:
                    continue
                if tid not in names:
                    names[tid] = next((t.name for t in threading.enumerate() if t.ident == tid), str(tid))
                per_thread[names[tid]] += 1
                seen, top = set(), True
                while frame is not None:
                    c = frame.f_code
                    key = f"{os.path.relpath(c.co_filename)}:{c.co_firstlineno}({c.co_name})"
                    if top:  # (with the line it was on)
                        own[(names[tid], f"{key} line {frame.f_lineno}")] += 1
                        top = False
                    if key not in seen:
                        anywhere[(names[tid], key)] += 1
                        seen.add(key)
                    frame = frame.f_back

    synchronize(dev)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    train_steps(step, stream, grad, steps)
    synchronize(dev)
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    total = max(1, sum(per_thread.values()))
    lines = [f"{steps} steps, {wall * 1e3 / steps:.3f} ms a step while sampled; samples by thread: "
             + ", ".join(f"{t} {n}" for t, n in per_thread.most_common())]
    for title, counts in (("own (top of the stack)", own), ("anywhere in the stack", anywhere)):
        lines.append(f"\n{title}: % of all samples, thread, function")
        lines += [f"{100 * n / total:6.1f}%  {t:20.20s} {key}" for (t, key), n in counts.most_common(60)]
    with open(os.path.join(out_dir, f"{name}.stacks.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    top = {}  # (each thread's four busiest lines, for the log: few files come back from a GPU machine)
    for (t, key), n in own.most_common():
        if len(top.setdefault(t, [])) < 4:
            top[t].append(f"{100 * n / total:.1f}% {key}")
    return {"steps": steps, "wall_ms_per_step": wall * 1e3 / steps, "threads": dict(per_thread), "top": top}


def cprofile_steps(name: str, step, stream, steps: int, grad, dev: torch.device, out_dir: str) -> dict:
    """`steps` more training steps under cProfile, with autograd's backward run on the training
    thread (torch.autograd.set_multithreading_enabled(False): cProfile sees one thread), so the
    backward's Python is counted with the forward's: each function's own time (what it calls in
    C included) and its calls, in out_dir/<name>.cprofile.txt. cProfile's cost per call inflates
    code of many small calls: a ranking of where the host's time goes, not a timing. Returns the
    wall time per step and the eight functions of most own time (us a step)."""
    import cProfile
    import pstats

    os.makedirs(out_dir, exist_ok=True)
    synchronize(dev)
    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        start = time.perf_counter()
        prof.enable()
        train_steps(step, stream, grad, steps)
        synchronize(dev)
        prof.disable()
        wall = time.perf_counter() - start
    st = pstats.Stats(prof)

    def where(f, line, fn):
        return fn if f.startswith("~") else f"{os.path.relpath(f)}:{line}({fn})"

    rows = [(where(*k), nc / steps, tt * 1e6 / steps, ct * 1e6 / steps) for k, (_cc, nc, tt, ct, _) in st.stats.items()]
    lines = [f"{steps} steps, {wall * 1e3 / steps:.3f} ms a step under cProfile"]
    for title, col in (("own", 2), ("cumulative", 3)):
        lines.append(f"\nby {title} time: calls a step, own us a step, cumulative us a step, function")
        lines += [f"{c:8.1f} {tt:9.1f} {ct:9.1f}  {w}" for w, c, tt, ct in sorted(rows, key=lambda r: -r[col])[:50]]
    with open(os.path.join(out_dir, f"{name}.cprofile.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    top = [(w, tt, c) for w, c, tt, _ in sorted(rows, key=lambda r: -r[2])[:8]]
    return {"steps": steps, "wall_ms_per_step": wall * 1e3 / steps, "top": top}


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
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="the weights' type, ours and FBGEMM's (the torch peers stay float32)")
    p.add_argument("--quick", action="store_true", help="5 timed batches, 5 warm-up, 1 run")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help=f"profile {PROFILED_STEPS} more steps of each system into DIR (see above)")
    p.add_argument("--stacks", default=None, metavar="DIR",
                   help=f"{SAMPLED_STEPS} more steps of each system with every thread's Python stack sampled: "
                        "DIR/<system>.stacks.txt (where the host's time goes)")
    p.add_argument("--cprofile", default=None, metavar="DIR",
                   help=f"{CPROFILED_STEPS} more steps of each system under cProfile, the backward on the training "
                        "thread: DIR/<system>.cprofile.txt (each function's own host time and calls)")
    p.add_argument("--ids-on-device", action="store_true",
                   help="every system is given its batches' ids and offsets on the device (as a loader that moves "
                        "them ahead gives them), not on the host")
    p.add_argument("--ragged", action="store_true",
                   help="bags of L/2 to 3L/2 ids (a number of ids that varies from batch to batch)")
    p.add_argument("--pageable-batches", action="store_true",
                   help="host batches in pageable memory, not pinned (the default pins them, as a DataLoader with "
                        "pin_memory=True does)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a check of this script where there is no GPU (FBGEMM's GPU TBE skipped)")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; run it on a GPU machine (or --device cpu to check the script)",
              file=sys.stderr)
        return 2
    dev = torch.device(a.device)
    w = Workload(rows=a.rows, dim=128, bags=8192, ids_per_bag=20, alpha=a.alpha, batches=5 if a.quick else 20)
    if a.quick:
        a.runs, a.warmup = 1, 5
    source = BatchSource(w)
    results, failed = {}, {}
    for name in a.only.split(","):
        if name not in SYSTEMS:
            p.error(f"unknown system {name!r}; systems: {', '.join(SYSTEMS)}")
        with tempfile.TemporaryDirectory(dir=a.ssd_path) as tmp:
            a.ssd_dir = os.path.join(tmp, "table")
            try:
                results[name] = run_system(name, w, source, a, dev)
            except ImportError as e:
                print(f"{name}: skipped ({e})", file=sys.stderr)
                continue
            except Exception as e:  # (the other systems still run, and the JSON keeps what failed)
                traceback.print_exc()
                failed[name] = f"{type(e).__name__}: {e}"
                write_json(a.json, dev, w, results, failed)
                continue
        r = results[name]
        print(f"{name:18s} {r['lookups_per_s'] / 1e6:8.1f} M lookups/s  (runs {', '.join(f'{x / 1e6:.1f}' for x in r['runs'])})"
              f"  GPU {r['gpu_bytes'] / 2**30:5.2f} GiB"
              + (f"  waits/batch {r['waits_per_batch']:.1f} (+{r['worker_waits_per_batch']:.1f} on the prefetch worker)"
                 if "waits_per_batch" in r else "")
              + (f"  tier-0 hit {r['tier0_hit_rate']:.3f}" if "tier0_hit_rate" in r else "")
              + (f"  graphs {r['graphs']}" if "graphs" in r else "")
              + f"  [{r['config']}]", flush=True)
        if "stacks" in r:
            for thread, lines in r["stacks"]["top"].items():
                print(f"{'':18s} stacks of {thread}: " + "; ".join(lines), flush=True)
        if "cprofile" in r:
            cp = r["cprofile"]
            print(f"{'':18s} cProfile: {cp['wall_ms_per_step']:.3f} ms a step; own us a step (calls): "
                  + "; ".join(f"{where} {us:.0f} ({calls:g})" for where, us, calls in cp["top"]), flush=True)
        if "profile" in r:
            pr = r["profile"]
            print(f"{'':18s} profiled {pr['steps']} steps: {pr['wall_ms_per_step']:.3f} ms a step, kernels "
                  f"{pr['kernel_ms_per_step']:.3f} ms a step ({a.profile}/{name}.txt)\n"
                  f"{'':18s} {trace_steps.line('', pr['phases']).strip()}\n"
                  f"{'':18s} kernels a step: "
                  + "; ".join(f"{k} {us:.1f} us" for k, us in pr.get("top_kernels_us_per_step", [])), flush=True)
        write_json(a.json, dev, w, results, failed)  # (after each system: a later one may not finish)
    batches = (("on the device" if a.ids_on_device else
                "on the host, " + ("pageable" if a.pageable_batches or dev.type != "cuda" else "pinned"))
               + (", ragged bags" if a.ragged else ""))
    print(f"\ndevice: {device_name(dev)}; torch {torch.__version__}; batches given {batches}")
    for ours, (peer, target) in TARGETS.items():
        if ours in results and peer in results:
            ratio = results[ours]["lookups_per_s"] / results[peer]["lookups_per_s"]
            print(f"{ours} / {peer}: {ratio:.2f}x (target >= {target}x: {'met' if ratio >= target else 'NOT met'})")
    idx = None
    if dev.type == "cuda":
        idx = index_speed(dev, a)
        print(f"device index, 1M ids: {idx['lookups'] / 1e9:.2f} G lookups/s, {idx['inserts'] / 1e9:.3f} G inserts/s")
    write_json(a.json, dev, w, results, failed, idx)
    return 1 if failed else 0


def device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (a check of the script: no GPU figure)"


def write_json(path, dev: torch.device, w: Workload, results: dict, failed: dict, index=None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"device": device_name(dev), "workload": vars(w) if hasattr(w, "__dict__") else str(w),
                       "systems": results, "failed": failed, "index": index}, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
