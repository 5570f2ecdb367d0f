"""Tier 0 on a GPU: the tier (tier.py), its index (index.py, plan_kernels.py), device inputs'
checks (checks.py), the batch's dedup (dedup.py), the lookup kernels (pooling.py), rows drawn on the device (rowinit.py), and zero-copy
moves to and from host rows mapped into the GPU (moves.py, hostmap.py); the kernels in Triton."""

from __future__ import annotations

import torch

from .. import locks

_TURNS = locks.Counted(reentrant=True)


def launch_turn():
    """Held around each kernel launch: launches take turns. Under Triton's interpreter (kernels
    on CPU tensors: the tests, bench/gpu_ops.py) the interpreter keeps one grid state per process,
    which two threads launching at once (a prefetch worker's plan beside training's kernels)
    corrupt; on a GPU a kernel's first launch compiles it, and Triton's compiler is not safe to run
    on two threads at once (triton-lang/triton#5933). Most of a launch's host time is Python,
    under the GIL anyway, so taking turns costs next to nothing once the kernels are compiled."""
    return _TURNS


def to_device(t: torch.Tensor, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """t on device (as dtype), queued on the current stream without waiting for it. A host tensor
    bound for a GPU goes through pinned memory (converted to dtype as it is copied there): from
    pageable memory CUDA stages the copy itself, and its documented behaviour lets it first wait
    for the stream to drain (cudaMemcpyAsync "may synchronize"), a wait torch's sync debug mode
    does not see, which would keep the host from running ahead of the device. torch's pinned
    allocator holds the block until the copy has run."""
    device = torch.device(device)
    if t.device.type == "cpu" and device.type == "cuda":
        if dtype not in (None, t.dtype) or not t.is_pinned():
            staged = torch.empty(t.shape, dtype=dtype or t.dtype, pin_memory=True)
            staged.copy_(t)
            t = staged
        return t.to(device, non_blocking=True)
    return t.to(device, dtype, non_blocking=True)
