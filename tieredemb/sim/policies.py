"""Eviction policies over one tier's slots (numba), with the engine's contract (native/index/policy.h):
select() picks victims among occupied slots not used by the current batch (MARK != stamp); then,
in batch order, insert() for each new row and touch() for each hit.

lru, lfu and clock reproduce native/index/policy.cc step for step (replay == simulate). The others:
  fifo       evicts in insertion order; hits change nothing (libCacheSim's FIFO).
  belady     evicts the row whose next use (batch) is farthest, never used again first; ties by
             slot. No bypass: every miss is inserted, as in libCacheSim's Belady.
  lookahead  the prefetch issue's rule: rows not used in the next k batches first, in LRU order;
             then farthest next use first, ties in LRU order.
  s3fifo     libCacheSim's S3FIFO.c (small FIFO of int(0.1 C) rows, main 2-bit CLOCK FIFO,
             ghost FIFO of int(0.9 C) keys, move-to-main threshold 2, rows inserted into main
             while the small queue is full and nothing was evicted yet). In batch mode rows of
             the current batch are skipped where they stand (neither moved nor aged).
"""

from __future__ import annotations

from tieredemb.trace.jit import inline, kernel

from .state import (
    BASE,
    BELADY,
    CAP,
    CLOCK,
    CLOCKT,
    CODE,
    COUNT1,
    COUNT2,
    FIFO,
    GHEAD,
    GHOSTCAP,
    GHOSTN,
    GTAIL,
    HAND,
    HASEVICTED,
    HEAD,
    HEAD2,
    HEAPN,
    LFU,
    LOOKAHEAD,
    LRU,
    MAINCAP,
    MARK,
    PA,
    PB,
    PC,
    PD,
    PERIOD,
    S3FIFO,
    SKEY,
    SMALLCAP,
    TAIL,
    TAIL2,
    USES,
    VIC,
)

LFU_COUNT_MAX = 1 << 30  # native/index/policy.cc stops counting here


# -- doubly linked lists over slots (head = most recent); PA = prev, PB = next, PA -2 = unlinked ----
@inline
def list_unlink(slot, sc, l, g, H, T):
    p, n = slot[PA, g], slot[PB, g]
    if p >= 0:
        slot[PB, p] = n
    else:
        sc[l, H] = n
    if n >= 0:
        slot[PA, n] = p
    else:
        sc[l, T] = p
    slot[PA, g] = -2
    slot[PB, g] = -1


@inline
def list_push_head(slot, sc, l, g, H, T):
    h = sc[l, H]
    slot[PA, g] = -1
    slot[PB, g] = h
    if h >= 0:
        slot[PA, h] = g
    else:
        sc[l, T] = g
    sc[l, H] = g


@inline
def list_move_to_head(slot, sc, l, g, H, T):
    if sc[l, H] == g:
        return
    if slot[PA, g] != -2:
        list_unlink(slot, sc, l, g, H, T)
    list_push_head(slot, sc, l, g, H, T)


# -- indexed binary min-heap over slots by (PA, PB); PC = heap, PD = heap index -------------------------
@inline
def _less(slot, g1, g2):
    return slot[PA, g1] < slot[PA, g2] or (slot[PA, g1] == slot[PA, g2] and slot[PB, g1] < slot[PB, g2])


@kernel
def heap_sift_up(slot, sc, l, i):
    base = sc[l, BASE]
    g = slot[PC, base + i]
    while i > 0:
        p = (i - 1) // 2
        q = slot[PC, base + p]
        if not _less(slot, g, q):
            break
        slot[PC, base + i] = q
        slot[PD, q] = i
        i = p
    slot[PC, base + i] = g
    slot[PD, g] = i
    return i


@kernel
def heap_sift_down(slot, sc, l, i):
    base, n = sc[l, BASE], sc[l, HEAPN]
    g = slot[PC, base + i]
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and _less(slot, slot[PC, base + c + 1], slot[PC, base + c]):
            c += 1
        q = slot[PC, base + c]
        if not _less(slot, q, g):
            break
        slot[PC, base + i] = q
        slot[PD, q] = i
        i = c
    slot[PC, base + i] = g
    slot[PD, g] = i
    return i


@kernel
def heap_fix(slot, sc, l, g):
    """Restores the heap after slot g's key changed, or adds g if it is not in the heap."""
    i = slot[PD, g]
    if i < 0:
        i = sc[l, HEAPN]
        sc[l, HEAPN] = i + 1
        slot[PC, sc[l, BASE] + i] = g
        slot[PD, g] = i
    heap_sift_down(slot, sc, l, heap_sift_up(slot, sc, l, i))


@kernel
def heap_pop(slot, sc, l):
    base = sc[l, BASE]
    top = slot[PC, base]
    n = sc[l, HEAPN] - 1
    sc[l, HEAPN] = n
    slot[PD, top] = -1
    if n > 0:
        last = slot[PC, base + n]
        slot[PC, base] = last
        slot[PD, last] = 0
        heap_sift_down(slot, sc, l, 0)
    return top


@kernel
def _heap_select(slot, sc, buf, l, need, stamp):
    """Pops the need smallest unmarked slots; marked ones popped on the way go back unchanged."""
    width = buf.shape[2]
    found, held = 0, 0
    while found < need and sc[l, HEAPN] > 0:
        g = heap_pop(slot, sc, l)
        if slot[MARK, g] == stamp:  # parked at the far end (found + held <= the batch's keys <= width)
            held += 1
            buf[l, VIC, width - held] = g
        else:
            buf[l, VIC, found] = g
            found += 1
    for j in range(held):
        heap_fix(slot, sc, l, buf[l, VIC, width - 1 - j])
    return found


@kernel
def _lfu_age(slot, sc, l):
    """native/index/policy.cc: every PERIOD = max(1024, 8 C) uses, all counts halve."""
    sc[l, USES] += 1
    if sc[l, USES] < sc[l, PERIOD]:
        return
    sc[l, USES] = 0
    base, n = sc[l, BASE], sc[l, HEAPN]
    for i in range(n):
        slot[PA, slot[PC, base + i]] >>= 1
    for i in range(n // 2 - 1, -1, -1):
        heap_sift_down(slot, sc, l, i)


# -- CLOCK (native/index/policy.cc ClockPolicy): PA = referenced bit, the hand in sc[l, HAND] ----------------
@kernel
def _clock_select(slot, sc, buf, l, need, stamp):
    """Lap one takes unreferenced slots and clears the rest; lap two takes what lap one cleared."""
    base, cap = sc[l, BASE], sc[l, CAP]
    found, nclear, pos = 0, 0, sc[l, HAND]
    for step in range(2 * cap):
        if found >= need:
            break
        g = base + pos
        if slot[SKEY, g] >= 0 and slot[MARK, g] != stamp:
            second_lap = step >= cap
            if slot[PA, g] and not second_lap:
                slot[PD, base + nclear] = g  # cleared when the plan is accepted, as the engine does
                nclear += 1
            elif slot[PA, g] or not second_lap:
                buf[l, VIC, found] = g
                found += 1
        pos = (pos + 1) % cap
    for j in range(nclear):
        slot[PA, slot[PD, base + j]] = 0
    sc[l, HAND] = pos
    return found


# -- LRU-ordered lists: lru, fifo, lookahead ---------------------------------------------------------
@inline
def _list_select(slot, sc, buf, l, need, stamp):
    found, g = 0, sc[l, TAIL]
    while g >= 0 and found < need:
        if slot[MARK, g] != stamp:
            buf[l, VIC, found] = g
            found += 1
        g = slot[PA, g]
    return found


@kernel
def _lookahead_select(slot, sc, buf, l, need, stamp, window_end, knext):
    """Rows not used before batch window_end first (LRU order), then farthest next use first,
    ties in LRU order. Scratch: PD holds the ranked candidates, PC their sort keys."""
    base = sc[l, BASE]
    found, kept, g = 0, 0, sc[l, TAIL]
    while g >= 0 and found < need:
        if slot[MARK, g] != stamp:
            if knext[slot[SKEY, g]] >= window_end:
                buf[l, VIC, found] = g
                found += 1
            else:
                slot[PD, base + kept] = g
                kept += 1
        g = slot[PA, g]
    if found < need:
        # key = (distance from the window's end to the next use) * kept + LRU rank: ascending
        # order is farthest next use first, ties least recently used first.
        for j in range(kept):
            slot[PC, base + j] = (window_end - knext[slot[SKEY, slot[PD, base + j]]]) * kept + j
        _heapsort(slot[PC], base, kept)
        for j in range(need - found):
            buf[l, VIC, found + j] = slot[PD, base + slot[PC, base + j] % kept]
        found = need
    return found


@kernel
def _heapsort(a, lo, n):
    """Sorts a[lo:lo+n] ascending in place (no allocation)."""
    for start in range(n // 2 - 1, -1, -1):
        _sift(a, lo, start, n)
    for end in range(n - 1, 0, -1):
        a[lo], a[lo + end] = a[lo + end], a[lo]
        _sift(a, lo, 0, end)


@kernel
def _sift(a, lo, i, n):
    v = a[lo + i]
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and a[lo + c + 1] > a[lo + c]:
            c += 1
        if a[lo + c] <= v:
            break
        a[lo + i] = a[lo + c]
        i = c
    a[lo + i] = v


# -- S3-FIFO: small queue = list (HEAD, TAIL), main = list (HEAD2, TAIL2), ghost = per-key list -------
@kernel
def _ghost_unlink(ghost, sc, l, k):
    p, n = ghost[l, 0, k], ghost[l, 1, k]
    if p >= 0:
        ghost[l, 1, p] = n
    else:
        sc[l, GHEAD] = n
    if n >= 0:
        ghost[l, 0, n] = p
    else:
        sc[l, GTAIL] = p
    ghost[l, 0, k] = -2
    ghost[l, 1, k] = -1
    sc[l, GHOSTN] -= 1


@kernel
def s3fifo_ghost_take(ghost, sc, l, k):
    """1 if key k was in the ghost queue (and removes it): its row goes to the main queue."""
    if ghost[l, 0, k] == -2:
        return 0
    _ghost_unlink(ghost, sc, l, k)
    return 1


@kernel
def _ghost_add(ghost, sc, l, k):
    if sc[l, GHOSTCAP] == 0:
        return
    while sc[l, GHOSTN] >= sc[l, GHOSTCAP]:
        _ghost_unlink(ghost, sc, l, sc[l, GTAIL])
    h = sc[l, GHEAD]
    ghost[l, 0, k] = -1
    ghost[l, 1, k] = h
    if h >= 0:
        ghost[l, 0, h] = k
    else:
        sc[l, GTAIL] = k
    sc[l, GHEAD] = k
    sc[l, GHOSTN] += 1


@kernel
def _s3_evict_small(slot, ghost, sc, l, stamp):
    g = sc[l, TAIL]
    while g >= 0:
        p = slot[PA, g]
        if slot[MARK, g] != stamp:
            list_unlink(slot, sc, l, g, HEAD, TAIL)
            sc[l, COUNT1] -= 1
            if slot[PC, g] >= 2:  # used again while small: promoted to main with a fresh count
                list_push_head(slot, sc, l, g, HEAD2, TAIL2)
                sc[l, COUNT2] += 1
                slot[PD, g] = 1
                slot[PC, g] = 0
            else:
                _ghost_add(ghost, sc, l, slot[SKEY, g])
                return g
        g = p
    return -1


@kernel
def _s3_evict_main(slot, sc, l, stamp):
    g, unmarked = sc[l, TAIL2], False
    while True:
        if g < 0:
            if not unmarked:
                return -1
            g, unmarked = sc[l, TAIL2], False
            continue
        p = slot[PA, g]
        if slot[MARK, g] != stamp:
            unmarked = True
            f = slot[PC, g]
            list_unlink(slot, sc, l, g, HEAD2, TAIL2)
            if f < 1:
                sc[l, COUNT2] -= 1
                return g
            list_push_head(slot, sc, l, g, HEAD2, TAIL2)  # 2-bit CLOCK: reinserted one count lower
            slot[PC, g] = min(f, 3) - 1
        g = p


@kernel
def _s3_select(slot, ghost, sc, buf, l, need, stamp):
    for j in range(need):
        sc[l, HASEVICTED] = 1
        if sc[l, COUNT2] > sc[l, MAINCAP] or sc[l, COUNT1] == 0:
            g = _s3_evict_main(slot, sc, l, stamp)
            if g < 0:
                g = _s3_evict_small(slot, ghost, sc, l, stamp)
        else:
            g = _s3_evict_small(slot, ghost, sc, l, stamp)
            if g < 0:
                g = _s3_evict_main(slot, sc, l, stamp)
        if g < 0:
            return j
        buf[l, VIC, j] = g
    return need


# -- dispatch -------------------------------------------------------------------------------------------
@inline
def select(slot, ghost, sc, buf, l, need, stamp, window_end, knext):
    """Victims (global slots) into buf[l, VIC, :need], best first; returns how many were found."""
    code = sc[l, CODE]
    if code == LRU or code == FIFO:
        return _list_select(slot, sc, buf, l, need, stamp)
    if code == LFU or code == BELADY:
        return _heap_select(slot, sc, buf, l, need, stamp)
    if code == CLOCK:
        return _clock_select(slot, sc, buf, l, need, stamp)
    if code == LOOKAHEAD:
        return _lookahead_select(slot, sc, buf, l, need, stamp, window_end, knext)
    return _s3_select(slot, ghost, sc, buf, l, need, stamp)


@inline
def insert(slot, sc, l, g, k, knext, from_ghost):
    """Slot g now holds key k (its first use)."""
    code = sc[l, CODE]
    if code == LRU or code == FIFO or code == LOOKAHEAD:
        list_move_to_head(slot, sc, l, g, HEAD, TAIL)
    elif code == CLOCK:
        slot[PA, g] = 1
    elif code == LFU:
        sc[l, CLOCKT] += 1
        slot[PA, g] = 1
        slot[PB, g] = sc[l, CLOCKT]
        heap_fix(slot, sc, l, g)
        _lfu_age(slot, sc, l)
    elif code == BELADY:
        slot[PA, g] = -knext[k]
        slot[PB, g] = g
        heap_fix(slot, sc, l, g)
    else:
        if from_ghost or (sc[l, HASEVICTED] == 0 and sc[l, COUNT1] >= sc[l, SMALLCAP]):
            list_push_head(slot, sc, l, g, HEAD2, TAIL2)
            sc[l, COUNT2] += 1
            slot[PD, g] = 1
        else:
            list_push_head(slot, sc, l, g, HEAD, TAIL)
            sc[l, COUNT1] += 1
            slot[PD, g] = 0
        slot[PC, g] = 0


@inline
def touch(slot, sc, l, g, k, knext):
    """One use of the row in slot g (key k): a hit."""
    code = sc[l, CODE]
    if code == LRU or code == LOOKAHEAD:
        list_move_to_head(slot, sc, l, g, HEAD, TAIL)
    elif code == CLOCK:
        slot[PA, g] = 1
    elif code == LFU:
        if slot[PA, g] < LFU_COUNT_MAX:
            slot[PA, g] += 1
        sc[l, CLOCKT] += 1
        slot[PB, g] = sc[l, CLOCKT]
        heap_fix(slot, sc, l, g)
        _lfu_age(slot, sc, l)
    elif code == BELADY:
        slot[PA, g] = -knext[k]
        heap_fix(slot, sc, l, g)
    elif code == S3FIFO:
        slot[PC, g] += 1
