"""Where a training step's host time goes, for bench_gpu.py's systems (each a step function
step(ids, offsets, grad) over a stream of batches): the host's waits for the device counted,
torch.profiler's kernels and phases, every thread's Python stack sampled, and cProfile with the
backward on the training thread."""

from __future__ import annotations

import os
import threading
import time

import torch

import trace_steps


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
    cumulative time), by thread. Returns the wall time per step. The sampler is a Python thread:
    it samples when it gets the GIL, mostly as some thread lets it go (a torch op, a wait), so the
    lines that do are over-counted; cprofile_steps' worker profile is by each thread's CPU time."""
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


def cprofile_steps(name: str, step, stream, steps: int, grad, dev: torch.device, out_dir: str,
                   prefetchers: list = ()) -> dict:
    """`steps` more training steps under cProfile, with autograd's backward run on the training
    thread (torch.autograd.set_multithreading_enabled(False)), so the backward's Python is counted
    with the forward's: each function's own time (what it calls in C included) and its calls, in
    out_dir/<name>.cprofile.txt. cProfile's cost per call inflates code of many small calls: a
    ranking of where the host's time goes, not a timing. (From Python 3.12 on, cProfile hears every
    thread's calls, a prefetch worker's too.) Returns the wall time per step and the eight
    functions of most own time (us a step).

    prefetchers (a prefetching system's: module._prefetchers()): then `steps` steps more, with
    their workers' residencies of those steps' batches (Prefetcher._make_resident, on each
    worker's thread) profiled, by the thread's CPU time (time.thread_time: a wait for the GIL, for
    a lock, or asleep on the device counts nothing; a spin on it counts), in
    out_dir/<name>.worker.cprofile.txt, with the residencies' wall and CPU time a batch: their gap
    is the worker's waiting. A pass of its own, the training thread unprofiled, and by the profile
    module (sys.setprofile: its own thread only), not cProfile: Python allows one cProfile at a
    time from 3.12 on ("Another profiling tool is already active"), and that one hears every
    thread. The profile module costs more a call than cProfile (its times inflate more)."""
    import cProfile

    os.makedirs(out_dir, exist_ok=True)
    synchronize(dev)
    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        start = time.perf_counter()
        prof.enable()
        try:
            train_steps(step, stream, grad, steps)
            synchronize(dev)
        finally:
            prof.disable()
        wall = time.perf_counter() - start
    head = f"{steps} steps, {wall * 1e3 / steps:.3f} ms a step under cProfile"
    rows = _write_profile(os.path.join(out_dir, f"{name}.cprofile.txt"), head, [prof], steps, "step")
    out = {"steps": steps, "wall_ms_per_step": wall * 1e3 / steps, "top": _top(rows)}
    if prefetchers:
        workers = _WorkerProfiles(prefetchers)
        try:
            train_steps(step, stream, grad, steps)
            synchronize(dev)
        finally:
            workers.restore()
        n = workers.calls
        if n:
            head = (f"{n} residencies on the prefetch worker: {workers.wall * 1e3 / n:.3f} ms wall, "
                    f"{workers.cpu * 1e3 / n:.3f} ms of the thread's CPU time each, under the profile module "
                    "(by CPU time)")
            rows = _write_profile(os.path.join(out_dir, f"{name}.worker.cprofile.txt"), head, workers.profiles, n,
                                  "residency")
            out["worker"] = {"residencies": n, "wall_ms": workers.wall * 1e3 / n, "cpu_ms": workers.cpu * 1e3 / n,
                             "top": _top(rows)}
    return out


def _top(rows: list) -> list:
    """_write_profile's rows' eight functions of most own time: (function, own us, calls)."""
    return [(w, tt, c) for w, c, tt, _ in sorted(rows, key=lambda r: -r[2])[:8]]


class _WorkerProfiles:
    """Each prefetcher's _make_resident wrapped (on the instance, until restore()) to run under a
    profile.Profile (that thread's calls only) timed by time.thread_time, its wall and CPU time
    added up."""

    def __init__(self, prefetchers):
        import profile

        self.profiles, self.patched = [], []
        self.calls, self.wall, self.cpu = 0, 0.0, 0.0
        lock = threading.Lock()
        for p in prefetchers:
            def profiled(batch, window, make_resident=p._make_resident):
                # (a profile.Profile a residency: one run twice fails its own check, "Bad call")
                prof = profile.Profile(timer=time.thread_time)
                wall, cpu = time.perf_counter(), time.thread_time()
                try:
                    return prof.runcall(make_resident, batch, window)
                finally:
                    with lock:
                        self.calls += 1
                        self.wall += time.perf_counter() - wall
                        self.cpu += time.thread_time() - cpu
                        self.profiles.append(prof)
            p._make_resident = profiled
            self.patched.append(p)

    def restore(self) -> None:
        for p in self.patched:
            del p._make_resident  # (the class's again)


def _write_profile(path: str, head: str, profiles: list, per: int, unit: str) -> list:
    """The profiles' functions, by own and by cumulative time (us a `unit`, of which there were
    `per`), written to path under head. Returns the rows: (function, calls, own us, cumulative
    us), each a unit."""
    import pstats

    st = pstats.Stats(profiles[0])
    for prof in profiles[1:]:
        st.add(prof)

    def where(f, line, fn):
        return fn if f.startswith("~") or not f else f"{os.path.relpath(f)}:{line}({fn})"  # ('': profile's builtins)

    rows = [(where(*k), nc / per, tt * 1e6 / per, ct * 1e6 / per) for k, (_cc, nc, tt, ct, _) in st.stats.items()
            if k[2] != "setprofile" and k[:2] != ("profile", 0)]  # (the profile module's own frames)
    lines = [head]
    for title, col in (("own", 2), ("cumulative", 3)):
        lines.append(f"\nby {title} time: calls a {unit}, own us a {unit}, cumulative us a {unit}, function")
        lines += [f"{c:8.1f} {tt:9.1f} {ct:9.1f}  {w}" for w, c, tt, ct in sorted(rows, key=lambda r: -r[col])[:50]]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return rows


# A table's steps by phase (phase_steps): (what holds it, its attribute, the phase's name), the
# outer ones first. What holds it: "module" (the table), "tier" (its tier 0), "index", "pool",
# "lower" (the layer below tier 0), "zero_copy", or a module of the package by its dotted name.
PHASES = (
    ("module", "forward", "forward"),
    ("tieredemb.kernels", "backward_update", "backward + update"),
    ("tier", "dedup", "dedup"),
    ("tier", "resident", "residency"),
    ("tier", "_plan", "plan"),
    ("index", "_window_sorted", "plan: window sorted"),
    ("tieredemb.gpu.plan_kernels", "assign", "plan: assign launch"),
    ("tieredemb.gpu.plan_kernels", "place", "plan: place launch"),
    ("tieredemb.gpu.index", "_to_host", "plan: transfer (waits for the device)"),
    ("tieredemb.gpu.direct_index", "_to_host", "plan: transfer (waits for the device)"),
    ("lower", "write_from", "store: write victims"),
    ("lower", "read_to", "store: read misses"),
    ("pool", "to_host", "rows to host"),
    ("pool", "from_host", "rows to device"),
    ("zero_copy", "move", "zero-copy moves"),
    ("index", "plan_queued", "plan queued (no wait)"),
    ("on_stream", "queued_work", "residency queued over the store"),
    ("on_stream", "wait", "waits for the store's queued calls"),
    ("tier", "draw_marked", "draw marked"),
    ("index", "commit", "commit"),
)


def phase_steps(module, step, stream, steps: int, grad, dev: torch.device) -> dict:
    """`steps` more training steps with each phase of PHASES that the table has timed wherever it
    runs (the training thread, a prefetch worker, autograd's device thread): its calls, wall time
    and the thread's CPU time (time.thread_time: a wait for the device, the GIL or a lock counts no
    CPU), a step, inclusive of the phases it calls. A wrapper costs about a microsecond a call, so
    these time the unprofiled step, as cProfile cannot. Phases the table does not have, or that are
    not timed (a native object's method: a CPU tier 0's index), are named under "absent". Returns
    {"threads": {thread: {phase: {calls, wall_ms, cpu_ms}}}, "absent", "wall_ms_per_step"}."""
    import importlib

    tier = module._store.tier0
    holders = {"module": module, "tier": tier,
               **{k: getattr(tier, k, None) for k in ("index", "pool", "lower", "zero_copy", "on_stream")}}
    times: dict = {}
    lock = threading.Lock()

    def timed(fn, phase):
        def run(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
                with lock:
                    t = times.setdefault(threading.current_thread().name, {}).setdefault(phase, [0, 0.0, 0.0])
                    t[0], t[1], t[2] = t[0] + 1, t[1] + wall, t[2] + cpu
        return run

    undo, absent = [], []
    try:
        for where, attr, phase in PHASES:
            try:
                holder = holders[where] if where in holders else importlib.import_module(where)
            except ImportError:  # (the GPU modules, where Triton is not installed)
                holder = None
            is_module = isinstance(holder, type(importlib))
            if holder is None or not hasattr(holder, attr) or not (is_module or hasattr(holder, "__dict__")):
                absent.append(phase)  # (no __dict__: a native object, whose class is every instance's)
                continue
            fn, own = getattr(holder, attr), is_module or attr in vars(holder)  # (else the class's, bound)
            setattr(holder, attr, timed(fn, phase))
            undo.append((holder, attr, fn if own else None))
        synchronize(dev)
        on_stream = holders.get("on_stream")
        if on_stream is not None:  # (its store calls run on the driver's thread, in native code: timed there)
            on_stream.io.take_times()
        log_file = getattr(holders.get("lower"), "_file", None)  # (a log store's: its writes timed in native code)
        log_file = log_file if hasattr(log_file, "take_write_times") else None
        if log_file is not None:
            log_file.take_write_times()
        start = time.perf_counter()
        train_steps(step, stream, grad, steps)
        synchronize(dev)
        wall = time.perf_counter() - start
        if on_stream is not None:
            t = on_stream.io.take_times()
            times["the driver's thread: the store's calls (StreamIo)"] = {
                "store: write victims": [t["calls"], t["write_seconds"], 0.0],
                "store: read misses": [t["calls"], t["read_seconds"], 0.0]}
        if log_file is not None:  # (wall time only: no thread's CPU time is taken there)
            t = log_file.take_write_times()
            times["the log store's writes (LogFile)"] = {
                "write: waiting for the last append": [t["writes"], t["drain_seconds"], 0.0],
                "write: the record staged (appended at once past a record's rows)":
                    [t["writes"], t["stage_seconds"], 0.0],
                "write: compaction": [t["writes"], t["compact_seconds"], 0.0],
                f"the writer thread: appends ({t['appended_bytes'] / max(t['appends'], 1) / 1e6:.1f} MB each)":
                    [t["appends"], t["append_seconds"], 0.0]}
    finally:
        for holder, attr, before in reversed(undo):
            if before is None:
                delattr(holder, attr)  # (a bound method: the class's again)
            else:
                setattr(holder, attr, before)
    with lock:  # (a prefetch worker may still be timing a phase)
        threads = {thread: {phase: {"calls": c / steps, "wall_ms": w * 1e3 / steps, "cpu_ms": u * 1e3 / steps}
                            for phase, (c, w, u) in sorted(got.items(), key=lambda kv: -kv[1][1])}
                   for thread, got in times.items()}
    return {"steps": steps, "wall_ms_per_step": wall * 1e3 / steps, "threads": threads, "absent": absent}
