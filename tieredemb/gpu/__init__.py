"""Tier 0 on a GPU: the tier (tier.py), its index (index.py, plan_kernels.py), the batch's dedup
(dedup.py), the lookup kernels (pooling.py), rows drawn on the device (rowinit.py), and zero-copy
moves to and from host rows mapped into the GPU (moves.py, hostmap.py); the kernels in Triton."""

from __future__ import annotations

import contextlib
import os
import threading

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_TURNS = threading.Lock()


def launch_turn():
    """Held around each kernel launch. Under Triton's interpreter (kernels on CPU tensors: the
    tests, bench/gpu_ops.py) launches take turns: the interpreter keeps one grid state per
    process, which two threads launching at once (a prefetch worker's plan beside training's
    kernels) corrupt. On a GPU nothing waits."""
    return _TURNS if _INTERPRETED else contextlib.nullcontext()
