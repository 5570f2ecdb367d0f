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
    with pytest.raises(ValueError, match=r"export: tables \['a', 'b'\] are of an export_rows that did not finish"):
        fresh.import_rows(tmp_path / "export")
    live = TieredEmbeddingBagCollection(tables, cache_bytes=20_000, ssd_path=tmp_path / "live",
                                        optimizer=tieredemb.Adagrad(lr=0.1))
    live.export_rows(tmp_path / "export")  # (written again, whole: it imports, into the table refused before)
    fresh.import_rows(tmp_path / "export")
    for t in tables:
        assert torch.equal(fresh.read_rows(t.name, torch.arange(t.num_embeddings)),
                           live.read_rows(t.name, torch.arange(t.num_embeddings)))


def test_exports_of_two_collections_and_of_a_module_share_a_directory(tmp_path):
    """A review of export.json: it named one export for the whole directory, so a second
    collection's export into it (a model's bag and sequence collections), or a table's export
    replaced by a module's, was refused as unfinished."""
    bags = TieredEmbeddingBagCollection([EmbeddingBagConfig("a", 50, 4, ["a"]), EmbeddingBagConfig("b", 30, 4, ["b"])],
                                        optimizer=tieredemb.SGD(lr=0.1))
    seq = tieredemb.TieredEmbeddingCollection([tieredemb.EmbeddingConfig("c", 40, 4, ["c"])],
                                              optimizer=tieredemb.SGD(lr=0.1))
    for ebc, t in ((bags, "a"), (bags, "b"), (seq, "c")):
        ebc.write_rows(t, torch.arange(5), torch.full((5, 4), float(ord(t))))
    bags.export_rows(tmp_path / "x")
    seq.export_rows(tmp_path / "x")
    single = tieredemb.TieredEmbeddingBag(50, 4, optimizer=tieredemb.SGD(lr=0.1))
    single.write_rows(torch.arange(2), torch.full((2, 4), 7.0))
    single.export_rows(tmp_path / "x" / "a")  # (table a's export replaced by a module's)
    fresh_bags = TieredEmbeddingBagCollection([EmbeddingBagConfig("a", 50, 4, ["a"]),
                                               EmbeddingBagConfig("b", 30, 4, ["b"])], optimizer=tieredemb.SGD(lr=0.1))
    fresh_seq = tieredemb.TieredEmbeddingCollection([tieredemb.EmbeddingConfig("c", 40, 4, ["c"])],
                                                    optimizer=tieredemb.SGD(lr=0.1))
    assert fresh_bags.import_rows(tmp_path / "x") == {"a": 2, "b": 5}
    assert fresh_seq.import_rows(tmp_path / "x") == {"c": 5}
    assert fresh_bags.read_rows("a", torch.tensor([1]))[0, 0] == 7.0
    with pytest.raises(ValueError, match=r"table name 'export.json': a table's name names its directory in an "
                                         r"export: .* not '.', '..' or 'export.json'"):
        EmbeddingBagConfig("export.json", 10, 4, ["e"])
