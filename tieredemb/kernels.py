"""The math of a lookup on tier 0: bag pooling forward, and backward fused with the optimizer.

Three implementations of the same arithmetic, chosen by where tier 0 keeps its rows:
- native: the C++ kernels, on a tier 0 in host memory (HostPool: the CPU path);
- triton: gpu/pooling.py, on a device-resident tier 0 (DeviceRows: the GPU path);
- torch: torch ops (F.embedding_bag on the batch's unique rows, autograd for the gradient, then
  the optimizer in torch ops), the reference twin. The tests run each on the CPU (Triton under
  its interpreter) by replacing `implementation`, and check them against one another.

Inputs: tier0, the table's tier 0 (its pool, and mark_dirty); config, the table's TableConfig (its
row layout: float32 or 16-bit weights; stochastic rounding; seed); batch, a ResidentBatch (unique
ids, inverse, count, slots); bags, a Bags. forward returns what backward needs (`saved`). The
math is float32 whatever the weights' type: 16-bit weights are read exactly and written back
rounded (to the nearest, or stochastically).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from . import _C
from .gpu import current_device, to_device

_MODE_NAMES = ("sum", "mean", "max")


@dataclasses.dataclass(frozen=True)
class Bags:
    """How the batch's ids form bags. offsets: int64 [B + 1] bag boundaries, on tier 0's device; psw: per-sample
    weights [N] or None; mode: 0 sum, 1 mean, 2 max; skip_id: the row left out of every bag
    (EmbeddingBag's padding_idx) or -1; frozen_id: the row never updated (the padding row) or -1.
    out_at: int64 [B] on tier 0's device, where bag b's pooled row starts in the output block (and its
    gradient in the gradient's), in floats: several lookups write one [B, sum of dims] block side
    by side; None: the output is [B, dim] of its own."""

    offsets: torch.Tensor
    psw: torch.Tensor | None
    mode: int
    skip_id: int
    frozen_id: int
    out_at: torch.Tensor | None = None


def implementation(pool) -> str:
    """The kernels a pool's rows take: 'native' (HostPool) or 'triton' (DeviceRows)."""
    return pool.kernels


def unique_index(batch, row_id: int) -> int:
    """The position of row_id among the batch's distinct ids, -1 if absent (host code paths;
    numpy: torch's intra-op threads cost milliseconds per call on a busy 2-core machine)."""
    if row_id < 0:
        return -1
    hit = np.flatnonzero(batch.unique[:int(batch.count)].cpu().numpy() == row_id)
    return int(hit[0]) if len(hit) else -1


def _psw_cpu(psw):
    return None if psw is None else psw.detach().to("cpu", torch.float32).contiguous()


def forward(tier0, config, batch, bags: Bags, out: torch.Tensor | None = None):
    """Pools the batch's bags from tier 0 into out (float32, contiguous, on tier 0's device: [B,
    dim], or the block bags.out_at places the rows in; None: a new [B, dim]). Returns (out,
    saved)."""
    pool, layout = tier0.pool, config.layout
    dim = layout.dim
    how = implementation(pool)
    if out is None:
        out = torch.empty(len(bags.offsets) - 1, dim, dtype=torch.float32, device=pool.device)
    if how == "native":
        argmax = torch.empty((len(bags.offsets) - 1) * dim, dtype=torch.int64) if bags.mode == 2 else None
        _C.pool_forward(pool.rows, dim, batch.slots, batch.inverse, bags.offsets, _psw_cpu(bags.psw), bags.mode,
                        unique_index(batch, bags.skip_id), out, argmax, weights=layout.code, out_at=bags.out_at)
        return out, argmax
    if how == "triton":
        from .gpu import pooling

        dev = pool.device
        psw = None if bags.psw is None else to_device(bags.psw.detach(), dev, torch.float32).contiguous()
        with tier0.pool_lock, current_device(dev):
            return pooling.forward(pool.rows, dim, batch.slots, batch.unique, batch.inverse,
                                   bags.offsets, psw, bags.mode, bags.skip_id, layout.code,
                                   out, bags.out_at)
    count = int(batch.count)
    dev = pool.device
    leaf = layout.weights(pool.gather(batch.slots[:count])).contiguous().requires_grad_(True)
    psw = None
    if bags.psw is not None:
        psw = bags.psw.detach().to(dev, torch.float32).requires_grad_(bags.psw.requires_grad)
    skip_u = unique_index(batch, bags.skip_id)
    with torch.enable_grad():
        pooled = F.embedding_bag(batch.inverse.to(dev), leaf, bags.offsets.to(dev), mode=_MODE_NAMES[bags.mode],
                                 per_sample_weights=psw, include_last_offset=True,
                                 padding_idx=skip_u if skip_u >= 0 else None)
    if bags.out_at is None:
        out.copy_(pooled.detach())
    else:
        out.view(-1)[row_floats(bags, dim, dev)] = pooled.detach()
    return out, (pooled, leaf, psw)


def row_floats(bags: Bags, dim: int, device) -> torch.Tensor:
    """[B, dim]: the positions of each bag's output row in the flat block (bags.out_at's)."""
    return bags.out_at.to(device)[:, None] + torch.arange(dim, device=device)


def backward_update(tier0, config, batch, bags: Bags, saved, grad_out: torch.Tensor, step: int,
                    need_psw_grad: bool, scalars: tuple | None = None) -> torch.Tensor | None:
    """Sums each unique row's gradient and applies the table's optimizer to its row in tier 0,
    except the padding row, and marks the rows it updated dirty. grad_out: [B, dim], or the block
    bags.out_at places the rows in. Returns the gradient of the per-sample weights when asked.
    scalars: on the triton path, the step's scalars as device tensors (gpu/pooling.py's)."""
    pool, layout, optimizer = tier0.pool, config.layout, config.optimizer
    dim = layout.dim
    how = implementation(pool)
    if how == "triton":
        from .gpu import pooling

        dev = pool.device
        psw = None if bags.psw is None else to_device(bags.psw.detach(), dev, torch.float32).contiguous()
        with tier0.pool_lock, current_device(dev):
            psw_grad = pooling.backward_update(pool.rows, tier0.dirty, dim, batch.slots, batch.unique, batch.count,
                                               batch.inverse, bags.offsets, psw, bags.mode,
                                               bags.skip_id, bags.frozen_id, grad_out, saved, optimizer, step,
                                               need_psw_grad, layout.code, config.stochastic_rounding, config.seed,
                                               bags.out_at, batch.groups, scalars)
        return None if psw_grad is None else psw_grad.to(bags.psw.device, bags.psw.dtype)
    skip_u, frozen_u = unique_index(batch, bags.skip_id), unique_index(batch, bags.frozen_id)
    count = int(batch.count)
    left_alone = [u for u in (frozen_u, skip_u) if u >= 0]
    keep = np.delete(np.arange(count), left_alone)  # the unique rows the update touches
    updated = batch.slots[:count].cpu() if not left_alone else torch.from_numpy(np.delete(
        batch.slots[:count].cpu().numpy(), left_alone))
    if how == "native":
        psw_grad = torch.empty(len(batch.inverse), dtype=torch.float32) if need_psw_grad else None
        args = optimizer.native_args(step)
        args.stochastic_rounding, args.sr_seed, args.step = config.stochastic_rounding, config.seed, step
        grad_out = grad_out.detach().to("cpu", torch.float32).contiguous()
        tier0.update_in_place(updated, lambda: _C.pool_backward_update(
            pool.rows, dim, batch.slots, batch.inverse, bags.offsets, _psw_cpu(bags.psw), bags.mode, skip_u, grad_out,
            saved, args, frozen_u, psw_grad, weights=layout.code,
            unique_ids=batch.unique if config.stochastic_rounding else None, out_at=bags.out_at))
        if psw_grad is not None and bags.psw is not None:
            psw_grad = psw_grad.to(bags.psw.device, bags.psw.dtype)
        return psw_grad
    if config.stochastic_rounding and layout.code:
        raise NotImplementedError("the torch-ops twin rounds 16-bit weights to the nearest only")
    out, leaf, psw = saved
    inputs = [leaf] + ([psw] if need_psw_grad and psw is not None else [])
    grad_out = grad_out.to(out.device, out.dtype)
    if bags.out_at is not None:
        grad_out = grad_out.reshape(-1)[row_floats(bags, dim, out.device)]
    grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
    grad = grads[0] if grads[0] is not None else torch.zeros_like(leaf)
    stored = pool.gather(updated)
    rows = torch.cat([layout.weights(stored), layout.state(stored)], 1)  # float32 weights ‖ state
    optimizer.apply_torch(rows, grad[torch.from_numpy(keep).to(grad.device)], dim, step)
    layout.set_weights(stored, rows[:, :dim])
    layout.state(stored)[:] = rows[:, dim:]
    tier0.update_in_place(updated, lambda: pool.scatter(updated, stored))
    if need_psw_grad and psw is not None:
        g = grads[1] if grads[1] is not None else torch.zeros_like(psw)
        return g.to(bags.psw.device, bags.psw.dtype)
    return None
