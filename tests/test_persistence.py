"""The step count lives in the backing store's record, written with it atomically at flush;
checkpoints and reopened tables carry it; state_dict refuses tables too large for memory."""

from __future__ import annotations

import json
import os

import pytest
import torch

import tieredemb
import tieredemb.persistence
from ssd_backend import RocksDBStore

BACKENDS = ["rocksdb", "log", "slots"]
RECORD = {"log": "log.json", "slots": "slots.json"}


def table(path, backend, **kw):
    return tieredemb.TieredEmbeddingBag(500, 4, "sum", cache_rows=20, ssd_path=path, ssd_options={"backend": backend},
                                        optimizer=tieredemb.Adam(lr=0.01), **kw)


def train(emb, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        emb(torch.randint(0, 500, (40,), generator=g), torch.arange(0, 40, 4)).sum().backward()


def stored_state(path, backend) -> dict:
    """The state in the store's record, read from the files (RocksDB: read-only open)."""
    if backend == "rocksdb":
        return RocksDBStore.read_meta(path).get("state", {})
    with open(os.path.join(path, RECORD[backend])) as f:
        return json.load(f)["state"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_is_stored_with_the_rows_and_restored(tmp_path, backend):
    path = str(tmp_path / "t")
    emb = table(path, backend)
    train(emb, 7)
    assert emb.step == 7
    emb.flush()
    assert stored_state(path, backend) == {"step": 7}
    train(emb, 2)  # not flushed: the record still says 7
    assert stored_state(path, backend) == {"step": 7}
    emb.close()  # close flushes
    assert sorted(n for n in os.listdir(path) if "step" in n) == []  # no file beside the record
    again = table(path, backend)
    assert again.step == 9
    # Adam's bias correction goes on from step 9: the same rows as a table never closed.
    ref = tieredemb.TieredEmbeddingBag(500, 4, "sum", cache_rows=20, optimizer=tieredemb.Adam(lr=0.01))
    train(ref, 7), train(ref, 2), train(ref, 3, seed=1), train(again, 3, seed=1)
    ids = torch.arange(500)
    assert torch.equal(again.read_rows(ids), ref.read_rows(ids))
    again.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoint_carries_the_step(tmp_path, backend):
    emb = table(str(tmp_path / "t"), backend)
    train(emb, 5)
    emb.checkpoint(tmp_path / "ck")
    train(emb, 1)
    emb.close()
    assert stored_state(str(tmp_path / "ck"), backend) == {"step": 5}
    snap = table(str(tmp_path / "ck"), backend)
    assert snap.step == 5
    snap.close()


def test_step_file_of_an_earlier_version_is_read_once(tmp_path):
    path = str(tmp_path / "t")
    table(path, "log").close()
    record = os.path.join(path, "log.json")
    with open(record) as f:
        doc = json.load(f)
    del doc["state"]  # a table written before the step moved into the record
    with open(record, "w") as f:
        json.dump(doc, f)
    with open(os.path.join(path, "tieredemb_step.json"), "w") as f:
        json.dump({"step": 41}, f)
    emb = table(path, "log")
    assert emb.step == 41
    emb.close()
    assert stored_state(path, "log") == {"step": 41}


def test_state_dict_of_a_table_too_large_for_memory_is_refused(monkeypatch):
    emb = tieredemb.TieredEmbeddingBag(1000, 4, cache_rows=10)
    monkeypatch.setattr(tieredemb.persistence, "STATE_DICT_MAX_BYTES", 1000 * 4 * 4 - 1)
    with pytest.raises(RuntimeError, match=r"state_dict\(\) would hold 16000 bytes .* use export_rows\(\)"):
        emb.state_dict()
    monkeypatch.setattr(tieredemb.persistence, "STATE_DICT_MAX_BYTES", 1000 * 4 * 4)
    assert emb.state_dict()["weight"].shape == (1000, 4)


def test_a_table_whose_flush_fails_at_close_still_lets_its_store_go(tmp_path):
    """close() raises the flush's error, and lets the store's files and lock go all the same: the
    table opens again. (The failure: the store's files closed under the table, with dirty rows in
    tier 0 to write down.)"""
    path = str(tmp_path / "t")
    emb = table(path, "log")
    train(emb, 3)
    emb._store.bottom._file.close()
    with pytest.raises(Exception, match="closed"):
        emb.close()
    emb.close()  # (nothing left to let go: it raised "the store is closed" before)
    again = table(path, "log")  # (refused as locked if the first still held the store)
    again.close()


def test_a_table_reopened_with_another_dim_names_the_dim(tmp_path):
    """The rows' width differs first; the error names the table's field that makes it differ (it
    named the internal width alone)."""
    tieredemb.TieredEmbeddingBag(100, 4, "sum", ssd_path=tmp_path / "t", ssd_options={"backend": "log"}).close()
    with pytest.raises(ValueError, match=r"stored width 4 != requested 8 \(stored embedding_dim 4 != requested 8\)"):
        tieredemb.TieredEmbeddingBag(100, 8, "sum", ssd_path=tmp_path / "t")
