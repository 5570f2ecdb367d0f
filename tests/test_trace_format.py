"""The trace file format: round trips, streaming, and every kind of damaged file."""

import os
import shutil
import struct

import numpy as np
import pytest

from tieredemb.trace import Chunk, TableInfo, TraceError, TraceWriter, open_trace

TABLES = [TableInfo("user", 1000), TableInfo("item", 70_000), TableInfo("tiny", 3)]


def _random_batches(rng, total, count, max_len):
    return [rng.integers(0, total, rng.integers(0, max_len)) for _ in range(count)]


def _write(path, tables, batches, chunk_lookups=1 << 20):
    with TraceWriter(path, tables, chunk_lookups=chunk_lookups, meta={"note": "test"}) as w:
        for b in batches:
            w.write_batch(b)
    return path


@pytest.mark.parametrize("total", [200, 65_536, 65_537, 2**32, 2**32 + 1, 2**40])
def test_round_trip_keeps_every_key_and_batch(tmp_path, total):
    """Every key width (1, 2, 4, 8 bytes) including the largest key of each width."""
    rng = np.random.default_rng(total % 1000)
    tables = [TableInfo("a", 100), TableInfo("b", total - 100)]
    batches = _random_batches(rng, total, 60, 400) + [np.array([0, total - 1, total - 1], np.int64), np.zeros(0, np.int64)]
    path = _write(tmp_path / "t.trace", tables, batches, chunk_lookups=500)
    with open_trace(path) as r:
        assert r.header.tables == tables
        assert r.header.num_batches == len(batches)
        assert r.header.num_lookups == sum(b.size for b in batches)
        assert r.header.meta == {"note": "test"}
        got = list(r.batches())
        assert len(got) == len(batches)
        for a, b in zip(got, batches):
            np.testing.assert_array_equal(a, b)
        whole = r.read_all()
        np.testing.assert_array_equal(whole.keys, np.concatenate(batches))
        np.testing.assert_array_equal(whole.batch_offsets, np.concatenate([[0], np.cumsum([b.size for b in batches])]))


def test_chunks_stream_whole_batches_forward_and_backward(tmp_path):
    rng = np.random.default_rng(1)
    batches = _random_batches(rng, 71_003, 3000, 200)
    path = _write(tmp_path / "t.trace", TABLES, batches, chunk_lookups=4096)
    with open_trace(path) as r:
        chunks = list(r.chunks())
        assert len(chunks) > 50  # the trace is far bigger than one chunk
        largest_batch = max(b.size for b in batches)
        for c in chunks[:-1]:
            assert 4096 <= c.keys.size < 4096 + largest_batch  # cut after the batch that fills it
            assert c.batch_offsets[0] == 0 and c.batch_offsets[-1] == c.keys.size
        assert [c.first_batch for c in chunks] == list(np.cumsum([0] + [c.num_batches for c in chunks[:-1]]))
        backward = list(r.chunks(reverse=True))
        assert [c.first_batch for c in backward] == [c.first_batch for c in reversed(chunks)]
        for a, b in zip(backward, reversed(chunks)):
            np.testing.assert_array_equal(a.keys, b.keys)
        flat = [k for c in chunks for k in c.batches()]
        for a, b in zip(flat, batches):
            np.testing.assert_array_equal(a, b)


def test_write_batches_equals_write_batch(tmp_path):
    rng = np.random.default_rng(2)
    batches = _random_batches(rng, 71_003, 500, 300)
    a = _write(tmp_path / "a.trace", TABLES, batches, chunk_lookups=1000)
    with TraceWriter(tmp_path / "b.trace", TABLES, chunk_lookups=1000, meta={"note": "test"}) as w:
        w.write_batches(np.concatenate(batches[:250]), np.concatenate([[0], np.cumsum([b.size for b in batches[:250]])]))
        for b in batches[250:]:
            w.write_batch(b)
    assert a.read_bytes() == (tmp_path / "b.trace").read_bytes()


def test_empty_trace(tmp_path):
    path = _write(tmp_path / "t.trace", TABLES, [])
    with open_trace(path) as r:
        assert (r.header.num_batches, r.header.num_lookups) == (0, 0)
        assert list(r.chunks()) == []
        c = r.read_all()
        assert c.keys.size == 0 and c.batch_offsets.tolist() == [0]


def test_header_maps_table_ids_to_keys_and_back():
    from tieredemb.trace import TraceHeader

    h = TraceHeader(TABLES, 0, 0)
    assert h.table_base.tolist() == [0, 1000, 71_000] and h.total_rows == 71_003
    keys = h.keys(np.array([0, 1, 2, 1]), np.array([999, 0, 2, 69_999]))
    assert keys.tolist() == [999, 1000, 71_002, 70_999]
    assert h.table_of(keys).tolist() == [0, 1, 2, 1]
    with pytest.raises(TraceError, match=r"id 1000 of table 'user' \(#0\) out of range \[0, 1000\)"):
        h.keys(0, [5, 1000])
    with pytest.raises(TraceError, match=r"id -1 of table 'tiny'"):
        h.keys(2, [-1])
    with pytest.raises(TraceError, match=r"table index 3 out of range \[0, 3\)"):
        h.keys(np.array([3]), [0])


def test_writer_rejects_keys_outside_the_tables(tmp_path):
    path = tmp_path / "t.trace"
    with pytest.raises(TraceError, match=r"key 71003 in batch 1 out of range \[0, 71003\)"):
        with TraceWriter(path, TABLES) as w:
            w.write_batch([1, 2])
            w.write_batch([3, 71_003])
    assert not path.exists()  # an exception inside the block leaves no half-written file
    with TraceWriter(path, TABLES) as w:
        with pytest.raises(TraceError, match=r"key -5 in batch 0"):
            w.write_batch([-5])
        with pytest.raises(TraceError, match="integers"):
            w.write_batch([0.5])
        with pytest.raises(TraceError, match="batch_offsets must rise"):
            w.write_batches([1, 2, 3], [0, 2])
    with pytest.raises(TraceError, match="num_rows 0"):
        TraceWriter(tmp_path / "x.trace", [TableInfo("a", 0)])
    with pytest.raises(TraceError, match="unique"):
        TraceWriter(tmp_path / "x.trace", [TableInfo("a", 1), TableInfo("a", 2)])


def test_a_trace_replaces_the_file_at_its_path_only_when_closed(tmp_path):
    """An aborted writer deleted the file that was at its path; a writer still open had emptied it."""
    path = tmp_path / "t.trace"
    with TraceWriter(path, TABLES) as w:
        w.write_batch([1, 2])
    os.chmod(path, 0o640)
    old = path.read_bytes()
    with pytest.raises(TraceError, match="key 71003"):
        with TraceWriter(path, TABLES) as w:
            w.write_batch([3, 4])
            assert path.read_bytes() == old  # (while it is written: the old trace, whole)
            w.write_batch([71_003])
    assert path.read_bytes() == old and os.listdir(tmp_path) == ["t.trace"]
    with TraceWriter(path, TABLES) as w:
        w.write_batch([5, 6, 7])
    assert open_trace(path).read_all().keys.tolist() == [5, 6, 7] and os.listdir(tmp_path) == ["t.trace"]
    assert os.stat(path).st_mode & 0o777 == 0o640  # (its permissions kept)


def _layout(path):
    """(data offset, compressed size of chunk 0) from the documented header fields."""
    raw = path.read_bytes()
    data_offset = struct.unpack_from("<Q", raw, 40)[0]
    csize = struct.unpack_from("<I", raw, data_offset + 4)[0]
    return raw, data_offset, csize


def _read_everything(path):
    with open_trace(path) as r:
        return list(r.chunks())


@pytest.fixture
def good(tmp_path):
    rng = np.random.default_rng(3)
    return _write(tmp_path / "good.trace", TABLES, _random_batches(rng, 71_003, 200, 100), chunk_lookups=2000)


def _damaged(good, tmp_path, edit):
    raw = bytearray(good.read_bytes())
    raw = edit(raw)
    path = tmp_path / "bad.trace"
    path.write_bytes(bytes(raw))
    return str(path)


def test_truncated_files_name_the_file_and_offset(good, tmp_path):
    raw, data, csize = _layout(good)
    cases = {
        30: r"truncated header: expected 64 bytes, file has 30 at byte 0",
        data - 3: rf"truncated header: expected {data - 64} bytes, file has {data - 67} at byte 64",
        data + 10: rf"truncated chunk header: expected 28 bytes, file has 10 at byte {data}",
        data + 28 + csize // 2: rf"truncated chunk payload: expected {csize} bytes, file has {csize - csize // 2} at byte {data + 28}",
        data + 28 + csize: rf"truncated chunk header: expected 28 bytes, file has 0 at byte {data + 28 + csize}",
        len(raw) - 1: r"truncated chunk payload",
    }
    for size, message in cases.items():
        bad = _damaged(good, tmp_path, lambda b, size=size: b[:size])
        with pytest.raises(TraceError, match=message) as e:
            _read_everything(bad)
        assert bad in str(e.value)
    bad = _damaged(good, tmp_path, lambda b: b[:-1])
    end = len(good.read_bytes())  # (the message read "the last chunk ends at byte N at byte N - 1")
    with open_trace(bad) as r, pytest.raises(TraceError, match=rf": truncated file: it ends at byte {end - 1}, "
                                                               rf"its last chunk at byte {end}$"):
        list(r.chunks(reverse=True))  # the backward pass checks the file end before reading


def test_flipped_bytes_fail_their_checksum(good, tmp_path):
    raw, data, csize = _layout(good)

    def flip(at):
        def edit(b):
            b[at] ^= 0x40
            return b
        return edit

    cases = {
        20: r"header checksum mismatch \(header bytes 0..\d+\) at byte 0",
        data - 2: r"header checksum mismatch",  # inside the metadata JSON
        data + 9: rf"chunk header checksum mismatch at byte {data}",
        data + 28 + csize // 3: rf"chunk payload checksum mismatch at byte {data + 28}",
        len(raw) - 1: r"chunk payload checksum mismatch",
        data + 1: rf"corrupt chunk header: magic b'T\\x03HK', expected b'TCHK' at byte {data}",
    }
    for at, message in cases.items():
        with pytest.raises(TraceError, match=message):
            _read_everything(_damaged(good, tmp_path, flip(at)))


def test_wrong_magic_version_and_trailing_bytes(good, tmp_path):
    bad = _damaged(good, tmp_path, lambda b: b"PK\x03\x04" + b[4:])
    with pytest.raises(TraceError, match=r"not a tieredemb trace: magic b'PK\\x03\\x04.*' at byte 0"):
        open_trace(bad)
    empty = tmp_path / "empty.trace"
    empty.write_bytes(b"")
    with pytest.raises(TraceError, match="not a tieredemb trace"):
        open_trace(empty)
    bad = _damaged(good, tmp_path, lambda b: b[:8] + struct.pack("<H", 9) + b[10:])
    with pytest.raises(TraceError, match="unsupported trace version 9"):
        open_trace(bad)
    bad = _damaged(good, tmp_path, lambda b: b + b"junk")
    raw, _, _ = _layout(good)
    with pytest.raises(TraceError, match=rf"4 unexpected bytes after the last chunk at byte {len(raw)}"):
        _read_everything(bad)


def test_an_unclosed_writer_leaves_an_incomplete_trace(tmp_path):
    rng = np.random.default_rng(4)
    w = TraceWriter(tmp_path / "open.trace", TABLES, chunk_lookups=1000)
    for b in _random_batches(rng, 71_003, 400, 200):
        w.write_batch(b)  # ~40k lookups: chunks (and the header) reach the file
    assert not (tmp_path / "open.trace").exists()  # it is written beside its path (as a crash would leave it)
    (written,) = tmp_path.glob(".partial-*.open.trace")
    shutil.copy(written, tmp_path / "copy.trace")
    w.close()
    assert os.path.getsize(tmp_path / "copy.trace") > 64
    with pytest.raises(TraceError, match="incomplete trace: the writer was not closed"):
        open_trace(tmp_path / "copy.trace")
    assert open_trace(tmp_path / "open.trace").header.num_batches == 400


def test_chunk_is_a_plain_dataclass():
    c = Chunk(np.array([5, 6, 7], np.int64), np.array([0, 2, 2, 3], np.int64))
    assert c.num_batches == 3 and [b.tolist() for b in c.batches()] == [[5, 6], [], [7]]
