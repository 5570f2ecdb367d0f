"""One lookup, start to end: ids -> a resident batch (dedup, tier 0 residency: prefetch.py and
tiers/) -> forward kernel -> autograd -> backward kernel fused with the optimizer -> the touched
rows marked dirty -> the batch released (its rows unpinned; write-back happens when they are
evicted or flushed).

A batch stays pinned in tier 0 from its forward until its backward has run, or until its graph
is freed (the ResidentBatch's DropGuard releases it), or at once for a forward that
builds no graph (no_grad, or a frozen table).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import kernels
from .gpu import to_device
from .kernels import Bags


class Part(NamedTuple):
    """One table's share of a lookup: the tiered module, its ids int64 [N], bag boundaries int64
    [B + 1], per-sample weights [N] or None, pooling mode (0 sum, 1 mean, 2 max), whether the
    padding row is left out of the bags, and out_at: where each bag's row starts in the output
    block, in floats (int64 [B] on the host; None: the block is this part's own [B, dim]);
    check: the verdict on device inputs (gpu/checks.py) or None; source: the caller's tensors
    (a prefetched batch's forward recognizes them)."""

    table: object
    ids: Tensor
    offsets: Tensor
    psw: Tensor | None
    mode: int
    exclude_padding: bool
    out_at: Tensor | None = None
    segments: tuple | None = None  # (starts [S + 1], row_ends [S]): runs of disjoint id ranges (CacheTier.dedup)
    check: object = None
    source: tuple = ()


class Expand(NamedTuple):
    """Columns [col, col + dim) of every sample b's row take distinct bag inverse[b] of `bags`,
    pooled once at the block's float side + dim * inverse[b] (after the samples' rows). inverse:
    on the block's device."""

    col: int
    dim: int
    side: int
    bags: int
    inverse: Tensor


class _Pool(torch.autograd.Function):
    """Autograd's view of a lookup over one or more tables: inputs (each part's per-sample weights
    and its table's grad anchor), output the pooled bags. Its backward applies each trained
    table's fused optimizer to its tier 0."""

    @staticmethod
    def forward(ctx, resident: list, shape: tuple, samples: int, expand: list, *inputs) -> Tensor:
        block, ctx.saved = _forward(resident, shape, graph=True)
        ctx.resident, ctx.shape, ctx.expand = resident, shape, expand
        ctx.versions = _versions(resident)
        return _result(block, samples, expand)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        grads = []
        try:
            _check_before_updates(ctx.resident, ctx.saved, ctx.versions)
            grad = _grad_block(grad, ctx.shape, ctx.expand)
            for (part, batch, bags), saved, needs in zip(ctx.resident, ctx.saved, ctx.needs_input_grad[4::2]):
                if isinstance(saved, _Frozen):
                    grads += [saved.psw_grad(part, bags, grad) if needs else None, None]
                else:
                    grads += [_backward(part.table, batch, bags, saved, grad, need_psw_grad=needs), None]
        finally:  # (a part that raised leaves the later ones unpinned too)
            for _, batch, _ in ctx.resident:
                batch.release()
        return None, None, None, None, *grads


class _Frozen(NamedTuple):
    """A part's saved state when its table takes no update (its batch released at once): where
    its per-sample weights want their gradient, the rows of its distinct ids (float32 [U, D], a
    row its bags leave out zeroed) and each id's position among them; else None, None."""

    rows: Tensor | None
    inverse: Tensor | None

    def psw_grad(self, part: Part, bags, grad: Tensor) -> Tensor:
        """d(out[b])/d(psw[i]) = grad[b] . row of id i, for each id i of bag b (sum pooling: the one
        that takes weights)."""
        dim, dev = self.rows.shape[1], self.rows.device
        lengths = (bags.offsets[1:] - bags.offsets[:-1]).to(dev)
        bag = torch.repeat_interleave(torch.arange(len(lengths), device=dev), lengths)
        rows = grad.reshape(-1)[kernels.row_floats(bags, dim, dev)] if bags.out_at is not None else grad.to(dev)
        return (rows[bag] * self.rows[self.inverse]).sum(1).to(part.psw.device, part.psw.dtype)

    @staticmethod
    def of(part: Part, batch, bags) -> "_Frozen":
        if part.psw is None or not part.psw.requires_grad:
            return _FROZEN
        tier0, layout = part.table._store.tier0, part.table.config.layout
        count = int(batch.count)
        rows = layout.weights(tier0.pool.gather(batch.slots[:count])).to(torch.float32)
        skip = kernels.unique_index(batch, bags.skip_id)
        if skip >= 0:
            rows[skip] = 0.0
        return _Frozen(rows, batch.inverse.to(rows.device))


_FROZEN = _Frozen(None, None)  # a frozen part whose weights want no gradient


def _versions(resident: list) -> list:
    """The version of each tensor backward reads again that may be the caller's own (its bag
    boundaries and per-sample weights, when no copy was made of them)."""
    return [(bags.offsets._version, None if bags.psw is None else bags.psw._version) for _, _, bags in resident]


def _check_before_updates(resident: list, saved: list, versions: list) -> None:
    """Raises before any part's update: if a trained part's table has no optimizer, or a tensor
    the forward used was changed in place since (as torch's autograd does for the tensors it
    saves: backward would pool other bags or weights)."""
    for (part, batch, _), s in zip(resident, saved):
        if not isinstance(s, _Frozen) and part.table.optimizer is None:
            raise RuntimeError(f"{part.table.described()} has no optimizer: pass "
                               "optimizer=tieredemb.SGD(lr=...) (or Adagrad, RowWiseAdagrad, Adam); its update is "
                               "fused into backward")
    for (part, _, bags), (offsets, psw) in zip(resident, versions):
        for name, t, seen in (("offsets", bags.offsets, offsets), ("per_sample_weights", bags.psw, psw)):
            if t is not None and t._version != seen:
                raise RuntimeError(f"{part.table.described()}: the {name} its forward used were modified in "
                                   f"place before backward (version {seen}, now {t._version}); backward would "
                                   f"update the rows of other bags: change them after backward, or pass a copy")


def pooled(table, ids: Tensor, offsets: Tensor, psw: Tensor | None, mode: int, exclude_padding: bool,
           check=None, source: tuple = ()) -> Tensor:
    """ids int [N]; offsets int64 [B + 1] bag boundaries; psw [N] or None; mode 0 sum, 1 mean,
    2 max. Returns [B, D]. table: the tiered module (its store, prefetcher, optimizer, step).
    check, source: see Part (a check's added empty bag is pooled and left out of the result)."""
    bags = len(offsets) - 1
    samples = bags - 1 if check is not None and check.extra_bag else bags
    return pooled_block([Part(table, ids, offsets, psw, mode, exclude_padding, check=check, source=source)],
                        (bags, table.embedding_dim), samples)


def pooled_block(parts: list, shape: tuple, samples: int, expand: tuple = ()) -> Tensor:
    """Every part's bags pooled into one float32 block of `shape` on the tables' device (each
    part's rows at its out_at), one autograd node for them all; its backward reads each bag's
    gradient where its row went. Returns the block's first `samples` rows, each Expand's columns
    filled from its distinct bags (which the rows after them hold). Each part's table is a
    different module (each has one batch in flight here)."""
    for part in parts:
        if part.table._closed:
            raise RuntimeError(f"{part.table.described()} is closed (close() let its tiers go): it takes no more "
                               "lookups")
    graphs = parts[0].table._store.tier0.graphs
    if graphs is not None:  # (replayed CUDA graphs: gpu/graphed.py; None where they do not apply)
        out = graphs.pooled(parts, shape, samples, expand)
        if out is not None:
            return out
    taken = []
    try:
        for part in parts:
            batch = part.table._prefetch.take(part.ids, part.offsets, part.segments, part.check, part.source)
            taken.append(batch)
            batch.await_rows()
    except BaseException:
        for batch in taken:
            batch.release()
        raise
    resident = []
    for part, batch in zip(parts, taken):
        pad = -1 if part.table.padding_idx is None else part.table.padding_idx
        dev = part.table._store.tier0.pool.device  # (offsets and out_at moved there once, for forward and backward)
        out_at = None if part.out_at is None else to_device(part.out_at, dev)
        resident.append((part, batch, Bags(to_device(part.offsets, dev), part.psw, part.mode,
                                           pad if part.exclude_padding else -1, pad, out_at)))
    try:
        if torch.is_grad_enabled() and any(p.table._grad_anchor.requires_grad
                                           or (p.psw is not None and p.psw.requires_grad) for p in parts):
            inputs = [t for p in parts for t in (p.psw, p.table._grad_anchor)]
            return _Pool.apply(resident, shape, samples, list(expand), *inputs)
    except BaseException:
        for batch in taken:
            batch.release()
        raise
    try:  # no graph: nothing to update
        return _result(_forward(resident, shape, graph=False)[0], samples, expand)
    finally:
        for batch in taken:
            batch.release()


def _forward(resident: list, shape: tuple, graph: bool) -> tuple[Tensor, list]:
    """The block with every part's bags pooled in, and what each part's backward needs (a _Frozen
    for a table that takes no update: its batch is released at once). graph: whether a backward
    will run (a frozen part's weights may then want their gradient)."""
    block = torch.empty(shape, dtype=torch.float32, device=resident[0][0].table._store.tier0.pool.device)
    saved = []
    for part, batch, bags in resident:
        s = kernels.forward(part.table._store.tier0, part.table.config, batch, bags, block)[1]
        trained = part.table._grad_anchor.requires_grad
        saved.append(s if trained else _Frozen.of(part, batch, bags) if graph else _FROZEN)
    for (_, batch, _), s in zip(resident, saved):
        if isinstance(s, _Frozen):
            batch.release()
    return block, saved


def _result(block: Tensor, samples: int, expand: list) -> Tensor:
    """The samples' rows of the block, each Expand's columns filled from its distinct bags."""
    if samples == block.shape[0] and not expand:
        return block
    out = block[:samples].clone()
    flat = block.view(-1)
    for e in expand:
        distinct = flat[e.side:e.side + e.bags * e.dim].view(e.bags, e.dim)
        out[:, e.col:e.col + e.dim] = distinct.index_select(0, e.inverse)
    return out


def _grad_block(grad: Tensor, shape: tuple, expand: list) -> Tensor:
    """The gradient in the block's layout: the samples' rows, and where each Expand's distinct
    bags were pooled, their gradient (the sum over their samples)."""
    grad = grad.to(torch.float32).contiguous()
    if tuple(grad.shape) == tuple(shape) and not expand:
        return grad
    block = torch.zeros(shape, dtype=torch.float32, device=grad.device)
    block[:grad.shape[0]] = grad
    flat = block.view(-1)
    for e in expand:
        sums = torch.zeros(e.bags, e.dim, dtype=torch.float32, device=grad.device)
        sums.index_add_(0, e.inverse, grad[:, e.col:e.col + e.dim])
        flat[e.side:e.side + e.bags * e.dim] = sums.view(-1)
    return block


def _backward(table, batch, bags: Bags, saved, grad_out: Tensor, need_psw_grad: bool) -> Tensor | None:
    """One part's update (its batch is released by the caller, _Pool.backward, whatever happens)."""
    if batch.released:
        raise RuntimeError("this batch's rows were released before backward (was the forward run under "
                           "no_grad, or backward called twice?)")
    if table._closed:
        raise RuntimeError(f"{table.described()} was closed before this batch's backward: its update would be lost")
    step = table.step + 1  # (counted once the update is made: one that raises takes no step)
    psw_grad = kernels.backward_update(table._store.tier0, table.config, batch, bags, saved, grad_out, step,
                                       need_psw_grad)
    table.step = step
    return psw_grad
