"""One lookup, start to end: ids -> a resident batch (dedup, tier 0 residency: prefetch.py and
tiers/) -> forward kernel -> autograd -> backward kernel fused with the optimizer -> the touched
rows marked dirty -> the batch released (its rows unpinned; write-back happens when they are
evicted or flushed).

A batch stays pinned in tier 0 from its forward until its backward has run, or until its graph
is freed (the ResidentBatch releases itself when collected), or at once for a forward that
builds no graph (no_grad, or a frozen table).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import kernels
from .kernels import Bags


class _Pool(torch.autograd.Function):
    """Autograd's view of a lookup: inputs (per-sample weights, the module's grad anchor), output
    the pooled bags. Its backward applies the fused optimizer to tier 0."""

    @staticmethod
    def forward(ctx, table, batch, bags: Bags, psw: Tensor | None, anchor: Tensor) -> Tensor:
        out, saved = kernels.forward(table._store.tier0, table.config, batch, bags)
        ctx.lookup = (table, batch, bags, saved)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        table, batch, bags, saved = ctx.lookup
        psw_grad = _backward(table, batch, bags, saved, grad_out, need_psw_grad=ctx.needs_input_grad[3])
        return None, None, None, psw_grad, None


def pooled(table, ids: Tensor, offsets: Tensor, psw: Tensor | None, mode: int, exclude_padding: bool) -> Tensor:
    """ids int64 [N]; offsets int64 [B + 1] bag boundaries; psw [N] or None; mode 0 sum, 1 mean,
    2 max. Returns [B, D]. table: the tiered module (its store, prefetcher, optimizer, step)."""
    batch = table._prefetch.take(ids, offsets)
    batch.await_rows()
    pad = -1 if table.padding_idx is None else table.padding_idx
    bags = Bags(offsets, psw, mode, pad if exclude_padding else -1, pad)
    training = torch.is_grad_enabled() and table._grad_anchor.requires_grad
    if not training:
        try:
            return kernels.forward(table._store.tier0, table.config, batch, bags)[0]
        finally:
            batch.release()
    try:
        return _Pool.apply(table, batch, bags, psw, table._grad_anchor)
    except BaseException:
        batch.release()
        raise


def _backward(table, batch, bags: Bags, saved, grad_out: Tensor, need_psw_grad: bool) -> Tensor | None:
    if batch.released:
        raise RuntimeError("this batch's rows were released before backward (was the forward run under "
                           "no_grad, or backward called twice?)")
    try:
        if table.optimizer is None:
            raise RuntimeError(f"{type(table).__name__} has no optimizer: pass optimizer=tieredemb.SGD(lr=...) "
                               "(or Adagrad, RowWiseAdagrad, Adam); its update is fused into backward")
        table.step += 1
        return kernels.backward_update(table._store.tier0, table.config, batch, bags, saved, grad_out, table.step,
                                       need_psw_grad)
    finally:
        batch.release()
