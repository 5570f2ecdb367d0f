"""The `tieredemb` command: the demo (README's main job) runs end to end, in memory and over
an SSD store; unknown commands, --help and --version behave; commands start without what they do
not need, and a cold numba cache is announced."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import tieredemb
from tieredemb.cli import main
from tieredemb.trace import TableInfo, TraceWriter

SMALL = ["--steps", "3", "--rows", "50000", "--cache-rows", "10000", "--batch", "128", "--bag-len", "8"]


def test_demo_trains_through_prefetch_and_reports(capsys):
    assert main(["demo", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "3 steps in" in out and "tier0  hit rate" in out and "host store: " in out
    assert "prefetch (depth 2): " in out and "% of tier-0 misses were made resident before" in out
    assert main(["demo", *SMALL, "--prefetch-depth", "0"]) == 0
    assert "prefetch: off" in capsys.readouterr().out


def test_demo_over_the_log_store_says_when_it_reopens_a_table(tmp_path, capsys):
    args = ["demo", *SMALL, "--ssd-path", str(tmp_path / "t"), "--ssd-backend", "log"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "SSD store at" in out and "created a new table at" in out and "rows written back" in out
    assert "{" not in out  # no raw dicts
    assert (tmp_path / "t" / "log.json").exists()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "reopened the log table at" in out and "it has trained 3 steps" in out
    assert "has trained 6 steps in all" in out


def test_demo_trains_a_collection_of_tables(capsys):
    assert main(["demo", *SMALL, "--tables", "4"]) == 0
    out = capsys.readouterr().out
    # (2 dims: 2 groups, and one more per dim where the plan holds a table whole beside cached ones)
    assert "4 tables of" in out and re.search(r"\b[2-4] groups looked up together", out) and "3 steps in" in out
    assert "planned from the first 3 batches" in out and "proportional:" in out
    for k in range(4):  # each table measures the hit rate its plan predicted
        line = next(x for x in out.splitlines() if x.startswith(f"  table{k}: "))
        if "whole table in tier 0" not in line:
            got, want = line.split("tier-0 hit rate ")[1].split(" (plan: ")
            assert got == want.split(")")[0], line


def test_demo_of_tables_over_ssd_stores_them_there_and_reopens_them(tmp_path, capsys):
    args = ["demo", *SMALL, "--tables", "3", "--ssd-path", str(tmp_path / "c"), "--ssd-backend", "log"]
    assert main(args) == 0
    assert "created a new collection at" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "c")) == ["collection.json", "group0", "group1"]  # every table on SSD
    assert (tmp_path / "c" / "group0" / "log.json").exists()  # the store --ssd-backend names
    assert main(args) == 0
    assert "its groups have trained [3, 3] steps" in capsys.readouterr().out
    assert main(["demo", *SMALL, "--tables", "2", "--ssd-path", str(tmp_path / "c")]) == 2  # (was a traceback)
    err = capsys.readouterr().err
    assert err.startswith("tieredemb demo: error: ssd_path ") and err.count("\n") == 1, err
    assert "group0 holds tables [table0 " in err and "this collection would put" in err


@pytest.mark.parametrize("options, said", [
    (["--rows", "0"], "--rows 0: must be >= 1"),
    (["--dim", "0"], "--dim 0: must be >= 1"),
    (["--cache-rows", "-3"], "--cache-rows -3: must be >= 1"),
    (["--cache-rows", "0"], "--cache-rows 0: must be >= 1"),  # (was the default, silently)
    (["--host-rows", "0"], "--host-rows 0: must be >= 1"),
    (["--prefetch-depth", "-1"], "--prefetch-depth -1: must be >= 0"),
    (["--alpha", "-1"], "--alpha -1.0: must be a number >= 0"),
    (["--bag-len", "0"], "--bag-len 0: must be >= 1"),  # (RuntimeError: step must be nonzero)
    (["--steps", "0"], "--steps 0: must be >= 1"),  # (TypeError)
    (["--tables", "3", "--steps", "0"], "--steps 0: must be >= 1"),  # (need at least one array to concatenate)
    (["--batch", "0"], "--batch 0: must be >= 1"),  # (0 lookups, status 0)
    (["--tables", "0"], "--tables 0: must be >= 1"),  # (the demo of one table)
    (["--tables", "-2"], "--tables -2: must be >= 1"),
    (["--tables", "2", "--host-rows", "100"], "--host-rows 100 does not apply to --tables 2"),  # (ignored)
])
def test_bad_demo_options_get_one_line_naming_the_option(capsys, options, said):
    """Each was a Python traceback, or an option ignored or replaced by its default."""
    assert main(["demo", "--rows", "1000", "--steps", "2", "--batch", "8", "--bag-len", "4", *options]) == 2
    out = capsys.readouterr()
    assert out.err.startswith(f"tieredemb demo: error: {said}")
    assert out.err.count("\n") == 1 and out.out == "", out


def test_a_demo_of_tables_takes_a_small_alpha():
    """The tables' alphas spread over --alpha +- 0.15: --alpha 0.1 was a traceback (alpha -0.05 must be >= 0)."""
    assert main(["demo", "--rows", "1000", "--steps", "2", "--batch", "8", "--bag-len", "4", "--tables", "2",
                 "--alpha", "0.1"]) == 0


def test_a_demo_table_reopened_with_other_options_says_why_in_one_line(tmp_path, capsys):
    args = ["demo", "--rows", "1000", "--steps", "2", "--batch", "8", "--bag-len", "4", "--ssd-backend", "log",
            "--ssd-path", str(tmp_path / "t")]
    assert main(args) == 0
    for other, said in [(["--rows", "2000"], "stored num_embeddings 1000 != requested 2000"),
                        (["--dim", "32"], "stored embedding_dim 64 != requested 32"),
                        (["--ssd-backend", "slots"], "holds a 'log' table, requested backend 'slots'")]:
        capsys.readouterr()
        assert main(args + other) == 2  # (a 20-line traceback)
        err = capsys.readouterr().err
        assert err.startswith(f"tieredemb demo: error: ssd_path {tmp_path / 't'}: ") and said in err, err
        assert err.count("\n") == 1


def test_every_demo_option_has_help_and_a_default(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = capsys.readouterr().out
    text = text[text.index("options:"):]
    for option in ("--rows", "--dim", "--cache-rows", "--host-rows", "--ssd-path", "--ssd-backend", "--steps",
                   "--batch", "--bag-len", "--alpha", "--policy", "--prefetch-depth", "--tables"):
        line = text[text.index(option):].split("\n  -")[0]
        assert "default" in line, option
    assert "(default: None)" not in text  # (it followed the options that say their default themselves)


def test_a_demo_of_tables_whose_budget_holds_no_batch_says_so(capsys):
    assert main(["demo", "--rows", "20000", "--steps", "10", "--batch", "256", "--tables", "3"]) == 2  # (a traceback)
    assert "tieredemb demo: error: cache_bytes 255744 cannot hold every table's widest batch" in capsys.readouterr().err


def test_usage_and_unknown_command(capsys):
    assert main(["--help"]) == 0
    assert "simulate" in capsys.readouterr().out
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
    assert main([]) == 2  # (no command: a usage error, its usage on stderr; a review found it on stdout)
    out, err = capsys.readouterr()
    assert out == "" and "simulate" in err


def test_options_that_would_be_ignored_are_refused(tmp_path, capsys):
    """(A review.) --lookahead K with no lookahead policy, a probe of a directory that is not
    there (it named a temporary file inside it): one line each, exit 2."""
    t = tmp_path / "t.trace"
    with TraceWriter(t, [TableInfo("t", 50)]) as w:
        for k in range(4):
            w.write_batch(np.arange(k, k + 10))
    for command in (["simulate", str(t), "--capacity", "20", "--policy", "lru", "--lookahead", "4"],
                    ["mrc", str(t), "--policy", "lfu", "--lookahead", "4"]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--lookahead 4: applies to the policy lookahead only" in err, err
    for policies in (["lookahead"], ["Lookahead"], ["lru", "LOOKAHEAD"]):  # (policy names are read in any case)
        assert main(["simulate", str(t), "--capacity", "20", "--lookahead", "4"]
                    + [a for p in policies for a in ("--policy", p)]) == 0, policies
    capsys.readouterr()
    missing = tmp_path / "nodir"
    assert main(["plan", str(t), "--cache-bytes", "1KiB", "--dim", "8", "--probe", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"probe: '{missing}' is not a directory" in err, err


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"tieredemb {tieredemb.__version__}\n"


def test_submodules_read_as_attributes_after_a_plain_import():
    """The README's tieredemb.metrics.prometheus(...), tieredemb.trace.open_any, tieredemb.sim.replay
    .replay_trace: an AttributeError after `import tieredemb` alone (a fresh process: nothing imported
    them before)."""
    code = ("import sys, tieredemb\n"
            "names = [tieredemb.metrics.prometheus, tieredemb.trace.open_any, tieredemb.sim.replay.replay_trace,\n"
            "         tieredemb.planner.report]\n"
            "print(len(names))\n"
            "try:\n    tieredemb.no_such_thing\nexcept AttributeError as e:\n    print(e)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.stdout.split("\n")[:2] == ["4", "module 'tieredemb' has no attribute 'no_such_thing'"], run.stderr


def test_python_dash_m_runs_the_command():
    run = subprocess.run([sys.executable, "-m", "tieredemb", "--version"], capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stdout) == (0, f"tieredemb {tieredemb.__version__}\n"), run.stderr


def _run_command(args: list[str], env=None) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Runs `tieredemb ARGS` in a fresh interpreter; returns it and which of torch / numba it imported."""
    code = ("import sys\nfrom tieredemb.cli import main\ntry:\n    status = main(sys.argv[1:])\n"
            "except SystemExit as e:  # argparse's --help\n    status = e.code\n"
            "print('IMPORTED', *[m for m in ('torch', 'numba') if m in sys.modules])\nsys.exit(status)")
    run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                         env=None if env is None else {**os.environ, **env})
    return run, run.stdout.splitlines()[-1].split()[1:]


@pytest.fixture
def small_trace(tmp_path):
    path = tmp_path / "t.trace"
    with TraceWriter(path, [TableInfo("t", 500)]) as w:
        for b in range(20):
            w.write_batch((np.arange(40) * (b + 1)) % 500)
    return path


def test_commands_import_only_what_they_need(small_trace):
    """--help and --version start without torch and numba; simulate needs numba, not torch."""
    for args, imported in [(["--help"], []), (["--version"], []), (["simulate", "--help"], []),
                           (["mrc", "--help"], []), (["trace", "inspect", str(small_trace), "--no-reuse"], []),
                           (["simulate", str(small_trace), "--capacity", "10%"], ["numba"])]:
        run, modules = _run_command(args)
        assert run.returncode == 0, run.stderr
        assert modules == imported, args


def test_a_cold_numba_cache_is_announced_once(small_trace, tmp_path):
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}
    first, _ = _run_command(["simulate", str(small_trace), "--capacity", "50", "--mode", "request"], env)
    assert first.returncode == 0, first.stderr
    assert first.stderr.count("compiling numba kernels (first run only") == 1, first.stderr
    again, _ = _run_command(["simulate", str(small_trace), "--capacity", "50", "--mode", "request"], env)
    assert again.returncode == 0 and again.stderr == ""
    assert again.stdout.splitlines()[:-1] == first.stdout.splitlines()[:-1]
    # (an oracleGeneral export makes a numba typed Dict, whose constructor numba compiles in every
    # process: with a warm cache it said "first run only" every time, a review found)
    for out in ("a.oracleGeneral", "b.oracleGeneral"):
        run, _ = _run_command(["trace", "convert", str(small_trace), str(tmp_path / out)], env)
        assert run.returncode == 0, run.stderr
    assert "compiling numba" not in run.stderr, run.stderr


@pytest.mark.parametrize("args", [["trace", "inspect", "T"], ["mrc", "T"], ["plan", "T", "--cache-bytes", "100KiB",
                                                                             "--dim", "4"]])
def test_output_into_a_closed_pipe_ends_quietly(small_trace, args):
    """`tieredemb mrc t.trace | head`: a review saw '[Errno 32] Broken pipe' and status 2. The
    reader's end is closed before the command writes."""
    read, write = os.pipe()
    os.close(read)
    try:
        run = subprocess.run([sys.executable, "-m", "tieredemb", *[str(small_trace) if a == "T" else a for a in args]],
                             stdout=write, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write)
    # (a cold numba cache says so on stderr first: a fresh clone's)
    assert run.returncode == 1 and "Errno" not in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_a_percentage_of_the_most_rows_a_trace_may_have(tmp_path, capsys):
    """(A review.) 100% of 2**63 - 1 rows, computed in floats, was 2**63: mrc's sizes an
    OverflowError traceback, simulate's capacity refused with a number never typed."""
    (tmp_path / "one.csv").write_text(f"batch,table,id\n0,0,{2**63 - 2}\n1,0,5\n2,0,{2**63 - 2}\n")
    assert main(["simulate", str(tmp_path / "one.csv"), "--capacity", "100%", "--json"]) == 0
    assert f"{2**63 - 1}" in capsys.readouterr().out
    assert main(["mrc", str(tmp_path / "one.csv"), "--sizes", "100%", "--json"]) == 0
    assert f"{2**63 - 1}" in capsys.readouterr().out
    assert main(["mrc", str(tmp_path / "one.csv"), "--sizes", "99999999999999999999"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rows must be > 0 and below 2**63" in err, err


def test_a_plot_asked_for_at_a_directory_is_refused(small_trace, tmp_path, capsys):
    """(A review: mrc --png DIR wrote DIR.png beside the directory.)"""
    (tmp_path / "plots").mkdir()
    assert main(["mrc", str(small_trace), "--png", str(tmp_path / "plots")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Is a directory" in err and str(tmp_path / "plots") in err, err
    assert sorted(os.listdir(tmp_path)) == sorted(["plots", small_trace.name])  # (no plots.png beside it)
    assert os.listdir(tmp_path / "plots") == []
