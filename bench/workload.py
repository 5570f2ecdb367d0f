"""Deterministic embedding-bag batches: Zipf-distributed ids over a permuted table.

A batch is B bags of exactly L ids each, torch layout:
    indices: int64 [B * L]   row ids in [0, rows)
    offsets: int64 [B]       bag starts, arange(0, B * L, L)  (include_last_offset=False)

Id distribution: tieredemb.trace.ZipfSampler, the project's one Zipf sampler: a rank r in
[1, rows] is drawn with P(r) ~ 1 / r**alpha, then mapped through a fixed pseudo-random
permutation of the row ids, so hot rows are scattered over the table rather than packed at its
start. Batch i depends only on (rows, alpha, seed, i, B, L): not on how many batches are
generated, nor in what order, so other benchmarks and tests can regenerate any one of them.

Reused by bench_train.py and by benchmarks with other sizes (e.g. 10M rows, alpha 1.05); many
tables (Table, TABLES, Batches: one sampler per table) by bench_collection.py. And
store_every_row: a new tiered table's rows all stored before timing (bench_train.py --preinit,
bench_gpu.py's cached systems).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from tieredemb.trace.synth import ZipfSampler

# Stream tag for np.random.default_rng([seed, TAG]): the upstream gradient's own stream.
_GRAD_STREAM = 2


@dataclass(frozen=True)
class Workload:
    rows: int = 2_000_000
    dim: int = 128
    bags: int = 8192  # B, bags per batch
    ids_per_bag: int = 20  # L, fixed bag length
    alpha: float = 1.15
    seed: int = 0
    batches: int = 20  # timed batches per run (see bench_train.py for warm-up / runs)

    @property
    def lookups_per_batch(self) -> int:
        return self.bags * self.ids_per_bag


QUICK = Workload(rows=200_000, bags=2048, batches=5)


def offsets_for(bags: int, ids_per_bag: int) -> torch.Tensor:
    """Bag starts, int64 [B], for fixed-length bags (torch layout, no trailing total)."""
    return torch.arange(0, bags * ids_per_bag, ids_per_bag, dtype=torch.int64)


class BatchSource:
    """Batch i of a workload, reproducible on its own."""

    def __init__(self, w: Workload):
        self.workload = w
        self.ids = ZipfSampler(w.rows, w.alpha, seed=w.seed)
        self.offsets = offsets_for(w.bags, w.ids_per_bag)

    def indices(self, i: int) -> torch.Tensor:
        """int64 [B * L] ids of batch i."""
        return torch.from_numpy(self.ids.batch(i, self.workload.lookups_per_batch))

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices int64 [B * L], offsets int64 [B]); offsets is shared by every batch."""
        return self.indices(i), self.offsets

    def batches(self, start: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.batch(i) for i in range(start, start + count)]


def upstream_grad(w: Workload) -> torch.Tensor:
    """A fixed fp32 [B, D] gradient of the pooled output, the same for every system and batch."""
    g = torch.Generator().manual_seed(int(np.random.default_rng([w.seed, _GRAD_STREAM]).integers(2**62)))
    return torch.randn(w.bags, w.dim, generator=g, dtype=torch.float32)


def store_every_row(emb, chunk: int = 1 << 20) -> None:
    """Writes every row of a new tiered table below its top tier as it reads (its initial values,
    optimizer state and all), untimed: the table is the same, every row of it now stored, as
    FBGEMM and torch fill theirs at construction. Each miss then reads its row from below, and no
    first-touch initialization (nor its page faults) falls in timed steps. A new table's misses
    are otherwise rows never stored, drawn with nothing read: on a GPU it runs ever slower for
    hundreds of batches as the rows written back come to be read again (measured on an H200,
    2026-11-27: zero-copy 161 M lookups/s in the first run after warming up, 107 M in the third,
    90.6 M in the fortieth, with the same misses and writes a run). chunk: rows a read and a write
    (small ones keep the temporaries out of a peak RSS). Where the store below counts the rows it
    holds, checks that it holds them all."""
    store = emb._store  # (whole rows, weights and state, each read once: write_rows reads them again)
    for start in range(0, emb.num_embeddings, chunk):
        ids = torch.arange(start, min(start + chunk, emb.num_embeddings))
        store.write(ids, store.read(ids))
    stored = store.bottom.stats().get("rows_stored")  # (the RocksDB store does not count them)
    if stored is not None and stored != emb.num_embeddings:
        raise RuntimeError(f"store_every_row: {stored} rows stored below tier 0, expected {emb.num_embeddings}")


def add_workload_args(parser: argparse.ArgumentParser, defaults: Workload = Workload()) -> None:
    """Adds --rows --dim --bags --ids-per-bag --alpha --seed --batches (defaults from `defaults`)."""
    g = parser.add_argument_group("workload")
    g.add_argument("--rows", type=int, default=None, help=f"table rows (default {defaults.rows})")
    g.add_argument("--dim", type=int, default=None, help=f"row width, fp32 (default {defaults.dim})")
    g.add_argument("--bags", type=int, default=None, help=f"bags per batch B (default {defaults.bags})")
    g.add_argument("--ids-per-bag", type=int, default=None, help=f"ids per bag L (default {defaults.ids_per_bag})")
    g.add_argument("--alpha", type=float, default=None, help=f"Zipf exponent (default {defaults.alpha})")
    g.add_argument("--seed", type=int, default=None, help=f"workload seed (default {defaults.seed})")
    g.add_argument("--batches", type=int, default=None, help=f"timed batches per run (default {defaults.batches})")


def workload_from_args(args: argparse.Namespace, defaults: Workload = Workload()) -> Workload:
    """The workload named by add_workload_args flags; flags left unset keep `defaults`."""
    changes = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(Workload)
        if getattr(args, f.name, None) is not None
    }
    return dataclasses.replace(defaults, **changes)


def workload_flags(w: Workload) -> list[str]:
    """The command-line flags that reproduce `w` (for launching subprocesses)."""
    return [
        f"--rows={w.rows}", f"--dim={w.dim}", f"--bags={w.bags}", f"--ids-per-bag={w.ids_per_bag}",
        f"--alpha={w.alpha!r}", f"--seed={w.seed}", f"--batches={w.batches}",
    ]


# -- many tables ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Table:
    """One table of a many-table workload: its rows, dim, Zipf alpha and fixed bag length."""

    rows: int
    dim: int
    alpha: float
    ids_per_bag: int


# Many tables (bench_collection.py): 8 tables of 1M-20M rows. Sum of rows x dim x 4 bytes: 7.9
# GiB (2.11 G floats, under 2^31), which FBGEMM allocates and writes at construction (8.5 GiB
# peak RSS with its row-wise state). Ours (measured): 8.5-8.6 GiB whole, 9.6 GiB cached at steady
# state (the host store's huge pages).
TABLES = (
    Table(20_000_000, 64, 0.90, 2),
    Table(2_000_000, 128, 0.94, 4),
    Table(2_000_000, 64, 0.98, 4),
    Table(1_000_000, 128, 1.03, 8),
    Table(1_000_000, 64, 1.07, 8),
    Table(1_000_000, 128, 1.11, 16),
    Table(1_000_000, 64, 1.16, 16),
    Table(1_000_000, 64, 1.20, 8),
)


class Batches:
    """Batch i: every table's ids (int64 [B * L_t], the table's own row ids), reproducible alone."""

    def __init__(self, tables: list[Table], bags: int, seed: int):
        self.tables, self.bags = tables, bags
        # One sampler per table: its own permutation and draws (table=k), the workload's seed.
        self.samplers = [ZipfSampler(t.rows, t.alpha, seed=seed, table=k) for k, t in enumerate(tables)]
        self.offsets = [offsets_for(bags, t.ids_per_bag) for t in tables]
        # Every bag's length, table-major (table 0's B bags, then table 1's, ...): int64 [B * T].
        self.lengths = torch.cat([torch.full((bags,), t.ids_per_bag, dtype=torch.int64) for t in tables])

    def ids(self, i: int) -> list[torch.Tensor]:
        return [torch.from_numpy(s.batch(i, self.bags * t.ids_per_bag)) for s, t in zip(self.samplers, self.tables)]

    @property
    def lookups_per_batch(self) -> int:
        return self.bags * sum(t.ids_per_bag for t in self.tables)


if __name__ == "__main__":
    import time

    p = argparse.ArgumentParser(description="Generate a few batches and describe the id distribution.")
    add_workload_args(p)
    a = p.parse_args()
    w = workload_from_args(a)
    t = time.perf_counter()
    src = BatchSource(w)
    t_setup = time.perf_counter() - t
    t = time.perf_counter()
    batches = src.batches(0, w.batches)
    t_gen = time.perf_counter() - t
    ids = torch.cat([b[0] for b in batches])
    uniq = torch.unique(ids).numel()
    hot = torch.from_numpy(src.ids.hottest(w.rows // 10))
    top10 = torch.isin(ids, hot).double().mean().item()
    print(f"{w}")
    print(f"setup {t_setup:.2f}s, {w.batches} batches in {t_gen:.2f}s; per batch unique ids "
          f"{torch.unique(batches[0][0]).numel()} of {w.lookups_per_batch}; over all batches {uniq}; "
          f"share of lookups in the hottest 10% of rows {top10:.3f}")

