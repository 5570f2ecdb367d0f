"""CUDA graphs of the lookups of a table held whole in tier 0 on a GPU.

Such a table (a DeviceTier with a DirectIndex whose misses are drawn on the device) makes a batch
resident without waiting for the device, and the device work of its lookup depends only on the
batch's shape: ids [N], boundaries [B + 1], the bag mode, the padding row. The ordinary path
(lookup.py) is bound by the host there: on an H200, 2.3 ms of host time a step for 0.35 ms of
kernels (bench/RESULTS.md), spent in some 30 CUDA calls, 6 Triton launches and the Python between
them. Here the forward's device work (the dedup, the rows drawn, the pooling) and the backward's
(each row's gradient summed, the optimizer) are each captured once as a CUDA graph over buffers
kept for the shape, and replayed: the host checks the ids into pinned memory (as before), queues
two copies in, one graph, and one copy of the pooled rows out.

When: a shape is captured the second time a lookup of it comes (the first runs the ordinary path,
which compiles the kernels); at most _MOST_SHAPES shapes a table are kept, the least recently used
dropped. A shape is the number of bags and the number of ids rounded up (padded(): at most 1/8
more), so batches whose ids vary in number, as jagged features' do, share one: the ids are padded
with an id the dedup leaves out, after the bags. A backward is captured for its optimizer arguments the same way: those that
change every step (Adam's step size; the step, with stochastic rounding) never repeat, and such
backwards run the ordinary kernels over the captured forward's tensors. Ids and offsets given on
the device, which the module checked there, are taken too, after the ordinary path's one wait to
read the verdict. Everything else takes the ordinary path: per-sample weights, several tables in
one call, batches registered for prefetch, a cached tier 0, a caller capturing a graph of its own,
and a forward of a shape whose last batch still waits for its backward (gradient accumulation:
the shape's buffers are in use). The results are the ordinary path's, bit for bit: the same
kernels, in the same order over the same ids (the padding is no distinct id and in no bag).

On CPU tensors (a DeviceTier on CPU tensors: gpu/tier.on_cpu_tensors, the tests) a "graph" is its
function run again over the same buffers at each replay, so the tests exercise the buffers' flow
without a GPU; the capture itself runs only on one (tests/test_gpu.py).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .. import kernels
from ..kernels import Bags
from .checks import SENTINEL32, SENTINEL64, checked_dtype, checked_ids
from .dedup import dedup as device_dedup
from .index import DirectIndex

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
    """fn's device work captured as a CUDA graph on stream (a table's own: captures on two
    threads at once each have theirs), or on CPU tensors fn itself. replay(held) runs it again
    and returns its outputs (a graph's: the tensors its capture made, rewritten in place); held:
    the locks a graph's launch takes (fn takes its own, as the ordinary path does)."""

    def __init__(self, fn, device: torch.device, stream):
        self.fn, self.graph = fn, None
        if device.type == "cuda":
            # (not torch.cuda.graph, which first waits for the device and empties its caches: a
            # capture queues no work, so it needs no wait; "relaxed": other threads' CUDA calls, a
            # prefetch worker's or autograd's, may go on meanwhile, and a kernel Triton compiles for
            # this shape, not yet loaded, may be loaded during the capture)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.device(device), torch.cuda.stream(stream):
                graph.capture_begin(capture_error_mode="relaxed")
                try:
                    self.outputs = fn()
                finally:
                    graph.capture_end()
            self.graph = graph

    def replay(self, held):
        if self.graph is None:
            return self.fn()
        with held():
            self.graph.replay()
        return self.outputs


class _Shape:
    """One shape's buffers and graphs. ids [P], offsets [B + 2]: the inputs, on the device: the
    batch's N ids followed by P - N ids `drop` (gpu/checks.py's sentinel, which the dedup leaves
    out), after an empty bag added after the B given (as the module's device check places the ids
    after the last bag: gpu/pooling.py); samples: the bags of the output (the first B, or B - 1
    where that check added one); batch, out, saved: what the forward's last replay left (the
    backward reads them); grad: the backward's input (the added bags' rows zero)."""

    def __init__(self, key: tuple, ids: torch.Tensor, offsets: torch.Tensor, bags: Bags, samples: int, drop: int):
        self.key = key
        self.ids, self.offsets, self.bags = ids, offsets, bags
        self.samples, self.drop = samples, drop
        self.forward: _Graph | None = None
        self.batch = self.out = self.saved = None
        self.grad: torch.Tensor | None = None
        self.backwards: dict = {}  # optimizer arguments -> _Graph
        self.last_args = None
        self.flight: _Flight | None = None  # the trained forward whose backward has not run yet
        self.pinned: list = [None, None]  # host ids' staging: (ids, offsets, the event after their copy)
        self.turn = 0


class _Flight:
    """A trained forward replayed from a shape's graph, until its backward runs or its autograd
    graph is freed without one (then the shape's buffers are free again)."""

    __slots__ = ("shape", "done", "__weakref__")

    def __init__(self, shape: _Shape):
        self.shape, self.done = shape, False

    def land(self) -> None:
        self.done = True
        if self.shape.flight is self:
            self.shape.flight = None

    def __del__(self):
        self.land()


class StepGraphs:
    """A DeviceTier's captured lookups, by shape (see the module's docstring). captures, replays:
    graphs captured and replayed (forwards and backwards); failed: why capturing stopped for this
    tier (a capture that raised: its lookup and every later one take the ordinary path)."""

    def __init__(self, tier):
        self.tier = tier
        self.shapes: dict = {}  # key -> _Shape, the least recently used first
        self.seen: dict = {}  # key -> lookups of a shape not captured yet
        self.stream = torch.cuda.Stream(tier.device) if tier.device.type == "cuda" else None
        self.captures = self.replays = 0
        self.failed: str | None = None

    def stats(self) -> dict:
        return {"shapes": len(self.shapes), "captures": self.captures, "replays": self.replays,
                "failed": self.failed}

    def _capture(self, fn) -> _Graph | None:
        try:
            graph = _Graph(fn, self.tier.device, self.stream)
        except Exception as e:  # (nothing ran: a capture queues no work)
            self.failed = f"{type(e).__name__}: {e}"
            return None
        self.captures += 1
        return graph

    def pooled(self, part, shape: tuple, samples: int, expand) -> torch.Tensor | None:
        """A lookup of this tier's table (lookup.py's Part, of `samples` bags into a block of
        `shape`, expand: lookup.py's), its bags pooled through the table's graphs; or None where
        they do not apply (see the module's docstring): the caller runs the ordinary path."""
        table, tier = part.table, self.tier
        # host ids, or device ids and offsets the module checked on the device (a verdict to read)
        given = "host" if part.check is None and part.ids.device.type == "cpu" else "device" if (
            part.check is not None and part.ids.device == tier.device and part.offsets.device == tier.device) else None
        if (self.failed or given is None or expand or part.out_at is not None
                or part.psw is not None or part.ids.numel() == 0
                or not isinstance(tier.index, DirectIndex) or not tier.init_misses_here
                or not table._prefetch.idle()
                or (tier.device.type == "cuda" and torch.cuda.is_current_stream_capturing())):
            return None
        trained = torch.is_grad_enabled() and table._grad_anchor.requires_grad
        if trained and table.optimizer is None:
            return None  # (the ordinary path raises the error)
        pad = table.padding_idx
        dtype = part.ids.dtype if given == "device" else checked_dtype(tier.num_embeddings)
        key = (given, dtype, padded(part.ids.numel()), len(part.offsets), samples, part.mode, part.exclude_padding,
               -1 if pad is None else pad, tier.pool.rows.data_ptr())
        return self.forward(table, part, key, dtype, samples, trained)

    # -- forward ------------------------------------------------------------------------------
    def forward(self, table, part, key: tuple, dtype: torch.dtype, samples: int, trained: bool) -> torch.Tensor | None:
        """The part's first `samples` bags pooled by the shape's graph (captured now if its time
        has come), or None: the ordinary path is to run it."""
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
            if shape.flight is not None:
                return None
        tier = table._store.tier0
        if part.check is not None:  # (the verdict read: one wait, as the ordinary path's; its error if any)
            part.check.resolve()
        if shape is None:
            shape = self._add_shape(key, part, dtype, samples)
        with table._store.lock, kernels._current(tier.device):
            self._inputs(shape, part)  # (IndexError for a bad host id: nothing changed)
            tier.after_queued()  # (rows a residency on the tier's stream drew or read)
            if shape.forward is None:
                shape.forward = self._capture(lambda: self._forward_work(table, shape))
                if shape.forward is None:
                    return None
            with tier.index_lock:
                shape.batch, shape.out, shape.saved = shape.forward.replay(lambda: tier.pool_lock)
                tier.index.version += 1
            tier.before_next(torch.cuda.current_stream(tier.device) if tier.stream is not None else None)
            self.replays += 1
            table._prefetch.count_forward()
            if not trained:
                return shape.out[:samples].clone()
            shape.flight = _Flight(shape)
            return _Replayed.apply(self, shape, shape.flight, table, table._grad_anchor)

    def _inputs(self, shape: _Shape, part) -> None:
        """The part's ids (host ones checked) and offsets copied into the shape's buffers, on the
        current stream. From the host through one of the shape's two pinned blocks, taken in
        turn: a block whose last copy has not run yet is left alone and a new one taken (no
        wait; the caller's tensors are free to change at once)."""
        n, given = part.ids.numel(), len(part.offsets)
        if part.check is not None:
            shape.ids[:n].copy_(part.ids)
            shape.ids[n:].fill_(shape.drop)
            shape.offsets[:given].copy_(part.offsets)
            shape.offsets[given:].copy_(part.offsets[given - 1:])
            return
        on_gpu = self.tier.device.type == "cuda"
        if on_gpu:
            shape.turn ^= 1
            block = shape.pinned[shape.turn]
            if block is None or not block[2].query():
                block = shape.pinned[shape.turn] = (torch.empty(shape.ids.shape, dtype=shape.ids.dtype, pin_memory=True),
                                                    torch.empty(shape.offsets.shape, dtype=torch.int64, pin_memory=True),
                                                    torch.cuda.Event())
            ids, offsets, copied = block
        else:
            ids, offsets = torch.empty_like(shape.ids), torch.empty_like(shape.offsets)
        checked_ids(part.ids, self.tier.num_embeddings, pin=on_gpu, out=ids[:n])
        ids.numpy()[n:] = shape.drop
        o = offsets.numpy()
        np.copyto(o[:given], part.offsets.numpy(), casting="unsafe")
        o[given] = o[given - 1]
        shape.ids.copy_(ids, non_blocking=True)
        shape.offsets.copy_(offsets, non_blocking=True)
        if on_gpu:
            copied.record()

    def _add_shape(self, key: tuple, part, dtype: torch.dtype, samples: int) -> _Shape:
        while len(self.shapes) >= _MOST_SHAPES:
            oldest = next((k for k, s in self.shapes.items() if s.flight is None), None)
            if oldest is None:
                break
            del self.shapes[oldest]
        dev = self.tier.device
        pad = part.table.padding_idx
        pad = -1 if pad is None else pad
        p = padded(part.ids.numel())
        offsets = torch.empty(len(part.offsets) + 1, dtype=torch.int64, device=dev)
        shape = _Shape(key, torch.empty(p, dtype=dtype, device=dev), offsets,
                       Bags(offsets, None, part.mode, pad if part.exclude_padding else -1, pad), samples,
                       SENTINEL32 if dtype == torch.int32 else SENTINEL64)
        self.shapes[key] = shape
        return shape

    def _forward_work(self, table, shape: _Shape) -> tuple:
        """The forward's device work over the shape's buffers: what the ordinary path queues for
        a batch of a whole-table tier 0 (DeviceTier.dedup and resident, kernels.forward)."""
        tier = table._store.tier0
        deduped = device_dedup(shape.ids, shape.drop)
        slots = tier.draw(deduped.unique, deduped.count)
        batch = _Batch(deduped.unique, deduped.inverse, deduped.count, deduped.groups, slots)
        out = torch.empty(len(shape.offsets) - 1, table.embedding_dim, dtype=torch.float32, device=tier.device)
        out, saved = kernels.forward(tier, table.config, batch, shape.bags, out)
        return batch, out, saved

    # -- backward -----------------------------------------------------------------------------
    def backward(self, table, shape: _Shape, flight: _Flight, grad: torch.Tensor) -> None:
        """The optimizer applied to the rows of the shape's batch, from its bags' gradient: by
        the backward's graph for these optimizer arguments (captured now if their time has
        come), else by the ordinary kernels over the captured forward's tensors."""
        if flight.done:
            raise RuntimeError("this batch's rows were released before backward (was backward called twice?)")
        try:
            tier = table._store.tier0
            if table.optimizer is None:
                raise RuntimeError(f"{type(table).__name__} has no optimizer: pass optimizer=tieredemb.SGD(lr=...) "
                                   "(or Adagrad, RowWiseAdagrad, Adam); its update is fused into backward")
            step = table.step + 1
            args = _arguments(table.config, step)
            if shape.grad is None:  # (the added bags' rows stay zero)
                shape.grad = torch.zeros(shape.out.shape, dtype=torch.float32, device=tier.device)
            shape.grad[:shape.samples].copy_(grad)

            def work():
                kernels.backward_update(tier, table.config, shape.batch, shape.bags, shape.saved, shape.grad, step,
                                        False)

            with kernels._current(tier.device):
                graph = shape.backwards.get(args)
                if graph is None and args == shape.last_args and len(shape.backwards) < _MOST_BACKWARDS:
                    graph = shape.backwards[args] = self._capture(work)
                shape.last_args = args
                if graph is None:
                    work()
                else:
                    graph.replay(lambda: tier.pool_lock)
                    self.replays += 1
                if tier.stream is not None:
                    tier.computed_on(torch.cuda.current_stream(tier.device))
            table.step = step
        finally:
            flight.land()


def _arguments(config, step: int) -> tuple:
    """What a backward graph holds of the optimizer: its arguments at this step (and the step,
    which stochastic rounding draws from)."""
    a = config.optimizer.native_args(step)
    return (a.kind, a.lr, a.eps, a.beta1, a.beta2, a.adam_step_size, a.accumulator_divisor,
            step if config.stochastic_rounding else None)


class _Replayed(torch.autograd.Function):
    """Autograd's view of a replayed forward: input the table's grad anchor, output the pooled
    rows (a copy of the graph's); its backward runs the shape's backward."""

    @staticmethod
    def forward(ctx, graphs, shape, flight, table, anchor):
        ctx.graphs, ctx.shape, ctx.flight, ctx.table = graphs, shape, flight, table
        return shape.out[:shape.samples].clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        ctx.graphs.backward(ctx.table, ctx.shape, ctx.flight, grad)
        return None, None, None, None, None
