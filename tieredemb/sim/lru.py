"""One LRU tier at one size in O(1) per lookup: tieredemb.trace.reuse's times and dead bits, plus
the boundary T, the oldest time still among the `cap` most recent. A lookup hits iff its key's
time is >= T (as of the start of its batch in batch mode); each touch moves T forward by at most
one live time, and T never moves back, so the scan for the next live time is O(1) amortized. No
count levels: about 1.3-1.5x as fast as the stack-distance pass (reuse.lru_hits), which answers
every size at once (curves.mrc), and about 3x as fast as the general list kernel (kernel.py)."""

from __future__ import annotations

import numpy as np

from tieredemb.trace.jit import kernel, popcount, prefetch
from tieredemb.trace.reuse import renumber, scratch

from .errors import check_below, too_wide

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
def _lru_one_size(keys, offsets, per_request, cap, last, seen, owner, dead, table_of, hits, misses, st):
    """hits/misses [T] per table (table_of [D], or one entry for one table). st: the state between
    calls, [now, live, top, words, batches so far, batch too wide, its width]. Returns False (st[5],
    st[6] set) when a batch has more unique keys than cap. Scratch as reuse._lru_pass."""
    n = keys.size
    per_table = table_of.size > 1
    max_words = dead.size
    now, live, top, words, b0 = st[0], st[1], st[2], st[3], st[4]  # top: the boundary T, once live > cap
    window = words * 64
    nbatches = n if per_request else offsets.size - 1
    for b in range(nbatches):
        s = b if per_request else offsets[b]
        e = b + 1 if per_request else offsets[b + 1]
        stamp = b0 + b
        unique = 0
        for i in range(s, e):  # 1. hit or miss, against the order at the batch start
            if i + _AHEAD < n:
                prefetch(last, keys[i + _AHEAD])
            k = keys[i]
            if not per_request:
                if seen[k] == stamp:
                    continue
                seen[k] = stamp
            unique += 1
            p = last[k]
            t = table_of[k] if per_table else 0
            if p >= 0 and (live <= cap or p >= top):
                hits[t] += 1
            else:
                misses[t] += 1
        if unique > cap:
            st[5], st[6] = stamp, unique
            return False
        for i in range(s, e):  # 2. touch the unique keys in first-occurrence order
            k = keys[i]
            if not per_request:
                if seen[k] != stamp:
                    continue
                seen[k] = -2 - stamp
            if now == window:  # out of times: renumber (top keeps its rank among live times)
                rank = _live_below(dead, top) if live > cap else 0
                words = min(max_words, max(16, (2 * live + 2 + 63) >> 6))
                now = renumber(last, owner, dead, now, words)
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
    st[0], st[1], st[2], st[3], st[4] = now, live, top, words, b0 + nbatches
    return True


class LruTier:
    """One LRU tier of `cap` rows over dense keys in [0, nkeys), fed in order a chunk of whole
    batches at a time (request mode: offsets None). Memory: O(min(nkeys, lookups)) for a trace of
    `lookups` lookups in all; table_of [nkeys] (or None) splits the counts per table."""

    def __init__(self, nkeys: int, cap: int, lookups: int, *, per_request: bool, table_of: np.ndarray | None = None):
        self.cap, self.per_request, self.nkeys = int(cap), per_request, int(nkeys)
        self._table_of = np.zeros(1, np.int64) if table_of is None else np.ascontiguousarray(table_of, np.int64)
        tables = int(self._table_of.max(initial=0)) + 1
        self.hits, self.misses = np.zeros(tables, np.int64), np.zeros(tables, np.int64)
        self._last, self._seen, self._owner, self._dead, _ = scratch(max(nkeys, 1), max(lookups, 1), per_request)
        self._last[:] = -1
        self._seen[:] = -1
        self._dead[:] = 0
        self._st = np.array([0, 0, 0, min(16, self._dead.size), 0, -1, 0], np.int64)

    def feed(self, dense: np.ndarray, offsets: np.ndarray | None) -> None:
        """The next batches: dense keys, and offsets [b+1] (None in request mode). Raises
        SimError (too_wide) for a batch with more unique keys than the tier holds, or for a key
        past nkeys."""
        check_below(dense, self.nkeys)
        if not _lru_one_size(dense, np.zeros(1, np.int64) if self.per_request else offsets, self.per_request,
                             self.cap, self._last, self._seen, self._owner, self._dead, self._table_of, self.hits,
                             self.misses, self._st):
            raise too_wide(int(self._st[5]), int(self._st[6]), 0, self.cap)

    @property
    def distinct(self) -> int:
        """Distinct keys fed so far."""
        return int(self._st[1])

    @property
    def batches(self) -> int:
        """Batches (request mode: lookups) fed so far."""
        return int(self._st[4])

