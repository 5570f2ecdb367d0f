"""A collection's checkpoint or export cut short by a real SIGKILL (the child process kills itself
at the point named): a checkpoint leaves no directory at its path (one cut short opened as a
new, empty collection; a single table's: test_ssd_damage.py), an export is refused by
import_rows (one written over an earlier export and cut short between two tables imported as a
mix of the two)."""

from __future__ import annotations

import glob
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import tieredemb
from tieredemb import EmbeddingBagConfig, TieredEmbeddingBagCollection

PRELUDE = textwrap.dedent("""
    import os, signal, sys, torch, tieredemb
    from tieredemb import EmbeddingBagConfig, TieredEmbeddingBagCollection

    def tables():
        return [EmbeddingBagConfig("a", 500, 8, ["a"]), EmbeddingBagConfig("b", 300, 16, ["b"])]

    def make(path, backend="log"):
        return TieredEmbeddingBagCollection(tables(), cache_bytes=20_000, ssd_path=path,
                                            ssd_options={"backend": backend}, optimizer=tieredemb.Adagrad(lr=0.1))

    def train(ebc, steps):
        for s in range(steps):
            ids = torch.arange(s * 7, s * 7 + 40) % 300
            ebc({"a": (ids, torch.arange(0, 40, 4)), "b": (ids, torch.arange(0, 40, 4))}).values().sum().backward()

    def die():
        os.kill(os.getpid(), signal.SIGKILL)
""")


def run_child(code: str, *args) -> None:
    run = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code), *map(str, args)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == -signal.SIGKILL, run.stderr


@pytest.mark.parametrize("backend", ["log", "rocksdb"])
def test_a_collection_checkpoint_killed_part_way_leaves_no_directory(tmp_path, backend):
    run_child("""
        ebc = make(sys.argv[1], sys.argv[3])
        train(ebc, 5)
        ebc.engines[1].checkpoint = lambda path: die()  # (group0's checkpoint is whole by then)
        ebc.checkpoint(sys.argv[2])
    """, tmp_path / "live", tmp_path / "ckpt", backend)
    assert not (tmp_path / "ckpt").exists()
    assert len(glob.glob(str(tmp_path / "ckpt.partial-*"))) == 1  # (what the crash left, named so)


def test_a_collection_export_written_again_and_killed_between_tables_is_refused(tmp_path):
    run_child("""
        import tieredemb.collection_state as cs
        ebc = make(sys.argv[1])
        train(ebc, 5)
        ebc.export_rows(sys.argv[2])  # (whole)
        train(ebc, 5)
        write = cs.write_export
        cs.write_export = lambda d, chunks, meta: die() if d.endswith("b") else write(d, chunks, meta)
        ebc.export_rows(sys.argv[2])  # (table a written again, then the kill)
    """, tmp_path / "live", tmp_path / "export")
    tables = [EmbeddingBagConfig("a", 500, 8, ["a"]), EmbeddingBagConfig("b", 300, 16, ["b"])]
    fresh = TieredEmbeddingBagCollection(tables, optimizer=tieredemb.Adagrad(lr=0.1))
    with pytest.raises(ValueError, match=r"export: no export.json: an export_rows that did not finish"):
        fresh.import_rows(tmp_path / "export")
    live = TieredEmbeddingBagCollection(tables, cache_bytes=20_000, ssd_path=tmp_path / "live",
                                        optimizer=tieredemb.Adagrad(lr=0.1))
    live.export_rows(tmp_path / "export")  # (written again, whole: it imports, into the table refused before)
    fresh.import_rows(tmp_path / "export")
    for t in tables:
        assert torch.equal(fresh.read_rows(t.name, torch.arange(t.num_embeddings)),
                           live.read_rows(t.name, torch.arange(t.num_embeddings)))
