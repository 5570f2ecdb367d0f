"""Rows across tiers: deterministic init, write-back, pins, flush, the highest copy wins,
optimizer state travelling with its row, and the ways a table is saved and restored."""

from __future__ import annotations

import gc
import glob
import json
import os
import subprocess
import sys
import threading

import psutil
import pytest
import torch

import tieredemb as te
from training import finalize_what_the_graph_holds, rows_and_state

N, D = 40, 4
ONE_BAG = torch.tensor([0])


def train(m, batches, seed=0):
    """One forward + backward per batch (each batch one bag, mode of the table)."""
    g = torch.Generator().manual_seed(seed)
    for batch in batches:
        out = m(torch.tensor(batch), ONE_BAG)
        (out * torch.randn(out.shape, generator=g)).sum().backward()


def look(m, batch):
    with torch.no_grad():
        m(torch.tensor(batch), ONE_BAG)


def layers(m):
    """The table's layers top to bottom: its cache tiers, then the bottom store."""
    return m._store.tiers + [m._store.bottom]


def tier(m, name):
    (t,) = [t for t in layers(m) if t.name == name]
    return t


def bottom_rows(m, ids):
    """Whole rows (weights and state) as the bottom store holds them, read without caching."""
    out = torch.empty(len(ids), m.width)
    m._store.bottom.read_to(ids, out, torch.arange(len(ids)))
    return out


def counts(m, name):
    s = m.stats()[name]
    return s["evictions"], s["dirty_writebacks"], s["clean_drops"]


def random_batches(n_batches, ids_below, max_unique, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        k = int(torch.randint(1, max_unique + 1, (1,), generator=g))
        ids = torch.randint(0, ids_below, (k,), generator=g)
        out.append(torch.cat([ids, ids[:1]]).tolist())  # a duplicate in every batch
    return out


# -- deterministic init -----------------------------------------------------------------------

CONFIGS = [
    dict(cache_rows=None),
    dict(cache_rows=4),
    dict(cache_rows=4, host_rows=8),
    dict(cache_rows=3, host_rows=5, policy="lfu"),
    dict(cache_rows=2, host_rows=7, policy="clock"),
]


def test_unwritten_rows_read_the_same_whatever_the_tiers_and_access_order():
    probe = torch.tensor([0, 7, 13, 39, 21])
    seen = []
    for k, cfg in enumerate(CONFIGS):
        m = te.TieredEmbeddingBag(N, D, "sum", optimizer=te.SGD(lr=0.1), seed=5, **cfg)
        order = torch.randperm(N, generator=torch.Generator().manual_seed(k)).tolist()
        for i in range(0, N, 2):  # every row passes through tier 0 (read only), in a different order
            look(m, order[i:i + 2])
        train(m, [[30, 31], [32, 33]])  # written rows elsewhere
        rows = m.read_rows(probe)
        # A forward reads the same value the table reports.
        with torch.no_grad():  # (two rows at a time: the smallest tier 0 holds 2)
            fwd = torch.cat([m(probe[i:i + 2], torch.arange(len(probe[i:i + 2]))) for i in range(0, len(probe), 2)])
        assert torch.equal(fwd, rows)
        seen.append(rows)
    for rows in seen[1:]:
        assert torch.equal(rows, seen[0])


def test_seed_decides_the_initial_rows():
    ids = torch.arange(200)
    a = te.TieredEmbeddingBag(1000, 8, seed=1, cache_rows=10).read_rows(ids)
    b = te.TieredEmbeddingBag(1000, 8, seed=1, cache_rows=None).read_rows(ids)
    c = te.TieredEmbeddingBag(1000, 8, seed=2, cache_rows=10).read_rows(ids)
    assert torch.equal(a, b)
    assert (a != c).all()
    # Rows differ from each other too (the id is part of the key).
    assert len(torch.unique(a[:, 0])) == len(ids)


def test_initial_rows_are_standard_normal():
    m = te.TieredEmbeddingBag(10**6, 16, cache_rows=64)
    w = m.read_rows(torch.arange(0, 10**6, 50))  # 20000 rows, 320000 values
    assert abs(float(w.mean())) < 0.01
    assert abs(float(w.std()) - 1.0) < 0.01
    assert 0.66 < float((w.abs() < 1).float().mean()) < 0.70  # ~68% within one sigma
    # Columns (Box-Muller pairs included) and neighbouring rows are uncorrelated.
    corr = torch.corrcoef(w.T)
    assert float((corr - torch.eye(16)).abs().max()) < 0.03
    assert abs(float(torch.corrcoef(torch.stack([w[:-1].flatten(), w[1:].flatten()]))[0, 1])) < 0.01


def test_other_initializers():
    ids = torch.arange(5000)
    u = te.TieredEmbeddingBag(5000, 8, cache_rows=8, init=te.Init("uniform", -0.5, 0.25)).read_rows(ids)
    assert float(u.min()) >= -0.5 and float(u.max()) < 0.25
    assert abs(float(u.mean()) - (-0.125)) < 0.01
    z = te.TieredEmbeddingBag(5000, 8, cache_rows=8, init=te.Init("zeros")).read_rows(ids)
    assert torch.equal(z, torch.zeros(5000, 8))


@pytest.mark.parametrize("padding_idx, row", [(3, 3), (-1, N - 1)])
def test_padding_row_starts_at_zero(padding_idx, row):
    m = te.TieredEmbeddingBag(N, D, cache_rows=4, host_rows=8, padding_idx=padding_idx)
    w = m.read_rows(torch.arange(N))
    assert torch.equal(w[row], torch.zeros(D))
    assert bool((w[torch.arange(N) != row] != 0).all())


def test_optimizer_state_starts_at_zero():
    m = te.TieredEmbeddingBag(N, D, cache_rows=4, optimizer=te.Adam(lr=0.1))
    assert torch.equal(m.read_optimizer_state(torch.arange(N)), torch.zeros(N, 2 * D))


def test_billion_row_table_is_created_without_allocating():
    proc = psutil.Process()
    gc.collect()
    rss = proc.memory_info().rss
    m = te.TieredEmbeddingBag(10**9, 16, "sum", cache_rows=1000, optimizer=te.SGD(lr=0.5))
    ids = torch.tensor([0, 10**9 - 1, 123_456_789])
    before = m.read_rows(ids).clone()
    out = m(ids, torch.tensor([0, 1]))
    assert out.shape == (2, 16)
    assert torch.allclose(out[0], before[0])
    assert torch.allclose(out[1], before[1] + before[2])
    out.sum().backward()
    assert torch.allclose(m.read_rows(ids), before - 0.5)  # d(sum)/d(row) = 1 for every row
    far = torch.tensor([999_999_999, 500_000_000])
    look(m, list(range(1000, 2000)))  # evicts the trained rows (dirty write-back)
    assert m.stats()["tier0"]["dirty_writebacks"] == 3
    assert torch.allclose(m.read_rows(ids), before - 0.5)
    assert m.read_rows(far).abs().sum() > 0
    grown = proc.memory_info().rss - rss
    assert grown < 100 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB"


# -- write-back -------------------------------------------------------------------------------


def test_write_back_without_host_tier():
    m = te.TieredEmbeddingBag(N, D, "sum", cache_rows=4, optimizer=te.SGD(lr=0.25))
    assert [t.name for t in layers(m)] == ["tier0", "store"]
    store = tier(m, "store")
    look(m, [0, 1, 2, 3])
    look(m, [4, 5, 6, 7])  # 0..3 read only: dropped without a write
    assert counts(m, "tier0") == (4, 0, 4)
    assert store.index.size == 0 and m.stats()["tier0"]["bytes_out"] == 0

    train(m, [[0, 1, 2, 3]])  # evicts 4..7 (clean), then 0..3 become dirty
    assert counts(m, "tier0") == (8, 0, 8)
    trained = m.read_rows(torch.arange(4)).clone()
    assert not torch.equal(trained, te.TieredEmbeddingBag(N, D, cache_rows=4).read_rows(torch.arange(4)))

    look(m, [8, 9, 10, 11])  # 0..3 dirty: written back
    assert counts(m, "tier0") == (12, 4, 8)
    assert store.index.resident_ids(0, -1).tolist() == [0, 1, 2, 3]
    assert m.stats()["tier0"]["bytes_out"] == 4 * D * 4
    assert torch.equal(m.read_rows(torch.arange(4)), trained)

    # Back into tier 0 (clean now, the store holds the value): evicting again writes nothing.
    look(m, [0, 1, 2, 3])
    assert torch.equal(m.read_rows(torch.arange(4)), trained)
    look(m, [12, 13, 14, 15])
    assert counts(m, "tier0") == (20, 4, 16)
    # And training them from the store's copy continues from the trained values.
    with torch.no_grad():
        out = m(torch.tensor([0, 1, 2, 3]), torch.arange(4))
    assert torch.equal(out, trained)


def flush_racing_a_backward(m, owner, copy_name: str):
    """A flush whose copy of the dirty rows down (owner's method copy_name) is followed, before
    flush returns, by the backward of a batch in flight updating one of those rows: the order a
    training thread's backward and another thread's flush can take. (The interleaving is forced
    by running the backward inside the copy's wrapper: a real race does not land there every
    time.) Returns (tier 0's rows of the batch, the bottom's after a second flush)."""
    train(m, [[0, 1, 2]])  # 0..2 dirty
    out = m(torch.tensor([0, 1, 2]), ONE_BAG)  # pinned, in flight
    copy = getattr(owner, copy_name)
    fired = []

    def copy_then_backward(*args, **kw):
        result = copy(*args, **kw)
        if not fired:
            fired.append(1)
            out.sum().backward()
        return result

    setattr(owner, copy_name, copy_then_backward)
    try:
        m.flush()
    finally:
        delattr(owner, copy_name)
    assert fired
    m.flush()  # the updated rows are still dirty: written now
    ids = torch.tensor([0, 1, 2])
    return m.read_rows(ids), m.layout.weights(bottom_rows(m, ids))


def test_a_backward_between_a_flushs_copy_and_its_end_is_not_lost():
    m = te.TieredEmbeddingBag(N, D, "sum", cache_rows=8, optimizer=te.SGD(lr=0.25))
    in_tier0, in_bottom = flush_racing_a_backward(m, m._store.tier0.lower, "write_from")
    assert torch.equal(in_bottom, in_tier0)


@pytest.mark.parametrize("device_path", [False, pytest.param(True, marks=pytest.mark.interpreted)],
                         ids=["host", "device"])
def test_a_failed_write_back_leaves_its_rows_dirty(device_path):
    """The copy down fails (a fault injected into the copy: a disk that fails part way cannot be
    had here for real); the rows stay dirty, and the next flush writes them."""
    m = te.TieredEmbeddingBag(N, D, "sum", cache_rows=8, optimizer=te.SGD(lr=0.25))
    if device_path:
        from tieredemb.gpu.tier import on_cpu_tensors

        m = on_cpu_tensors(m, 8)
    train(m, [[0, 1, 2]])
    owner, name = (m._store.tier0.pool, "to_host") if device_path else (m._store.tier0.lower, "write_from")

    def failing(*args, **kw):
        raise OSError("injected: the disk failed")

    setattr(owner, name, failing)
    with pytest.raises(OSError, match="injected"):
        m.flush()
    delattr(owner, name)
    ids = torch.tensor([0, 1, 2])
    assert not torch.equal(m.layout.weights(bottom_rows(m, ids)), m.read_rows(ids))
    m.flush()
    assert torch.equal(m.layout.weights(bottom_rows(m, ids)), m.read_rows(ids))


@pytest.mark.interpreted
def test_a_backward_between_a_flushs_copy_and_its_end_is_not_lost_on_the_device_path():
    from tieredemb.gpu.tier import on_cpu_tensors

    m = on_cpu_tensors(te.TieredEmbeddingBag(N, D, "sum", cache_rows=8, optimizer=te.SGD(lr=0.25)), 8)
    tier0 = m._store.tier0
    owner = tier0.pool if hasattr(tier0.pool, "to_host") else tier0
    in_tier0, in_bottom = flush_racing_a_backward(m, owner, "to_host")
    assert torch.equal(in_bottom, in_tier0)


def test_write_back_through_a_host_tier():
    m = te.TieredEmbeddingBag(N, D, "sum", cache_rows=4, host_rows=8, optimizer=te.SGD(lr=0.25))
    assert [t.name for t in layers(m)] == ["tier0", "host", "store"]
    store = tier(m, "store")
    look(m, [0, 1, 2, 3])
    look(m, [4, 5, 6, 7])
    assert counts(m, "tier0") == (4, 0, 4)
    assert counts(m, "host") == (0, 0, 0) and tier(m, "host").index.size == 8

    train(m, [[0, 1, 2, 3]])  # hits in the host; tier 0 drops 4..7 clean
    trained = m.read_rows(torch.arange(4)).clone()
    assert m.stats()["host"]["hits"] == 4
    assert counts(m, "tier0") == (8, 0, 8)

    look(m, [8, 9, 10, 11])  # tier 0 writes 0..3 down into the host; the host drops 4..7
    assert counts(m, "tier0") == (12, 4, 8)
    assert counts(m, "host") == (4, 0, 4)
    assert sorted(tier(m, "host").index.dirty_rows()[0].tolist()) == [0, 1, 2, 3]
    assert store.index.size == 0  # nothing reached the store yet
    assert torch.equal(m.read_rows(torch.arange(4)), trained)

    look(m, [12, 13, 14, 15])  # the host drops 8..11 (clean, least recent)
    look(m, [16, 17, 18, 19])  # the host writes 0..3 down to the store
    assert counts(m, "host") == (12, 4, 8)
    assert store.index.resident_ids(0, -1).tolist() == [0, 1, 2, 3]
    assert torch.equal(m.read_rows(torch.arange(4)), trained)
    assert torch.equal(bottom_rows(m, torch.arange(4))[:, :D], trained)


# -- invariant 2: pins ------------------------------------------------------------------------


def test_two_batches_in_flight_that_do_not_fit_both_train():
    """The second batch finds tier 0 full of the first's pinned rows: its rows go to overflow
    slots, and both train as with the whole table in tier 0."""
    ref = te.TieredEmbeddingBag(N, D, "sum", cache_rows=None, optimizer=te.SGD(lr=0.1))
    m = te.TieredEmbeddingBag(N, D, "sum", cache_rows=4, host_rows=8, optimizer=te.SGD(lr=0.1))
    for t in (m, ref):
        first = t(torch.tensor([0, 1, 2]), ONE_BAG)
        second = t(torch.tensor([3, 4, 5, 1]), ONE_BAG)
        (first.sum() + 3 * second.sum()).backward()
    index = m._store.tier0.index
    assert index.pinned == 0 and m.stats()["tier0"]["overflow_rows"] == 2
    train(m, [[6, 7, 8, 9]]), train(ref, [[6, 7, 8, 9]])
    assert index.overflow == 0 and index.size == 4
    ids = torch.arange(N)
    assert torch.equal(m.read_rows(ids), ref.read_rows(ids))


def test_rows_in_flight_are_not_evicted_by_other_batches():
    ref = te.TieredEmbeddingBag(N, D, "sum", cache_rows=None, optimizer=te.SGD(lr=0.1))
    m = te.TieredEmbeddingBag(N, D, "sum", cache_rows=4, host_rows=6, optimizer=te.SGD(lr=0.1))
    batch = torch.tensor([0, 1])
    held = m(batch, ONE_BAG)
    slots = m._store.tier0.index.lookup(batch).tolist()
    for i in range(2, N, 2):  # many other batches stream through the 2 free slots
        look(m, [i, i + 1])
        train(m, [[i, i + 1]])
        train(ref, [[i, i + 1]])
        assert m._store.tier0.index.lookup(batch).tolist() == slots
    held.sum().backward()  # updates rows 0 and 1, not whatever else came into their slots
    out = ref(batch, ONE_BAG)
    out.sum().backward()
    train(m, [[0]]), train(ref, [[0]])
    ids = torch.arange(N)
    assert torch.equal(m.read_rows(ids), ref.read_rows(ids))


def test_two_batches_in_flight_that_fit_both_train():
    ref = te.TieredEmbeddingBag(N, D, "sum", cache_rows=None, optimizer=te.Adagrad(lr=0.1))
    m = te.TieredEmbeddingBag(N, D, "sum", cache_rows=6, host_rows=8, optimizer=te.Adagrad(lr=0.1))
    for t in (ref, m):
        a = t(torch.tensor([0, 1, 2]), ONE_BAG)
        b = t(torch.tensor([2, 3, 4]), ONE_BAG)
        if t is m:
            assert t._store.tier0.index.pinned == 5
            look(t, [10, 11])  # one free slot: the other row is lent an overflow slot
            assert t.stats()["tier0"]["overflow_rows"] == 1
        (b * 2).sum().backward()
        a.sum().backward()
    assert m._store.tier0.index.pinned == 0
    ids = torch.arange(N)
    assert torch.equal(m.read_rows(ids), ref.read_rows(ids))
    assert torch.equal(m.read_optimizer_state(ids), ref.read_optimizer_state(ids))


def test_dropped_output_releases_its_pins():
    m = te.TieredEmbeddingBag(N, D, "sum", cache_rows=4, optimizer=te.SGD(lr=0.1))
    out = m(torch.tensor([0, 1, 2, 3]), ONE_BAG)
    loss = out.sum() * 2
    assert m._store.tier0.index.pinned == 4
    del out, loss
    gc.collect()
    assert m._store.tier0.index.pinned == 0
    train(m, [[4, 5, 6, 7]])  # needs every slot


@pytest.mark.parametrize("unpooled", [False, True], ids=["bags", "unpooled"])
def test_a_graph_the_collector_judges_unreachable_keeps_its_batch_pinned_until_backward(unpooled):
    """What a pinned batch's graph holds is finalized as the cyclic collector does to a live graph
    it misjudges (simulated: training.finalize_what_the_graph_holds says why): the batch stays
    pinned, and backward trains as without it (the batch's release-on-drop was its __del__, which
    unpinned it: backward raised, or on a GPU trained rows already evicted)."""
    def make():
        kw = dict(cache_rows=4, optimizer=te.Adagrad(lr=0.1), seed=3)
        return te.TieredEmbedding(N, D, **kw) if unpooled else te.TieredEmbeddingBag(N, D, "sum", **kw)

    ids = torch.tensor([[0, 1, 2], [2, 3, 0]]) if unpooled else torch.tensor([0, 1, 2, 3, 2])
    runs = []
    for fault in (True, False):
        m = make()
        out = m(ids) if unpooled else m(ids, torch.tensor([0, 2]))
        if fault:
            assert "ResidentBatch" in finalize_what_the_graph_holds(out)
        assert m._store.tier0.index.pinned == 4
        out.backward(torch.ones_like(out))
        assert m._store.tier0.index.pinned == 0
        runs.append(rows_and_state(m))
    assert torch.equal(runs[0], runs[1])


def test_an_output_dropped_while_an_error_propagates_keeps_the_error_and_releases_its_pins():
    """A forward's output that is a temporary of an expression that raises is freed while the
    error propagates: its batch's release runs then, and the caller still gets its own error (the
    release called Python with the error pending: a SystemError came out instead)."""
    m = te.TieredEmbeddingBag(N, D, "sum", cache_rows=8, optimizer=te.Adagrad(lr=0.1), seed=3)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        (m(torch.tensor([0, 1, 2, 3, 2]), torch.tensor([0, 2])) @ torch.randn(D + 1, 1)).sum()
    with pytest.raises(ZeroDivisionError):
        (m(torch.tensor([4, 5]), torch.tensor([0, 1])), 1 / 0)
    assert m._store.tier0.index.pinned == 0 and m._store.batches_held() == 0


def test_a_batch_collected_inside_a_lock_is_released_after_it():
    """The garbage collector may collect a pinned batch while its thread holds one of the
    package's locks (here the store's room, which a prefetch worker holds as it waits for room):
    it is released by the store's next residency, not there (its release takes that lock too: the
    thread hung, before). A real collection in a real thread, no fake."""
    import threading

    m = te.TieredEmbeddingBag(N, D, "sum", cache_rows=4, optimizer=te.SGD(lr=0.1))
    st = m._store
    gc.disable()  # (until the thread collects: no collection of the cycle before)
    try:
        cycle = [st.prepare(torch.tensor([0, 1, 2]))]
        cycle.append(cycle)
        del cycle
        collected = threading.Event()

        def collect():
            with st.room:
                gc.collect()
            collected.set()

        threading.Thread(target=collect, daemon=True).start()
        assert collected.wait(60), "the collecting thread hung"
    finally:
        gc.enable()
    assert st.tier0.index.pinned == 3 and len(st.orphans) == 1
    train(m, [[4, 5, 6, 7]])  # (its residency releases the collected batch first)
    assert st.tier0.index.pinned == 0 and not st.orphans and st.batches_held() == 0


def test_forward_without_grad_pins_nothing():
    m = te.TieredEmbeddingBag(N, D, "sum", cache_rows=4, optimizer=te.SGD(lr=0.1))
    with torch.no_grad():
        out = m(torch.tensor([0, 1, 2, 3]), ONE_BAG)
    assert m._store.tier0.index.pinned == 0
    frozen = te.TieredEmbeddingBag.from_pretrained(torch.randn(N, D), cache_rows=4, optimizer=te.SGD(lr=0.1))
    out = frozen(torch.tensor([0, 1, 2, 3]), ONE_BAG)
    assert frozen._store.tier0.index.pinned == 0
    assert not out.requires_grad


# -- invariant 4: flush -----------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [dict(cache_rows=4), dict(cache_rows=4, host_rows=8)], ids=["no-host", "host"])
def test_flush_makes_the_bottom_hold_every_update(cfg):
    m = te.TieredEmbeddingBag(N, D, "sum", optimizer=te.Adagrad(lr=0.2), **cfg)
    train(m, random_batches(30, N, 3, seed=1))
    assert m._store.bottom.name == "store"
    ids = torch.arange(N)
    rows_before_flush = bottom_rows(m, ids)
    w, s = m.read_rows(ids).clone(), m.read_optimizer_state(ids).clone()
    assert not torch.equal(rows_before_flush[:, :D], w)  # some updates were only in upper tiers
    m.flush()
    for t in m._store.tiers:  # (the bottom's dirty bits mean "ever written")
        assert t.index.dirty_rows()[0].tolist() == [], t.name
    rows = bottom_rows(m, ids)
    assert torch.equal(rows[:, :D], w)
    assert torch.equal(rows[:, D:], s)
    # flush changed no value, and training goes on from the same rows.
    assert torch.equal(m.read_rows(ids), w)
    # Clean rows are dropped with no write afterwards.
    wb = m.stats()["tier0"]["dirty_writebacks"]
    look(m, [30, 31, 32, 33])
    assert m.stats()["tier0"]["dirty_writebacks"] == wb


# -- invariant 1: the highest copy wins ------------------------------------------------------


def test_read_rows_returns_the_highest_tiers_copy():
    m = te.TieredEmbeddingBag(N, D, "sum", cache_rows=4, host_rows=8, optimizer=te.SGD(lr=0.1))
    train(m, [[0, 1]])
    look(m, [2, 3, 4, 5])  # 0 and 1 now in the host only (dirty), 2..5 in tier 0 and the host
    t0, host = m._store.tier0.index, tier(m, "host").index
    assert t0.lookup(torch.tensor([2, 0])).tolist()[1] == -1 and t0.lookup(torch.tensor([2]))[0] >= 0
    new = torch.arange(3 * D, dtype=torch.float32).reshape(3, D)
    m.write_rows(torch.tensor([2, 0, 20]), new)  # in tier 0; in the host only; in the store only
    assert torch.equal(m.read_rows(torch.tensor([2, 0, 20])), new)
    # The lower copy of row 2 is stale and that is allowed only because the upper one is dirty.
    assert host.lookup(torch.tensor([2]))[0] >= 0
    host_copy = tier(m, "host").pool.gather(torch.from_numpy(host.lookup(torch.tensor([2]))))
    assert not torch.equal(host_copy[0, :D], new[0])
    assert 2 in t0.dirty_rows()[0].tolist()
    # A forward sees the new values, and they survive eviction down every tier.
    with torch.no_grad():
        assert torch.equal(m(torch.tensor([2, 0, 20]), torch.arange(3)), new)
    for i in range(6, N - 4, 4):
        look(m, list(range(i, i + 4)))
    assert torch.equal(m.read_rows(torch.tensor([2, 0, 20])), new)
    m.flush()
    assert torch.equal(bottom_rows(m, torch.tensor([2, 0, 20]))[:, :D], new)


def test_write_rows_keeps_or_sets_optimizer_state():
    m = te.TieredEmbeddingBag(N, D, "sum", cache_rows=4, host_rows=8, optimizer=te.Adagrad(lr=0.1))
    train(m, [[0, 1, 2]])
    ids = torch.tensor([0, 1, 2])
    state = m.read_optimizer_state(ids).clone()
    assert (state > 0).all()
    m.write_rows(ids, torch.zeros(3, D))
    assert torch.equal(m.read_optimizer_state(ids), state)
    m.write_rows(ids, torch.ones(3, D), torch.full((3, D), 0.5))
    assert torch.equal(m.read_rows(ids), torch.ones(3, D))
    assert torch.equal(m.read_optimizer_state(ids), torch.full((3, D), 0.5))


# -- invariant 6 / state travels with the row -------------------------------------------------


@pytest.mark.parametrize("opt", [te.Adagrad(lr=0.3), te.Adam(lr=0.05), te.RowWiseAdagrad(lr=0.3)],
                         ids=["adagrad", "adam", "rowwise"])
@pytest.mark.parametrize("policy", ["lru", "lfu", "clock"])
def test_optimizer_state_travels_with_the_row(opt, policy):
    ref = te.TieredEmbeddingBag(N, D, "sum", cache_rows=None, optimizer=opt)
    m = te.TieredEmbeddingBag(N, D, "sum", cache_rows=3, host_rows=5, policy=policy, optimizer=opt)
    batches = random_batches(60, 16, 3, seed=2)
    train(ref, batches, seed=3)
    train(m, batches, seed=3)
    assert m.stats()["host"]["dirty_writebacks"] > 0  # state really went down and back up
    ids = torch.arange(N)
    state = m.read_optimizer_state(ids)
    assert torch.equal(m.read_rows(ids), ref.read_rows(ids))
    assert torch.equal(state, ref.read_optimizer_state(ids))
    touched = torch.zeros(N, dtype=torch.bool)
    touched[torch.tensor(sum(batches, []))] = True
    assert bool((state[touched] != 0).any(1).all())
    assert bool((state[~touched] == 0).all())


# -- saving and restoring ---------------------------------------------------------------------


def test_state_dict_round_trip_into_different_tiers():
    a = te.TieredEmbeddingBag(N, D, "sum", cache_rows=4, host_rows=8, optimizer=te.Adam(lr=0.05), seed=1)
    train(a, random_batches(20, N, 4, seed=4))
    sd = a.state_dict()
    assert set(sd) == {"weight", "optimizer_state", "optimizer_step"}
    assert sd["weight"].shape == (N, D) and sd["optimizer_state"].shape == (N, 2 * D)
    assert int(sd["optimizer_step"]) == 20
    b = te.TieredEmbeddingBag(N, D, "sum", cache_rows=2, policy="clock", optimizer=te.Adam(lr=0.05), seed=9)
    b.load_state_dict(sd)
    ids = torch.arange(N)
    assert torch.equal(b.read_rows(ids), a.read_rows(ids))
    assert torch.equal(b.read_optimizer_state(ids), a.read_optimizer_state(ids))
    assert b.step == a.step
    # Training on from the restored table matches (Adam's bias correction uses the step).
    more = random_batches(5, N, 2, seed=5)
    train(a, more, seed=6)
    train(b, more, seed=6)
    assert torch.equal(b.read_rows(ids), a.read_rows(ids))
    assert torch.equal(b.read_optimizer_state(ids), a.read_optimizer_state(ids))


def test_state_dict_of_the_wrong_shape_is_refused():
    a = te.TieredEmbeddingBag(N, D, "sum", cache_rows=4)
    b = te.TieredEmbeddingBag(N + 1, D, "sum", cache_rows=4)
    rows = b.read_rows(torch.arange(N + 1)).clone()
    with pytest.raises(RuntimeError, match="size mismatch"):
        b.load_state_dict(a.state_dict())
    assert torch.equal(b.read_rows(torch.arange(N + 1)), rows)


def test_export_import_round_trip_in_chunks(tmp_path):
    a = te.TieredEmbeddingBag(N, D, "sum", cache_rows=4, host_rows=8, optimizer=te.Adagrad(lr=0.2))
    batches = random_batches(15, N, 3, seed=7)
    train(a, batches)
    written = sorted(set(sum(batches, [])))
    assert a.export_rows(tmp_path / "exp", chunk_rows=3) == len(written)
    assert len(glob.glob(os.path.join(tmp_path, "exp", "chunk_*.pt"))) == -(-len(written) // 3)
    b = te.TieredEmbeddingBag(N, D, "sum", cache_rows=2, host_rows=3, policy="lfu", optimizer=te.Adagrad(lr=0.2))
    assert b.import_rows(tmp_path / "exp") == len(written)
    ids = torch.arange(N)
    assert torch.equal(b.read_rows(ids), a.read_rows(ids))
    assert torch.equal(b.read_optimizer_state(ids), a.read_optimizer_state(ids))
    assert b.step == a.step == len(batches)
    c = te.TieredEmbeddingBag(N, D + 1, "sum", cache_rows=2, optimizer=te.Adagrad(lr=0.2))
    with pytest.raises(ValueError, match="embedding_dim"):
        c.import_rows(tmp_path / "exp")


@pytest.mark.parametrize("cfg", [dict(cache_rows=None), dict(cache_rows=N), dict(cache_rows=4),
                                 dict(cache_rows=4, host_rows=8)],
                         ids=["all-in-tier0", "cache-rows-N", "tier0+store", "tier0+host+store"])
def test_iter_rows_lists_written_rows_only(cfg):
    m = te.TieredEmbeddingBag(N, D, "sum", optimizer=te.SGD(lr=0.1), **cfg)
    look(m, [5, 6, 7, 8])  # read only
    m.read_rows(torch.arange(N))
    train(m, [[9, 1], [30]])
    m.write_rows(torch.tensor([20]), torch.ones(1, D))
    look(m, [10, 11, 12, 13])  # pushes the written rows down where tiers are small
    chunks = list(m.iter_rows(chunk_rows=2))
    ids = torch.cat([c[0] for c in chunks]).tolist()
    assert ids == [1, 9, 20, 30]
    assert all(len(c[0]) <= 2 for c in chunks)
    w = torch.cat([c[1] for c in chunks])
    assert torch.equal(w, m.read_rows(torch.tensor(ids)))


@pytest.mark.parametrize("damage", ["chunk-missing", "chunk-truncated", "rows-miscounted", "state-width",
                                    "into-a-trained-table"])
def test_an_import_is_checked_whole_before_any_row_is_written(tmp_path, damage):
    """Each was imported part way (a missing chunk silently: its rows left at their initial values;
    a damaged one after the earlier chunks were written), or into a trained table, whose rows the
    export leaves out kept their trained values: a blend of two tables."""
    a = te.TieredEmbeddingBag(N, D, "sum", cache_rows=4, optimizer=te.Adagrad(lr=0.2))
    train(a, random_batches(15, N, 3, seed=7))
    exp = tmp_path / "exp"
    a.export_rows(exp, chunk_rows=3)
    b = te.TieredEmbeddingBag(N, D, "sum", cache_rows=2, optimizer=te.Adagrad(lr=0.2))
    chunk = exp / "chunk_000002.pt"
    if damage == "chunk-missing":
        chunk.unlink()
        match = "chunk_000002.pt is missing"
    elif damage == "chunk-truncated":
        chunk.write_bytes(chunk.read_bytes()[:100])
        match = "chunk_000002.pt: not a readable chunk of an export"
    elif damage == "rows-miscounted":
        meta = json.loads((exp / "meta.json").read_text())
        (exp / "meta.json").write_text(json.dumps({**meta, "rows": meta["rows"] + 1}))
        match = r"its chunks hold \d+ rows, its meta.json says"
    elif damage == "state-width":
        c = torch.load(chunk)
        torch.save({**c, "state": torch.zeros(len(c["ids"]), D + 3)}, chunk)
        match = rf"chunk_000002.pt: a chunk holds ids int64 \[k\], weights \[k, {D}\] and state \[k, {D}\]"
    else:
        train(b, [[N - 1]])
        match = rf"into TieredEmbeddingBag: it has rows written already \(id {N - 1}\)"
    rows, state, step = b.read_rows(torch.arange(N)), b.read_optimizer_state(torch.arange(N)), b.step
    with pytest.raises(ValueError, match=match):
        b.import_rows(exp)
    assert torch.equal(b.read_rows(torch.arange(N)), rows) and b.step == step
    assert torch.equal(b.read_optimizer_state(torch.arange(N)), state)


def test_export_of_a_table_that_was_only_read_is_empty(tmp_path):
    # Serving (forward only) must not turn every row it read into a stored, exported row.
    m = te.TieredEmbeddingBag(N, D, "sum")
    look(m, list(range(N)))
    assert m.export_rows(tmp_path / "exp") == 0


@pytest.mark.parametrize("cache_rows", [None, 10**6])
def test_small_host_tier_under_a_tier0_that_holds_every_row_is_refused(cache_rows):
    """host_rows below tier 0's rows is refused, also where tier 0 holds the whole table (the test had
    a second half, "or the table must work", that no case reached)."""
    with pytest.raises(ValueError, match=rf"host_rows 6 < the {N} rows of tier 0 \(cache_rows={cache_rows}\): the "
                                         "host cache must be at least as large as tier 0"):
        te.TieredEmbeddingBag(N, D, "sum", cache_rows=cache_rows, host_rows=6, optimizer=te.SGD(lr=0.5))


# -- TieredEmbedding ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 3, 4), (5,), (), (0, 3), (1, 1, 1, 2)])
def test_embedding_output_shape(shape):
    m = te.TieredEmbedding(N, D, cache_rows=30, host_rows=32, optimizer=te.SGD(lr=0.1))
    ids = torch.randint(0, N, shape, generator=torch.Generator().manual_seed(0))
    out = m(ids)
    assert out.shape == (*shape, D)
    assert torch.equal(out.reshape(-1, D), m.read_rows(ids.reshape(-1)))


def test_embedding_backward_matches_torch():
    ids = torch.tensor([[[1, 2, 1], [3, 3, 3]], [[0, 1, 5], [2, 2, 7]]])
    m = te.TieredEmbedding(N, D, cache_rows=6, host_rows=8, optimizer=te.SGD(lr=0.5), padding_idx=7)
    ref = torch.nn.Embedding(N, D, padding_idx=7)
    with torch.no_grad():
        ref.weight.copy_(m.read_rows(torch.arange(N)))
    g = torch.randn(*ids.shape, D, generator=torch.Generator().manual_seed(1))
    out = m(ids)
    ref_out = ref(ids)
    assert torch.equal(out, ref_out)
    (out * g).sum().backward()
    (ref_out * g).sum().backward()
    with torch.no_grad():
        expected = ref.weight - 0.5 * ref.weight.grad
    assert torch.allclose(m.read_rows(torch.arange(N)), expected, atol=1e-6)
    assert torch.equal(m.read_rows(torch.tensor([7])), torch.zeros(1, D))


def test_the_host_store_counts_the_rows_it_finds_on_every_read_path():
    """HostStore.read_to into another block (rows copied, the rest drawn), the same deferred (the
    rest marked for a device to draw), and locate (a zero-copy tier 0's read): each counts its ids
    as reads and the ones ever written as found."""
    from tieredemb.tiers.host_store import HostStore
    from tieredemb.tiers.rowstore import RowInit

    init = RowInit(4, 0, 0.0, 1.0, 7, -1)
    store = HostStore(100, 4, init)
    store.write_from(torch.tensor([3, 10, 50]), torch.ones(3, 4), torch.arange(3))
    ids = torch.tensor([3, 4, 10, 99])
    store.read_to(ids, torch.zeros(4, 4), torch.arange(4))
    with init.deferred():
        store.read_to(ids, torch.zeros(4, 4), torch.arange(4))
    assert store.locate(ids).tolist() == [3, -1, 10, -1]
    s = store.stats()
    assert (s["reads"], s["rows_found"], s["rows_written"], s["rows_stored"]) == (12, 6, 3, 3)


def _row_as_flushed(emb, dim):
    emb.flush()
    with emb._store.lock:
        return emb._store.host_store.rows[0, :dim].clone()


@pytest.mark.parametrize("look", [_row_as_flushed, lambda emb, dim: emb.read_rows(torch.tensor([0]))[0],
                                  lambda emb, dim: emb.state_dict()["weight"][0]],
                         ids=["flush", "read_rows", "state_dict"])
def test_rows_copied_beside_training_are_whole(look):
    """flush(), read_rows() or state_dict() on one thread while backward updates a pinned row on
    another (allowed): the copy mixed two updates (a value the row never had) until every copy out
    of tier 0 and the update excluded each other. SGD with lr 1 and a gradient of ones: every
    column of the row always holds the same value. (A race: before the fix, 176 torn rows in 7758
    flushes; 63 in 1606 read_rows.)"""
    dim = 1 << 16
    emb = te.TieredEmbeddingBag(4, dim, mode="sum", cache_rows=2, optimizer=te.SGD(lr=1.0))
    emb.write_rows(torch.arange(4), torch.zeros(4, dim))
    ids, offsets, grad = torch.tensor([0]), torch.tensor([0]), torch.ones(1, dim)
    done = threading.Event()

    def train():
        try:
            for _ in range(3000):
                emb(ids, offsets).backward(grad)
        finally:
            done.set()

    trainer = threading.Thread(target=train)
    trainer.start()
    torn = looks = 0
    while not done.is_set():
        row = look(emb, dim)
        looks += 1
        torn += int(not torch.all(row == row[0]))
    trainer.join()
    assert looks > 20 and torn == 0, (looks, torn)


def _interrupting(original, action):
    """original (a native call), wrapped to run action() once after it returns (where a signal's
    handler or a KeyboardInterrupt lands at the next bytecode: injected, as a signal cannot be
    made to land there every time)."""
    fired = []

    def run(*args, **kwargs):
        out = original(*args, **kwargs)
        if not fired:
            fired.append(1)
            action()
        return out
    return run


def _interrupt():
    raise KeyboardInterrupt


def test_an_interrupt_right_after_a_backwards_update_loses_nothing(monkeypatch):
    """A Ctrl-C landing after the native update and before its rows were marked dirty: the update
    showed in read_rows, and was dropped when the rows left tier 0 (clean). Marked first now."""
    emb = te.TieredEmbeddingBag(N, D, mode="sum", cache_rows=2, optimizer=te.SGD(lr=1.0))
    emb.write_rows(torch.arange(N), torch.zeros(N, D))
    out = emb(torch.tensor([1, 2]), torch.tensor([0]))
    monkeypatch.setattr(te._C, "pool_backward_update", _interrupting(te._C.pool_backward_update, _interrupt))
    with pytest.raises(KeyboardInterrupt):
        out.sum().backward()
    monkeypatch.undo()
    train(emb, [[5, 6]])  # rows 1, 2 evicted
    assert torch.equal(emb.read_rows(torch.tensor([1, 2])), -torch.ones(2, D))


@pytest.mark.parametrize("action", ["interrupt", "flush"])
def test_a_lookup_cut_between_its_row_moves_and_its_commit_changes_no_value(action, monkeypatch):
    """An interrupt, or a signal handler's flush(), between the misses' rows read into the victims'
    slots and the commit: the victims' ids named slots holding other rows (the flush wrote those
    under the victims' ids). Now the victims leave (written down first), and a flush there is
    refused."""
    emb = te.TieredEmbeddingBag(N, D, mode="sum", cache_rows=2, optimizer=te.SGD(lr=1.0))
    emb.write_rows(torch.arange(N), torch.arange(N, dtype=torch.float32)[:, None].expand(N, D))
    train(emb, [[0, 1]])  # rows 0, 1 resident and dirty: -1 each
    want = emb.read_rows(torch.arange(N))
    tier0 = emb._store.tier0
    if action == "interrupt":  # (at the commit's call: the index is native, so a stand-in forwards to it)
        class Index:
            def __getattr__(self, name):
                return getattr(index, name)

            def commit(self, *args):
                raise KeyboardInterrupt

        index = tier0.index
        monkeypatch.setattr(tier0, "index", Index())
    else:
        monkeypatch.setattr(tier0.pool, "fill_from", _interrupting(tier0.pool.fill_from, emb.flush))
    with pytest.raises(KeyboardInterrupt if action == "interrupt" else RuntimeError,
                       match=None if action == "interrupt" else "from inside a lookup of the same table"):
        emb(torch.tensor([2, 3]), torch.tensor([0]))
    monkeypatch.undo()
    assert torch.equal(emb.read_rows(torch.arange(N)), want)
    emb.flush()
    assert torch.equal(emb.read_rows(torch.arange(N)), want)


def test_a_flush_from_inside_a_backwards_update_raises_not_hangs(monkeypatch):
    """A signal handler's flush() while the same thread's backward held tier 0's pool_lock waited for
    itself forever. The package's plain locks now refuse their holder's second take."""
    emb = te.TieredEmbeddingBag(N, D, mode="sum", cache_rows=4, optimizer=te.SGD(lr=1.0))
    out = emb(torch.tensor([1, 2]), torch.tensor([0]))
    monkeypatch.setattr(te._C, "pool_backward_update", _interrupting(te._C.pool_backward_update, emb.flush))
    got = []

    def backward():
        try:
            out.sum().backward()
        except RuntimeError as e:
            got.append(str(e))

    thread = threading.Thread(target=backward, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the flush inside the update waited for itself"
    assert got and "from inside its own update" in got[0]


def test_exit_with_a_prefetch_worker_running_does_not_abort(tmp_path):
    """Interpreter exit with batches registered and the prefetch worker in native code: the worker,
    a daemon thread, was ended inside the call and the process aborted (std::terminate, rc 134; 8
    of 8 runs in the review). Workers are stopped at exit now."""
    code = (
        "import torch, tieredemb as te\n"
        "emb = te.TieredEmbeddingBag(200_000, 64, mode='sum', optimizer=te.RowWiseAdagrad(lr=0.1), cache_rows=32)\n"
        "g = torch.Generator().manual_seed(0)\n"
        "for _ in range(8):\n"
        "    emb.prefetch(torch.randint(0, 200_000, (4096,), generator=g), torch.arange(0, 4096, 16))\n")
    # ... and in a forked child that made its own (its parent imported the package before the fork)
    forked = ("import os, sys, tieredemb.prefetch\n"
              "pid = os.fork()\n"
              "if pid:\n"
              "    sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n" + code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for program in (code, code, forked, forked):
        child = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120)
        assert child.returncode == 0, (child.returncode, child.stderr[-2000:])


def test_an_interrupt_while_the_prefetch_worker_starts_leaves_the_table_usable(monkeypatch):
    """An interrupt inside the worker thread's start() (injected there: a signal cannot be made to
    land in it) left a thread never started, which shutdown() then joined: RuntimeError, and the
    table's prefetcher wedged (later epochs refused, plain training hung)."""
    emb = te.TieredEmbeddingBag(N, D, mode="sum", cache_rows=8, optimizer=te.SGD(lr=0.1))
    start = threading.Thread.start

    def interrupted(thread):
        if thread.name == "tieredemb-prefetch":
            raise KeyboardInterrupt
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", interrupted)
    with pytest.raises(KeyboardInterrupt):
        emb.prefetch(torch.tensor([1, 2]), ONE_BAG)
    monkeypatch.undo()
    emb._prefetch.shutdown()  # (what a loader's cleanup does)
    train(emb, [[1, 2], [3, 4]])
    assert emb._store.tier0.index.pinned == 0


def test_an_interrupt_as_a_lookups_commit_returns_stays_an_interrupt(monkeypatch):
    """A SIGINT during the native commit is raised as it returns: the failure path then evicted the
    committed plan, which the index refused as stale, and that RuntimeError replaced the
    KeyboardInterrupt (a save-on-Ctrl-C `except KeyboardInterrupt` missed it); the batch's pins
    were never undone. Injected after the real commit (a signal cannot be made to land there)."""
    emb = te.TieredEmbeddingBag(N, D, mode="sum", cache_rows=2, optimizer=te.SGD(lr=1.0))
    train(emb, [[0, 1]])
    want = emb.read_rows(torch.arange(N))
    tier0 = emb._store.tier0
    index = tier0.index

    class Index:
        def __getattr__(self, name):
            return getattr(index, name)

        def commit(self, *args):
            index.commit(*args)
            raise KeyboardInterrupt

    monkeypatch.setattr(tier0, "index", Index())
    with pytest.raises(KeyboardInterrupt):
        emb(torch.tensor([2, 3]), ONE_BAG)
    monkeypatch.undo()
    assert index.pinned == 0
    assert torch.equal(emb.read_rows(torch.arange(N)), want)


def test_store_counts_a_found_row_zero():
    """Mutant h3 (host_store.py locate: found > 0): row 0 stored in slot 0 counted as not found;
    stats()["store"]["rows_found"] is a documented counter (metrics.py exports it)."""
    emb = te.TieredEmbeddingBag(100, 4, mode="sum", cache_rows=2, optimizer=te.SGD(lr=0.1))
    one = torch.tensor([0])
    emb(torch.tensor([0, 1]), one).sum().backward()  # rows 0, 1 written in tier 0
    emb(torch.tensor([2, 3]), one).sum().backward()  # 0, 1 evicted: written down
    emb.reset_stats()
    with torch.no_grad():
        emb(torch.tensor([0, 1]), one)  # both read back from the store, both stored
    s = emb.stats()["store"]
    assert (s["reads"], s["rows_found"]) == (2, 2)


def test_an_import_refuses_an_id_equal_to_the_tables_rows_before_writing_any_row(tmp_path):
    """Mutant r5 (persistence.py check_chunks: max id <= rows accepted). The damage cases of
    test_an_import_is_checked_whole_before_any_row_is_written have no id out of range; at the
    bound, the import wrote the earlier chunks and then failed in write_rows (IndexError): a
    blend of two tables, which that check exists to prevent."""
    n, d = 40, 4
    a = te.TieredEmbeddingBag(n, d, "sum", cache_rows=4, optimizer=te.Adagrad(lr=0.2))
    for ids in ([1, 9, 20], [30, 39, 5], [12, 13, 14]):
        a(torch.tensor(ids), torch.tensor([0])).sum().backward()
    exp = tmp_path / "exp"
    a.export_rows(exp, chunk_rows=3)
    chunks = sorted(exp.glob("chunk_*.pt"))
    last = torch.load(chunks[-1])
    last["ids"][-1] = n  # one past the last row
    torch.save(last, chunks[-1])
    b = te.TieredEmbeddingBag(n, d, "sum", cache_rows=2, optimizer=te.Adagrad(lr=0.2))
    before = b.read_rows(torch.arange(n))
    with pytest.raises(ValueError, match=rf"ids must lie in \[0, {n}\)"):
        b.import_rows(exp)
    assert torch.equal(b.read_rows(torch.arange(n)), before)
