"""Synthetic traces: Zipf(alpha) over a permuted table, with a fraction of each batch reused from
the previous batch; and the driver shared with the locality-log generator (locality.py).
ZipfSampler is the project's one Zipf id sampler: `tieredemb demo` and the benchmarks'
workload (bench/workload.py) draw their ids from it too.

Zipf ranks are drawn exactly (rejection-inversion, Hörmann & Derflinger 1996: O(1) per draw, no
table of probabilities, so a 10^9-row table costs no memory), then mapped to row ids by a keyed
Feistel permutation of [0, rows) (again O(1) memory). Everything is a function of the seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numba
import numpy as np

from .format import TableInfo, TraceError, TraceHeader, TraceWriter

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@numba.njit(cache=True)
def _mix(z):
    """splitmix64's finalizer: a bijective 64-bit hash."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@numba.njit(cache=True)
def _permute(x, rows, half_bits, keys):
    """A bijection of [0, rows): a 4-round Feistel network on 2*half_bits bits, cycle-walked
    until the value falls back inside [0, rows) (the domain is < 4*rows, so a few steps)."""
    mask = (np.uint64(1) << np.uint64(half_bits)) - np.uint64(1)
    y = np.uint64(x)
    while True:
        left, right = y >> np.uint64(half_bits), y & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        y = (left << np.uint64(half_bits)) | right
        if y < np.uint64(rows):
            return np.int64(y)


@numba.njit(cache=True)
def _permute_all(ranks, rows, half_bits, keys, out):
    for i in range(ranks.size):
        out[i] = _permute(ranks[i], rows, half_bits, keys)


@numba.njit(cache=True)
def _log1p_over(x):
    """log(1 + x) / x, continuous at 0."""
    return math.log1p(x) / x if abs(x) > 1e-8 else 1.0 - x / 2.0


@numba.njit(cache=True)
def _expm1_over(x):
    """(exp(x) - 1) / x, continuous at 0."""
    return math.expm1(x) / x if abs(x) > 1e-8 else 1.0 + x / 2.0


@numba.njit(cache=True)
def _h_integral(x, s):
    """Integral of t^-s from 1 to x."""
    lx = math.log(x)
    return _expm1_over((1.0 - s) * lx) * lx


@numba.njit(cache=True)
def _h_integral_inv(y, s):
    t = y * (1.0 - s)
    t = max(t, -1.0)  # rounding at the far end of the support
    return math.exp(_log1p_over(t) * y)


@numba.njit(cache=True)
def _zipf_batch(rows, s, n, seed, half_bits, keys, prev, reuse_count):
    """n ids: ranks ~ Zipf(s) on 1..rows, permuted; then reuse_count random positions copy prev."""
    np.random.seed(seed)
    lo = _h_integral(1.5, s) - 1.0
    hi = _h_integral(rows + 0.5, s)
    squeeze = 2.0 - _h_integral_inv(_h_integral(2.5, s) - 2.0 ** -s, s)
    out = np.empty(n, np.int64)
    for i in range(n):
        while True:
            u = hi + np.random.random() * (lo - hi)
            x = _h_integral_inv(u, s)
            k = int(x + 0.5)
            k = min(max(k, 1), rows)
            if k - x <= squeeze or u >= _h_integral(k + 0.5, s) - float(k) ** -s:
                break
        out[i] = _permute(k - 1, rows, half_bits, keys)
    if reuse_count > 0:
        pos = np.arange(n)
        for j in range(reuse_count):  # partial Fisher-Yates: reuse_count distinct positions
            r = j + np.random.randint(0, n - j)
            pos[j], pos[r] = pos[r], pos[j]
            out[pos[j]] = prev[pos[j]]
    return out


@numba.njit(cache=True)
def _batch_seed(seed, table, batch):
    z = _mix(np.uint64(seed) * _GOLDEN + np.uint64(table))
    return np.int64(_mix(z + np.uint64(batch)) & np.uint64(0xFFFFFFFF))


class ZipfSampler:
    """Ids of one table of `rows` rows: P(rank r) ~ r^-alpha over a seeded permutation of the rows;
    from the second batch on, a fraction `reuse` of the positions repeat the previous batch's id
    at the same position (batches of equal length). Every id is a function of (rows, alpha,
    seed, table, batch index, position): batch(i, n) draws batch i alone, next_batch(n) the
    batches in order (with reuse)."""

    def __init__(self, rows: int, alpha: float, *, reuse: float = 0.0, seed: int = 0, table: int = 0):
        if rows < 1:
            raise TraceError(f"rows {rows} must be >= 1")
        if not alpha >= 0:
            raise TraceError(f"alpha {alpha} must be >= 0 (0 = uniform)")
        if not 0.0 <= reuse <= 1.0:
            raise TraceError(f"reuse {reuse} must lie in [0, 1]")
        check_seed(seed)
        self.rows, self.alpha, self.reuse, self.seed, self.table = rows, float(alpha), reuse, seed, table
        self._half_bits = max(1, (max(1, (rows - 1).bit_length()) + 1) // 2)
        seq = np.random.SeedSequence([seed, table])
        self._keys = seq.generate_state(4, dtype=np.uint64)
        self._prev = self._none = np.zeros(0, np.int64)
        self._batch = 0

    def permutation(self, ranks) -> np.ndarray:
        """int64 row ids of 0-based ranks (rank 0 is the most popular row)."""
        ranks = np.ascontiguousarray(np.ravel(ranks), dtype=np.int64)
        if ranks.size and (ranks.min() < 0 or ranks.max() >= self.rows):
            bad = int(ranks[(ranks < 0) | (ranks >= self.rows)][0])
            raise TraceError(f"rank {bad} out of range [0, {self.rows})")
        out = np.empty(ranks.size, np.int64)
        _permute_all(ranks, self.rows, self._half_bits, self._keys, out)
        return out

    def hottest(self, k: int) -> np.ndarray:
        """The k most probable row ids, hottest first, int64 [k]."""
        return self.permutation(np.arange(min(k, self.rows)))

    def batch(self, i: int, n: int) -> np.ndarray:
        """int64 [n]: the ids of batch i drawn alone (no reuse), the same whatever was drawn before."""
        return self._draw(i, n, self._none, 0)

    def next_batch(self, n: int) -> np.ndarray:
        """int64 [n]: the next batch's ids (batch 0, 1, ... in turn), `reuse` of them from the last one."""
        reuse = round(self.reuse * n) if self._prev.size == n else 0
        out = self._draw(self._batch, n, self._prev, reuse)
        self._prev, self._batch = out, self._batch + 1
        return out

    def _draw(self, i: int, n: int, prev: np.ndarray, reuse: int) -> np.ndarray:
        return _zipf_batch(self.rows, self.alpha, n, _batch_seed(self.seed, self.table, i), self._half_bits,
                           self._keys, prev, reuse)


def per_table(value, tables: int, what: str) -> list[int]:
    """An int for every table, or a list with one per table."""
    values = [value] * tables if np.isscalar(value) else list(value)
    if len(values) != tables:
        raise TraceError(f"{what}: {len(values)} values given for {tables} tables")
    return [int(v) for v in values]


def write_synthetic(path, tables: list[TableInfo], num_batches: int, lookups, draw: Callable[[int, int], np.ndarray],
                    *, meta: dict, chunk_lookups: int = 1 << 20, progress: bool = False) -> TraceHeader:
    """Writes num_batches batches; batch b holds, table after table, draw(t, lookups[t]) ids of
    table t (draw is called in batch order, so it may keep state)."""
    from tqdm import tqdm

    lookups = per_table(lookups, len(tables), "lookups per batch")
    if num_batches < 0 or min(lookups) < 0:
        raise TraceError(f"num_batches {num_batches} and lookups per batch {lookups} must be >= 0")
    with TraceWriter(path, tables, chunk_lookups=chunk_lookups, meta=meta) as w:
        every = np.arange(len(tables))
        for _ in tqdm(range(num_batches), desc="synth", unit="batch", disable=not progress):
            ids = np.concatenate([draw(t, lookups[t]) for t in every])
            w.write_batch(w.header.keys(np.repeat(every, lookups), ids))
    return w.header


def check_seed(seed) -> None:
    """A trace generator's seed: an int in [0, 2**64) (numpy's SeedSequence takes no other)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**64:
        raise TraceError(f"seed {seed!r} must be an int in [0, 2**64)")


def synth_zipf(path, rows, num_batches: int, lookups, *, alpha: float = 1.05, reuse: float = 0.0, seed: int = 0,
               chunk_lookups: int = 1 << 20, progress: bool = False) -> TraceHeader:
    """A Zipf trace: rows = one int per table (or an int for one table); lookups = per table per batch."""
    rows = [int(rows)] if np.isscalar(rows) else [int(r) for r in rows]
    tables = [TableInfo(f"table{t}", r) for t, r in enumerate(rows)]
    samplers = [ZipfSampler(r, alpha, reuse=reuse, seed=seed, table=t) for t, r in enumerate(rows)]
    meta = {"generator": "zipf", "alpha": alpha, "reuse": reuse, "seed": seed}
    return write_synthetic(path, tables, num_batches, lookups, lambda t, n: samplers[t].next_batch(n), meta=meta,
                           chunk_lookups=chunk_lookups, progress=progress)
