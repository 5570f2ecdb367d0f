"""simulate(): hit ratios of a policy and a stack of tier sizes on a trace.

Modes: "batch" is the engine (per-batch dedup, a batch's rows never evicted by that batch, the
policy sees the batch's rows in batch order after its victims are chosen); "request" treats
every lookup as one request, what libCacheSim and the caching literature simulate.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import numpy as np

from tieredemb.trace.format import TraceSource
from tieredemb.trace.keys import check_keys, check_offsets, compact

from .errors import SimError, check_below, too_wide
from .kernel import next_use, run_batches
from .lru import LruTier
from .state import (
    BELADY,
    CLEAN_DROPS,
    DIRTY_WB,
    EVICTIONS,
    HITS,
    LOOKAHEAD,
    LRU,
    MISSES,
    POLICIES,
    S3FIFO,
    WRITES,
    make_buffers,
    make_state,
)

MODES = ("batch", "request")
_SLICE_LOOKUPS = 1 << 20  # lookups per kernel call (progress bar granularity)
_STREAM_DENSE_ROWS = 1 << 24  # stream a trace file with dense per-key state up to this many rows


def parse_policy(name: str, lookahead: int | None = None) -> tuple[int, int]:
    """'lru' | 'lfu' | 'fifo' | 'clock' | 's3fifo' | 'belady' | 'lookahead' (+ lookahead=k) |
    'lookahead-k' -> (policy code, k or 0)."""
    base, _, k = str(name).lower().partition("-")
    if base not in POLICIES:
        raise SimError(f"unknown policy {name!r} (known: {', '.join(POLICIES)}, lookahead-K)")
    if base != "lookahead":
        if k:
            raise SimError(f"unknown policy {name!r}: only lookahead takes a suffix (lookahead-K)")
        return POLICIES.index(base), 0
    if k:
        if not k.isdigit():
            raise SimError(f"policy {name!r}: K in lookahead-K must be a positive integer")
        lookahead = int(k)
    if lookahead is None or int(lookahead) < 1:
        raise SimError(f"policy {name!r} needs a window of K >= 1 batches (lookahead-K or lookahead=K), "
                       f"got {lookahead}")
    return LOOKAHEAD, int(lookahead)


def parse_stack(policy, capacities, lookahead: int | None, mode: str) -> tuple[list[int], list[str], list[int], int]:
    """Checks a tier stack: (policy codes, policy names, capacities, lookahead window or 0)."""
    caps = [capacities] if np.isscalar(capacities) else list(capacities)
    if not caps:
        raise SimError("capacities: give at least one tier capacity (rows)")
    for c in caps:
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or not 0 < c < 2**63:
            raise SimError(f"capacity {c!r} must be a positive integer number of rows, below 2**63")
    names = [policy] if isinstance(policy, str) else list(policy)
    if len(names) == 1:
        names = names * len(caps)
    if len(names) != len(caps):
        raise SimError(f"{len(names)} policies for {len(caps)} tiers: give one policy, or one per tier")
    parsed = [parse_policy(p, lookahead) for p in names]
    windows = {k for _, k in parsed if k}
    if len(windows) > 1:
        raise SimError(f"one lookahead window per simulation, got {sorted(windows)}")
    if mode not in MODES:
        raise SimError(f"unknown mode {mode!r} (known: {', '.join(MODES)})")
    for (code, _), cap in zip(parsed, caps):
        if code == S3FIFO and int(cap * 0.1) < 2:
            raise SimError(f"s3fifo needs capacity >= 20 rows (its small queue holds int(0.1 * C) >= 2), got {cap}")
    return ([c for c, _ in parsed], [POLICIES[c] + (f"-{k}" if k else "") for c, k in parsed], [int(c) for c in caps],
            windows.pop() if windows else 0)


def _per_table(names, hits, misses) -> list[dict] | None:
    if len(hits) < 2:
        return None
    names = names or [str(i) for i in range(len(hits))]
    return [{"table": names[i], "hits": int(h), "misses": int(m), "hit_ratio": float(h / (h + m)) if h + m else 0.0}
            for i, (h, m) in enumerate(zip(hits, misses))]


@dataclass
class TierResult:
    """One cache tier. hits/misses count lookups read through the tier (per unique key per batch
    in batch mode); writes count rows written into it from the tier above (dirty victims);
    rows_in = misses + writes (rows moved in), rows_out = dirty_writebacks (rows written below)."""

    name: str
    policy: str
    capacity: int
    hits: int = 0
    misses: int = 0
    writes: int = 0
    evictions: int = 0
    dirty_writebacks: int = 0
    clean_drops: int = 0
    per_table: list[dict] | None = None

    @property
    def hit_ratio(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    @property
    def miss_ratio(self) -> float:
        n = self.hits + self.misses
        return self.misses / n if n else 0.0

    @property
    def rows_in(self) -> int:
        return self.misses + self.writes

    @property
    def rows_out(self) -> int:
        return self.dirty_writebacks

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(hit_ratio=self.hit_ratio, miss_ratio=self.miss_ratio, rows_in=self.rows_in, rows_out=self.rows_out)
        if d["per_table"] is None:
            del d["per_table"]
        return d


@dataclass
class SimResult:
    mode: str
    train: bool
    lookups: int
    batches: int
    tiers: list[TierResult] = field(default_factory=list)
    bottom_reads: int = 0   # rows read from below the last tier (its misses)
    bottom_writes: int = 0  # rows written below the last tier (its dirty victims)

    @property
    def hit_ratio(self) -> float:
        """Tier 0's hit ratio."""
        return self.tiers[0].hit_ratio

    def to_dict(self) -> dict:
        return {"mode": self.mode, "train": self.train, "lookups": self.lookups, "batches": self.batches,
                "tiers": [t.to_dict() for t in self.tiers], "bottom_reads": self.bottom_reads,
                "bottom_writes": self.bottom_writes}


class Simulator:
    """Streaming simulation over keys in [0, nkeys): feed() batches (or chunks of them) in order,
    then result(). Policies that look ahead (belady, lookahead-k) need next_use for the lookups
    fed (see simulate(), which computes it over the whole trace)."""

    def __init__(self, policy, capacities, nkeys: int, *, mode: str = "batch", train: bool = False,
                 lookahead: int | None = None, table_of: np.ndarray | None = None, table_names=None):
        self.codes, self.names, self.capacities, self.lookahead = parse_stack(policy, capacities, lookahead, mode)
        self.needs_future = any(c in (BELADY, LOOKAHEAD) for c in self.codes)
        self.mode, self.train, self.nkeys = mode, bool(train), int(nkeys)
        # A tier at least as large as the key space never evicts: its arrays need only nkeys slots.
        self._caps = [max(1, min(c, self.nkeys)) for c in self.capacities]
        self._st = make_state(self.codes, self._caps, max(self.nkeys, 1), 1)
        self._knext = np.zeros(max(self.nkeys, 1) if self.needs_future else 1, np.int64)
        self._seen = np.full(max(self.nkeys, 1) if mode == "batch" else 1, -1, np.int64)  # per-batch dedup
        self._table_of = np.zeros(1, np.int64) if table_of is None else np.ascontiguousarray(table_of, np.int64)
        self._table_names = table_names
        ntables = 1 if table_of is None else max(int(self._table_of.max(initial=0)) + 1, len(table_names or []))
        self._tstats = np.zeros((len(self._caps), max(1, ntables), 2), np.int64)
        self._err = np.full(4, -1, np.int64)
        self.lookups = 0
        self.batches = 0

    def feed(self, keys: np.ndarray, batch_offsets: np.ndarray | None = None, next_batch: np.ndarray | None = None,
             bar=None) -> None:
        """keys: int64 [n] in [0, nkeys); batch_offsets [b+1] or None (every lookup its own
        batch); next_batch [n]: for each lookup the index of the next batch that uses its key
        (kernel.next_use over the whole trace; belady / lookahead)."""
        keys = check_keys(keys)
        check_below(keys, self.nkeys)
        per_request = self.mode == "request" or batch_offsets is None
        offsets = np.zeros(1, np.int64) if per_request else check_offsets(batch_offsets, keys.size)
        nb = keys.size if per_request else offsets.size - 1
        if self.needs_future and (next_batch is None or next_batch.size != keys.size):
            raise SimError(f"policies {self.names} look ahead: feed() needs next_batch for every lookup")
        nxt = np.ascontiguousarray(next_batch, np.int64) if self.needs_future else np.zeros(0, np.int64)
        width = 1 if per_request else int(np.diff(offsets).max(initial=1))
        if self._st.buf.shape[2] < width:  # scratch only: nothing in it survives a batch
            self._st = self._st._replace(buf=make_buffers(len(self._caps), width))
        b = 0
        while b < nb:
            if per_request:
                e = min(nb, b + _SLICE_LOOKUPS)
            else:
                e = int(np.searchsorted(offsets, offsets[b] + _SLICE_LOOKUPS, "right")) - 1
                e = min(nb, max(e, b + 1))
            if not run_batches(*self._st, keys, offsets, b, e, self.batches, per_request, self.train, nxt,
                               self._knext, self._seen, self.lookahead, self._table_of, self._tstats, self._err):
                batch, tier, rows = (int(x) for x in self._err[:3])
                raise too_wide(batch, rows, tier, self.capacities[tier])
            if bar is not None:
                bar.update(int(e - b) if per_request else int(offsets[e] - offsets[b]))
            b = e
        self.lookups += int(keys.size)
        self.batches += int(nb)

    def result(self) -> SimResult:
        sc = self._st.sc
        ntiers = len(self._caps)
        tiers = []
        for l in range(ntiers):
            s = sc[l]
            tiers.append(TierResult(f"tier{l}", self.names[l], self.capacities[l], int(s[HITS]), int(s[MISSES]),
                                    int(s[WRITES]), int(s[EVICTIONS]), int(s[DIRTY_WB]), int(s[CLEAN_DROPS]),
                                    _per_table(self._table_names, self._tstats[l, :, 0], self._tstats[l, :, 1])))
        return SimResult(self.mode, self.train, self.lookups, self.batches, tiers,
                         int(sc[ntiers, MISSES]), int(sc[ntiers, WRITES]))


def _load(trace, batch_offsets):
    """(keys, offsets or None, table_base or None, table names or None) from arrays, a Chunk,
    an iterable of Chunks (concatenated), a TraceSource, or a trace path in any format
    tieredemb.trace reads (read whole)."""
    if isinstance(trace, (str, os.PathLike)):
        from tieredemb.trace.detect import open_any

        with open_any(trace) as r:
            return _load(r, None)
    if isinstance(trace, TraceSource):
        chunk = trace.read_all()
        return chunk.keys, chunk.batch_offsets, trace.header.table_base, [t.name for t in trace.header.tables]
    if hasattr(trace, "keys") and hasattr(trace, "batch_offsets"):
        return trace.keys, trace.batch_offsets, None, None
    if not isinstance(trace, (np.ndarray, list, tuple)) and hasattr(trace, "__iter__"):
        chunks = list(trace)
        if chunks and all(hasattr(c, "batch_offsets") for c in chunks):
            keys = np.concatenate([np.asarray(c.keys, np.int64) for c in chunks])
            sizes = np.concatenate([np.diff(np.asarray(c.batch_offsets, np.int64)) for c in chunks])
            return keys, np.concatenate([[0], np.cumsum(sizes)]), None, None
        trace = np.asarray(chunks)
    return trace, batch_offsets, None, None


def simulate(keys, batch_offsets=None, policy="lru", capacities=(), *, mode: str = "batch", train: bool = False,
             lookahead: int | None = None, table_base=None, progress: bool = False) -> SimResult:
    """Simulates a tier stack over a trace.

    keys: int64 [N] global row keys (>= 0), or a tieredemb.trace Chunk or iterable of Chunks,
    or a trace: a file path in any format tieredemb.trace reads, or an open TraceSource for
    reading options (tieredemb.trace.open_any); a trace is streamed chunk by chunk when no policy
    looks ahead and its rows fit dense per-row state, else read whole;
    batch_offsets: int64 [B+1] (None: every lookup its own batch); policy: a name (see
    parse_policy) or one per tier; capacities: rows per tier, top to bottom (below them a
    bottom that holds every row); train: every looked-up row becomes dirty in tier 0, so victims
    are written down; table_base: int64 [T] first key of each table, for a per-table breakdown
    (taken from the trace header when keys is a path).
    """
    if isinstance(keys, (str, os.PathLike)):
        from tieredemb.trace.detect import open_any

        with open_any(keys) as source:
            return simulate(source, None, policy, capacities, mode=mode, train=train, lookahead=lookahead,
                            table_base=table_base, progress=progress)
    if isinstance(keys, TraceSource):
        streamed = _simulate_stream(keys, policy, capacities, mode, train, lookahead, progress)
        if streamed is not None:
            return streamed
    keys, batch_offsets, header_base, names = _load(keys, batch_offsets)
    if table_base is None:
        table_base = header_base
    keys = check_keys(keys)
    if mode not in MODES:
        raise SimError(f"unknown mode {mode!r} (known: {', '.join(MODES)})")
    offsets = None if mode == "request" or batch_offsets is None else check_offsets(batch_offsets, keys.size)
    dense, nkeys, original = compact(keys)
    table_of = None
    if table_base is not None and len(table_base) > 1:
        table_base = np.asarray(table_base, np.int64)
        universe = original if original is not None else np.arange(nkeys, dtype=np.int64)
        table_of = np.searchsorted(table_base, universe, "right").astype(np.int64) - 1
        if names is None or len(names) != len(table_base):
            names = [str(i) for i in range(len(table_base))]
    codes, _, caps, _ = parse_stack(policy, capacities, lookahead, mode)
    if codes == [LRU] and not train:
        return _lru_one_pass(dense, offsets, nkeys, caps[0], mode, table_of, names)
    sim = Simulator(policy, capacities, nkeys, mode=mode, train=train, lookahead=lookahead, table_of=table_of,
                    table_names=names)
    nxt = None
    if sim.needs_future:
        nxt = np.empty(dense.size, np.int64)
        next_use(dense, np.zeros(1, np.int64) if offsets is None else offsets, offsets is None,
                 np.empty(max(nkeys, 1), np.int64), nxt)
    with _progress(progress, keys.size, sim.names) as bar:
        sim.feed(dense, offsets, nxt, bar)
    return sim.result()


class _progress:
    """A tqdm bar over lookups (or nothing), closed on exit."""

    def __init__(self, on: bool, total: int, policies: list[str]):
        self.bar = None
        if on:
            from tqdm import tqdm

            self.bar = tqdm(total=int(total), unit="lookup", unit_scale=True, desc=f"simulate {'/'.join(policies)}")

    def __enter__(self):
        return self.bar

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


def _simulate_stream(source: TraceSource, policy, capacities, mode, train, lookahead, progress) -> SimResult | None:
    """A trace chunk by chunk (memory: the state, not the trace), when every key fits a dense
    table and no policy looks ahead; None otherwise (the caller reads it whole)."""
    codes, names, caps, _ = parse_stack(policy, capacities, lookahead, mode)
    h = source.header
    if h.total_rows > _STREAM_DENSE_ROWS or any(c in (BELADY, LOOKAHEAD) for c in codes):
        return None
    table_of = h.table_of(np.arange(h.total_rows, dtype=np.int64)) if len(h.tables) > 1 else None
    tables = [t.name for t in h.tables]
    if codes == [LRU] and not train:
        sim = LruTier(h.total_rows, caps[0], h.num_lookups, per_request=mode == "request", table_of=table_of)
    else:
        sim = Simulator(policy, capacities, h.total_rows, mode=mode, train=train, lookahead=lookahead,
                        table_of=table_of, table_names=tables)
    lookups = 0
    with _progress(progress, h.num_lookups, names) as bar:
        for chunk in source.chunks():
            try:
                if isinstance(sim, LruTier):
                    sim.feed(chunk.keys, None if mode == "request" else chunk.batch_offsets)
                    if bar is not None:
                        bar.update(chunk.keys.size)
                else:
                    sim.feed(chunk.keys, None if mode == "request" else chunk.batch_offsets, None, bar)
            except SimError as e:
                raise SimError(f"{source.path} (chunk from batch {chunk.first_batch}): {e}") from None
            lookups += chunk.keys.size
    return _lru_result(sim, mode, lookups, tables) if isinstance(sim, LruTier) else sim.result()


def _lru_one_pass(dense, offsets, nkeys: int, cap: int, mode: str, table_of, names) -> SimResult:
    """One LRU tier without write-backs: lru.LruTier, ~3x faster than the list kernel and equal
    to it (tests)."""
    tier = LruTier(nkeys, cap, dense.size, per_request=offsets is None, table_of=table_of)
    tier.feed(dense, offsets)
    return _lru_result(tier, mode, dense.size, names)


def _lru_result(tier: LruTier, mode: str, lookups: int, names) -> SimResult:
    """The SimResult of an LruTier. Evictions: every insertion beyond the rows the tier ends up holding."""
    hits, misses = int(tier.hits.sum()), int(tier.misses.sum())
    evictions = misses - min(tier.cap, tier.distinct)
    result = TierResult("tier0", "lru", tier.cap, hits, misses, 0, evictions, 0, evictions,
                        _per_table(names, tier.hits, tier.misses))
    return SimResult(mode, False, int(lookups), tier.batches, [result], misses, 0)
