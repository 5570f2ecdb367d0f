"""Child process of the SSD training crash test: trains a TieredEmbeddingBag on an SSD table
on deterministic batches, flushes every k steps and acknowledges each flush, until killed.

History: step s (s = 1, 2, ...) runs forward / backward on batch(s) (a function of s only).
Before step s starts, "s" is appended to PROGRESS (no fsync: the page cache survives SIGKILL
of the process); after flush() returns following step s, "s" is appended to ACKS and fsynced.
A restarted child reopens the same table and resumes at (last step in PROGRESS) + 1, so its
state at the start of a life is whatever the previous life left on disk.
With --checkpoint-at c, emb.checkpoint(DIR/checkpoint) is taken right after step c, then
"c" is written to CHECKPOINTED (fsynced).

The parent (test_ssd_train_crash.py) replays the same steps with make_table(None) and
train_step: results do not depend on tier sizes (bit for bit on the CPU).

Run: python tests/ssd_train_child.py DIR --flush-every 5 --cache-rows 192 [--host-rows 512]
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch

import tieredemb  # not preloaded by the fork server: see _PRELOAD in the test
from ssd_crash_child import first_step, run_steps

NUM_ROWS = 4096
DIM = 8
BAGS = 32
BAG_SIZE = 4  # at most 128 unique ids per batch: tier 0 needs >= 128 rows
SEED = 7
# Per backend: RocksDB with a small write queue (write() backpressure is exercised too); the log
# store with small segments (compaction runs, and is killed, many times).
SSD_OPTIONS = {"rocksdb": {"write_queue_rows": 1024}, "log": {"backend": "log", "segment_bytes": 64 << 10}}


def optimizer(name: str = "adagrad"):
    return {"adagrad": tieredemb.Adagrad(lr=0.05), "adam": tieredemb.Adam(lr=0.01)}[name]


def make_table(ssd_path=None, cache_rows=None, host_rows=None, opt: str = "adagrad", backend: str = "rocksdb"):
    """The test's table. ssd_path None and cache_rows None: the in-memory reference."""
    return tieredemb.TieredEmbeddingBag(
        NUM_ROWS, DIM, mode="sum", cache_rows=cache_rows, host_rows=host_rows,
        ssd_path=ssd_path, optimizer=optimizer(opt), seed=SEED,
        ssd_options=SSD_OPTIONS[backend] if ssd_path is not None else None)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [BAGS, BAG_SIZE], target float32 [BAGS, DIM]) of a step. Ids are skewed
    towards small ids: hot rows stay in tier 0, cold ones are evicted to the SSD dirty."""
    rng = np.random.default_rng([SEED, step])
    ids = (NUM_ROWS * rng.random((BAGS, BAG_SIZE)) ** 3).astype(np.int64)
    target = rng.standard_normal((BAGS, DIM)).astype(np.float32)
    return torch.from_numpy(ids), torch.from_numpy(target)


def train_step(emb, step: int) -> torch.Tensor:
    """One forward / backward (the fused optimizer updates the rows). Returns the unique ids."""
    ids, target = batch(step)
    out = emb(ids)
    ((out - target) ** 2).sum().backward()
    return torch.unique(ids)


def read_all(emb) -> torch.Tensor:
    """float32 [NUM_ROWS, width]: every row's weights ‖ optimizer state."""
    ids = torch.arange(NUM_ROWS)
    return torch.cat([emb.read_rows(ids), emb.read_optimizer_state(ids)], 1)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--flush-every", type=int, default=5)
    ap.add_argument("--cache-rows", type=int, default=192)
    ap.add_argument("--host-rows", type=int, default=0, help="0: no host tier")
    ap.add_argument("--checkpoint-at", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=10**6)
    ap.add_argument("--backend", default="rocksdb", choices=sorted(SSD_OPTIONS))
    a = ap.parse_args(argv)
    first = first_step(a.dir)
    emb = make_table(os.path.join(a.dir, "table"), a.cache_rows, a.host_rows or None, backend=a.backend)
    run_steps(a, first, emb, lambda s: train_step(emb, s))


if __name__ == "__main__":
    main()
