"""The `tieredemb` command: the demo (README's main job) runs end to end, in memory and over
an SSD store; unknown commands and --help behave."""

from __future__ import annotations

from tieredemb.cli import main

SMALL = ["--steps", "3", "--rows", "50000", "--cache-rows", "10000", "--batch", "128", "--bag-len", "8"]


def test_demo_trains_and_reports(capsys):
    assert main(["demo", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "3 steps in" in out and "tier0  hit rate" in out


def test_demo_over_the_log_store(tmp_path, capsys):
    assert main(["demo", *SMALL, "--ssd-path", str(tmp_path / "t"), "--ssd-backend", "log"]) == 0
    out = capsys.readouterr().out
    assert "SSD at" in out and "'rows_written'" in out
    assert (tmp_path / "t" / "log.json").exists()


def test_usage_and_unknown_command(capsys):
    assert main(["--help"]) == 0
    assert "simulate" in capsys.readouterr().out
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
