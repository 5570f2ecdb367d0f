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

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import PerMultiprocessor, launch_turn, programs
from .rowinit import init_chunk, kernel_args

# The assign kernel's programs (gpu.programs): None, one per sorted position (each set's first
# miss does the work, the others return at once); or capped, each taking positions a grid's
# stride apart. The same results either way. On the H200 (bench/gpu_kernels.py --plan, a queued
# plan and its commit, 164K ids): one per position 352.5 us, 8 to 64 per multiprocessor
# 294.0-307.5 us.
ASSIGN_PROGRAMS = PerMultiprocessor(32)

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
                 part_ends_ptr, part_sets_ptr, part_base_ptr, n_parts, sets, ways, cap, slots_ptr, set_ptr, tag_ptr,
                 step_ptr, PARTS: tl.constexpr, OVERFLOW: tl.constexpr, LOOKUP: tl.constexpr, WAYS: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Ids BLOCK * program 0 onwards: slots[i], the slot of ids[i] (-1: a miss, or i >= U), and
    set[i] (int32), its set if a miss, else `sets` (after every set when sorted); the slots found
    get the plan's tag, its step (they are the batch's: no victims, no free overflow slots).
    LOOKUP: slots[i] only, the slot that holds ids[i] (every i < n; -1 for none, and for an id < 0),
    an overflow row whether pinned or not; nothing else written."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    raw = tl.load(ids_ptr + i, mask=live, other=0)
    if LOOKUP:
        valid = live & (raw >= 0)
    else:
        valid = live & (i < tl.load(num_unique_ptr))
    ids = tl.maximum(raw, 0)
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
        if not LOOKUP:  # an overflow row nobody pins any more leaves and comes back: a miss
            unpinned = tl.load(pins_ptr + tl.maximum(slot, 0), mask=live, other=0) <= 0
            slot = tl.where((slot >= cap) & unpinned, -1, slot)
    slot = tl.where(valid, slot, -1)
    tl.store(slots_ptr + i, slot, mask=live)
    if not LOOKUP:
        tl.store(set_ptr + i, tl.where(valid & (slot < 0), home, sets).to(tl.int32), mask=live)
        tl.store(tag_ptr + slot, tl.zeros_like(slot) + tl.load(step_ptr), mask=slot >= 0)


@triton.jit
def _assign_kernel(in_set_ptr, order_ptr, n, sets, ways, slot_id_ptr, pins_ptr, tag_ptr, step_ptr, stamp_ptr, uses_ptr,
                   wid_ptr, wbatch_ptr, n_w, w_steps, chosen_ptr, LFU: tl.constexpr, WINDOW: tl.constexpr,
                   WAYS: tl.constexpr):
    """Sorted positions p = program 0, then a grid's stride apart, below n (the batch's misses
    sorted by set, in batch order within one: in_set, order): if p is its set's first miss, the
    set's misses take its ways, the r-th miss the way of rank r among the candidates (ties: the
    lower way), while candidates last: chosen[order[p + r]] = its slot."""
    for p in range(tl.program_id(0), n, tl.num_programs(0)):
        s = tl.load(in_set_ptr + p).to(tl.int64)
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
            taken = (tl.load(pins_ptr + slot, mask=in_set, other=0) > 0) | (tl.load(tag_ptr + slot, mask=in_set,
                                                                                  other=0) == tl.load(step_ptr))
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
def _draw_kernel(ids_ptr, num_unique_ptr, n, num_rows, held_ptr, slots_ptr, counts_ptr, out_ptr, dim,
                 width, weight_words, seed, kind, a, b, below_high, zero_id, WEIGHTS: tl.constexpr,
                 CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """A tier holding every row (slot = id): the distinct ids i < n, CHUNK at a time from CHUNK *
    program 0 on, a grid's stride apart. slots[i] = the id (-1 for i >= U, or an id out of range:
    left alone); a row not held yet is marked held, drawn into out[id] (rowinit.init_chunk) and
    counted in counts[0] (one add a program); program 0 adds U to counts[1]."""
    num_unique = tl.load(num_unique_ptr)
    if tl.program_id(0) == 0:
        tl.store(counts_ptr + 1, tl.load(counts_ptr + 1) + num_unique)
    drawn = 0
    for base in range(tl.program_id(0) * CHUNK, n, tl.num_programs(0) * CHUNK):
        i = base + tl.arange(0, CHUNK)
        live = i < n
        row_id = tl.load(ids_ptr + i, mask=live, other=-1)
        ok = live & (i < num_unique) & (row_id >= 0) & (row_id < num_rows)
        new = ok & (tl.load(held_ptr + row_id, mask=ok, other=1) == 0)
        tl.store(slots_ptr + i, tl.where(ok, row_id, -1), mask=live)
        tl.debug_barrier()  # (every thread has read held before any marks it, whatever num_warps is)
        tl.store(held_ptr + row_id, 1, mask=new)  # (clean: a row never held was never marked dirty)
        drawn += tl.sum(new.to(tl.int32), axis=0)
        init_chunk(out_ptr, row_id, row_id, new, dim, width, weight_words, seed.to(tl.uint64), kind, a, b,
                   below_high, zero_id, WEIGHTS, CHUNK, BLOCK)
    if drawn > 0:
        tl.atomic_add(counts_ptr, drawn.to(tl.int64))  # (an integer sum: the same whatever the order)


# Ids a draw program reads at once, and its programs (gpu.programs): the chunks of ids taken a
# grid's stride apart. On the H200 (bench/gpu_kernels.py, the batch, 40 % of its distinct
# rows drawn): one program of one warp per id (N of them, most past U or held) 101.9 us, chunks of
# 8 at 32 programs per multiprocessor 31.8 us, chunks of 64 48.2 us. Small chunks: a chunk's rows
# are drawn one after the other by its warp, so on the batch (164K ids, 57K distinct,
# 16-25K drawn) chunks of 8 keep about 32 warps a multiprocessor busy with a few rows each, where
# chunks of 64 would leave 7 with 25 rows each.
DRAW_CHUNK = 8
DRAW_PROGRAMS = PerMultiprocessor(32)


def draw(ids, num_unique, index, rows, init, slots) -> None:
    """_draw_kernel over ids [n] (distinct in their first U = num_unique entries) for DirectIndex
    `index`, drawing rows into `rows` (the pool) with RowInit `init`; slots: int64 [n] out."""
    n = ids.numel()
    if n == 0:
        return
    dim, kind, a, b, seed, zero_id = init.args
    width = rows.shape[1]
    with launch_turn():
        # (one warp a program: a chunk's 8 ids held by 4 threads each, hence the barrier between the
        # held bits' loads and stores; a row of dim 128 drawn four columns a thread)
        _draw_kernel[(programs(triton.cdiv(n, DRAW_CHUNK), DRAW_PROGRAMS, ids.device),)](
            ids, num_unique, n, index.slots_total, index.held.view(torch.uint8), slots, index.drawn, rows, dim, width,
            seed=seed, kind=kind, zero_id=zero_id, WEIGHTS=init.weights, CHUNK=DRAW_CHUNK, enable_fp_fusion=False,
            num_warps=1, **kernel_args(dim, width, kind, a, b, init.weights))


def find(ids, num_unique, index, slots, set_out) -> None:
    """_find_kernel over ids [n] into slots (int64 [n]) / set_out (int32 [n]) for SetIndex
    `index`, the slots found tagged with the plan's step (index.step, on the device) in index.tags."""
    _find(ids, num_unique, index, slots, set_out, False)


def lookup(ids, index, slots) -> None:
    """_find_kernel as a lookup: slots (int64 [n]) the slot of each of ids [n] in SetIndex `index`,
    -1 where none holds it (and for an id < 0). Changes nothing."""
    _find(ids, ids, index, slots, slots, True)


def _find(ids, num_unique, index, slots, set_out, lookup: bool) -> None:
    n = ids.numel()
    if n == 0:
        return
    parts = index.partitions is not None
    ovf = index.overflow_in_use > 0 or not index.overflow_known  # (unknown: any may be in use)
    n_ovf = index.ovf_ids.numel()
    block = 64
    dummy = slots
    with launch_turn():
        _find_kernel[(triton.cdiv(n, block),)](
            ids, num_unique, n, index.slot_id, index.pins, index.ovf_ids if ovf else dummy,
            index.ovf_slot if ovf else dummy, max(n_ovf, 1), max(n_ovf, 1).bit_length(),
            index.part_ends if parts else dummy, index.part_sets if parts else dummy,
            index.part_base if parts else dummy, len(index.partitions) if parts else 1, index.sets, index.ways,
            index.capacity, slots, set_out, index.tags, index.step, PARTS=parts, OVERFLOW=ovf, LOOKUP=lookup,
            WAYS=triton.next_power_of_2(index.ways), BLOCK=block)


def assign(in_set, order, index, window, chosen) -> None:
    """_assign_kernel: the misses sorted by set (in_set, order) take their sets' ways into chosen
    (int64 [n], -1 where a miss finds none), never a slot holding the plan's tag (the batch's
    rows). window: (ids sorted, their first batch) or None."""
    n = in_set.numel()
    if n == 0:
        return
    wid, wbatch = window if window is not None else (in_set, in_set)
    n_w = max(wid.numel(), 1)
    with launch_turn():
        _assign_kernel[(programs(n, ASSIGN_PROGRAMS, in_set.device),)](
            in_set, order, n, index.sets, index.ways, index.slot_id, index.pins, index.tags, index.step, index.stamp,
            index.uses, wid, wbatch, n_w, n_w.bit_length(), chosen, LFU=index.policy == "lfu",
            WINDOW=window is not None, WAYS=triton.next_power_of_2(index.ways))


# The rest of a plan, after find and assign, in two launches over the "entries": the batch's n ids,
# then the overflow slots. The first (tally) counts each kind of entry per block; a cumsum of the
# counts gives every block its offsets; the second (place) writes each entry where it goes, so the
# lists come out in the order of the entries, as the torch twin compacts them.
# Kinds, in the order of the plan's transfer header:
NEED, FREE, VALID, FRESH, VICTIM, DIRTY, BAD, LINGERING = range(8)
KINDS = 8
_KINDS_K: tl.constexpr = tl.constexpr(KINDS)
_BLOCK = 256


@triton.jit
def _entries(v, ids_ptr, num_unique, n, num_rows, found_ptr, chosen_ptr, slot_id_ptr, pins_ptr, dirty_ptr, tag_ptr,
             tag, cap, n_ovf, decided_ptr, DECIDE: tl.constexpr):
    """Entries v: v < n is the batch's id v; n <= v < n + n_ovf the overflow slot cap + v - n.
    Returns (id, the slot find gave it, the one assign chose, the slot whose row may leave (the
    chosen one; the overflow slot), the id in that slot, and the kinds: need (a miss with no slot
    in its set), free (an overflow slot empty or lingering), valid, fresh (a miss), victim (a row
    leaving: in a chosen slot, or lingering in an overflow slot nobody pins and the batch did not
    find), dirty (a victim to write down), bad (an id out of range), lingering). Which overflow
    rows linger and which victims are dirty is decided once (DECIDE, in tally: into decided[v],
    2 | 1) and read back after (in place): on a GPU a release on the compute stream may unpin a row
    between the two launches (and a row's dirty bit is its pinned batch's to set), and both must
    see the same victims."""
    is_id = v < n
    valid = is_id & (v < num_unique)
    row_id = tl.load(ids_ptr + v, mask=is_id, other=0)
    found = tl.load(found_ptr + v, mask=is_id, other=-1)
    fresh = valid & (found < 0)
    chosen = tl.load(chosen_ptr + v, mask=fresh, other=-1)
    need = fresh & (chosen < 0)
    in_set = fresh & (chosen >= 0)
    is_ovf = (v >= n) & (v < n + n_ovf)
    slot = tl.where(is_id, chosen, cap + v - n)
    at = tl.maximum(slot, 0)
    gone_id = tl.load(slot_id_ptr + at, mask=in_set | is_ovf, other=-1)
    live = v < n + n_ovf
    if DECIDE:
        lingering = is_ovf & (gone_id >= 0) & (tl.load(pins_ptr + at, mask=is_ovf, other=1) == 0) & \
            (tl.load(tag_ptr + at, mask=is_ovf, other=0) != tag)
        victim = (in_set & (gone_id >= 0)) | lingering
        dirty = victim & (tl.load(dirty_ptr + at, mask=victim, other=0) != 0)
        tl.store(decided_ptr + v, (lingering.to(tl.uint8) * 2) | dirty.to(tl.uint8), mask=live)
    else:
        seen = tl.load(decided_ptr + v, mask=live, other=0)
        lingering = is_ovf & ((seen & 2) != 0)
        victim = (in_set & (gone_id >= 0)) | lingering
        dirty = (seen & 1) != 0
    bad = valid & ((row_id < 0) | (row_id >= num_rows))
    free = is_ovf & ((gone_id < 0) | lingering)
    return row_id, found, chosen, slot, gone_id, need, free, valid, fresh, victim, dirty, bad, lingering


@triton.jit(do_not_specialize=["n", "blocks"])
def _tally_kernel(ids_ptr, num_unique_ptr, n, num_rows, found_ptr, chosen_ptr, slot_id_ptr, pins_ptr, dirty_ptr,
                  tag_ptr, step_ptr, cap, n_ovf, decided_ptr, counts_ptr, blocks, BLOCK: tl.constexpr):
    """Entries BLOCK * program b onwards: counts[kind, b] = how many of each kind (kind-major: the
    scan over the blocks is then along the inner dimension); decided[v]: 2 if the entry is a
    lingering overflow row, | 1 if a dirty victim."""
    b = tl.program_id(0)
    v = b * BLOCK + tl.arange(0, BLOCK)
    _, _, _, _, _, need, free, valid, fresh, victim, dirty, bad, lingering = _entries(
        v, ids_ptr, tl.load(num_unique_ptr), n, num_rows, found_ptr, chosen_ptr, slot_id_ptr, pins_ptr, dirty_ptr,
        tag_ptr, tl.load(step_ptr), cap, n_ovf, decided_ptr, True)
    out = counts_ptr + b
    tl.store(out + 0 * blocks, tl.sum(need.to(tl.int64), axis=0))
    tl.store(out + 1 * blocks, tl.sum(free.to(tl.int64), axis=0))
    tl.store(out + 2 * blocks, tl.sum(valid.to(tl.int64), axis=0))
    tl.store(out + 3 * blocks, tl.sum(fresh.to(tl.int64), axis=0))
    tl.store(out + 4 * blocks, tl.sum(victim.to(tl.int64), axis=0))
    tl.store(out + 5 * blocks, tl.sum(dirty.to(tl.int64), axis=0))
    tl.store(out + 6 * blocks, tl.sum(bad.to(tl.int64), axis=0))
    tl.store(out + 7 * blocks, tl.sum(lingering.to(tl.int64), axis=0))


@triton.jit
def _rank(flag, ends_ptr, blocks, b, kind):
    """Each flagged entry's rank among the entries of its kind: those in blocks before b (ends:
    the cumsum of the blocks' counts, [KINDS, blocks]), then those before it in block b."""
    before = tl.load(ends_ptr + kind * blocks + b - 1, mask=b > 0, other=0)
    f = flag.to(tl.int32)
    return before + (tl.cumsum(f, axis=0) - f).to(tl.int64)


@triton.jit(do_not_specialize=["n", "blocks", "guess"])
def _place_kernel(ids_ptr, num_unique_ptr, n, num_rows, found_ptr, chosen_ptr, slot_id_ptr, pins_ptr, dirty_ptr,
                  tag_ptr, step_ptr, cap, n_ovf, decided_ptr, ends_ptr, blocks, slots_ptr, valid_ptr, fresh_ptr,
                  xfer_ptr, miss_slots_ptr, miss_victims_ptr, need_at_ptr, need_miss_ptr, victims_ptr, dirty_slots_ptr,
                  free_ptr, leaves_ptr, rows_ptr, width, guess, guessed_ptr, GUESS: tl.constexpr, COLS: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Entries BLOCK * program b onwards, each where it goes: the batch's slots (a miss: the slot
    assign chose, -1 for a need, bound later), valid and fresh; into the transfer (xfer: the kinds'
    totals, then the miss ids from 8, then the dirty victims' ids from 8 + n) and the device lists
    beside it (miss slots, each miss's dirty victim in its set, victim slots, dirty slots, the needs
    (their entry and miss rank), the free overflow slots); leaves[j] = 1 for a lingering overflow
    row whose slot no need takes (commit empties it); with GUESS, the rows of the first `guess`
    dirty victims into guessed."""
    b = tl.program_id(0)
    v = b * BLOCK + tl.arange(0, BLOCK)
    row_id, found, chosen, slot, gone_id, need, free, valid, fresh, victim, dirty, bad, lingering = _entries(
        v, ids_ptr, tl.load(num_unique_ptr), n, num_rows, found_ptr, chosen_ptr, slot_id_ptr, pins_ptr, dirty_ptr,
        tag_ptr, tl.load(step_ptr), cap, n_ovf, decided_ptr, False)
    kind = tl.arange(0, _KINDS_K)
    first = kind + b * _KINDS_K < _KINDS_K  # (program 0 writes the totals)
    tl.store(xfer_ptr + kind, tl.load(ends_ptr + kind * blocks + blocks - 1), mask=first)
    is_id = v < n
    tl.store(slots_ptr + v, tl.where(fresh, chosen, found), mask=is_id)
    tl.store(valid_ptr + v, valid.to(tl.uint8), mask=is_id)
    tl.store(fresh_ptr + v, fresh.to(tl.uint8), mask=is_id)
    miss = _rank(fresh, ends_ptr, blocks, b, 3)
    tl.store(xfer_ptr + _KINDS_K + miss, row_id, mask=fresh)
    tl.store(miss_slots_ptr + miss, chosen, mask=fresh)
    tl.store(miss_victims_ptr + miss, tl.where(dirty, gone_id, -1), mask=fresh)  # (an entry < n: in its set)
    k = _rank(need, ends_ptr, blocks, b, 0)
    tl.store(need_at_ptr + k, v.to(tl.int64), mask=need)
    tl.store(need_miss_ptr + k, miss, mask=need)
    tl.store(victims_ptr + _rank(victim, ends_ptr, blocks, b, 4), slot, mask=victim)
    d = _rank(dirty, ends_ptr, blocks, b, 5)
    tl.store(xfer_ptr + _KINDS_K + n + d, gone_id, mask=dirty)
    tl.store(dirty_slots_ptr + d, slot, mask=dirty)
    f = _rank(free, ends_ptr, blocks, b, 1)
    tl.store(free_ptr + f, slot, mask=free)
    is_ovf = (v >= n) & (v < n + n_ovf)
    leaves = lingering & (f >= tl.load(ends_ptr + blocks - 1))  # (no need takes its slot: past the needs' total)
    tl.store(leaves_ptr + v - n, leaves.to(tl.uint8), mask=is_ovf)
    if GUESS:
        copy = dirty & (d < guess)
        for c0 in range(0, width, COLS):
            cols = c0 + tl.arange(0, COLS)
            m = copy[:, None] & (cols < width)[None, :]
            row = tl.load(rows_ptr + tl.maximum(slot, 0)[:, None] * width + cols[None, :], mask=m)
            tl.store(guessed_ptr + d[:, None] * width + cols[None, :], row, mask=m)


@triton.jit(do_not_specialize=["count"])
def _bind_kernel(need_at_ptr, need_miss_ptr, free_ptr, count, count_ptr, slots_ptr, miss_slots_ptr,
                 COUNTED: tl.constexpr, BLOCK: tl.constexpr):
    """Need k < count (the k-th miss, in batch order, that found no slot in its set) takes the k-th
    free overflow slot. COUNTED: count is the least of the plan's needs and free slots (its
    totals on the device, at count_ptr: NEED, then FREE); a need past the free slots would keep
    no slot (-1: the caller makes sure there are enough)."""
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = k < (tl.minimum(tl.load(count_ptr), tl.load(count_ptr + 1)) if COUNTED else count)
    slot = tl.load(free_ptr + k, mask=live)
    tl.store(slots_ptr + tl.load(need_at_ptr + k, mask=live, other=0), slot, mask=live)
    tl.store(miss_slots_ptr + tl.load(need_miss_ptr + k, mask=live, other=0), slot, mask=live)


@triton.jit(do_not_specialize=["n"])
def _release_kernel(slots_ptr, n, pins_ptr, BLOCK: tl.constexpr):
    """A batch's rows unpinned: slots[i] >= 0 loses a pin (atomic: commits on the tier's stream
    may pin rows at the same time)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + i, mask=i < n, other=-1)
    tl.atomic_add(pins_ptr + tl.maximum(slot, 0), tl.full(slot.shape, -1, tl.int32), mask=slot >= 0)


@triton.jit(do_not_specialize=["n"])
def _commit_kernel(ids_ptr, n, valid_ptr, fresh_ptr, slots_ptr, leaves_ptr, n_ovf, cap, slot_id_ptr, pins_ptr,
                   dirty_ptr, stamp_ptr, uses_ptr, step_ptr, PIN: tl.constexpr, BLOCK: tl.constexpr):
    """A plan applied, entries BLOCK * program 0 onwards: each miss's id into its slot (clean, used
    once), each row of the batch stamped (with the plan's step), used once more and (PIN) pinned; each overflow slot
    whose row leaves (leaves[j]) emptied. (No two entries touch one slot: a victim's slot is the miss's
    that takes it, or emptied.)"""
    v = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    is_id = v < n
    valid = is_id & (tl.load(valid_ptr + v, mask=is_id, other=0) != 0)
    fresh = valid & (tl.load(fresh_ptr + v, mask=is_id, other=0) != 0)
    slot = tl.load(slots_ptr + v, mask=valid, other=0)
    valid &= slot >= 0  # (never so but for a queued plan short of overflow slots: nothing written outside)
    fresh &= valid
    tl.store(slot_id_ptr + slot, tl.load(ids_ptr + v, mask=fresh, other=0), mask=fresh)
    tl.store(dirty_ptr + slot, tl.zeros_like(slot).to(tl.uint8), mask=fresh)
    uses = tl.load(uses_ptr + slot, mask=valid & ~fresh, other=0)
    tl.store(uses_ptr + slot, uses + 1, mask=valid)
    tl.store(stamp_ptr + slot, tl.zeros_like(slot) + tl.load(step_ptr), mask=valid)
    if PIN:  # (atomic: a release on another stream may unpin rows at the same time)
        tl.atomic_add(pins_ptr + slot, tl.full(slot.shape, 1, tl.int32), mask=valid)
    is_ovf = (v >= n) & (v < n + n_ovf)
    at = cap + v - n
    leaves = is_ovf & (tl.load(leaves_ptr + v - n, mask=is_ovf, other=0) != 0)
    tl.store(slot_id_ptr + at, tl.full(v.shape, -1, tl.int64), mask=leaves)
    tl.store(dirty_ptr + at, tl.zeros_like(v).to(tl.uint8), mask=leaves)


class Placed(NamedTuple):
    """A plan's lists on the device (place()): xfer, the one block the plan moves to the host
    (KINDS totals, then the miss ids from KINDS, then the dirty victims' ids from KINDS + n); the
    rest stay on the device."""

    xfer: torch.Tensor         # int64 [KINDS + 2n + overflow slots]
    slots: torch.Tensor        # int64 [n]: each id's slot (a need's once bound)
    valid: torch.Tensor        # bool [n]
    fresh: torch.Tensor        # bool [n]
    miss_slots: torch.Tensor   # int64 [n]: the misses' slots, in batch order (a need's once bound)
    miss_victims: torch.Tensor  # int64 [n]: the id of each miss's dirty victim in its set (the row its slot
    #                             holds, written down before the miss comes), -1 for none (and for a need's)
    victims: torch.Tensor      # int64 [n + overflow slots]: slots whose row leaves
    dirty_slots: torch.Tensor  # int64 [n + overflow slots]: those whose row is written down first
    needs: tuple               # (entry, miss rank) of each need, the free overflow slots: for bind()
    leaves: torch.Tensor       # uint8 [overflow slots]: 1 where a lingering row leaves for good
    guessed: torch.Tensor | None  # float32 [guess, width]: the first dirty victims' rows


def place(ids, num_unique, num_rows, index, found, chosen, rows, guess) -> Placed:
    """The plan's lists from find's slots (found) and assign's (chosen), in three launches (tally,
    a cumsum, place); guess > 0: the rows (rows: the pool) of the first `guess` dirty victims
    too. Reads the index; changes nothing in it."""
    n, dev, n_ovf = ids.numel(), ids.device, index.overflow_slots
    blocks = max(1, triton.cdiv(n + n_ovf, _BLOCK))
    counts = torch.empty(KINDS, blocks, dtype=torch.int64, device=dev)  # (kind-major: see _tally_kernel)

    def empty(size, dtype=torch.int64):
        return torch.empty(size, dtype=dtype, device=dev)

    out = Placed(empty(KINDS + 2 * n + n_ovf), found, empty(n, torch.bool), empty(n, torch.bool), empty(n), empty(n),
                 empty(n + n_ovf), empty(n + n_ovf), (empty(n), empty(n), empty(n_ovf)), empty(n_ovf, torch.uint8),
                 empty((guess, rows.shape[1]), torch.float32) if guess else None)
    decided = empty(n + n_ovf, torch.uint8)  # (tally's reading of what may change under it: see _entries)
    state = (index.slot_id, index.pins, index.dirty, index.tags, index.step, index.capacity, n_ovf, decided)
    with launch_turn():
        _tally_kernel[(blocks,)](ids, num_unique, n, num_rows, found, chosen, *state, counts, blocks, BLOCK=_BLOCK)
    # (along the inner dimension: on a GPU torch scans an outer one with a thread per column, 117 us
    # for the 164K ids on an H200, against a few for an inner one)
    ends = torch.cumsum(counts, 1)
    width = rows.shape[1] if guess else 1
    with launch_turn():
        _place_kernel[(blocks,)](ids, num_unique, n, num_rows, found, chosen, *state, ends, blocks, out.slots,
                                 out.valid.view(torch.uint8), out.fresh.view(torch.uint8), out.xfer, out.miss_slots,
                                 out.miss_victims, out.needs[0], out.needs[1], out.victims, out.dirty_slots,
                                 out.needs[2], out.leaves, rows if guess else ids, width, guess,
                                 out.guessed if guess else ids,
                                 GUESS=guess > 0, COLS=min(16, triton.next_power_of_2(width)), BLOCK=_BLOCK)
    return out


def bind(placed: Placed, count: int | None) -> None:
    """The first `count` needs take the first `count` free overflow slots (count <= both); None:
    the count the plan's totals hold on the device (no wait: the caller made sure it fits)."""
    if count is None:
        most = placed.needs[0].numel()
        if most:
            with launch_turn():
                _bind_kernel[(triton.cdiv(most, _BLOCK),)](*placed.needs, 0, placed.xfer[NEED:FREE + 1], placed.slots,
                                                             placed.miss_slots, COUNTED=True, BLOCK=_BLOCK)
    elif count:
        with launch_turn():
            _bind_kernel[(triton.cdiv(count, _BLOCK),)](*placed.needs, count, placed.slots, placed.slots,
                                                          placed.miss_slots, COUNTED=False, BLOCK=_BLOCK)


def commit(ids, placed: Placed, index, lingering: bool, pin: bool) -> None:
    """_commit_kernel: the plan applied to the index's state tensors (the overflow slots' rows
    leaving only when some row lingered)."""
    n, n_ovf = ids.numel(), (index.overflow_slots if lingering else 0)
    if n + n_ovf == 0:
        return
    with launch_turn():
        _commit_kernel[(triton.cdiv(n + n_ovf, _BLOCK),)](
            ids, n, placed.valid.view(torch.uint8), placed.fresh.view(torch.uint8), placed.slots, placed.leaves, n_ovf,
            index.capacity, index.slot_id, index.pins, index.dirty, index.stamp, index.uses, index.step, PIN=pin,
            BLOCK=_BLOCK)


def release(slots, pins) -> None:
    """_release_kernel: the rows in slots (int64 [n]; entries < 0 ignored) lose a pin."""
    n = slots.numel()
    if n:
        with launch_turn():
            _release_kernel[(triton.cdiv(n, _BLOCK),)](slots, n, pins, BLOCK=_BLOCK)
