"""Crash tests of training on an SSD table: a child process trains a TieredEmbeddingBag
(ssd_train_child.py), flushing every k steps and acknowledging each flush; the parent
SIGKILLs it at random moments, reopens the table and checks every row against a replay of
the same batches in an in-memory table.

The check is exact (float bits), per row, weights and optimizer state:
- Each life reopens the table the previous life left and resumes at the step after its last
  PROGRESS entry. The state it starts from (S) is exactly what the parent read and checked
  after the previous kill, so the parent's reference for this life is an in-memory table
  loaded with S and trained on the same steps: it knows every value each row really held at
  every step of the life, even though S itself mixes rows from different steps.
- Let A = the last acknowledged flush of this life (None: the life start) and P = the last
  step started (PROGRESS). A row must hold the value it had after step A, or the value after
  a later step <= P that touched it (already written back by an eviction or flush). Anything
  else is a lost flushed update, a missing row or an invented value. Rows never touched must
  read as their initial values; that is the case S = init of the first life.
- Results do not depend on tier sizes (bit for bit on the CPU), so each life picks its own
  tier-0 and host-cache sizes.
Recovery of a recovered table, and kills during recovery, are covered because lives chain.

CI size: >= 20 kills in well under 60 s. --runslow runs test_train_crash_soak (hundreds).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import random
import signal
import time

import pytest
import torch

import ssd_train_child as child
from ssd_backend import detect_backend
from ssd_crash_child import read_steps

# (cache_rows, host_rows); 0 = no host tier. Every one holds a batch's unique ids in tier 0.
TIER_SIZES = [(128, 0), (192, 512), (256, 0), (160, 2048), (1024, 0)]

# Preloaded by the fork server: NOT tieredemb. Importing tieredemb starts its native thread
# pool, which does not survive fork(): a child forked after it hangs in its first parallel
# kernel (see test_native_pool_survives_fork). Each child imports tieredemb itself (~40 ms).
_PRELOAD = ["torch", "numpy", "rocksdict"]


@pytest.fixture(scope="module")
def fork_ctx():
    """A forkserver that imported torch once: a child starts in ~50 ms instead of ~2 s, and is
    still a fresh process that shares no RocksDB handle with us. The fork server is one per
    process; test_ssd_crash.py may have started it with tieredemb preloaded, so it is
    restarted with _PRELOAD here and stopped again (its preload list restored) afterwards."""
    server = multiprocessing.forkserver._forkserver
    saved = server._preload_modules
    server._stop()
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    yield ctx
    server._stop()
    server._preload_modules = saved


def _bits(rows: torch.Tensor) -> torch.Tensor:
    return rows.contiguous().view(torch.int32)


def _same_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bool [n]: rows of a and b equal bit for bit."""
    return (_bits(a) == _bits(b)).all(1)


def _read_table(path: str, cache_rows=64, host_rows=None, backend="rocksdb") -> torch.Tensor:
    emb = child.make_table(path, cache_rows, host_rows, backend=backend)
    try:
        return child.read_all(emb)
    finally:
        emb.close()


class TrainReplay:
    """The reference: in-memory tables trained on the same steps, life after life."""

    def __init__(self, backend: str = "rocksdb"):
        self.backend = backend
        self.state = child.read_all(child.make_table())  # S of the first life: init
        self.progress = 0

    def check(self, workdir: str) -> dict:
        """Checks the table in workdir after a kill; it becomes the next life's start."""
        progress = read_steps(os.path.join(workdir, "PROGRESS"))
        acks = read_steps(os.path.join(workdir, "ACKS"))
        p = progress[-1] if progress else self.progress
        a = acks[-1] if acks and acks[-1] > self.progress else None
        assert p >= self.progress

        ref = child.make_table()
        ids = torch.arange(child.NUM_ROWS)
        ref.write_rows(ids, self.state[:, :child.DIM], self.state[:, child.DIM:])
        at_ack = self.state.clone()  # each row's value after step A
        later = []  # (ids, rows) after each step in (A, P]
        for step in range(self.progress + 1, p + 1):
            touched = child.train_step(ref, step)
            rows = torch.cat([ref.read_rows(touched), ref.read_optimizer_state(touched)], 1)
            if a is not None and step <= a:
                at_ack[touched] = rows
            else:
                later.append((touched, rows))
        final = child.read_all(ref)

        got = _read_table(os.path.join(workdir, "table"), backend=self.backend)
        ok = _same_rows(got, at_ack)
        for touched, rows in later:
            ok[touched] |= _same_rows(got[touched], rows)
        if not bool(ok.all()):
            bad = ok.logical_not().nonzero().flatten()[:5].tolist()
            detail = [(i, got[i].tolist(), at_ack[i].tolist()) for i in bad]
            raise AssertionError(
                f"after a kill with last ack {a}, progress {p} (life started after step "
                f"{self.progress}): {int((~ok).sum())} rows hold no value they had from the ack "
                f"to the kill; (id, held, value at ack): {detail}")
        report = {"progress": p, "ack": a,
                  "rows_not_latest": int((~_same_rows(got, final)).sum()),
                  "rows_changed_since_ack": int((~_same_rows(final, at_ack)).sum())}
        self.state = got
        self.progress = p
        return report


def _start_child(ctx, workdir: str, rnd: random.Random, extra=(), backend="rocksdb"):
    cache_rows, host_rows = rnd.choice(TIER_SIZES)
    ready = os.path.join(workdir, "READY")
    if os.path.exists(ready):
        os.remove(ready)
    proc = ctx.Process(
        target=child.main,
        args=([workdir, "--flush-every", str(rnd.choice([3, 5, 8])), "--cache-rows",
               str(cache_rows), "--host-rows", str(host_rows), "--backend", backend, *extra],), daemon=True)
    proc.start()
    return proc


def _wait_for(proc, path: str, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.is_alive(), f"child died with exit code {proc.exitcode} before {what}"
        assert time.monotonic() < deadline, f"child did not {what} in {timeout} s"
        time.sleep(0.005)


def _kill(proc) -> None:
    assert proc.is_alive(), f"child exited early with code {proc.exitcode}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    assert proc.exitcode == -signal.SIGKILL


def _run_lives(ctx, workdir: str, kills: int, seed: int, backend: str = "rocksdb") -> list[dict]:
    rnd = random.Random(seed)
    replay = TrainReplay(backend)
    reports = []
    for _ in range(kills):
        proc = _start_child(ctx, workdir, rnd, backend=backend)
        if rnd.random() < 0.15:
            time.sleep(rnd.uniform(0.0, 0.05))  # may land while the table is opening
        else:
            _wait_for(proc, os.path.join(workdir, "READY"), "open the table")
            time.sleep(rnd.uniform(0.02, 0.35))
        _kill(proc)
        if detect_backend(os.path.join(workdir, "table")) is None:
            continue  # killed before the table was created: nothing to check yet
        reports.append(replay.check(workdir))
    return reports


@pytest.mark.parametrize("backend", ["rocksdb", "log"])
def test_train_crash_kill9_loses_no_flushed_update(tmp_path, fork_ctx, backend):
    reports = _run_lives(fork_ctx, str(tmp_path), kills=24, seed=23, backend=backend)
    assert len(reports) >= 20
    acked = [r for r in reports if r["ack"] is not None]
    assert len(acked) >= 10, f"too few lives got to a flush: {reports}"
    # The check has teeth: rows changed after the ack (a lost flush would show) and rows
    # that legitimately hold an older value than the latest one both occurred.
    assert sum(r["rows_changed_since_ack"] for r in acked) > 0, reports
    assert sum(r["rows_not_latest"] for r in reports) > 0, reports
    assert reports[-1]["progress"] > 200, reports


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["rocksdb", "log"])
def test_train_crash_soak(tmp_path, fork_ctx, backend):
    reports = _run_lives(fork_ctx, str(tmp_path), kills=300, seed=101, backend=backend)
    assert len(reports) >= 280


def test_checkpoint_before_crash_opens_as_it_was(tmp_path, fork_ctx):
    workdir = str(tmp_path)
    at = 60
    proc = _start_child(fork_ctx, workdir, random.Random(5), ["--checkpoint-at", str(at)])
    _wait_for(proc, os.path.join(workdir, "CHECKPOINTED"), "checkpoint")
    time.sleep(0.15)  # keep training after the checkpoint, then die
    _kill(proc)
    assert read_steps(os.path.join(workdir, "PROGRESS"))[-1] > at + 5

    ref = child.make_table()
    for step in range(1, at + 1):
        child.train_step(ref, step)
    expected = child.read_all(ref)
    got = _read_table(os.path.join(workdir, "checkpoint"), cache_rows=100, host_rows=300)
    differ = (~_same_rows(got, expected)).nonzero().flatten()
    assert len(differ) == 0, f"checkpoint at step {at}: rows {differ[:10].tolist()} differ"
    # The live table went on past the checkpoint and recovered by the crash rule.
    TrainReplay().check(workdir)


# ------------------------------------------------------------------ clean close and reopen

def _train(emb, steps) -> None:
    for step in steps:
        child.train_step(emb, step)


@pytest.mark.parametrize("opt", ["adagrad", "adam"])
def test_reopen_after_clean_close_keeps_rows_and_state(tmp_path, opt):
    path = str(tmp_path / "table")
    emb = child.make_table(path, cache_rows=128, host_rows=512, opt=opt)
    _train(emb, range(1, 81))
    before = child.read_all(emb)
    emb.close()
    ref = child.make_table(opt=opt)
    _train(ref, range(1, 81))
    expected = child.read_all(ref)
    assert torch.equal(_bits(before), _bits(expected))  # tier sizes do not change results
    for cache_rows, host_rows in [(None, None), (300, None), (130, 4000)]:
        emb = child.make_table(path, cache_rows, host_rows, opt=opt)
        got = child.read_all(emb)
        emb.close()
        differ = (~_same_rows(got, expected)).nonzero().flatten()
        assert len(differ) == 0, (f"reopened with cache_rows={cache_rows}, host_rows="
                                  f"{host_rows}: rows {differ[:10].tolist()} differ")


def _resume_one_step(tmp_path, opt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows after 40 steps, close, reopen, 1 step; rows after 41 uninterrupted steps)."""
    path = str(tmp_path / "table")
    emb = child.make_table(path, cache_rows=128, opt=opt)
    _train(emb, range(1, 41))
    emb.close()
    emb = child.make_table(path, cache_rows=128, opt=opt)
    _train(emb, [41])
    resumed = child.read_all(emb)
    emb.close()
    ref = child.make_table(opt=opt)
    _train(ref, range(1, 42))
    return resumed, child.read_all(ref)


def test_training_resumes_after_reopen_adagrad(tmp_path):
    resumed, uninterrupted = _resume_one_step(tmp_path, "adagrad")
    assert torch.equal(_bits(resumed), _bits(uninterrupted))


def test_training_resumes_after_reopen_adam(tmp_path):
    resumed, uninterrupted = _resume_one_step(tmp_path, "adam")
    differ = (~_same_rows(resumed, uninterrupted)).nonzero().flatten()
    assert len(differ) == 0, f"rows {differ[:10].tolist()} differ after one resumed step"


def _fork_and_read_rows() -> int:
    """Forks; the child reads every row of a new in-memory table (a parallel native kernel).
    Returns the child's exit code, or -1 if it did not finish in 5 s (then it is killed)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            # torch's own OpenMP pool is not fork-safe once the parent used it (torch's
            # DataLoader workers do the same); tieredemb's native pool must be, on its own.
            torch.set_num_threads(1)
            child.read_all(child.make_table())
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -1


def test_native_pool_survives_fork():
    assert _fork_and_read_rows() == 0, "the forked child hung in its first parallel kernel"
