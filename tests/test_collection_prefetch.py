"""Prefetch for a collection: PrefetchLoader (or prefetch() by hand) makes every group's rows of the
next batches resident ahead of their forward; training gives bit for bit what it gives without
prefetch, over a small tier 0, host caches and SSD, pooled and unpooled; a prefetched batch's forward
given the same tensors is not checked again; errors leave every group's prefetcher agreeing."""

from __future__ import annotations

import pytest
import torch

import tieredemb
from tieredemb import (EmbeddingBagConfig, EmbeddingConfig, PrefetchLoader, TieredEmbeddingBagCollection,
                       TieredEmbeddingCollection)
from tieredemb.prefetch import PrefetchOrderError
from training import KJT

# a and b share a group; c is a group of its own
TABLES = [EmbeddingBagConfig("a", 400, 8, ["fa", "fa2"]), EmbeddingBagConfig("b", 300, 8, ["fb"]),
          EmbeddingBagConfig("c", 200, 4, ["fc"], pooling="mean")]
B = 6


def batch(seed, tables=TABLES, kjt=False):
    g = torch.Generator().manual_seed(seed)
    keys, values, lengths = [], [], []
    for t in tables:
        for f in t.feature_names:
            n = torch.randint(1, 5, (B,), generator=g)
            keys.append(f)
            values.append(torch.randint(0, t.num_embeddings, (int(n.sum()),), generator=g))
            lengths.append(n)
    if kjt:
        return KJT(keys, torch.cat(values), torch.cat(lengths))
    return {f: (v, torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)[:-1]]))
            for f, v, n in zip(keys, values, lengths)}


def make(tables=TABLES, cls=TieredEmbeddingBagCollection, **kw):
    kw.setdefault("optimizer", tieredemb.Adagrad(lr=0.1))
    kw.setdefault("cache_bytes", 2500)  # about 10 % of the rows: evictions every batch
    return cls(tables, **kw)


def step(ebc, features, seed):
    out = ebc(features)
    values = out.values() if hasattr(out, "values") and callable(out.values) and not isinstance(out, dict) else \
        torch.cat([out[f].values().reshape(-1) for f in out])
    values.backward(torch.randn(values.shape, generator=torch.Generator().manual_seed(500 + seed)))
    return values.detach()


def rows(ebc, tables=TABLES):
    return [ebc.read_rows(t.name, torch.arange(t.num_embeddings)) for t in tables] + \
        [ebc.read_optimizer_state(t.name, torch.arange(t.num_embeddings)) for t in tables]


@pytest.mark.parametrize("tiers", [dict(), dict(host_bytes=12000), dict(ssd=True)], ids=["host", "host-cache", "ssd"])
@pytest.mark.parametrize("kjt", [False, True], ids=["dict", "kjt"])
def test_prefetched_training_equals_training_without_it(tiers, kjt, tmp_path):
    tiers = dict(tiers)
    if tiers.pop("ssd", False):
        tiers["ssd_path"] = tmp_path / "ssd"
    plain, fetched = make(**tiers), make(**{k: (v / "p" if k == "ssd_path" else v) for k, v in tiers.items()})
    batches = [(batch(s, kjt=kjt), s) for s in range(12)]
    want = [step(plain, f, s) for f, s in batches]
    with PrefetchLoader(batches, [fetched], depth=2) as loader:
        got = [step(fetched, f, s) for f, s in loader]
    for x, y in zip(want, got):
        assert torch.equal(x, y)
    for x, y in zip(rows(plain), rows(fetched)):
        assert torch.equal(x, y)
    for e in fetched.engines:
        s = e.stats()["prefetch"]
        assert s["registered"] == 12 and s["forwards"] == 12 and s["demand_misses"] == 0
        assert s["prefetched_rows"] + s["late_rows"] > 0
    assert not fetched._ahead and all(not e._prefetch.queue for e in fetched.engines)
    plain.close()
    fetched.close()


def test_unpooled_collection_prefetches_too():
    tables = [EmbeddingConfig("u", 300, 8, ["fu", "fu2"]), EmbeddingConfig("v", 100, 4, ["fv"])]
    plain, fetched = make(tables, TieredEmbeddingCollection), make(tables, TieredEmbeddingCollection)
    batches = [batch(s, tables) for s in range(8)]
    want = [step(plain, f, s) for s, f in enumerate(batches)]
    got = [step(fetched, f, s) for s, f in enumerate(PrefetchLoader(batches, [fetched], depth=2))]
    assert all(torch.equal(x, y) for x, y in zip(want, got))
    assert all(torch.equal(x, y) for x, y in zip(rows(plain, tables), rows(fetched, tables)))
    assert all(e.stats()["prefetch"]["demand_misses"] == 0 for e in fetched.engines)


def test_a_prefetched_batch_is_checked_once_unless_other_tensors_are_given(monkeypatch):
    ebc = make()
    prepared = []
    prepare = ebc._prepare
    monkeypatch.setattr(ebc, "_prepare", lambda f: (prepared.append(1), prepare(f))[1])
    first, second = batch(0), batch(1)
    ebc.prefetch(first)
    ebc.prefetch(second)
    assert len(prepared) == 2
    step(ebc, first, 0)  # the very tensors: as prepared at prefetch
    assert len(prepared) == 2
    copy = {f: tuple(t.clone() for t in v) for f, v in second.items()}
    step(ebc, copy, 1)  # equal values, other tensors: checked and compared again
    assert len(prepared) == 3 and not ebc._ahead
    ebc.prefetch(first)
    # changed after prefetch, in the second group (c): the first group takes its batch, the second
    # finds another one
    first["fc"][0][0] = (first["fc"][0][0] + 1) % 200
    with pytest.raises(PrefetchOrderError):
        ebc(first)
    # the error forgot every group's prefetched batches: the groups agree, and go on without them
    assert not ebc._ahead and all(not e._prefetch.queue for e in ebc.engines)
    step(ebc, first, 2)
    twin = make()  # the same batches, never prefetched
    for s, features in enumerate([batch(0), batch(1), first]):
        step(twin, features, s)
    assert all(torch.equal(x, y) for x, y in zip(rows(ebc), rows(twin)))


def test_prefetch_under_inference_mode():
    ebc = make()
    with torch.inference_mode():
        batches = [batch(s) for s in range(3)]
        outs = [ebc(f).values() for f in PrefetchLoader(batches, [ebc], depth=2)]
    plain = make()
    with torch.no_grad():
        assert all(torch.equal(x, plain(f).values()) for x, f in zip(outs, batches))
    ebc.prefetch(batches[0])  # inference tensors prefetched outside inference mode: compared, not recognized
    assert torch.equal(ebc(batches[0]).values().detach(), outs[0])
    assert not ebc._ahead and all(not e._prefetch.queue for e in ebc.engines)


def test_bad_features_at_prefetch_change_nothing():
    ebc = make()
    bad = batch(0)
    bad["fc"] = (torch.tensor([0, 200]), torch.tensor([0, 1, 1, 1, 1, 2]))  # table c has 200 rows
    with pytest.raises(IndexError, match=r"feature 'fc': id 200 out of range \[0, 200\) of table 'c'"):
        ebc.prefetch(bad)
    assert not ebc._ahead and all(not e._prefetch.queue for e in ebc.engines)
    assert all(e.stats()["prefetch"]["registered"] == 0 for e in ebc.engines)


def test_loader_batches_for_a_collection():
    ebc = make()
    labelled = [(batch(s), torch.ones(B)) for s in range(3)]  # (features, label): no ids_fn needed
    for s, (features, label) in enumerate(PrefetchLoader(labelled, [ebc], depth=1)):
        step(ebc, features, s)
    assert all(e.stats()["prefetch"]["registered"] == 3 for e in ebc.engines)
    with pytest.raises(TypeError, match=r"a batch for a collection must be its features .* got list"):
        list(PrefetchLoader([[torch.arange(3)]], [ebc]))
    other = make()  # two modules: ids_fn says which features each takes
    pairs = [(batch(s), batch(s + 10)) for s in range(3)]
    loader = PrefetchLoader(pairs, [ebc, other], depth=2, ids_fn=lambda p: {ebc: p[0], other: p[1]})
    for s, (x, y) in enumerate(loader):
        step(ebc, x, s)
        step(other, y, s)
    assert all(e.stats()["prefetch"]["demand_misses"] == 0 for e in other.engines)


@pytest.mark.interpreted
def test_prefetch_on_the_device_path_equals_no_prefetch():
    """Groups whose tier 0 are device tiers (Triton kernels, run on CPU tensors here): the loader's
    batches are made resident on each tier's own path, and train as the same batches unprefetched."""
    from tieredemb.gpu.tier import collection_on_cpu_tensors

    kw = dict(optimizer=tieredemb.RowWiseAdagrad(lr=0.1), cache_bytes=2500)
    plain = collection_on_cpu_tensors(TieredEmbeddingBagCollection(TABLES, **kw))
    fetched = collection_on_cpu_tensors(TieredEmbeddingBagCollection(TABLES, **kw))
    batches = [batch(s, kjt=True) for s in range(4)]  # (the interpreter's time: as few as show it)
    want = [step(plain, f, s) for s, f in enumerate(batches)]
    got = [step(fetched, f, s) for s, f in enumerate(PrefetchLoader(batches, [fetched], depth=1))]
    assert all(torch.equal(x, y) for x, y in zip(want, got))
    assert all(torch.equal(x, y) for x, y in zip(rows(plain), rows(fetched)))
    assert all(e.stats()["prefetch"]["demand_misses"] == 0 for e in fetched.engines)


def test_a_single_tables_ids_fn_may_give_a_list():
    emb = tieredemb.TieredEmbeddingBag(50, 4, "sum", optimizer=tieredemb.SGD(lr=0.1))
    batches = [[torch.arange(3) + s, torch.tensor([0, 2])] for s in range(3)]
    for ids, offsets in PrefetchLoader(batches, [emb], depth=1, ids_fn=lambda b: {emb: list(b)}):
        emb(ids, offsets).sum().backward()
    assert emb.stats()["prefetch"]["registered"] == 3 and emb.stats()["prefetch"]["demand_misses"] == 0


def test_weights_that_need_their_gradient_get_it_whatever_mode_prefetch_ran_in():
    tables = [EmbeddingBagConfig("a", 100, 4, ["fa"]), EmbeddingBagConfig("b", 50, 4, ["fb"])]
    plain, fetched = make(tables), make(tables)
    features = batch(3, tables)
    grads = []
    for ebc, ahead in ((plain, False), (fetched, True)):
        weighted = {f: (ids, off, torch.linspace(0.5, 1.5, len(ids)).requires_grad_(True))
                    for f, (ids, off) in features.items()}
        if ahead:
            with torch.no_grad():  # (a loader may register batches under no_grad)
                ebc.prefetch(weighted)
        out = ebc(weighted).values()
        out.backward(torch.ones_like(out))
        grads.append([weighted[f][2].grad for f in weighted])
    assert all(g is not None for g in grads[1])
    assert all(torch.equal(x, y) for x, y in zip(*grads))
