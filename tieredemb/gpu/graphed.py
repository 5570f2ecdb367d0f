"""CUDA graphs of the lookups of tables held whole in tier 0 on a GPU, and of zero-copy ones.

Such a table (a DeviceTier with a DirectIndex whose misses are drawn on the device; or a zero-copy
DeviceTier, whose residency is queued with no wait: ZeroCopy.queued_work) makes a batch
resident without waiting for the device, and the device work of its lookup depends only on the
batch's shape: ids [N], boundaries [B + 1], the bag mode, the padding row. The ordinary path
(lookup.py) is bound by the host there: on an H200, 2.3 ms of host time a step for 0.35 ms of
kernels (bench/RESULTS.md), spent in some 30 CUDA calls, 6 Triton launches and the Python between
them. Here the forward's device work (the dedup, the rows drawn, the pooling) and the backward's
(each row's gradient summed, the optimizer) are each captured once as a CUDA graph over buffers
kept for the shape, and replayed: the host checks the ids into pinned memory (as before), queues
the copies in, one graph, and one copy of the pooled rows out. A lookup of several tables at once
(a collection's groups, each writing its features' rows into one block at out_at) is one graph
each way for all of them.

When: a shape is captured the second time a lookup of it comes (the first runs the ordinary path,
which compiles the kernels); at most _MOST_SHAPES shapes are kept, the least recently used
dropped. A shape is each table's number of bags and number of ids rounded up (padded(): at most
1/8 more), so batches whose ids vary in number, as jagged features' do, share one: the ids are
padded with an id the dedup leaves out, after the bags. A backward is captured for its optimizer's
arguments the same way; what changes every step (Adam's step size, and the step that stochastic
rounding draws from) the update kernel reads from device tensors, filled before each replay. Ids
and offsets given on the device, which the module checked there, are taken too, after the
ordinary path's one wait to read the verdict. Everything else takes the ordinary path:
per-sample weights, inverse-keyed features, batches registered for prefetch, a cached tier 0
that copies rows through the host, a caller capturing a graph of its own, and a forward of a
shape whose last batch still waits for its backward (gradient accumulation: the shape's buffers
are in use). The results are the ordinary path's, bit for bit: the same kernels, in the same
order over the same ids (the padding is no distinct id and in no bag).

A zero-copy table's forward graph also pins its batch's rows (its commit), and its backward's
releases them, the host counting both after the replay (ZeroCopy.graphed_admitted,
graphed_released); a forward under no_grad, a frozen table's, or one whose backward never comes
releases them by the ordinary kernel. Before each replay the tier makes room for the batch
(ZeroCopy.room_for_graph: the overflow slots at least the pinned ids and the batch's); a tier
that must grow replaces the tensors its graphs read, so its shapes are dropped (a shape in flight
then runs its backward's kernels one by one: _Shape.stale) and captured again.

On CPU tensors (a DeviceTier on CPU tensors: gpu/tier.on_cpu_tensors, the tests) a "graph" is its
function's work recorded as it ran once and replayed as recorded (gpu/recorded.py): a host value
baked into a launch or a tensor replaced between replays goes wrong there as in a CUDA graph, so
the tests show it without a GPU; the CUDA capture itself runs only on one (tests/test_gpu.py).
"""

from __future__ import annotations

import contextlib
import threading
from typing import NamedTuple

import numpy as np
import torch

from .. import _C, kernels, locks
from ..kernels import Bags
from . import copy_to, current_device, pooling
from .checks import SENTINEL32, SENTINEL64, checked_dtype, checked_ids
from .dedup import dedup as device_dedup
from .recorded import Recorded

_MOST_SHAPES = 4  # shapes whose graphs a table keeps
_MOST_BACKWARDS = 2  # backward graphs a shape keeps (one per optimizer arguments)
_CAPTURE_AT = 2  # the lookup of a shape that captures it (the first ones run the ordinary path)
_MOST_SEEN = 64  # shapes counted towards capture (then the counts start again)


def padded(n: int) -> int:
    """The ids a shape of n ids holds: n rounded up to a multiple of an eighth of the largest power
    of two at most n (at most 1/8 more), so batches whose ids vary in number share shapes."""
    step = 1 << max(0, n.bit_length() - 4)
    return -(-n // step) * step


class _Batch(NamedTuple):
    """A captured forward's batch, as kernels.forward and kernels.backward_update read one."""

    unique: torch.Tensor
    inverse: torch.Tensor
    count: torch.Tensor
    groups: tuple
    slots: torch.Tensor


class _Graph:
    """fn's device work captured as a CUDA graph (on a stream of its own: captures on two threads
    at once, a forward's and autograd's backward's, do not meet), or on CPU tensors recorded as
    it runs once (gpu/recorded.py: replayed op by op, as recorded, as a graph would be).
    replay(held) runs it again and returns its outputs (the tensors the capture made, rewritten
    in place); held: a context holding the locks a replay takes (fn takes its own, as the
    ordinary path does). On CPU tensors the capture does the work once (on a GPU it queues
    nothing): the first replay after it returns what it computed."""

    def __init__(self, fn, device: torch.device):
        self.graph = self.recorded = None
        if device.type != "cuda":
            self.recorded = Recorded(fn)
        else:
            # (not torch.cuda.graph, which first waits for the device and empties its caches: a
            # capture queues no work, so it needs no wait; "relaxed": other threads' CUDA calls, a
            # prefetch worker's or autograd's, may go on meanwhile, and a kernel Triton compiles for
            # this shape, not yet loaded, may be loaded during the capture)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
                graph.capture_begin(capture_error_mode="relaxed")
                try:
                    self.outputs = fn()
                finally:
                    graph.capture_end()
            self.graph = graph

    def replay(self, held):
        with held if held is not None else contextlib.nullcontext():  # (None: the caller holds them)
            if self.recorded is not None:
                return self.recorded.replay()
            self.graph.replay()
        return self.outputs

    @property
    def ran(self) -> bool:
        """Whether the capture itself did the work its first replay is to do (on CPU tensors)."""
        return self.recorded is not None and self.recorded.fresh


class _Input:
    """One table's inputs in a shape, on the device: ids [P] (the batch's N ids, then P - N ids
    `drop`: gpu/checks.py's sentinel, which the dedup leaves out), offsets [B + 2] (the B + 1
    given, then an empty bag, to which the ids after the last bag belong, as the module's device
    check places them: gpu/pooling.py), out_at [B + 1] or None (where each bag's row goes in the
    block; the empty bag's in the block's last row, a scratch row), bags (as kernels.py takes
    them); pinned: the host's two staging blocks, taken in turn."""

    def __init__(self, table, ids: torch.Tensor, offsets: torch.Tensor, out_at: torch.Tensor | None, drop: int,
                 mode: int, exclude_padding: bool, scratch: int):
        pad = -1 if table.padding_idx is None else table.padding_idx
        self.table, self.tier = table, table._store.tier0
        self.queued = self.tier.graph_kind() == "queued"  # (else "draw": see DeviceTier.graph_kind)
        self.ids, self.offsets, self.out_at, self.drop = ids, offsets, out_at, drop
        self.scratch = scratch  # where the added bag's row goes in the block, in floats: its last row
        self.bags = Bags(offsets, None, mode, pad if exclude_padding else -1, pad, out_at)
        self.out_at_given = None  # (the host's out_at last copied in)
        self.offsets_given = None  # (the host's bag boundaries last copied in: fixed bags give the same each batch)
        self.scalars = None  # the backward's step-dependent scalars (pooling.step_scalars)
        self.rate = None  # the learning rate in scalars (None: none yet)
        self.pinned: list = [None, None]
        self.turn = 0
        self.write_back = None  # a zero-copy residency's victims' write-back, queued after each replay (ZeroCopy)


class _Shape:
    """One shape's inputs (one _Input a table), the block the forward pools into ([rows, width]:
    the output's first `samples` rows, then the added bags' scratch rows), and its graphs. batches,
    out, saved: what the forward's last replay left (the backward reads them); grad: the
    backward's input (the added bags' rows zero)."""

    def __init__(self, inputs: list, rows: int, width: int, samples: int):
        self.inputs = inputs
        self.rows, self.width, self.samples = rows, width, samples
        tiers = [inp.tier for inp in inputs]  # (the locks a lookup of the shape takes, in this order)
        self.generations = tuple(t.generation for t in tiers)  # (the tensors its graphs read: see stale)
        self.stores_held = locks.Group(inp.table._store.lock for inp in inputs)
        self.indexes_held = locks.Group(t.index_lock for t in tiers)
        self.pools_held = locks.Group(t.pool_lock for t in tiers)
        self.forward: _Graph | None = None
        self.batches = self.out = self.saved = None
        self.grad: torch.Tensor | None = None
        self.backwards: dict = {}  # optimizer arguments -> _Graph
        self.last_args = None
        self.flight: _Flight | None = None  # the trained forward whose backward has not run yet

    @property
    def busy(self) -> bool:
        """Whether a trained forward's backward is still to come (its autograd graph alive)."""
        return self.flight is not None and not self.flight.done

    @property
    def stale(self) -> bool:
        """Whether a tier's pool or index state was replaced since the shape was made (a grow:
        DeviceTier.generation): its graphs read and write the old tensors, so replay none."""
        return self.generations != tuple(inp.tier.generation for inp in self.inputs)

    def release(self, keep, stream, collected: bool = False) -> None:
        """The queued residencies' pins of the shape's last forward released, for the inputs keep
        (input -> bool) says, queued on stream (None: each tier's own) now: a forward that takes no
        update, or whose backward never ran (collected: its autograd graph was collected, maybe
        inside one of the package's locks: see locks.py)."""
        for inp, batch in zip(self.inputs, self.batches):
            if inp.queued and keep(inp):
                store = inp.table._store
                if collected:
                    store.release_dropped(batch.slots, stream)
                else:
                    store.unpin(batch.slots, stream)


class _Flight:
    """A trained forward replayed from a shape's graph, until its backward runs or its autograd
    graph is freed without one (then the shape's buffers are free again, and the pins of its
    queued residencies released: the graph holds a DropGuard that lands it, not a __del__ or a weak
    reference, which Python's cyclic collector can run or clear while the graph is alive:
    native/drop_guard.cc). updates: whether each table takes an update (the others' pins were
    released after the forward); released: whether the backward released the pins."""

    __slots__ = ("shape", "updates", "done", "released")

    def __init__(self, shape: _Shape, updates: tuple):
        self.shape, self.updates, self.done, self.released = shape, updates, False, False

    def land(self) -> None:
        if self.done:
            return
        self.done = True
        try:
            if not self.released:
                self.released = True
                updated = {id(inp) for inp, u in zip(self.shape.inputs, self.updates) if u}
                self.shape.release(lambda inp: id(inp) in updated, None, collected=True)
        finally:
            if self.shape.flight is self:
                self.shape.flight = None

    def dropped(self) -> None:
        """Its autograd graph was freed (run by the graph's DropGuard): landed, if not yet."""
        try:
            self.land()
        except Exception:
            pass


class StepGraphs:
    """The captured lookups led by a DeviceTier's table (the first of a lookup's tables keeps
    them), by shape (see the module's docstring). captures, replays: graphs captured and replayed
    (forwards and backwards); failed: why capturing stopped here (a capture that raised: its
    lookup and every later one take the ordinary path)."""

    def __init__(self, tier):
        self.tier = tier
        self.shapes: dict = {}  # key -> _Shape, the least recently used first
        self.seen: dict = {}  # key -> lookups of a shape not captured yet
        # (held while the two dicts change: a grow on another thread, a prefetch worker's, drops shapes)
        self.shapes_lock = threading.Lock()
        self.captures = self.replays = 0
        self.failed: str | None = None

    def stats(self) -> dict:
        return {"shapes": len(self.shapes), "captures": self.captures, "replays": self.replays,
                "failed": self.failed}

    def _capture(self, fn) -> _Graph | None:
        if self.failed:
            return None
        try:
            graph = _Graph(fn, self.tier.device)
        except Exception as e:  # (nothing ran on a GPU: a capture queues no work; on CPU tensors, a test of a bug)
            self.failed = f"{type(e).__name__}: {e}"
            return None
        self.captures += 1
        return graph

    def pooled(self, parts: list, shape: tuple, samples: int, expand) -> torch.Tensor | None:
        """A lookup (lookup.py's parts, one a table, this tier's first, pooled into a block of
        `shape`, the first `samples` rows returned; expand: lookup.py's), through the graphs; or
        None where they do not apply (see the module's docstring): the caller runs the ordinary
        path."""
        if self.failed or expand or (self.tier.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return None
        keys = [self._part_key(p) for p in parts]
        if None in keys:
            return None
        tables = [p.table for p in parts]
        trained = torch.is_grad_enabled() and any(t._grad_anchor.requires_grad for t in tables)
        updates = tuple(trained and t._grad_anchor.requires_grad for t in tables)
        if any(u and t.optimizer is None for u, t in zip(updates, tables)):
            return None  # (the ordinary path raises the error)
        return self.forward(parts, (tuple(keys), tuple(shape), samples), updates if trained else None)

    def _part_key(self, part) -> tuple | None:
        """What a part brings to its lookup's shape, or None if the graphs do not take it."""
        tier = part.table._store.tier0
        # host ids, or device ids and offsets the module checked on the device (a verdict to read)
        given = "host" if part.check is None and part.ids.device.type == "cpu" else "device" if (
            part.check is not None and part.ids.device == tier.device
            and part.offsets.device in (tier.device, torch.device("cpu"))) else None
        if (given is None or tier.graphs is None or tier.device != self.tier.device or part.psw is not None
                or part.ids.numel() == 0 or not part.table._prefetch.idle()):
            return None
        kind = tier.graph_kind()
        if kind is None:
            return None
        dtype = part.ids.dtype if given == "device" else checked_dtype(tier.num_embeddings)
        return (tier.pool.rows.data_ptr(), kind, tier.generation, given, dtype, padded(part.ids.numel()),
                len(part.offsets), part.mode, part.exclude_padding, part.out_at is None)

    # -- forward ------------------------------------------------------------------------------
    def forward(self, parts: list, key: tuple, updates: tuple | None) -> torch.Tensor | None:
        """The parts' bags pooled by the graph of the shape `key` names (captured now if its time
        has come): the block's first rows, the lookup's samples; or None: the ordinary path is to
        run it. updates: whether each table takes an update in backward (None: no autograd graph
        is made)."""
        with self.shapes_lock:
            shape = self.shapes.pop(key, None)
            if shape is None:
                seen = self.seen.get(key, 0) + 1
                if seen < _CAPTURE_AT:
                    if len(self.seen) >= _MOST_SEEN:
                        self.seen.clear()
                    self.seen[key] = seen
                    return None
                self.seen.pop(key, None)
            else:
                self.shapes[key] = shape  # (the last used, last: the oldest is dropped first)
                if shape.busy:
                    return None
        for part in parts:  # (the verdict read: one wait, as the ordinary path's; its error if any)
            if part.check is not None:
                part.check.resolve()
        if shape is None:
            shape = self._add_shape(key, parts)
        tiers = [inp.tier for inp in shape.inputs]
        stream = torch.cuda.current_stream(self.tier.device) if self.tier.stream is not None else None
        with shape.stores_held, current_device(self.tier.device):
            # (a queued residency's room: under the stores' locks, which every other residency takes)
            for inp in shape.inputs:  # (batches collected inside a lock: see TableStore.orphans)
                if inp.queued:
                    inp.table._store.release_orphans()
            waits = [inp.tier.zero_copy.room_for_graph(inp.ids.numel()) if inp.queued else () for inp in shape.inputs]
            if shape.stale:  # (a tier grew to make room: the next lookup captures the shape again)
                return None
            for inp, part in zip(shape.inputs, parts):
                self._inputs(inp, part)  # (IndexError for a bad host id: nothing changed)
            for tier in tiers:
                tier.after_queued()  # (rows a residency on a tier's stream drew or read)
            for event in (e for w in waits for e in w):  # (releases queued on other streams)
                stream.wait_event(event)
            with shape.indexes_held:
                if shape.forward is None:
                    shape.forward = self._capture(lambda: self._forward_work(shape))
                    if shape.forward is None:
                        return None
                shape.batches, shape.out, shape.saved = shape.forward.replay(shape.pools_held)
                for inp, waited in zip(shape.inputs, waits):
                    if inp.queued:
                        if inp.write_back is not None:
                            inp.tier.zero_copy.write_back(inp.write_back, replayed=True)
                        inp.tier.zero_copy.graphed_admitted(inp.ids.numel(), waited)
                        inp.table._store.count_held()
                    else:
                        inp.tier.index.version += 1
            for inp in shape.inputs:
                inp.tier.before_next(stream)
                inp.table._prefetch.count_forward()
            self.replays += 1
            if updates is None:  # (no backward: the pins go at once)
                shape.release(lambda inp: True, stream)
                return shape.out[:shape.samples].clone()
            frozen = {id(inp) for inp, u in zip(shape.inputs, updates) if not u}
            if frozen:
                shape.release(lambda inp: id(inp) in frozen, stream)
            flight = shape.flight = _Flight(shape, updates)
            try:
                return _Replayed.apply(self, shape, flight, *[inp.table._grad_anchor for inp in shape.inputs])
            except BaseException:
                flight.land()
                raise

    def drop_shapes(self) -> None:
        """Drops every shape not in flight (a tier's tensors are being replaced: DeviceTier.grow,
        which waits for the device first); a shape in flight is stale (its backward runs its
        kernels one by one; it is never looked up again, its key naming the old generation) and
        dropped as the least recently used, later."""
        with self.shapes_lock:
            for key in [k for k, shape in self.shapes.items() if not shape.busy]:
                del self.shapes[key]

    def _inputs(self, inp: _Input, part) -> None:
        """A part's ids (host ones checked), offsets and out_at copied into its buffers, on the
        current stream. From the host through one of two pinned blocks, taken in turn: a block
        whose last copy has not run yet is left alone and a new one taken (no wait; the caller's
        tensors are free to change at once). Host offsets and out_at (each the same from batch
        to batch for fixed bags, and for one shape) only when they changed."""
        n, given = part.ids.numel(), len(part.offsets)
        if inp.out_at is not None and _changed(inp.out_at_given, part.out_at.numpy()):
            inp.out_at_given = part.out_at.numpy().copy()
            copy_to(inp.out_at, torch.from_numpy(np.append(inp.out_at_given, inp.scratch)))
        if part.check is not None:
            inp.ids[:n].copy_(part.ids)
            inp.ids[n:].fill_(inp.drop)
            if part.offsets.device.type != "cpu":
                inp.offsets[:given].copy_(part.offsets)
                inp.offsets[given:].copy_(part.offsets[given - 1:])
            else:  # (a collection's features checked on the device keep their boundaries on the host)
                o = part.offsets.numpy()
                copy_to(inp.offsets, torch.from_numpy(np.append(o, o[-1])))
            return
        on_gpu = inp.tier.device.type == "cuda"
        if on_gpu:
            inp.turn ^= 1
            block = inp.pinned[inp.turn]
            if block is None or not block[2].query():
                block = inp.pinned[inp.turn] = (torch.empty(inp.ids.shape, dtype=inp.ids.dtype, pin_memory=True),
                                                torch.empty(inp.offsets.shape, dtype=torch.int64, pin_memory=True),
                                                torch.cuda.Event())
            ids, offsets, copied = block
        else:
            ids, offsets = torch.empty_like(inp.ids), torch.empty_like(inp.offsets)
        checked_ids(part.ids, inp.tier.num_embeddings, pin=on_gpu, out=ids[:n])
        ids.numpy()[n:] = inp.drop
        inp.ids.copy_(ids, non_blocking=True)
        bounds = part.offsets.numpy()
        if _changed(inp.offsets_given, bounds):
            o = offsets.numpy()
            np.copyto(o[:given], bounds, casting="unsafe")
            o[given] = o[given - 1]
            inp.offsets.copy_(offsets, non_blocking=True)
            inp.offsets_given = bounds.copy()
        if on_gpu:
            copied.record()

    def _add_shape(self, key: tuple, parts: list) -> _Shape:
        with self.shapes_lock:
            while len(self.shapes) >= _MOST_SHAPES:
                oldest = next((k for k, s in self.shapes.items() if not s.busy), None)
                if oldest is None:
                    break
                if self.tier.device.type == "cuda":  # (its buffers and graphs' memory freed once no replay reads them)
                    torch.cuda.synchronize(self.tier.device)
                del self.shapes[oldest]
        dev = self.tier.device
        (rows, width), samples = key[1], key[2]
        if parts[0].out_at is None:  # (one table, its own [B, dim] block: the added bag's row after)
            rows, width = len(parts[0].offsets), parts[0].table.embedding_dim
        else:
            rows += 1
        inputs = []
        for part in parts:
            dtype = part.ids.dtype if part.check is not None else checked_dtype(part.table._store.tier0.num_embeddings)
            out_at = None if part.out_at is None else torch.empty(len(part.offsets), dtype=torch.int64, device=dev)
            inputs.append(_Input(part.table, torch.empty(padded(part.ids.numel()), dtype=dtype, device=dev),
                                 torch.empty(len(part.offsets) + 1, dtype=torch.int64, device=dev), out_at,
                                 SENTINEL32 if dtype == torch.int32 else SENTINEL64, part.mode, part.exclude_padding,
                                 (rows - 1) * width))
        shape = _Shape(inputs, rows, width, samples)
        with self.shapes_lock:
            self.shapes[key] = shape
        return shape

    def _forward_work(self, shape: _Shape) -> tuple:
        """The forward's device work over the shape's buffers: what the ordinary path queues for
        a batch of a whole-table tier 0 (DeviceTier.dedup and resident, kernels.forward), for
        each table, into one block."""
        block = torch.empty(shape.rows, shape.width, dtype=torch.float32, device=self.tier.device)
        batches, saved = [], []
        for inp in shape.inputs:
            deduped = device_dedup(inp.ids, inp.drop)
            if inp.queued:  # (pinned until the backward's release; its victims' write-back queued after each replay)
                slots = inp.tier.zero_copy.queued_work(deduped.unique, deduped.count, True, captured=True)
                inp.write_back = inp.tier.zero_copy.take_captured()
            else:
                slots = inp.tier.draw(deduped.unique, deduped.count)
            batch = _Batch(deduped.unique, deduped.inverse, deduped.count, deduped.groups, slots)
            saved.append(kernels.forward(inp.tier, inp.table.config, batch, inp.bags, block)[1])
            batches.append(batch)
        return batches, block, saved

    # -- backward -----------------------------------------------------------------------------
    def backward(self, shape: _Shape, flight: _Flight, grad: torch.Tensor) -> None:
        """Each updated table's optimizer applied to the rows of its batch, from the bags'
        gradient: by the backward's graph for these optimizer arguments (captured now if their
        time has come), else by the ordinary kernels over the captured forward's tensors."""
        if flight.done:
            raise RuntimeError("this batch's rows were released before backward (was backward called twice?)")
        try:
            inputs = shape.inputs
            steps = [inp.table.step + 1 for inp in inputs]
            native = [inp.table.config.optimizer.native_args(step) if update else None
                      for inp, step, update in zip(inputs, steps, flight.updates)]
            args = tuple(_arguments(a) if a is not None else None for a in native)
            if shape.grad is None:  # (the added bags' rows stay zero)
                shape.grad = torch.zeros(shape.out.shape, dtype=torch.float32, device=self.tier.device)
                for inp in inputs:
                    inp.scalars, inp.rate = pooling.step_scalars(self.tier.device), None
            shape.grad[:shape.samples].copy_(grad)
            for inp, a, step in zip(inputs, native, steps):  # (what changes every step, read by the graph)
                config = inp.table.config
                if a is not None and pooling.step_dependent(config.optimizer, config.stochastic_rounding):
                    pooling.fill_step_scalars(inp.scalars, a.adam_step_size, step)
                if a is not None and inp.rate != a.lr:  # (set_learning_rate: an LR schedule)
                    inp.scalars[2].fill_(a.lr)
                    inp.rate = a.lr

            def work():
                try:
                    for inp, batch, saved, step, update in zip(inputs, shape.batches, shape.saved, steps,
                                                               flight.updates):
                        if update:
                            kernels.backward_update(inp.tier, inp.table.config, batch, inp.bags, saved, shape.grad,
                                                    step, False, inp.scalars)
                finally:  # (the queued residencies' pins, whatever happened: the host's part after, graphed_released)
                    for inp, batch, update in zip(inputs, shape.batches, flight.updates):
                        if inp.queued and update:
                            with inp.tier.pool_lock:
                                inp.tier.index.unpin(batch.slots)

            with current_device(self.tier.device):
                stale = shape.stale  # (a tier grew since the forward: its kernels one by one, on the new tensors)
                graph = None if stale else shape.backwards.get(args)
                if graph is None and not stale and args == shape.last_args and len(shape.backwards) < _MOST_BACKWARDS:
                    graph = self._capture(work)
                    if graph is not None:
                        shape.backwards[args] = graph
                shape.last_args = args
                stream = torch.cuda.current_stream(self.tier.device) if self.tier.stream is not None else None
                try:
                    replayed = False
                    if graph is not None:
                        # (stale checked again under the locks a grow takes: one on another thread,
                        # a prefetch worker's, may have replaced the tensors since the check above)
                        with shape.pools_held:
                            if not shape.stale or graph.ran:
                                graph.replay(None)
                                replayed = True
                    if replayed:
                        self.replays += 1
                    else:
                        work()
                finally:
                    flight.released = True
                    for inp, update in zip(inputs, flight.updates):
                        if inp.queued and update:
                            inp.tier.zero_copy.graphed_released(inp.ids.numel(), stream)
                            inp.table._store.count_release()
                if stream is not None:
                    for inp in inputs:
                        inp.tier.computed_on(stream)
            for inp, step, update in zip(inputs, steps, flight.updates):
                if update:
                    inp.table.step = step
        finally:
            flight.land()


def _changed(last: np.ndarray | None, now: np.ndarray) -> bool:
    """Whether host values now differ from the last copied to the device (None: none yet). Not
    np.array_equal: its Python layers cost more than the compare, once a step."""
    return last is None or last.shape != now.shape or bool(np.count_nonzero(last != now))


def _arguments(a) -> tuple:
    """What a backward graph holds of the optimizer (a: its native_args): the arguments that stay
    from step to step (Adam's step size, the step and the learning rate are read from device
    tensors: see pooling.backward_update's scalars)."""
    return (a.kind, a.eps, a.one_minus_beta1, a.one_minus_beta2, a.accumulator_divisor, a.weight_decay,
            a.decoupled_weight_decay)


class _Replayed(torch.autograd.Function):
    """Autograd's view of a replayed forward: inputs the tables' grad anchors, output the pooled
    rows (a copy of the graph's); its backward runs the shape's backward."""

    @staticmethod
    def forward(ctx, graphs, shape, flight, *anchors):
        ctx.graphs, ctx.shape, ctx.flight = graphs, shape, flight
        ctx.on_drop = _C.DropGuard(flight.dropped)  # (the graph freed with no backward: see _Flight)
        return shape.out[:shape.samples].clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        ctx.graphs.backward(ctx.shape, ctx.flight, grad)
        return (None, None, None) + (None,) * len(ctx.shape.inputs)
