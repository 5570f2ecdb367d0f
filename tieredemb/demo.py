"""`tieredemb demo`: trains a small click model whose embedding table is larger than its cache,
through the whole pipeline: ids -> prefetch (the next batches' rows made resident in the
background) -> tier 0 -> host cache -> backing store (host memory or SSD), and write-back."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np
import torch

from tieredemb import planner
from tieredemb.trace.synth import ZipfSampler


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default, where its help does not say it already (those default to None)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tieredemb demo", description=__doc__, formatter_class=_Defaults)
    p.add_argument("--rows", type=int, default=2_000_000, help="rows of the embedding table")
    p.add_argument("--dim", type=int, default=64, help="embedding dimension")
    p.add_argument("--cache-rows", type=int, default=None,
                   help="tier 0's rows (the compute cache; default: a twentieth of the rows)")
    p.add_argument("--host-rows", type=int, default=None,
                   help="rows of a host-memory cache between tier 0 and the backing store (default: none)")
    p.add_argument("--ssd-path", default=None,
                   help="keep the backing store on SSD in this directory (default: host memory); an existing "
                        "table there is reopened and trained further")
    p.add_argument("--ssd-backend", default=None, choices=["log", "rocksdb", "slots"],
                   help="SSD store for a new table (default: rocksdb; log is the fast one for training)")
    p.add_argument("--steps", type=int, default=200, help="training steps (batches)")
    p.add_argument("--batch", type=int, default=2048, help="bags per batch")
    p.add_argument("--bag-len", type=int, default=20, help="ids per bag")
    p.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the ids (higher: more skewed)")
    p.add_argument("--policy", default="lru", choices=["lru", "lfu", "clock"], help="eviction policy of the caches")
    p.add_argument("--prefetch-depth", type=int, default=2,
                   help="batches made resident ahead of training by a background worker (0: none)")
    p.add_argument("--tables", type=int, default=1,
                   help="train a collection of this many tables (--rows split among them, dims 32 and 64, "
                        "one feature each, one tier-0 budget) instead of one table; no prefetch")
    return p


def demo(argv: list[str]) -> int:
    """The `tieredemb demo` command; argv: its options (see --help). Returns the exit status."""
    from tqdm import tqdm

    import ssd_backend
    import tieredemb

    args = _parser().parse_args(argv)
    if (refused := _refused(args)) is not None:
        return _error(refused)
    if args.tables > 1:
        return _demo_collection(args)
    cache_rows = args.cache_rows or max(1, args.rows // 20)
    existing = args.ssd_path is not None and ssd_backend.detect_backend(args.ssd_path)

    torch.manual_seed(0)
    try:  # (a table reopened at --ssd-path with other rows, dim or store: the library's one line)
        emb = tieredemb.TieredEmbeddingBag(args.rows, args.dim, mode="sum", cache_rows=cache_rows,
                                           host_rows=args.host_rows, ssd_path=args.ssd_path, policy=args.policy,
                                           ssd_options={"backend": args.ssd_backend} if args.ssd_backend else None,
                                           optimizer=tieredemb.RowWiseAdagrad(lr=0.05))
    except (ValueError, OSError, ssd_backend.StoreError) as e:
        return _error(str(e))
    print(f"table: {args.rows:,} rows x {args.dim} ({args.rows * emb.width * 4 / 2**20:,.0f} MiB with optimizer state); "
          f"tier 0 holds {cache_rows:,} rows ({100 * cache_rows / args.rows:.1f}%)"
          + (f", host cache {args.host_rows:,} rows" if args.host_rows else "")
          + (f", SSD store at {args.ssd_path}" if args.ssd_path else ", backing store in host memory"))
    if existing:
        print(f"reopened the {existing} table at {os.path.abspath(args.ssd_path)}: it has trained {emb.step} steps; "
              f"training goes on from its rows and optimizer state (give a new --ssd-path to start afresh)")
    elif args.ssd_path:
        print(f"created a new table at {os.path.abspath(args.ssd_path)}")

    # A toy click model: pooled embedding -> MLP -> logit; the label depends on the ids.
    mlp = torch.nn.Sequential(torch.nn.Linear(args.dim, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adagrad(mlp.parameters(), lr=0.05)
    sampler = ZipfSampler(args.rows, args.alpha, seed=1 + emb.step)
    offsets = torch.arange(0, args.batch * args.bag_len, args.bag_len)

    def batches():
        for _ in range(args.steps):
            ids = torch.from_numpy(sampler.next_batch(args.batch * args.bag_len))
            yield ids, offsets, ((ids.view(args.batch, args.bag_len) % 7) == 0).any(1).float()

    loader = tieredemb.PrefetchLoader(batches(), [emb], depth=args.prefetch_depth)
    lookups, start, loss_avg = 0, time.perf_counter(), None
    bar = tqdm(loader, total=args.steps, desc="training", unit="batch")
    for step, (ids, offsets_, label) in enumerate(bar):
        logit = mlp(emb(ids, offsets_)).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, label)
        opt.zero_grad()
        loss.backward()
        opt.step()
        lookups += ids.numel()
        loss_avg = loss.item() if loss_avg is None else 0.9 * loss_avg + 0.1 * loss.item()
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss_avg:.4f}", tier0_hit=f"{emb.stats()['tier0']['hit_rate']:.3f}")
    emb.flush()
    elapsed = time.perf_counter() - start
    print(f"\n{args.steps} steps in {elapsed:.1f} s: {lookups / elapsed:,.0f} lookups/s "
          f"(forward + backward + fused optimizer, incl. the MLP); the table has trained {emb.step} steps in all")
    print(f"final loss (moving average): {loss_avg:.4f}")
    _report(emb.stats(), args.prefetch_depth)
    emb.close()
    return 0


# The least value of each whole-number option (None: the option left out, its default).
_LEAST = {"rows": 1, "dim": 1, "cache_rows": 1, "host_rows": 1, "steps": 1, "batch": 1, "bag_len": 1,
          "prefetch_depth": 0, "tables": 1}


def _refused(args) -> str | None:
    """Why the options cannot run (the option, its value, the rule), None when they can."""
    for name, least in _LEAST.items():
        value = getattr(args, name)
        if value is not None and value < least:
            return f"--{name.replace('_', '-')} {value}: must be >= {least}"
    if not (math.isfinite(args.alpha) and args.alpha >= 0):
        return f"--alpha {args.alpha}: must be a number >= 0 (0: uniform ids)"
    if args.tables > 1 and args.host_rows is not None:
        return (f"--host-rows {args.host_rows} does not apply to --tables {args.tables}: the collection's tiers come "
                f"from its plan (tier 0, then each table's store), with no host cache between")
    return None


def _error(message: str) -> int:
    print(f"tieredemb demo: error: {message}", file=sys.stderr)
    return 2


def _report(stats: dict, depth: int) -> None:
    print("what each layer did (rows are looked up once per batch, duplicates removed):")
    for tier in ("tier0", "host"):
        if tier in stats:
            s = stats[tier]
            print(f"  {tier:6s} hit rate {s['hit_rate']:.3f} ({s['hits']:,} hits, {s['misses']:,} misses); "
                  f"evicted {s['evictions']:,} rows: {s['dirty_writebacks']:,} written back (trained since read), "
                  f"{s['clean_drops']:,} dropped unchanged; moved {s['bytes_moved'] / 2**20:,.1f} MiB"
                  + (f"; {s['overflow_rows']:,} rows served beyond its capacity" if s["overflow_rows"] else ""))
    bottom = stats.get("ssd", stats.get("store"))
    where = "SSD store" if "ssd" in stats else "host store"
    print(f"  {where}: {bottom['reads']:,} rows read by the caches above, {bottom['rows_found']:,} of them "
          f"stored before (the rest never written: their deterministic initial values); "
          f"{bottom['rows_written']:,} rows written back")
    p = stats["prefetch"]
    if depth == 0:
        print("  prefetch: off (--prefetch-depth 0): every forward read its own misses")
        return
    misses = p["prefetched_rows"] + p["late_rows"] + p["demand_misses"]
    ahead = p["prefetched_rows"] / misses if misses else 1.0
    print(f"  prefetch (depth {depth}): {100 * ahead:.1f}% of tier-0 misses were made resident before their "
          f"forward asked ({p['prefetched_rows']:,} rows); forwards waited {p['wait_seconds']:.2f} s in all "
          f"for {p['late_rows']:,} rows still in flight")


def _demo_collection(args) -> int:
    """--tables N: a click model over a TieredEmbeddingBagCollection of N tables."""
    from tqdm import tqdm

    import ssd_backend
    import tieredemb

    torch.manual_seed(0)
    rows = [max(1, args.rows // args.tables * (k + 1) * 2 // (args.tables + 1)) for k in range(args.tables)]
    tables = [tieredemb.EmbeddingBagConfig(f"table{k}", rows[k], 32 if k % 2 else 64, [f"feature{k}"])
              for k in range(args.tables)]
    budget = (args.cache_rows or sum(rows) // 20) * 64 * 4
    opt = tieredemb.RowWiseAdagrad(lr=0.05)
    # mixed locality: alphas spread over alpha +- 0.15 (none below 0: uniform)
    alphas = [max(0.0, args.alpha - 0.15 + 0.3 * k / max(1, args.tables - 1)) for k in range(args.tables)]
    samplers = [ZipfSampler(n, a, seed=1 + k) for k, (n, a) in enumerate(zip(rows, alphas))]
    n_ids = args.batch * args.bag_len

    def batch_ids(step):
        return [s.batch(step, n_ids) for s in samplers]

    # Plan tier 0 from the first batches' ids (a trace of each table), as `tieredemb plan` does.
    ahead = min(args.steps, 40)
    first = [batch_ids(i) for i in range(ahead)]
    traces = {t.name: (np.concatenate([b[k] for b in first]), np.arange(ahead + 1) * n_ids) for k, t in enumerate(tables)}
    sizes = {t.name: (t.num_embeddings, tieredemb.TableConfig(1, t.embedding_dim, optimizer=opt).width * 4)
             for t in tables}
    # (with an SSD directory every table is stored there: 1 byte of host memory holds no whole table)
    try:
        plans = tieredemb.plan(traces, sizes, cache_bytes=budget, host_bytes=1 if args.ssd_path else None)
    except ValueError as e:  # (the planner needs every table's widest batch in tier 0)
        return _error(f"{e} (--cache-rows; --batch, --bag-len)")
    print(f"{args.tables} tables of {min(rows):,} to {max(rows):,} rows (dims 32 and 64, Zipf alpha "
          f"{min(alphas):.2f} to {max(alphas):.2f}); tier-0 budget {budget / 2**20:,.1f} MiB, planned from the first "
          f"{ahead} batches:")
    print(planner.report(plans))
    existing = args.ssd_path is not None and os.path.exists(os.path.join(args.ssd_path, "collection.json"))
    try:  # (a collection reopened at --ssd-path with other tables or store: the library's one line)
        ebc = tieredemb.TieredEmbeddingBagCollection(tables, plan=plans["planned"], ssd_path=args.ssd_path,
                                                     optimizer=opt, policy=args.policy,
                                                     ssd_options={"backend": args.ssd_backend} if args.ssd_backend
                                                     else None)
    except (ValueError, OSError, ssd_backend.StoreError) as e:
        return _error(str(e))
    print(f"{len(ebc.groups)} groups looked up together")
    if args.ssd_path:
        print(f"reopened the collection at {os.path.abspath(args.ssd_path)}: its groups have trained "
              f"{[e.step for e in ebc.engines]} steps; training goes on" if existing
              else f"created a new collection at {os.path.abspath(args.ssd_path)}, every table on SSD")
    width = sum(t.embedding_dim for t in tables)
    mlp = torch.nn.Sequential(torch.nn.Linear(width, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    dense_opt = torch.optim.Adagrad(mlp.parameters(), lr=0.05)
    offsets = torch.arange(0, args.batch * args.bag_len, args.bag_len)
    start, loss_avg, lookups = time.perf_counter(), None, 0
    for step in tqdm(range(args.steps), desc="training", unit="batch"):
        ids = [torch.from_numpy(i) for i in batch_ids(step)]
        label = ((ids[0].view(args.batch, args.bag_len) % 7) == 0).any(1).float()
        pooled = ebc({f"feature{k}": (i, offsets) for k, i in enumerate(ids)})
        loss = torch.nn.functional.binary_cross_entropy_with_logits(mlp(pooled.values()).squeeze(1), label)
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        lookups += sum(len(i) for i in ids)
        loss_avg = loss.item() if loss_avg is None else 0.9 * loss_avg + 0.1 * loss.item()
    ebc.flush()
    elapsed = time.perf_counter() - start
    print(f"\n{args.steps} steps in {elapsed:.1f} s: {lookups / elapsed:,.0f} lookups/s; final loss (moving average) "
          f"{loss_avg:.4f}")
    predicted = {t.name: t for t in plans["planned"].tables}
    for name, s in ebc.stats()["tables"].items():
        t0, p = s["tier0"], predicted[name]
        hit = "whole table in tier 0" if t0 is None else f"tier-0 hit rate {t0['hit_rate']:.3f} (plan: {p.tier0_hit:.3f})"
        print(f"  {name}: {hit}, {p.cache_rows:,} of {p.rows:,} rows in tier 0")
    ebc.close()
    return 0
