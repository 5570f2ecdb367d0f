"""Tier 0's reads and writes below in stream order (tieredemb/gpu/storeio.py), on CPU tensors under
Triton's interpreter (host calls then run at once, where a GPU's stream would reach them): over the
real log store and the host store, the same outputs, rows, optimizer state and store as the waiting
path; no residency waits for its plan; a failed store call is raised by the next one and by flush."""

from __future__ import annotations

import pytest
import torch

import tieredemb
from training import rows_and_state, train

pytestmark = pytest.mark.interpreted
pytest.importorskip("triton")
from tieredemb.gpu import storeio  # noqa: E402
from tieredemb.gpu.index import SetIndex  # noqa: E402
from tieredemb.gpu.tier import on_cpu_tensors  # noqa: E402

NUM, D = 300, 8


def _batches(seed, steps, bags=10, length=6):
    g = torch.Generator().manual_seed(seed)
    return [((torch.rand(bags * length, generator=g) ** 2 * NUM).long(), torch.arange(0, bags * length, length),
             torch.randn(bags, D, generator=g)) for _ in range(steps)]


def _table(on_stream: bool, cache_rows: int, path, monkeypatch, dtype=torch.float32):
    monkeypatch.setattr(storeio, "ON_STREAM", on_stream)
    kw = dict(ssd_path=str(path), ssd_options={"backend": "log"}) if path is not None else {}
    emb = tieredemb.TieredEmbeddingBag(NUM, D, "sum", optimizer=tieredemb.RowWiseAdagrad(lr=0.1), cache_rows=cache_rows,
                                       seed=2, dtype=dtype, **kw)
    g = torch.Generator().manual_seed(1)
    emb.write_rows(torch.arange(0, NUM, 7), torch.randn(len(range(0, NUM, 7)), D, generator=g))  # (the rest drawn)
    emb = on_cpu_tensors(emb, cache_rows)
    assert (emb._store.tier0.on_stream is not None) == on_stream
    return emb


@pytest.mark.parametrize("store, cache_rows, depth", [("log", 8, 0), ("log", 64, 0), ("log", 8, 2), ("host", 8, 0)],
                         ids=["log-cache8", "log-cache64", "log-prefetch", "host-cache8"])
def test_reads_and_writes_in_stream_order_train_as_the_waiting_path(store, cache_rows, depth, tmp_path, monkeypatch):
    """cache 8: overflow slots, and rows lingering in them that leave and come back (written down,
    then read back, in one host call). Between the halves, rows written from outside (some held in
    tier 0) and a flush. Without prefetch no residency waits for its plan (no SetIndex._plan)."""
    data = _batches(6, 6)

    def run(on_stream):
        emb = _table(on_stream, cache_rows, tmp_path / f"t{int(on_stream)}" if store == "log" else None, monkeypatch)
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
    below = "ssd" if store == "log" else "store"
    assert st[below]["rows_written"] > 0 and st["tier0"]["bytes_in"] > 0 and st["tier0"]["bytes_out"] > 0
    if depth == 0:  # (with prefetch the batches are made resident at other times: other victims)
        assert st[below] == st_plain[below]
        assert {k: st["tier0"][k] for k in ("hits", "misses", "bytes_in", "bytes_out")} == \
            {k: st_plain["tier0"][k] for k in ("hits", "misses", "bytes_in", "bytes_out")}
    assert streamed._store.tier0.on_stream.calls.ran > 0


def test_a_failed_store_read_is_raised_by_the_next_residency_and_by_flush(tmp_path, monkeypatch):
    """The read runs in a host call, where nothing can raise to the caller: its error is kept and
    raised by the next residency and every call after (the table is then unusable: see storeio)."""
    from ssd_backend.log_store import LogStore

    emb = _table(True, 8, tmp_path / "t", monkeypatch)
    data = _batches(7, 3)
    train(emb, data[:1])
    monkeypatch.setattr(LogStore, "read_to", lambda *a, **k: (_ for _ in ()).throw(OSError("the disk is gone")))
    train(emb, data[1:2])  # (its read fails in the host call; the caller goes on)
    with pytest.raises(RuntimeError, match="the disk is gone"):
        train(emb, data[2:])
    with pytest.raises(RuntimeError, match="the disk is gone"):
        emb.flush()


def test_on_stream_is_off_for_a_table_held_whole_and_with_a_host_cache_between(tmp_path, monkeypatch):
    monkeypatch.setattr(storeio, "ON_STREAM", True)
    whole = on_cpu_tensors(tieredemb.TieredEmbeddingBag(NUM, D, cache_rows=None), None)
    cached = tieredemb.TieredEmbeddingBag(NUM, D, cache_rows=8, host_rows=40, ssd_path=str(tmp_path / "c"),
                                          ssd_options={"backend": "log"})
    cached = on_cpu_tensors(cached, 8)
    assert whole._store.tier0.on_stream is None and cached._store.tier0.on_stream is None
