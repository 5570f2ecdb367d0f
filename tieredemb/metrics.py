"""Tables' statistics for monitoring: as JSON, and in Prometheus' text exposition format.

    text = tieredemb.metrics.prometheus({"user": user_emb, "item": item_emb, "ebc": collection})
    doc = tieredemb.metrics.as_json({"user": user_emb, "item": item_emb, "ebc": collection})

Names follow Prometheus' conventions: a `tieredemb_` prefix, the unit in the name (`_bytes`,
`_rows`, `_seconds`), `_total` on counters; the table and the tier (or store) are labels. A
collection (TieredEmbeddingBagCollection or TieredEmbeddingCollection) gives every table's own
series (labels collection, table, tier: its lookups and its share of tier 0), and its groups'
shared tiers, stores and prefetch (labels collection, group).
"""

from __future__ import annotations

import json
import math

# stats() key of a cache tier (tier0, host) -> (metric, type, help)
_TIER = {
    "hits": ("tier_hits_total", "counter", "rows looked up for reading and found in the tier"),
    "misses": ("tier_misses_total", "counter", "rows looked up for reading and read from below"),
    "writes": ("tier_written_rows_total", "counter", "rows written into the tier from above"),
    "evictions": ("tier_evictions_total", "counter", "rows evicted from the tier"),
    "dirty_writebacks": ("tier_writebacks_total", "counter", "evicted rows written down (changed since read)"),
    "clean_drops": ("tier_clean_drops_total", "counter", "evicted rows dropped unchanged"),
    "overflow_rows": ("tier_overflow_rows_total", "counter", "rows lent an overflow slot (no room beside pinned rows)"),
    "bytes_in": ("tier_read_bytes_total", "counter", "bytes of rows read into the tier"),
    "bytes_out": ("tier_written_down_bytes_total", "counter", "bytes of rows written down from the tier"),
    "capacity": ("tier_capacity_rows", "gauge", "rows the tier holds at most (overflow slots apart)"),
    "resident": ("tier_resident_rows", "gauge", "rows in the tier now"),
    "hit_rate": ("tier_hit_ratio", "gauge", "hits / (hits + misses) since the counters were reset"),
}
# stats() key of the backing store ("store": host memory, "ssd") -> (metric, type, help)
_STORE = {
    "reads": ("store_read_rows_total", "counter", "rows read from the backing store"),
    "rows_found": ("store_found_rows_total", "counter", "rows read that were stored (the rest: initial values)"),
    "rows_written": ("store_written_rows_total", "counter", "rows written to the backing store"),
    "bytes_read": ("store_read_bytes_total", "counter", "bytes read from the backing store's files"),
    "bytes_written": ("store_written_bytes_total", "counter", "bytes written to the backing store's files"),
    "flushes": ("store_flushes_total", "counter", "flushes (every update before them durable)"),
    "rows_stored": ("store_stored_rows", "gauge", "distinct rows the backing store holds"),
}
_TABLE = {
    "lookups": ("lookups_total", "counter", "ids looked up, duplicates included"),
}
_PREFETCH = {
    "registered": ("prefetch_batches_total", "counter", "batches registered ahead of their forward"),
    "prefetched_rows": ("prefetch_ahead_rows_total", "counter", "tier-0 misses made resident before the forward asked"),
    "late_rows": ("prefetch_late_rows_total", "counter", "tier-0 misses a forward waited for the worker on"),
    "demand_misses": ("prefetch_demand_rows_total", "counter", "tier-0 misses of batches never registered"),
    "wait_seconds": ("prefetch_wait_seconds_total", "counter", "time forwards waited for their rows"),
    "room_waits": ("prefetch_room_waits_total", "counter", "times the worker waited for pinned rows to be released"),
}


def _checked(tables) -> dict:
    """tables, if it maps names to tiered modules or collections; else TypeError naming the first
    that is not one."""
    from .collection import _Collection
    from .module import _TieredBase

    if not isinstance(tables, dict):
        raise TypeError(f"give {{name: table or collection}}, got {type(tables).__name__}")
    for name, table in tables.items():
        if not isinstance(table, (_TieredBase, _Collection)):
            raise TypeError(f"{name!r}: {type(table).__name__} is not a tiered table or collection")
    return tables


def as_json(tables: dict) -> str:
    """{name: its stats()} (a table module's or a collection's) as a JSON document."""
    return json.dumps({name: table.stats() for name, table in _checked(tables).items()}, indent=1, sort_keys=True)


def prometheus(tables: dict) -> str:
    """The tables' statistics (tables: name -> a tiered module) in the text exposition format."""
    samples: dict[str, tuple[str, str, list[str]]] = {}

    def add(spec, labels: dict, value) -> None:
        name, kind, help_ = spec
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return
        metric = "tieredemb_" + name
        lines = samples.setdefault(metric, (kind, help_, []))[2]
        tags = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
        lines.append(f"{metric}{{{tags}}} {float(value):.17g}")

    for name, obj in _checked(tables).items():
        for labels, part, stats in _parts(name, obj):
            if part == "prefetch":
                specs = _PREFETCH
            elif part == "table":
                specs = _TABLE
            elif part in ("store", "ssd"):
                specs, labels = _STORE, {**labels, "store": "ssd" if part == "ssd" else "host"}
            else:
                specs, labels = _TIER, {**labels, "tier": part}
            for key, spec in specs.items():
                if key in stats:
                    add(spec, labels, stats[key])
    out = []
    for metric, (kind, help_, lines) in samples.items():
        out += [f"# HELP {metric} {help_}", f"# TYPE {metric} {kind}", *lines]
    return "\n".join(out) + "\n"


def _parts(name: str, obj):
    """(labels, part, stats) of every part of a table module or a collection (see the top)."""
    from .collection import _Collection

    stats = obj.stats()
    if not isinstance(obj, _Collection):
        for part, s in stats.items():
            yield {"table": name}, part, s
        return
    for table, s in stats["tables"].items():
        labels = {"collection": name, "table": table}
        yield labels, "table", s
        if s["tier0"] is not None:
            yield labels, "tier0", s["tier0"]
    for group, s in stats["groups"].items():
        for part, value in s.items():
            if part == "tables" or (part == "tier0" and "partitions" in value):  # per table above
                continue
            yield {"collection": name, "group": group}, part, value


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
