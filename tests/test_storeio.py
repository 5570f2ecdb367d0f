"""Tier 0's reads and writes of the log store below in stream order (tieredemb/gpu/storeio.py), on
CPU tensors under Triton's interpreter (the native StreamIo's calls then run at once, where a GPU's
stream would reach them): over the real log store, the same outputs, rows, optimizer state and store
counters as the waiting path; no residency waits for its plan; a failed store call is raised by the
next residency and by flush."""

from __future__ import annotations

import pytest
import torch

import tieredemb
from training import batches, rows_and_state, train

pytestmark = pytest.mark.interpreted
pytest.importorskip("triton")
from tieredemb.gpu import storeio  # noqa: E402
from tieredemb.gpu.index import SetIndex  # noqa: E402
from tieredemb.gpu.tier import on_cpu_tensors  # noqa: E402

NUM, D = 300, 8


def _table(on_stream: bool, cache_rows: int, path, monkeypatch, dtype=torch.float32):
    monkeypatch.setattr(storeio, "ON_STREAM", on_stream)
    kw = dict(ssd_path=str(path), ssd_options={"backend": "log"})
    emb = tieredemb.TieredEmbeddingBag(NUM, D, "sum", optimizer=tieredemb.RowWiseAdagrad(lr=0.1), cache_rows=cache_rows,
                                       seed=2, dtype=dtype, **kw)
    g = torch.Generator().manual_seed(1)
    emb.write_rows(torch.arange(0, NUM, 7), torch.randn(len(range(0, NUM, 7)), D, generator=g))  # (the rest drawn)
    emb = on_cpu_tensors(emb, cache_rows)
    assert (emb._store.tier0.on_stream is not None) == on_stream
    return emb


@pytest.mark.parametrize("cache_rows, depth", [(8, 0), (64, 0), (8, 2)], ids=["cache8", "cache64", "prefetch"])
def test_reads_and_writes_in_stream_order_train_as_the_waiting_path(cache_rows, depth, tmp_path, monkeypatch):
    """cache 8: overflow slots, and rows lingering in them that leave and come back (written down,
    then read back, in one store call). Between the halves, rows written from outside (some held in
    tier 0) and a flush. Without prefetch no residency waits for its plan (no SetIndex._plan)."""
    data = batches(6, 6)

    def run(on_stream):
        emb = _table(on_stream, cache_rows, tmp_path / f"t{int(on_stream)}", monkeypatch)
        outs = []
        for first, part in ((True, data[:3]), (False, data[3:])):
            with monkeypatch.context() as m:
                if on_stream and depth == 0:
                    m.setattr(SetIndex, "_plan", lambda *a, **k: pytest.fail("a residency waited for its plan"))
                outs += train(emb, part, depth=depth)
            if first:
                g = torch.Generator().manual_seed(3)
                emb.write_rows(torch.arange(3, NUM, 11), torch.randn(len(range(3, NUM, 11)), D, generator=g))
                emb.flush()
        return emb, outs

    plain, plain_outs = run(False)
    streamed, outs = run(True)
    assert [torch.equal(a, b) for a, b in zip(outs, plain_outs)] == [True] * 6
    assert torch.equal(rows_and_state(streamed).view(torch.int32), rows_and_state(plain).view(torch.int32))
    st, st_plain = streamed.stats(), plain.stats()
    assert st["ssd"]["rows_written"] > 0 and st["tier0"]["bytes_in"] > 0 and st["tier0"]["bytes_out"] > 0
    assert st["ssd"]["rows_initialized"] > 0 and st["ssd"]["rows_found"] > 0  # (both kinds of miss read)
    if depth == 0:  # (with prefetch the batches are made resident at other times: other victims)
        assert st["ssd"] == st_plain["ssd"]
        assert {k: st["tier0"][k] for k in ("hits", "misses", "bytes_in", "bytes_out")} == \
            {k: st_plain["tier0"][k] for k in ("hits", "misses", "bytes_in", "bytes_out")}
    assert streamed._store.tier0.on_stream.queued_calls > 0


def test_a_failed_store_call_is_raised_by_the_next_residency_and_by_flush(tmp_path, monkeypatch):
    """A store call runs where nothing can raise to the caller (on a GPU, the driver's thread): its
    error is kept and raised by the next residency and every call after (the table is then
    unusable: see storeio). The failure here: the store's files closed under the tier."""
    emb = _table(True, 8, tmp_path / "t", monkeypatch)
    data = batches(7, 3)
    train(emb, data[:1])
    store = emb._store.tier0.lower
    store._file.close()
    train(emb, data[1:2])  # (its reads and writes fail in the queued call; the caller goes on)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="closed with its reads and writes still queued"):
            train(emb, data[2:])
    with pytest.raises(RuntimeError, match="closed with its reads and writes still queued"):
        emb.flush()
    assert emb._store.tier0.on_stream.io.take_counts()["calls"] == 2  # (the failed one ran, and no later one)
    with pytest.raises(Exception):  # (the flush's error; then the store's own, its files closed here)
        emb.close()
    assert store._closed  # (its lock let go all the same)


def test_a_batch_not_allowed_overflow_is_refused_past_tier0s_capacity_and_changes_nothing(tmp_path, monkeypatch):
    """A prefetcher's residencies (allow_overflow False) are queued too, the overflow slots grown
    for them, but not past tier 0's capacity: then refused, as on the waiting path, until a
    release makes room."""
    emb = _table(True, 8, tmp_path / "t", monkeypatch)
    store, tier = emb._store, emb._store.tier0
    ids = [b[0] for b in batches(8, 2, length=60)]  # (600 ids a batch: two pinned need more overflow slots)
    first = store.prepare(ids[0])  # (allowed overflow: pinned)
    slots_before = tier.index.overflow_slots
    assert tier.pinned_ids + 600 > slots_before > tier.index.capacity  # (the next would grow them, past 8)
    assert store.make_resident(store.dedup(ids[1], in_plan=True), allow_overflow=False) is None
    assert tier.index.overflow_slots == slots_before and store.batches_held() == 1
    first.release()
    second = store.make_resident(store.dedup(ids[1], in_plan=True), allow_overflow=False)
    assert second is not None
    second.release()


def test_a_table_dropped_unflushed_lets_its_queued_calls_finish_first(tmp_path, monkeypatch):
    """The queued calls hold raw pointers to the StreamIo and its pinned blocks: those are held
    until the stream is past them (on CPU tensors, at once), then let go."""
    import gc

    emb = _table(True, 8, tmp_path / "t", monkeypatch)
    train(emb, batches(9, 2))
    held = emb._store.tier0.on_stream._held
    assert held["io"] is not None and held["blocks"] is not None
    del emb
    gc.collect()
    assert held == {}


def test_on_stream_is_only_for_a_log_store_of_float32_rows_right_below_a_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(storeio, "ON_STREAM", True)
    log = dict(ssd_options={"backend": "log"})
    tables = {"whole": (tieredemb.TieredEmbeddingBag(NUM, D, cache_rows=None, ssd_path=str(tmp_path / "w"), **log),
                        None),
              "host cache between": (tieredemb.TieredEmbeddingBag(NUM, D, cache_rows=8, host_rows=40,
                                                                   ssd_path=str(tmp_path / "c"), **log), 8),
              "host store": (tieredemb.TieredEmbeddingBag(NUM, D, cache_rows=8), 8),
              "float16 rows": (tieredemb.TieredEmbeddingBag(
                  NUM, D, cache_rows=8, ssd_path=str(tmp_path / "h"),
                  ssd_options={"backend": "log", "storage_dtype": torch.float16}), 8)}
    on = {name: on_cpu_tensors(emb, rows)._store.tier0.on_stream is not None for name, (emb, rows) in tables.items()}
    assert on == dict.fromkeys(tables, False)
    assert _table(True, 8, tmp_path / "yes", monkeypatch)._store.tier0.on_stream is not None


def test_a_residency_that_fails_after_its_moves_changes_no_value(tmp_path, monkeypatch):
    """As test_gpu_tier.py's: a residency in stream order that failed after the misses' rows were
    moved into the victims' slots (the commit's failure injected: an out-of-memory cannot be had
    on CPU tensors) left the victims' ids naming other rows. Those slots are emptied now."""
    plain = _table(False, 8, tmp_path / "plain", monkeypatch)
    emb = _table(True, 8, tmp_path / "streamed", monkeypatch)
    data = batches(6, 3)
    train(plain, data)
    train(emb, data)
    index = emb._store.tier0.index

    def failing(plan, pin):
        raise MemoryError("injected: out of memory in the commit")

    monkeypatch.setattr(index, "commit_queued", failing)
    with pytest.raises(MemoryError, match="injected"):
        emb(torch.arange(250, 258), torch.tensor([0]))
    monkeypatch.undo()
    every = torch.arange(NUM)
    assert torch.equal(emb.read_rows(every), plain.read_rows(every))
    emb.flush()
    assert torch.equal(emb.read_rows(every), plain.read_rows(every))
