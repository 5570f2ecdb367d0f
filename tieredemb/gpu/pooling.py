"""Tier 0's lookup math on the device, as Triton kernels: bag pooling forward, and backward fused
with the optimizer. The same arithmetic as the native CPU kernels (native/kernels/pooling.cc)
and the torch-ops twin (tieredemb/kernels.py), equal to them within float tolerance, and bit for
bit from run to run: every sum has a fixed order (a bag's rows in occurrence order; a unique
row's gradient over its occurrences in occurrence order), and no kernel uses atomics.

Inputs, all on the pool's device: pool float32 [slots, width] (a row: dim weights ‖ state);
slots int64 [>= U] (unique row u lives in pool row slots[u]); unique int64 [>= U] (its id, to
find the padding row); inverse int64 [N] (occurrence i is unique row inverse[i]); offsets int64
[B + 1] (bag b is occurrences offsets[b] .. offsets[b+1]); psw float32 [N] or None. Buffers may
be longer than U (a batch deduplicated on the device, its U never read by the host): occurrences
in a bag only name u < U. Occurrences in no bag (include_last_offset's ids after the last bag,
on the device path: gpu/checks.py) name u = U, whose unique id and slot are -1: the kernels that
read every occurrence leave them out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import PerMultiprocessor, launch_turn, programs
from .rowinit import _mix64, _row_key, bf16_bits, load_weights, store_weights

_SUM, _MEAN, _MAX = 0, 1, 2

# Launch shapes of the forward and of the backward's update: warps per program, and the most
# occurrences read at once (see _tile). Measured on an H200 by bench/gpu_kernels.py (bench_gpu.py's
# batch, dim 128; two sweeps, bench/RESULTS.md; each time with its launch's host time in it):
# forward 91-105 us at 4 warps and 32 occurrences, 47-59 us at 1 and 8; backward + update 529-631
# us at 4 and 32, 404-408 us at 1 and 16. Module constants, so that gpu_kernels.py can try others.
FORWARD_WARPS, FORWARD_TILE = 1, 8
UPDATE_WARPS, UPDATE_TILE = 1, 16
# The update's programs (gpu.programs): None, one per occurrence (U of N do work, the others
# return at once); or capped, each taking unique rows a grid's stride apart. The same results
# either way. On the H200 (bench/gpu_kernels.py --update-programs, the batch: 164K ids,
# 57K distinct): one per occurrence 287.6 us, 32 per multiprocessor 267.9 us, 8 per 349.1 us.
UPDATE_PROGRAMS = PerMultiprocessor(32)


@triton.jit
def _forward_kernel(pool_ptr, slots_ptr, unique_ptr, inverse_ptr, offsets_ptr, psw_ptr, out_ptr, at_ptr, saved_ptr,
                    dim, width, skip_id, MODE: tl.constexpr, HAS_PSW: tl.constexpr, HAS_AT: tl.constexpr,
                    WEIGHTS: tl.constexpr, HAS_SKIP: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr):
    """Bag b = program 0, columns block = program 1: the pooled rows of the bag, row skip_id left
    out (EmbeddingBag's padding_idx; -1: none), into out[b] (HAS_AT: out's floats from at[b]).
    Sum and mean read TILE occurrences at a time (one [TILE, BLOCK] load, summed down: a chain of
    dependent loads per tile, not per occurrence). Max takes one occurrence at a time (the first
    of equal maxima wins, as on the CPU) and also writes saved[b, d], the argmax (the occurrence
    that gave the max, -1 for an empty bag); mean writes saved[b] = 1 / its rows (1 if none),
    the backward's scale."""
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < dim
    begin = tl.load(offsets_ptr + b)
    end = tl.load(offsets_ptr + b + 1)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if MODE == 2:
        best = tl.full([BLOCK], -1, dtype=tl.int64)
        for i in range(begin, end):
            u = tl.load(inverse_ptr + i)
            if tl.load(unique_ptr + u) != skip_id:
                row = load_weights(pool_ptr, tl.load(slots_ptr + u), cols, in_row, width, WEIGHTS)
                take = (best < 0) | (row > acc)
                acc = tl.where(take, row, acc)
                best = tl.where(take, i, best)
        tl.store(saved_ptr + b.to(tl.int64) * dim + cols, best, mask=in_row)
    else:
        count = 0.0
        for first in range(begin, end, TILE):
            k = first + tl.arange(0, TILE)
            live = k < end
            u = tl.load(inverse_ptr + k, mask=live, other=0)
            keep = live
            if HAS_SKIP:  # (a dependent load less per tile where no row is left out)
                keep = keep & (tl.load(unique_ptr + u, mask=live, other=0) != skip_id)
            slot = tl.load(slots_ptr + u, mask=keep, other=0)
            rows = load_weights(pool_ptr, slot[:, None], cols[None, :], keep[:, None] & in_row[None, :], width,
                                WEIGHTS)
            if HAS_PSW:
                rows = rows * tl.load(psw_ptr + k, mask=keep, other=0.0)[:, None]
            acc += tl.sum(rows, axis=0)
            count += tl.sum(keep.to(tl.float32), axis=0)
        if MODE == 1:
            inv = tl.math.div_rn(1.0, tl.maximum(count, 1.0))
            acc = acc * inv
            if tl.program_id(1) == 0:
                tl.store(saved_ptr + b, inv)
    tl.store(out_ptr + _out_row(at_ptr, b, dim, HAS_AT) + cols, acc, mask=in_row)


@triton.jit
def _out_row(at_ptr, b, dim, HAS_AT: tl.constexpr):
    """Where bag b's output row (or its gradient) starts: at[b], or b * dim (int64 either way: a
    compiled kernel's returns must agree in type, which the interpreter does not check)."""
    if HAS_AT:
        row = tl.load(at_ptr + b)
    else:
        row = b.to(tl.int64) * dim
    return row


def forward(pool: torch.Tensor, dim: int, slots: torch.Tensor, unique: torch.Tensor, inverse: torch.Tensor,
            offsets: torch.Tensor, psw: torch.Tensor | None, mode: int, skip_id: int, weights: int = 0,
            out: torch.Tensor | None = None, at: torch.Tensor | None = None):
    """The bags pooled (mode 0 sum, 1 mean, 2 max), row skip_id left out of every bag (-1: none);
    weights: the rows' weight type (optim.WEIGHT_TYPES): (out float32 [B, dim], saved: what the
    backward takes: for max the argmax, int64 [B, dim]; for mean 1 / each bag's rows, float32
    [B]; None for sum). out / at: the block to write and where each bag's row starts in it
    (int64 [B], in floats; several lookups side by side), instead of a new [B, dim]."""
    bags = offsets.numel() - 1
    if out is None:
        out = torch.empty(bags, dim, dtype=torch.float32, device=pool.device)
    saved = (torch.empty(bags, dim, dtype=torch.int64, device=pool.device) if mode == _MAX else
             torch.empty(bags, dtype=torch.float32, device=pool.device) if mode == _MEAN else None)
    if bags == 0:
        return out, saved
    block = min(128, triton.next_power_of_2(dim))
    with launch_turn():
        _forward_kernel[(bags, triton.cdiv(dim, block))](
            pool, slots, unique, inverse, offsets, psw if psw is not None else out, out,
            at if at is not None else offsets, saved if saved is not None else offsets, dim, pool.shape[1], skip_id,
            MODE=mode, HAS_PSW=psw is not None, HAS_AT=at is not None, WEIGHTS=weights, HAS_SKIP=skip_id >= 0,
            TILE=_tile(block, FORWARD_TILE), BLOCK=block, num_warps=FORWARD_WARPS)
    return out, saved


@triton.jit
def _psw_grad_kernel(pool_ptr, slots_ptr, unique_ptr, inverse_ptr, bag_ptr, grad_ptr, at_ptr, out_ptr, dim, width,
                     skip_id, HAS_AT: tl.constexpr, WEIGHTS: tl.constexpr, BLOCK: tl.constexpr):
    """Occurrence i: out[i] = <row of i, grad of its bag> (0 for row skip_id, and for an id after
    the last bag, which has no row: slot -1)."""
    i = tl.program_id(0)
    u = tl.load(inverse_ptr + i)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    slot = tl.load(slots_ptr + u)
    if (tl.load(unique_ptr + u) != skip_id) & (slot >= 0):
        g_base = _out_row(at_ptr, tl.load(bag_ptr + i), dim, HAS_AT)
        for start in range(0, dim, BLOCK):
            c = start + cols
            acc += load_weights(pool_ptr, slot, c, c < dim, width, WEIGHTS) * tl.load(grad_ptr + g_base + c,
                                                                                      mask=c < dim, other=0.0)
    tl.store(out_ptr + i, tl.sum(acc, axis=0))


def _tile(block: int, most: int) -> int:
    """Occurrences a kernel reads at once for rows of `block` columns: at most `most`, in a
    [TILE, BLOCK] load of at most 4096 floats."""
    return max(1, min(most, 4096 // block))


@triton.jit
def _tile_grad(order_ptr, first, end, sorted_bag_ptr, scale_ptr, grad_ptr, at_ptr, argmax_ptr, dim, cols, w,
               MODE: tl.constexpr, HAS_AT: tl.constexpr, SCALE: tl.constexpr, TILE: tl.constexpr):
    """The sum of the gradients of the occurrences at sorted positions first .. min(first + TILE,
    end) - 1 (occurrence i = order[k], of bag sorted_bag[k]: its bag's gradient times its scale:
    SCALE 0 none, 1 scale[i] (per-sample weights), 2 scale[bag] (mean: 1 / the bag's rows); for
    max only the columns it was the argmax of), read as one [TILE, BLOCK] tile and summed down (a
    fixed order). The bags are read by position, so the gradient rows wait on one load, not two;
    the occurrences themselves only for max and per-sample weights."""
    k = first + tl.arange(0, TILE)
    live = k < end
    bag = tl.load(sorted_bag_ptr + k, mask=live, other=0)
    m = live[:, None] & w[None, :]
    grad = tl.load(grad_ptr + _out_row(at_ptr, bag, dim, HAS_AT)[:, None] + cols[None, :], mask=m, other=0.0)
    if MODE == 2:
        i = tl.load(order_ptr + k, mask=live, other=0)
        won = tl.load(argmax_ptr + bag[:, None] * dim + cols[None, :], mask=m, other=-1) == i[:, None]
        grad = tl.where(won, grad, 0.0)
    elif SCALE == 1:
        i = tl.load(order_ptr + k, mask=live, other=0)
        grad = grad * tl.load(scale_ptr + i, mask=live, other=0.0)[:, None]
    elif SCALE == 2:
        grad = grad * tl.load(scale_ptr + bag, mask=live, other=0.0)[:, None]
    return tl.sum(grad, axis=0)


@triton.jit
def _chunk_kernel(sorted_ptr, order_ptr, start_ptr, chunk_ptr, unique_ptr, sorted_bag_ptr, scale_ptr, grad_ptr,
                  at_ptr, argmax_ptr, partial_ptr, n, dim, skip_id, frozen_id, MODE: tl.constexpr,
                  HAS_AT: tl.constexpr, SCALE: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr):
    """The sorted positions of window program 0 (TILE of them; occurrences sorted by unique row,
    sorted[p] the row of position p): each tile of a row with more than TILE occurrences that
    starts here (at start[u] + k * TILE) has its gradient sum stored in partial[chunk[u] + k]. So a
    hot row's occurrences (thousands in a Zipf batch) are summed by many programs side by side,
    and _update_kernel adds their partial sums. A window holds at most two such tile starts: a
    second row's can only be that row's first position (else the row would cover the window's
    start), and such a row runs past the window's end."""
    k = tl.program_id(0) * TILE + tl.arange(0, TILE)
    live = k < n
    u = tl.load(sorted_ptr + k, mask=live, other=0)
    first = tl.load(start_ptr + u, mask=live, other=0)
    end = tl.load(start_ptr + u + 1, mask=live, other=0)
    starts = live & ((k - first) % TILE == 0) & (end - first > TILE)
    p1 = tl.min(tl.where(starts, k, n), axis=0)
    p2 = tl.min(tl.where(starts & (k > p1), k, n), axis=0)
    cols = tl.arange(0, BLOCK)
    w = cols < dim
    for j in tl.static_range(2):
        p = p1 if j == 0 else p2
        if p < n:
            row = tl.load(sorted_ptr + p)
            uid = tl.load(unique_ptr + row)
            if (uid >= 0) & (uid != skip_id) & (uid != frozen_id):  # (-1: ids after the last bag)
                row_start = tl.load(start_ptr + row)
                g = _tile_grad(order_ptr, p, tl.load(start_ptr + row + 1), sorted_bag_ptr, scale_ptr, grad_ptr,
                               at_ptr, argmax_ptr, dim, cols, w, MODE, HAS_AT, SCALE, TILE)
                c = tl.load(chunk_ptr + row) + (p - row_start) // TILE
                tl.store(partial_ptr + c * dim + cols, g, mask=w)


# sr_seed is a 64-bit key, never a constant: Triton would compile a value of 1 in as a
# Python int, which has no .to().
@triton.jit(do_not_specialize=["sr_seed"])
def _update_kernel(pool_ptr, dirty_ptr, slots_ptr, unique_ptr, num_unique_ptr, order_ptr, start_ptr, chunk_ptr,
                   partial_ptr, sorted_bag_ptr, scale_ptr, grad_ptr, at_ptr, argmax_ptr, dim, dim_f, width,
                   weight_words, skip_id, frozen_id, lr, eps, one_minus_beta1, one_minus_beta2, adam_step_ptr, acc_div,
                   weight_decay, sr_seed, step_ptr, lr_ptr,
                   OPT: tl.constexpr, DECAY: tl.constexpr, MODE: tl.constexpr, HAS_AT: tl.constexpr,
                   SCALE: tl.constexpr, WEIGHTS: tl.constexpr, STOCHASTIC: tl.constexpr, LR_READ: tl.constexpr,
                   TILE: tl.constexpr, BLOCK: tl.constexpr):
    """Unique rows u = program 0, then a grid's stride apart, below U; for each, g = the sum of its
    occurrences' gradients (occurrences order[start[u]] .. order[start[u+1]-1], each the gradient
    of its bag times its scale (see _tile_grad); for max only the columns it was the argmax of; a
    bag's gradient is grad's row bag, or with HAS_AT its floats from at[bag]): one tile's sum for a
    row of at most TILE occurrences, else the sum of its tiles' partial sums (partial rows chunk[u]
    .. chunk[u+1]-1, _chunk_kernel's), TILE at a time, in order. Then the optimizer applied to its
    row in the pool, and the row marked dirty. Rows skip_id (left out of the bags) and frozen_id
    (the padding row) are left alone. 16-bit weights (WEIGHTS 1, 2) are updated in float32 and
    rounded back: to the nearest, or stochastically (STOCHASTIC). Every sum has a fixed order: the
    same bits from run to run. LR_READ: the rate is read from lr_ptr (a CUDA graph's, which serves
    every rate an LR schedule sets), else it is lr. DECAY: no weight decay (0), L2 (1: g +=
    weight_decay * w first), decoupled (2: w *= 1 - lr * weight_decay first)."""
    if LR_READ:
        lr = tl.load(lr_ptr)
    for u in range(tl.program_id(0), tl.load(num_unique_ptr), tl.num_programs(0)):
        uid = tl.load(unique_ptr + u)
        if (uid != skip_id) & (uid != frozen_id):
            cols = tl.arange(0, BLOCK)
            w = cols < dim
            first = tl.load(start_ptr + u)
            end = tl.load(start_ptr + u + 1)
            if end - first > TILE:
                g = tl.zeros([BLOCK], dtype=tl.float32)
                c_end = tl.load(chunk_ptr + u + 1)
                for c0 in range(tl.load(chunk_ptr + u), c_end, TILE):
                    c = c0 + tl.arange(0, TILE)
                    g += tl.sum(tl.load(partial_ptr + c[:, None] * dim + cols[None, :],
                                        mask=(c < c_end)[:, None] & w[None, :], other=0.0), axis=0)
            else:
                g = _tile_grad(order_ptr, first, end, sorted_bag_ptr, scale_ptr, grad_ptr, at_ptr, argmax_ptr, dim,
                               cols, w, MODE, HAS_AT, SCALE, TILE)
            slot = tl.load(slots_ptr + u)
            row = pool_ptr + slot * width + weight_words - dim  # the state: at row + dim + ...
            x = load_weights(pool_ptr, slot, cols, w, width, WEIGHTS)
            if DECAY == 1:
                g = g + weight_decay * x
            elif DECAY == 2:
                x = x * (1.0 - lr * weight_decay)
            if OPT == 0:  # SGD
                x = x - lr * g
            elif OPT == 1:  # Adagrad: a squared-gradient sum per element
                s = tl.load(row + dim + cols, mask=w, other=0.0) + g * g
                tl.store(row + dim + cols, s, mask=w)
                x = x - lr * tl.math.div_rn(g, tl.math.sqrt_rn(s) + eps)
            elif OPT == 2:  # row-wise Adagrad: one accumulator, the mean squared gradient (over acc_div: 1, or
                # momentum-scaled row-wise Adagrad's c)
                acc = tl.load(row + dim) + tl.math.div_rn(tl.sum(g * g, axis=0), dim_f)
                tl.store(row + dim, acc)
                x = x - tl.math.div_rn(lr, tl.math.sqrt_rn(tl.math.div_rn(acc, acc_div)) + eps) * g
            else:  # lazy Adam, torch.optim.SparseAdam's arithmetic
                m = tl.load(row + dim + cols, mask=w, other=0.0)
                v = tl.load(row + 2 * dim + cols, mask=w, other=0.0)
                numer = (g - m) * one_minus_beta1 + m
                vv = (g * g - v) * one_minus_beta2 + v
                tl.store(row + dim + cols, numer, mask=w)
                tl.store(row + 2 * dim + cols, vv, mask=w)
                x = x - tl.load(adam_step_ptr) * tl.math.div_rn(numer, tl.math.sqrt_rn(vv) + eps)
            if STOCHASTIC and WEIGHTS != 0:
                _store_stochastic(pool_ptr, slot, cols, x, w, width, uid, sr_seed, tl.load(step_ptr), WEIGHTS)
            else:
                store_weights(pool_ptr, slot, cols, x, w, width, WEIGHTS)
            tl.store(dirty_ptr + slot, 1)


@triton.jit
def _store_stochastic(pool_ptr, slot, cols, x, mask, width, row_id, sr_seed, step, WEIGHTS: tl.constexpr):
    """x (float32) into 16-bit weights, rounded stochastically: to the neighbour away from zero
    with probability the distance from the one toward zero over the gap. The random bits are the
    native kernels' (a function of sr_seed, the row id, the step and the column)."""
    key = _row_key(sr_seed.to(tl.uint64), row_id) + (step.to(tl.uint64) << 20) + cols.to(tl.uint64) + 1
    r = (_mix64(key) >> 32).to(tl.uint32)
    finite = tl.abs(x) < float("inf")
    if WEIGHTS == 2:
        bits = x.to(tl.uint32, bitcast=True)
        up = ((bits + (r >> 16)) & 0xFFFF0000) >> 16
        tl.store(pool_ptr.to(tl.pointer_type(tl.uint16)) + slot * width * 2 + cols,
                 tl.where(finite, up.to(tl.uint16), bf16_bits(x)), mask=mask)
    else:
        # All in 32 bits: hi as the bits of lo plus one, a 16-bit add, was compiled by ptxas (CUDA 12.8
        # and 12.9, Triton 3.6) to an add of 0 in one lane of four in the update for max pooling: every
        # fourth column rounded toward zero (bench/RESULTS.md, thirty-fourth session).
        lo = x.to(tl.float16, fp_downcast_rounding="rtz").to(tl.float32)
        lo_abs = tl.abs(lo)
        exponent = lo_abs.to(tl.uint32, bitcast=True) >> 23
        # a float16's gap at |lo|: 2^(exponent - 10), and 2^-24 below 2^-14 (subnormal); exact sums
        gap = ((tl.maximum(exponent, 113) - 10) << 23).to(tl.float32, bitcast=True)
        hi_abs = lo_abs + gap
        frac = tl.where(hi_abs <= 65504.0, tl.math.div_rn(tl.abs(x) - lo_abs, gap), 0.0)  # (hi infinite: lo)
        hi = (hi_abs.to(tl.uint32, bitcast=True) | (x.to(tl.uint32, bitcast=True) & 0x80000000)).to(
            tl.float32, bitcast=True)
        u = (r >> 8).to(tl.float32) * 5.9604644775390625e-08
        half = tl.where(finite, tl.where(u < frac, hi, lo), x).to(tl.float16)
        tl.store(pool_ptr.to(tl.pointer_type(tl.float16)) + slot * width * 2 + cols, half, mask=mask)


@triton.jit
def _bag_of(offsets_ptr, bags, q, live, steps, BLOCK: tl.constexpr):
    """The bag of each occurrence q (int64 [BLOCK]): the last b < bags with offsets[b] <= q, by a
    binary search of `steps` >= log2(bags) + 1 halvings (empty bags are skipped)."""
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = tl.zeros([BLOCK], dtype=tl.int64) + (bags - 1)
    for _ in range(steps):
        mid = (lo + hi + 1) // 2
        go = lo < hi
        at_or_before = tl.load(offsets_ptr + mid, mask=live & go, other=0) <= q
        lo = tl.where(go & at_or_before, mid, lo)
        hi = tl.where(go & ~at_or_before, mid - 1, hi)
    return lo


@triton.jit
def _prep_kernel(offsets_ptr, bags, order_ptr, start_ptr, n, sorted_bag_ptr, bag_ptr, tiles_ptr, chunk_ptr, steps,
                 BY_OCCURRENCE: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr):
    """Positions BLOCK * program 0 onwards, p < n, in up to three roles. Sorted position p:
    sorted_bag[p] = the bag of occurrence order[p]. Occurrence p (BY_OCCURRENCE: the per-sample
    weights' gradient reads it): bag[p] = its bag. Unique row p: tiles[p] = its tiles of TILE
    occurrences if it has more than TILE (start[p + 1] - start[p]), else 0. Program 0 sets
    chunk[0] = 0."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = p < n
    occurrence = tl.load(order_ptr + p, mask=live, other=0)
    tl.store(sorted_bag_ptr + p, _bag_of(offsets_ptr, bags, occurrence, live, steps, BLOCK), mask=live)
    if BY_OCCURRENCE:
        tl.store(bag_ptr + p, _bag_of(offsets_ptr, bags, p.to(tl.int64), live, steps, BLOCK), mask=live)
    count = tl.load(start_ptr + p + 1, mask=live, other=0) - tl.load(start_ptr + p, mask=live, other=0)
    tl.store(tiles_ptr + p, tl.where(count > TILE, (count + TILE - 1) // TILE, 0), mask=live)
    if tl.program_id(0) == 0:
        tl.store(chunk_ptr, 0)


_PREP_BLOCK = 256


def backward_update(pool: torch.Tensor, dirty: torch.Tensor, dim: int, slots: torch.Tensor, unique: torch.Tensor,
                    num_unique: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor, psw: torch.Tensor | None,
                    mode: int, skip_id: int, frozen_id: int, grad_out: torch.Tensor, saved: torch.Tensor | None,
                    optimizer, step: int, need_psw_grad: bool, weights: int = 0, stochastic_rounding: bool = False,
                    sr_seed: int = 0, at: torch.Tensor | None = None, groups: tuple | None = None,
                    scalars: tuple | None = None) -> torch.Tensor | None:
    """Applies the optimizer to every unique row the batch used but rows skip_id and frozen_id,
    with the gradients of duplicate ids summed first, and marks those rows dirty (dirty: uint8
    [slots]). num_unique: int64 [1] on the device (U). grad_out: [B, dim], or with at (int64 [B])
    a block holding bag b's gradient at its floats from at[b]. saved: the forward's (argmax for
    max, the bags' scales for mean). groups: the dedup's grouping of the occurrences
    (gpu/dedup.py), or None to sort for it here. scalars: what changes from step to step, as
    device tensors the kernel reads (a CUDA graph of this call then serves every step, its
    caller filling them: gpu/graphed.py): step_scalars' (Adam's step size, the step, the rate);
    None: made here from optimizer and step (the rate then passed as a number). Returns the per-sample weights' gradient when
    asked."""
    n, bags, dev = inverse.numel(), offsets.numel() - 1, pool.device
    if n == 0:
        return torch.empty(0, dtype=torch.float32, device=dev) if need_psw_grad else None
    grad_out = grad_out.to(dev, torch.float32).contiguous()
    at_arg = at if at is not None else offsets
    block = triton.next_power_of_2(dim)
    if groups is not None:  # the dedup's
        order, sorted_u, start = groups
    else:
        sorted_u, order = torch.sort(inverse, stable=True)  # occurrences grouped by unique row, in occurrence order
        start = torch.zeros(n + 1, dtype=torch.int64, device=dev)
        per_unique = torch.zeros(n, dtype=torch.int64, device=dev).index_add_(0, inverse, torch.ones_like(inverse))
        torch.cumsum(per_unique, 0, out=start[1:])  # (bincount would wait for the device to size its output)
    # Each occurrence's bag, and the tiles of the rows of more than `tile` occurrences: those are
    # summed a tile per program first (_chunk_kernel), their tiles' partial sums in rows chunk[u] ..
    # chunk[u + 1] - 1 of partial. Such rows number fewer than n / tile, and each has at most its
    # occurrences / tile + 1 tiles.
    tile = _tile(block, UPDATE_TILE)
    sorted_bag, tiles = torch.empty(n, dtype=torch.int64, device=dev), torch.empty(n, dtype=torch.int64, device=dev)
    bag_of = torch.empty(n, dtype=torch.int64, device=dev) if need_psw_grad else sorted_bag  # (else not written)
    chunk = torch.empty(n + 1, dtype=torch.int64, device=dev)
    with launch_turn():
        _prep_kernel[(triton.cdiv(n, _PREP_BLOCK),)](offsets, bags, order, start, n, sorted_bag, bag_of, tiles, chunk,
                                                     max(bags, 1).bit_length() + 1, BY_OCCURRENCE=need_psw_grad,
                                                     TILE=tile, BLOCK=_PREP_BLOCK)
    psw_grad = None
    if need_psw_grad:
        psw_grad = torch.empty(n, dtype=torch.float32, device=dev)
        with launch_turn():
            _psw_grad_kernel[(n,)](pool, slots, unique, inverse, bag_of, grad_out, at_arg, psw_grad, dim,
                                   pool.shape[1], skip_id, HAS_AT=at is not None, WEIGHTS=weights,
                                   BLOCK=min(block, 128))
    # each occurrence's gradient scaled by its per-sample weight, or for mean by its bag's saved scale
    scale_kind = 1 if psw is not None else 2 if mode == _MEAN else 0
    scale = psw.to(dev, torch.float32) if psw is not None else saved if mode == _MEAN else grad_out
    argmax_arg = saved if mode == _MAX else order
    partial = grad_out  # (not read when no row has more than a tile of occurrences)
    if n > tile:  # (no row has more occurrences than the batch)
        torch.cumsum(tiles, 0, out=chunk[1:])
        partial = torch.empty(2 * triton.cdiv(n, tile) + 1, dim, dtype=torch.float32, device=dev)
        with launch_turn():
            _chunk_kernel[(triton.cdiv(n, tile),)](sorted_u, order, start, chunk, unique, sorted_bag, scale,
                                                   grad_out, at_arg, argmax_arg, partial, n, dim, skip_id, frozen_id,
                                                   MODE=mode, HAS_AT=at is not None, SCALE=scale_kind, TILE=tile,
                                                   BLOCK=block)
    a = optimizer.native_args(step)
    lr_read = scalars is not None  # (a caller's scalars hold the rate too)
    if scalars is None:
        if step_dependent(optimizer, stochastic_rounding):
            scalars = step_scalars(dev)
            fill_step_scalars(scalars, a.adam_step_size, step)
        else:  # (never read)
            scalars = _unread_scalars(dev)
    with launch_turn():
        _update_kernel[(programs(n, UPDATE_PROGRAMS, pool.device),)](
            pool, dirty, slots, unique, num_unique, order, start, chunk, partial, sorted_bag, scale, grad_out, at_arg,
            argmax_arg, dim, float(dim), pool.shape[1], dim if weights == 0 else (dim + 1) // 2, skip_id, frozen_id,
            a.lr, a.eps, a.one_minus_beta1, a.one_minus_beta2, scalars[0], a.accumulator_divisor, a.weight_decay,
            sr_seed, scalars[1], scalars[2], OPT=optimizer.kind,
            DECAY=0 if not a.weight_decay else 2 if a.decoupled_weight_decay else 1,
            MODE=mode, HAS_AT=at is not None, SCALE=scale_kind, WEIGHTS=weights, STOCHASTIC=stochastic_rounding,
            LR_READ=lr_read, TILE=tile, BLOCK=block, num_warps=UPDATE_WARPS)
    return psw_grad


def step_dependent(optimizer, stochastic_rounding: bool) -> bool:
    """Whether the update kernel reads backward_update's scalars (Adam, or stochastic rounding)."""
    return optimizer.kind == 3 or stochastic_rounding


_UNREAD: dict = {}


def _unread_scalars(device) -> tuple:
    """step_scalars of the device, made once, for calls whose kernel reads none."""
    key = str(device)
    if key not in _UNREAD:
        _UNREAD[key] = step_scalars(device)
    return _UNREAD[key]


def step_scalars(device) -> tuple:
    """Device tensors for backward_update's scalars: (Adam's step size float32 [1], the step
    int64 [1], the learning rate float32 [1])."""
    return (torch.empty(1, dtype=torch.float32, device=device), torch.empty(1, dtype=torch.int64, device=device),
            torch.empty(1, dtype=torch.float32, device=device))


def fill_step_scalars(scalars: tuple, adam_step_size: float, step: int) -> None:
    """Fills step_scalars' step tensors on the current stream (a fill kernel each: no copy from
    the host, nothing waits)."""
    scalars[0].fill_(adam_step_size)
    scalars[1].fill_(step)
