"""The native SSD stores (log and slots) on damage and interruptions, on real files and real
processes: a table whose record is gone, a creation and a checkpoint cut by SIGKILL, a flushed log
cut or missing a segment, a compaction cut between its mark and its removal, an older version's
mark, a checkpoint to another filesystem or onto a full one, and the
lock after a fork. Each of these was a silent wrong answer or a refused reopen before."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from native_store_rows import META, WIDTH, init_rows, read, rows_for
from ssd_backend import LogStore, SlotFileStore, StoreCorruptedError, StoreError
from test_ssd_store import small_disk  # noqa: F401 - a fixture: a real 3 MiB tmpfs

STORES = {"log": LogStore, "slots": SlotFileStore}


def make(kind: str, path, meta=META, **kw):
    return STORES[kind](path, WIDTH, init_rows, meta, **kw)


def trained(kind: str, path, n: int = 300):
    """A closed table whose rows 0..n-1 are written and flushed; returns them."""
    ids = torch.arange(n)
    with make(kind, path) as s:
        s.write(ids, rows_for(ids))
    return ids


def _killed_at(kind: str, path, where: str, then: str) -> subprocess.CompletedProcess:
    """A child that SIGKILLs itself when it reaches `where` (a method of the native store base),
    while doing `then` to the table at path."""
    code = textwrap.dedent(f"""
        import os, signal, sys, torch
        import ssd_backend.native_store as ns
        from native_store_rows import META, WIDTH, init_rows, rows_for
        from ssd_backend import {STORES[kind].__name__} as Store
        path = sys.argv[1]
        kill = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        if {then!r} == "checkpoint":
            s = Store(path, WIDTH, init_rows, META)
            s.write(torch.arange(50), rows_for(torch.arange(50)))
            setattr(ns.NativeStore, {where!r}, kill)
            s.checkpoint(path + "-ck")
        else:
            setattr(ns, {where!r}, kill)
            Store(path, WIDTH, init_rows, META)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True)


@pytest.mark.parametrize("kind", STORES)
def test_a_table_without_its_record_is_refused_and_kept(tmp_path, kind):
    """Its files were taken for a creation cut short: the table was wiped and made anew, empty."""
    path = tmp_path / "t"
    trained(kind, path)
    record = path / STORES[kind].META_FILE
    record.rename(tmp_path / "record")
    before = sorted(os.listdir(path))
    with pytest.raises(StoreCorruptedError, match=f"holds a .* table's files .* but no {record.name}"):
        make(kind, path)
    assert sorted(os.listdir(path)) == before
    (tmp_path / "record").rename(record)
    with make(kind, path) as s:
        assert torch.equal(read(s, torch.arange(300)), rows_for(torch.arange(300)))


@pytest.mark.parametrize("kind", STORES)
def test_a_creation_killed_before_its_record_creates_again(tmp_path, kind):
    path = tmp_path / "t"
    child = _killed_at(kind, path, "write_json_atomic", "create")
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert "CREATING" in os.listdir(path) and not (path / STORES[kind].META_FILE).exists()
    with make(kind, path) as s:
        s.write(torch.arange(5), rows_for(torch.arange(5)))
    assert "CREATING" not in os.listdir(path)
    with make(kind, path) as s:
        assert torch.equal(read(s, torch.arange(5)), rows_for(torch.arange(5)))


@pytest.mark.parametrize("kind", STORES)
def test_a_checkpoint_killed_before_its_record_does_not_open_as_a_table(tmp_path, kind):
    """It opened as a new, empty table (its files wiped). A checkpoint is now built beside its
    path and renamed to it whole: the path holds nothing, and the directory it was built in, its
    files without their record, is refused as a table. The live table is whole."""
    path = tmp_path / "t"
    child = _killed_at(kind, path, "_copy_record", "checkpoint")
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert not (tmp_path / "t-ck").exists()
    (partial,) = tmp_path.glob("t-ck.partial-*")
    assert os.listdir(partial)
    with pytest.raises(StoreCorruptedError, match="a damaged table, or a checkpoint cut short"):
        make(kind, partial)
    with make(kind, path) as s:
        assert torch.equal(read(s, torch.arange(50)), rows_for(torch.arange(50)))


def _segments(path) -> list:
    return sorted(path / n for n in os.listdir(path) if n.startswith("seg-"))


def _logged(path, ids, rounds: int = 4) -> None:
    """A closed log table of 64 KiB segments: rounds of ids, each round's rows tagged with it."""
    with make("log", path, segment_bytes=64 << 10) as s:
        for k in range(rounds):
            s.write(ids, rows_for(ids, float(k)))


def test_a_flushed_log_cut_short_is_refused_not_shortened(tmp_path):
    """A segment cut inside the flushed log, or cut exactly after one of its records, or an older
    segment missing, or the newest: each read as a shorter log (rows reverted, the file then cut
    for good). The mark lists every segment's length now. (A record's payload changed in place is
    not seen: flushed records are trusted, not checksummed again.)"""
    path = tmp_path / "t"
    _logged(path, torch.arange(3000))
    segs = _segments(path)
    assert len(segs) > 3
    middle = segs[len(segs) // 2]
    whole = middle.read_bytes()
    size = len(whole)
    first_record = 32 + int.from_bytes(whole[8:16], "little") * (8 + 4 * WIDTH)
    assert first_record < size
    for cut in (size - 1000, first_record):  # (inside its last record; between its first two)
        os.truncate(middle, cut)
        with pytest.raises(StoreCorruptedError, match=f"{middle.name}: its records end at byte [0-9]+, before "
                                                      f"the flushed log's {size}"):
            make("log", path)
        assert middle.stat().st_size == cut  # (not cut further)
    middle.write_bytes(whole)
    for gone in (segs[1], segs[-1]):
        gone.rename(tmp_path / "kept")
        with pytest.raises(StoreCorruptedError, match=f"the flushed log holds {gone.name} .* which is missing"):
            make("log", path)
        (tmp_path / "kept").rename(gone)
    with make("log", path) as s:  # (put back whole, it opens)
        assert torch.equal(read(s, torch.arange(3000)), rows_for(torch.arange(3000), 3.0))


def test_a_segment_compacted_away_but_not_yet_removed_opens(tmp_path):
    """Compaction removes a segment's file only once a mark without it is durable: a crash in
    between leaves a file the mark does not list, whose copies are all older than the log's."""
    path, ids, aside = tmp_path / "t", torch.arange(1000), tmp_path / "aside"
    aside.mkdir()
    with make("log", path, segment_bytes=64 << 10) as s:
        for k in range(30):
            s.write(ids, rows_for(ids, float(k)))
            s.flush()
            for seg in _segments(path):  # (each segment as it was flushed)
                if not (aside / seg.name).exists():
                    os.link(seg, aside / seg.name)
        assert s.stats()["compactions"] > 0
    gone = [seg for seg in sorted(aside.iterdir()) if not (path / seg.name).exists()]
    assert gone
    for seg in gone:
        seg.rename(path / seg.name)
    with make("log", path) as s:
        assert torch.equal(read(s, ids), rows_for(ids, 29.0))
    with make("log", path) as s:  # (and again, after the open's own flush)
        assert torch.equal(read(s, ids), rows_for(ids, 29.0))


_KILLED_AFTER_COMPACTION = textwrap.dedent("""
    import os, signal, sys, torch
    from native_store_rows import META, WIDTH, init_rows, rows_for
    from ssd_backend import LogStore
    s = LogStore(sys.argv[1], WIDTH, init_rows, META, segment_bytes=65536)
    ids = torch.arange(1000)
    for k in range(100):
        s.write(ids, rows_for(ids, float(k)))
        if s.stats()["compactions"] > 0:  # (the compaction's flush made every write durable)
            print(k, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_table_killed_right_after_a_compaction_opens(tmp_path):
    """The mark written by a compaction must not list the segment it removes (a table killed before
    its next flush would then be refused, its segment missing)."""
    path = tmp_path / "t"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.run([sys.executable, "-c", _KILLED_AFTER_COMPACTION, str(path)], env=env,
                           capture_output=True, text=True)
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
    last = int(child.stdout)
    with make("log", path) as s:
        assert torch.equal(read(s, torch.arange(1000)), rows_for(torch.arange(1000), float(last)))


def _v1_mark(seq: int, end: int) -> bytes:
    """The flush mark as tables flushed before the segment list kept it: the newest segment and its
    length, under file_io.h's checksum (for 24 bytes: the merged seed lanes, then byte by byte)."""
    m64, k1, k2 = (1 << 64) - 1, 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F

    def mix(h, w):
        h = (h + w * k2) & m64
        return (((h << 31) | (h >> 33)) & m64) * k1 & m64

    magic = int.from_bytes(b"logmark1", "little")
    body = b"".join(v.to_bytes(8, "little") for v in (magic, seq, end))
    lanes = [(magic + k1) & m64, magic ^ k2, (magic - k1) & m64, ~magic & m64]
    h = 24 * k1 & m64
    for k, lane in enumerate(lanes):
        h = mix(h ^ lane, k)
    for byte in body:
        h = mix(h, byte)
    return body + (h ^ (h >> 29)).to_bytes(8, "little")


def test_a_table_flushed_by_an_older_version_opens(tmp_path):
    """An older version's mark (the newest segment's length only) still opens its table, and still
    refuses the newest segment missing or cut inside the flushed log."""
    path, ids = tmp_path / "t", torch.arange(3000)
    _logged(path, ids)
    newest = _segments(path)[-1]
    whole = newest.read_bytes()
    (path / "flushed").write_bytes(_v1_mark(int(newest.name[4:14]), len(whole)))
    os.truncate(newest, len(whole) - 100)
    with pytest.raises(StoreCorruptedError, match=f"{newest.name}: its records end at byte"):
        make("log", path)
    newest.write_bytes(whole)
    with make("log", path) as s:
        assert torch.equal(read(s, ids), rows_for(ids, 3.0))
        s.write(ids[:10], rows_for(ids[:10], 7.0))
    assert (path / "flushed").read_bytes()[:8] == b"logmark2"  # (the close rewrote it)
    with make("log", path) as s:
        assert torch.equal(read(s, ids[:10]), rows_for(ids[:10], 7.0))


_SHORT_WRITE = textwrap.dedent("""
    import resource, signal, sys, torch
    from ssd_backend import LogStore
    W = 16  # 64-byte rows: a 64 KiB segment's records hold 454 rows at most
    init = lambda i, o, r=None: o.zero_() if r is None else o.index_fill_(0, r, 0.0)
    rows = lambda ids, t: ids[:, None].float() + t + torch.zeros(1, W)
    s = LogStore(sys.argv[1], W, init, {"num_embeddings": 100000}, segment_bytes=65536)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (32720 + 15000, hard))  # (a full disk, cutting a record)
    try:
        s.write(torch.arange(754), rows(torch.arange(754), 0.0))  # two records: the second is cut
        sys.exit("the write did not fail")
    except Exception as e:
        print("failed:", type(e).__name__, flush=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    s.write(torch.arange(1000, 1010), rows(torch.arange(1000, 1010), 1.0))  # (the store goes on)
    s.write(torch.arange(2000, 2454), rows(torch.arange(2000, 2454), 2.0))  # (a new segment)
    s.close()
""")


def test_a_log_that_went_on_after_a_failed_write_opens(tmp_path):
    """A record cut by a real short write (RLIMIT_FSIZE, as a full disk cuts one) left its bytes past
    the segment's records; the store went on and flushed past that segment, which then read as a
    flushed log cut short: a good table refused. The failed record is cut off now."""
    path = tmp_path / "t"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.run([sys.executable, "-c", _SHORT_WRITE, str(path)], env=env, capture_output=True, text=True)
    assert child.returncode == 0 and child.stdout.startswith("failed: Store"), child.stdout + child.stderr
    s = LogStore(path, 16, lambda i, o, r=None: o.zero_() if r is None else o.index_fill_(0, r, 0.0),
                 {"num_embeddings": 100000})
    try:
        for ids, tag in ((torch.arange(1000, 1010), 1.0), (torch.arange(2000, 2454), 2.0)):
            assert torch.equal(read(s, ids), ids[:, None].float() + tag + torch.zeros(1, 16))
    finally:
        s.close()


def test_a_slot_checkpoint_to_another_filesystem(tmp_path, small_disk):  # noqa: F811 - the fixture
    """copy_file_range fails across filesystems on some kernels (EXDEV): the copy falls back to
    reads and writes. A checkpoint too large for its disk leaves no directory behind (one was left,
    and then opened as an empty table)."""
    path, meta = tmp_path / "t", {**META, "num_embeddings": 100_000}
    ids = torch.arange(2000)
    with make("slots", path, meta) as s:
        s.write(ids, rows_for(ids))
        s.checkpoint(small_disk / "ck")
        big = torch.arange(80_000)  # (3.7 MiB of rows)
        s.write(big, rows_for(big, 1.0))
        with pytest.raises(StoreError, match="cannot write checkpoint"):
            s.checkpoint(small_disk / "full")
    assert not (small_disk / "full").exists()
    with make("slots", small_disk / "ck", meta) as s:
        assert torch.equal(read(s, ids), rows_for(ids))


@pytest.mark.parametrize("kind", STORES)
def test_close_lets_the_lock_go_though_a_forked_child_holds_it(tmp_path, kind):
    """A child forked while the table was open (a DataLoader's worker) shares the lock's file
    description: closing ours alone left it locked, and reopening was refused."""
    path = tmp_path / "t"
    s = make(kind, path)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: holds what it inherited until the parent has reopened
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        s.close()
        make(kind, path).close()
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)


@pytest.mark.parametrize("kind", STORES)
def test_a_forked_child_letting_go_of_the_lock_leaves_its_parent_locked(tmp_path, kind):
    """The explicit unlock acts on the lock's file description, which a forked child shares: a child
    that let go of its copy (the lock part of its store's release: the native files are not a
    forked child's to close) would have unlocked its parent's table. Another process must still
    find it locked."""
    path = tmp_path / "t"
    s = make(kind, path)
    try:
        pid = os.fork()
        if pid == 0:
            s._unlock()
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        code = (f"from ssd_backend import {STORES[kind].__name__} as S, StoreLockedError\n"
                "try:\n    S(__import__('sys').argv[1], None, None, None)\n"
                "except StoreLockedError:\n    print('locked')\n")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        other = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True)
        assert other.stdout.strip() == "locked", other.stdout + other.stderr
    finally:
        s.close()


@pytest.mark.parametrize("kind", [*STORES, "rocksdb"])
def test_a_module_dropped_unclosed_lets_its_table_go(tmp_path, kind):
    """A table's module dropped without close() (a notebook cell run again) kept the table locked
    until the process ended: the lock's descriptor had no owner to close it (native stores), or the
    writer thread kept the store alive (RocksDB). Its rows written
    since the last flush are lost, as the durability contract says; the flushed ones are there."""
    import gc

    import tieredemb

    def module():
        return tieredemb.TieredEmbeddingBag(100, 4, mode="sum", ssd_path=tmp_path / "t", ssd_options={"backend": kind})

    emb = module()
    emb.write_rows(torch.arange(3), torch.ones(3, 4))
    emb.flush()
    del emb
    gc.collect()
    emb = module()
    try:
        assert torch.equal(emb.read_rows(torch.arange(3)), torch.ones(3, 4))
    finally:
        emb.close()
