"""DLRM locality logs (the dlrm repository's input/dist_emb_*.log) in both directions.

A log describes one table's lookups with three lines of comma-separated values:
    1. the distinct ids, in order of first use
    2. the stack distances that occur, ascending: 0 = first use of an id, d >= 1 = the id was
       the d-th most recently used (d = 1: the same id as the lookup before)
    3. their cumulative probabilities (line 3[j] = P(distance <= line 2[j]))
dlrm's distance d is reuse.stack_distances' value + 1 (and its 0 is FIRST_USE).

Generation follows dlrm's LRU stack-distance model (trace_generate_lru): draw a distance from
line 2/3; 0 takes the next unused id of line 1 (once all are used: the least recently used id),
d >= 1 reuses the id at depth d of the LRU stack. While fewer than max(line 2) ids are in use,
the draw is restricted to distances <= that number (dlrm shrinks the uniform draw the same way).
The stack is a Fenwick tree over access times (one marker per id at its latest use), so a lookup
costs O(log u) instead of dlrm's O(u) list deletion.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numba
import numpy as np

from ..output import PendingFile
from .format import TableInfo, TraceError, TraceHeader, open_trace
from .reuse import stack_distances
from .synth import check_seed, per_table, write_synthetic


@dataclass
class LocalityLog:
    """unique: int64 [u] ids in first-use order; distances: int64 [k] ascending, distances[0] == 0;
    cdf: float64 [k] cumulative probability of each distance."""

    unique: np.ndarray
    distances: np.ndarray
    cdf: np.ndarray

    def check(self, where: str) -> None:
        """Raises TraceError naming `where` and the rule a field breaks."""
        u, d, c = self.unique, self.distances, self.cdf
        if u.size == 0 or u.min() < 0 or np.unique(u).size != u.size:
            raise TraceError(f"{where}: line 1 must list distinct ids >= 0 (got {u.size} values, "
                             f"{np.unique(u).size} distinct, min {u.min() if u.size else None})")
        if d.size == 0 or d[0] != 0 or np.any(np.diff(d) <= 0):
            raise TraceError(f"{where}: line 2 must be stack distances rising from 0, got {d[:5].tolist()}...")
        if d[-1] > u.size:
            raise TraceError(f"{where}: stack distance {int(d[-1])} on line 2 exceeds the {u.size} ids of line 1")
        if c.size != d.size:
            raise TraceError(f"{where}: line 3 has {c.size} probabilities for the {d.size} distances of line 2")
        if np.any(np.diff(c) < 0) or c[0] < 0 or abs(c[-1] - 1.0) > 1e-6:
            raise TraceError(f"{where}: line 3 must be cumulative probabilities rising to 1, "
                             f"got {c[:3].tolist()}..{c[-1]}")


def _parse_line(path: str, number: int, line: str, kind):
    try:
        return np.array([kind(v) for v in line.split(",")], dtype=np.int64 if kind is int else np.float64)
    except ValueError as e:
        raise TraceError(f"{path}: line {number} is not a comma-separated list of {kind.__name__}s ({e})") from None


def read_locality_log(path) -> LocalityLog:
    """Reads a dlrm locality log (three lines: ids, stack distances, cumulative probabilities)."""
    path = os.fspath(path)
    with open(path) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    if len(lines) != 3:
        raise TraceError(f"{path}: a locality log has 3 lines (ids, stack distances, cumulative "
                         f"probabilities), this file has {len(lines)}")
    log = LocalityLog(_parse_line(path, 1, lines[0], int), _parse_line(path, 2, lines[1], int),
                      _parse_line(path, 3, lines[2], float))
    log.check(path)
    return log


def write_locality_log(path, log: LocalityLog) -> None:
    """Writes the three lines as dlrm does (values joined by ', ', floats in Python's repr)."""
    with PendingFile(path) as out, open(out.temp, "w") as f:
        f.writelines(", ".join(map(repr, values)) + "\n" for values in (log.unique.tolist(), log.distances.tolist(), [float(c) for c in log.cdf]))


def profile(ids) -> LocalityLog:
    """The locality log of one table's ids, in lookup order (one lookup = one request)."""
    ids = np.asarray(ids, dtype=np.int64).ravel()
    if ids.size == 0:
        raise TraceError("cannot profile an empty id sequence")
    dist = stack_distances(ids) + 1  # FIRST_USE (-1) becomes dlrm's 0
    values, first = np.unique(ids, return_index=True)
    distances, counts = np.unique(dist, return_counts=True)
    return LocalityLog(values[np.argsort(first)], distances, np.cumsum(counts) / ids.size)


def profile_trace(path, *, progress: bool = False) -> tuple[TraceHeader, list[LocalityLog | None]]:
    """One log per table of a trace (None for a table never looked up). Loads the trace's keys."""
    with open_trace(path) as r:
        keys = r.read_all().keys
        header = r.header
    table = header.table_of(keys)
    base = header.table_base
    logs = []
    for t in range(len(header.tables)):
        ids = keys[table == t] - base[t]
        logs.append(profile(ids) if ids.size else None)
    return header, logs


@numba.njit(cache=True)
def _kth(tree, k):
    """Index of the k-th marker (1-based k) in a Fenwick tree over times 0..cap-1."""
    pos = 0
    step = 1
    while step * 2 < tree.size:
        step *= 2
    while step > 0:
        nxt = pos + step
        if nxt < tree.size and tree[nxt] < k:
            pos = nxt
            k -= tree[nxt]
        step //= 2
    return pos


@numba.njit(cache=True)
def _add(tree, pos, v):
    i = pos + 1
    while i < tree.size:
        tree[i] += v
        i += i & -i


@numba.njit(cache=True)
def _generate(uniforms, unique, distances, cdf, last, owner, tree, state):
    """Ids for the draws `uniforms`; state = [now (next time), live (ids in use), fresh (next
    unused id of line 1)]. Markers are repacked to times 0..live-1 when the times run out."""
    now, live, fresh = state[0], state[1], state[2]
    u, cap, max_d = unique.size, owner.size, distances[-1]
    out = np.empty(uniforms.size, np.int64)
    for i in range(uniforms.size):
        if now == cap:  # repack: live <= u markers into times 0..live-1 (cap = 2u + 2)
            t = 0
            for q in range(cap):
                if last[owner[q]] == q:
                    owner[t] = owner[q]
                    last[owner[t]] = t
                    t += 1
            tree[:] = 0
            for q in range(t):
                _add(tree, q, 1)
            now = t
        r = uniforms[i]
        if live < max_d:  # only distances up to the ids in use can be reused
            r *= cdf[np.searchsorted(distances, live, side="right") - 1]
        d = distances[min(np.searchsorted(cdf, r, side="left"), cdf.size - 1)]
        if d == 0 and fresh < u:
            key = fresh
            fresh += 1
        else:  # depth d from the top is the (live - d + 1)-th oldest marker; a first use with
            key = owner[_kth(tree, live - d + 1 if d > 0 else 1)]  # every id used: the LRU one
        if last[key] >= 0:
            _add(tree, last[key], -1)
        else:
            live += 1
        owner[now] = key
        last[key] = now
        _add(tree, now, 1)
        now += 1
        out[i] = unique[key]
    state[0], state[1], state[2] = now, live, fresh
    return out


class LocalityGenerator:
    """Draws ids from a locality log; uniforms come from np.random.default_rng(seed), one per id,
    so next(a) followed by next(b) gives the same ids as next(a + b)."""

    def __init__(self, log: LocalityLog, seed: int = 0):
        log.check("locality log")
        self.log = log
        u = log.unique.size
        self._last = np.full(u, -1, np.int64)
        self._owner = np.zeros(2 * u + 2, np.int64)
        self._tree = np.zeros(2 * u + 3, np.int64)
        self._state = np.zeros(3, np.int64)
        self._rng = np.random.default_rng(seed)

    def next(self, n: int) -> np.ndarray:
        return _generate(self._rng.random(n), self.log.unique, self.log.distances, self.log.cdf.astype(np.float64),
                         self._last, self._owner, self._tree, self._state)


def synth_locality(path, logs: list[LocalityLog], num_batches: int, lookups, *, rows=None, seed: int = 0,
                   names: list[str] | None = None, chunk_lookups: int = 1 << 20,
                   progress: bool = False) -> TraceHeader:
    """A trace with one table per log; rows: None (max id of line 1 + 1), an int, or one per table."""
    check_seed(seed)
    rows = [int(log.unique.max()) + 1 for log in logs] if rows is None else per_table(rows, len(logs), "rows")
    names = names or [f"table{t}" for t in range(len(logs))]
    gens = [LocalityGenerator(log, seed=int(np.random.SeedSequence([seed, t]).generate_state(1)[0]))
            for t, log in enumerate(logs)]
    tables = [TableInfo(n, r) for n, r in zip(names, rows)]
    meta = {"generator": "locality", "seed": seed}
    return write_synthetic(path, tables, num_batches, lookups, lambda t, n: gens[t].next(n), meta=meta,
                           chunk_lookups=chunk_lookups, progress=progress)
