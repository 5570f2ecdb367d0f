"""`tieredemb replay`: drive the real engine with a trace and report what the simulator reports.

One TieredEmbeddingBag of total_rows rows (the trace's global keys, table_base[t] + id, so a
multi-table trace shares one set of tiers, as in tieredemb.sim), mode 'sum', one bag per lookup:
a trace has no bag structure, and a bag per lookup keeps the batch's ids in trace order, which
decides the order the policy sees them in. Each batch is one forward (train=True: one backward
with the fused optimizer, so every row the batch used becomes dirty), released before the next,
so nothing is pinned between batches: the engine's "batch mode" of the trace contract, whose
counts tieredemb.sim.simulate reproduces exactly for lru, lfu and clock.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Iterator, Sequence

import numpy as np
import torch

from tieredemb.trace.cli import add_input_args, open_input
from tieredemb.trace.detect import open_any
from tieredemb.trace.format import TraceSource
from tieredemb.trace.keys import check_keys, check_offsets

from .cli import _rows


class ReplayError(ValueError):
    """Bad replay input (policy, capacity, trace, batch): the message names the value and the rule."""


@dataclasses.dataclass
class TierCounts:
    """One cache tier's counts over the replay. hits/misses: unique rows per batch looked up for
    reading; writes: rows written down into it by the tier above; rows_in: rows read or written
    into it; rows_out: dirty rows it wrote down (= dirty_writebacks)."""

    name: str
    capacity: int
    hits: int
    misses: int
    hit_ratio: float
    evictions: int
    dirty_writebacks: int
    clean_drops: int
    writes: int
    rows_in: int
    rows_out: int


@dataclasses.dataclass
class ReplayResult:
    """What replay_trace measured: per cache tier counts (top first); bottom_reads / bottom_writes:
    rows the last cache tier read from / wrote down to the bottom (its misses / dirty write-backs,
    as tieredemb.sim counts them); bottom: the bottom's own counters (the dense host store or the
    SSD store); throughput: engine_s is the time inside the engine (forward, and with train the
    backward and fused update, of every batch), lookups_per_s = num_lookups / engine_s; wall_s
    also counts reading the trace."""

    policy: str
    capacities: list[int]
    train: bool
    dim: int
    total_rows: int
    num_batches: int
    num_lookups: int
    tiers: list[TierCounts]
    bottom_reads: int
    bottom_writes: int
    bottom: dict
    wall_s: float
    engine_s: float
    lookups_per_s: float
    batch_median_s: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# -- inputs -------------------------------------------------------------------------------------
class _Source:
    """A trace (a file in any format tieredemb.trace reads, or an open TraceSource; streamed chunk
    by chunk) or in-memory arrays, seen as whole batches. Closes only the file it opened."""

    def __init__(self, source, total_rows: int | None):
        self._reader = self._opened = None
        if isinstance(source, (str, os.PathLike, TraceSource)):
            if isinstance(source, TraceSource):
                self._reader = source
            else:
                try:
                    self._reader = self._opened = open_any(source)
                except OSError as e:
                    raise ReplayError(f"trace {os.fspath(source)!r} cannot be opened: {e.strerror or e}") from None
            self.name = self._reader.path
            self.total_rows = int(self._reader.header.total_rows)
            self.num_batches = int(self._reader.header.num_batches)
            if total_rows is not None and total_rows != self.total_rows:
                self.close()
                raise ReplayError(f"total_rows {total_rows} != the {self.total_rows} rows declared by {self.name}")
            return
        if hasattr(source, "keys") and hasattr(source, "batch_offsets"):  # a tieredemb.trace Chunk
            source = (source.keys, source.batch_offsets)
        if not (isinstance(source, tuple) and len(source) == 2):
            raise ReplayError(f"source must be a trace path, a Chunk or a tuple (keys, batch_offsets), "
                              f"got {type(source).__name__}")
        keys = check_keys(source[0])
        offsets = check_offsets(source[1], keys.size)
        top = int(keys.max()) + 1 if keys.size else 1
        if total_rows is not None and top > total_rows:
            raise ReplayError(f"key {top - 1} out of range [0, {total_rows}) (total_rows)")
        self.name = "<arrays>"
        self.total_rows = top if total_rows is None else int(total_rows)
        self.num_batches = int(offsets.size - 1)
        self._arrays = (keys, offsets)

    def batches(self) -> Iterator[np.ndarray]:
        """Each batch's global keys (int64 views), in trace order."""
        if self._reader is None:
            chunks = [self._arrays]
        else:
            chunks = ((c.keys, c.batch_offsets) for c in self._reader.chunks())
        for keys, offsets in chunks:
            for b in range(len(offsets) - 1):
                yield keys[offsets[b]:offsets[b + 1]]

    def close(self) -> None:
        if self._opened is not None:
            self._opened.close()


def _capacities(capacities: Sequence, total_rows: int) -> list[int]:
    if isinstance(capacities, (int, str)):
        capacities = [capacities]
    if not 1 <= len(capacities) <= 2:
        raise ReplayError(f"capacities {list(capacities)!r}: the engine has one or two cache tiers "
                          "(tier 0, then a host cache), give one or two capacities")
    rows = [_rows(str(c), total_rows) for c in capacities]  # the rule of `tieredemb simulate --capacity`
    if len(rows) == 2:
        if rows[1] < min(rows[0], total_rows):
            raise ReplayError(f"capacity {capacities[1]!r} (host tier, {rows[1]} rows) < capacity "
                              f"{capacities[0]!r} (tier 0, {rows[0]} rows): the host cache must be at least as large")
        if rows[1] >= total_rows:
            raise ReplayError(f"capacity {capacities[1]!r} (host tier, {rows[1]} rows) holds every one of the "
                              f"{total_rows} rows: that is the backing store itself, drop the second capacity")
    return rows


# -- the replay ---------------------------------------------------------------------------------
def replay_trace(source, *, policy: str, capacities, train: bool = False, dim: int = 64, ssd_path=None,
                 optimizer=None, progress: bool = False, batches: int | None = None,
                 total_rows: int | None = None) -> ReplayResult:
    """Replays a trace through one TieredEmbeddingBag and returns its per-tier counts.

    source: a trace (streamed): a path in any format tieredemb.trace reads, or an open
    tieredemb.trace.TraceSource (open_any, for reading options); or global keys in memory: a
    tieredemb.trace Chunk or (keys int [N], batch_offsets int [B+1]).
    capacities: [tier 0] or [tier 0, host cache], rows or '10%' of total_rows (rounded, as
    `tieredemb simulate` does). train: backward
    with optimizer (default SGD(lr=0.01)). batches: replay only the first this many batches.
    total_rows: the key space of arrays (default max key + 1; a trace declares its own)."""
    import tieredemb
    from tieredemb.config import POLICIES

    if policy not in POLICIES:
        raise ReplayError(f"policy {policy!r} is not one the engine has: {', '.join(POLICIES)}")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
        raise ReplayError(f"dim {dim!r} must be a positive int")
    if batches is not None and (isinstance(batches, bool) or not isinstance(batches, int) or batches < 0):
        raise ReplayError(f"batches {batches!r} must be an int >= 0")
    src = _Source(source, total_rows)
    try:
        rows = _capacities(capacities, src.total_rows)
        if train and optimizer is None:
            optimizer = tieredemb.SGD(lr=0.01)
        try:
            emb = tieredemb.TieredEmbeddingBag(src.total_rows, dim, mode="sum", cache_rows=rows[0],
                                               host_rows=rows[1] if len(rows) > 1 else None, ssd_path=ssd_path,
                                               policy=policy, optimizer=optimizer)
        except (ValueError, TypeError, RuntimeError) as e:
            raise ReplayError(f"cannot build the engine table: {e}") from None
        try:
            return _run(emb, src, policy, rows, train, dim, progress, batches)
        finally:
            emb.close()
    finally:
        src.close()


def _run(emb, src: _Source, policy: str, rows: list[int], train: bool, dim: int, progress: bool,
         limit: int | None) -> ReplayResult:
    from tqdm import tqdm

    total = src.num_batches if limit is None else min(limit, src.num_batches)
    times: list[float] = []
    lookups = done = 0
    start = time.perf_counter()
    with torch.set_grad_enabled(train), tqdm(total=total, desc="replay", unit="batch", disable=not progress) as bar:
        for keys in src.batches():
            if done == total:
                break
            done += 1
            bar.update(1)
            n = len(keys)
            if n == 0:
                continue
            ids = torch.from_numpy(keys).view(n, 1)  # [B, L] input: one bag per lookup, no offsets to check
            t0 = time.perf_counter()
            try:
                out = emb(ids)
                if train:
                    out.sum().backward()
            except (ValueError, IndexError) as e:
                raise ReplayError(f"{src.name}: batch {done - 1} ({n} lookups): {e}") from None
            times.append(time.perf_counter() - t0)
            lookups += n
    wall = time.perf_counter() - start
    engine = sum(times)
    stats = emb.stats()
    row_bytes = emb.width * 4
    tiers = []
    for name, cap in zip(("tier0", "host"), rows):
        s = stats[name]
        tiers.append(TierCounts(name=name, capacity=min(cap, src.total_rows), hits=s["hits"], misses=s["misses"],
                                hit_ratio=s["hit_rate"], evictions=s["evictions"],
                                dirty_writebacks=s["dirty_writebacks"], clean_drops=s["clean_drops"],
                                writes=s["writes"], rows_in=s["bytes_in"] // row_bytes,
                                rows_out=s["bytes_out"] // row_bytes))
    bottom = {k: v for k, v in stats.get("ssd", stats.get("store", {})).items() if k != "writer_error"}
    return ReplayResult(policy=policy, capacities=rows, train=train, dim=dim, total_rows=src.total_rows,
                        num_batches=done, num_lookups=lookups, tiers=tiers, bottom_reads=tiers[-1].misses,
                        bottom_writes=tiers[-1].dirty_writebacks, bottom=bottom, wall_s=wall,
                        engine_s=engine, lookups_per_s=lookups / engine if engine > 0 else 0.0,
                        batch_median_s=statistics.median(times) if times else 0.0)


# -- the command ----------------------------------------------------------------------------------
# Counts that replay and tieredemb.sim.simulate both report, compared by --compare.
_COMPARED = ("hits", "misses", "evictions", "dirty_writebacks", "clean_drops", "writes", "rows_in", "rows_out")


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        raise _ArgError(message)


def compare(result: ReplayResult, sim) -> list[str]:
    """Differences between a replay and a tieredemb.sim SimResult, one line each ([] if equal)."""
    diffs = []
    if len(result.tiers) != len(sim.tiers):
        return [f"tiers: replay has {len(result.tiers)}, simulator {len(sim.tiers)}"]
    for i, (r, s) in enumerate(zip(result.tiers, sim.tiers)):
        for f in _COMPARED:
            a, b = getattr(r, f), getattr(s, f)
            if a != b:
                diffs.append(f"tier {i} ({r.name}) {f}: engine {a:,}, simulator {b:,}")
    for f in ("bottom_reads", "bottom_writes"):
        if getattr(result, f) != getattr(sim, f):
            diffs.append(f"{f}: engine {getattr(result, f):,}, simulator {getattr(sim, f):,}")
    return diffs


def _format(result: ReplayResult, source: str, sim=None) -> str:
    mode = "train (backward + fused SGD)" if result.train else "forward only"
    lines = [f"{source}: {result.num_lookups:,} lookups in {result.num_batches:,} batches over "
             f"{result.total_rows:,} rows; engine policy {result.policy}, {mode}, dim {result.dim}"]
    head = f"{'tier':14s} {'capacity':>11s} {'hits':>12s} {'misses':>12s} {'hit ratio':>9s} {'evictions':>11s} " \
           f"{'write-backs':>11s} {'clean drops':>11s} {'writes':>11s} {'rows in':>12s} {'rows out':>11s}"
    lines.append(head)
    rows = [(r.name, "engine", r) for r in result.tiers]
    if sim is not None:
        rows = [x for r, s in zip(result.tiers, sim.tiers) for x in ((r.name, "engine", r), (r.name, "simulator", s))]
    for name, who, t in rows:
        label = f"{name} {who}" if sim is not None else name
        lines.append(f"{label:14s} {t.capacity:>11,} {t.hits:>12,} {t.misses:>12,} {t.hit_ratio:>9.4f} "
                     f"{t.evictions:>11,} {t.dirty_writebacks:>11,} {t.clean_drops:>11,} {t.writes:>11,} "
                     f"{t.rows_in:>12,} {t.rows_out:>11,}")
    lines.append(f"bottom: {result.bottom_reads:,} rows read, {result.bottom_writes:,} rows written")
    lines.append(f"throughput: {result.lookups_per_s:,.0f} lookups/s in the engine ({result.engine_s:.3f} s; "
                 f"median batch {result.batch_median_s * 1e3:.2f} ms); wall {result.wall_s:.3f} s")
    if sim is not None:
        diffs = compare(result, sim)
        if diffs:
            lines.append(f"DIFFER: engine and simulator disagree on {len(diffs)} count(s):")
            lines += [f"  {d}" for d in diffs]
        else:
            lines.append("MATCH: engine and simulator counts are equal in every tier "
                         "(hits, misses, evictions, write-backs, clean drops, writes, rows moved)")
    return "\n".join(lines)


def replay(argv: list[str]) -> int:
    """tieredemb replay TRACE --policy P --capacity N [--capacity M] [--train] [--dim D]
    [--ssd-path DIR] [--json] [--compare]: drive the real engine with a trace."""
    p = _Parser(prog="tieredemb replay", description="Replay a trace through the real engine (one "
                "TieredEmbeddingBag over the trace's global keys) and report per-tier counts and throughput.")
    p.add_argument("trace", help="a trace file in any supported format (see below)")
    p.add_argument("--policy", required=True, help="lru | lfu | clock")
    p.add_argument("--capacity", action="append", required=True,
                   help="tier 0 rows, then (again) host cache rows; a number or a share like '10%%'")
    p.add_argument("--train", action="store_true", help="backward + fused SGD: every looked-up row becomes dirty")
    p.add_argument("--dim", type=int, default=64, help="embedding dimension (default 64)")
    p.add_argument("--ssd-path", default=None, help="back the table by an SSD store in this directory")
    p.add_argument("--batches", type=int, default=None, help="replay only the first N batches")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--compare", action="store_true", help="also run tieredemb.sim.simulate and compare")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (default: bars on a terminal)")
    add_input_args(p)
    try:
        args = p.parse_args(argv)
        progress = not args.no_progress and sys.stderr.isatty()
        with open_input(args.trace, args) as source:
            result = replay_trace(source, policy=args.policy, capacities=args.capacity, train=args.train,
                                  dim=args.dim, ssd_path=args.ssd_path, progress=progress,
                                  batches=args.batches)
            sim = None
            if args.compare:
                if args.batches is not None:
                    raise ReplayError(f"--compare replays the whole trace: drop --batches {args.batches}")
                from tieredemb.sim import simulate

                sim = simulate(source, policy=args.policy, capacities=result.capacities, train=args.train,
                               progress=progress)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except BrokenPipeError:  # (the reader went away: cli.main ends quietly)
        raise
    except (_ArgError, ValueError, OSError) as e:
        print(f"tieredemb replay: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = result.to_dict()
        if sim is not None:
            diffs = compare(result, sim)
            out = {"replay": out, "simulate": sim.to_dict(), "match": not diffs, "differences": diffs}
        print(json.dumps(out, indent=2))
    else:
        print(_format(result, args.trace, sim))
    return 0
