"""The simulator's state: five int64 arrays that every numba function takes explicitly.

    slot  [NSLOT_FIELDS, S]  per slot of every tier; tier l owns slots sc[l, BASE] + 0..cap-1
    where [T, K]             slot of key k in tier l, -1 if not resident
    ghost [T, 2, K or 1]     S3-FIFO ghost queue: prev / next key (prev -2: not in the ghost)
    sc    [T + 1, NSC]       per tier: policy, sizes, list heads, counters; row T: the bottom
    buf   [T, NBUF, W]       one plan per tier (W = the longest batch: a batch's misses, dirty
                             victims and misses further down never exceed its unique keys)

Per-slot policy fields PA..PD mean, by policy:
    lru, fifo, lookahead   PA = prev (towards the head = most recent), PB = next (lookahead: PC, PD scratch)
    lfu                    PA = use count, PB = last-use clock, PC = heap, PD = heap index
    belady                 PA = -next use (batch), PB = slot (tie-break), PC = heap, PD = heap index
    clock                  PA = referenced bit (PD: scratch)
    s3fifo                 PA/PB = prev/next in its queue, PC = freq, PD = queue (0 small, 1 main)
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

POLICIES = ("lru", "lfu", "fifo", "clock", "s3fifo", "belady", "lookahead")
LRU, LFU, FIFO, CLOCK, S3FIFO, BELADY, LOOKAHEAD = range(len(POLICIES))

SKEY, MARK, DIRTY, PA, PB, PC, PD = range(7)
NSLOT_FIELDS = 7
IDS, SLOTS, MISS, VIC, VKEY, VDIRTY, GHOSTHIT = range(7)
NBUF = 7
(CODE, BASE, CAP, USED, HEAD, TAIL, HEAD2, TAIL2, HAND, CLOCKT, HEAPN, USES, PERIOD, STAMP, NMISS, NVIC,
 FROMFREE, COUNT1, COUNT2, SMALLCAP, MAINCAP, GHOSTCAP, GHOSTN, GHEAD, GTAIL, HASEVICTED, NIN,
 HITS, MISSES, WRITES, EVICTIONS, DIRTY_WB, CLEAN_DROPS) = range(33)
NSC = 33
READS = MISSES  # the bottom row: rows read from below the last tier
NEVER = np.iinfo(np.int64).max // 4  # next use (batch) of a key never used again

State = namedtuple("State", "slot where ghost sc buf")


def make_state(codes: list[int], caps: list[int], nkeys: int, width: int) -> State:
    """Fresh (empty) tiers with these policy codes and capacities, for keys in [0, nkeys)."""
    t = len(caps)
    sc = np.zeros((t + 1, NSC), np.int64)
    slot = np.zeros((NSLOT_FIELDS, int(sum(caps))), np.int64)
    slot[[SKEY, PB, PC, PD]] = -1
    base = 0
    for l, (code, cap) in enumerate(zip(codes, caps)):
        sc[l, CODE], sc[l, BASE], sc[l, CAP] = code, base, cap
        sc[l, HEAD] = sc[l, TAIL] = sc[l, HEAD2] = sc[l, TAIL2] = sc[l, GHEAD] = sc[l, GTAIL] = -1
        sc[l, PERIOD] = max(1024, 8 * cap)  # LFU aging, as native/index/policy.cc
        sc[l, SMALLCAP] = int(cap * 0.1)     # S3-FIFO queues, as libCacheSim's (int)(size * ratio)
        sc[l, MAINCAP] = cap - sc[l, SMALLCAP]
        sc[l, GHOSTCAP] = int(cap * 0.9)
        if code in (LRU, FIFO, LOOKAHEAD, S3FIFO):
            slot[PA, base:base + cap] = -2  # not linked into a list
        base += cap
    ghost = np.full((t, 2, nkeys if S3FIFO in codes else 1), -1, np.int64)
    ghost[:, 0] = -2
    return State(slot, np.full((t, nkeys), -1, np.int64), ghost, sc, make_buffers(t, width))


def make_buffers(tiers: int, width: int) -> np.ndarray:
    return np.zeros((tiers, NBUF, max(1, width)), np.int64)
