"""One LRU tier at one size in O(1) per lookup: stackdist's times and dead bits, plus the boundary
T, the oldest time still among the `cap` most recent. A lookup hits iff its key's time is >= T
(as of the start of its batch in batch mode); each touch moves T forward by at most one live time,
and T never moves back, so the scan for the next live time is O(1) amortized. No count levels:
about 1.3-1.5x as fast as the stack-distance pass, which answers every size at once (mrc)."""

from __future__ import annotations

import numpy as np

from .stackdist import _renumber, _scratch
from .state import kernel, popcount, prefetch

_AHEAD = 16


@kernel
def _live_below(dead, t):
    """Live times among 0..t-1 (every time below the current one was taken)."""
    w = t >> 6
    s = 0
    for j in range(w):
        s += 64 - np.int64(popcount(dead[j]))
    r = t & 63
    if r:
        s += r - np.int64(popcount(dead[w] & ((np.uint64(1) << np.uint64(r)) - np.uint64(1))))
    return s


@kernel
def _next_live(dead, t):
    """The first live time after t (one exists: the newest time is live)."""
    t += 1
    w = t >> 6
    x = ~dead[w] & ~((np.uint64(1) << np.uint64(t & 63)) - np.uint64(1))
    while x == 0:
        w += 1
        x = ~dead[w]
    return (w << 6) + np.int64(popcount((x & -x) - np.uint64(1)))


@kernel
def _lru_one_size(keys, offsets, per_request, cap, last, seen, owner, dead, table_of, hits, misses):
    """hits/misses [T] per table (table_of [D], or one entry for one table). Returns the number
    of distinct keys. Scratch as stackdist._lru_pass."""
    n = keys.size
    per_table = table_of.size > 1
    last[:] = -1
    seen[:] = -1
    dead[:] = 0
    max_words = dead.size
    words = min(16, max_words)
    window = words * 64
    now, live, top = 0, 0, 0  # top: the boundary T, meaningful once live > cap
    nbatches = n if per_request else offsets.size - 1
    for b in range(nbatches):
        s = b if per_request else offsets[b]
        e = b + 1 if per_request else offsets[b + 1]
        for i in range(s, e):  # 1. hit or miss, against the order at the batch start
            if i + _AHEAD < n:
                prefetch(last, keys[i + _AHEAD])
            k = keys[i]
            if not per_request:
                if seen[k] == b:
                    continue
                seen[k] = b
            p = last[k]
            t = table_of[k] if per_table else 0
            if p >= 0 and (live <= cap or p >= top):
                hits[t] += 1
            else:
                misses[t] += 1
        for i in range(s, e):  # 2. touch the unique keys in first-occurrence order
            k = keys[i]
            if not per_request:
                if seen[k] != b:
                    continue
                seen[k] = -2 - b
            if now == window:  # out of times: renumber (top keeps its rank among live times)
                rank = _live_below(dead, top) if live > cap else 0
                words = min(max_words, max(16, (2 * live + 2 + 63) >> 6))
                now = _renumber(last, owner, dead, now, words)
                window = words * 64
                top = rank
            p = last[k]
            if p >= 0:
                dead[p >> 6] |= np.uint64(1) << np.uint64(p & 63)
            else:
                live += 1
            owner[now] = k
            last[k] = now
            now += 1
            if live == cap + 1 and p < 0:  # the tier just overflowed: T = the second-oldest time
                top = _next_live(dead, -1)
                top = _next_live(dead, top)
            elif live > cap and (p < top or p == top):  # a time joined the top set (or T died)
                top = _next_live(dead, top)
    return live


def lru_one_size(dense: np.ndarray, offsets: np.ndarray | None, nkeys: int, cap: int,
                 table_of: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """(hits [T], misses [T], distinct keys) of one LRU tier of `cap` rows: dense keys in
    [0, nkeys); offsets None for request mode; table_of [nkeys] or None."""
    table_of = np.zeros(1, np.int64) if table_of is None else np.ascontiguousarray(table_of, np.int64)
    tables = int(table_of.max(initial=0)) + 1
    hits, misses = np.zeros(tables, np.int64), np.zeros(tables, np.int64)
    if dense.size == 0:
        return hits, misses, 0
    per_request = offsets is None
    last, seen, owner, dead, _ = _scratch(nkeys, dense.size, per_request)
    distinct = _lru_one_size(dense, np.zeros(1, np.int64) if per_request else offsets, per_request, cap, last, seen,
                             owner, dead, table_of, hits, misses)
    return hits, misses, int(distinct)
