"""Importers and exporters: FBGEMM request files, libCacheSim oracleGeneral, CSV, npy."""

import numpy as np
import pytest
import torch

from tieredemb.trace import TableInfo, TraceError, TraceWriter, convert, open_trace
from tieredemb.trace.oracle import RECORD, write_keys

TABLES = [TableInfo("table0", 500), TableInfo("table1", 40_000), TableInfo("table2", 7)]


@pytest.fixture
def trace(tmp_path):
    """40 batches; each holds table 0's lookups, then table 1's, then table 2's (table-major)."""
    rng = np.random.default_rng(7)
    path = tmp_path / "src.trace"
    with TraceWriter(path, TABLES, chunk_lookups=300) as w:
        for b in range(40):
            ids = [rng.zipf(1.3, rng.integers(0, 30)) % t.num_rows for t in TABLES]
            w.write_batch(w.header.keys(np.repeat([0, 1, 2], [len(i) for i in ids]), np.concatenate(ids)))
    return path


def _read(path):
    with open_trace(path) as r:
        return r.header, r.read_all()


def _same_lookups(a, b):
    (_, ca), (hb, cb) = _read(a), _read(b)
    np.testing.assert_array_equal(ca.keys, cb.keys)
    np.testing.assert_array_equal(ca.batch_offsets, cb.batch_offsets)
    return hb


@pytest.mark.parametrize("ext, options", [
    ("csv", {"rows": [500, 40_000, 7]}),
    ("pt", {"rows": [500, 40_000, 7], "batch_size": 1}),
    ("oracleGeneral", {}),
])
def test_round_trip_through_each_format(tmp_path, trace, ext, options):
    out = tmp_path / f"x.{ext}"
    convert(trace, out)
    convert(out, tmp_path / "back.trace", **options)
    back = _same_lookups(trace, tmp_path / "back.trace")
    if ext in ("csv", "pt"):
        assert back.tables == TABLES and back.meta["rows"] == "given"
    if ext == "oracleGeneral":  # one table of global keys, sized by the largest key + 1
        assert len(back.tables) == 1 and back.meta["rows"] == "largest id + 1"


def test_npy_export_is_2d_for_equal_batches_and_1d_otherwise(tmp_path, trace):
    convert(trace, tmp_path / "ragged.npy")
    a = np.load(tmp_path / "ragged.npy")
    assert a.ndim == 1 and a.tolist() == _read(trace)[1].keys.tolist()
    with TraceWriter(tmp_path / "even.trace", [TableInfo("t", 100)]) as w:
        for b in range(6):
            w.write_batch(np.arange(b, b + 4))
    convert(tmp_path / "even.trace", tmp_path / "even.npy")
    assert np.load(tmp_path / "even.npy").shape == (6, 4)
    convert(tmp_path / "even.npy", tmp_path / "back.trace", rows=100)
    _same_lookups(tmp_path / "even.trace", tmp_path / "back.trace")
    np.save(tmp_path / "flat.npy", np.arange(10, dtype=np.int32))
    convert(tmp_path / "flat.npy", tmp_path / "flat.trace", batch_size=4)
    assert [b.tolist() for b in open_trace(tmp_path / "flat.trace").batches()] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with pytest.raises(TraceError, match="batch size None must be given"):
        convert(tmp_path / "flat.npy", tmp_path / "f2.trace")
    with TraceWriter(tmp_path / "empty.trace", [TableInfo("t", 5)]) as w:
        w.write_batch([])
        w.write_batch([])
    convert(tmp_path / "empty.trace", tmp_path / "empty.npy")
    assert np.load(tmp_path / "empty.npy").shape == (2, 0)
    assert convert(tmp_path / "empty.npy", tmp_path / "empty2.trace").num_batches == 2
    (tmp_path / "junk.npy").write_bytes(b"junk")
    with pytest.raises(TraceError, match="junk.npy: not a .npy array"):
        convert(tmp_path / "junk.npy", tmp_path / "f4.trace")
    np.save(tmp_path / "float.npy", np.ones(3))
    with pytest.raises(TraceError, match="integer array"):
        convert(tmp_path / "float.npy", tmp_path / "f3.trace")


def _fbgemm_file(path, rng, T=3, B=8, dtype=torch.int32):
    lengths = torch.from_numpy(rng.integers(0, 4, (T, B)))
    indices = torch.from_numpy(rng.integers(0, 50, int(lengths.sum()))).to(dtype)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths.reshape(-1), 0)])
    torch.save((indices, offsets, lengths), path)
    return indices.numpy(), offsets.numpy(), T, B


def test_fbgemm_import_cuts_samples_into_table_major_batches(tmp_path):
    indices, offsets, T, B = _fbgemm_file(tmp_path / "req.pt", np.random.default_rng(8))
    header = convert(tmp_path / "req.pt", tmp_path / "req.trace", batch_size=3)
    assert [t.num_rows for t in header.tables] == [
        int(indices[offsets[t * B]:offsets[(t + 1) * B]].max()) + 1 for t in range(T)]
    assert header.meta["rows"] == "largest id + 1"
    base = header.table_base
    expected = []
    for s in range(0, B, 3):  # samples s..s+2, table after table
        expected.append([int(i) + int(base[t]) for t in range(T)
                         for i in indices[offsets[t * B + s]:offsets[t * B + min(s + 3, B)]]])
    assert [b.tolist() for b in open_trace(tmp_path / "req.trace").batches()] == expected
    convert(tmp_path / "req.trace", tmp_path / "again.pt")  # the same indices, lengths summed per batch
    again = torch.load(tmp_path / "again.pt")
    assert again[0].tolist() == indices.tolist()
    assert again[2].shape == (T, 3)
    whole = convert(tmp_path / "req.pt", tmp_path / "one.trace", rows=50)
    assert whole.num_batches == 1 and [t.num_rows for t in whole.tables] == [50] * T


def test_fbgemm_bench_reads_our_export(tmp_path, trace):
    generate_requests_from_data_file = pytest.importorskip(  # (not a dependency: ./run installs it beside a CPU torch)
        "fbgemm_gpu.tbe.utils.requests").generate_requests_from_data_file

    convert(trace, tmp_path / "x.pt")
    header, c = _read(trace)
    B, T, n = header.num_batches, len(header.tables), header.num_lookups
    req = generate_requests_from_data_file(iters=1, B=B, T=T, L=n // B, E=40_000, weighted=False,
                                           device=torch.device("cpu"), requests_data_file=str(tmp_path / "x.pt"))[0]
    table = header.table_of(c.keys)
    assert req.indices.tolist() == (c.keys - header.table_base[table])[np.argsort(table, kind="stable")].tolist()
    one = generate_requests_from_data_file(iters=1, B=B, T=1, L=int((table == 1).sum()) // B, E=40_000, weighted=False,
                                           device=torch.device("cpu"), requests_data_file=str(tmp_path / "x.pt"),
                                           tables="1")[0]
    assert one.indices.tolist() == (c.keys[table == 1] - 500).tolist()
    lengths = [int(np.sum(table[c.batch_offsets[b]:c.batch_offsets[b + 1]] == 1)) for b in range(B)]
    assert torch.diff(one.offsets).tolist() == lengths


def test_fbgemm_bad_files(tmp_path):
    _fbgemm_file(tmp_path / "req.pt", np.random.default_rng(9))
    with pytest.raises(TraceError, match=r"id \d+ of table 0 out of range \[0, 2\)"):
        convert(tmp_path / "req.pt", tmp_path / "x.trace", rows=2)
    torch.save((torch.tensor([1, -1]), torch.tensor([0, 1, 2]), torch.tensor([[1, 1]])), tmp_path / "neg.pt")
    with pytest.raises(TraceError, match="id -1 of table 0 is negative"):
        convert(tmp_path / "neg.pt", tmp_path / "x.trace")
    torch.save((torch.tensor([1, 2]), torch.tensor([0, 1, 2])), tmp_path / "nolen.pt")
    with pytest.raises(TraceError, match="give the number of tables"):
        convert(tmp_path / "nolen.pt", tmp_path / "x.trace")
    assert convert(tmp_path / "nolen.pt", tmp_path / "x.trace", num_tables=2).num_lookups == 2
    torch.save((torch.tensor([1, 2]), torch.tensor([0, 1, 2, 2]), torch.tensor([[1, 1]])), tmp_path / "off.pt")
    with pytest.raises(TraceError, match=r"offsets has 4 entries, expected T\*B \+ 1 = 3"):
        convert(tmp_path / "off.pt", tmp_path / "x.trace")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(TraceError, match="junk.pt: not an FBGEMM .pt request file"):
        convert(tmp_path / "junk.pt", tmp_path / "x.trace")


def test_libcachesim_reads_our_oracle_export(tmp_path, trace):
    lcs = pytest.importorskip("libcachesim")  # (as test_sim_libcachesim.py: a test extra)

    convert(trace, tmp_path / "x.oracleGeneral.bin")
    _, c = _read(trace)
    keys = c.keys.tolist()
    reader = lcs.TraceReader(str(tmp_path / "x.oracleGeneral.bin"), lcs.TraceType.ORACLE_GENERAL_TRACE)
    reqs = [(r.clock_time, r.obj_id, r.obj_size, r.next_access_vtime) for r in reader]
    assert [r[1] for r in reqs] == keys
    batch = np.repeat(np.arange(40), np.diff(c.batch_offsets)).tolist()
    assert [r[0] for r in reqs] == batch and {r[2] for r in reqs} == {1}
    for i, k in enumerate(keys):  # 1-based position of the next request for the same key
        nxt = next((j + 1 for j in range(i + 1, len(keys)) if keys[j] == k), 2**63 - 1)
        assert reqs[i][3] == nxt


def test_oracle_import_batches_by_time_skips_size_zero_and_remaps(tmp_path):
    rec = np.zeros(7, RECORD)
    rec["time"] = [3, 3, 5, 5, 5, 9, 9]
    rec["id"] = [2**63 + 5, 17, 2**63 + 5, 42, 17, 99, 17]
    rec["size"] = [1, 1, 1, 0, 1, 1, 1]
    rec.tofile(tmp_path / "x.oracleGeneral")
    h = convert(tmp_path / "x.oracleGeneral", tmp_path / "x.trace", remap=True)
    assert h.meta["rows"] == "distinct ids (remapped)"  # (a review: it said "largest id + 1")
    assert h.meta["skipped_size_zero"] == 1 and h.tables[0].num_rows == 3
    assert [b.tolist() for b in open_trace(tmp_path / "x.trace").batches()] == [[0, 1], [0, 1], [2, 1]]
    h = convert(tmp_path / "x.oracleGeneral", tmp_path / "y.trace", remap=True, batch_size=4)
    assert [b.tolist() for b in open_trace(tmp_path / "y.trace").batches()] == [[0, 1, 0, 1], [2, 1]]
    with pytest.raises(TraceError, match=r"id 9223372036854775813 of record 0 \(byte 0\) does not fit"):
        convert(tmp_path / "x.oracleGeneral", tmp_path / "z.trace")
    # (before, renumbered ids past the rows given went unchecked: out of a simulator's arrays)
    with pytest.raises(TraceError, match=r"3 distinct ids, renumbered 0..2 \(remap\), do not fit the table's 2 rows"):
        convert(tmp_path / "x.oracleGeneral", tmp_path / "z.trace", remap=True, rows=2)
    with open(tmp_path / "x.oracleGeneral", "ab") as f:
        f.write(b"\0" * 10)
    with pytest.raises(TraceError, match=r"x.oracleGeneral: truncated record at byte 168"):
        convert(tmp_path / "x.oracleGeneral", tmp_path / "z.trace", remap=True)


def test_csv_columns_batches_and_errors(tmp_path):
    (tmp_path / "a.csv").write_text("id,batch,table\n5,0,1\n6,0,0\n5,1,1\n7,7,1\n")
    h = convert(tmp_path / "a.csv", tmp_path / "a.trace")
    assert [t.num_rows for t in h.tables] == [7, 8]
    assert [b.tolist() for b in open_trace(tmp_path / "a.trace").batches()] == [[12, 6], [12], [14]]
    (tmp_path / "b.csv").write_text("0,0,3\n0,0,4\n2,0,3\n")  # no header: batch,table,id
    convert(tmp_path / "b.csv", tmp_path / "b.trace", rows=10)
    assert [b.tolist() for b in open_trace(tmp_path / "b.trace").batches()] == [[3, 4], [3]]
    (tmp_path / "c.csv").write_text("id\n1\n2\n3\n")
    convert(tmp_path / "c.csv", tmp_path / "c.trace", batch_size=2)
    assert [b.tolist() for b in open_trace(tmp_path / "c.trace").batches()] == [[1, 2], [3]]
    (tmp_path / "d.csv").write_text("batch,table,id\n0,0,1\n0,0,x2\n")
    with pytest.raises(TraceError, match=r"d.csv: line 3 \('0,0,x2'\) is not 3 integers"):
        convert(tmp_path / "d.csv", tmp_path / "d.trace")
    with pytest.raises(TraceError, match=r"b.csv: line 1: id 3 of table 'table0' \(#0\) out of range \[0, 3\)"):
        convert(tmp_path / "b.csv", tmp_path / "e.trace", rows=3)
    (tmp_path / "f.csv").write_text("batch,row\n")
    with pytest.raises(TraceError, match="must name the columns batch, table, id"):
        convert(tmp_path / "f.csv", tmp_path / "f.trace")


def test_unknown_formats_and_missing_files(tmp_path, trace):
    with pytest.raises(TraceError, match=r"x.parquet: cannot tell the format from the extension"):
        convert(trace, tmp_path / "x.parquet")
    with pytest.raises(TraceError, match="unknown trace format 'parquet'"):
        convert(trace, tmp_path / "x.bin", dst_format="parquet")
    with pytest.raises(TraceError, match="no such file"):
        convert(tmp_path / "none.csv", tmp_path / "x.trace")
    (tmp_path / "a.csv").write_text("id\n1\n")
    with pytest.raises(TraceError, match="one side must be a tieredemb trace"):
        convert(tmp_path / "a.csv", tmp_path / "x.npy")
    (tmp_path / "b.trace").write_bytes(b"not a trace at all")
    with pytest.raises(TraceError, match="b.trace: not a tieredemb trace"):
        convert(tmp_path / "b.trace", tmp_path / "x.csv")


def test_oracle_write_keys_matches_the_export_of_one_lookup_batches(tmp_path):
    keys = np.array([5, 0, 5, 7, 0, 5], np.int64)
    write_keys(tmp_path / "k.bin", keys)
    ours = np.fromfile(tmp_path / "k.bin", RECORD)
    assert ours["next"].tolist() == [3, 5, 6, -1, -1, -1]  # 1-based, as traceConv writes
    with TraceWriter(tmp_path / "k.trace", [TableInfo("t", 8)]) as w:
        for k in keys:
            w.write_batch(np.array([k]))
    convert(tmp_path / "k.trace", tmp_path / "k.oracleGeneral")
    assert (tmp_path / "k.bin").read_bytes() == (tmp_path / "k.oracleGeneral").read_bytes()
    with pytest.raises(TraceError, match="key -1 is negative"):
        write_keys(tmp_path / "bad.bin", np.array([3, -1]))
