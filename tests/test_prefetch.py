"""Prefetch: module.prefetch() and PrefetchLoader train to the same outputs and weights as
training without prefetch (bit for bit on the CPU), through a tiny cache over an SSD table;
forwards of prefetched batches read nothing themselves; background errors surface on the
training thread with their traceback; threads stop on exhaustion, break and exception."""

from __future__ import annotations

import threading
import traceback

import pytest
import torch

import tieredemb
from tieredemb.prefetch import PrefetchOrderError

NUM, DIM, BAGS, LEN, STEPS = 3000, 8, 16, 6, 200
CACHE = 400  # tier 0: a few batches' rows (< 100 unique each), far below the rows touched


def make_batches(steps=STEPS, seed=0):
    """(ids [BAGS * LEN], offsets [BAGS], grad [BAGS, DIM]) per step. Ids are skewed (hot rows
    repeat within and across batches: a row updated by batch t is read again by t + 1) and every
    batch repeats its first id at its end."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = (torch.rand(BAGS * LEN - 1, generator=g) ** 4 * NUM).long()
        ids = torch.cat([ids, ids[:1]])
        out.append((ids, torch.arange(0, BAGS * LEN, LEN), torch.randn(BAGS, DIM, generator=g)))
    return out


def make_table(tmp_path=None, name="t", **tiers):
    ssd = {} if tmp_path is None else dict(ssd_path=tmp_path / name)
    return tieredemb.TieredEmbeddingBag(NUM, DIM, mode="sum", optimizer=tieredemb.Adam(lr=0.01), seed=3,
                                        **ssd, **tiers)


def train_manual(emb, batches, depth):
    """Each step registers the batch `depth` ahead of the one it trains, then trains."""
    outs = []
    for ids, offsets, _ in batches[:depth]:
        emb.prefetch(ids, offsets)
    for t, (ids, offsets, grad) in enumerate(batches):
        if depth and t + depth < len(batches):
            emb.prefetch(*batches[t + depth][:2])
        out = emb(ids, offsets)
        out.backward(grad)
        outs.append(out.detach())
    return outs


def rows_and_state(emb):
    ids = torch.arange(NUM)
    return torch.cat([emb.read_rows(ids), emb.read_optimizer_state(ids)], 1)


@pytest.fixture(scope="module")
def batches():
    b = make_batches()
    # The workload has what the tests claim: rows of batch t read again by t + 1, duplicates.
    assert all(len(set(b[t][0].tolist()) & set(b[t + 1][0].tolist())) > 0 for t in range(STEPS - 1))
    assert all(len(torch.unique(ids)) < len(ids) for ids, _, _ in b)
    return b


@pytest.fixture(scope="module")
def reference(batches):
    """Outputs and final rows of the whole table in tier 0, no prefetch."""
    emb = make_table()
    outs = train_manual(emb, batches, depth=0)
    return outs, rows_and_state(emb)


# -- module.prefetch --------------------------------------------------------------------------

@pytest.mark.parametrize("depth", [1, 3])
def test_manual_prefetch_trains_bit_for_bit_through_a_tiny_cache_over_ssd(tmp_path, batches, reference, depth):
    emb = make_table(tmp_path, cache_rows=CACHE)
    outs = train_manual(emb, batches, depth)
    s = emb.stats()
    assert s["tier0"]["evictions"] > 1000 and s["ssd"]["rows_found"] > 1000  # rows really went down and came back
    p = s["prefetch"]
    assert p["registered"] == STEPS and p["forwards"] == STEPS
    assert p["demand_misses"] == 0  # every forward's rows were made resident by the prefetch worker
    assert p["prefetched_rows"] + p["late_rows"] == s["tier0"]["misses"]
    ref_outs, ref_rows = reference
    assert all(torch.equal(a, b) for a, b in zip(outs, ref_outs))
    assert torch.equal(rows_and_state(emb), ref_rows)
    assert emb._store.tier0.index.pinned == 0
    emb.close()


def test_forward_waits_for_nothing_once_its_batch_is_resident(batches):
    """With the worker done before each forward (the test waits for it), all misses count as
    prefetched and no time is spent waiting."""
    emb = make_table(cache_rows=CACHE)
    done = threading.Semaphore(0)
    store = emb._store
    make_resident = store.make_resident

    def instrumented(unique):
        result = make_resident(unique)
        if threading.current_thread() is not threading.main_thread():
            done.release()
        return result

    store.make_resident = instrumented
    for ids, offsets, grad in batches[:30]:
        emb.prefetch(ids, offsets)
        assert done.acquire(timeout=30)
        emb(ids, offsets).backward(grad)
    p = emb.stats()["prefetch"]
    assert p["late_rows"] == 0 and p["demand_misses"] == 0 and p["wait_seconds"] < 30
    assert p["prefetched_rows"] == emb.stats()["tier0"]["misses"] > 0


def test_prefetched_rows_stay_pinned_until_backward(batches):
    emb = make_table(cache_rows=CACHE)
    ids, offsets, grad = batches[0]
    emb.prefetch(ids, offsets)
    out = emb(ids, offsets)
    unique = torch.unique(ids)
    assert emb._store.tier0.index.pinned == len(unique)
    out.backward(grad)
    assert emb._store.tier0.index.pinned == 0
    with torch.no_grad():  # a forward without grad releases at once
        emb.prefetch(ids, offsets)
        emb(ids, offsets)
    assert emb._store.tier0.index.pinned == 0


def test_forward_out_of_order_is_refused_and_changes_nothing(batches):
    emb = make_table(cache_rows=CACHE)
    (a, off, grad), (b, _, _) = batches[0], batches[1]
    emb.prefetch(a, off)
    emb.prefetch(b, off)
    with pytest.raises(PrefetchOrderError, match=r"expected prefetched batch #0 \(96 ids"):
        emb(b, off)
    emb(a, off).backward(grad)  # the right order still works
    with pytest.raises(PrefetchOrderError, match="#1"):
        emb(a, off)
    emb(b, off).backward(grad)


def test_bad_ids_raise_at_prefetch_and_change_nothing(batches):
    emb = make_table(cache_rows=CACHE)
    ids, offsets, grad = batches[0]
    with pytest.raises(IndexError, match=f"{NUM}"):
        emb.prefetch(torch.cat([ids[:-1], torch.tensor([NUM])]), offsets)
    assert emb.stats()["prefetch"]["registered"] == 0
    emb(ids, offsets).backward(grad)  # nothing registered: an ordinary forward
    assert emb.stats()["prefetch"]["demand_misses"] == len(torch.unique(ids))


def test_embedding_prefetch(tmp_path):
    ref = tieredemb.TieredEmbedding(500, 4, optimizer=tieredemb.SGD(lr=0.1))
    emb = tieredemb.TieredEmbedding(500, 4, cache_rows=40, ssd_path=tmp_path / "e", optimizer=tieredemb.SGD(lr=0.1))
    g = torch.Generator().manual_seed(1)
    steps = [torch.randint(0, 500, (3, 5), generator=g) for _ in range(20)]
    emb.prefetch(steps[0])
    for t, ids in enumerate(steps):
        if t + 1 < len(steps):
            emb.prefetch(steps[t + 1])
        out, want = emb(ids), ref(ids)
        assert torch.equal(out, want)
        out.sum().backward()
        want.sum().backward()
    assert torch.equal(emb.read_rows(torch.arange(500)), ref.read_rows(torch.arange(500)))
    emb.close()


# -- errors in the background -----------------------------------------------------------------

def test_background_error_surfaces_with_its_traceback_and_prefetch_recovers(tmp_path, batches):
    emb = make_table(tmp_path, cache_rows=CACHE)
    train_manual(emb, batches[:5], depth=1)
    backing = emb._store.backing
    real_read = backing.read

    def failing_ssd_read(ids, out):
        raise OSError("simulated SSD failure")

    backing.read = failing_ssd_read
    ids, offsets, grad = batches[5]
    emb.prefetch(ids, offsets)
    with pytest.raises(OSError, match="simulated SSD failure") as info:
        emb(ids, offsets)  # the next call after the failure
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "failing_ssd_read" in frames and "_work" in frames  # the worker's own frames
    assert emb._store.tier0.index.pinned == 0  # nothing left pinned
    backing.read = real_read
    train_manual(emb, batches[5:10], depth=2)  # prefetch works again
    assert emb.stats()["prefetch"]["registered"] == 1 + 10
    emb.close()
