"""Miss-ratio curves: miss ratio against cache size (rows) for one policy.

lru: exact at every size in one pass (LRU is a stack algorithm; in batch mode too, because the
engine touches a batch's rows in batch order). Other policies: one simulation per size, run on a
thread pool (the kernels release the GIL). sample_rate: SHARDS spatial sampling (Waldspurger et
al., FAST'15): keep the keys whose hash falls below rate * 2^64 and simulate sizes scaled by the
rate. Misses are divided by rate * (the full trace's lookups), not by the sampled lookups: the
paper's SHARDS-adj correction, which matters when a few hot keys carry much of the traffic and
happen to be in or out of the sample.
"""

from __future__ import annotations

import numbers
import operator
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from tieredemb.trace.keys import check_keys, check_offsets, compact
from tieredemb.trace.reuse import batch_widths, distinct_keys, lru_hits

from .errors import SimError
from .kernel import next_use
from .simulator import MODES, Simulator, _load, parse_policy
from .state import BELADY, LOOKAHEAD, LRU, POLICIES


@dataclass
class MissRatioCurve:
    policy: str
    mode: str
    sizes: np.ndarray       # int64 [m] cache sizes (rows), ascending
    miss_ratio: np.ndarray  # float64 [m]
    lookups: int            # lookups the ratios are over (per unique key per batch in batch mode)
    sample_rate: float | None = None

    @property
    def hit_ratio(self) -> np.ndarray:
        return 1.0 - self.miss_ratio

    def to_dict(self) -> dict:
        return {"policy": self.policy, "mode": self.mode, "lookups": self.lookups, "sample_rate": self.sample_rate,
                    "sizes": [int(s) for s in self.sizes], "miss_ratio": [float(r) for r in self.miss_ratio]}


def _lookups(keys: np.ndarray, offsets: np.ndarray | None, count_from: int = 0) -> tuple[int, int]:
    """(cache lookups of batch count_from on (request mode: request), the largest batch in
    distinct keys) of a trace, per the mode."""
    if offsets is None or keys.size == 0:
        return max(0, keys.size - count_from), min(1, keys.size)
    dense, nkeys, _ = compact(keys)
    widths = batch_widths(dense, offsets, nkeys)
    return int(widths[count_from:].sum()), int(widths.max(initial=0))


def shards_sample(keys: np.ndarray, offsets: np.ndarray | None, rate: float, seed: int = 0):
    """SHARDS spatial sampling: the lookups whose key hashes below rate * 2^64 (splitmix64 of the
    key), with batch offsets recomputed over what is kept. Returns (keys, offsets or None)."""
    if not 0 < rate <= 1:
        raise SimError(f"sample rate {rate} must be in (0, 1]")
    h = keys.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15 + seed)
    h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    h ^= h >> np.uint64(31)
    keep = h < np.uint64(min(int(rate * 2.0**64), 2**64 - 1))
    if offsets is None:
        return keys[keep], None
    kept_before = np.concatenate([[0], np.cumsum(keep, dtype=np.int64)])
    return keys[keep], kept_before[offsets]


def default_sizes(distinct: int, smallest: int, points: int) -> np.ndarray:
    """`points` distinct sizes spaced evenly in log scale from `smallest` to the number of
    distinct keys (all sizes in between when there are fewer)."""
    lo, hi = max(1, smallest), max(distinct, smallest, 1)
    want = min(max(1, points), hi - lo + 1)
    m = want
    while True:  # rounding merges small sizes: sample more densely until `want` remain
        sizes = np.unique(np.geomspace(lo, hi, m).round().astype(np.int64))
        if sizes.size >= want:
            return sizes[np.linspace(0, sizes.size - 1, want).round().astype(np.int64)]
        m += want - sizes.size


def mrc(keys, batch_offsets=None, sizes=None, *, policy: str = "lru", mode: str = "batch", points: int = 100,
        sample_rate: float | None = None, lookahead: int | None = None, workers: int | None = None,
        progress: bool = False, warmup: int = 0) -> MissRatioCurve:
    """Miss ratio at each size. keys/batch_offsets as simulate() (arrays, a Chunk, or a trace: a
    path in any format tieredemb.trace reads or a TraceSource, read whole); sizes: rows, or None for `points` log-spaced sizes up to the distinct keys.
    sample_rate: SHARDS sampling (sizes are scaled by it internally; the curve is reported at the
    requested sizes). warmup (lru only): the first `warmup` batches (request mode: requests) only
    fill the cache; the ratios are over the lookups after them (a steady state, not a cold start)."""
    keys, batch_offsets, _, _ = _load(keys, batch_offsets)
    keys = check_keys(keys)
    if mode not in MODES:
        raise SimError(f"unknown mode {mode!r} (known: {', '.join(MODES)})")
    if sizes is None and (isinstance(points, bool) or not isinstance(points, numbers.Integral) or points < 1):
        raise SimError(f"points {points!r} must be a whole number >= 1 of curve sizes")
    code, k = parse_policy(policy, lookahead)
    name = POLICIES[code] + (f"-{k}" if k else "")
    offsets = None if mode == "request" or batch_offsets is None else check_offsets(batch_offsets, keys.size)
    units = keys.size if offsets is None else offsets.size - 1
    try:
        warmup = operator.index(warmup)
    except TypeError:
        raise SimError(f"warmup {warmup!r} must be a whole number of batches (requests)") from None
    if warmup:
        if code != LRU:
            raise SimError(f"warmup {warmup}: only the lru curve takes a warm-up (policy {name})")
        if not 0 <= warmup < units:
            raise SimError(f"warmup {warmup} must be in [0, {units}): the trace's "
                           f"{'requests' if offsets is None else 'batches'}, some left to count")
    full_lookups, smallest = _lookups(keys, offsets, warmup)
    rate = None
    if sample_rate is not None and not 0 < float(sample_rate) <= 1:
        raise SimError(f"sample rate {sample_rate} must be in (0, 1]")
    if sample_rate is not None and float(sample_rate) < 1:
        rate = float(sample_rate)
        if warmup and offsets is None:  # sampling renumbers the requests; batches keep theirs
            raise SimError(f"warmup {warmup} with sample_rate {rate}: batch mode only")
        keys, offsets = shards_sample(keys, offsets, rate)
        smallest = _lookups(keys, offsets)[1]
    dense, nkeys, original = compact(keys)
    scale = rate or 1.0
    if sizes is None:
        distinct = nkeys if original is not None else distinct_keys(dense, nkeys)
        sizes = default_sizes(int(np.ceil(distinct / scale)), int(np.ceil(smallest / scale)), points)
    given = np.asarray(sizes)
    if given.size and (given.dtype.kind not in "iu" or given.max() >= 2**63):
        raise SimError(f"sizes must be whole row counts below 2**63, got {given.dtype} "
                       f"{given.reshape(-1)[:3].tolist()}{' ...' if given.size > 3 else ''}")
    sizes = np.unique(given.astype(np.int64))
    if sizes.size == 0 or sizes[0] <= 0:
        raise SimError(f"sizes must be positive row counts, got {sizes[:1].tolist()}")
    # (unsampled sizes as they are: float64 rounds 2**63 - 1 up, past int64)
    scaled = sizes.copy() if scale == 1.0 else np.maximum(1, np.round(sizes * scale)).astype(np.int64)
    if rate is None and scaled[0] < smallest:
        raise SimError(f"size {int(sizes[0])} is smaller than a batch of this trace ({smallest} unique rows): "
                       f"batch mode needs every batch to fit")
    if code != LRU:  # a sampled batch can exceed its scaled size: simulate at least that size
        scaled = np.maximum(scaled, smallest)
    if code == LRU:
        hits = lru_hits(dense, offsets, max(nkeys, 1), scaled, warmup)
    else:
        hits = _per_size(dense, offsets, nkeys, name, scaled, mode, workers, progress)
    sampled_lookups = _lookups(dense, offsets, warmup)[0] if rate else full_lookups
    misses = sampled_lookups - hits
    expected = full_lookups * scale
    miss = np.clip(misses / expected, 0.0, 1.0) if expected else np.zeros(sizes.size)
    return MissRatioCurve(name, mode, sizes, np.asarray(miss, np.float64), int(full_lookups), rate)


def _per_size(dense, offsets, nkeys, policy, sizes, mode, workers, progress):
    """One simulation per size on a thread pool; returns hits [m]."""
    nxt = None
    if parse_policy(policy)[0] in (BELADY, LOOKAHEAD):
        nxt = np.empty(dense.size, np.int64)
        next_use(dense, np.zeros(1, np.int64) if offsets is None else offsets, offsets is None,
                 np.empty(max(nkeys, 1), np.int64), nxt)

    def one(size):
        sim = Simulator(policy, [int(size)], nkeys, mode=mode)
        sim.feed(dense, offsets, nxt)
        t = sim.result().tiers[0]
        return t.hits, t.hits + t.misses

    workers = workers or min(len(sizes), os.cpu_count() or 1)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(sizes), unit="size", desc=f"mrc {policy}")
    out = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for r in pool.map(one, sizes):
            out.append(r)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return np.array([h for h, _ in out], np.int64)
