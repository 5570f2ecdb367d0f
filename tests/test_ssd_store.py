"""RocksDBStore on real RocksDB files in tmp_path (no fakes)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from store_holder import held_by_another_process
from ssd_backend import (RocksDBStore, StoreCorruptedError, StoreLockedError,
                         StoreWriteError)

WIDTH = 12
META = {"num_embeddings": 100_000, "embedding_dim": 6, "width": WIDTH, "dtype": "float32",
        "optimizer": {"name": "adam", "lr": 0.01, "betas": [0.9, 0.999]}, "seed": 3,
        "init": "uniform"}


def init_rows(ids: torch.Tensor, out: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """A deterministic function of the id, unlike any written row (into out, or out[rows])."""
    j = torch.arange(out.shape[1], dtype=torch.float64)
    values = (torch.cos(ids.double()[:, None] * 0.37 + j) - 3.0).float()
    if rows is None:
        out.copy_(values)
    else:
        out[rows] = values


def rows_for(ids: torch.Tensor, tag: float = 0.0) -> torch.Tensor:
    j = torch.arange(WIDTH, dtype=torch.float64)
    return (torch.sin(ids.double()[:, None] * 1.3 + j * 0.7 + tag) * 10).float()


def read(store, ids) -> torch.Tensor:
    out = torch.full((len(ids), store.width), float("nan"))
    store.read(ids, out)
    return out


def open_store(path, meta=META, **kw) -> RocksDBStore:
    return RocksDBStore(str(path), WIDTH, init_rows, meta, **kw)


def test_unwritten_rows_read_as_initializer(tmp_path):
    with open_store(tmp_path / "t") as s:
        ids = torch.tensor([5, 0, 9999, 17])
        expected = torch.empty(4, WIDTH)
        init_rows(ids, expected)
        assert torch.equal(read(s, ids), expected)
        assert s.stats()["rows_initialized"] == 4
        assert s.written_ids().numel() == 0


def test_read_your_writes_while_queued(tmp_path):
    # A tiny queue and many overlapping writes: reads must see the newest value of each row,
    # queued or written, without flush().
    with open_store(tmp_path / "t", write_queue_rows=64) as s:
        model = {}
        g = torch.Generator().manual_seed(0)
        for step in range(60):
            ids = torch.randperm(500, generator=g)[:40]
            rows = rows_for(ids, tag=step)
            s.write(ids, rows)
            rows.fill_(123.0)  # the caller reuses its buffer: the store must have copied
            for i in ids.tolist():
                model[i] = step
            probe = torch.randperm(600, generator=g)[:100]
            got = read(s, probe)
            for k, i in enumerate(probe.tolist()):
                if i in model:
                    want = rows_for(torch.tensor([i]), tag=model[i])[0]
                else:
                    want = torch.empty(1, WIDTH)
                    init_rows(torch.tensor([i]), want)
                    want = want[0]
                assert torch.equal(got[k], want), (step, i)
            assert s.stats()["queue_rows"] <= 64
        s.flush()
        st_ = s.stats()
        assert st_["queue_rows"] == 0 and st_["rows_written"] == 60 * 40
        assert s.written_ids().tolist() == sorted(model)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 0.0), (torch.float16, 1e-3),
                                       (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("compression", [None, "lz4"])
def test_dtype_and_compression_round_trip(tmp_path, dtype, tol, compression):
    ids = torch.arange(0, 3000, 3)
    rows = rows_for(ids)
    with open_store(tmp_path / "t", storage_dtype=dtype, compression=compression) as s:
        s.write(ids, rows)
        queued = read(s, ids)
        s.flush()
        flushed = read(s, ids)
    with open_store(tmp_path / "t", storage_dtype=dtype, compression=compression) as s:
        reopened = read(s, ids)
    # One value whatever tier it came from: queued, flushed, reopened.
    assert torch.equal(queued, flushed) and torch.equal(flushed, reopened)
    assert torch.equal(reopened, rows.to(dtype).float())
    if tol == 0.0:
        assert torch.equal(reopened, rows)
    else:
        rel = ((reopened - rows).abs() / rows.abs().clamp_min(1e-2)).max().item()
        assert rel <= tol, rel


def test_lz4_compresses_compressible_rows(tmp_path):
    ids = torch.arange(20_000)
    rows = torch.zeros(20_000, WIDTH)
    rows[:, 0] = ids.float()
    sizes = {}
    for comp in (None, "lz4"):
        p = tmp_path / str(comp)
        with open_store(p, compression=comp, wal=False) as s:
            s.write(ids, rows)
            s.flush()
            assert torch.equal(read(s, ids), rows)
        sizes[comp] = sum(os.path.getsize(f) for f in glob.glob(str(p / "*.sst")))
    assert sizes["lz4"] < sizes[None] / 2, sizes


def test_reopen_after_clean_close_restores_rows_and_meta(tmp_path):
    ids = torch.tensor([1, 2, 3, 9000])
    s = open_store(tmp_path / "t", wal=False)  # close() must flush the memtable itself
    s.write(ids, rows_for(ids))
    s.close()
    s.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        read(s, ids)
    stored = RocksDBStore.read_meta(tmp_path / "t")
    assert stored["meta"] == META and stored["width"] == WIDTH
    assert stored["storage_dtype"] == "float32"
    with RocksDBStore(str(tmp_path / "t"), None, init_rows, None) as s:  # adopt what is stored
        assert s.meta == META and s.width == WIDTH
        assert torch.equal(read(s, ids), rows_for(ids))
        assert s.written_ids().tolist() == [1, 2, 3, 9000]
        assert s.written_ids(3, 1).tolist() == [3]
        assert s.written_ids(9001).tolist() == []


@pytest.mark.parametrize("field,value", [
    ("num_embeddings", 200_000), ("embedding_dim", 8), ("dtype", "float16"),
    ("optimizer", {"name": "adam", "lr": 0.02, "betas": [0.9, 0.999]}), ("seed", 4),
    ("init", "normal"), ("extra_field", 1)])
def test_meta_mismatch_names_the_field(tmp_path, field, value):
    open_store(tmp_path / "t").close()
    meta = dict(META, **{field: value})
    with pytest.raises(ValueError, match=rf"stored {field} .* != requested"):
        open_store(tmp_path / "t", meta=meta)
    # The failed open released the table.
    open_store(tmp_path / "t").close()


def test_width_and_storage_dtype_mismatch(tmp_path):
    open_store(tmp_path / "t").close()
    with pytest.raises(ValueError, match="stored width 12 != requested 16"):
        RocksDBStore(str(tmp_path / "t"), 16, init_rows, dict(META, width=16))
    with pytest.raises(ValueError, match="stored storage_dtype float32 != requested float16"):
        open_store(tmp_path / "t", storage_dtype=torch.float16)


def test_bad_arguments_name_the_value(tmp_path):
    with open_store(tmp_path / "t") as s:
        with pytest.raises(IndexError, match=r"id 100000 out of range \[0, 100000\)"):
            read(s, torch.tensor([1, 100_000]))
        with pytest.raises(IndexError, match="id -1 out of range"):
            s.write(torch.tensor([-1]), torch.zeros(1, WIDTH))
        with pytest.raises(ValueError, match=r"float32 \[2, 12\]"):
            s.write(torch.tensor([1, 2]), torch.zeros(2, WIDTH + 1))
        assert s.written_ids().numel() == 0  # a call that raised changed nothing
    with pytest.raises(ValueError, match="storage_dtype"):
        open_store(tmp_path / "u", storage_dtype=torch.float64)
    with pytest.raises(ValueError, match="compression 'zstd'"):
        open_store(tmp_path / "u", compression="zstd")


def test_table_held_by_another_process(tmp_path):
    path = str(tmp_path / "t")
    open_store(path, meta=None).close()
    with held_by_another_process("RocksDBStore", path):
        with pytest.raises(StoreLockedError, match=r"lock file .*/t/LOCK.* held by another"):
            open_store(path, meta=None)
        # Reading the metadata does not need the lock.
        assert RocksDBStore.read_meta(path)["width"] == WIDTH
    open_store(path, meta=None).close()  # released when the holder closed


def test_same_process_second_open_is_refused_until_close(tmp_path):
    s = open_store(tmp_path / "t")
    with pytest.raises(StoreLockedError, match="LOCK"):
        open_store(tmp_path / "t")
    s.close()
    open_store(tmp_path / "t").close()


def test_directory_that_is_not_a_table(tmp_path):
    d = tmp_path / "notes"
    d.mkdir()
    (d / "readme.txt").write_text("not a table")
    with pytest.raises(ValueError, match="not an SSD table"):
        open_store(d)
    assert sorted(os.listdir(d)) == ["readme.txt"]  # nothing created there
    with pytest.raises(ValueError, match="not an SSD table"):
        RocksDBStore.read_meta(d)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        open_store(f)


def test_rocksdb_without_our_metadata_is_not_a_table(tmp_path):
    import rocksdict
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    db = rocksdict.Rdict(str(tmp_path / "t"), opts)
    db[b"12345678"] = b"x"
    db.close()
    with pytest.raises(ValueError, match="without the tieredemb metadata"):
        open_store(tmp_path / "t")


def _table_with_sst(path) -> torch.Tensor:
    ids = torch.arange(20_000)
    with open_store(path, wal=False) as s:
        s.write(ids, rows_for(ids))
    return ids


def _corrupt_middle(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\xde\xad\xbe\xef" * 16)


@pytest.mark.parametrize("damage", ["sst_bytes", "sst_truncated", "sst_missing", "current",
                                    "manifest_bytes", "manifest_truncated"])
def test_corrupted_or_truncated_files_raise_clear_error(tmp_path, damage):
    path = tmp_path / "t"
    ids = _table_with_sst(path)
    sst = glob.glob(str(path / "*.sst"))
    manifest = glob.glob(str(path / "MANIFEST-*"))
    assert sst and manifest
    if damage == "sst_bytes":
        _corrupt_middle(sst[0])
    elif damage == "sst_truncated":
        os.truncate(sst[0], os.path.getsize(sst[0]) // 2)
    elif damage == "sst_missing":
        os.remove(sst[0])
    elif damage == "current":
        (path / "CURRENT").write_text("MANIFEST-999999\n")
    elif damage == "manifest_bytes":
        _corrupt_middle(manifest[0])
    else:
        os.truncate(manifest[0], 10)
    with pytest.raises(StoreCorruptedError, match=f"ssd_path {path}: .*corrupted") as info:
        s = open_store(path)
        try:
            read(s, ids)  # a damaged data block shows only when it is read
        finally:
            s.close()
    assert damage != "sst_bytes" or "checksum mismatch" in str(info.value)


def test_corrupted_metadata_record(tmp_path):
    import rocksdict
    from ssd_backend.rocksdb_store import META_KEY
    open_store(tmp_path / "t").close()
    db = rocksdict.Rdict(str(tmp_path / "t"), rocksdict.Options(raw_mode=True))
    db[META_KEY] = b"{not json"
    db.close()
    with pytest.raises(StoreCorruptedError, match="metadata record"):
        open_store(tmp_path / "t")


@pytest.fixture
def small_disk(tmp_path):
    """A real 3 MiB tmpfs: writes hit ENOSPC for real (needs root; skipped otherwise)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill a disk for real: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_full_disk_error_reaches_caller_and_flushed_data_survives(small_disk):
    path = small_disk / "t"
    s = open_store(path, meta=dict(META, num_embeddings=10**6))
    flushed = torch.arange(100)
    s.write(flushed, rows_for(flushed))
    s.flush()
    with pytest.raises(StoreWriteError, match="No space left on device"):
        for k in range(1, 1000):  # 1000 rows x 48 bytes per write: fills 3 MiB soon
            ids = torch.arange(k * 1000, (k + 1) * 1000)
            s.write(ids, rows_for(ids, tag=1.0))
            if k % 10 == 0:
                s.flush()
    # The error sticks: every later write/flush reports it; reads still work.
    with pytest.raises(StoreWriteError):
        s.write(flushed, rows_for(flushed, tag=2.0))
    with pytest.raises(StoreWriteError):
        s.flush()
    assert torch.equal(read(s, flushed), rows_for(flushed))
    with pytest.raises(StoreWriteError):
        s.close()
    s.close()  # closed now; the lock is released
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    with open_store(path, meta=dict(META, num_embeddings=10**6)) as s:
        assert torch.equal(read(s, flushed), rows_for(flushed))
        for i in s.written_ids(1000).tolist()[::97]:  # later rows: whole, or not there
            assert torch.equal(read(s, torch.tensor([i])), rows_for(torch.tensor([i]), 1.0))


def test_checkpoint_opens_as_table_with_queued_writes(tmp_path):
    ids = torch.arange(0, 5000, 7)
    with open_store(tmp_path / "t", write_queue_rows=1 << 20) as s:
        s.write(ids, rows_for(ids))
        s.checkpoint(tmp_path / "snap")  # includes the still-queued rows
        s.write(ids, rows_for(ids, tag=1.0))  # after the snapshot: not in it
        with pytest.raises(ValueError, match="already exists"):
            s.checkpoint(tmp_path / "snap")
    with open_store(tmp_path / "snap") as snap:
        assert torch.equal(read(snap, ids), rows_for(ids))
        assert torch.equal(snap.written_ids(), ids)
    with open_store(tmp_path / "t") as s:
        assert torch.equal(read(s, ids), rows_for(ids, tag=1.0))


def test_stats_count_rows_and_bytes(tmp_path):
    with open_store(tmp_path / "t") as s:
        s.write(torch.arange(10), rows_for(torch.arange(10)))
        s.flush()
        read(s, torch.arange(20))
        st_ = s.stats()
    assert st_["writes"] == 1 and st_["rows_written"] == 10
    assert st_["bytes_written"] == 10 * WIDTH * 4
    assert st_["reads"] == 20 and st_["rows_found"] == 10 and st_["rows_initialized"] == 10
    assert st_["bytes_read"] == 10 * WIDTH * 4 and st_["queue_rows"] == 0


def test_large_read_uses_reader_pool_and_keeps_order(tmp_path):
    ids = torch.arange(0, 40_000, 2)
    with open_store(tmp_path / "t", reader_threads=4, wal=False) as s:
        s.write(ids, rows_for(ids))
        s.flush()
        probe = torch.randperm(40_000, generator=torch.Generator().manual_seed(1))
        got = read(s, probe)
    written = probe % 2 == 0
    assert torch.equal(got[written], rows_for(probe[written]))
    expected = torch.empty(int((~written).sum()), WIDTH)
    init_rows(probe[~written], expected)
    assert torch.equal(got[~written], expected)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["write", "read", "flush", "reopen"]),
                              st.lists(st.integers(0, 63), min_size=0, max_size=20, unique=True)),
                    max_size=25))
def test_model_based_read_your_writes(tmp_path_factory, ops):
    path = tmp_path_factory.mktemp("m") / "t"
    model: dict[int, torch.Tensor] = {}
    s = open_store(path, write_queue_rows=8)
    try:
        for n, (op, id_list) in enumerate(ops):
            ids = torch.tensor(id_list, dtype=torch.int64)
            if op == "write":
                rows = rows_for(ids, tag=n)
                s.write(ids, rows)
                model.update(zip(id_list, rows))
            elif op == "read":
                got = read(s, ids)
                for k, i in enumerate(id_list):
                    if i in model:
                        assert torch.equal(got[k], model[i])
            elif op == "flush":
                s.flush()
            else:
                s.close()
                s = open_store(path)
        assert s.written_ids().tolist() == sorted(model)
    finally:
        s.close()
    shutil.rmtree(path)


def test_a_writer_stopped_on_its_own_thread_does_not_wait_for_itself():
    """A RocksDB store dropped in a reference cycle is finalized by whichever thread collects it:
    its own writer thread, maybe while that holds the queue's lock (the collection runs at an
    allocation inside _loop's hold). stop() then took that lock again and hung the thread, and
    interpreter exit after it. Here stop() is called the same way, from the thread under the lock."""
    import threading
    import weakref

    import numpy as np

    from ssd_backend.common import WriteBehind

    class Store:  # (a stand-in for the store: what is tested is the writer's own thread and lock)
        def apply(self, batches):
            with wb._cond:
                wb.stop()
            returned.set()
            return 0

    store, returned = Store(), threading.Event()
    wb = WriteBehind("t", weakref.WeakMethod(store.apply), lambda e: e, 100, 100, dict.fromkeys(
        ("writes", "rows_written", "bytes_written", "rows_queued_hits"), 0))
    wb.enqueue(np.arange(2, dtype=np.int64), torch.zeros(2, 4))
    assert returned.wait(10), "stop() on the writer's own thread, under its lock, hung"
    wb._thread.join(10)
    assert not wb._thread.is_alive()


def test_reopening_keeps_two_of_rocksdbs_info_logs(tmp_path):
    """Each open rolls RocksDB's LOG to LOG.old.<time>, and RocksDB keeps 1000 by default (a review:
    200 opens left 199 of them, 35 KB each)."""
    for _ in range(6):
        open_store(tmp_path / "t").close()
    assert len(glob.glob(str(tmp_path / "t" / "LOG.old.*"))) <= 2
