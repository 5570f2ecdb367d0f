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

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.extending import intrinsic

# Every simulator kernel: compiled once to the on-disk cache, GIL released, and without numba's
# reference counting (_nrt=False: arrays come in from Python and are never allocated inside),
# which otherwise costs atomic increments on every call and measured 20-50x slower per lookup.
kernel = numba.njit(cache=True, nogil=True, _nrt=False)
# The per-lookup path, inlined into its callers: a call passes every array as a struct (up to a
# hundred words per call here), which LLVM does not inline away for functions this size.
inline = numba.njit(cache=True, nogil=True, _nrt=False, inline="always")


@intrinsic
def prefetch(typingctx, arr, idx):
    """prefetch(arr, i): asks the CPU to bring arr[i] (1-D) into cache; the per-key tables are
    far larger than the caches and the loop is otherwise bound by their load latency."""
    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])  # read, keep, data
        return context.get_dummy_value()
    return numba.types.void(arr, idx), codegen


@intrinsic
def popcount(typingctx, x):
    """Number of set bits of a uint64 (one instruction: llvm.ctpop)."""
    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i64, [i64]), "llvm.ctpop.i64")
        return builder.call(fn, [args[0]])
    return numba.types.uint64(numba.types.uint64), codegen

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
        sc[l, PERIOD] = max(1024, 8 * cap)  # LFU aging, as native/policy.cc
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
