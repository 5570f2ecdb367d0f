"""The GPU path's work per training step, counted on a CPU: what a device tier 0 asks of torch and
Triton for one forward + backward, run on CPU tensors (the Triton kernels under the interpreter).

On a GPU each torch op that is not a view is about one kernel launch (a few microseconds of host
time each, whatever its size); FBGEMM's TBE takes a few launches a step. So these counts are the
host-side cost the GPU path pays, measurable without a GPU. The time itself, and the
device-to-host waits (which CPU tensors cannot show), are bench_gpu.py's, on a GPU.

Counted for one step after a few warm-up steps, per configuration: torch ops that launch a kernel
on a GPU (not views, allocations or wrapped Python numbers; outside the Triton kernels), Triton
kernel launches, and item() reads. Configurations: the whole table in
tier 0; tier 0 = 10% of the rows over host memory (rows copied through host blocks, and with
zero_copy: moved by a kernel); the first two also with the ids and offsets taken as CUDA inputs
are (the module's device-input path, forced on CPU tensors: gpu/checks.py); that tier 0 (without
zero_copy) through a PrefetchLoader of depth 2 (the training thread's step, and separately the
prefetch worker's residency of that step's batch).

With --host-time, also the host's time for the whole-table step and the zero-copy step (tier 0 =
10 %), eager and graphed, with every Triton launch and graph replay made a no-op (the kernels'
outputs are then whatever memory held: only steps whose host code reads none of them run
through): the Python and torch dispatch a step costs the host on this machine, without the
interpreter's own time and its effect on the caches. Small bags, so the torch ops' own work is
small. Not a GPU figure: on a GPU each launch costs its own host time too.

With --tables, the same two counts and that host time for bench_collection.py's 8 tables (dims
64 and 128, 2 to 16 ids a bag; rows at --tables-scale, whole in tier 0), trained as a loop of 8
TieredEmbeddingBag modules and as one TieredEmbeddingBagCollection (its 2 groups, one per dim),
host features: where a GPU step is bound by the host's launches (the tables' kernels take
microseconds), the ratio of these host times is what the collection gains over the loop (issue
13's target there: 2x). Again not a GPU figure.

    python bench/gpu_ops.py          (4,000 rows, 64 bags of 8: minutes on 2 cores, interpreted)
    python bench/gpu_ops.py --rows 20000 --bags 256 --length 20 --detail   (over 15 minutes: the whole
                                     table's draws of 20,000 rows, interpreted)
    python bench/gpu_ops.py --host-time
    python bench/gpu_ops.py --tables
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import os
import statistics
import threading
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import tieredemb  # noqa: E402
from tieredemb.gpu.tier import on_cpu_tensors  # noqa: E402

# Ops that launch no kernel on a GPU: views of a tensor's memory, allocations, Python numbers
# wrapped as tensors.
NO_KERNEL = {"view", "_unsafe_view", "slice", "select", "expand", "as_strided", "unsqueeze", "squeeze", "t",
             "transpose", "alias", "detach", "reshape", "split", "permute", "lift_fresh", "_reshape_alias",
             "split_with_sizes", "unbind", "narrow", "empty", "empty_like", "new_empty", "scalar_tensor"}


class Counter(TorchDispatchMode):
    """Counts the torch ops dispatched on the calling thread (the Triton interpreter's own tensor
    work excluded), and the Triton kernels launched."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.kernels = collections.Counter()
        self.inside_kernel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in NO_KERNEL and not self.inside_kernel:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict:
        """torch ops that launch a kernel on a GPU; scalar reads (.item(), int(), bool() of a
        tensor: a wait for the device; .tolist() and .cpu() are not seen on CPU tensors)."""
        return {"torch_ops": sum(n for k, n in self.ops.items() if k != "_local_scalar_dense"),
                "scalar_reads": self.ops["_local_scalar_dense"], "triton_launches": sum(self.kernels.values())}


def count_kernels(counter_of_thread):
    """Patches the Triton interpreter's launch so that each launch is counted by the counter of
    the thread making it (counter_of_thread(): a Counter or None)."""
    from triton.runtime.interpreter import InterpretedFunction

    launch = InterpretedFunction.run

    def run(self, *args, **kwargs):
        counter = counter_of_thread()
        if counter is None:
            return launch(self, *args, **kwargs)
        counter.kernels[self.fn.__name__] += 1
        counter.inside_kernel += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            counter.inside_kernel -= 1

    InterpretedFunction.run = run


def host_time(a, steps: int = 300) -> tuple[dict, dict]:
    """({step: median host seconds}, {step: launches a step}): the whole-table step and the
    zero-copy step (tier 0 = 10 %), each eager (cuda_graphs off) and through gpu/graphed.py with
    each graph's replay a no-op (on a GPU a replay is one launch), every Triton launch a no-op,
    all taken in turn: see the module's docstring."""
    from tieredemb.gpu import graphed

    small = argparse.Namespace(**{**vars(a), "bags": 8, "length": 2})
    data = batches(small, 6)
    cache = a.rows // 10
    tables = {"eager": table(a, None), "graphed": table(a, None, graphs=True),
              "zero-copy eager": table(a, cache, zero_copy=True), "zero-copy graphed": table(a, cache, zero_copy=True,
                                                                                           graphs=True)}
    for emb in tables.values():
        for ids, offsets, grad in data[:5]:  # (real kernels: the rows drawn, the graphs captured, the code warm)
            emb(ids, offsets).backward(grad)
    ids, offsets, grad = data[5]
    replay = graphed._Graph.replay

    def no_replay(graph, held):  # (the outputs of its last real run)
        if not hasattr(graph, "last"):
            graph.last = replay(graph, held)
        held = held() if callable(held) else held  # (a context; before 2026-11-26 a function returning one)
        with held if held is not None else contextlib.nullcontext():  # (None: the caller holds the locks)
            return graph.last

    for emb in tables.values():  # (each graph's last real run: this batch's)
        emb(ids, offsets).backward(grad)
    graphed._Graph.replay = no_replay
    launches = {}
    try:
        for name, emb in tables.items():
            with no_launches():  # (each graph's first no-op replay runs it once, to keep its outputs)
                emb(ids, offsets).backward(grad)
            with no_launches() as off:
                emb(ids, offsets).backward(grad)
            launches[name] = off.launches
        with no_launches():
            seconds = timed_steps({name: (lambda e=emb: e(ids, offsets).backward(grad))
                                   for name, emb in tables.items()}, steps)
    finally:
        graphed._Graph.replay = replay
    for name, emb in tables.items():
        replays = emb._store.tier0.graphs.stats()["replays"] if "graphed" in name else 0
        if "graphed" in name and replays < 2 * steps:
            raise RuntimeError(f"{name}: {replays} graphs replayed in {steps} steps: its steps were not graphed")
    return seconds, launches


class no_launches:
    """Every Triton launch a no-op while inside (counted in .launches)."""

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction

        self.run, self.launches = InterpretedFunction.run, 0

        def no_op(fn, *args, **kwargs):
            self.launches += 1

        InterpretedFunction.run = no_op
        return self

    def __exit__(self, *exc):
        from triton.runtime.interpreter import InterpretedFunction

        InterpretedFunction.run = self.run


def timed_steps(steps: dict, n: int) -> dict:
    """{name: step()} -> {name: median host seconds of a step}, the steps taken in turn (noise hits
    them alike), with the garbage collector off."""
    times = {name: [] for name in steps}
    gc.disable()
    try:
        for _ in range(n):
            for name, step in steps.items():
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
    finally:
        gc.enable()
    return {name: statistics.median(t) for name, t in times.items()}


def many_tables(a, current) -> None:
    """--tables: see the module's docstring."""
    from tieredemb.gpu.tier import collection_on_cpu_tensors

    from workload import TABLES

    tables = [(max(1, int(t.rows * a.tables_scale)), t.dim, t.ids_per_bag) for t in TABLES]
    g = torch.Generator().manual_seed(0)
    bags = 8  # (small: the torch ops' own work on the host is small, as in --host-time)
    feats = [(torch.randint(0, rows, (bags * length,), generator=g), torch.arange(0, bags * length, length))
             for rows, _, length in tables]
    grad = torch.randn(bags, sum(dim for _, dim, _ in tables), generator=g)
    grads = [x.contiguous() for x in torch.split(grad, [dim for _, dim, _ in tables], 1)]
    opt = tieredemb.RowWiseAdagrad(lr=0.1)
    loop = [on_cpu_tensors(tieredemb.TieredEmbeddingBag(rows, dim, "sum", optimizer=opt, cache_rows=None), None)
            for rows, dim, _ in tables]
    col = collection_on_cpu_tensors(tieredemb.TieredEmbeddingBagCollection(
        [tieredemb.EmbeddingBagConfig(f"t{k}", rows, dim, [f"f{k}"]) for k, (rows, dim, _) in enumerate(tables)],
        optimizer=opt))

    def loop_step():  # (as bench_collection.py's loop: every forward, then the backwards, last first)
        outs = [m(ids, offsets) for m, (ids, offsets) in zip(loop, feats)]
        for out, g_ in reversed(list(zip(outs, grads))):
            out.backward(g_)

    def collection_step():
        col({f"f{k}": f for k, f in enumerate(feats)}).values().backward(grad)

    steps = {"loop of 8 TieredEmbeddingBag": loop_step, "TieredEmbeddingBagCollection": collection_step}
    print(f"bench_collection.py's 8 tables at {a.tables_scale:g} of their rows, whole in tier 0, {bags} bags a "
          f"table, host features; one step after 3, on CPU tensors (Triton interpreted)")
    for name, step in steps.items():
        for _ in range(3):
            step()
        current.counter = Counter()
        with current.counter:
            step()
        s = current.counter.summary()
        current.counter = None
        print(f"  {name:32s} torch kernels {s['torch_ops']:4d}  triton launches {s['triton_launches']:3d}  "
              f"item() reads {s['scalar_reads']}")
    with no_launches() as off:
        host = timed_steps(steps, a.tables_steps)
    launches = off.launches // a.tables_steps
    (ln, lt), (cn, ct) = host.items()
    print(f"  Triton launches made no-ops, median of {a.tables_steps} steps each, taken in turn ({launches} "
          f"launches a step pair not counted): {ln} {lt * 1e6:.0f} us, {cn} {ct * 1e6:.0f} us a step: "
          f"collection / loop {lt / ct:.2f}x")


def batches(a, count: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = (torch.rand(a.bags * a.length, generator=g) ** 3 * a.rows).long()
        out.append((ids, torch.arange(0, a.bags * a.length, a.length), torch.randn(a.bags, a.dim, generator=g)))
    return out


def table(a, cache_rows, zero_copy=False, graphs=False):
    emb = tieredemb.TieredEmbeddingBag(a.rows, a.dim, "sum", optimizer=tieredemb.RowWiseAdagrad(lr=0.1),
                                       cache_rows=cache_rows)
    return on_cpu_tensors(emb, cache_rows, zero_copy=zero_copy, graphs=graphs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--bags", type=int, default=64)
    p.add_argument("--length", type=int, default=8, help="ids per bag")
    p.add_argument("--warmup", type=int, default=5, help="steps before the one counted")
    p.add_argument("--detail", action="store_true", help="also print each configuration's ops by name")
    p.add_argument("--host-time", action="store_true", help="also time the whole-table step's host code (see above)")
    p.add_argument("--tables", action="store_true",
                   help="instead: bench_collection.py's 8 tables as a loop of modules and as a collection (see above)")
    p.add_argument("--tables-scale", type=float, default=0.001, help="--tables: each table's rows times this")
    p.add_argument("--tables-steps", type=int, default=200, help="--tables: timed steps of each")
    a = p.parse_args(argv)
    current = threading.local()
    count_kernels(lambda: getattr(current, "counter", None))
    if a.tables:
        many_tables(a, current)
        return 0
    data = batches(a, a.warmup + 1)
    print(f"{a.rows:,} rows x {a.dim}, {a.bags} bags x {a.length} ids; one step (forward + backward + row-wise "
          f"Adagrad) after {a.warmup}, on CPU tensors (Triton interpreted)")
    results = []  # (name, Counter)
    for name, cache_rows, zero_copy, on_device in (
            ("whole table in tier 0", None, False, False),
            ("  ... ids and offsets given on the device", None, False, True),
            ("tier 0 = 10% over host memory", a.rows // 10, False, False),
            ("  ... ids and offsets given on the device", a.rows // 10, False, True),
            ("the same, zero_copy", a.rows // 10, True, False)):
        emb = table(a, cache_rows, zero_copy)
        if on_device:  # (the path CUDA inputs take: checked by a kernel, the verdict read once)
            emb._on_device = lambda t: True
        for ids, offsets, grad in data[:-1]:
            emb(ids, offsets).backward(grad)
        ids, offsets, grad = data[-1]
        current.counter = Counter()
        with current.counter:
            emb(ids, offsets).backward(grad)
        results.append((name, current.counter))
        current.counter = None
    # Prefetch: the training thread's step, and the worker's residency of one batch.
    emb = table(a, a.rows // 10)
    step, worker = Counter(), Counter()
    residency = emb._prefetch._make_resident

    def counted_residency(*args, **kwargs):
        batch, counted_residency.seen = counted_residency.seen, counted_residency.seen + 1
        if batch != a.warmup:  # (batches are made resident in order: this one the counted step's)
            return residency(*args, **kwargs)
        current.counter = worker
        try:
            with worker:
                return residency(*args, **kwargs)
        finally:
            current.counter = None

    counted_residency.seen = 0
    emb._prefetch._make_resident = counted_residency
    with tieredemb.PrefetchLoader(data, [emb], depth=2) as loader:
        for k, (ids, offsets, grad) in enumerate(loader):
            if k == a.warmup:
                current.counter = step
                with step:
                    emb(ids, offsets).backward(grad)
                current.counter = None
            else:
                emb(ids, offsets).backward(grad)
    results += [("tier 0 = 10%, PrefetchLoader depth 2: the step", step),
                ("  ... and the worker's residency of its batch", worker)]
    for name, c in results:
        s = c.summary()
        print(f"  {name:48s} torch kernels {s['torch_ops']:4d}  triton launches {s['triton_launches']:2d}  "
              f"item() reads {s['scalar_reads']}")
        if a.detail:
            print("    " + ", ".join(f"{k} {n}" for k, n in c.ops.most_common()))
    if a.host_time:
        seconds, launches = host_time(a)
        print("  host time of a step, 8 bags x 2 ids, Triton launches and graph replays made no-ops (median of 300 "
              "steps each, in turn; the launches not counted in it):")
        for name in seconds:
            print(f"    {name:20s} {seconds[name] * 1e6:6.0f} us a step ({launches[name]} launches)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
