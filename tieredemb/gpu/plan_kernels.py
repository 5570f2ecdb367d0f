"""The device index's hot steps as Triton kernels (gpu/index.py), so that a plan is a handful of
launches rather than a hundred torch ops: on a GPU each op costs the host a launch, and the host,
not the device, bounds a step of small ops.

- find: each id's set and slot (a match among its set's ways, else in the overflow directory);
  an overflow row nobody pins counts as a miss (it leaves and comes back).
- assign: the misses of each set, in batch order, take the set's victim candidates, best first
  (empty slots, then rows no window batch uses in the policy's order, then window rows, farthest
  next use first; never pinned rows or rows of the batch).
- draw (DirectIndex, a tier holding the whole table whose rows were never stored below): a
  batch's whole residency, one launch: the rows it does not hold yet are drawn in place (as
  rowinit draws them), marked held, and counted.

Each has a torch-ops twin in index.py (SetIndex's "torch" kernels) that computes the same
integers; the tests run both on random batches and compare every plan. Only integer arithmetic:
the results are the same bits on any device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launch_turn
from .rowinit import init_row, kernel_args

HASH = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: Fibonacci hashing
NEVER = 1 << 62  # a victim key larger than any stamp: not a candidate
USES_CAP = (1 << 28) - 1  # LFU's key: uses (at most this) above the stamp's 32 bits
WINDOW_KEY = (1 << 61) + (1 << 20)  # a window row's key: this less its first window batch
# the same, as the kernels read them
_HASH_K: tl.constexpr = tl.constexpr(HASH)
_NEVER_K: tl.constexpr = tl.constexpr(NEVER)
_USES_CAP_K: tl.constexpr = tl.constexpr(USES_CAP)
_WINDOW_KEY_K: tl.constexpr = tl.constexpr(WINDOW_KEY)
_LAST_K: tl.constexpr = tl.constexpr((1 << 63) - 1)  # past every key (lanes beyond the set's ways)


@triton.jit
def _floor_mod(x, m):
    """x mod m in [0, m) for m > 0 (torch.remainder's sign rule, not C's)."""
    r = x % m
    return tl.where(r < 0, r + m, r)


@triton.jit
def _set_of(ids, sets, part_ends_ptr, part_sets_ptr, part_base_ptr, n_parts, PARTS: tl.constexpr):
    """Each id's set: a hash of the id over the sets (of its part: the parts hold id ranges, each
    with sets of its own)."""
    h = (ids * _HASH_K) >> 29
    if PARTS:
        part = tl.zeros_like(ids)
        for k in range(n_parts - 1):  # the parts whose range ends at or before the id
            part += (tl.load(part_ends_ptr + k) <= ids).to(tl.int64)
        return tl.load(part_base_ptr + part) + _floor_mod(h, tl.load(part_sets_ptr + part))
    else:
        return _floor_mod(h, sets)


@triton.jit
def _lower_bound(sorted_ptr, n, x, steps):
    """For each x, the first position of sorted[:n] holding a value >= x, clamped to n - 1 (as
    torch.searchsorted, then clamp); steps >= log2(n + 1)."""
    lo = tl.zeros_like(x)
    hi = tl.zeros_like(x) + n
    for _ in range(steps):
        mid = (lo + hi) // 2
        less = tl.load(sorted_ptr + tl.minimum(mid, n - 1)) < x
        go = lo < hi
        lo = tl.where(go & less, mid + 1, lo)
        hi = tl.where(go & ~less, mid, hi)
    return tl.minimum(lo, n - 1)


@triton.jit
def _find_kernel(ids_ptr, num_unique_ptr, n, slot_id_ptr, pins_ptr, ovf_ids_ptr, ovf_slot_ptr, n_ovf, ovf_steps,
                 part_ends_ptr, part_sets_ptr, part_base_ptr, n_parts, sets, ways, cap, slots_ptr, set_ptr,
                 PARTS: tl.constexpr, OVERFLOW: tl.constexpr, WAYS: tl.constexpr, BLOCK: tl.constexpr):
    """Ids BLOCK * program 0 onwards: slots[i], the slot of ids[i] (-1: a miss, or i >= U), and
    set[i], its set if a miss, else `sets` (after every set when sorted)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    valid = live & (i < tl.load(num_unique_ptr))
    ids = tl.maximum(tl.load(ids_ptr + i, mask=live, other=0), 0)
    home = _set_of(ids, sets, part_ends_ptr, part_sets_ptr, part_base_ptr, n_parts, PARTS)
    way = tl.arange(0, WAYS)
    at = home[:, None] * ways + way[None, :]
    match = (tl.load(slot_id_ptr + at, mask=live[:, None] & (way < ways)[None, :], other=-1) == ids[:, None])
    first = tl.min(tl.where(match, way[None, :], WAYS), axis=1)  # the way that holds the id, WAYS: none
    slot = tl.where(first < WAYS, home * ways + first, -1)
    if OVERFLOW:  # the sorted overflow directory's entry for the id, if any
        pos = _lower_bound(ovf_ids_ptr, n_ovf, ids, ovf_steps)
        found = (slot < 0) & (tl.load(ovf_ids_ptr + pos, mask=live, other=-1) == ids)
        slot = tl.where(found, tl.load(ovf_slot_ptr + pos, mask=live & found, other=-1), slot)
        # an overflow row nobody pins any more leaves and comes back: a miss
        unpinned = tl.load(pins_ptr + tl.maximum(slot, 0), mask=live, other=0) == 0
        slot = tl.where((slot >= cap) & unpinned, -1, slot)
    slot = tl.where(valid, slot, -1)
    tl.store(slots_ptr + i, slot, mask=live)
    tl.store(set_ptr + i, tl.where(valid & (slot < 0), home, sets), mask=live)


@triton.jit
def _assign_kernel(in_set_ptr, order_ptr, n, sets, ways, slot_id_ptr, pins_ptr, used_ptr, stamp_ptr, uses_ptr,
                   wid_ptr, wbatch_ptr, n_w, w_steps, chosen_ptr, LFU: tl.constexpr, WINDOW: tl.constexpr,
                   WAYS: tl.constexpr):
    """Sorted position p = program 0 (the batch's misses sorted by set, in batch order within one:
    in_set, order): if p is its set's first miss, the set's misses take its ways, the r-th miss
    the way of rank r among the candidates (ties: the lower way), while candidates last: chosen
    [order[p + r]] = its slot."""
    p = tl.program_id(0)
    s = tl.load(in_set_ptr + p)
    prev = tl.load(in_set_ptr + tl.maximum(p - 1, 0))
    if (s < sets) & ((p == 0) | (prev != s)):
        ahead = p + tl.arange(0, WAYS)
        misses = tl.sum((tl.load(in_set_ptr + ahead, mask=ahead < n, other=-1) == s).to(tl.int32), axis=0)
        way = tl.arange(0, WAYS)
        in_set = way < ways
        slot = s * ways + way
        sid = tl.load(slot_id_ptr + slot, mask=in_set, other=-1)
        key = tl.load(stamp_ptr + slot, mask=in_set, other=0)
        if LFU:  # uses first (capped), then the stamp
            key = tl.minimum(tl.load(uses_ptr + slot, mask=in_set, other=0), _USES_CAP_K) * (1 << 32) + key
        if WINDOW:  # rows the window batches use: after the rest, the farthest next use first
            pos = _lower_bound(wid_ptr, n_w, sid, w_steps)
            ahead_use = (tl.load(wid_ptr + pos) == sid) & (sid >= 0)
            key = tl.where(ahead_use, _WINDOW_KEY_K - tl.load(wbatch_ptr + pos), key)
        key = tl.where(sid < 0, -1, key)
        taken = (tl.load(pins_ptr + slot, mask=in_set, other=0) > 0) | (tl.load(used_ptr + slot, mask=in_set,
                                                                               other=0) != 0)
        key = tl.where(taken, _NEVER_K, key)
        key = tl.where(in_set, key, _LAST_K)
        # each way's rank among the candidates: the ways with a smaller key, or an equal one before it
        before = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None]) & (way[None, :] < way[:, None]))
        rank = tl.sum(before.to(tl.int32), axis=1)
        place = in_set & (rank < misses) & (key < _NEVER_K)
        miss = tl.load(order_ptr + p + rank, mask=place, other=0)
        tl.store(chosen_ptr + miss, slot.to(tl.int64), mask=place)


# seed is a 64-bit key, never a constant (see rowinit).
@triton.jit(do_not_specialize=["seed"])
def _draw_kernel(ids_ptr, num_unique_ptr, num_rows, held_ptr, slots_ptr, counts_ptr, out_ptr, dim,
                 width, weight_words, seed, kind, a, b, below_high, zero_id, WEIGHTS: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Distinct id i = program 0 of a tier holding every row (slot = id): slots[i] = the id (-1
    for i >= U, or an id out of range: left alone); a row not held yet is drawn into out[id],
    marked held, and counted in counts[0]; program 0 adds U to counts[1]."""
    i = tl.program_id(0)
    num_unique = tl.load(num_unique_ptr)
    row_id = tl.load(ids_ptr + i)
    ok = (i < num_unique) & (row_id >= 0) & (row_id < num_rows)
    tl.store(slots_ptr + i, tl.where(ok, row_id, -1))
    if i == 0:
        tl.store(counts_ptr + 1, tl.load(counts_ptr + 1) + num_unique)
    if ok:
        if tl.load(held_ptr + row_id) == 0:
            init_row(out_ptr, row_id, row_id, dim, width, weight_words, seed.to(tl.uint64), kind, a, b, below_high,
                     zero_id, WEIGHTS, BLOCK)
            tl.store(held_ptr + row_id, 1)  # (clean: a row never held was never marked dirty)
            tl.atomic_add(counts_ptr, 1)  # (an integer sum: the same whatever the order)


def draw(ids, num_unique, index, rows, init, slots) -> None:
    """_draw_kernel over ids [n] (distinct in their first U = num_unique entries) for DirectIndex
    `index`, drawing rows into `rows` (the pool) with RowInit `init`; slots: int64 [n] out."""
    n = ids.numel()
    if n == 0:
        return
    dim, kind, a, b, seed, zero_id = init.args
    width = rows.shape[1]
    with launch_turn():
        # (one warp a program: most ids are held, or past U, and only store their slot)
        _draw_kernel[(n,)](ids, num_unique, index.slots_total, index.held.view(torch.uint8), slots, index.drawn,
                           rows, dim, width, seed=seed, kind=kind, zero_id=zero_id, WEIGHTS=init.weights,
                           enable_fp_fusion=False, num_warps=1, **kernel_args(dim, width, kind, a, b, init.weights))


def find(ids, num_unique, index, slots, set_out) -> None:
    """_find_kernel over ids [n] into slots / set_out (int64 [n]) for SetIndex `index`."""
    n = ids.numel()
    if n == 0:
        return
    parts = index.partitions is not None
    ovf = index.overflow_in_use > 0
    n_ovf = index.ovf_ids.numel()
    block = 64
    dummy = slots
    with launch_turn():
        _find_kernel[(triton.cdiv(n, block),)](
            ids, num_unique, n, index.slot_id, index.pins, index.ovf_ids if ovf else dummy,
            index.ovf_slot if ovf else dummy, max(n_ovf, 1), max(n_ovf, 1).bit_length(),
            index.part_ends if parts else dummy, index.part_sets if parts else dummy,
            index.part_base if parts else dummy, len(index.partitions) if parts else 1, index.sets, index.ways,
            index.capacity, slots, set_out, PARTS=parts, OVERFLOW=ovf, WAYS=triton.next_power_of_2(index.ways),
            BLOCK=block)


def assign(in_set, order, index, used, window, chosen) -> None:
    """_assign_kernel: the misses sorted by set (in_set, order) take their sets' ways into chosen
    (int64 [n], -1 where a miss finds none). window: (ids sorted, their first batch) or None."""
    n = in_set.numel()
    if n == 0:
        return
    wid, wbatch = window if window is not None else (in_set, in_set)
    n_w = max(wid.numel(), 1)
    with launch_turn():
        _assign_kernel[(n,)](in_set, order, n, index.sets, index.ways, index.slot_id, index.pins, used, index.stamp,
                             index.uses, wid, wbatch, n_w, n_w.bit_length(), chosen, LFU=index.policy == "lfu",
                             WINDOW=window is not None, WAYS=triton.next_power_of_2(index.ways))
