"""The batch loop (numba): the engine's plan / write-back / commit / read-below order per batch.

Per batch, U = its unique keys in first-occurrence order (request mode: one key). In tier l,
plan() finds the misses and picks victims (free slots first, slot order 0, 1, ...); dirty
victims are written down to tier l+1 (a plan + commit there that counts writes, which may evict
and write further down); then commit() applies the plan, inserting misses and touching hits in
batch order; then the misses are read from tier l+1. This is tiers/cache.py CacheTier.resident over
native/index/cache_index.cc, step for step. Training marks every key of U dirty in tier 0 afterwards.
"""

from __future__ import annotations

from tieredemb.trace.jit import inline, kernel, prefetch

from .policies import insert, s3fifo_ghost_take, select, touch
from .state import (
    BASE,
    CAP,
    CLEAN_DROPS,
    CODE,
    DIRTY,
    DIRTY_WB,
    EVICTIONS,
    FROMFREE,
    GHOSTHIT,
    HITS,
    IDS,
    MARK,
    MISS,
    MISSES,
    NEVER,
    NIN,
    NMISS,
    NVIC,
    PA,
    PB,
    READS,
    S3FIFO,
    SKEY,
    SLOTS,
    STAMP,
    USED,
    VDIRTY,
    VIC,
    VKEY,
    WRITES,
)

PREFETCH_AHEAD = 16  # lookups


@inline
def _plan(slot, where, ghost, sc, buf, l, n, window_end, knext):
    sc[l, STAMP] += 1
    stamp = sc[l, STAMP]
    base = sc[l, BASE]
    s3 = sc[l, CODE] == S3FIFO
    nm = 0
    for i in range(n):
        k = buf[l, IDS, i]
        g = where[l, k]
        buf[l, SLOTS, i] = g
        if g < 0:
            buf[l, MISS, nm] = i
            nm += 1
            if s3:
                buf[l, GHOSTHIT, i] = s3fifo_ghost_take(ghost, sc, l, k)
    used = sc[l, USED]
    from_free = min(nm, sc[l, CAP] - used)
    need = nm - from_free
    if need > 0:
        for i in range(n):  # the batch's resident rows are not victims (marked only when it matters)
            g = buf[l, SLOTS, i]
            if g >= 0:
                slot[MARK, g] = stamp
        select(slot, ghost, sc, buf, l, need, stamp, window_end, knext)
    for j in range(nm):
        buf[l, SLOTS, buf[l, MISS, j]] = base + used + j if j < from_free else buf[l, VIC, j - from_free]
    for v in range(need):
        g = buf[l, VIC, v]
        buf[l, VKEY, v] = slot[SKEY, g]
        buf[l, VDIRTY, v] = slot[DIRTY, g]
    sc[l, NIN] = n
    sc[l, NMISS] = nm
    sc[l, NVIC] = need
    sc[l, FROMFREE] = from_free


@inline
def _commit(slot, where, sc, buf, l, write, knext, table_of, tstats):
    n, nm = sc[l, NIN], sc[l, NMISS]
    for v in range(sc[l, NVIC]):
        where[l, buf[l, VKEY, v]] = -1
        sc[l, EVICTIONS] += 1
        sc[l, DIRTY_WB if buf[l, VDIRTY, v] else CLEAN_DROPS] += 1
    sc[l, USED] += sc[l, FROMFREE]
    per_table = tstats.shape[1] > 1
    for i in range(n):
        k = buf[l, IDS, i]
        g = buf[l, SLOTS, i]
        hit = where[l, k] >= 0
        if hit:
            touch(slot, sc, l, g, k, knext)
        else:
            where[l, k] = g
            slot[SKEY, g] = k
            slot[DIRTY, g] = 0
            insert(slot, sc, l, g, k, knext, buf[l, GHOSTHIT, i])
        if write:
            slot[DIRTY, g] = 1
        elif per_table:
            tstats[l, table_of[k], 0 if hit else 1] += 1
    if write:
        sc[l, WRITES] += n
    else:
        sc[l, HITS] += n - nm
        sc[l, MISSES] += nm


@inline
def _dirty_victims_down(sc, buf, l, ntiers):
    """Copies tier l's dirty victims (victim order) into tier l+1's input; returns how many."""
    nd = 0
    last = l + 1 == ntiers
    for v in range(sc[l, NVIC]):
        if buf[l, VDIRTY, v]:
            if not last:
                buf[l + 1, IDS, nd] = buf[l, VKEY, v]
            nd += 1
    if last:
        sc[ntiers, WRITES] += nd
    return nd


@kernel
def _write_down(slot, where, ghost, sc, buf, l0, n, ntiers, window_end, knext, table_of, tstats, err):
    """Writes n rows (buf[l0, IDS, :n]) into tier l0: plans down the chain of dirty victims,
    then commits bottom-up (each tier writes its victims below before it commits)."""
    l = l0
    while True:
        if n > sc[l, CAP]:
            err[1], err[2] = l, n
            return False
        _plan(slot, where, ghost, sc, buf, l, n, window_end, knext)
        n = _dirty_victims_down(sc, buf, l, ntiers)
        if n == 0 or l + 1 == ntiers:
            break
        l += 1
    for m in range(l, l0 - 1, -1):
        _commit(slot, where, sc, buf, m, True, knext, table_of, tstats)
    return True


@inline
def _read(slot, where, ghost, sc, buf, n, ntiers, window_end, knext, table_of, tstats, err):
    """Makes buf[0, IDS, :n] resident in tier 0, reading each tier's misses from the one below."""
    for l in range(ntiers):
        if n > sc[l, CAP]:
            err[1], err[2] = l, n
            return False
        _plan(slot, where, ghost, sc, buf, l, n, window_end, knext)
        nd = _dirty_victims_down(sc, buf, l, ntiers)
        if nd and l + 1 < ntiers and not _write_down(slot, where, ghost, sc, buf, l + 1, nd, ntiers, window_end,
                                                      knext, table_of, tstats, err):
            return False
        _commit(slot, where, sc, buf, l, False, knext, table_of, tstats)
        n = sc[l, NMISS]
        if l + 1 == ntiers:
            sc[ntiers, READS] += n
        else:
            for j in range(n):
                buf[l + 1, IDS, j] = buf[l, IDS, buf[l, MISS, j]]
        if n == 0:
            break
    return True


@inline
def _prefetch_ahead(keys, i, where0, prev, succ):
    """Prefetches, for the lookup PREFETCH_AHEAD ahead, its tier-0 entry; half as far ahead (the
    entry is in cache by then) its slot; a quarter as far its LRU neighbours. The per-key and
    per-slot tables exceed the CPU caches and the loop is bound by their load latency."""
    n = keys.size
    if i + PREFETCH_AHEAD < n:
        prefetch(where0, keys[i + PREFETCH_AHEAD])
    if i + PREFETCH_AHEAD // 2 < n:
        g = where0[keys[i + PREFETCH_AHEAD // 2]]
        if g >= 0:
            prefetch(prev, g)
            prefetch(succ, g)
    if i + PREFETCH_AHEAD // 4 < n:
        g = where0[keys[i + PREFETCH_AHEAD // 4]]
        if g >= 0:
            if prev[g] >= 0:
                prefetch(succ, prev[g])
            if succ[g] >= 0:
                prefetch(prev, succ[g])


@inline
def _all_resident(where0, buf, n):
    for i in range(n):
        if where0[buf[0, IDS, i]] < 0:
            return False
    return True


@inline
def _touch_all(slot, where0, sc, buf, n, knext, table_of, tstats):
    """What plan + commit do to tier 0 for a batch that hits entirely: touches in batch order."""
    per_table = tstats.shape[1] > 1
    for i in range(n):
        k = buf[0, IDS, i]
        touch(slot, sc, 0, where0[k], k, knext)
        if per_table:
            tstats[0, table_of[k], 0] += 1
    sc[0, HITS] += n


@kernel
def run_batches(slot, where, ghost, sc, buf, keys, offsets, b0, b1, batch_id0, per_request, train, nxt, knext,
                seen, lookahead, table_of, tstats, err):
    """Batches b0..b1-1 (request mode: lookups b0..b1-1). nxt: per lookup, the next batch that
    uses its key (next_use; empty when no policy needs it); knext: per key, the same for its
    latest use; lookahead: the window of lookahead-k. batch_id0 + b identifies batch b across
    calls (chunks). Returns False with err = (batch, tier, rows) when a batch needs more rows
    than a tier holds."""
    ntiers = where.shape[0]
    use_next = nxt.size > 0  # (not its size against the keys': a dummy of one matched a chunk of one lookup)
    where0, prev, succ = where[0], slot[PA], slot[PB]
    for b in range(b0, b1):
        if per_request:
            _prefetch_ahead(keys, b, where0, prev, succ)
            buf[0, IDS, 0] = keys[b]
            n = 1
            if use_next:
                knext[keys[b]] = nxt[b]
            window_end = b + lookahead + 1
        else:
            n = 0
            stamp = batch_id0 + b
            for i in range(offsets[b], offsets[b + 1]):
                _prefetch_ahead(keys, i, where0, prev, succ)
                k = keys[i]
                if seen[k] != stamp:
                    seen[k] = stamp
                    buf[0, IDS, n] = k
                    n += 1
                    if use_next:
                        knext[k] = nxt[i]
            window_end = b + lookahead + 1
        if n == 0:
            continue
        if _all_resident(where0, buf, n):  # nothing to plan: the commit's touches alone
            _touch_all(slot, where0, sc, buf, n, knext, table_of, tstats)
        elif not _read(slot, where, ghost, sc, buf, n, ntiers, window_end, knext, table_of, tstats, err):
            err[0] = batch_id0 + b
            return False
        if train:
            for i in range(n):
                slot[DIRTY, where0[buf[0, IDS, i]]] = 1
    return True


@kernel
def next_use(keys, offsets, per_request, first, out):
    """out[i] = index of the first LATER batch (request mode: lookup) that uses keys[i], NEVER
    if none. One backward pass; first: int64 [nkeys] scratch."""
    first[:] = NEVER
    nb = keys.size if per_request else offsets.size - 1
    for b in range(nb - 1, -1, -1):
        s = b if per_request else offsets[b]
        e = b + 1 if per_request else offsets[b + 1]
        for i in range(s, e):
            out[i] = first[keys[i]]
        for i in range(s, e):
            first[keys[i]] = b
