"""SlotFileStore (the native slot-file SSD backend) on real files: round trips, the
initializer, read-your-writes, reopen, metadata and lock errors, damaged files, O_DIRECT,
kill -9 after flush, and open_store's backend choice. The shared crash checker runs against
this backend too (tests/test_ssd_crash.py, parametrized)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from native_store_rows import META, N, WIDTH, init_rows, read, rows_for
from store_holder import held_by_another_process
from test_ssd_store import small_disk  # noqa: F401 - a fixture: a real 3 MiB tmpfs
from ssd_backend import (RocksDBStore, SlotFileStore, StoreCorruptedError, StoreLockedError,
                         StoreWriteError, detect_backend, open_store)


def make(path, meta=META, **kw) -> SlotFileStore:
    return SlotFileStore(path, WIDTH, init_rows, meta, **kw)


def _direct_ok(path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


@pytest.fixture(params=[False, True], ids=["buffered", "o_direct"])
def direct(request, tmp_path):
    if request.param:
        probe = tmp_path / "probe"
        probe.write_bytes(b"\0" * 4096)
        if not _direct_ok(probe):  # e.g. tmpfs: the filesystem refuses O_DIRECT
            pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
        probe.unlink()
    return request.param


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 0), (torch.float16, 1e-2),
                                       (torch.bfloat16, 1e-1)])
def test_round_trip_and_initializer(tmp_path, direct, dtype, tol):
    ids = torch.tensor([0, 7, 8, 9, N - 1, 2048])
    with make(tmp_path / "t", storage_dtype=dtype, direct_reads=direct) as s:
        s.write(ids, rows_for(ids))
        s.flush()
        probe = torch.cat([ids, torch.tensor([1, 4999 - 1])])
        got = read(s, probe)
        torch.testing.assert_close(got[:6], rows_for(ids), rtol=tol, atol=tol * 40)
        expected_init = torch.empty(2, WIDTH)
        init_rows(probe[6:], expected_init)
        assert torch.equal(got[6:], expected_init)  # never written: the initializer, exactly
        assert s.written_ids().tolist() == sorted(ids.tolist())
        assert s.slot_bytes == (512 if direct else WIDTH * dtype.itemsize)
        st = s.stats()
        assert st["rows_found"] == 6 and st["rows_initialized"] == 2 and st["rows_stored"] == 6


def test_reopen_restores_rows_meta_and_either_io_mode(tmp_path, direct):
    ids = torch.randperm(N)[:1500]
    with make(tmp_path / "t", direct_reads=direct) as s:
        s.write(ids, rows_for(ids))
    for reopen_direct in {False, direct}:  # an O_DIRECT table opens buffered and back
        with SlotFileStore(tmp_path / "t", None, init_rows, None,
                           direct_reads=reopen_direct) as s:
            assert s.width == WIDTH and s.meta == META and s.num_rows == N
            assert torch.equal(read(s, ids), rows_for(ids))
            assert torch.equal(s.written_ids(), ids.sort().values)
            assert s.written_ids(start=int(ids.min()) + 1, limit=3).tolist() == \
                ids.sort().values[1:4].tolist()


def _damage_slots(path, ids, slot_bytes) -> None:
    """Overwrites the first half of these rows' slots with garbage, as a copy into the
    mapping cut by kill -9 would leave them. (A fake: such a kill cannot be aimed at the
    few microseconds of one copy; tests/test_ssd_crash.py kills real processes at random.)"""
    with open(os.path.join(path, "slots.bin"), "r+b") as f:
        for i in ids.tolist():
            f.seek(i * slot_bytes)
            f.write(b"\xff" * (slot_bytes // 2))


def test_redo_log_repairs_a_torn_copy_and_a_torn_log_changes_nothing(tmp_path):
    path = tmp_path / "t"
    base = torch.arange(200)
    with make(path) as s:
        s.write(base, rows_for(base))
        s.flush()
        latest = torch.tensor([7, 3000, 150])
        s.write(latest, rows_for(latest, 5.0))  # the redo log now holds this write
        slot_bytes = s.slot_bytes
    _damage_slots(path, latest, slot_bytes)
    with make(path) as s:  # replays the log: the torn rows are whole again
        assert s.stats()["rows_replayed"] == 3
        assert torch.equal(read(s, latest), rows_for(latest, 5.0))
        assert torch.equal(read(s, base[:7]), rows_for(base[:7]))
    # A log record cut by a crash (its copy never began): not replayed, the slots keep what
    # they hold. The record is 32 header bytes, 3 ids and 3 rows: the write stopped after 100.
    log = path / "redo.log"
    raw = bytearray(log.read_bytes())
    raw[100:32 + 3 * 8 + 3 * WIDTH * 4] = bytes(32 + 3 * 8 + 3 * WIDTH * 4 - 100)
    log.write_bytes(bytes(raw))
    _damage_slots(path, torch.tensor([9]), slot_bytes)
    with make(path) as s:
        assert s.stats()["rows_replayed"] == 0
        assert torch.equal(read(s, latest), rows_for(latest, 5.0))
        assert (read(s, torch.tensor([9]))[0, 0] != 9.0).item()  # not repaired: not in the log


def test_write_is_stored_when_it_returns(tmp_path):
    """Writes are synchronous: a read right after sees them; dtypes convert on the way."""
    with make(tmp_path / "t", storage_dtype=torch.float16) as s:
        ids = torch.tensor([4, 2, 4000])
        s.write(ids, rows_for(ids, 0.5))
        assert torch.allclose(read(s, ids), rows_for(ids, 0.5), rtol=1e-3)
        assert s.stats()["rows_written"] == 3 and s.stats()["rows_stored"] == 3


@pytest.mark.parametrize("field,value", [("num_embeddings", N + 1), ("seed", 4),
                                         ("optimizer", "sgd"), ("extra", 1)])
def test_meta_mismatch_names_the_field(tmp_path, field, value):
    make(tmp_path / "t").close()
    with pytest.raises(ValueError, match=f"stored {field} .* != requested"):
        make(tmp_path / "t", meta=dict(META, **{field: value}))
    make(tmp_path / "t").close()  # the failed open released the lock


def test_width_dtype_and_argument_errors(tmp_path):
    make(tmp_path / "t").close()
    with pytest.raises(ValueError, match="stored width 12 != requested 8"):
        SlotFileStore(tmp_path / "t", 8, init_rows, META)
    with pytest.raises(ValueError, match="stored storage_dtype float32 != requested float16"):
        make(tmp_path / "t", storage_dtype=torch.float16)
    with pytest.raises(ValueError, match="num_embeddings"):
        make(tmp_path / "u", meta={"seed": 1})
    with make(tmp_path / "t") as s:
        with pytest.raises(IndexError, match=f"id {N} out of range \\[0, {N}\\)"):
            s.write(torch.tensor([1, N]), rows_for(torch.tensor([1, N])))
        with pytest.raises(ValueError, match="float32 \\[2, 12\\]"):
            s.write(torch.tensor([1, 2]), torch.zeros(2, 3))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="not a slot table"):
        make(tmp_path / "other")


def test_table_held_by_another_process(tmp_path):
    path = str(tmp_path / "t")
    make(path).close()
    with held_by_another_process("SlotFileStore", path):
        with pytest.raises(StoreLockedError, match=r"lock file .*/t/LOCK is held by another"):
            make(path)
        assert SlotFileStore.read_meta(path)["width"] == WIDTH  # no lock needed
    s = make(path)  # released when the holder closed
    with pytest.raises(StoreLockedError, match="LOCK"):  # same process, still open
        make(path)
    s.close()


@pytest.mark.parametrize("damage", ["slots_truncated", "bitmap_truncated", "slots_missing",
                                    "meta_garbage", "bitmap_bits_past_end"])
def test_damaged_files_raise_clear_error(tmp_path, damage):
    path = tmp_path / "t"
    meta = dict(META, num_embeddings=N - 3)  # N - 3 rows: the bitmap's last byte is partial
    with make(path, meta=meta) as s:
        s.write(torch.arange(100), rows_for(torch.arange(100)))
    if damage == "slots_truncated":
        os.truncate(path / "slots.bin", 100 * 48 + 7)
        match = "slots.bin has 4807 bytes, expected .* truncated"
    elif damage == "bitmap_truncated":
        os.truncate(path / "written.bin", 10)
        match = "written.bin has 10 bytes, expected 625"
    elif damage == "slots_missing":
        os.remove(path / "slots.bin")
        match = "slots.bin: No such file"
    elif damage == "meta_garbage":
        (path / "slots.json").write_text("{not json")
        match = "metadata record .*slots.json is not valid"
    else:
        with open(path / "written.bin", "r+b") as f:
            f.seek(624)
            f.write(b"\xff")
        match = "marks rows >= num_rows 4997 as written"
    with pytest.raises(StoreCorruptedError, match=f"ssd_path {path}: .*{match}"):
        make(path, meta=meta)
    with pytest.raises(StoreCorruptedError):  # again: the failed open released the lock
        make(path, meta=meta)


_KILLED = textwrap.dedent("""
    import sys, torch
    from ssd_backend import SlotFileStore
    N, W = 5000, 12
    def init(ids, out, rows=None): out.zero_() if rows is None else out.index_fill_(0, rows, 0.0)
    s = SlotFileStore(sys.argv[1], W, init, {"num_embeddings": N}, direct_reads=sys.argv[2] == "1")
    tag = float(sys.argv[3])
    ids = torch.arange(0, N, 3)
    s.write(ids, ids[:, None].float() + tag + torch.zeros(1, W))
    s.flush()
    print("flushed", flush=True)
    k = 0
    while True:  # unflushed writes to other rows until killed
        more = torch.arange(1 + k % 2, N, 3)
        s.write(more, more[:, None].float() + 1000 + k + torch.zeros(1, W))
        k += 1
""")


def test_flushed_rows_survive_sigkill(tmp_path, direct):
    path = str(tmp_path / "t")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    ids = torch.arange(0, N, 3)
    for life in range(2):
        child = subprocess.Popen([sys.executable, "-c", _KILLED, path, str(int(direct)),
                                  str(life * 0.5)], stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert child.stdout.readline().strip() == "flushed"
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(30)
        assert child.returncode == -signal.SIGKILL
        with SlotFileStore(path, None, lambda i, o, r=None: o.zero_() if r is None else o.index_fill_(0, r, 0.0), None) as s:
            assert torch.equal(read(s, ids), ids[:, None].float() + life * 0.5
                               + torch.zeros(1, WIDTH))
            others = read(s, torch.arange(1, N, 3))  # unflushed: initial or a whole write
            assert ((others[:, 0] == 0) | (others[:, 0] >= 1000)).all()
            assert (others == others[:, :1]).all(), "a torn row"


def test_checkpoint_is_sparse_and_opens_as_table(tmp_path):
    big = dict(META, num_embeddings=50_000_000)  # 2.4 GB of slots, nearly all holes
    ids = torch.tensor([5, 49_999_999, 12_345_678])
    with SlotFileStore(tmp_path / "t", WIDTH, init_rows, big) as s:
        s.write(ids, rows_for(ids))
        s.checkpoint(tmp_path / "ck")  # includes the queued write
        s.write(ids, rows_for(ids, 9.0))  # after the checkpoint: not in it
        with pytest.raises(ValueError, match="already exists"):
            s.checkpoint(tmp_path / "ck")
    st = os.stat(tmp_path / "ck" / "slots.bin")
    assert st.st_size == 50_000_000 * 48 and st.st_blocks * 512 < (1 << 20)
    with open_store(tmp_path / "ck", WIDTH, init_rows, big) as c:
        assert isinstance(c, SlotFileStore)
        assert torch.equal(read(c, ids), rows_for(ids))
        assert torch.equal(c.written_ids(), ids.sort().values)


def test_open_store_picks_and_detects_the_backend(tmp_path):
    ids = torch.arange(3)
    with open_store(tmp_path / "s", WIDTH, init_rows, META, {"backend": "slots"}) as s:
        s.write(ids, rows_for(ids))
    with open_store(tmp_path / "r", WIDTH, init_rows, META) as r:  # default: RocksDB
        assert isinstance(r, RocksDBStore)
    assert detect_backend(tmp_path / "s") == "slots"
    assert detect_backend(tmp_path / "r") == "rocksdb"
    assert detect_backend(tmp_path / "none") is None
    with open_store(tmp_path / "s", WIDTH, init_rows, META) as s:  # backend unspecified
        assert isinstance(s, SlotFileStore) and torch.equal(read(s, ids), rows_for(ids))
    with pytest.raises(ValueError, match="holds a 'slots' table, requested backend 'rocksdb'"):
        open_store(tmp_path / "s", WIDTH, init_rows, META, {"backend": "rocksdb"})
    with pytest.raises(ValueError, match="backend 'lmdb' is not one of"):
        open_store(tmp_path / "x", WIDTH, init_rows, META, {"backend": "lmdb"})


def test_large_random_read_keeps_order_across_io_threads(tmp_path, direct):
    ids = torch.randperm(N)
    with make(tmp_path / "t", direct_reads=direct, io_threads=8) as s:
        s.write(ids[:3000], rows_for(ids[:3000]))
        s.flush()
        probe = torch.randperm(N)
        got = read(s, probe)
        written = torch.zeros(N, dtype=torch.bool)
        written[ids[:3000]] = True
        expected = torch.empty(N, WIDTH)
        init_rows(probe, expected)
        expected[written[probe]] = rows_for(probe[written[probe]])
        assert torch.equal(got, expected)


def test_full_disk_error_reaches_caller_and_flushed_rows_survive(small_disk):
    path = small_disk / "t"
    meta = dict(META, num_embeddings=10**6)  # 48 MB of sparse slots on a 3 MiB disk
    s = SlotFileStore(path, WIDTH, init_rows, meta)
    flushed = torch.arange(100)
    s.write(flushed, rows_for(flushed))
    s.flush()
    written = 0
    with pytest.raises(StoreWriteError, match="No space left on device"):
        for k in range(1, 1000):
            ids = torch.arange(k * 1000, (k + 1) * 1000)
            s.write(ids, rows_for(ids, 1.0))
            written = k
            if k % 10 == 0:
                s.flush()
    # The failed write changed nothing (its rows read as before) and the store stays usable:
    # what was written before it flushes and reads back.
    failed = torch.arange((written + 1) * 1000, (written + 2) * 1000)
    before = torch.empty(len(failed), WIDTH)
    init_rows(failed, before)
    assert torch.equal(read(s, failed), before)
    assert s.stats()["rows_stored"] == 100 + written * 1000
    s.flush()
    assert torch.equal(read(s, flushed), rows_for(flushed))
    last = torch.arange(written * 1000, (written + 1) * 1000)
    s.write(last, rows_for(last, 2.0))  # rewriting rows that have their space: fine
    s.close()
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    with SlotFileStore(path, WIDTH, init_rows, meta) as s:
        assert torch.equal(read(s, flushed), rows_for(flushed))
