"""Tier 0 on a GPU: the tier (tier.py), its index (index.py, plan_kernels.py; direct_index.py for
a tier holding every row), device inputs' checks (checks.py), the batch's dedup (dedup.py), the
lookup kernels (pooling.py), rows drawn on the device (rowinit.py), residencies queued with no wait
for the device (queued.py): zero-copy moves to and from host rows mapped into the GPU (zerocopy.py,
moves.py, hostmap.py), and a log store's reads and writes queued on the stream (storeio.py); the
kernels in Triton."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import numpy as np
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


@dataclasses.dataclass(frozen=True)
class PerMultiprocessor:
    """A kernel's programs capped at this many per multiprocessor of the GPU it runs on (one
    multiprocessor on CPU tensors, where Triton's interpreter runs the programs one by one)."""

    count: int

    def __post_init__(self):
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"programs per multiprocessor must be a positive int, got {self.count!r}")


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device (1 for any other)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def programs(items: int, cap, device: torch.device) -> int:
    """A grid for a kernel whose programs take its items a grid's stride apart, launched on
    device: one program per item (cap None), at most cap of them (a positive int), or at most so
    many per multiprocessor (a PerMultiprocessor): pooling.UPDATE_PROGRAMS,
    plan_kernels.ASSIGN_PROGRAMS and DRAW_PROGRAMS, rowinit.INIT_PROGRAMS, moves.MOVE_PROGRAMS.
    ValueError naming a cap that is none of these."""
    if cap is None:
        return items
    if isinstance(cap, PerMultiprocessor):
        return min(items, cap.count * multiprocessors(device))
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ValueError(f"a kernel's programs must be None (one per item), a positive int or a PerMultiprocessor, "
                         f"got {cap!r}")
    return min(items, cap)


# Host-to-device copies of at most this many bytes from pageable memory are asynchronous (CUDA
# Programming Guide, "Asynchronous Concurrent Execution"); larger ones may wait for the stream.
_INLINE_COPY_BYTES = 64 << 10


def current_device(device: torch.device):
    """The device made current (Triton launches on the current device's current stream: a table on
    cuda:1 from a thread whose current device is cuda:0)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def to_device(t: torch.Tensor, device, dtype: torch.dtype | None = None, *, owned: bool = False) -> torch.Tensor:
    """t on device (as dtype), queued on the current stream without waiting for it. A host tensor
    of more than 64 KiB bound for a GPU goes through pinned memory (converted to dtype as it is
    copied there, by numpy where it can: torch's intra-op threads cost more on the host): from
    pageable memory CUDA stages such a copy itself, and its documented behaviour lets it first wait
    for the stream to drain (cudaMemcpyAsync "may synchronize"), a wait torch's sync debug mode
    does not see, which would keep the host from running ahead of the device. torch's pinned
    allocator holds the block until the copy has run. A caller's pinned tensor is staged too, of
    any size: the device reads a pinned source when the copy runs, later, and a caller who refilled
    it after forward returned would send ids the host never checked. owned: t is the package's own
    pinned block, left as it is until the copy has run (copied from directly)."""
    device = torch.device(device)
    if t.device.type != "cpu" or device.type != "cuda":
        return t.to(device, dtype, non_blocking=True)
    return _copy_source(t, dtype or t.dtype, owned).to(device, dtype, non_blocking=True)


def copy_to(dst: torch.Tensor, t: torch.Tensor, *, owned: bool = False) -> None:
    """t copied into dst (converted to its dtype), queued on the current stream without waiting
    for it: a host tensor bound for a GPU goes through pinned memory as to_device's does."""
    if t.device.type == "cpu" and dst.device.type == "cuda":
        t = _copy_source(t, dst.dtype, owned)
    dst.copy_(t, non_blocking=True)


def _copy_source(t: torch.Tensor, dtype: torch.dtype, owned: bool) -> torch.Tensor:
    """What a host tensor t bound for a GPU as dtype is copied from (see to_device): t itself if
    it is the package's own pinned block, or small and pageable; else a pinned copy as dtype."""
    pinned = t.is_pinned()
    if owned and pinned and dtype == t.dtype and t.is_contiguous():
        return t
    if not pinned and t.numel() * max(t.element_size(), dtype.itemsize) <= _INLINE_COPY_BYTES:
        return t  # (the driver copies a small pageable source before it returns)
    return staged(t, dtype, pin=True)


def staged(t: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A contiguous host copy of t (a host tensor) as dtype, pinned if pin; by numpy where it can
    (it has no bfloat16). Not part of the autograd graph."""
    out = torch.empty(t.shape, dtype=dtype, pin_memory=pin)
    if torch.bfloat16 in (dtype, t.dtype):
        out.copy_(t.detach())
    else:
        np.copyto(out.numpy(), t.detach().numpy(), casting="unsafe")
    return out
