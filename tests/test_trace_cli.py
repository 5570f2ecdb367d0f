"""`tieredemb trace convert | inspect | synth`, in process and once through the installed command."""

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from tieredemb.trace import TableInfo, TraceWriter, open_trace
from tieredemb.trace.cli import trace


def test_synth_inspect_convert(tmp_path, capsys):
    out = tmp_path / "z.trace"
    assert trace(["synth", str(out), "--zipf", "1.1", "--rows", "1000", "50", "--batches", "40",
                  "--lookups", "30", "5", "--reuse", "0.2", "--seed", "3"]) == 0
    assert "40 batches, 1,400 lookups over 2 table(s)" in capsys.readouterr().out
    assert trace(["inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_batches"] == 40 and info["num_lookups"] == 1400
    assert [(t["name"], t["rows"], t["lookups"]) for t in info["tables"]] == [("table0", 1000, 1200), ("table1", 50, 200)]
    with open_trace(out) as r:
        keys = r.read_all().keys
    assert info["unique_rows"] == np.unique(keys).size
    assert sum(t["unique"] for t in info["tables"]) == info["unique_rows"]
    reuse = info["reuse"]
    assert reuse["first_use"] == info["unique_rows"]
    cache_lookups = 1400 - reuse["repeat_in_batch"]
    assert reuse["first_use"] + sum(b["lookups"] for b in reuse["buckets"]) == cache_lookups
    assert [b["lo"] for b in reuse["buckets"]][:4] == [0, 1, 2, 4]
    assert trace(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "unique rows:" in text and "LRU hit ratio" in text and "table1" in text

    assert trace(["convert", str(out), str(tmp_path / "z.csv")]) == 0
    assert trace(["convert", str(tmp_path / "z.csv"), str(tmp_path / "back.trace"), "--rows", "1000", "50"]) == 0
    assert "tables table0 (1,000 rows), table1 (50 rows)" in capsys.readouterr().out
    with open_trace(tmp_path / "back.trace") as r:
        np.testing.assert_array_equal(r.read_all().keys, keys)
    assert trace(["convert", str(out), str(tmp_path / "dist_{}.log")]) == 0
    assert trace(["synth", str(tmp_path / "l.trace"), "--logs", str(tmp_path / "dist_0.log"),
                  str(tmp_path / "dist_1.log"), "--batches", "10", "--lookups", "7"]) == 0
    assert open_trace(tmp_path / "l.trace").header.num_lookups == 140
    assert trace(["convert", str(out), str(tmp_path / "z.bin"), "--to", "oracle", "--obj-size", "64"]) == 0
    assert (tmp_path / "z.bin").stat().st_size == 1400 * 24
    assert trace(["convert", str(tmp_path / "z.bin"), str(tmp_path / "o.trace"), "--from", "oracle",
                  "--batch-size", "100"]) == 0
    assert open_trace(tmp_path / "o.trace").header.num_batches == 14


def test_errors_return_1_with_the_reason(tmp_path, capsys):
    assert trace(["inspect", str(tmp_path / "missing.trace")]) == 2
    assert "missing.trace" in capsys.readouterr().err
    (tmp_path / "bad.trace").write_bytes(b"TEMBTRC\0" + b"\0" * 10)
    assert trace(["inspect", str(tmp_path / "bad.trace")]) == 2
    assert "truncated header" in capsys.readouterr().err
    with TraceWriter(tmp_path / "t.trace", [TableInfo("t", 10)]) as w:
        w.write_batch([1, 2])
    assert trace(["convert", str(tmp_path / "t.trace"), str(tmp_path / "t.xyz")]) == 2
    assert "cannot tell the format" in capsys.readouterr().err
    assert trace(["synth", str(tmp_path / "s.trace"), "--zipf", "1", "--batches", "2", "--lookups", "3"]) == 2
    assert "--zipf needs --rows" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        trace(["synth", str(tmp_path / "s.trace"), "--batches", "2", "--lookups", "3"])  # neither --zipf nor --logs


@pytest.mark.parametrize("case", ["obj-size-csv", "obj-size-0", "obj-size-import", "seed", "csv-int64", "pt-batch-0",
                                  "pt-tables", "dash", "chunk-export"])
def test_bad_options_and_values_are_named_not_tracebacks_or_ignored(tmp_path, capsys, case):
    """Each was a traceback (TypeError, ValueError) or an option silently replaced or ignored."""
    t = str(tmp_path / "t.trace")
    with TraceWriter(t, [TableInfo("a", 10), TableInfo("b", 10)]) as w:
        w.write_batch([1, 12])
        w.write_batch([3, 14])
    args, said = {
        "obj-size-csv": (["convert", t, str(tmp_path / "x.csv"), "--obj-size", "3"],
                         "exporting to csv: obj_size applies to an oracleGeneral export only"),
        "obj-size-0": (["convert", t, str(tmp_path / "x.oracleGeneral"), "--obj-size", "0"],
                       "obj_size 0 must lie in [1, 2**32)"),
        "obj-size-import": (["convert", str(tmp_path / "x.csv"), str(tmp_path / "y.trace"), "--obj-size", "2"],
                            "--obj-size applies to an export to oracleGeneral"),
        "seed": (["synth", str(tmp_path / "s.trace"), "--zipf", "1", "--rows", "9", "--batches", "2", "--lookups", "3",
                  "--seed", "-1"], "seed -1 must be an int in [0, 2**64)"),
        "csv-int64": (["inspect", str(tmp_path / "x.csv")],
                      "line 3 ('0,0,99999999999999999999') is not 3 integers (int64)"),
        "pt-batch-0": (["convert", str(tmp_path / "x.pt"), str(tmp_path / "y.trace"), "--batch-size", "0"],
                       "batch size 0 must be >= 1 sample"),
        "pt-tables": (["convert", str(tmp_path / "x.pt"), str(tmp_path / "y.trace"), "--tables", "7"],
                      "its lengths tensor [T, B] holds 2 tables, not the 7 given"),
        "dash": (["convert", t, "-", "--to", "csv"], "destination '-': give a file name"),
        "chunk-export": (["convert", t, str(tmp_path / "x.oracleGeneral"), "--chunk-lookups", "8"],
                         "--chunk-lookups applies to the .trace an import writes, not to an export of"),
    }[case]
    (tmp_path / "x.csv").write_text("batch,table,id\n0,0,5\n0,0,99999999999999999999\n" if case == "csv-int64"
                                    else "batch,table,id\n0,0,5\n")
    if case.startswith("pt"):
        assert trace(["convert", t, str(tmp_path / "x.pt")]) == 0
    capsys.readouterr()
    assert trace(args) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "x.oracleGeneral").exists() and not (tmp_path / "y.trace").exists()
    assert not os.path.exists("-")


def test_the_installed_command_dispatches_to_trace(tmp_path):
    with TraceWriter(tmp_path / "t.trace", [TableInfo("t", 10)]) as w:
        w.write_batch([1, 2, 1])
    run = subprocess.run([sys.executable, "-m", "tieredemb.cli", "trace", "inspect", str(tmp_path / "t.trace"),
                          "--json"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    info = json.loads(run.stdout)
    assert info["num_lookups"] == 3 and info["reuse"]["repeat_in_batch"] == 1


def test_a_convert_to_a_fifo_writes_into_it(tmp_path):
    """Outputs written beside their destination and moved into place replaced a FIFO by a regular
    file (its reader got nothing) and failed on /dev/stdout (no file can be made beside it): a
    destination that is not a regular file is written directly, as before."""
    import threading

    with TraceWriter(tmp_path / "t.trace", [TableInfo("t", 1000)], chunk_lookups=100) as w:
        for b in range(5):
            w.write_batch(np.arange(100) * (b + 1) % 1000)
    fifo = tmp_path / "out.csv"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    assert trace(["convert", str(tmp_path / "t.trace"), str(fifo), "--to", "csv"]) == 0
    reader.join(30)
    assert got and got[0].count("\n") == 501  # the header and 500 lookups
    assert not fifo.is_file() and fifo.is_fifo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.csv", "t.trace"]


def test_outputs_to_stdout_append_where_it_appends_and_go_through_a_pipe(tmp_path):
    """`convert X /dev/stdout >> file` replaced the file (the output was moved over what /dev/stdout
    named) and a .trace, .npy or oracleGeneral output failed on a pipe (not seekable). A stream gets
    the whole file copied into it, through the inherited descriptor; the command's own lines go to
    stderr then. Real subprocesses, as a shell runs them."""
    with TraceWriter(tmp_path / "t.trace", [TableInfo("t", 1000)], chunk_lookups=100) as w:
        for b in range(5):
            w.write_batch(np.arange(100) * (b + 1) % 1000)
    (tmp_path / "t.csv").write_text("")
    assert trace(["convert", str(tmp_path / "t.trace"), str(tmp_path / "t.csv"), "--to", "csv"]) == 0
    log = tmp_path / "all.csv"
    log.write_text("kept 1\nkept 2\n")
    cmd = [sys.executable, "-m", "tieredemb", "trace", "convert", "--no-progress"]
    with open(log, "a") as out:
        run = subprocess.run(cmd + [str(tmp_path / "t.trace"), "/dev/stdout", "--to", "csv"], stdout=out,
                             stderr=subprocess.PIPE, text=True, timeout=120)
    assert run.returncode == 0 and "wrote /dev/stdout" in run.stderr
    assert log.read_text() == "kept 1\nkept 2\n" + (tmp_path / "t.csv").read_text()
    for to in ("trace", "npy", "oracle"):
        src = tmp_path / ("t.csv" if to == "trace" else "t.trace")
        run = subprocess.run(cmd + [str(src), "/dev/stdout", "--to", to], capture_output=True, timeout=120)
        assert run.returncode == 0, (to, run.stderr[-500:])
        assert len(run.stdout) > 500 and b"wrote" not in run.stdout
        if to == "trace":
            (tmp_path / "piped.trace").write_bytes(run.stdout)
            assert open_trace(tmp_path / "piped.trace").header.num_lookups == 500
    assert not [p for p in os.listdir(tempfile.gettempdir()) if p.startswith(".partial-")]


@pytest.mark.parametrize("ext", ["trace", "csv", "oracleGeneral", "npy", "pt"])
def test_a_failed_convert_leaves_the_destination_as_it_was(tmp_path, capsys, ext):
    """A failed import deleted an existing .trace; a failed export left a header-only .csv or a
    zero-filled .oracleGeneral in place of the file there, both read as valid empty traces."""
    with TraceWriter(tmp_path / "t.trace", [TableInfo("t", 1000)], chunk_lookups=100) as w:
        for b in range(20):
            w.write_batch(np.arange(100) * (b + 1) % 1000)
    if ext == "trace":  # ids out of the --rows given: the import fails part-way
        (tmp_path / "s.csv").write_text("batch,table,id\n" + "".join(f"{i // 10},0,{i}\n" for i in range(100)))
        args = [str(tmp_path / "s.csv"), "--rows", "50"]
    else:  # a trace cut short: the export fails at its last chunk
        data = (tmp_path / "t.trace").read_bytes()
        (tmp_path / "cut.trace").write_bytes(data[:len(data) - 50])
        args = [str(tmp_path / "cut.trace")]
    dst = tmp_path / f"keep.{ext}"
    dst.write_bytes(b"what was there before")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert trace(["convert", args[0], str(dst), *args[1:]]) == 2
    assert ("out of range [0, 50)" if ext == "trace" else "truncated") in capsys.readouterr().err
    assert dst.read_bytes() == b"what was there before"
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing left beside it
