"""LogStore (append-only segments, the SSD tier for training) on real files: round trips,
reopen, compaction, checkpoints by hard link, records cut by a crash, kill -9, a full disk,
damaged files, and training through the engine. The shared crash checker runs against this
backend too (tests/test_ssd_crash.py, parametrized)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import tieredemb
from ssd_backend import LogStore, StoreCorruptedError, StoreError, StoreLockedError, StoreWriteError, open_store
from native_store_rows import META, N, WIDTH, init_rows, o_direct_or_skip, read, rows_for
from store_holder import held_by_another_process
from test_ssd_store import small_disk  # noqa: F401 - a fixture: a real 3 MiB tmpfs


def make(path, meta=META, **kw) -> LogStore:
    return LogStore(path, WIDTH, init_rows, meta, **kw)


def segment_files(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("seg-"))


def test_round_trip_initializer_and_reopen(tmp_path):
    ids = torch.randperm(N)[:1500]
    with make(tmp_path / "t", storage_dtype=torch.bfloat16) as s:
        s.write(ids, rows_for(ids))
        probe = torch.tensor([int(ids[0]), int(torch.arange(N)[~torch.isin(torch.arange(N), ids)][0])])
        expected = torch.empty(2, WIDTH)
        expected[0] = rows_for(ids[:1]).to(torch.bfloat16).float()[0]
        init_rows(probe[1:], expected[1:])
        assert torch.equal(read(s, probe), expected)
        assert s.stats()["rows_initialized"] == 1 and s.stats()["rows_stored"] == 1500
    with LogStore(tmp_path / "t", None, init_rows, None) as s:  # adopts width, dtype, meta
        assert s.width == WIDTH and s.meta == META and s.storage_dtype == torch.bfloat16
        assert torch.equal(read(s, ids), rows_for(ids).to(torch.bfloat16).float())
        assert torch.equal(s.written_ids(), ids.sort().values)
        assert s.written_ids(start=int(ids.min()) + 1, limit=2).tolist() == ids.sort().values[1:3].tolist()
    with pytest.raises(ValueError, match="stored seed 3 != requested 4"):
        make(tmp_path / "t", meta=dict(META, seed=4), storage_dtype=torch.bfloat16)


def test_compaction_bounds_the_log_and_keeps_every_row(tmp_path):
    path = tmp_path / "t"
    latest = torch.empty(N, WIDTH)
    init_rows(torch.arange(N), latest)
    g = torch.Generator().manual_seed(0)
    with make(path, segment_bytes=64 << 10) as s:
        for step in range(300):  # ~60 rows of 48 B per write over 5000 rows: many rewrites
            ids = torch.randperm(N, generator=g)[:60]
            s.write(ids, rows_for(ids, float(step)))
            latest[ids] = rows_for(ids, float(step))
        st = s.stats()
        assert st["compactions"] > 0 and st["rows_compacted"] > 0
        on_disk = sum(os.path.getsize(path / n) for n in segment_files(path))
        assert on_disk <= 2 * st["live_bytes"] + 3 * (64 << 10), st
        assert torch.equal(read(s, torch.arange(N)), latest)
    with make(path) as s:
        assert torch.equal(read(s, torch.arange(N)), latest)


def test_write_times_count_every_write_and_the_bytes_appended(tmp_path):
    """take_write_times (bench/host_time.py's phases of a log store): each write counted, the
    writer thread's appends with the very bytes of their records (a header, the ids, the rows),
    the time of each part, and nothing left once taken."""
    g = torch.Generator().manual_seed(0)
    with make(tmp_path / "t", segment_bytes=1 << 20) as s:
        s._file.take_write_times()
        sizes = [int(k) for k in torch.randint(1, 200, (12,), generator=g)]
        for n in sizes:
            ids = torch.randperm(N, generator=g)[:n]
            s.write(ids, rows_for(ids, 1.0))
        s.flush()  # (the last append done)
        t = s._file.take_write_times()
        assert t["writes"] == t["appends"] == len(sizes)
        assert t["appended_bytes"] == sum(32 + n * 8 + n * WIDTH * 4 for n in sizes)
        assert all(t[k] >= 0 for k in ("drain_seconds", "stage_seconds", "compact_seconds"))
        assert t["append_seconds"] > 0
        assert set(s._file.take_write_times().values()) == {0}


def test_segment_numbers_past_2_24_and_at_their_end(tmp_path):
    """A row's location named its segment by number, in 24 bits: from the 2^24th segment on, rows read
    another segment's bytes (or crashed the process). It names a slot now, reused as segments go. An
    empty segment file stands in for the numbers a long-trained table has used up (open drops it, and
    numbering goes on past it)."""
    path = tmp_path / "t"
    ids, more = torch.arange(64), torch.tensor([100, 101])
    with make(path, segment_bytes=64 << 10) as s:
        s.write(ids, rows_for(ids, 1.0))
    (path / f"seg-{1 << 24:010d}.log").touch()
    with make(path) as s:
        s.write(more, rows_for(more, 2.0))
        assert torch.equal(read(s, ids), rows_for(ids, 1.0))
        assert torch.equal(read(s, more), rows_for(more, 2.0))
    assert f"seg-{(1 << 24) + 1:010d}.log" in segment_files(path)
    with make(path) as s:
        assert torch.equal(read(s, ids), rows_for(ids, 1.0))
        assert torch.equal(read(s, more), rows_for(more, 2.0))
    (path / f"seg-{2**32 - 1:010d}.log").touch()  # the last number: the next segment has none
    with make(path) as s:
        with pytest.raises(StoreError, match="used up its segment numbers"):
            s.write(more, rows_for(more, 3.0))
    with make(path) as s:
        assert torch.equal(read(s, more), rows_for(more, 2.0))


def test_checkpoint_links_segments_and_keeps_its_state(tmp_path):
    path, ck = tmp_path / "t", tmp_path / "ck"
    first = torch.arange(0, N, 2)
    with make(path, segment_bytes=64 << 10) as s:
        s.write(first, rows_for(first))
        s.checkpoint(ck)
        with pytest.raises(ValueError, match="already exists"):
            s.checkpoint(ck)
        for step in range(200):  # later writes and compactions must not reach the checkpoint
            ids = torch.arange(step % 7, N, 7)
            s.write(ids, rows_for(ids, 100.0 + step))
        assert s.stats()["compactions"] > 0
    linked = [n for n in segment_files(ck) if (path / n).exists()]
    assert all(os.path.samefile(ck / n, path / n) for n in linked)
    with open_store(ck, WIDTH, init_rows, META) as c:
        assert isinstance(c, LogStore)
        assert torch.equal(read(c, first), rows_for(first))
        assert torch.equal(c.written_ids(), first)
        c.write(first[:3], rows_for(first[:3], 7.0))  # writes to the checkpoint stay there
    with make(path) as s:
        assert not torch.equal(read(s, first[:3]), rows_for(first[:3], 7.0))


def test_a_record_cut_by_a_crash_is_not_replayed(tmp_path):
    path = tmp_path / "t"
    kept, cut = torch.arange(10), torch.arange(5, 20)
    with make(path) as s:
        s.write(kept, rows_for(kept))
        s.flush()
        mark = (path / "flushed").read_bytes()
        s.write(cut, rows_for(cut, 9.0))  # not flushed (the close flushes it: its mark is put back below)
        seg = path / segment_files(path)[-1]
        size = s._file.log_stats()["log_bytes"]
    # The unflushed record loses its last bytes, as a write cut by a power loss would.
    # (A fake: the kill -9 test below cannot aim at the middle of one write.)
    (path / "flushed").write_bytes(mark)
    with open(seg, "r+b") as f:
        f.truncate(size - 7)
    s = make(path)
    try:
        assert s.stats()["rows_replayed"] == 0
        assert torch.equal(read(s, kept), rows_for(kept))
        expected = torch.empty(10, WIDTH)
        init_rows(torch.arange(10, 20), expected)
        assert torch.equal(read(s, torch.arange(10, 20)), expected)
    finally:
        s.close()


_KILLED = textwrap.dedent("""
    import sys, torch
    from ssd_backend import LogStore
    N, W = 5000, 12
    s = LogStore(sys.argv[1], W, lambda i, o, r=None: o.zero_() if r is None else o.index_fill_(0, r, 0.0), {"num_embeddings": N})
    ids = torch.arange(0, N, 3)
    s.write(ids, ids[:, None].float() + torch.zeros(1, W))
    s.flush()
    print("flushed", flush=True)
    k = 0
    while True:  # unflushed writes until killed
        more = torch.arange(k % 3, N, 3)
        s.write(more, more[:, None].float() + 1000 * (k + 1) + torch.zeros(1, W))
        k += 1
""")


def test_kill9_keeps_flushed_rows_and_no_row_is_torn(tmp_path):
    path = str(tmp_path / "t")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for life in range(3):
        child = subprocess.Popen([sys.executable, "-c", _KILLED, path], stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert child.stdout.readline().strip() == "flushed"
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(30)
        with LogStore(path, None, lambda i, o, r=None: o.zero_() if r is None else o.index_fill_(0, r, 0.0), None) as s:
            rows = read(s, torch.arange(N))
            ids = torch.arange(N).float()
            assert (rows == rows[:, :1]).all(), "a torn row"
            flushed = torch.arange(0, N, 3)
            # Flushed rows hold their flushed value or a whole later one.
            assert ((rows[flushed, 0] == ids[flushed]) | (rows[flushed, 0] >= 1000)).all()
            others = rows[torch.arange(1, N, 3), 0]
            assert ((others == 0) | (others >= 1000)).all()


def test_full_disk_error_reaches_caller_and_flushed_rows_survive(small_disk):
    path = small_disk / "t"
    meta = dict(META, num_embeddings=10**6)
    s = LogStore(path, WIDTH, init_rows, meta, segment_bytes=256 << 10)
    flushed = torch.arange(100)
    s.write(flushed, rows_for(flushed))
    s.flush()
    with pytest.raises(StoreWriteError, match="No space left on device"):
        for k in range(1, 1000):
            ids = torch.arange(k * 1000, (k + 1) * 1000)
            s.write(ids, rows_for(ids, 1.0))  # appended behind: the error comes from a later call
    with pytest.raises(StoreWriteError):  # sticky: unflushed rows may be lost, the caller knows
        s.flush()
    assert torch.equal(read(s, flushed), rows_for(flushed))
    with pytest.raises(StoreWriteError):
        s.close()
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    with LogStore(path, WIDTH, init_rows, meta) as s:
        assert torch.equal(read(s, flushed), rows_for(flushed))


def test_rows_of_a_write_in_flight_read_back_at_once(tmp_path):
    """Write-behind: the batch staged for the background append is what reads return."""
    with make(tmp_path / "t") as s:
        for step in range(20):
            ids = torch.arange(step % 5, N, 5)
            s.write(ids, rows_for(ids, float(step)))
            assert torch.equal(read(s, ids), rows_for(ids, float(step)))
        s.flush()
        assert torch.equal(read(s, torch.arange(4, N, 5)), rows_for(torch.arange(4, N, 5), 19.0))


def test_a_row_count_past_the_row_index_is_refused(tmp_path):
    """The row index (8 bytes a row) was sized num_rows * 8, which wrapped: a table of 2^61 + 1 rows
    got 8 bytes of index and its first write crashed the process (found under ASan)."""
    with pytest.raises(StoreError, match=r"num_rows 2305843009213693953 must be in \[1, 2\^60\)"):
        make(tmp_path / "t", meta={**META, "num_embeddings": 2**61 + 1})
    assert not (tmp_path / "t").exists() or not segment_files(tmp_path / "t")


def test_damaged_files_and_foreign_directories(tmp_path):
    path = tmp_path / "t"
    with make(path) as s:
        s.write(torch.arange(5), rows_for(torch.arange(5)))
    (path / "flushed").write_bytes(b"\0" * 32)  # a damaged flush mark: every record is verified
    with make(path) as s:
        assert torch.equal(read(s, torch.arange(5)), rows_for(torch.arange(5)))
    seg = path / segment_files(path)[0]
    raw = bytearray(seg.read_bytes())
    raw[40] ^= 0xFF  # an id of the first record: with no mark to trust it, the record fails its checksum
    seg.write_bytes(bytes(raw))
    (path / "flushed").write_bytes(b"\0" * 32)
    with make(path) as s:
        assert s.stats()["rows_stored"] == 0
    (path / "log.json").write_text("{not json")
    with pytest.raises(StoreCorruptedError, match="log.json"):
        make(path)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="not a log table .* not empty"):
        make(other)
    with pytest.raises(ValueError, match=r"segment_bytes 1024: must be None or an int in \[65536, 2\*\*40\)"):
        make(tmp_path / "small", segment_bytes=1024)


def test_table_held_by_another_process(tmp_path):
    path = tmp_path / "t"
    make(path).close()
    with held_by_another_process("LogStore", path):
        with pytest.raises(StoreLockedError, match="LOCK"):
            make(path)
    make(path).close()  # released when the holder closed


def test_training_through_the_engine_matches_an_in_memory_table(tmp_path):
    def table(**kw):
        return tieredemb.TieredEmbeddingBag(3000, 8, mode="sum", optimizer=tieredemb.Adagrad(lr=0.1), seed=5, **kw)

    ref = table()
    ssd = table(cache_rows=300, ssd_path=tmp_path / "t", ssd_options={"backend": "log", "segment_bytes": 64 << 10})
    g = torch.Generator().manual_seed(1)
    for _ in range(40):
        ids = torch.randint(0, 3000, (200,), generator=g)
        offsets = torch.arange(0, 200, 4)
        for emb in (ref, ssd):
            emb(ids, offsets).pow(2).sum().backward()
    assert ssd.stats()["ssd"]["rows_written"] > 0
    everything = torch.arange(3000)
    assert torch.equal(ssd.read_rows(everything), ref.read_rows(everything))
    ssd.close()
    reopened = table(cache_rows=300, ssd_path=tmp_path / "t")
    assert torch.equal(reopened.read_rows(everything), ref.read_rows(everything))
    reopened.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_from_a_pool_equals_write(tmp_path, dtype):
    pool = torch.randn(300, WIDTH)
    slots = torch.tensor([7, 250, 3, 99])
    ids = torch.tensor([10, 4000, 11, 2])
    with make(tmp_path / "a", storage_dtype=dtype) as a, make(tmp_path / "b", storage_dtype=dtype) as b:
        a.write_from(ids, pool, slots)
        b.write(ids, pool[slots])
        assert torch.equal(read(a, ids), read(b, ids))
        with pytest.raises(IndexError, match="src row 300 out of range"):
            a.write_from(ids[:1], pool, torch.tensor([300]))


def test_o_direct_reads_return_the_rows(tmp_path):
    o_direct_or_skip(tmp_path)
    ids = torch.randperm(N)[:700]
    with make(tmp_path / "t") as s:
        s.write(ids, rows_for(ids))
    with make(tmp_path / "t", direct_reads=True, io_threads=8) as s:
        expected = torch.empty(N, WIDTH)
        init_rows(torch.arange(N), expected)
        expected[ids] = rows_for(ids)
        assert torch.equal(read(s, torch.arange(N)), expected)
        s.write(ids[:5], rows_for(ids[:5], 3.0))  # staged, then appended: read back either way
        assert torch.equal(read(s, ids[:5]), rows_for(ids[:5], 3.0))


RACE = textwrap.dedent("""
    import sys, threading, time
    import numpy as np
    from ssd_backend import _C
    N, RB = 20000, 64
    f = _C.LogFile.open(sys.argv[1], N, RB, 64 << 10, True, False, 3)
    stop, problems = threading.Event(), []
    def writer(seed):
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            ids = rng.choice(N, 200, replace=False).astype(np.int64)
            f.write(ids, np.full((200, RB), seed, np.uint8))
    def reader():
        rng = np.random.default_rng(2)
        while not stop.is_set():
            out = np.zeros((2000, RB), np.uint8)
            found = f.read(rng.choice(N, 2000, replace=False).astype(np.int64), out).astype(bool)
            if not (out[found] == out[found][:, :1]).all():
                problems.append("a row mixed from two writes")
    def run(target, *args):
        try:
            target(*args)
        except Exception as e:
            problems.append(repr(e))
    threads = [threading.Thread(target=run, args=a) for a in ((writer, 1), (writer, 3), (reader,), (reader,))]
    for t in threads:
        t.start()
    time.sleep(2)
    stop.set()
    for t in threads:
        t.join()
    f.close()
    print(problems[:3], len(problems))
""")


def test_calls_from_several_threads_wait_for_each_other(tmp_path):
    """The native files take one call at a time; calls from several threads at once wait for each
    other instead of racing (found by a ThreadSanitizer review: two writers and two readers
    crashed the process with SIGSEGV, or a writer found its next segment's file there already).
    The tables call from one thread at a time; ssd_backend's stores may be called from any."""
    done = subprocess.run([sys.executable, "-c", RACE, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[] 0"
