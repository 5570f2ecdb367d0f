"""The planner: every table's tier-0 rows, and whether its rows are stored in host memory or on
SSD, under one budget per tier, chosen from the tables' access traces (MTrainS' placement from
locality).

Model. For every table its exact LRU miss-ratio curve in the engine's batch mode (each lookup's
stack distance, one pass: tieredemb.trace.reuse) gives the rows tier 0 misses per batch at any size;
the engine's tier 0 gives each table of a collection a partition of its own, so these are the
hits it will measure. A batch costs, per table, the rows crossing into tier 0 (its misses; when
training each is also written back once evicted) times the bytes of a row over the
host-to-tier-0 bandwidth, plus, for a table stored on SSD, the same rows over the SSD's
bandwidth. The model counts row moves only: kernels and dedup cost the same under any plan.

Choice. Tier 0's budget is split by a multiple-choice knapsack over each table's curve grid
(geometric sizes, and the sizes where its curve falls): the split of least predicted seconds,
over 4096 or more slices of the budget, whatever the curves' shape (a scan's cliff included); the
bytes the slices leave go greedily to the step that saves the most per byte (a table whose size
reaches all its rows sits whole in tier 0). Then host memory holds whole tables, the ones whose
SSD reads cost most per byte first, while host_bytes lasts; the rest go to SSD. The planner also
prices the two obvious splits of tier 0, in proportion to the tables' bytes and in equal shares,
with the same model and the same placement rule.

    plans = tieredemb.plan({"user": (ids, offsets), ...}, {"user": (rows, row_bytes), ...},
                           cache_bytes="1GiB")
    print(tieredemb.planner.report(plans))
    ebc = tieredemb.TieredEmbeddingBagCollection(tables, plan=plans["planned"])
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import operator
import os

import numpy as np

from .config import parse_budget

STRATEGIES = ("planned", "proportional", "equal")


@dataclasses.dataclass(frozen=True)
class Bandwidth:
    """Bytes per second of rows moving between host memory and tier 0 (PCIe on a GPU, memory on
    a CPU), and read from or written to the SSD store."""

    to_tier0: float = 20e9
    ssd: float = 2e9

    def __post_init__(self):
        for name in ("to_tier0", "ssd"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (0 < v < float("inf")):
                raise ValueError(f"bandwidth {name} must be a finite number > 0 of bytes/s, got {v!r}")
            object.__setattr__(self, name, float(v))


@dataclasses.dataclass
class TablePlan:
    """One table under a plan: its rows and row bytes; tier-0 rows (all of them: whole in tier
    0) and its store ('host' or 'ssd'); what the model predicts per batch: distinct rows looked
    up, tier 0's hit ratio, rows read from SSD, bytes moved, seconds; and the table's curve
    (tier-0 sizes and hit ratios there)."""

    name: str
    rows: int
    row_bytes: int
    cache_rows: int
    store: str
    lookups_per_batch: float
    tier0_hit: float
    ssd_rows_per_batch: float
    bytes_per_batch: float
    seconds_per_batch: float
    curve_sizes: list
    curve_hits: list


@dataclasses.dataclass
class Plan:
    """Every table's tiers under one strategy ('planned', 'proportional' or 'equal')."""

    strategy: str
    tables: list[TablePlan]
    train: bool
    bandwidth: Bandwidth

    @property
    def seconds_per_batch(self) -> float:
        return sum(t.seconds_per_batch for t in self.tables)

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "train": self.train, "bandwidth": dataclasses.asdict(self.bandwidth),
                "seconds_per_batch": self.seconds_per_batch, "tables": [dataclasses.asdict(t) for t in self.tables]}


def load(plan) -> dict:
    """A planner.Plan, its to_dict(), or the path of `tieredemb plan --json`'s file (its
    'planned' entry) -> {table: (tier-0 rows, store, rows, row bytes or None)}."""
    what = "plan"
    try:
        if isinstance(plan, (str, os.PathLike)):
            what = f"plan file {os.fspath(plan)}"
            with open(plan) as f:
                plan = json.load(f)["planned"]
        if not isinstance(plan, dict):
            plan = plan.to_dict()
        return {t["name"]: (int(t["cache_rows"]), t["store"], int(t["rows"]), t.get("row_bytes"))
                for t in plan["tables"]}
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # (an OSError stays one: it names the file)
        raise ValueError(f"{what}: not a plan (a planner.Plan, its to_dict(), or the file `tieredemb plan --json` "
                         f"writes, whose 'planned' entry lists 'tables'): {type(e).__name__}: {e}") from None


class _Curve:
    """A table's exact LRU misses per batch (batch mode) at any tier-0 size of at least its widest
    batch, from every counted lookup's stack distance (one pass; a size's misses are then one
    binary search: the planner asks at many sizes), and a grid of sizes to choose from and report."""

    def __init__(self, ids, offsets, rows: int, points: int, warmup: int = 0):
        from .trace.reuse import DUPLICATE, FIRST_USE, stack_distances

        keys = np.asarray(ids, dtype=np.int64)
        offsets = np.asarray(offsets, dtype=np.int64)
        self.rows = rows
        self.batches = max(1, len(offsets) - 1 - warmup)  # the counted ones: after the warm-up
        d = stack_distances(keys, offsets) if keys.size else np.zeros(0, np.int64)
        looked_up = d != DUPLICATE  # a repeat inside its batch is no lookup of tier 0
        upto = np.concatenate([[0], np.cumsum(looked_up)])
        widest = int((upto[offsets[1:]] - upto[offsets[:-1]]).max(initial=0))  # distinct rows of a batch
        d = d[offsets[warmup]:][looked_up[offsets[warmup]:]]
        self.lookups = d.size / self.batches  # distinct rows per counted batch
        d[d == FIRST_USE] = np.iinfo(np.int64).max  # a miss at any size
        self._distances = np.sort(d)  # a tier of C rows hits a lookup iff its distance < C
        self.smallest = min(rows, max(1, widest))  # batch mode: a batch fits in the tier
        grid = np.geomspace(self.smallest, rows, points).astype(np.int64)
        # and the sizes where the curve falls: one past the distances at `points` quantiles (a
        # scan's cliff, all of whose lookups hit once its cycle fits, lies on no geometric grid)
        seen = self._distances[:np.searchsorted(self._distances, np.iinfo(np.int64).max, "left")]
        knees = seen[np.linspace(0, seen.size - 1, points).astype(np.int64)] + 1 if seen.size else grid[:0]
        self.sizes = np.unique(np.clip(np.concatenate([grid, knees, [self.smallest, rows]]), self.smallest, rows))

    def misses_at(self, size: int) -> float:
        """Misses per batch of a tier of `size` rows (at least the widest batch)."""
        size = min(max(int(size), self.smallest), self.rows)
        hits = int(np.searchsorted(self._distances, size, "left"))
        return (self._distances.size - hits) / self.batches


def _misses(curve: _Curve, cache: int, store: str) -> float:
    """Rows tier 0 reads in per batch: none for a table held whole in host memory (its tier 0 is
    the table itself: the collection groups such tables apart, with no tier 0), else the curve's
    (a table whole in tier 0 over SSD still reads each row once)."""
    return 0.0 if cache >= curve.rows and store == "host" else curve.misses_at(cache)


def _seconds(row_bytes, curve: _Curve, cache: int, store: str, bw: Bandwidth, train: bool) -> float:
    """A table's row moves' seconds per batch (_price's, without its report)."""
    m0 = _misses(curve, cache, store)
    return (2 if train else 1) * row_bytes * (m0 / bw.to_tier0 + (m0 / bw.ssd if store == "ssd" else 0.0))


def _price(name, rows, row_bytes, curve: _Curve, cache: int, store: str, bw: Bandwidth, train: bool) -> TablePlan:
    moves = 2 if train else 1  # a trained row read up is written back when evicted
    m0 = _misses(curve, cache, store)
    ssd = m0 if store == "ssd" else 0.0
    seconds = _seconds(row_bytes, curve, cache, store, bw, train)
    hits = [1 - _misses(curve, s, store) / curve.lookups if curve.lookups else 0.0 for s in curve.sizes]
    return TablePlan(name, rows, row_bytes, int(cache), store, curve.lookups,
                     1 - m0 / curve.lookups if curve.lookups else 0.0, ssd, moves * row_bytes * (m0 + ssd), seconds,
                     curve.sizes.tolist(), hits)


def _whole(name: str, value, what: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} {value!r} must be a whole number of {what}") from None


def _checked_trace(name, ids, offsets, rows: int) -> tuple:
    """A table's trace as int64 arrays: ids in [0, rows), offsets [B + 1] from 0 to len(ids),
    non-decreasing. ValueError naming the table and the first value that breaks a rule."""
    ids, offsets = np.asarray(ids), np.asarray(offsets)
    for what, a in (("ids", ids), ("offsets", offsets)):
        if a.size and a.dtype.kind not in "iu":
            raise ValueError(f"table {name!r}: trace {what} must be integers, got {a.dtype}")
    ids, offsets = ids.astype(np.int64, copy=False), offsets.astype(np.int64, copy=False)
    if ids.ndim != 1 or offsets.ndim != 1 or len(offsets) < 2:
        raise ValueError(f"table {name!r}: a trace is ids [N] and batch offsets [B + 1] with B >= 1, got shapes "
                         f"{ids.shape} and {offsets.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= rows):
        raise ValueError(f"table {name!r}: trace id {int(ids.min() if ids.min() < 0 else ids.max())} is outside "
                         f"its rows [0, {rows})")
    if offsets[0] != 0 or offsets[-1] != ids.size or (np.diff(offsets) < 0).any():
        raise ValueError(f"table {name!r}: batch offsets must run from 0 to the {ids.size} ids, non-decreasing; "
                         f"got {offsets[0]} .. {offsets[-1]}")
    return ids, offsets


def plan(traces: dict, tables: dict, *, cache_bytes, host_bytes=None, bandwidth: Bandwidth = Bandwidth(),
         train: bool = True, points: int = 48, warmup: int = 0) -> dict[str, Plan]:
    """The three plans ('planned', 'proportional', 'equal') of a set of tables.

    traces: {table: (ids int [N] of the table's own rows, batch offsets [B + 1])}; tables:
    {table: (rows, bytes of a stored row: weights and optimizer state)}. cache_bytes: tier 0's
    budget over every table. host_bytes: host memory for tables stored whole there (the rest go
    to SSD); None: every table in host memory (no SSD). bandwidth: each tier's bytes per second
    (planner.Bandwidth: given, or measured by planner.probe()), which price the moves. train:
    rows are written back too. points: sizes on each table's curve grid (>= 2; geometric from
    its widest batch to its rows, and the sizes where the curve falls). warmup: the traces'
    first batches only fill tier 0, and the predictions (hit ratios, bytes
    and seconds per batch) are of the batches after them: a steady state, where a trace that
    starts cold would count every first touch as a miss any plan pays (the same warm-up for
    every table: their traces are of the same batches). ValueError if tier 0 cannot hold every
    table's widest batch (the least a tier is planned at), or warmup leaves a trace no batch."""
    if not isinstance(bandwidth, Bandwidth):
        raise TypeError(f"bandwidth must be a planner.Bandwidth (or planner.probe()'s), got {bandwidth!r}")
    if not isinstance(train, bool):
        raise TypeError(f"train must be True or False, got {train!r}")
    if set(traces) != set(tables):
        raise ValueError(f"traces and tables name different tables: {sorted(set(traces) ^ set(tables))}")
    if not tables:
        raise ValueError("no tables to plan")
    for n, (rows, row_bytes) in tables.items():
        for what, v in (("rows", rows), ("row bytes", row_bytes)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
                raise ValueError(f"table {n!r}: {what} {v!r} must be a whole number > 0")
    tables = {n: (int(rows), int(row_bytes)) for n, (rows, row_bytes) in tables.items()}
    warmup = _whole("warmup", warmup, "batches")
    points = _whole("points", points, "curve points")
    if points < 2:
        raise ValueError(f"points {points} must be >= 2 (a curve's grid runs from its widest batch to all its rows)")
    for n, trace in traces.items():
        if not isinstance(trace, (tuple, list)) or len(trace) != 2:
            raise ValueError(f"table {n!r}: a trace is a pair (ids, batch offsets), got {type(trace).__name__}"
                             + (f" of {len(trace)}" if isinstance(trace, (tuple, list)) else ""))
    traces = {n: _checked_trace(n, *traces[n], tables[n][0]) for n in tables}
    batches = {n: len(offsets) - 1 for n, (_, offsets) in traces.items()}
    if len(set(batches.values())) > 1:
        raise ValueError(f"the traces must be of the same batches (one warm-up for all), got batch counts {batches}")
    count = next(iter(batches.values()))
    if not 0 <= warmup < count:
        raise ValueError(f"warmup {warmup} must be in [0, {count}): the traces have {count} batches, some left "
                         "to count")
    cache_budget, host_budget = parse_budget("cache_bytes", cache_bytes), parse_budget("host_bytes", host_bytes)
    if cache_budget is None:
        raise ValueError("cache_bytes is required: tier 0's budget over every table")
    curves = {n: _Curve(*traces[n], tables[n][0], points, warmup) for n in tables}
    least = sum(curves[n].smallest * tables[n][1] for n in tables)
    if cache_budget < least:
        raise ValueError(f"cache_bytes {cache_budget} cannot hold every table's widest batch ({least} bytes): "
                         "give tier 0 more, or plan from smaller batches")
    plans = {}
    for strategy in STRATEGIES:
        # Where a table is stored prices its misses, and its misses decide where it is stored:
        # split and place in turn until the placement holds (a few rounds).
        store = {n: "host" for n in tables}
        for _ in range(4):
            cache = _split(strategy, cache_budget, tables, curves, store, bandwidth, train)
            placed = _place(host_budget, tables, curves, cache, bandwidth, train)
            if placed == store:
                break
            store = placed
        plans[strategy] = Plan(strategy, [_price(n, *tables[n], curves[n], cache[n], store[n], bandwidth, train)
                                          for n in tables], train, bandwidth)
    # The knapsack is exact over the curves' grids; a simple split's sizes lie off them, and the
    # placement rule is shared: the planned split is the cheapest of the three, as predicted.
    cheapest = min(plans.values(), key=lambda p: p.seconds_per_batch)
    if cheapest.seconds_per_batch < plans["planned"].seconds_per_batch:
        plans["planned"] = dataclasses.replace(cheapest, strategy="planned")
    return plans


def _split(strategy, budget, tables, curves, store, bw, train) -> dict:
    """Tier-0 rows per table (store: each table's, which prices its misses)."""
    names = list(tables)
    lo = {n: curves[n].smallest for n in names}
    if strategy != "planned":
        return _shares(strategy, budget, tables, lo)

    def cost(n, s):
        return _seconds(tables[n][1], curves[n], s, store[n], bw, train)

    left = budget - sum(lo[n] * tables[n][1] for n in names)
    size = _knapsack(names, lo, left, tables, curves, cost)
    return _top_up(size, left - sum((size[n] - lo[n]) * tables[n][1] for n in names), tables, curves, cost)


def _knapsack(names, lo, left, tables, curves, cost) -> dict:
    """Each table's size from its curve's sizes, of least total cost whose bytes past every
    table's least fit in `left`: a multiple-choice knapsack over slices of the budget. A size's
    bytes round up to whole slices, and the slices run to the budget's plus one a table (a size
    that fits exactly may weigh one more than the budget's whole slices: a cliff reached with the
    last bytes is a choice too); the best choice within u slices whose bytes fit, u from the most
    down, is taken (at the budget's whole slices every choice fits). Each table wastes less than a
    slice, which _top_up spends. The curves need not be convex: a cliff is reached wherever
    reaching it pays, where a greedy by gain per byte may spend the bytes first on a table whose
    first steps save more per byte and then cannot reach it."""
    slices = min(1 << 16, max(4096, 256 * len(names)))
    unit = max(1, -(-left // slices))
    fits = left // unit  # (slices every choice within which fits)
    top = fits + len(names)
    least = np.zeros(top + 1)  # least cost of the tables so far within u slices
    picks = []
    for n in names:
        sizes = curves[n].sizes[(curves[n].sizes > lo[n]) & ((curves[n].sizes - lo[n]) * tables[n][1] <= left)]
        sizes = np.concatenate([[lo[n]], sizes])
        weight = -(-(sizes - lo[n]) * tables[n][1] // unit)
        cost_at = [cost(n, int(s)) for s in sizes]
        after, pick = np.full(top + 1, np.inf), np.zeros(top + 1, np.int32)
        for k, (w, c) in enumerate(zip(weight.tolist(), cost_at)):
            candidate = least[:top + 1 - w] + c
            better = candidate < after[w:]
            after[w:][better] = candidate[better]
            pick[w:][better] = k
        picks.append((n, sizes, weight, pick))
        least = after
    for start in range(top, fits - 1, -1):
        size, u = {}, start
        for n, sizes, weight, pick in reversed(picks):
            k = int(pick[u])
            size[n] = int(sizes[k])
            u -= int(weight[k])
        if sum((size[n] - lo[n]) * tables[n][1] for n in names) <= left:
            return {n: size[n] for n in names}
    raise AssertionError("unreachable: within the budget's whole slices every choice fits")


def _top_up(size, left, tables, curves, cost) -> dict:
    """Spend the bytes left greedily: each step moves one table to a larger size on its grid (or
    as far as the last bytes reach), the step that saves the most per byte; looking past the next
    grid size steps over a curve's flat stretches."""
    size = dict(size)
    while True:
        best = None
        for n in size:
            rb = tables[n][1]
            grid = curves[n].sizes
            steps = [int(s) for s in grid[(grid > size[n]) & ((grid - size[n]) * rb <= left)]]
            if size[n] + left // rb < tables[n][0] and (not steps or steps[-1] < size[n] + left // rb):
                steps.append(size[n] + left // rb)
            here = cost(n, size[n])
            for step in steps:
                if step <= size[n]:
                    continue
                extra = (step - size[n]) * rb
                gain = (here - cost(n, step)) / extra
                if best is None or gain > best[0]:
                    best = (gain, n, step, extra)
        if best is None or best[0] <= 0:
            return size
        _, n, step, extra = best
        size[n], left = step, left - extra


def _shares(strategy, budget, tables, lo) -> dict:
    """Tier-0 rows per table in proportion to its bytes (the same fraction of every table's rows,
    as the collection splits cache_bytes) or in equal bytes, each held between its widest batch
    and all its rows. Where raising tables to their widest batch would overrun the budget, the
    common fraction (or share of bytes) is lowered until the shares fit: the largest that does,
    by bisection (the planner checked that the budget holds every widest batch)."""
    total = sum(rows * rb for rows, rb in tables.values())

    def at(scale: float | None) -> dict:
        if scale is None:  # the budget's own split, in integers
            raw = {n: budget * rows // total if strategy == "proportional" else budget // len(tables) // rb
                   for n, (rows, rb) in tables.items()}
        else:
            raw = {n: int(scale * (rows if strategy == "proportional" else 1 / rb)) for n, (rows, rb) in tables.items()}
        return {n: int(min(tables[n][0], max(lo[n], raw[n]))) for n in tables}

    def fits(shares: dict) -> bool:
        return sum(shares[n] * tables[n][1] for n in tables) <= budget

    shares = at(None)
    if fits(shares):
        return shares
    low, high = 0.0, budget / total if strategy == "proportional" else budget / len(tables)
    for _ in range(64):
        mid = (low + high) / 2
        low, high = (mid, high) if fits(at(mid)) else (low, mid)
    return at(low)


def _place(host_budget, tables, curves, cache, bw, train) -> dict:
    """'host' or 'ssd' per table: whole tables in host memory, dearest SSD traffic per byte first."""
    if host_budget is None:
        return {n: "host" for n in tables}
    moves = 2 if train else 1
    saving = {n: moves * tables[n][1] * curves[n].misses_at(cache[n]) / bw.ssd / (tables[n][0] * tables[n][1])
              for n in tables}
    store, left = {}, host_budget
    for n in sorted(tables, key=lambda n: -saving[n]):
        need = tables[n][0] * tables[n][1]
        store[n] = "host" if need <= left else "ssd"  # (one that never misses too, while room lasts)
        left -= need if store[n] == "host" else 0
    return store


def split_trace(keys, batch_offsets, table_rows: dict) -> dict:
    """A trace of global keys (table t's row r is sum of the rows of the tables before t, + r;
    tieredemb.trace's layout) -> {table: (its ids, its batch offsets)}; table_rows: {table:
    rows} in key order."""
    keys = np.asarray(keys, dtype=np.int64)
    offsets = np.asarray(batch_offsets, dtype=np.int64)
    ends = np.cumsum(list(table_rows.values()))
    if keys.size and (keys.min() < 0 or keys.max() >= ends[-1]):
        raise ValueError(f"key {int(keys.max() if keys.max() >= ends[-1] else keys.min())} is outside the "
                         f"tables' {int(ends[-1])} rows")
    table = np.searchsorted(ends, keys, "right")
    batch = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    out = {}
    for t, (name, rows) in enumerate(table_rows.items()):
        mine = table == t
        counts = np.bincount(batch[mine], minlength=len(offsets) - 1)
        out[name] = (keys[mine] - (ends[t] - rows), np.concatenate([[0], np.cumsum(counts)]))
    return out


def report(plans: dict[str, Plan]) -> str:
    """The plans as text: every table's tier-0 rows, hit ratio, store and bytes per batch, and
    each plan's predicted seconds of row moves per batch against the planned one's."""
    lines = []
    best = plans["planned"].seconds_per_batch
    for strategy, p in plans.items():
        ratio = f" ({p.seconds_per_batch / best:.2f}x the plan's)" if strategy != "planned" and best > 0 else ""
        lines.append(f"{strategy}: {p.seconds_per_batch * 1e3:.4g} ms of row moves per batch predicted{ratio}")
        for t in p.tables:
            whole = " whole" if t.cache_rows >= t.rows else ""
            lines.append(f"  {t.name:12s} rows {t.rows:>12,}  tier 0 {t.cache_rows:>11,}{whole:6s} "
                         f"({t.tier0_hit:6.1%} hit)  store {t.store:4s}  {t.bytes_per_batch / 2**20:9.2f} MiB/batch")
    return "\n".join(lines)


def to_json(plans: dict[str, Plan]) -> str:
    return json.dumps({k: p.to_dict() for k, p in plans.items()}, indent=1)


def plot(plans: dict[str, Plan], path: str) -> None:
    """A PNG: every table's tier-0 hit-ratio curve, with each strategy's chosen point on it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    marks = {"planned": "o", "proportional": "s", "equal": "^"}
    for k, t in enumerate(plans["planned"].tables):
        color = f"C{k % 10}"
        ax.plot(t.curve_sizes, t.curve_hits, color=color, label=f"{t.name} ({t.rows:,} rows)")
        for strategy, p in plans.items():
            chosen = p.tables[k]
            ax.plot([chosen.cache_rows], [chosen.tier0_hit], marks.get(strategy, "x"), color=color,
                    markerfacecolor=color if strategy == "planned" else "none")
    ax.set_xscale("log")
    ax.set_xlabel("tier-0 rows")
    ax.set_ylabel("tier-0 hit ratio")
    ax.set_title("planned (filled), proportional (square), equal (triangle)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def probe(width: int, ssd_path=None, rows: int = 1 << 18, batch: int = 1 << 15) -> Bandwidth:
    """This machine's bandwidths, measured (median of 5): rows of `width` 32-bit words copied at
    random between host arrays (the moves of a host tier 0; on a GPU, give the PCIe figure),
    and read at random from a log store made in a temporary directory under ssd_path (None:
    the SSD figure is the default's)."""
    import os
    import statistics
    import tempfile
    import time

    import torch

    from . import _C

    src = torch.randn(rows, width)
    dst = torch.empty(batch, width)
    pick = torch.randint(0, rows, (batch,))
    at = torch.arange(batch)

    def timed(fn, n) -> float:
        times = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return n * width * 4 / statistics.median(times)

    if ssd_path is not None and not os.path.isdir(ssd_path):
        raise ValueError(f"probe: {os.fspath(ssd_path)!r} is not a directory (the SSD probe writes a log store in "
                         "a temporary directory inside it)")
    host = timed(lambda: _C.copy_rows(src, pick, dst, at), batch)
    if ssd_path is None:
        return Bandwidth(to_tier0=host)
    from ssd_backend import open_store
    from ssd_backend.options import LogOptions

    from .tiers.rowstore import RowInit

    with tempfile.TemporaryDirectory(dir=ssd_path) as d:
        init = RowInit(width, 0, 0.0, 1.0, 0, -1, 0)
        store = open_store(os.path.join(d, "probe"), width, init, {"num_embeddings": rows, "width": width},
                           LogOptions())
        store.write_from(torch.arange(rows), src, torch.arange(rows))
        store.flush()
        unique = torch.from_numpy(np.unique(pick.numpy()))
        block = torch.empty(len(unique), width)
        ssd = timed(lambda: store.read_to(unique, block, torch.arange(len(unique))), len(unique))
        store.close()
    return Bandwidth(to_tier0=host, ssd=ssd)
