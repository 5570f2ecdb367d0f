"""LRU stack distances in O(N log D): every touch of a key takes the next time, and the distance
of a reuse is the number of live times (each key's latest) after the key's previous time. Every
time below `now` was taken by exactly one touch, so live times up to t = t + 1 - dead times up to
t: only deaths (a key's previous time, at each reuse) are recorded, as bits (64 times per word)
under a Fenwick tree of per-word counts, D/32 entries that stay in cache. Times are renumbered
(live ones packed to the front) whenever they run out: memory is O(D).

Batch mode follows the engine: a batch's unique keys are touched in first-occurrence order after
the whole batch is looked up, so every key of batch t is measured against the recency order as of
the start of batch t, and a key's repeats inside its batch are not lookups of the cache at all.
"""

from __future__ import annotations

import numpy as np

from .keys import check_keys, check_offsets, compact
from .state import kernel, popcount, prefetch

FIRST_USE = -1
DUPLICATE = -2  # batch mode: a repeat of a key earlier in the same batch (not a cache lookup)
_AHEAD = 16     # lookups: prefetch distance for the per-key table


@kernel
def _live_upto(dead, tree, t):
    """Live times among 0..t."""
    w = t >> 6
    s = 0
    i = w  # Fenwick prefix over words 0..w-1 (tree is 1-based)
    while i > 0:
        s += tree[i]
        i -= i & -i
    r = t & 63
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) if r == 63 else (np.uint64(1) << np.uint64(r + 1)) - np.uint64(1)
    return t + 1 - s - np.int64(popcount(dead[w] & mask))


@kernel
def _kill(dead, tree, t):
    """Time t is no longer a key's latest."""
    w = t >> 6
    dead[w] |= np.uint64(1) << np.uint64(t & 63)
    i = w + 1
    while i < tree.size:
        tree[i] += 1
        i += i & -i


@kernel
def _renumber(last, owner, dead, now, words):
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
def _lru_pass(keys, offsets, per_request, last, seen, owner, dead, tree, out, lut, sizes, hist):
    """One pass of LRU stack distances. out [N] (or size 0): each lookup's distance.
    hist [m+2] (or size 0): per lookup, +1 at j = the number of the m cache sizes <= its distance
    (first use: j = m; repeats inside a batch: j = m+1); a cache of sizes[i] rows then hits
    sum(hist[:i+1]) lookups. j is lut[d] for d < lut.size (a table: most distances are short),
    else a branch-free binary search of sizes (ascending, padded to 2^x with int64 max).
    Scratch: last/seen [D], owner [>= 2D+2 times], dead [words], tree [words+1]."""
    n = keys.size
    write_out = out.size == n
    m = hist.size - 2
    last[:] = -1
    seen[:] = -1
    max_words = dead.size
    words = min(16, max_words)
    cap = words * 64
    dead[:] = 0
    tree[:] = 0
    now, live = 0, 0
    nbatches = n if per_request else offsets.size - 1
    for b in range(nbatches):
        s = b if per_request else offsets[b]
        e = b + 1 if per_request else offsets[b + 1]
        for i in range(s, e):  # 1. every key against the order at the batch start
            if i + _AHEAD < n:
                prefetch(last, keys[i + _AHEAD])
            k = keys[i]
            if not per_request:
                if seen[k] == b:
                    if write_out:
                        out[i] = DUPLICATE
                    if m >= 0:
                        hist[m + 1] += 1
                    continue
                seen[k] = b
            p = last[k]
            d = FIRST_USE if p < 0 else live - _live_upto(dead, tree, p)
            if write_out:
                out[i] = d
            if m >= 0:
                j = m
                if 0 <= d < lut.size:
                    j = lut[d]
                elif d >= 0:
                    j, step = 0, sizes.size
                    while step > 1:
                        step >>= 1
                        j += step if sizes[j + step - 1] <= d else 0
                    j += 1 if sizes[j] <= d else 0
                hist[j] += 1
        for i in range(s, e):  # 2. touch the unique keys in first-occurrence order
            k = keys[i]
            if not per_request:
                if seen[k] != b:
                    continue  # a repeat: touched already in this batch
                seen[k] = -2 - b
            if now == cap:  # out of times: renumber, doubling the window while it is half full
                words = min(max_words, max(16, (2 * live + 2 + 63) >> 6))
                now = _renumber(last, owner, dead, now, words)
                tree[:words + 1] = 0
                cap = words * 64
            p = last[k]
            if p >= 0:
                _kill(dead, tree[:words + 1], p)
            else:
                live += 1
            owner[now] = k
            last[k] = now
            now += 1


def _scratch(nkeys: int, n: int, per_request: bool):
    """last [D], owner [times] and the tree as int32 while times and keys fit (half the memory
    traffic of the per-key table, which is what the pass waits on), else int64."""
    times = max(1024, 2 * min(nkeys, n) + 2)  # distinct keys <= min(D, N)
    words = (times + 63) // 64 + 1
    small = np.int32 if max(nkeys, words * 64) < 2**31 else np.int64
    return (np.empty(nkeys, small), np.empty(1 if per_request else nkeys, np.int64), np.empty(words * 64, small),
            np.empty(words, np.uint64), np.empty(words + 1, small))


def lru_hits(dense: np.ndarray, offsets: np.ndarray | None, nkeys: int, sizes: np.ndarray) -> np.ndarray:
    """Exact LRU hits at each of `sizes` (ascending int64, > 0) in one pass: dense keys in
    [0, nkeys); offsets None for request mode. Returns int64 [m]."""
    hist = np.zeros(sizes.size + 2, np.int64)
    if dense.size:
        lut = np.searchsorted(sizes, np.arange(min(1 << 16, int(sizes[-1]) + 1)), "right").astype(np.int32)
        padded = np.full(1 << max(0, int(sizes.size - 1).bit_length()), np.iinfo(np.int64).max, np.int64)
        padded[:sizes.size] = sizes
        per_request = offsets is None
        _lru_pass(dense, np.zeros(1, np.int64) if per_request else offsets, per_request,
                  *_scratch(nkeys, dense.size, per_request), np.empty(0, np.int64), lut, padded, hist)
    return np.cumsum(hist[:sizes.size])


@kernel
def _count_distinct(keys, bits):
    bits[:] = 0
    n = 0
    for k in keys:
        bit = np.uint64(1) << np.uint64(k & 63)
        if not bits[k >> 6] & bit:
            bits[k >> 6] |= bit
            n += 1
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
        _lru_pass(dense, offsets, per_request, *_scratch(nkeys, keys.size, per_request), out,
                  np.empty(0, np.int32), np.empty(0, np.int64), np.empty(0, np.int64))
    return out
