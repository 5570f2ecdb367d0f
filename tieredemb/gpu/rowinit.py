"""The initial value of a row never written, computed on the device: a Triton port of
native/kernels/random.cc, bit for bit (see random.h for why it is reproducible everywhere).

Only integer hashing, IEEE +, -, *, correctly rounded / and sqrt (div_rn, sqrt_rn), and the same
polynomials in the same order; the kernel is compiled without fused multiply-adds
(enable_fp_fusion=False), as random.cc is built with -ffp-contract=off. So a row reads the same
whether a CPU or a GPU initialized it, and a 10^9-row table on a GPU is created in O(1): each row
is drawn when it is first missed.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from . import PerMultiprocessor, launch_turn, programs

_GAMMA = 0x9E3779B97F4A7C15


@triton.jit
def _mix64(x):
    """The splitmix64 output function (a bijection of uint64)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _row_key(seed, row_id):
    """random.cc's row_key: splitmix64(seed ^ splitmix64(id + c)), with splitmix64(x) = mix64(x + gamma)."""
    inner = _mix64(row_id.to(tl.uint64, bitcast=True) + 0x632BE59BD9B4E019 + 0x9E3779B97F4A7C15)
    return _mix64((seed ^ inner) + 0x9E3779B97F4A7C15)


@triton.jit
def _unit_float(k):
    """An int32 value as float32 (exact below 2^24)."""
    return k.to(tl.int32, bitcast=True).to(tl.float32)


@triton.jit
def _neg2_log_u24(m):
    """-2 ln(m / 2^24) for m in [1, 2^24] (uint32), as random.cc's neg2_log_u24."""
    ix = _unit_float(m).to(tl.uint32, bitcast=True) - 0x3F3504F3
    dk = ((ix >> 23).to(tl.int32, bitcast=True) - 24).to(tl.float32)
    f = ((ix & 0x007FFFFF) + 0x3F3504F3).to(tl.float32, bitcast=True) - 1.0
    s = tl.math.div_rn(f, 2.0 + f)
    z = s * s
    w = z * z
    r = z * (0.6666666269302368 + w * 0.2849878668785095) + w * (0.40000972151756287 + w * 0.24279078841209412)
    hfsq = 0.5 * f * f
    log_u = dk * 0.6931381225585938 - ((hfsq - (s * (hfsq + r) + dk * 9.05800061445916e-06)) - f)
    return -2.0 * log_u


@triton.jit
def _cos_sin_u24(b):
    """(cos a, sin a) of the angle given by the 24-bit uniform b (uint32), as random.cc's cos_sin_u24."""
    q = b >> 22
    t = ((b & 0x3FFFFF).to(tl.int32, bitcast=True) - 0x200000).to(tl.float32) * 3.7450703871400037e-07
    z = t * t
    # (the float32 values of random.cc's literals, written exactly)
    s = ((-0.00019515295571181923 * z + 0.008332161232829094) * z - 0.16666655242443085) * z * t + t
    c = ((2.44331567955669e-05 * z - 0.0013887316454201937) * z + 0.04166664555668831) * z * z - 0.5 * z + 1.0
    swap = (q & 1) != 0
    x = tl.where(swap, s, c)
    y = tl.where(swap, c, s)
    cos = (x.to(tl.uint32, bitcast=True) ^ ((((q + 1) >> 1) & 1) << 31)).to(tl.float32, bitcast=True)
    sin = (y.to(tl.uint32, bitcast=True) ^ ((q >> 1) << 31)).to(tl.float32, bitcast=True)
    return cos, sin


@triton.jit
def load_weights(pool_ptr, row, cols, mask, width, WEIGHTS: tl.constexpr):
    """Weights cols of pool row `row` (words of width) as float32: WEIGHTS 0 float32, 1 float16,
    2 bfloat16 (16-bit weights two to a word, weight d at half-word 2 * row * width + d)."""
    if WEIGHTS == 0:
        return tl.load(pool_ptr + row * width + cols, mask=mask, other=0.0)
    elif WEIGHTS == 1:
        return tl.load(pool_ptr.to(tl.pointer_type(tl.float16)) + row * width * 2 + cols, mask=mask,
                       other=0.0).to(tl.float32)
    else:
        bits = tl.load(pool_ptr.to(tl.pointer_type(tl.uint16)) + row * width * 2 + cols, mask=mask, other=0)
        return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def store_weights(pool_ptr, row, cols, value, mask, width, WEIGHTS: tl.constexpr):
    """Stores float32 weights into pool row `row`, rounded to the nearest (even) 16-bit value if
    WEIGHTS is 1 (float16) or 2 (bfloat16)."""
    if WEIGHTS == 0:
        tl.store(pool_ptr + row * width + cols, value, mask=mask)
    elif WEIGHTS == 1:
        tl.store(pool_ptr.to(tl.pointer_type(tl.float16)) + row * width * 2 + cols, value.to(tl.float16), mask=mask)
    else:
        tl.store(pool_ptr.to(tl.pointer_type(tl.uint16)) + row * width * 2 + cols, bf16_bits(value), mask=mask)


@triton.jit
def bf16_bits(x):
    """float32 -> the bits of the nearest (even) bfloat16 (NaN stays a NaN)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, (bits >> 16) | 0x40, rounded).to(tl.uint16)


@triton.jit
def init_row(out_ptr, dst, row_id, dim, width, weight_words, seed, kind, a, b, below_high, zero_id,
             WEIGHTS: tl.constexpr, BLOCK: tl.constexpr):
    """The initial row of row_id into out[dst]: the dim weights drawn (kind 0 normal(a, b), 1
    uniform [a, b), 2 zeros; row zero_id zeros) in float32 and stored as WEIGHTS (0 float32, 1
    float16, 2 bfloat16, rounded to the nearest), the rest of the row zero. seed: uint64."""
    key = _row_key(seed, row_id)
    zero = (kind == 2) | (row_id == zero_id)
    for start in range(0, dim, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        pair = (cols // 2).to(tl.uint64)
        h = _mix64(key + (pair + 1) * 0x9E3779B97F4A7C15)
        hi = (h >> 40).to(tl.uint32)
        lo = ((h >> 8) & 0xFFFFFF).to(tl.uint32)
        even = (cols % 2) == 0
        if kind == 1:
            u = _unit_float(tl.where(even, hi, lo)) * 5.9604644775390625e-08  # k / 2^24
            v = a + (b - a) * u
            value = tl.where(v < below_high, v, below_high)
        else:
            r = tl.math.sqrt_rn(_neg2_log_u24(hi + 1))
            cos, sin = _cos_sin_u24(lo)
            value = a + b * (r * tl.where(even, cos, sin))
        store_weights(out_ptr, dst, cols, tl.where(zero == 0, value, 0.0), cols < dim, width, WEIGHTS)
    if WEIGHTS != 0:  # an odd dim's last half-word
        pad = dim + tl.arange(0, 2)
        store_weights(out_ptr, dst, pad, tl.zeros([2], dtype=tl.float32), pad < 2 * weight_words, width, WEIGHTS)
    for start in range(weight_words, width, BLOCK):  # the optimizer state
        cols = start + tl.arange(0, BLOCK)
        tl.store(out_ptr + dst * width + cols, tl.zeros([BLOCK], dtype=tl.float32), mask=cols < width)


@triton.jit
def init_chunk(out_ptr, dst, row_id, todo, dim, width, weight_words, seed, kind, a, b, below_high, zero_id,
               WEIGHTS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """The initial rows of row_id[j] into out[dst[j]] where todo[j] (vectors of CHUNK), one after
    the other: each taken out of the vectors by a sum over the one lane it is in, so a program
    reads its chunk's ids and rows at once and no thread waits on memory for the next."""
    lanes = tl.arange(0, CHUNK)
    if tl.max(todo.to(tl.int32), axis=0) > 0:  # (a chunk of rows held already: nothing to take out)
        for j in range(0, CHUNK):
            d = tl.sum(tl.where((lanes == j) & todo, dst + 1, 0), axis=0) - 1
            if d >= 0:
                init_row(out_ptr, d, tl.sum(tl.where(lanes == j, row_id, 0), axis=0), dim, width, weight_words,
                         seed, kind, a, b, below_high, zero_id, WEIGHTS, BLOCK)


# seed is a 64-bit key, never a constant: Triton would compile a seed of 1 in as a Python int,
# which has no .to().
@triton.jit(do_not_specialize=["seed"])
def _init_rows_kernel(ids_ptr, out_ptr, rows_ptr, n, count_ptr, dim, width, weight_words, seed, kind, a, b,
                      below_high, zero_id, mark, HAS_ROWS: tl.constexpr, MARKED: tl.constexpr, COUNTED: tl.constexpr,
                      WEIGHTS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Rows i of the batch, CHUNK at a time from CHUNK * program 0 on, a grid's stride apart: the
    initial row of ids[i] into out[rows[i]] (out[i] without rows; rows[i] < 0: none; MARKED: only
    if that row's first word, as an int32, is mark; COUNTED: only for i < count[0])."""
    end = tl.minimum(n, tl.load(count_ptr)) if COUNTED else n
    for base in range(tl.program_id(0) * CHUNK, end, tl.num_programs(0) * CHUNK):
        i = base + tl.arange(0, CHUNK)
        live = i < end
        row_id = tl.load(ids_ptr + i, mask=live, other=0)
        dst = tl.load(rows_ptr + i, mask=live, other=-1) if HAS_ROWS else i.to(tl.int64)
        todo = live & (dst >= 0)
        if MARKED:
            todo = todo & (tl.load(out_ptr + dst * width, mask=todo, other=0).to(tl.int32, bitcast=True) == mark)
            # Every thread has read its marks before any row is drawn (word 0 is a weight's): else
            # a lane that reads late sees a drawn weight and leaves its row undrawn.
            tl.debug_barrier()
        init_chunk(out_ptr, dst, row_id, todo, dim, width, weight_words, seed.to(tl.uint64), kind, a, b,
                   below_high, zero_id, WEIGHTS, CHUNK, BLOCK)


# Rows an init program reads at once, and its programs (gpu.programs): the chunks taken a grid's
# stride apart. Not yet measured on a GPU (before: one program per row). Small chunks, as
# plan_kernels.DRAW_CHUNK: here most rows of a chunk may be drawn (a tier's misses never stored),
# one after the other, and 16K misses in chunks of 8 are 2K warps at work, in chunks of 64 only 250.
INIT_CHUNK = 8
INIT_PROGRAMS = PerMultiprocessor(32)


def kernel_args(dim: int, width: int, kind: int, a: float, b: float, weights: int) -> dict:
    """init_row's arguments that depend on the table alone (besides dim, width, kind, and seed and
    zero_id): a and b as float32, the largest float32 below b (uniform draws stay below it), the
    weights' words, and the block of columns."""
    a32, b32 = np.float32(a), np.float32(b)
    words = dim if weights == 0 else (dim + 1) // 2
    return dict(weight_words=words, a=float(a32), b=float(b32),
                below_high=float(np.nextafter(b32, a32)) if kind == 1 else 0.0,
                BLOCK=min(256, triton.next_power_of_2(max(dim, width - words, 1))))


def init_rows(ids: torch.Tensor, out: torch.Tensor, rows: torch.Tensor | None, dim: int, kind: int, a: float,
              b: float, seed: int, zero_id: int, weights: int = 0, *, marked: int | None = None,
              count: torch.Tensor | None = None) -> None:
    """The initial rows of ids (int64 [n], on out's device) into out (float32 [*, width] words) at
    rows (int64 [n]; entries < 0 are skipped; None: rows 0..n-1); with marked (an int32), only
    those rows whose first word is marked. Arguments as RowInit's (weights: the weights' type
    code): bit for bit the native init_rows'. count (an int64 on the device): only the first
    count[0] of the n (no wait for the count)."""
    n = ids.numel()
    if n == 0:
        return
    width = out.shape[1]
    with launch_turn():  # (one warp a program, as the whole table's draw: plan_kernels.draw)
        _init_rows_kernel[(programs(triton.cdiv(n, INIT_CHUNK), INIT_PROGRAMS, out.device),)](
            ids, out, rows if rows is not None else ids, n, ids if count is None else count, dim, width, seed=seed,
            kind=kind, zero_id=zero_id, mark=0 if marked is None else marked, HAS_ROWS=rows is not None,
            MARKED=marked is not None, COUNTED=count is not None, WEIGHTS=weights, CHUNK=INIT_CHUNK,
            enable_fp_fusion=False, num_warps=1, **kernel_args(dim, width, kind, a, b, weights))
