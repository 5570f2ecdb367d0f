"""A collection's budgets: each table's tier-0 rows and store, from cache_bytes or a plan, and each
group's host cache, its share of host_bytes. Bytes of a row count its weights, its optimizer's
state and its padding (row_alignment)."""

from __future__ import annotations

from . import planner
from .config import TableConfig


def row_bytes(t, row_alignment: int) -> int:
    """Bytes of a stored row of table config t: its weights, its optimizer's state, the padding."""
    return TableConfig(1, t.embedding_dim, optimizer=t.optimizer, dtype=t.dtype, row_alignment=row_alignment).width * 4


def tier0_and_store(tables: list, cache_bytes, host_bytes, ssd_path, plan, row_alignment: int) -> tuple[dict, dict]:
    """{table: tier-0 rows} and {table: 'host' or 'ssd'}, from the plan or the budgets (tier 0's
    split in proportion to the tables' bytes: the same fraction of every table's rows)."""
    if plan is None:
        store = "host" if ssd_path is None else "ssd"
        if cache_bytes is None:
            return {t.name: t.num_embeddings for t in tables}, {t.name: store for t in tables}
        total = sum(t.num_embeddings * row_bytes(t, row_alignment) for t in tables)
        return ({t.name: min(t.num_embeddings, max(1, cache_bytes * t.num_embeddings // total)) for t in tables},
                {t.name: store for t in tables})
    if cache_bytes is not None or host_bytes is not None:
        raise ValueError("give a plan or cache_bytes / host_bytes, not both: the plan already splits the budgets")
    chosen = planner.load(plan)
    names = {t.name for t in tables}
    if set(chosen) != names:
        raise ValueError(f"the plan is for tables {sorted(chosen)}, this collection has {sorted(names)}")
    for t in tables:
        rows, where, planned_rows, planned_bytes = chosen[t.name]
        if planned_rows != t.num_embeddings:
            raise ValueError(f"the plan's table {t.name!r} has {planned_rows} rows, this one {t.num_embeddings}")
        if planned_bytes is not None and row_bytes(t, row_alignment) > planned_bytes:  # (its tiers would pass it)
            raise ValueError(f"the plan's table {t.name!r} has rows of {planned_bytes} bytes, this one's take "
                             f"{row_bytes(t, row_alignment)} (weights, optimizer state, padding): its tiers would pass "
                             "the planned budget; plan for these tables (dim, optimizer, dtype, row_alignment)")
        if not 1 <= rows or where not in ("host", "ssd"):
            raise ValueError(f"the plan's table {t.name!r}: tier-0 rows {rows} must be >= 1 and store {where!r} "
                             "'host' or 'ssd'")
        if where == "ssd" and ssd_path is None:
            raise ValueError(f"the plan stores table {t.name!r} on SSD: give ssd_path")
    return ({t.name: min(chosen[t.name][0], t.num_embeddings) for t in tables},
            {t.name: chosen[t.name][1] for t in tables})


def host_rows(groups: list, tables: list, tier0: dict, host_bytes, row_alignment: int) -> list:
    """Each group's host cache rows (None: none), its share of host_bytes (in proportion to its
    tables' bytes); ValueError if a share is short of its tier 0's rows (a host cache holds them)."""
    total = sum(t.num_embeddings * row_bytes(t, row_alignment) for t in tables)
    hosts = []
    for g in groups:
        parts = [(t.num_embeddings, tier0[t.name]) for t in g.tables]
        host = None
        if host_bytes is not None and not all(cap >= rows for rows, cap in parts):
            group_bytes = sum(t.num_embeddings * row_bytes(t, row_alignment) for t in g.tables)
            host = host_bytes * group_bytes // total // row_bytes(g.tables[0], row_alignment)
            need = sum(c for _, c in parts)
            if host < need - len(parts):  # (less than a row a table short: a tier 0's least row, taken)
                raise ValueError(f"host_bytes {host_bytes}: {g.directory}'s share is {host} rows, fewer than its "
                                 f"tier 0's {need}; a host cache holds tier 0's rows and more (give host_bytes >= "
                                 "cache_bytes, or None for no host cache)")
            host = max(host, need)
        hosts.append(host)
    return hosts
