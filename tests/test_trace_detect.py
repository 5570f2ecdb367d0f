"""Every supported format is read directly, told from its content: `simulate`, `mrc`, `trace inspect`
on the file give what they give on its conversion; readers stream in blocks and keep batches whole
across block boundaries; a file that matches no format gets one line naming it."""

import json

import numpy as np
import pytest
import torch

import tieredemb.trace.csvfile
import tieredemb.trace.npyfile
import tieredemb.trace.oracle
from tieredemb.cli import main
from tieredemb.trace import TableInfo, TraceError, TraceWriter, open_any, open_trace, sniff_format, synth_zipf
from tieredemb.trace.oracle import RECORD

ROWS = [500, 40_000, 7]


@pytest.fixture
def base(tmp_path):
    """60 Zipf batches of 30 + 20 + 5 lookups over 3 tables, 20% reused from the batch before."""
    path = tmp_path / "base.trace"
    synth_zipf(path, ROWS, 60, [30, 20, 5], alpha=1.2, reuse=0.2, seed=5, chunk_lookups=400)
    return path


@pytest.fixture
def ragged(tmp_path):
    """40 batches of 1 to 80 lookups, one table (a .npy export of it is 1-D)."""
    path = tmp_path / "ragged.trace"
    rng = np.random.default_rng(6)
    with TraceWriter(path, [TableInfo("t", 3000)]) as w:
        for n in rng.integers(1, 80, 40):
            w.write_batch(rng.zipf(1.2, n) % 3000)
    return path


# (fixture, exported file name, exporter options, options to read it back)
CASES = {
    "oracle": ("base", "x.oracleGeneral.bin", [], []),
    "oracle, other name": ("base", "requests.dat", ["--to", "oracle"], []),
    "oracle, batch size": ("base", "x.oracleGeneral.bin", [], ["--batch-size", "50"]),
    "csv": ("base", "x.csv", [], ["--rows", "500", "40000", "7"]),
    "csv, other name": ("base", "lookups.txt", ["--to", "csv"], []),
    "npy 1-D": ("ragged", "x.npy", [], ["--batch-size", "64"]),
    "npy 2-D": ("base", "x.npy", [], []),
    "pt": ("base", "x.pt", [], ["--batch-size", "1"]),
    "pt, other name": ("base", "requests.bin", ["--to", "pt"], ["--rows", "500", "40000", "7", "--batch-size", "2"]),
}


def _run(capsys, *argv) -> str:
    status = main([str(a) for a in argv])
    out = capsys.readouterr()
    assert status == 0, out.err
    return out.out


@pytest.fixture(params=list(CASES))
def foreign(request, tmp_path, capsys):
    """(a file of another format, read options, its conversion to .trace with those options)."""
    fixture, name, export, read = CASES[request.param]
    src = request.getfixturevalue(fixture)
    path = tmp_path / name
    _run(capsys, "trace", "convert", src, path, *export)
    converted = tmp_path / "converted.trace"
    _run(capsys, "trace", "convert", path, converted, *read)
    return path, read, converted


def test_simulate_reads_every_format_as_its_conversion(foreign, capsys):
    path, read, converted = foreign
    args = ["--policy", "lru", "--policy", "lfu,clock", "--policy", "s3fifo", "--capacity", "5%", "--capacity", "300",
            "--json"]
    direct = json.loads(_run(capsys, "simulate", path, *args, *read))
    via = json.loads(_run(capsys, "simulate", converted, *args))
    assert direct == via
    assert direct[0]["tiers"][0]["hits"] > 0
    for mode in (["--mode", "request"], ["--train"]):
        assert _run(capsys, "simulate", path, *args, *read, *mode) == _run(capsys, "simulate", converted, *args, *mode)


def test_mrc_reads_every_format_as_its_conversion(foreign, capsys):
    path, read, converted = foreign
    for args in (["--points", "9"], ["--policy", "belady", "--sizes", "10%", "30%"], ["--mode", "request"]):
        direct = json.loads(_run(capsys, "mrc", path, "--json", *args, *read))
        assert direct == json.loads(_run(capsys, "mrc", converted, "--json", *args))
        assert 0 < direct["miss_ratio"][0] <= 1


def test_inspect_reads_every_format_as_its_conversion(foreign, capsys):
    path, read, converted = foreign
    direct = json.loads(_run(capsys, "trace", "inspect", path, "--json", *read))
    via = json.loads(_run(capsys, "trace", "inspect", converted, "--json"))
    assert direct["format"] == sniff_format(path) != "trace" and via["format"] == "trace"
    for key in ("num_batches", "num_lookups", "total_rows", "unique_rows", "tables", "reuse", "batch_lookups"):
        assert direct[key] == via[key], key


@pytest.mark.parametrize("fmt, module, name, source", [
    ("oracle", tieredemb.trace.oracle, "x.oracleGeneral.bin", "ragged"),
    ("csv", tieredemb.trace.csvfile, "x.csv", "ragged"),
    ("npy", tieredemb.trace.npyfile, "x.npy", "ragged"),
    ("npy", tieredemb.trace.npyfile, "x.npy", "base"),
])
def test_readers_stream_in_blocks_and_keep_batches_whole(request, monkeypatch, tmp_path, capsys, fmt, module, name,
                                                         source):
    """Blocks of 7 lookups cut through most batches; the batches read are still the trace's own."""
    src = request.getfixturevalue(source)
    path = tmp_path / name
    _run(capsys, "trace", "convert", src, path)
    options = {}
    with open_trace(src) as r:
        want = r.read_all()
    if fmt == "npy" and source == "ragged":  # a 1-D export: batch size 7 instead of the trace's batches
        want.batch_offsets = np.unique(np.append(np.arange(0, want.keys.size, 7), want.keys.size))
        options = {"batch_size": 7}
    monkeypatch.setattr(module, "BLOCK", 7)
    with open_any(path, **options) as src:
        chunks = list(src.chunks())
        got = src.read_all()
    assert len(chunks) > 20 and max(c.keys.size for c in chunks) < 7 + 80 + 55  # a block, plus the batch it ends in
    assert [c.first_batch for c in chunks] == list(np.cumsum([0] + [c.num_batches for c in chunks[:-1]]))
    np.testing.assert_array_equal(got.keys, want.keys)
    np.testing.assert_array_equal(got.batch_offsets, want.batch_offsets)
    assert src.header.num_batches == want.num_batches and src.header.num_lookups == want.keys.size


def test_content_decides_not_the_name(tmp_path, base, capsys):
    for name, fmt in [("a.csv", "oracle"), ("b.npy", "csv"), ("c.trace", "npy"), ("d.oracleGeneral.bin", "pt")]:
        _run(capsys, "trace", "convert", base, tmp_path / name, "--to", fmt)
        assert sniff_format(tmp_path / name) == fmt, name
    (tmp_path / "e.pt").write_bytes(base.read_bytes())
    assert sniff_format(tmp_path / "e.pt") == "trace"
    legacy = tmp_path / "legacy.bin"
    torch.save((torch.tensor([1, 2]), torch.tensor([0, 1, 2]), torch.tensor([[1, 1]])), legacy,
               _use_new_zipfile_serialization=False)
    assert sniff_format(legacy) == "pt" and open_any(legacy).header.num_lookups == 2
    # an oracleGeneral file whose next_access_vtime fields are not filled in: only its name tells
    rec = np.zeros(4, RECORD)
    rec["id"], rec["size"] = [3, 4, 3, 5], 1
    rec.tofile(tmp_path / "zeros.oracleGeneral")
    rec.tofile(tmp_path / "zeros.bin")
    assert sniff_format(tmp_path / "zeros.oracleGeneral") is None
    assert open_any(tmp_path / "zeros.oracleGeneral").read_all().keys.tolist() == [3, 4, 3, 5]
    with pytest.raises(TraceError, match="zeros.bin: not a trace in a format tieredemb reads"):
        open_any(tmp_path / "zeros.bin")


@pytest.mark.parametrize("content, name, message", [
    (b"\x00\x01garbage\xff" * 5, "x.bin", r"x.bin: not a trace in a format tieredemb reads \(expected a tieredemb "
                                          r"trace, an FBGEMM .pt request file, a libCacheSim oracleGeneral file, a CSV of "
                                          r"batch,table,id lines, an integer .npy array\); it starts with b'\\x00"),
    (b"hello, world\n", "notes.txt", r"notes.txt: not a trace in a format tieredemb reads"),
    (b"\x28\xb5\x2f\xfd" + b"\0" * 40, "t.oracleGeneral.bin.zst", r"compressed with zstd: decompress it first \(zstd -d "),
    (b"1, 2, 3, 4\n0, 1, 2\n0.5, 0.75, 1.0\n", "dist_emb_0.log", r"locality log .* trace synth OUT --logs"),
    (b"", "empty.csv", r"empty.csv: empty CSV file"),
])
def test_a_file_of_no_format_gets_one_line(tmp_path, capsys, content, name, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(TraceError, match=message):
        open_any(path)
    for command in (["simulate", path, "--capacity", "10"], ["mrc", path], ["trace", "inspect", path]):
        assert main([str(a) for a in command]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(path) in err, err


@pytest.mark.parametrize("name, fmt, message", [
    ("x.trace", "csv", "not a CSV of batch,table,id lines: it holds bytes that are not UTF-8 text"),
    ("x.pt", "csv", "not a CSV of batch,table,id lines: it holds bytes that are not UTF-8 text"),
    ("x.csv", "pt", "not an FBGEMM .pt request file: torch.load failed ("),
    ("x.trace", "pt", "not an FBGEMM .pt request file: torch.load failed ("),
    ("x.pt", "npy", "not a .npy array: it starts with b'PK"),
])
def test_a_format_forced_on_a_file_of_another_gets_one_line(tmp_path, base, capsys, name, fmt, message):
    """--from csv on a binary file was a UnicodeDecodeError, --from pt on a CSV an IndexError (pop from
    empty list), --from npy on a .pt an AttributeError: tracebacks, not the file and what it is not."""
    path = tmp_path / name
    if name != "x.trace":
        _run(capsys, "trace", "convert", base, path)
    else:
        path.write_bytes(base.read_bytes())
    options = ["--from", fmt] + (["--batch-size", "4"] if fmt == "csv" else [])
    for command in (["simulate", path, "--capacity", "10"], ["trace", "inspect", path],
                    ["trace", "convert", path, tmp_path / "out.trace"]):
        assert main([str(a) for a in command + options]) == 2, command
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{path}: {message}" in err, err
    assert not (tmp_path / "out.trace").exists()


def test_options_that_do_not_apply_are_refused(tmp_path, base, capsys):
    assert main(["simulate", str(base), "--capacity", "10%", "--batch-size", "8"]) == 2
    err = capsys.readouterr().err
    assert "is a tieredemb trace: --batch-size does not apply" in err and err.count("\n") == 1
    _run(capsys, "trace", "convert", base, tmp_path / "x.csv")
    with pytest.raises(TraceError, match=r"a CSV of batch,table,id lines: --remap does not apply to it \(options it "
                                         r"takes: --rows, --batch-size\)"):
        open_any(tmp_path / "x.csv", remap=True)
    np.save(tmp_path / "flat.npy", np.arange(10))
    assert main(["simulate", str(tmp_path / "flat.npy"), "--capacity", "5"]) == 2
    assert "batch size None must be given and >= 1 (this input has no batches" in capsys.readouterr().err
    with pytest.raises(TraceError, match=r"no such file"):
        open_any(tmp_path / "missing.oracleGeneral.bin")


def test_a_directory_or_missing_file_is_named_as_such(tmp_path, capsys):
    """A directory was reported as "no such file"; with --from, a missing file or a directory was the OSError's text."""
    for options in ([], ["--from", "csv"]):
        for command in (["mrc", tmp_path], ["trace", "inspect", tmp_path], ["simulate", tmp_path, "--capacity", "3"]):
            assert main([str(a) for a in command + options]) == 2
            err = capsys.readouterr().err
            assert err.endswith(f": {tmp_path}: is a directory, not a trace file\n") and err.count("\n") == 1, err
        assert main(["trace", "inspect", str(tmp_path / "missing.csv"), *options]) == 2
        assert capsys.readouterr().err == f"tieredemb trace inspect: {tmp_path / 'missing.csv'}: no such file\n"


def test_the_batch_size_option_is_documented(capsys):
    for command in ("simulate", "mrc", "replay", "trace inspect", "trace convert"):
        try:
            assert main([*command.split(), "--help"]) == 0
        except SystemExit as e:  # argparse's --help
            assert e.code == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "--batch-size N lookups per batch for inputs that carry no batches" in text, command
        assert "a new batch wherever clock_time changes" in text and "told from its content" in text


def test_text_that_is_not_plain_csv_and_raw_ids_are_told_apart_from_oracle_records(tmp_path, capsys):
    """(A review.) UTF-16 text (PowerShell's `>`) whose size is a whole number of 24-byte records
    was read as an oracleGeneral file (hit ratios of garbage, exit 0): refused as UTF-16 by its
    byte-order mark. Raw uint64 ids (a DLRM binary trace) of such a size too: an oracle file's
    clock never goes back. Excel's "CSV UTF-8" (a UTF-8 byte-order mark) reads as its CSV."""
    lines = "batch,table,id\n" + "".join(f"{i // 20},0,{i * 7 % 1000}\n" for i in range(2000))
    while len(lines.encode("utf-16")) % RECORD.itemsize:
        lines += "0,0,11\n"  # (7 characters: every size mod 24 in turn)
    (tmp_path / "u16.csv").write_bytes(lines.encode("utf-16"))
    with pytest.raises(TraceError, match=r"u16.csv: UTF-16 text \(it starts with a byte-order mark\)"):
        open_any(tmp_path / "u16.csv")
    assert main(["simulate", str(tmp_path / "u16.csv"), "--capacity", "10"]) == 2
    assert "UTF-16 text" in capsys.readouterr().err
    ids = np.random.default_rng(0).integers(0, 2**63, 3 * 1000, dtype=np.int64).astype(np.uint64)
    ids.tofile(tmp_path / "raw.bin")  # (24,000 bytes: 1,000 "records")
    with pytest.raises(TraceError, match="raw.bin: not a trace in a format tieredemb reads"):
        open_any(tmp_path / "raw.bin")
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbf" + lines.encode())
    with open_any(tmp_path / "bom.csv") as src:
        assert sniff_format(tmp_path / "bom.csv") == "csv" and src.header.num_lookups == lines.count("\n") - 1


def test_ids_past_int64_keys_are_refused_by_name(tmp_path, capsys):
    """(A review.) An id of 2**63 - 1, or tables whose rows (largest id + 1 each) add up past
    2**63 - 1, were an OverflowError traceback, or keys that wrapped (wrong counts per table, a
    "negative key" error naming a key not in the file): now one line naming the table and id."""
    (tmp_path / "max.csv").write_text(f"batch,table,id\n0,0,{2**63 - 1}\n")
    (tmp_path / "two.csv").write_text(f"batch,table,id\n0,0,{2**62}\n0,1,{2**62}\n0,1,3\n")
    for name, message in (("max.csv", rf"table 0's largest id {2**63 - 1} takes the tables' keys past int64"),
                          ("two.csv", rf"table 1's largest id {2**62} takes the tables' keys past int64")):
        with pytest.raises(TraceError, match=message):
            open_any(tmp_path / name)
        for command in (["trace", "inspect", "--no-reuse"], ["simulate", "--capacity", "1"], ["mrc"]):
            assert main(command + [str(tmp_path / name)]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "past int64" in err, err
    with pytest.raises(TraceError, match=r"table 0: rows must be >= 1, got -5"):
        open_any(tmp_path / "two.csv", rows=-5)
    (tmp_path / "ok.csv").write_text(f"batch,table,id\n0,0,{2**62}\n0,1,{2**62 - 3}\n")
    with open_any(tmp_path / "ok.csv") as src:  # (2**63 - 1 rows in all: the most)
        assert src.read_all().keys.tolist() == [2**62, 2**63 - 2]
