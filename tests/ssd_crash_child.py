"""Child process of the SSD crash test: writes a deterministic history of rows, flushes
every k steps and acknowledges each flush, until it is killed.

History: step s (s = 1, 2, ...) writes rows ids_for_step(seed, s) with values
make_rows(s, ids). Before step s touches the store, "s" is appended to PROGRESS (no fsync:
the page cache survives SIGKILL of the process); after flush() returns at step s, "s" is
appended to ACKS and fsynced. A restarted child resumes at (last step in PROGRESS) + 1.
Row values encode (step, id), so the parent can tell which step a recovered row holds;
step 0 is the initial value (what the store's initializer returns).

The parent's checker only needs: ids_for_step, make_rows (the history), PROGRESS and ACKS.
A child that trains through tieredemb instead can keep that contract by logging its steps
the same way and exposing the per-step written rows.

Run: python tests/ssd_crash_child.py DIR --seed 1 --flush-every 5 [--checkpoint-at S]
     [--backend rocksdb|slots|log]
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch

NUM_ROWS = 2048
WIDTH = 16
ROWS_PER_STEP = 64
META = {"num_embeddings": NUM_ROWS, "embedding_dim": WIDTH // 2, "width": WIDTH,
        "dtype": "float32", "optimizer": {"name": "adagrad", "lr": 0.1, "eps": 1e-8},
        "seed": 7, "init": "crash-test"}


def ids_for_step(seed: int, step: int) -> np.ndarray:
    """Sorted unique int64 ids written at step (step >= 1)."""
    rng = np.random.default_rng([seed, step])
    return np.sort(rng.choice(NUM_ROWS, ROWS_PER_STEP, replace=False)).astype(np.int64)


def make_rows(step, ids) -> torch.Tensor:
    """float32 [n, WIDTH]: column 0 = step, column 1 = id, the rest a function of both.
    step: int or int64 [n]."""
    ids_t = torch.as_tensor(ids, dtype=torch.int64)
    steps = torch.as_tensor(step, dtype=torch.int64).expand_as(ids_t)
    j = torch.arange(WIDTH - 2, dtype=torch.float64)
    rest = torch.sin(steps[:, None].double() * 0.001 + ids_t[:, None].double() * 0.01 + j)
    return torch.cat([steps[:, None].double(), ids_t[:, None].double(), rest], 1).float()


def initializer(ids: torch.Tensor, out: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    if rows is None:
        out.copy_(make_rows(0, ids))
    else:
        out[rows] = make_rows(0, ids)


def read_steps(path: str) -> list[int]:
    """The complete lines of a PROGRESS / ACKS file as ints (a torn last line is ignored)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        text = f.read()
    lines = text.split("\n")
    if not text.endswith("\n"):
        lines = lines[:-1]
    return [int(x) for x in lines if x.strip()]


def open_store(table: str, backend: str | None = None, **kw):
    """backend: 'rocksdb', 'slots', 'log', or None (what the table directory holds)."""
    from ssd_backend import open_store as open_table
    return open_table(table, WIDTH, initializer, META, {"backend": backend, **kw})


def first_step(workdir: str) -> int:
    """The step a new life starts at: one past the last step a life began."""
    done = read_steps(os.path.join(workdir, "PROGRESS"))
    return (done[-1] if done else 0) + 1


def run_steps(a, first: int, table, step) -> None:
    """The life of a child once its table is open (a store or a tiered module: both have
    flush, checkpoint and close). Writes READY, then for each step: PROGRESS before it,
    step(step), a checkpoint at --checkpoint-at (CHECKPOINTED once it is complete), and a
    flush every --flush-every steps, acknowledged in ACKS once flush() returned."""
    progress = os.open(os.path.join(a.dir, "PROGRESS"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    acks = os.open(os.path.join(a.dir, "ACKS"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    with open(os.path.join(a.dir, "READY"), "w") as f:
        f.write(str(os.getpid()))
    for s in range(first, first + a.max_steps):
        os.write(progress, f"{s}\n".encode())
        step(s)
        if s == a.checkpoint_at:
            table.checkpoint(os.path.join(a.dir, "checkpoint"))
            with open(os.path.join(a.dir, "CHECKPOINTED"), "w") as f:
                f.write(f"{s}\n")
                f.flush()
                os.fsync(f.fileno())
        if s % a.flush_every == 0:
            table.flush()
            os.write(acks, f"{s}\n".encode())
            os.fsync(acks)
    table.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--flush-every", type=int, default=5)
    ap.add_argument("--checkpoint-at", type=int, default=0)
    ap.add_argument("--wal", type=int, default=1, help="rocksdb only")
    ap.add_argument("--backend", default="rocksdb", choices=["rocksdb", "slots", "log"])
    ap.add_argument("--max-steps", type=int, default=10**6)
    a = ap.parse_args(argv)
    first = first_step(a.dir)
    # RocksDB: a small write queue, so write()'s backpressure is exercised too (the native
    # stores have no queue: their writes are synchronous or staged).
    kw = {"wal": bool(a.wal), "write_queue_rows": 1024} if a.backend == "rocksdb" else {}
    store = open_store(os.path.join(a.dir, "table"), a.backend, **kw)

    def step(s: int) -> None:
        ids = ids_for_step(a.seed, s)
        store.write(torch.from_numpy(ids), make_rows(s, ids))

    run_steps(a, first, store, step)


if __name__ == "__main__":
    main()
