"""Tier 0 on a GPU: the device index (index.py, plan_kernels.py), the tier (tier.py), the lookup
kernels (pooling.py) and rows drawn on the device (rowinit.py), in Triton."""

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
