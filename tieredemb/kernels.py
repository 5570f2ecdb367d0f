"""The math of a lookup on tier 0: bag pooling forward, and backward fused with the optimizer.

Two implementations of the same arithmetic:
- native: the C++ kernels, on a tier 0 in host memory (the CPU path; the fast one);
- torch: torch ops (F.embedding_bag on the batch's unique rows, autograd for the gradient, then
  the optimizer in torch ops), for a tier 0 on a GPU. The tests run it on the CPU too (by
  replacing use_native) and check it against the native kernels.

Inputs: pool, tier 0's rows (tiers/pools.py); batch, a ResidentBatch (unique ids, inverse,
slots); bags, a Bags (offsets and how to pool). forward returns what backward needs (`saved`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from . import _C

_MODE_NAMES = ("sum", "mean", "max")


@dataclasses.dataclass(frozen=True)
class Bags:
    """How the batch's ids form bags. offsets: int64 [B + 1] bag boundaries; psw: per-sample
    weights [N] or None; mode: 0 sum, 1 mean, 2 max; skip_u: the unique index left out of every
    bag (EmbeddingBag's padding_idx) or -1; frozen_u: the unique index never updated (the
    padding row) or -1."""

    offsets: torch.Tensor
    psw: torch.Tensor | None
    mode: int
    skip_u: int
    frozen_u: int


def use_native(pool) -> bool:
    return pool.device.type == "cpu"


def _psw_cpu(psw):
    return None if psw is None else psw.detach().to("cpu", torch.float32).contiguous()


def forward(pool, dim: int, batch, bags: Bags):
    """Pools the batch's bags from tier 0. Returns (float32 [B, dim] on the pool's device, saved)."""
    num_bags = len(bags.offsets) - 1
    if use_native(pool):
        out = torch.empty(num_bags, dim, dtype=torch.float32)
        argmax = torch.empty(num_bags * dim, dtype=torch.int64) if bags.mode == 2 else None
        _C.pool_forward(pool.rows, dim, batch.slots, batch.inverse, bags.offsets, _psw_cpu(bags.psw), bags.mode,
                        bags.skip_u, out, argmax)
        return out, argmax
    dev = pool.device
    leaf = pool.gather(batch.slots)[:, :dim].contiguous().requires_grad_(True)
    psw = None
    if bags.psw is not None:
        psw = bags.psw.detach().to(dev, torch.float32).requires_grad_(bags.psw.requires_grad)
    with torch.enable_grad():
        out = F.embedding_bag(batch.inverse.to(dev), leaf, bags.offsets.to(dev), mode=_MODE_NAMES[bags.mode],
                              per_sample_weights=psw, include_last_offset=True,
                              padding_idx=bags.skip_u if bags.skip_u >= 0 else None)
    return out.detach(), (out, leaf, psw)


def backward_update(pool, dim: int, batch, bags: Bags, saved, grad_out: torch.Tensor, optimizer, step: int,
                    need_psw_grad: bool) -> torch.Tensor | None:
    """Sums each unique row's gradient and applies the optimizer to its row in tier 0, except the
    padding row. Returns the gradient of the per-sample weights when asked."""
    if use_native(pool):
        psw_grad = torch.empty(len(batch.inverse), dtype=torch.float32) if need_psw_grad else None
        _C.pool_backward_update(pool.rows, dim, batch.slots, batch.inverse, bags.offsets, _psw_cpu(bags.psw),
                                bags.mode, bags.skip_u, grad_out.detach().to("cpu", torch.float32).contiguous(),
                                saved, optimizer.native_args(step), bags.frozen_u, psw_grad)
        if psw_grad is not None and bags.psw is not None:
            psw_grad = psw_grad.to(bags.psw.device, bags.psw.dtype)
        return psw_grad
    out, leaf, psw = saved
    inputs = [leaf] + ([psw] if need_psw_grad and psw is not None else [])
    grads = torch.autograd.grad(out, inputs, grad_out.to(out.device, out.dtype), allow_unused=True)
    grad = grads[0] if grads[0] is not None else torch.zeros_like(leaf)
    keep = torch.ones(len(batch.slots), dtype=torch.bool)
    for u in (bags.frozen_u, bags.skip_u):
        if u >= 0:
            keep[u] = False
    sel = keep.nonzero().squeeze(1)
    slots = batch.slots[sel]
    rows = pool.gather(slots)
    optimizer.apply_torch(rows, grad[sel.to(grad.device)], dim, step)
    pool.scatter(slots, rows)
    if need_psw_grad and psw is not None:
        g = grads[1] if grads[1] is not None else torch.zeros_like(psw)
        return g.to(bags.psw.device, bags.psw.dtype)
    return None
