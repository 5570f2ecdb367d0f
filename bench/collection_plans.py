"""bench_collection.py's tables, budget and plans: the workload's tables at --scale, the cached
systems' tier-0 budget, tieredemb.planner's plans of it, each cached system's tier-0 rows, and
the warm-up that lets every cached tier 0 fill (see bench_collection.py's docstring)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from workload import TABLES, Batches, Table

FP32 = 4
MARGIN = 100  # warm-up batches after every cached tier 0 can be full


def tables_of(a) -> list[Table]:
    return [dataclasses.replace(t, rows=max(1, int(t.rows * a.scale))) for t in TABLES]


def names(tables) -> list[str]:
    return [f"t{k}" for k in range(len(tables))]


def row_bytes(t: Table) -> int:
    """Bytes of a stored row in tieredemb: weights and row-wise Adagrad's state."""
    import tieredemb

    return tieredemb.TableConfig(1, t.dim, optimizer=tieredemb.RowWiseAdagrad(lr=0.01)).width * FP32


def budget_of(a, tables) -> int:
    return int(a.cache_fraction * sum(t.rows * row_bytes(t) for t in tables))


# ---------------------------------------------------------------------------------------------
# The plans (parent)


def make_plans(a, tables, src: Batches):
    """tieredemb.planner's plans of the budget from the first --plan-batches batches' ids (each
    table's own), the first --plan-warmup of them only filling tier 0: (plans, None), or (None,
    why) where the planner is not there or refuses."""
    try:
        from tieredemb import planner

        plan, report = planner.plan, planner.report
    except (ImportError, AttributeError) as e:
        return None, f"planner not available ({type(e).__name__}: {e})"
    n, w = a.plan_batches, a.plan_warmup
    first = [src.ids(i) for i in range(n)]
    traces = {name: (np.concatenate([b[k].numpy() for b in first]),
                     np.arange(n + 1, dtype=np.int64) * src.bags * t.ids_per_bag)
              for k, (name, t) in enumerate(zip(names(tables), tables))}
    sizes = {name: (t.rows, row_bytes(t)) for name, t in zip(names(tables), tables)}
    start = time.perf_counter()
    # Over SSD (--ssd-path), host memory holds no whole table: every table's rows are on SSD,
    # and the planner prices its misses at SSD bandwidth too.
    host = 1 if a.ssd_path else None
    try:
        plans = plan(traces, sizes, cache_bytes=budget_of(a, tables), host_bytes=host, warmup=w)
    except (ValueError, TypeError) as e:
        return None, f"planner refused: {type(e).__name__}: {e}"
    over = f"batches {w:,}-{n - 1:,}, after {w:,} that fill tier 0" if w else "those batches, from a cold start"
    print(f"planned from the first {n:,} batches in {time.perf_counter() - start:.1f}s; its prediction "
          f"(tier-0 hits per distinct row of a batch, over {over}):")
    print(report(plans))
    return plans, None


def tier0_rows(system: str, a, tables, plans) -> dict:
    """{table: tier-0 rows} of a cached system: the collection's default split for proportional
    (each table budget x its bytes / all bytes, as rows), the plan's for the others."""
    if system == "proportional":
        budget, total = budget_of(a, tables), sum(t.rows * row_bytes(t) for t in tables)
        return {n: min(t.rows, max(1, budget * t.rows // total)) for n, t in zip(names(tables), tables)}
    return {t.name: min(t.rows, t.cache_rows) for t in plans[system].tables}


def fill_batches(src: Batches, k: int, rows: int, limit: int) -> int | None:
    """Batches until table k's batches have looked up `rows` distinct rows (an LRU tier 0 of that
    many rows is full from then on); None if not within `limit` batches."""
    t = src.tables[k]
    seen = np.zeros(t.rows, dtype=bool)
    count = 0
    for i in range(limit):
        ids = src.samplers[k].batch(i, src.bags * t.ids_per_bag)
        new = np.unique(ids[~seen[ids]])
        seen[new] = True
        count += len(new)
        if count >= rows:
            return i + 1
    return None


def auto_warmup(a, tables, src: Batches, cached: list[str], plans, least: int = 0, what: str = "warm-up") -> int:
    """Warm-up batches: until every cached system's tables can all have a full tier 0, + MARGIN."""
    need, why = max(MARGIN, least), "every tier 0 fills within the planner's trace"
    for system in cached:
        for k, (n, rows) in enumerate(tier0_rows(system, a, tables, plans).items()):
            if rows >= tables[k].rows:
                continue  # whole in tier 0: nothing to fill
            fill = fill_batches(src, k, rows, a.warmup_max)
            if fill is None:
                print(f"warning: {n}'s tier 0 under {system} ({rows:,} rows) is not full after --warmup-max "
                      f"{a.warmup_max} batches: the timed batches start before its steady state")
                fill = a.warmup_max
            if fill + MARGIN > need:
                need, why = fill + MARGIN, f"{n}'s tier 0 under {system} ({rows:,} rows) can be full after {fill:,}"
    print(f"{what}: {need:,} batches (auto: {why}; + {MARGIN})")
    return need
