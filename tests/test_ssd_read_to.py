"""read_to: the native SSD stores read rows straight into a cache tier's slots (no staging block),
and the engine's failure path when such a read fails after the tier wrote its victims down.
Real files throughout; the read fault is real too (segment files truncated under an open table
that reads with O_DIRECT)."""

from __future__ import annotations

import os

import pytest
import torch

import tieredemb
from ssd_backend import LogStore, RocksDBStore, SlotFileStore, StoreError
from native_store_rows import META, WIDTH, init_rows, o_direct_or_skip, read, rows_for

STORES = {"log": LogStore, "slots": SlotFileStore, "rocksdb": RocksDBStore}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(STORES))
def test_read_to_equals_read_into_the_given_rows(tmp_path, kind, dtype):
    written = torch.arange(0, 400, 3)
    ids = torch.tensor([9, 3, 0, 4999, 6, 1000])  # four written, two never written
    dst_rows = torch.tensor([17, 2, 40, 5, 33, 0])
    with STORES[kind](tmp_path / "t", WIDTH, init_rows, META, storage_dtype=dtype) as s:
        s.write(written, rows_for(written))
        s.flush()  # (RocksDB would serve rows still queued for its writer, and count them apart)
        pool = torch.full((50, WIDTH), 7.0)
        s.read_to(ids, pool, dst_rows)
        assert torch.equal(pool[dst_rows], read(s, ids))
        untouched = torch.ones(50, dtype=torch.bool)
        untouched[dst_rows] = False
        assert bool((pool[untouched] == 7.0).all())
        stats = s.stats()
        assert stats["rows_found"] == 2 * 4 and stats["rows_initialized"] == 2 * 2  # read_to, then read


@pytest.mark.parametrize("kind", sorted(STORES))
def test_read_to_rejects_bad_destinations_and_writes_nothing(tmp_path, kind):
    with STORES[kind](tmp_path / "t", WIDTH, init_rows, META) as s:
        s.write(torch.tensor([1, 2]), rows_for(torch.tensor([1, 2])))
        pool = torch.zeros(10, WIDTH)
        with pytest.raises(IndexError, match=r"dst row 10 out of range \[0, 10\)"):
            s.read_to(torch.tensor([1, 2]), pool, torch.tensor([3, 10]))
        with pytest.raises(ValueError, match="dst must be a contiguous float32"):
            s.read_to(torch.tensor([1]), torch.zeros(10, WIDTH, dtype=torch.float64), torch.tensor([0]))
        with pytest.raises(ValueError, match="dst_rows has 1 entries for 2 ids"):
            s.read_to(torch.tensor([1, 2]), pool, torch.tensor([0]))
        assert bool((pool == 0).all())


def _table(**kw):
    return tieredemb.TieredEmbeddingBag(3000, 8, mode="sum", optimizer=tieredemb.Adagrad(lr=0.1), seed=5, **kw)


def _train(tables, g, steps):
    for _ in range(steps):
        ids = torch.randint(0, 3000, (200,), generator=g)
        for emb in tables:
            emb(ids, torch.arange(0, 200, 4)).pow(2).sum().backward()


def test_a_failed_read_into_slots_evicts_the_victims_and_loses_nothing(tmp_path):
    """Tier 0 writes its dirty victims down, then reads the missing rows into their slots; the
    read fails (the segments were truncated under the table). The victims must have left tier 0
    (their slots hold partly read rows now), every other row keeps its value, and once the
    files are back training goes on exactly as an in-memory table's."""
    o_direct_or_skip(tmp_path)
    path = tmp_path / "t"
    ref = _table()
    ssd = _table(cache_rows=300, ssd_path=path,
                 ssd_options={"backend": "log", "segment_bytes": 64 << 10, "direct_reads": True})
    g = torch.Generator().manual_seed(1)
    _train([ref, ssd], g, 30)
    ssd.flush()
    saved = {n: (path / n).read_bytes() for n in os.listdir(path) if n.startswith("seg-")}
    for n in saved:
        os.truncate(path / n, 0)
    tier0 = ssd._store.tier0
    before = tier0.index.stats()
    written = ssd._store.bottom.written_ids(0, None)
    ids = written[~torch.from_numpy(tier0.index.lookup(written) >= 0)][:250]  # in the store only
    assert len(ids) == 250
    with pytest.raises(StoreError, match="cannot read"):
        ssd(ids, torch.arange(0, 250, 5))
    after = tier0.index.stats()
    evicted = after["evictions"] - before["evictions"]
    assert evicted > 0 and after["hits"] == before["hits"] and after["misses"] == before["misses"]
    assert tier0.index.size == 300 - evicted and tier0.index.pinned == 0
    ssd.flush()  # the victims' write-back has landed
    for n, data in saved.items():  # the files back (the write-backs since were appended past them)
        fd = os.open(path / n, os.O_WRONLY)
        try:
            os.pwrite(fd, data, 0)
        finally:
            os.close(fd)
    everything = torch.arange(3000)
    assert torch.equal(ssd.read_rows(everything), ref.read_rows(everything))
    _train([ref, ssd], g, 10)
    assert torch.equal(ssd.read_rows(everything), ref.read_rows(everything))
    ssd.close()
