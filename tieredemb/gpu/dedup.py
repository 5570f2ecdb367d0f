"""A batch's dedup on the device: one stable sort of its ids, a scan, and one Triton kernel that
writes the distinct ids, the inverse, and the grouping the backward needs (each distinct id's
occurrences, in occurrence order), so the backward sorts nothing again. Nothing waits for the
device: the count of distinct ids stays a device scalar."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..tiers.cache import Deduped
from . import launch_turn

_BLOCK = 1024


@triton.jit(do_not_specialize=["n", "drop"])  # (n = 1 as a constant would make n - 2 a Python int)
def _group_kernel(sorted_ptr, perm_ptr, steps_ptr, n, unique_ptr, inverse_ptr, row_ptr, start_ptr, count_ptr, drop,
                  HAS_DROP: tl.constexpr, BLOCK: tl.constexpr):
    """Sorted positions BLOCK * program 0 onwards (sorted[p] = ids[perm[p]], stable; steps[p - 1]:
    how many times the value changed up to p, so p's distinct id is number steps[p - 1]): row[p] =
    that number; inverse[perm[p]] = it; a first position writes unique[it] = its id and start[it]
    = p; past the U distinct ids, unique[q] = -1 and start[q + 1] = n; program 0 writes U.
    HAS_DROP: the id `drop`, the largest there can be, is no distinct id: when the last sorted id
    is it, U counts one less and unique[U] = -1, but its positions keep their group (start[U] is
    its first position, so group U - 1 ends where it begins; its occurrences name u = U)."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = p < n
    groups = tl.load(steps_ptr + tl.maximum(n - 2, 0), mask=n > 1, other=0) + 1
    num_unique = groups
    if HAS_DROP:
        num_unique -= (tl.load(sorted_ptr + n - 1) == drop).to(num_unique.dtype)
    u = tl.load(steps_ptr + p - 1, mask=live & (p > 0), other=0)
    value = tl.load(sorted_ptr + p, mask=live, other=0)
    first = live & ((p == 0) | (tl.load(sorted_ptr + p - 1, mask=live & (p > 0), other=0) != value))
    tl.store(unique_ptr + u, value, mask=first & (u < num_unique))
    tl.store(start_ptr + u, p, mask=first)
    tl.store(unique_ptr + p, tl.full([BLOCK], -1, tl.int64), mask=live & (p >= num_unique))
    tl.store(start_ptr + p + 1, tl.full([BLOCK], 0, tl.int64) + n, mask=live & (p + 1 >= groups))
    tl.store(row_ptr + p, u, mask=live)
    tl.store(inverse_ptr + tl.load(perm_ptr + p, mask=live, other=0), u, mask=live)
    if tl.program_id(0) == 0:
        tl.store(count_ptr, num_unique.to(tl.int64))


def dedup(ids: torch.Tensor, drop: int | None = None) -> Deduped:
    """ids int64 or int32 [N] on the device (N > 0) -> Deduped (its ids int64): unique [N] (the distinct ids ascending in
    the first U entries, -1 after), inverse [N] (ids[i] == unique[inverse[i]]), count (U, int64
    [1] on the device), groups (order [N]: the occurrences grouped by distinct id, in occurrence
    order; row [N]: the distinct id of each grouped position; start [N + 1]: distinct id u's
    occurrences are order[start[u]] .. order[start[u + 1] - 1], start[u] = N for u >= U). drop:
    an id larger than any other that is left out of the distinct ids (gpu/checks.py's SENTINEL
    for the ids after the last bag): its occurrences have inverse U, unique[U] = -1, and start[U]
    is its first sorted position (start[u] = N for u > U)."""
    n, dev = ids.numel(), ids.device
    sorted_ids, order = torch.sort(ids, stable=True)
    steps = torch.cumsum(sorted_ids[1:] != sorted_ids[:-1], 0)
    unique, inverse, row = (torch.empty(n, dtype=torch.int64, device=dev) for _ in range(3))
    start = torch.empty(n + 1, dtype=torch.int64, device=dev)
    count = torch.empty(1, dtype=torch.int64, device=dev)
    with launch_turn():
        _group_kernel[(triton.cdiv(n, _BLOCK),)](sorted_ids, order, steps if n > 1 else sorted_ids, n, unique,
                                                 inverse, row, start, count, 0 if drop is None else drop,
                                                 HAS_DROP=drop is not None, BLOCK=_BLOCK)
    return Deduped(unique, inverse, count, (order, row, start))
