"""Many tables: our collection against FBGEMM's CPU TBE and a loop of single-table modules, and
the planner's split of one tier-0 budget against the split in proportion to table size.

Workload (default): 8 tables of 1M to 20M rows, dims 64 and 128, Zipf alpha 0.90 (the 20M-row
table) to 1.20 (the small ones), one feature per table; B bags per batch, each table's bags of a
fixed length (2 ids for the big flat table, up to 16 for the small skewed ones: a real mix's big
id tables with little locality and small categorical tables read many times per sample). Ids from
workload.py's sampler (tieredemb.trace.ZipfSampler: Zipf over a permuted table, batch i a function
of (seed, table, i) alone). One step = forward, backward of a fixed upstream gradient
[B, sum of dims], row-wise Adagrad fused into backward; every system trains on the same batches.

  fbgemm        FBGEMM's CPU TBE holding the 8 tables in one table-batched module (embedding_specs
                of 8 HOST tables, one feature per table, indices and B * 8 + 1 offsets table-major;
                EXACT_ROWWISE_ADAGRAD; every row allocated and initialized at construction)
  loop          8 TieredEmbeddingBag modules, whole tables (cache_rows=None), in a model's order:
                every forward, then each module's backward on its own columns of the gradient, last
                first (--loop-order each: a table's backward right after its forward)
  collection    TieredEmbeddingBagCollection, every row in tier 0 (cache_bytes=None)
  proportional  the collection with cache_bytes = --cache-fraction of the rows' bytes (weights and
                optimizer state): its default split, in proportion to the tables' bytes
  planned       the same budget as tieredemb.planner splits it (plans["planned"]), planned from
                the first --plan-batches batches' ids (in the warm-up: the timed batches come after),
                predicting the batches after the first --plan-warmup of them (default: a trace
                until the proportional split's tier 0 can be full, + 100 batches, predicted over
                those last 100: the steady state the timed batches are in)
  equal         the same budget in equal shares (plans["equal"]); only when named in --only (a run
                costs as much as a planned one)
  proportional-pf, planned-pf
                proportional and planned fed through a PrefetchLoader of --prefetch-depth (warm-up
                and timed batches: the next batches' rows made resident, over SSD read, while a
                batch trains); only when named in --only

Below a cached system's tier 0 the rows are in host memory, or with --ssd-path on SSD (a fresh
store per run): the configuration where a tier-0 miss costs what it does on a GPU over host
memory, a read from a slower tier (the planner then plans with no host memory for whole tables).

Steady state. A cached table's tier 0 fills only once its batches have looked up as many distinct
rows as it holds: at the default sizes, 10% of the 20M-row table (2 ids a bag) after about 1,200
batches; until then its misses are first touches, the same under any split, and nothing is
evicted. And the host store under tier 0 faults its pages in as evicted rows are first written
back (huge pages: about 100 ms a batch while it does). So the warm-up (--warmup auto) lasts until
every table's tier 0 can be full under the proportional split and under the plans run (distinct
rows looked up >= its tier-0 rows, counted from the ids), plus 100 batches, and the timed batches
come after it; every system gets the same warm-up, whichever systems --only names. The worker
reports each table's tier-0 residency after the warm-up.

Each (system, run) is a fresh subprocess: it builds its system, trains the warm-up batches, then
times the --batches after them, so every run of every system starts from the same state and FBGEMM's
rows (about 8 GiB at the default sizes, allocated up front) never sit beside ours (the cached
systems, their store's pages faulted in, peak at about 9.6 GiB too). The runs go round the systems
in a rotating order, so noise on a shared machine hits them alike. Reported: lookups/s = ids looked
up / timed seconds, median (min, max) over runs; the issue's ratios of medians and the median of
run-by-run (paired) ratios; tier-0 hit rates over the timed batches, per table and over all
lookups, next to the planner's prediction; each worker's peak RSS and the load average. The plans
are made once, in the parent, and handed to the workers as JSON.

    python bench/bench_collection.py                      # the issue's workload (about 10 minutes)
    python bench/bench_collection.py --quick              # smoke test, under a minute
    python bench/bench_collection.py --only collection,loop --runs 5 --json out.json
    python bench/bench_collection.py --only proportional,planned,equal
    python bench/bench_collection.py --only proportional,planned --ssd-path /var/tmp/t   # rows on SSD
    python bench/bench_collection.py --only planned,planned-pf --ssd-path /var/tmp/t     # prefetch on SSD
    python bench/bench_collection.py --scale 0.5          # every table half as many rows
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import datetime
import hashlib
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import machine, peak_rss, reset_peak_rss, run_worker  # noqa: E402
from collection_plans import (FP32, MARGIN, auto_warmup, budget_of, make_plans, names, row_bytes,  # noqa: E402
                              tables_of)
from workload import Batches, Table, Workload, upstream_grad  # noqa: E402

SYSTEMS = ("fbgemm", "loop", "collection", "proportional", "planned", "equal", "proportional-pf", "planned-pf")
DEFAULT_SYSTEMS = SYSTEMS[:5]  # equal and the prefetched ones: only when asked for
CACHED = ("proportional", "planned", "equal", "proportional-pf", "planned-pf")  # tier 0 under the budget
PLANNED = ("planned", "equal", "planned-pf")  # need tieredemb.planner
# The targets: (system, peer) -> the least ratio of their lookups/s.
TARGETS = {("collection", "fbgemm"): 1.0, ("collection", "loop"): 2.0, ("planned", "proportional"): 1.2}
# Printed without a target: what else the run shows about the planner and the budget.
OTHER_RATIOS = (("planned", "equal"), ("proportional", "collection"), ("planned", "collection"),
                ("proportional-pf", "proportional"), ("planned-pf", "planned"))
QUICK = {"scale": 0.05, "bags": 256, "warmup": "20", "batches": 20, "runs": 2, "plan_batches": "20",
         "plan_warmup": 0}
DEFAULTS = {"scale": 1.0, "bags": 2048, "warmup": "auto", "batches": 100, "runs": 3, "plan_batches": "auto",
            "plan_warmup": None}


# ---------------------------------------------------------------------------------------------
# One system, in its own process (worker)


@dataclass
class System:
    prepare: object  # ids per table -> the system's input for a step (built before timing)
    step: object  # input -> pooled output [B, sum of dims] (the loop: per table), after backward and update
    tier0: object = None  # -> {table: tier-0 counters} of a cached collection, else None
    module: object = None  # the collection (its batches go through a PrefetchLoader in the -pf systems)


def build(name: str, a, tables: list[Table], src: Batches, grad: torch.Tensor) -> System:
    if name == "fbgemm":
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import ComputeDevice, EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

        # On cuda the tables sit in HBM (EmbeddingLocation.DEVICE), the ids are moved there before
        # timing; on the host, HOST tables.
        where, compute = ((EmbeddingLocation.DEVICE, ComputeDevice.CUDA) if a.device == "cuda"
                          else (EmbeddingLocation.HOST, ComputeDevice.CPU))
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(t.rows, t.dim, where, compute) for t in tables],
            feature_table_map=list(range(len(tables))),
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, pooling_mode=PoolingMode.SUM,
            weights_precision=SparseType.FP32, output_dtype=SparseType.FP32, learning_rate=a.lr, eps=a.eps)
        # Table-major: table 0's B bags, then table 1's, ...; B * T + 1 offsets (the last the total).
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(src.lengths, 0)]).to(a.device)

        def step(indices):
            out = tbe(indices, offsets)
            out.backward(grad)  # the fused optimizer updates the rows here
            return out.detach()

        return System(lambda ids: torch.cat(ids).to(a.device), step)

    import tieredemb

    opt = tieredemb.RowWiseAdagrad(lr=a.lr, eps=a.eps)
    if name == "loop":
        mods = [tieredemb.TieredEmbeddingBag(t.rows, t.dim, mode="sum", cache_rows=None, optimizer=opt, seed=a.table_seed,
                                             device=a.device) for t in tables]

        # Each module's backward gets its own columns of the fixed gradient, made contiguous once:
        # no torch.cat and slice backward in the step (their intra-op threads cost milliseconds
        # a step on a busy 2-core machine), the loop at its cheapest.
        grads = [g.contiguous() for g in torch.split(grad, [t.dim for t in tables], 1)]

        def step(ids):
            outs = [m(i, o) for m, i, o in zip(mods, ids, src.offsets)]
            for out, g in reversed(list(zip(outs, grads))):  # as autograd would: the last forward first
                out.backward(g)
            return [out.detach() for out in outs]

        def step_each(ids):  # --loop-order each: a table's backward right after its forward
            outs = []
            for m, i, o, g in zip(mods, ids, src.offsets, grads):
                out = m(i, o)
                out.backward(g)
                outs.append(out.detach())
            return outs

        if a.loop_order == "each":
            return System(lambda ids: ids, step_each)

        return System(lambda ids: ids, step)

    cfgs = [tieredemb.EmbeddingBagConfig(n, t.rows, t.dim, [f"f{k}"])
            for k, (n, t) in enumerate(zip(names(tables), tables))]
    name = name.removesuffix("-pf")  # (the same collection; the worker feeds it through a PrefetchLoader)
    if name == "collection":
        budget = {}
    elif name == "proportional":
        budget = {"cache_bytes": budget_of(a, tables)}
    else:
        with open(a.plans) as f:
            budget = {"plan": json.load(f)[name]}  # a Plan's to_dict()
    if a.ssd_path and name != "collection":  # a fresh store per run, removed when the worker ends
        os.makedirs(a.ssd_path, exist_ok=True)
        path = tempfile.mkdtemp(prefix=f"{name}-", dir=a.ssd_path)
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        budget.update(ssd_path=path, ssd={"backend": a.ssd_backend})
    try:
        ebc = tieredemb.TieredEmbeddingBagCollection(cfgs, optimizer=opt, seed=a.table_seed, device=a.device,
                                                     **budget)
    except TypeError as e:
        if "plan" in budget:
            raise SystemExit(f"planner not available: the collection takes no plan= ({e})")
        raise

    if a.kjt:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        keys = [f"f{k}" for k in range(len(tables))]

        def prepare(ids):
            return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(ids), lengths=src.lengths)
    else:
        def prepare(ids):
            return {f"f{k}": (i, o) for k, (i, o) in enumerate(zip(ids, src.offsets))}

    def step(features):
        out = ebc(features).values()
        out.backward(grad)
        return out.detach()

    def tier0():
        return {n: s["tier0"] for n, s in ebc.stats()["tables"].items()}

    return System(prepare, step, tier0 if name != "collection" else None, ebc)


def prefetch_counters(ebc) -> dict:
    """A collection's prefetch counters, summed over its groups."""
    stats = [e.stats()["prefetch"] for e in ebc.engines]
    return {k: sum(st[k] for st in stats) for k in ("prefetched_rows", "late_rows", "demand_misses", "wait_seconds",
                                                     "room_waits")}


def worker(a) -> None:
    """Builds one system, trains the warm-up batches, times the next ones; prints one RESULT line."""
    torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore")
    tables = tables_of(a)
    src = Batches(tables, a.bags, a.seed)
    grad = upstream_grad(Workload(bags=a.bags, dim=sum(t.dim for t in tables), seed=a.seed)).to(a.device)
    load = os.getloadavg()[0]
    reset_peak_rss()
    start = time.perf_counter()
    system = build(a.worker, a, tables, src, grad)
    built = time.perf_counter() - start
    start = time.perf_counter()
    if a.worker.endswith("-pf"):  # one PrefetchLoader over the warm-up and the timed batches
        from tieredemb import PrefetchLoader

        timed = [system.prepare(src.ids(i)) for i in range(a.warmup, a.warmup + a.batches)]
        warm = (system.prepare(src.ids(i)) for i in range(a.warmup))
        batches = iter(PrefetchLoader(itertools.chain(warm, timed), [system.module], depth=a.prefetch_depth,
                                      ids_fn=lambda features: {system.module: features}))
        for _ in range(a.warmup):
            system.step(next(batches))
        timed = batches  # (the loader keeps the next batches resident ahead through the timed ones)
    else:
        for i in range(a.warmup - 1):
            system.step(system.prepare(src.ids(i)))
        # The timed inputs are made before the last warm-up step: making them moves the allocator's
        # heap, and the next step's temporaries then fault in fresh pages (on this VM about 8 us a
        # page: a collection's first step after them took 40 ms instead of 10).
        timed = [system.prepare(src.ids(i)) for i in range(a.warmup, a.warmup + a.batches)]
        if a.warmup > 0:
            system.step(system.prepare(src.ids(a.warmup - 1)))
    warmed = time.perf_counter() - start
    before = system.tier0() if system.tier0 else None
    prefetched = a.worker.endswith("-pf")
    before_pf = prefetch_counters(system.module) if prefetched else None
    out = None
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for x in timed:
        out = system.step(x)
    sync()
    seconds = time.perf_counter() - start
    if isinstance(out, list):
        out = torch.cat(out, 1)
    tier0 = None
    if before is not None:
        tier0 = {}
        for n, s in system.tier0().items():
            if s is None:  # this table's group holds every row in tier 0
                tier0[n] = None
                continue
            hits, misses = s["hits"] - before[n]["hits"], s["misses"] - before[n]["misses"]
            tier0[n] = {"hits": hits, "misses": misses, "capacity": s["capacity"],
                        "resident_after_warmup": before[n]["resident"]}
    prefetch = None
    if prefetched:  # (the timed batches': the counters after warm-up taken off)
        after_pf = prefetch_counters(system.module)
        prefetch = {k: after_pf[k] - before_pf[k] for k in after_pf}
    result = {"system": a.worker, "seconds": seconds, "lookups": a.batches * src.lookups_per_batch, "prefetch": prefetch,
              "build_seconds": built, "warmup_seconds": warmed, "peak_rss": peak_rss(), "tier0": tier0,
              "load_before": load, "load_after": os.getloadavg()[0],
              "last_output_sha1": hashlib.sha1(out.cpu().numpy().tobytes()).hexdigest()}
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------
# The parent: runs, medians, ratios


def run_one(system: str, a) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", system, f"--scale={a.scale!r}",
           f"--bags={a.bags}", f"--warmup={a.warmup}", f"--batches={a.batches}", f"--seed={a.seed}",
           f"--cache-fraction={a.cache_fraction!r}", f"--threads={a.threads}", f"--lr={a.lr!r}",
           f"--eps={a.eps!r}", f"--table-seed={a.table_seed}", f"--loop-order={a.loop_order}",
           f"--device={a.device}", f"--prefetch-depth={a.prefetch_depth}"]
    if a.plans:
        cmd.append(f"--plans={a.plans}")
    if a.ssd_path:
        cmd += [f"--ssd-path={a.ssd_path}", f"--ssd-backend={a.ssd_backend}"]
    if a.kjt:
        cmd.append("--kjt")
    return run_worker(cmd, system)


def code_version() -> str:
    """HEAD and the tracked files changed in the work tree: the code the workers import (each run
    imports it afresh, so an edit during the benchmark shows up between runs)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    changed = [line[3:] for line in changed if line.strip()]
    return head + (f" + changes to {', '.join(changed)}" if changed else "")


def fmt_m(x: float) -> str:
    return f"{x / 1e6:.2f}M"


def overall_hit(tier0: dict | None) -> float | None:
    if not tier0:
        return None
    parts = [v for v in tier0.values() if v is not None]
    h, m = sum(v["hits"] for v in parts), sum(v["misses"] for v in parts)
    return h / (h + m) if h + m else None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(DEFAULT_SYSTEMS),
                   help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all but equal)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: tables at 5%% of the rows, 256 bags, 20 + 20 batches, 2 runs (no steady state)")
    p.add_argument("--scale", type=float, default=None, help="every table's rows times this (default 1; quick 0.05)")
    p.add_argument("--bags", type=int, default=None, help="bags (samples) per batch B (default 2048; quick 256)")
    p.add_argument("--warmup", default=None,
                   help="untimed batches before the timed ones, or 'auto': until every cached tier 0 can be "
                        f"full, + {MARGIN} (default auto; quick 20)")
    p.add_argument("--warmup-max", type=int, default=5000, help="auto warm-up: at most this many batches (default 5000)")
    p.add_argument("--plan-batches", default=None,
                   help="the planner's trace: the first N batches, or 'auto': until the proportional split's "
                        f"tier 0 can be full, + {MARGIN} (default auto; quick 20)")
    p.add_argument("--plan-warmup", type=int, default=None,
                   help="of those, the first W only fill tier 0 (the planner's warmup=): it predicts the "
                        f"steady state after them (default: --plan-batches - {MARGIN} when auto, else 0)")
    p.add_argument("--batches", type=int, default=None, help="timed batches per run (default 100; quick 20)")
    p.add_argument("--runs", type=int, default=None, help="runs (fresh processes) per system (default 3; quick 2)")
    p.add_argument("--cache-fraction", type=float, default=0.1,
                   help="the cached systems' tier-0 budget, a fraction of every row's bytes (default 0.1)")
    p.add_argument("--ssd-path", default=None,
                   help="the cached systems store every table's rows on SSD, in a fresh directory under this one "
                        "per run (removed after it), tier 0 above in memory; the planner plans with no host memory "
                        "for whole tables (default: rows in host memory)")
    p.add_argument("--ssd-backend", default="log", choices=["log", "slots", "rocksdb"],
                   help="the SSD store under --ssd-path (default log)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in every worker (default 2)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where every system's tables and tier 0 live (cuda: FBGEMM's GPU TBE with the tables in "
                        "HBM; ours with device='cuda', host ids as a data loader gives them)")
    p.add_argument("--loop-order", choices=("model", "each"), default="model",
                   help="the loop's order: model (every forward, then the backwards, last first, as in a "
                        "model: default) or each (a table's backward right after its forward: its rows "
                        "still in cache, a schedule no model has)")
    p.add_argument("--kjt", action="store_true", help="feed the collections a torchrec KeyedJaggedTensor, not a dict")
    p.add_argument("--prefetch-depth", type=int, default=2,
                   help="the -pf systems' PrefetchLoader depth (lookahead the same; default 2)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--seed", type=int, default=0, help="workload seed (ids and upstream gradient)")
    p.add_argument("--table-seed", type=int, default=0, help="tieredemb init seed")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--plans", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for k, v in (QUICK if a.quick else DEFAULTS).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    for k in ("warmup", "plan_batches"):
        if getattr(a, k) != "auto":
            try:
                setattr(a, k, int(getattr(a, k)))
            except ValueError:
                p.error(f"--{k.replace('_', '-')} {getattr(a, k)!r}: give a number of batches or 'auto'")
    a.systems = [s.strip() for s in a.only.split(",") if s.strip()]
    unknown = [s for s in a.systems if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    warnings.filterwarnings("ignore")
    if a.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no GPU here", file=sys.stderr)
        return 2
    tables = tables_of(a)
    src = Batches(tables, a.bags, a.seed)
    if a.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()} (every system's tables and tier 0 there)")
    print(f"{len(tables)} tables (rows x dim, Zipf alpha, ids per bag): "
          + ", ".join(f"{t.rows:,}x{t.dim} a{t.alpha} L{t.ids_per_bag}" for t in tables))
    print(f"B={a.bags}: {src.lookups_per_batch:,} lookups per batch; {a.warmup} warm-up + {a.batches} timed "
          f"batches per run, {a.runs} runs, a fresh process each; systems {','.join(a.systems)}; threads "
          f"{a.threads}; input {'KeyedJaggedTensor' if a.kjt else 'dict'}; loop order {a.loop_order}")
    fb_bytes = sum(t.rows * (t.dim + 1) for t in tables) * FP32
    print(f"rows' bytes: FBGEMM {fb_bytes / 2**30:.2f} GiB (allocated at construction); tieredemb "
          f"{sum(t.rows * row_bytes(t) for t in tables) / 2**30:.2f} GiB if every row were touched")
    version = code_version()
    print(f"machine: {machine()}; {datetime.datetime.now().isoformat(timespec='seconds')}; "
          f"load {os.getloadavg()[0]:.2f}; code {version}")

    systems = list(a.systems)
    skipped = {}
    if "fbgemm" in systems:
        try:
            import fbgemm_gpu.split_table_batched_embeddings_ops_training  # noqa: F401
        except Exception as e:  # not installed, or not loadable beside this torch
            skipped["fbgemm"] = f"fbgemm_gpu does not import ({type(e).__name__}: {e})"
    if any(s in CACHED for s in systems):
        print(f"tier-0 budget of the cached systems: {budget_of(a, tables) / 2**20:,.0f} MiB "
              f"({a.cache_fraction:g} of the rows' bytes)"
              + (f"; below it every row on SSD ({a.ssd_backend} store under {a.ssd_path})" if a.ssd_path else
                 "; below it every row in host memory"))
    plans = None
    if any(s in PLANNED for s in systems):
        if a.plan_batches == "auto":  # a trace long enough for the proportional split's steady state
            a.plan_batches = auto_warmup(a, tables, src, ["proportional"], None, what="planner's trace")
            if a.plan_warmup is None:
                a.plan_warmup = a.plan_batches - MARGIN
        a.plan_warmup = a.plan_warmup or 0
        plans, why = make_plans(a, tables, src)
        if plans is None:
            for s in PLANNED:
                skipped[s] = why
    for s, why in skipped.items():
        print(f"{s}: skipped: {why}")
    systems = [s for s in systems if s not in skipped]
    if a.warmup == "auto":  # the proportional split's fill counts whether it runs or not: one warm-up for any --only
        a.warmup = auto_warmup(a, tables, src, ["proportional", *{s.removesuffix("-pf") for s in systems if s in PLANNED}], plans,
                               least=a.plan_batches if plans is not None else 0)
    elif plans is not None and a.warmup < a.plan_batches:
        print(f"warning: warm-up {a.warmup} < --plan-batches {a.plan_batches}: the plan saw timed batches")
    if plans is not None:
        fd, a.plans = tempfile.mkstemp(prefix="bench_collection_plans_", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({k: p.to_dict() for k, p in plans.items()}))

    results: dict[str, list[dict]] = {s: [] for s in systems}
    failed: dict[str, str] = {}
    try:
        for r in range(a.runs):
            order = systems[r % len(systems):] + systems[:r % len(systems)]
            for s in order:
                if s in failed:
                    continue
                got = run_one(s, a)
                if "error" in got:
                    failed[s] = got["error"]
                    print(f"  run {r + 1}/{a.runs} {s:12s} failed: {got['error']}", flush=True)
                    continue
                results[s].append(got)
                hit = overall_hit(got["tier0"])
                print(f"  run {r + 1}/{a.runs} {s:12s} {got['lookups'] / got['seconds'] / 1e6:7.2f} M lookups/s"
                      f"  (build {got['build_seconds']:.1f}s, warm-up {got['warmup_seconds']:.1f}s, peak RSS "
                      f"{got['peak_rss'] / 2**30:.2f} GiB, load {got['load_before']:.2f}-{got['load_after']:.2f})"
                      + (f"  tier-0 hits {hit:.4f}" if hit is not None else "")
                      + (f"  prefetched {got['prefetch']['prefetched_rows']:,} rows, late {got['prefetch']['late_rows']:,}"
                         f", forwards waited {got['prefetch']['wait_seconds']:.2f}s" if got.get("prefetch") else ""),
                      flush=True)
    finally:
        if a.plans:
            os.unlink(a.plans)

    summary = {}
    print("\nlookups/s over runs: median (min, max)")
    for s, rs in results.items():
        if not rs:
            continue
        lps = [x["lookups"] / x["seconds"] for x in rs]
        summary[s] = {"lookups_per_s": lps, "median": statistics.median(lps), "min": min(lps), "max": max(lps),
                      "peak_rss": max(x["peak_rss"] for x in rs), "tier0_hit": overall_hit(rs[-1]["tier0"])}
        hit = summary[s]["tier0_hit"]
        print(f"  {s:12s} {fmt_m(summary[s]['median']):>8s} ({fmt_m(min(lps))}, {fmt_m(max(lps))})"
              f"  peak RSS {summary[s]['peak_rss'] / 2**30:5.2f} GiB" + (f"  tier-0 hits {hit:.4f}" if hit is not None else ""))
    for s, why in {**skipped, **failed}.items():
        print(f"  {s:12s} not measured: {why}")

    # Run r of a system and run r of its peer: the same round of the rotation, close in time.
    ratios = {}
    print("\nratios of the medians (paired: median of run-by-run ratios)")
    for (x, y), target in [*TARGETS.items(), *((pair, None) for pair in OTHER_RATIOS)]:
        if x not in summary or y not in summary:
            if target is not None:
                print(f"  {x}/{y}: not measured (target >= {target}x)")
            continue
        ratio = summary[x]["median"] / summary[y]["median"]
        paired = statistics.median(p / q for p, q in zip(summary[x]["lookups_per_s"], summary[y]["lookups_per_s"]))
        ratios[f"{x}/{y}"] = {"ratio": ratio, "paired": paired, "target": target}
        verdict = "" if target is None else f"  target >= {target}x: {'met' if ratio >= target else 'NOT met'}"
        print(f"  {x + '/' + y:25s} {ratio:6.3f}x (paired {paired:.3f}x){verdict}")

    cached = [s for s in CACHED if results.get(s)]
    if cached:
        how = f"after {a.plan_warmup:,} that fill tier 0" if a.plan_warmup else "cold"
        pred = (f" (the planner's prediction, from its {a.plan_batches:,}-batch trace, {how})"
                if plans is not None else "")
        print(f"\ntier-0 hit rate per table over the timed batches, measured{pred}; tier-0 rows; resident / "
              "capacity after warm-up")
        for s in cached:
            measured = results[s][-1]["tier0"]
            print(f"  {s}:")
            base = s.removesuffix("-pf")
            predicted = {t.name: t for t in plans[base].tables} if plans is not None and base in plans else {}
            for n in names(tables):
                v = measured.get(n)
                if v is None:
                    print(f"    {n}  whole table in tier 0")
                    continue
                rate = v["hits"] / (v["hits"] + v["misses"]) if v["hits"] + v["misses"] else float("nan")
                pred = f" ({predicted[n].tier0_hit:.3f})" if n in predicted else ""
                print(f"    {n}  {rate:.3f}{pred:8s}  rows {v['capacity']:>10,}  "
                      f"resident {v['resident_after_warmup'] / max(1, v['capacity']):6.1%}")

    if code_version() != version:
        print(f"\nwarning: the code changed during the benchmark ({version} -> {code_version()}): runs may "
              "differ in the code they ran")
    outputs = {s: {x["last_output_sha1"] for x in results[s]} for s in ("collection", *CACHED) if results.get(s)}
    same = None
    if len(outputs) > 1:
        same = len(set().union(*outputs.values())) == 1
        print(f"\ncollection outputs bit-identical whatever tier 0 holds ({', '.join(outputs)}; last batch of "
              f"every run): {same}")

    if a.json:
        doc = {"argv": sys.argv, "machine": machine(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "code": version, "code_after": code_version(),
               "args": {k: v for k, v in vars(a).items() if k not in ("worker", "plans")},
               "tables": [dataclasses.asdict(t) for t in tables], "lookups_per_batch": src.lookups_per_batch,
               "budget_bytes": budget_of(a, tables), "summary": summary, "ratios": ratios, "runs": results,
               "not_measured": {**skipped, **failed}, "collection_outputs_identical": same,
               "plans": None if plans is None else {k: p.to_dict() for k, p in plans.items()}}
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"json: {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
