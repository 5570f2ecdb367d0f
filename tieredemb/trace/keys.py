"""Checks of in-memory key arrays and key compaction, shared by the reuse analysis (reuse.py) and
every simulator entry point (tieredemb.sim). Bad input raises TraceError naming the value.

Simulator state is indexed by key (arrays, not hash maps), so keys are mapped to 0..D-1 first
when the key space is much larger than the trace (np.unique's inverse: one sort, measured cheaper
than a numba hash map for the numba kernels that follow, which then run on dense arrays).
"""

from __future__ import annotations

import numpy as np

from .format import TraceError

# Dense state up to this many keys per lookup (a 10M-lookup trace may use keys < 80M directly).
DENSE_FACTOR = 8


def check_keys(keys) -> np.ndarray:
    """keys -> contiguous int64 [N]; negative keys are an error naming the first one."""
    keys = np.ascontiguousarray(keys)
    if keys.ndim != 1:
        raise TraceError(f"keys must be 1-D, got shape {keys.shape}")
    if keys.dtype.kind not in "iu":
        raise TraceError(f"keys must be integers, got dtype {keys.dtype}")
    keys = keys.astype(np.int64, copy=False)
    if keys.size and keys.min() < 0:
        i = int(np.argmax(keys < 0))
        raise TraceError(f"key {int(keys[i])} at lookup {i} is negative (keys must be >= 0)")
    return keys


def check_offsets(batch_offsets, n: int) -> np.ndarray:
    """batch_offsets -> int64 [B+1] from 0 to n, non-decreasing."""
    off = np.ascontiguousarray(batch_offsets, dtype=np.int64)
    if off.ndim != 1 or off.size < 1:
        raise TraceError(f"batch_offsets must be 1-D with at least one entry, got shape {off.shape}")
    if off[0] != 0 or off[-1] != n:
        raise TraceError(f"batch_offsets must start at 0 and end at {n} (the number of keys), "
                       f"got {int(off[0])} .. {int(off[-1])}")
    if off.size > 1 and np.any(np.diff(off) < 0):
        i = int(np.argmax(np.diff(off) < 0))
        raise TraceError(f"batch_offsets must not decrease: offset {int(off[i + 1])} at {i + 1} "
                       f"follows {int(off[i])}")
    return off


def compact(keys: np.ndarray) -> tuple[np.ndarray, int, np.ndarray | None]:
    """keys -> (dense keys in [0, D), D, the original key of each dense key or None when the
    keys were kept as they are, which they are when the largest is small)."""
    if keys.size == 0:
        return keys, 0, None
    top = int(keys.max()) + 1
    if top <= DENSE_FACTOR * keys.size + 1024:
        return keys, top, None
    uniq, inv = np.unique(keys, return_inverse=True)
    return inv.astype(np.int64, copy=False), int(uniq.size), uniq
