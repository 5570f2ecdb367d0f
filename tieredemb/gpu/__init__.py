"""Tier 0 on a GPU: the tier (tier.py), its index (index.py, plan_kernels.py), device inputs'
checks (checks.py), the batch's dedup (dedup.py), the lookup kernels (pooling.py), rows drawn on the device (rowinit.py), and zero-copy
moves to and from host rows mapped into the GPU (moves.py, hostmap.py); the kernels in Triton."""

from __future__ import annotations

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
