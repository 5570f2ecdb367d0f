"""Reuse analysis of a trace: LRU stack distances, and from them the exact LRU hits at every cache
size in one pass (Mattson et al. 1970); tieredemb.sim's LRU curve and one-size LRU tier build on
the same recency times (renumber, scratch).

Stack distances in O(N log D): every touch of a key takes the next time, and the distance
of a reuse is the number of live times (each key's latest) after the key's previous time. Every
time below `now` was taken by exactly one touch, so live times up to t = t + 1 - dead times up to
t: only deaths (a key's previous time, at each reuse) are recorded, as bits (64 times per word)
under levels of counts: level k has an entry per 16^k words, the dead times in the entries before
it in its group of 16. Counting the deaths up to t is then a load per level, and recording one a
16-lane vector add per level (4 levels for 3M times), on about D/30 entries that stay in cache.
Times are renumbered (live ones packed to the front) whenever they run out: memory is O(D).

Batch mode follows the engine: a batch's unique keys are touched in first-occurrence order after
the whole batch is looked up, so every key of batch t is measured against the recency order as of
the start of batch t, and a key's repeats inside its batch are not lookups of the cache at all.
In request mode every lookup is its own batch: looked up and touched at once.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.cpython.unsafe.numbers import leading_zeros
from numba.extending import intrinsic

from .keys import check_keys, check_offsets, compact
from .jit import inline, kernel, popcount, prefetch

FIRST_USE = -1
DUPLICATE = -2  # batch mode: a repeat of a key earlier in the same batch (not a cache lookup)
_AHEAD = 16     # lookups: prefetch distance for the per-key table
_FB = 4         # count levels: groups of _F = 2^_FB entries
_F = 1 << _FB
_LEVELS = 8     # at most: windows up to 16^8 words (2^38 times)
_M = 10         # histogram bins: distances below 2^_M by a table, longer ones by buckets < 2^-(_M-1) of d wide


@intrinsic
def _add_after(typingctx, arr, base, lo):
    """arr[base + j] += 1 for lo < j < _F: one vector add over a group of counts."""
    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
        elt = context.get_data_type(aryty.dtype)
        vty = ir.VectorType(elt, _F)
        vptr = builder.bitcast(ptr, vty.as_pointer())
        lo = builder.trunc(args[2], elt) if elt.width < 64 else args[2]
        lo = builder.insert_element(ir.Constant(vty, ir.Undefined), lo, ir.Constant(ir.IntType(32), 0))
        lo = builder.shuffle_vector(lo, ir.Constant(vty, ir.Undefined),  # broadcast
                                    ir.Constant(ir.VectorType(ir.IntType(32), _F), [0] * _F))
        inc = builder.zext(builder.icmp_signed(">", ir.Constant(vty, list(range(_F))), lo), vty)
        builder.store(builder.add(builder.load(vptr, align=elt.width // 8), inc), vptr, align=elt.width // 8)
        return context.get_dummy_value()
    return numba.types.void(arr, base, lo), codegen


@inline
def _level_size(words, k):
    """Entries of level k for `words` words (one per 16^k words), a whole number of groups."""
    return ((words >> (_FB * k)) | (_F - 1)) + 1


@inline
def _levels(words):
    """Count levels for a window of `words` words: as many as make the top one a single group."""
    k = 1
    while 1 << (_FB * k) < words:
        k += 1
    return k


@inline
def _dead_upto(dead, tree, levels, t):
    """Dead times among 0..t."""
    w = t >> 6
    s = np.int64(popcount(dead[w] << np.uint64(63 - (t & 63))))  # bits 0..t&63
    off = 0
    for k in range(_LEVELS):  # a fixed count unrolls; level k lies at off, after the levels below
        if k < levels:
            s += tree[off + (w >> (_FB * k))]
            off += _level_size(dead.size, k)
    return s


@inline
def _kill(dead, tree, levels, t):
    """Time t is no longer a key's latest."""
    w = t >> 6
    dead[w] |= np.uint64(1) << np.uint64(t & 63)
    off = 0
    for k in range(_LEVELS):
        if k < levels:
            i = w >> (_FB * k)
            _add_after(tree, off + (i & ~(_F - 1)), i & (_F - 1))
            off += _level_size(dead.size, k)


@kernel
def renumber(last, owner, dead, now, words):
    """Packs the live times below now (in order) to 0..t-1 within a window of `words` words, with
    no deaths recorded. Returns t."""
    t = 0
    for w in range((now + 63) >> 6):
        x = ~dead[w]
        if (w + 1) << 6 > now:  # times at and after now were never taken
            x &= (np.uint64(1) << np.uint64(now & 63)) - np.uint64(1)
        while x:
            b = np.int64(popcount((x & -x) - np.uint64(1)))  # index of the lowest set bit
            x &= x - np.uint64(1)
            o = owner[(w << 6) + b]
            last[o] = t
            owner[t] = o
            t += 1
    dead[:words] = 0
    return t


@kernel
def _window(last, owner, dead, tree, now, live):
    """A window of times for 2*live + 2 (at least 1024), the live ones renumbered into it, no
    deaths counted. Returns (now, words, levels)."""
    words = min(dead.size, (max(1024, 2 * live + 2) + 63) >> 6)
    if now:
        now = renumber(last, owner, dead, now, words)
    else:
        dead[:] = 0
    levels, off = _levels(words), 0
    for k in range(levels):
        tree[off:off + _level_size(words - 1, k)] = 0
        off += _level_size(dead.size, k)
    return now, words, levels


@inline
def _touch(k, last, owner, dead, tree, now, words, levels, live):
    """Key k takes the next time. Returns (now, words, levels, live)."""
    if now == words << 6:  # out of times
        now, words, levels = _window(last, owner, dead, tree, now, live)
    p = last[k]
    if p >= 0:
        _kill(dead, tree, levels, p)
    else:
        live += 1
    owner[now] = k
    last[k] = now
    return now + 1, words, levels, live


@inline
def _bin(d, top, lut, sizes):
    """The number of sizes <= d (>= 0): the table's count at the start of d's bucket, then a step
    per size inside the bucket before d (rare: buckets are narrow)."""
    d = min(d, top)
    s = max(0, 64 - np.int64(leading_zeros(np.uint64(d))) - _M)
    j = np.int64(lut[(s << _M) + (d >> s)])
    while sizes[j] <= d:
        j += 1
    return j


@kernel
def _lru_pass(keys, offsets, per_request, last, seen, owner, dead, tree, out, lut, sizes, hist, count_from):
    """One pass of LRU stack distances. out [N] (or size 0): each lookup's distance.
    hist [m+2] (or size 0): per lookup of batch (request mode: request) count_from on, +1 at j =
    the number of the m cache sizes <= its distance (first use: j = m; repeats inside a batch:
    j = m+1); a cache of sizes[i] rows then hits sum(hist[:i+1]) of those lookups (the batches
    before count_from only warm it). sizes: ascending, then int64 max; lut: _bin's table (lru_hits).
    Scratch: last/seen [D], owner [>= 2D+2 times], dead [words], tree (scratch)."""
    n = keys.size
    write_out = out.size == n
    m = hist.size - 2
    top = sizes[m - 1] if m > 0 else 0
    last[:] = -1
    seen[:] = -1
    live = 0
    now, words, levels = _window(last, owner, dead, tree, 0, 0)
    nbatches = n if per_request else offsets.size - 1
    for b in range(nbatches):
        s = b if per_request else offsets[b]
        e = b + 1 if per_request else offsets[b + 1]
        counted = m >= 0 and b >= count_from
        for i in range(s, e):  # 1. every key against the order at the batch start
            if i + _AHEAD < n:
                prefetch(last, keys[i + _AHEAD])
            k = keys[i]
            if not per_request:
                if seen[k] == b:
                    if write_out:
                        out[i] = DUPLICATE
                    if counted:
                        hist[m + 1] += 1
                    continue
                seen[k] = b
            p = last[k]
            d = FIRST_USE if p < 0 else live - p - 1 + _dead_upto(dead, tree, levels, p)
            if write_out:
                out[i] = d
            if counted:
                hist[m if d < 0 else _bin(d, top, lut, sizes)] += 1
            if per_request:
                now, words, levels, live = _touch(k, last, owner, dead, tree, now, words, levels, live)
        if not per_request:
            for i in range(s, e):  # 2. touch the unique keys in first-occurrence order
                k = keys[i]
                if seen[k] == b:  # not a repeat: those were touched already in this batch
                    seen[k] = -2 - b
                    now, words, levels, live = _touch(k, last, owner, dead, tree, now, words, levels, live)


def scratch(nkeys: int, n: int, per_request: bool):
    """last [D], owner [times], dead [words] and the count levels (tree) for the largest window,
    as int32 while times and keys fit (half the memory traffic of the per-key table, which is
    what the pass waits on), else int64."""
    times = max(1024, 2 * min(nkeys, n) + 2)  # distinct keys <= min(D, N)
    words = (times + 63) // 64 + 1
    levels = _levels(words)
    if levels > _LEVELS:
        raise ValueError(f"{nkeys} keys need {levels} count levels, more than the {_LEVELS} the pass unrolls")
    tree = sum(_level_size(words, k) for k in range(levels))
    small = np.int32 if max(nkeys, words * 64) < 2**31 else np.int64
    return (np.empty(nkeys, small), np.empty(1 if per_request else nkeys, np.int64), np.empty(words * 64, small),
            np.empty(words, np.uint64), np.empty(tree, small))


def lru_hits(dense: np.ndarray, offsets: np.ndarray | None, nkeys: int, sizes: np.ndarray,
             count_from: int = 0) -> np.ndarray:
    """Exact LRU hits at each of `sizes` (ascending int64, > 0) in one pass: dense keys in
    [0, nkeys); offsets None for request mode. Hits of batch (request mode: request) count_from
    on: the ones before only warm the cache. Returns int64 [m]."""
    hist = np.zeros(sizes.size + 2, np.int64)
    if dense.size:
        shifts = np.arange(max(0, int(sizes[-1]).bit_length() - _M) + 1)[:, None]
        starts = (np.arange(1 << _M)[None, :] << shifts).ravel()  # bucket (s, x) holds d with d >> s == x
        lut = np.searchsorted(sizes, starts, "right").astype(np.min_scalar_type(sizes.size))
        per_request = offsets is None
        _lru_pass(dense, np.zeros(1, np.int64) if per_request else offsets, per_request,
                  *scratch(nkeys, dense.size, per_request), np.empty(0, np.int64), lut,
                  np.append(sizes, np.iinfo(np.int64).max), hist, int(count_from))
    return np.cumsum(hist[:sizes.size])


@kernel
def _count_distinct(keys, bits):
    bits[:] = 0
    n = 0
    for k in keys:  # branch-free: whether a key is new is a coin toss to the predictor
        bit = np.uint64(1) << np.uint64(k & 63)
        x = bits[k >> 6]
        n += (x & bit) == 0
        bits[k >> 6] = x | bit
    return n


def distinct_keys(dense: np.ndarray, nkeys: int) -> int:
    """Number of distinct values among dense keys in [0, nkeys) (a bit per key: stays in cache)."""
    return int(_count_distinct(dense, np.empty((max(nkeys, 1) + 63) // 64, np.uint64))) if dense.size else 0


@kernel
def _batch_widths(keys, offsets, seen, out):
    seen[:] = -1
    for b in range(offsets.size - 1):
        u = 0
        for i in range(offsets[b], offsets[b + 1]):
            if seen[keys[i]] != b:
                seen[keys[i]] = b
                u += 1
        out[b] = u


def batch_widths(dense: np.ndarray, offsets: np.ndarray, nkeys: int) -> np.ndarray:
    """int64 [B]: distinct keys of each batch (dense keys in [0, nkeys))."""
    out = np.zeros(offsets.size - 1, np.int64)
    if dense.size:
        _batch_widths(dense, offsets, np.empty(max(nkeys, 1), np.int64), out)
    return out


def stack_distances(keys, batch_offsets=None) -> np.ndarray:
    """keys: int64 [N] (>= 0); batch_offsets: int64 [B+1] or None (every lookup its own request).

    Returns int64 [N]: per lookup, the number of distinct other keys used since the key's last
    use (-1 = FIRST_USE). With batch_offsets the distance is taken against the recency order at
    the start of the lookup's batch, and a repeat inside the same batch is DUPLICATE (-2).
    An LRU cache of C rows hits a lookup iff 0 <= distance < C (in batch mode too: the engine's
    LRU is a stack algorithm).
    """
    keys = check_keys(keys)
    dense, nkeys, _ = compact(keys)
    per_request = batch_offsets is None
    offsets = np.zeros(1, np.int64) if per_request else check_offsets(batch_offsets, keys.size)
    out = np.empty(keys.size, np.int64)
    if keys.size:
        _lru_pass(dense, offsets, per_request, *scratch(nkeys, keys.size, per_request), out,
                  np.empty(0, np.uint8), np.empty(0, np.int64), np.empty(0, np.int64), 0)
    return out
