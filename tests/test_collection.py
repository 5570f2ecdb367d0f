"""TieredEmbeddingBagCollection: many tables under one budget, read by features of a
KeyedJaggedTensor or a dict; tables of one kind looked up together; equal to a dict of
torch.nn.EmbeddingBag (and to torchrec's EmbeddingBagCollection where it imports), forward and
training; inverse-keyed batches equal the same batch with its duplicates."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import tieredemb
from tieredemb import EmbeddingBagConfig, InverseKeyed, TieredEmbeddingBagCollection
from training import KJT

TABLES = [EmbeddingBagConfig("user", 300, 8, ["user_id", "friend_id"]),
          EmbeddingBagConfig("item", 200, 8, ["item_id"], pooling="mean"),
          EmbeddingBagConfig("cat", 50, 4, ["category"])]
B = 6


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for t in TABLES:
        for f in t.feature_names:
            lengths = torch.randint(0, 5, (B,), generator=g)
            ids = torch.randint(0, t.num_embeddings, (int(lengths.sum()),), generator=g)
            out[f] = (ids, torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]]), lengths)
    return out


def as_kjt(b):
    keys = [f for t in TABLES for f in t.feature_names]
    return KJT(keys, torch.cat([b[f][0] for f in keys]), torch.cat([b[f][2] for f in keys]))


def reference(opt_factory, ebc):
    """A dict of torch.nn.EmbeddingBag holding the collection's rows, and its optimizers."""
    refs = {t.name: torch.nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode=t.pooling,
                                          _weight=ebc.read_rows(t.name, torch.arange(t.num_embeddings)).clone())
            for t in TABLES}
    return refs, [opt_factory(m.parameters()) for m in refs.values()]


def backward_both(out, want, grad, opts):
    """Our pooled output's backward and the reference's, with one gradient; then the
    reference's optimizers step (ours stepped in backward)."""
    out.values().backward(grad)
    want.backward(grad)
    for o in opts:
        o.step()
        o.zero_grad()


def ref_forward(refs, b):
    table_of = {f: t for t in TABLES for f in t.feature_names}
    return torch.cat([refs[table_of[f].name](b[f][0], b[f][1]) for t in TABLES for f in t.feature_names], 1)


@pytest.mark.parametrize("tiers", [dict(), dict(cache_bytes=4000), dict(cache_bytes=3000, host_bytes=8000)],
                         ids=["whole", "cached", "host"])
@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
def test_trains_as_a_dict_of_embedding_bags(tiers, kind, kernels):
    ours_opt = {"sgd": tieredemb.SGD(lr=0.1), "adagrad": tieredemb.Adagrad(lr=0.1, eps=1e-10)}[kind]
    ref_opt = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1),
               "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-10)}[kind]
    ebc = TieredEmbeddingBagCollection(TABLES, optimizer=ours_opt, **tiers)
    refs, opts = reference(ref_opt, ebc)
    for step in range(6):
        b = batch(step)
        out = ebc(as_kjt(b) if step % 2 else {f: v[:2] for f, v in b.items()})
        want = ref_forward(refs, b)
        torch.testing.assert_close(out.values(), want, rtol=1e-5, atol=1e-6)
        backward_both(out, want, torch.randn(out.values().shape, generator=torch.Generator().manual_seed(step)), opts)
    for t in TABLES:
        torch.testing.assert_close(ebc.read_rows(t.name, torch.arange(t.num_embeddings)), refs[t.name].weight.detach(),
                                   rtol=1e-5, atol=1e-6)


def test_tables_of_one_kind_are_one_lookup(monkeypatch):
    ebc = TieredEmbeddingBagCollection(TABLES, optimizer=tieredemb.SGD(lr=0.1))
    assert [[t.name for t in g.tables] for g in ebc.groups] == [["user"], ["item"], ["cat"]]  # pooling, dim differ
    same = [EmbeddingBagConfig(f"t{k}", 100 + k, 8, [f"f{k}"]) for k in range(4)]
    ebc = TieredEmbeddingBagCollection(same, optimizer=tieredemb.SGD(lr=0.1), cache_bytes=10_000)
    assert len(ebc.engines) == 1 and ebc.engines[0].num_embeddings == sum(100 + k for k in range(4))
    calls = []

    def counted(name, fn):
        return lambda *a, **k: (calls.append(name), fn(*a, **k))[1]

    monkeypatch.setattr(tieredemb.kernels, "forward", counted("forward", tieredemb.kernels.forward))
    monkeypatch.setattr(tieredemb.kernels, "backward_update", counted("backward", tieredemb.kernels.backward_update))
    take, seen = ebc.engines[0]._prefetch.take, []
    monkeypatch.setattr(ebc.engines[0]._prefetch, "take", counted("take", lambda *a: (seen.append(a[2]), take(*a))[1]))
    out = ebc({f"f{k}": (torch.tensor([k, 99]), torch.tensor([0, 1])) for k in range(4)})
    assert calls == ["take", "forward"] and out.values().shape == (2, 32)  # one residency pass, one kernel
    starts, row_ends = seen[0]  # each table's ids a run of its own rows: deduplicated run by run
    assert starts.tolist() == [0, 2, 4, 6, 8] and row_ends.tolist() == [100, 201, 303, 406]
    assert torch.equal(out["f3"][1], ebc.read_rows("t3", torch.tensor([99]))[0])
    out.values().sum().backward()
    assert calls == ["take", "forward", "backward"]


def test_budget_is_split_in_proportion_to_bytes_and_each_table_keeps_its_share():
    tables = [EmbeddingBagConfig("a", 1000, 8, ["fa"]), EmbeddingBagConfig("b", 3000, 8, ["fb"]),
              EmbeddingBagConfig("c", 500, 16, ["fc"])]
    row = {8: 32, 16: 64}  # bytes of a stored row (SGD: weights only)
    budget = sum(t.num_embeddings * row[t.embedding_dim] for t in tables) // 10
    ebc = TieredEmbeddingBagCollection(tables, optimizer=tieredemb.SGD(lr=0.1), cache_bytes=budget)
    assert [e.config.partitions for e in ebc.engines] == [((1000, 100), (3000, 300)), ((500, 50),)]
    # a stream of table b's ids alone evicts none of table a's rows
    one = torch.tensor([0])  # one bag per feature
    ebc({"fa": (torch.arange(100), one), "fb": (torch.tensor([0]), one),
         "fc": (torch.tensor([0]), one)})
    for k in range(6):
        ebc({"fa": (torch.tensor([0]), one), "fb": (torch.arange(300) + 300 * k, one), "fc": (torch.tensor([0]), one)})
    s = ebc.stats()["tables"]
    assert s["a"]["tier0"]["resident"] == 100 and s["a"]["tier0"]["evictions"] == 0
    assert s["a"]["tier0"]["hits"] == 6 and s["a"]["lookups"] == 106
    assert s["b"]["tier0"]["capacity"] == 300 and s["b"]["tier0"]["evictions"] >= 5 * 300 - 1
    assert s["c"]["group"] == "group1" and s["c"]["tier0"]["capacity"] == 50
    ebc.reset_stats()  # a window of its own from here
    ebc({"fa": (torch.tensor([0, 1]), one), "fb": (torch.tensor([0]), one), "fc": (torch.tensor([0]), one)})
    s = ebc.stats()["tables"]
    assert s["a"]["lookups"] == 2 and s["a"]["tier0"]["hits"] == 2 and s["a"]["tier0"]["misses"] == 0
    assert s["b"]["tier0"]["hits"] + s["b"]["tier0"]["misses"] == 1 and s["b"]["tier0"]["evictions"] <= 1
    assert ebc.stats()["groups"]["group0"]["tier0"]["hits"] + ebc.stats()["groups"]["group0"]["tier0"]["misses"] == 3
    # padded rows (row_alignment 128: 8 and 16 words become 32) count as what they take: the same budget, fewer rows
    padded = TieredEmbeddingBagCollection(tables, optimizer=tieredemb.SGD(lr=0.1), cache_bytes=budget,
                                          row_alignment=128)
    parts = [e.config.partitions for e in padded.engines]
    assert parts == [((1000, 27), (3000, 83)), ((500, 13),)] and [e.width for e in padded.engines] == [32, 32]
    assert sum(c * 128 for p in parts for _, c in p) <= budget


@pytest.mark.parametrize("keyed", ["all", "friend_id"])  # friend_id alone: user_id's bags share its lookup
def test_inverse_keyed_batches_equal_their_duplicates(keyed, kernels):
    kw = dict(optimizer=tieredemb.Adagrad(lr=0.1))
    a, b = TieredEmbeddingBagCollection(TABLES, **kw), TieredEmbeddingBagCollection(TABLES, **kw)
    full = batch(3)
    distinct = {f: (v[0], v[1]) for f, v in full.items()}
    inverse = torch.tensor([0, 2, 2, 0, 1, 5])  # samples repeat bags
    dup = {}
    for f, (ids, starts, lengths) in full.items():
        bags = [ids[s:s + n] for s, n in zip(starts.tolist(), lengths.tolist())]
        chosen = [bags[i] for i in inverse.tolist()]
        dup[f] = (torch.cat(chosen), torch.tensor([0] + [len(c) for c in chosen[:-1]]).cumsum(0))
    ikjt = {f: InverseKeyed(ids, starts, inverse) if keyed in ("all", f) else dup[f]
            for f, (ids, starts) in distinct.items()}
    out_a, out_b = a(ikjt), b(dup)
    torch.testing.assert_close(out_a.values(), out_b.values())
    grad = torch.randn(out_a.values().shape)
    out_a.values().backward(grad)
    out_b.values().backward(grad)
    for t in TABLES:
        ids = torch.arange(t.num_embeddings)
        torch.testing.assert_close(a.read_rows(t.name, ids), b.read_rows(t.name, ids), rtol=1e-5, atol=1e-6)


def test_an_inverse_refilled_before_backward_trains_the_bags_its_forward_took():
    """A loader may refill its inverse tensor for the next batch before this one's backward; the
    backward's gradient goes to the bags the forward pooled (torch's own index_select refuses such
    a backward; the collection keeps a copy of the inverse), for the pooled and the unpooled
    collection."""
    ids, starts = torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2])  # distinct bags [1], [2], [3]
    pooled = (lambda: TieredEmbeddingBagCollection([EmbeddingBagConfig("t", 30, 4, ["f"])],
                                                   optimizer=tieredemb.SGD(lr=1.0)), lambda out: out.values())
    unpooled = (lambda: tieredemb.TieredEmbeddingCollection([tieredemb.EmbeddingConfig("t", 30, 4, ["f"])],
                                                            optimizer=tieredemb.SGD(lr=1.0)),
                lambda out: out["f"].values())
    for make, values in (pooled, unpooled):
        refilled, kept, fresh = make(), make(), make()
        inverse = torch.tensor([0, 0, 1])
        out = refilled({"f": InverseKeyed(ids, starts, inverse)})
        inverse[:] = 2
        values(out).sum().backward()
        values(kept({"f": InverseKeyed(ids, starts, torch.tensor([0, 0, 1]))})).sum().backward()
        rows = torch.tensor([1, 2, 3])
        assert torch.equal(refilled.read_rows("t", rows), kept.read_rows("t", rows))
        assert not torch.equal(kept.read_rows("t", rows), fresh.read_rows("t", rows))


def test_equal_to_torchrec_where_it_imports():
    torchrec = pytest.importorskip("torchrec")
    ebc = TieredEmbeddingBagCollection(TABLES, optimizer=tieredemb.SGD(lr=0.1))
    peer = torchrec.EmbeddingBagCollection(tables=[torchrec.EmbeddingBagConfig(
        name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_embeddings, feature_names=list(t.feature_names),
        pooling=torchrec.PoolingType.SUM if t.pooling == "sum" else torchrec.PoolingType.MEAN) for t in TABLES])
    for t in TABLES:
        peer.embedding_bags[t.name].weight.data.copy_(ebc.read_rows(t.name, torch.arange(t.num_embeddings)))
    b = batch(7)
    keys = [f for t in TABLES for f in t.feature_names]
    kjt = torchrec.KeyedJaggedTensor(keys=keys, values=torch.cat([b[f][0] for f in keys]),
                                     lengths=torch.cat([b[f][2] for f in keys]))
    ours, theirs = ebc(kjt), peer(kjt)
    assert isinstance(ours, torchrec.KeyedTensor) and ours.keys() == theirs.keys()
    torch.testing.assert_close(ours.values(), theirs.values(), rtol=1e-5, atol=1e-6)


def test_bad_collections_and_inputs():
    with pytest.raises(ValueError, match=r"table names must be unique"):
        TieredEmbeddingBagCollection([TABLES[0], TABLES[0]])
    for name in ("../up", "a/b", ".."):  # (an export writes directory/<table name>)
        with pytest.raises(ValueError, match=f"table name {name!r}: a table's name names its directory"):
            EmbeddingBagConfig(name, 5, 8, ["f"])
    with pytest.raises(ValueError, match=r"features \['user_id'\] appear in several"):
        TieredEmbeddingBagCollection([TABLES[0], EmbeddingBagConfig("x", 5, 8, ["user_id"])])
    ebc = TieredEmbeddingBagCollection(TABLES, optimizer=tieredemb.SGD(lr=0.1))
    b = {f: v[:2] for f, v in batch(0).items()}
    with pytest.raises(ValueError, match=r"missing \['category'\]"):
        ebc({f: v for f, v in b.items() if f != "category"})
    with pytest.raises(ValueError, match=r"give a plan or cache_bytes / host_bytes, not both"):
        TieredEmbeddingBagCollection(TABLES, cache_bytes=100, plan={"tables": []})
    plan = {"tables": [{"name": t.name, "rows": t.num_embeddings, "cache_rows": 10, "store": "ssd"} for t in TABLES]}
    with pytest.raises(ValueError, match=r"the plan stores table 'user' on SSD: give ssd_path"):
        TieredEmbeddingBagCollection(TABLES, plan=plan)
    with pytest.raises(ValueError, match=r"the plan is for tables \['cat', 'item', 'user'\], this collection has \['user'\]"):
        TieredEmbeddingBagCollection(TABLES[:1], plan=plan)
    b["category"] = (torch.tensor([50, 0, 0, 0, 0, 0]), torch.arange(B))
    with pytest.raises(IndexError, match=r"feature 'category': id 50 out of range \[0, 50\) of table 'cat'"):
        ebc(b)


def _state(ebc):
    return {t.name: (ebc.read_rows(t.name, torch.arange(t.num_embeddings)).clone(),
                     ebc.read_optimizer_state(t.name, torch.arange(t.num_embeddings)).clone()) for t in TABLES}


def test_a_plan_for_other_rows_or_not_a_plan_is_refused(tmp_path):
    """A plan sized for smaller rows (another dim, optimizer or dtype) was taken as it was: tier 0 went
    1.7x past its budget. A file that is not a plan raised JSONDecodeError or KeyError."""
    plan = {"tables": [{"name": t.name, "rows": t.num_embeddings, "cache_rows": 10, "store": "host",
                        "row_bytes": 4 * t.embedding_dim} for t in TABLES]}  # (no optimizer state priced)
    with pytest.raises(ValueError, match=r"the plan's table '\w+' has rows of \d+ bytes, this one's take \d+ "
                                         r"\(weights, optimizer state, padding\)"):
        TieredEmbeddingBagCollection(TABLES, plan=plan, optimizer=tieredemb.Adam(lr=0.1))
    big = {"tables": [{**t, "row_bytes": 4096} for t in plan["tables"]]}
    TieredEmbeddingBagCollection(TABLES, plan=big, optimizer=tieredemb.Adam(lr=0.1))  # (within it: taken)
    bad = tmp_path / "plan.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=f"plan file {bad}: not a plan .*JSONDecodeError"):
        TieredEmbeddingBagCollection(TABLES, plan=bad)
    bad.write_text('{"proportional": {}}')
    with pytest.raises(ValueError, match=r"not a plan .*KeyError: 'planned'"):
        TieredEmbeddingBagCollection(TABLES, plan=str(bad))
    with pytest.raises(ValueError, match=r"plan: not a plan .*KeyError: 'tables'"):
        TieredEmbeddingBagCollection(TABLES, plan={"planned": plan})


@pytest.mark.parametrize("tiers", [dict(), dict(cache_bytes=3000)], ids=["whole", "cached"])
def test_a_bad_feature_fails_before_any_table_is_looked_up(tiers):
    """Every feature is checked before the first group's lookup: a bad feature in a later group,
    or features of different batch sizes, change no rows, no counters, no tier."""
    ebc = TieredEmbeddingBagCollection(TABLES, optimizer=tieredemb.Adagrad(lr=0.1), is_weighted=True, **tiers)
    good = {f: v[:2] for f, v in batch(0).items()}
    ebc(good).values().sum().backward()
    before = _state(ebc)
    stats = ebc.stats()
    bad_inputs = [
        ({**good, "category": (torch.tensor([50] * B), torch.arange(B))}, IndexError,
         r"feature 'category': id 50 out of range \[0, 50\) of table 'cat'"),
        ({**good, "category": (torch.tensor([-1] * B), torch.arange(B))}, IndexError, r"feature 'category': id -1"),
        ({**good, "category": (torch.arange(3), torch.tensor([0, 1, 2]))}, ValueError,
         r"different batch sizes .*'category': 3"),
        ({**good, "item_id": (torch.arange(6), torch.tensor([1, 2, 3, 4, 5, 5]))}, ValueError,
         r"feature 'item_id': offsets\[0\] must be 0 .*got 1"),
        ({**good, "item_id": (torch.arange(6), torch.tensor([0, 2, 1, 4, 5, 5]))}, ValueError,
         r"feature 'item_id': offsets must be non-decreasing: offsets\[2\] = 1"),
        ({**good, "item_id": (torch.arange(6), torch.tensor([0, 2, 3, 4, 5, 7]))}, ValueError,
         r"feature 'item_id': offsets\[-1\] = 7 is past the end of input \(length 6\)"),
        ({**good, "item_id": (torch.arange(6.0), torch.arange(B))}, TypeError,
         r"feature 'item_id': ids must be an integer tensor, got torch.float32"),
        ({**good, "item_id": (torch.arange(6), torch.arange(B), torch.ones(5))}, ValueError,
         r"feature 'item_id': per_sample_weights must be a tensor of its ids' shape \(6,\)"),
        ({**good, "category": InverseKeyed(torch.arange(3), torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2, 2, 1, 3]))},
         ValueError, r"feature 'category': inverse 3 out of range \[0, 3\)"),
        ({**good, "category": InverseKeyed(torch.arange(3), torch.tensor([0, 1, 2]), torch.tensor([0, 1, -1, 2, 1, 0]))},
         ValueError, r"feature 'category': inverse -1 out of range"),
        ({**good, "category": InverseKeyed(torch.arange(3), torch.tensor([0, 1, 2]), torch.zeros(6, dtype=torch.bool))},
         TypeError, r"feature 'category': inverse must be a 1-D integer tensor, got torch.bool"),
        ({**good, "category": InverseKeyed(torch.arange(3), torch.tensor([0, 1, 2]), torch.zeros(2, 3, dtype=torch.int64))},
         TypeError, r"feature 'category': inverse must be a 1-D integer tensor, got torch.int64 \(2, 3\)"),
        ({**good, "category": [torch.arange(3)]}, TypeError, r"feature 'category': give \(ids, offsets"),
        ({**good, "item_id": (torch.arange(6), torch.arange(B), torch.ones(6))}, ValueError,
         r"feature 'item_id': per_sample_weights need pooling 'sum', its table pools by 'mean'"),
        ({**good, "category": (torch.arange(B), torch.arange(B), torch.ones(B, dtype=torch.int64))}, TypeError,
         r"feature 'category': per_sample_weights must be a floating point tensor, got torch.int64"),
        (KJT(["user_id"], torch.arange(4), torch.tensor([1, 1, 1])), ValueError,
         r"KeyedJaggedTensor: lengths sum to 3, values\(\) has 4"),
        (KJT(["user_id"], torch.arange(2), torch.tensor([3, -1])), ValueError,
         r"KeyedJaggedTensor: lengths must be >= 0, got -1"),
        (KJT(["user_id", "item_id"], torch.arange(3), torch.tensor([1, 1, 1])), ValueError,
         r"3 lengths do not split into 2 keys' batches"),
        ([1, 2], TypeError, r"features must be a KeyedJaggedTensor or a dict"),
        (KJT(list(good), torch.cat([good[f][0] for f in good]),
             torch.cat([torch.diff(good[f][1], append=torch.tensor([len(good[f][0])])) for f in good]),
             torch.ones(2)), ValueError, r"KeyedJaggedTensor: weights must be a tensor of values\(\)' shape"),
    ]
    for features, error, message in bad_inputs:
        with pytest.raises(error, match=message):
            ebc(features)
    assert ebc.stats() == stats  # (before reading rows back, which the stores count)
    after = _state(ebc)
    assert all(torch.equal(before[t][0], after[t][0]) and torch.equal(before[t][1], after[t][1]) for t in before)


def test_rows_and_state_are_read_and_written_within_their_table():
    ebc = TieredEmbeddingBagCollection(TABLES, optimizer=tieredemb.Adagrad(lr=0.1))
    before = _state(ebc)
    for call in (lambda: ebc.read_rows("item", torch.tensor([200])),
                 lambda: ebc.read_optimizer_state("item", [0, -1]),
                 lambda: ebc.write_rows("item", torch.tensor([3, 200]), torch.ones(2, 8))):
        with pytest.raises(IndexError, match=r"table 'item': id (200|-1) out of range \[0, 200\)"):
            call()
    with pytest.raises(TypeError, match=r"table 'item': ids must be integers, got torch.float32"):
        ebc.read_rows("item", torch.tensor([1.0]))
    with pytest.raises(KeyError, match=r"no table 'nope'"):
        ebc.read_rows("nope", [0])
    after = _state(ebc)
    assert all(torch.equal(before[t][0], after[t][0]) for t in before)
    ebc.write_rows("cat", torch.tensor([49]), torch.full((1, 4), 2.0))
    assert torch.equal(ebc.read_rows("cat", [49]), torch.full((1, 4), 2.0))
    assert torch.equal(ebc.read_rows("user", torch.arange(300)), before["user"][0])  # not the next table's row 0


def test_bad_tables_and_budgets_are_refused_by_name():
    cases = [
        (lambda: EmbeddingBagConfig("t", -5, 8, ["f"]), ValueError, r"table 't': num_embeddings must be an int >= 1, got -5"),
        (lambda: EmbeddingBagConfig("t", 5, 0, ["f"]), ValueError, r"table 't': embedding_dim must be an int >= 1, got 0"),
        (lambda: EmbeddingBagConfig("t", 5, 8, "feat"), TypeError, r"table 't': feature_names must be a list .*'feat'"),
        (lambda: tieredemb.EmbeddingConfig("t", 5.5, 8, ["f"]), ValueError, r"num_embeddings must be an int >= 1, got 5.5"),
        (lambda: TieredEmbeddingBagCollection(TABLES, cache_bytes=0), ValueError, r"cache_bytes must be at least 1 byte, got 0"),
        (lambda: TieredEmbeddingBagCollection(TABLES, cache_bytes=4000, host_bytes=-1), ValueError,
         r"host_bytes must be at least 1 byte, got -1"),
        (lambda: TieredEmbeddingBagCollection(TABLES, cache_bytes=4.5), TypeError, r"cache_bytes must be a size like"),
        (lambda: TieredEmbeddingBagCollection(TABLES, cache_bytes="lots"), ValueError, r"size 'lots' is not a number"),
        (lambda: TieredEmbeddingBagCollection(TABLES, cache_rows=10), TypeError,
         r"a collection sizes its tables' tiers itself: give cache_bytes / host_bytes or a plan, not cache_rows"),
        (lambda: TieredEmbeddingBagCollection(TABLES, padding_idx=0), TypeError,
         r"padding_idx=0: a collection's tables have no padding row"),
        # (a review: dtype= raised "_engine() got multiple values for keyword argument 'dtype'", and a config's
        # float64 was taken until the collection was built, with a message naming no table)
        (lambda: TieredEmbeddingBagCollection(TABLES, dtype=torch.float16), TypeError,
         r"dtype=torch.float16: a collection's tables take their dtype from their configs"),
        (lambda: EmbeddingBagConfig("t", 5, 8, ["f"], dtype=torch.float64), ValueError,
         r"table 't': dtype torch.float64 is not supported"),
        (lambda: tieredemb.EmbeddingConfig("t", 5, 8, ["f"], dtype="float16"), ValueError,
         r"table 't': dtype 'float16' is not supported"),
    ]
    for make, error, message in cases:
        with pytest.raises(error, match=message):
            make()
    import numpy as np
    t = EmbeddingBagConfig("t", np.int64(5), np.int32(8), ["f"])  # numpy ints, as a plan or a table may give
    assert (t.num_embeddings, t.embedding_dim) == (5, 8) and type(t.num_embeddings) is int


UNPOOLED = [tieredemb.EmbeddingConfig("user", 300, 8, ["user_id", "friend_id"]),
            tieredemb.EmbeddingConfig("cat", 50, 4, ["category"])]


@pytest.mark.parametrize("tiers", [dict(), dict(cache_bytes=3000)], ids=["whole", "cached"])
def test_unpooled_collection_trains_as_a_dict_of_embeddings(tiers):
    ec = tieredemb.TieredEmbeddingCollection(UNPOOLED, optimizer=tieredemb.SGD(lr=0.1), **tiers)
    assert len(ec.groups) == 2
    refs = {t.name: torch.nn.Embedding(t.num_embeddings, t.embedding_dim,
                                       _weight=ec.read_rows(t.name, torch.arange(t.num_embeddings)).clone())
            for t in UNPOOLED}
    opt = torch.optim.SGD([p for m in refs.values() for p in m.parameters()], lr=0.1)
    table_of = {f: t.name for t in UNPOOLED for f in t.feature_names}
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        b = {}
        for t in UNPOOLED:
            for f in t.feature_names:
                lengths = torch.randint(0, 4, (B,), generator=g)
                b[f] = (torch.randint(0, t.num_embeddings, (int(lengths.sum()),), generator=g),
                        torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]]), lengths)
        keys = [f for t in UNPOOLED for f in t.feature_names]
        out = ec(KJT(keys, torch.cat([b[f][0] for f in keys]), torch.cat([b[f][2] for f in keys])) if step % 2
                 else {f: v[:2] for f, v in b.items()})
        assert list(out) == keys
        loss = 0
        for f in keys:
            want = refs[table_of[f]](b[f][0])
            torch.testing.assert_close(out[f].values(), want)
            assert out[f].lengths().tolist() == b[f][2].tolist()
            w = torch.arange(want.numel(), dtype=torch.float32).view_as(want) / 100
            loss = loss + (out[f].values() * w).sum()
            (want * w).sum().backward()
        loss.backward()
        opt.step()
        opt.zero_grad()
    for t in UNPOOLED:
        ids = torch.arange(t.num_embeddings)
        torch.testing.assert_close(ec.read_rows(t.name, ids), refs[t.name].weight.detach(), rtol=1e-5, atol=1e-6)


def test_unpooled_inverse_keyed_batches_equal_their_duplicates():
    a = tieredemb.TieredEmbeddingCollection(UNPOOLED, optimizer=tieredemb.Adagrad(lr=0.1))
    b = tieredemb.TieredEmbeddingCollection(UNPOOLED, optimizer=tieredemb.Adagrad(lr=0.1))
    distinct = {"user_id": ([3, 4, 5, 6, 7], [0, 2, 2]), "friend_id": ([9, 9, 1], [0, 1, 1]), "category": ([2, 3], [0, 1, 2])}
    inverse = torch.tensor([2, 0, 1, 0])
    ikjt, dup = {}, {}
    for f, (ids, starts) in distinct.items():
        bags = [ids[s:e] for s, e in zip(starts, starts[1:] + [len(ids)])]
        chosen = [bags[i] for i in inverse.tolist()]
        ikjt[f] = InverseKeyed(torch.tensor(ids), torch.tensor(starts), inverse)
        dup[f] = (torch.tensor(sum(chosen, [])), torch.tensor([0] + [len(c) for c in chosen[:-1]]).cumsum(0))
    out_a, out_b = a(ikjt), b(dup)
    loss_a = loss_b = 0
    for f in out_a:
        torch.testing.assert_close(out_a[f].values(), out_b[f].values())
        assert out_a[f].lengths().tolist() == out_b[f].lengths().tolist()
        grad = torch.randn(out_a[f].values().shape)
        loss_a = loss_a + (out_a[f].values() * grad).sum()
        loss_b = loss_b + (out_b[f].values() * grad).sum()
    loss_a.backward()
    loss_b.backward()
    for t in UNPOOLED:
        ids = torch.arange(t.num_embeddings)
        torch.testing.assert_close(a.read_rows(t.name, ids), b.read_rows(t.name, ids), rtol=1e-5, atol=1e-6)


def test_unpooled_equal_to_torchrec_where_it_imports():
    torchrec = pytest.importorskip("torchrec")
    tables = [UNPOOLED[0], dataclasses.replace(UNPOOLED[1], embedding_dim=8)]  # torchrec's: one dim for all
    ec = tieredemb.TieredEmbeddingCollection(tables, optimizer=tieredemb.SGD(lr=0.1))
    peer = torchrec.EmbeddingCollection(tables=[torchrec.EmbeddingConfig(
        name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_embeddings, feature_names=list(t.feature_names))
        for t in tables])
    for t in tables:
        peer.embeddings[t.name].weight.data.copy_(ec.read_rows(t.name, torch.arange(t.num_embeddings)))
    keys = ["user_id", "friend_id", "category"]
    lengths = torch.tensor([1, 0, 2, 2, 1, 1, 0, 3, 1])
    values = torch.tensor([5, 7, 8, 1, 2, 3, 4, 0, 1, 2, 9])
    kjt = torchrec.KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)
    ours, theirs = ec(kjt), peer(kjt)
    assert list(ours) == list(theirs) == keys
    for f in keys:
        assert isinstance(ours[f], torchrec.JaggedTensor)
        torch.testing.assert_close(ours[f].values(), theirs[f].values())
        assert ours[f].lengths().tolist() == theirs[f].lengths().tolist()


def test_a_keyed_jagged_tensor_with_offsets_only():
    class OffsetsOnly:
        def __init__(self, kjt):
            self._kjt = kjt

        def keys(self):
            return self._kjt.keys()

        def values(self):
            return self._kjt.values()

        def offsets(self):
            return torch.cat([torch.zeros(1, dtype=torch.int64), self._kjt.lengths().cumsum(0)])

        def weights_or_none(self):
            return None

    ebc = TieredEmbeddingBagCollection(TABLES, optimizer=tieredemb.SGD(lr=0.1))
    kjt = as_kjt(batch(5))
    torch.testing.assert_close(ebc(OffsetsOnly(kjt)).values(), ebc(kjt).values())


class VariableBatchKJT(KJT):
    """A KeyedJaggedTensor with a batch size per key (torchrec's variable_stride_per_key) and the
    inverse indices that expand each key's distinct bags to one batch."""

    def __init__(self, keys, values, lengths, strides, inverse, weights=None):
        super().__init__(keys, values, lengths, weights)
        self._strides, self._inverse = strides, inverse

    def variable_stride_per_key(self):
        return True

    def stride_per_key(self):
        return self._strides

    def inverse_indices_or_none(self):
        return self._inverse


def test_a_keyed_jagged_tensor_with_a_batch_size_per_key_as_its_inverse_keyed_batch():
    """Keys of 1 and 3 distinct bags, inverse indices (given in another key order) expanding both to
    4 samples: forward and training equal the same batch given as InverseKeyed features (before,
    the lengths were cut into equal batches: f2's bags went to f1), and torchrec's collection where
    it imports. Different batch sizes without inverse indices are refused by name."""
    tables = [EmbeddingBagConfig("a", 100, 4, ["f1"]), EmbeddingBagConfig("b", 50, 4, ["f2"], pooling="mean")]
    ebcs = [TieredEmbeddingBagCollection(tables, optimizer=tieredemb.Adagrad(lr=0.1), cache_bytes=600)
            for _ in range(2)]
    values, lengths = torch.tensor([7, 8, 1, 2, 3, 4]), torch.tensor([2, 1, 0, 3])
    inverse = (["f2", "f1"], torch.tensor([[2, 0, 1, 0], [0, 0, 0, 0]]))
    kjt = VariableBatchKJT(["f1", "f2"], values, lengths, [1, 3], inverse)
    given = {"f1": InverseKeyed(torch.tensor([7, 8]), torch.tensor([0]), torch.tensor([0, 0, 0, 0])),
             "f2": InverseKeyed(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 1]), torch.tensor([2, 0, 1, 0]))}
    for step in range(3):
        a, b = ebcs[0](kjt).values(), ebcs[1](given).values()
        assert a.shape == (4, 8) and torch.equal(a, b)
        grad = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        a.backward(grad)
        b.backward(grad)
    for t in tables:
        ids = torch.arange(t.num_embeddings)
        assert torch.equal(ebcs[0].read_rows(t.name, ids), ebcs[1].read_rows(t.name, ids))
    with pytest.raises(ValueError, match=r"keys of different batch sizes \[1, 3\] need inverse_indices"):
        ebcs[0](VariableBatchKJT(["f1", "f2"], values, lengths, [1, 3], None))
    with pytest.raises(ValueError, match=r"stride_per_key\(\) \[2, 3\] does not split its 4 lengths"):
        ebcs[0](VariableBatchKJT(["f1", "f2"], values, lengths, [2, 3], inverse))
    try:
        import torchrec
    except ImportError:
        return
    peer = torchrec.EmbeddingBagCollection(tables=[torchrec.EmbeddingBagConfig(
        name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_embeddings, feature_names=list(t.feature_names),
        pooling=torchrec.PoolingType.SUM if t.pooling == "sum" else torchrec.PoolingType.MEAN) for t in tables])
    for t in tables:
        peer.embedding_bags[t.name].weight.data.copy_(ebcs[0].read_rows(t.name, torch.arange(t.num_embeddings)))
    theirs = torchrec.KeyedJaggedTensor(keys=["f1", "f2"], values=values, lengths=lengths,
                                        stride_per_key_per_rank=[[1], [3]],
                                        inverse_indices=(["f1", "f2"], torch.stack([inverse[1][1], inverse[1][0]])))
    torch.testing.assert_close(ebcs[0](theirs).values(), peer(theirs).values(), rtol=1e-5, atol=1e-6)


def test_unpooled_collection_refuses_an_inverse_outside_its_bags():
    ec = tieredemb.TieredEmbeddingCollection(UNPOOLED, optimizer=tieredemb.SGD(lr=0.1))
    good = {"user_id": (torch.arange(3), torch.tensor([0, 1])), "friend_id": (torch.arange(2), torch.tensor([0, 1])),
            "category": (torch.arange(2), torch.tensor([0, 1]))}
    before = ec.read_rows("cat", torch.arange(50)).clone()
    with pytest.raises(ValueError, match=r"feature 'category': inverse -1 out of range \[0, 2\)"):
        ec({**good, "category": InverseKeyed(torch.arange(2), torch.tensor([0, 1]), torch.tensor([0, -1]))})
    assert ec.stats()["tables"]["user"]["lookups"] == 0 and torch.equal(ec.read_rows("cat", torch.arange(50)), before)


def test_a_backward_that_fails_for_one_group_leaves_no_row_pinned():
    """One table with no optimizer: the backward raises, naming it, before any group's update (it
    updated the groups before it), and every group's batch is released all the same (no row stays
    pinned until the graph is collected)."""
    tables = [EmbeddingBagConfig("u", 50, 4, ["a"], optimizer=tieredemb.SGD(lr=0.1)),
              EmbeddingBagConfig("v", 40, 8, ["b"]), EmbeddingBagConfig("w", 30, 2, ["c"], optimizer=tieredemb.SGD(lr=0.1))]
    ebc = TieredEmbeddingBagCollection(tables, cache_bytes=2000)
    ids, starts = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 3])
    out = ebc({f: (ids, starts) for f in "abc"})
    rows = {t.name: ebc.read_rows(t.name, torch.arange(t.num_embeddings)) for t in tables}
    assert [e._store.tier0.index.pinned for e in ebc.engines] == [4, 4, 4]
    with pytest.raises(RuntimeError, match=r"TieredEmbeddingBag of tables \['v'\] has no optimizer"):
        out.values().sum().backward()
    for t in tables:
        assert torch.equal(ebc.read_rows(t.name, torch.arange(t.num_embeddings)), rows[t.name]), t.name
    assert [e._store.tier0.index.pinned for e in ebc.engines] == [0, 0, 0]
    assert [e._store.batches_held() for e in ebc.engines] == [0, 0, 0]


def test_a_weighted_collection_refuses_a_keyed_batch_without_weights():
    """It pooled with every weight 1; torchrec's weighted collection refuses such a batch too."""
    tables = [TABLES[0], TABLES[2]]
    ebc = TieredEmbeddingBagCollection(tables, optimizer=tieredemb.SGD(lr=0.1), is_weighted=True)
    keys = [f for t in tables for f in t.feature_names]
    b = batch(3)
    kjt = KJT(keys, torch.cat([b[f][0] for f in keys]), torch.cat([b[f][2] for f in keys]))
    before = {t.name: ebc.read_rows(t.name, torch.arange(t.num_embeddings)) for t in tables}
    with pytest.raises(ValueError, match=r"built with is_weighted=True, and this batch has no weights"):
        ebc(kjt)
    assert all(torch.equal(ebc.read_rows(n, torch.arange(len(r))), r) for n, r in before.items())


@pytest.mark.parametrize("as_kjt_input", [False, True], ids=["dict", "kjt"])
def test_weighted_features_train_and_give_their_weights_gradient_as_torch(as_kjt_input, kernels):
    """per_sample_weights (a dict's third entry, or a KeyedJaggedTensor's weights), requiring
    grad, on sum-pooled tables (one of them read by two features, one cached): outputs, rows
    after SGD, and the weights' gradients equal a dict of torch.nn.EmbeddingBag's."""
    tables = [TABLES[0], TABLES[2]]  # user (user_id, friend_id), cat: the sum-pooled ones
    ebc = TieredEmbeddingBagCollection(tables, optimizer=tieredemb.SGD(lr=0.1), cache_bytes=3000, is_weighted=True)
    refs = {t.name: torch.nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode="sum",
                                          _weight=ebc.read_rows(t.name, torch.arange(t.num_embeddings)).clone())
            for t in tables}
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in refs.values()]
    table_of = {f: t for t in tables for f in t.feature_names}
    keys = list(table_of)
    for step in range(4):
        b = batch(10 + step)
        g = torch.Generator().manual_seed(step)
        weights = {f: torch.rand(len(b[f][0]), generator=g) for f in keys}
        ours = {f: w.clone().requires_grad_(True) for f, w in weights.items()}
        theirs = {f: w.clone().requires_grad_(True) for f, w in weights.items()}
        if as_kjt_input:
            out = ebc(KJT(keys, torch.cat([b[f][0] for f in keys]), torch.cat([b[f][2] for f in keys]),
                          torch.cat([ours[f] for f in keys])))
        else:
            out = ebc({f: (b[f][0], b[f][1], ours[f]) for f in keys})
        want = torch.cat([refs[table_of[f].name](b[f][0], b[f][1], per_sample_weights=theirs[f]) for f in keys], 1)
        torch.testing.assert_close(out.values(), want, rtol=1e-5, atol=1e-6)
        backward_both(out, want, torch.randn(out.values().shape, generator=g), opts)
        for f in keys:
            torch.testing.assert_close(ours[f].grad, theirs[f].grad, rtol=1e-5, atol=1e-6)
    for t in tables:
        torch.testing.assert_close(ebc.read_rows(t.name, torch.arange(t.num_embeddings)), refs[t.name].weight.detach(),
                                   rtol=1e-5, atol=1e-6)


def test_weights_of_any_float_type_as_the_single_table_module_takes_them():
    """bfloat16 weights (which numpy has no type for) pool as the same values in float32."""
    ebc = TieredEmbeddingBagCollection([EmbeddingBagConfig("a", 100, 8, ["f", "g"])], optimizer=tieredemb.SGD(lr=0.1))
    ids, starts, w = torch.tensor([1, 2, 3]), torch.tensor([0, 2]), torch.tensor([0.5, 1.0, 2.0])
    want = ebc({"f": (ids, starts, w), "g": (ids, starts)}).values()
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        assert torch.equal(ebc({"f": (ids, starts, w.to(dtype)), "g": (ids, starts)}).values(), want), dtype


def test_keyed_jagged_weights_of_the_wrong_length_change_nothing():
    """Sum-pooled tables (weights allowed), a KeyedJaggedTensor whose weights() are shorter than
    its values(): refused before any group looks its rows up (before, the native kernel caught
    it after every group had made its rows resident and counted its lookups)."""
    tables = [EmbeddingBagConfig("u", 50, 4, ["a"]), EmbeddingBagConfig("v", 40, 8, ["b"])]
    ebc = TieredEmbeddingBagCollection(tables, optimizer=tieredemb.SGD(lr=0.1), cache_bytes=2000, is_weighted=True)
    kjt = KJT(["a", "b"], torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([1, 2, 2, 1]), torch.ones(2))
    stats = ebc.stats()
    with pytest.raises(ValueError, match=r"KeyedJaggedTensor: weights must be a tensor of values\(\)' shape \(6,\)"):
        ebc(kjt)
    assert ebc.stats() == stats


def test_a_keyed_jagged_tensors_weights_are_left_alone_unless_is_weighted():
    """As torchrec's collections: an EmbeddingBagCollection takes a KeyedJaggedTensor's weights
    only when built with is_weighted=True (before, they were always applied, and refused for a
    mean-pooled table); an EmbeddingCollection never does. A dict's weights are always applied."""
    tables = [EmbeddingBagConfig("u", 50, 4, ["a"]), EmbeddingBagConfig("v", 40, 8, ["b"], pooling="mean")]
    plain, weighted = (TieredEmbeddingBagCollection(tables, optimizer=tieredemb.SGD(lr=0.1), is_weighted=w)
                       for w in (False, True))
    assert not plain.is_weighted() and weighted.is_weighted()
    ids, lengths, w = torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([1, 2, 2, 1]), torch.full((6,), 3.0)
    unweighted = plain(KJT(["a", "b"], ids, lengths)).values()
    assert torch.equal(plain(KJT(["a", "b"], ids, lengths, w)).values(), unweighted)
    with pytest.raises(ValueError, match="feature 'b': per_sample_weights need pooling 'sum'"):
        weighted(KJT(["a", "b"], ids, lengths, w))
    sums = TieredEmbeddingBagCollection(tables[:1], optimizer=tieredemb.SGD(lr=0.1), is_weighted=True)
    a_ids, a_starts = torch.tensor([1, 2, 3]), torch.tensor([0, 1])
    torch.testing.assert_close(sums(KJT(["a"], a_ids, torch.tensor([1, 2]), w[:3])).values(), 3 * unweighted[:, :4])
    torch.testing.assert_close(plain({"a": (a_ids, a_starts, w[:3]), "b": (ids[3:], torch.tensor([0, 2]))}).values(),
                               torch.cat([3 * unweighted[:, :4], unweighted[:, 4:]], 1))
    ec = tieredemb.TieredEmbeddingCollection([tieredemb.EmbeddingConfig("u", 50, 4, ["a"])])
    torch.testing.assert_close(ec(KJT(["a"], a_ids, torch.tensor([1, 2]), w[:3]))["a"].values(),
                               ec(KJT(["a"], a_ids, torch.tensor([1, 2])))["a"].values())
    with pytest.raises(TypeError, match="is_weighted must be a bool, got 1"):
        TieredEmbeddingBagCollection(tables, is_weighted=1)


def test_without_torchrec_the_outputs_behave_as_torchrecs(monkeypatch):
    """Where torchrec is not installed (the GPU machine, most users) the collections return
    tieredemb's KeyedEmbeddings and JaggedEmbeddings: every method torchrec's KeyedTensor and
    JaggedTensor have that they stand in for gives what torchrec's gives for the same forward
    (or, where torchrec does not import here either, what it is documented to give)."""
    from tieredemb import keyed

    b = batch(3)
    keys = [f for t in TABLES for f in t.feature_names]
    dims = [t.embedding_dim for t in TABLES for _ in t.feature_names]
    ebc = TieredEmbeddingBagCollection(TABLES, optimizer=tieredemb.SGD(lr=0.1))
    ec = tieredemb.TieredEmbeddingCollection(UNPOOLED, optimizer=tieredemb.SGD(lr=0.1))
    unpooled = [f for t in UNPOOLED for f in t.feature_names]
    theirs = (ebc(as_kjt(b)), ec({f: b[f][:2] for f in unpooled})) if keyed._torchrec() is not None else None
    monkeypatch.setattr(keyed, "_torchrec", lambda: None)
    pooled, jagged = ebc(as_kjt(b)), ec({f: b[f][:2] for f in unpooled})
    assert isinstance(pooled, keyed.KeyedEmbeddings)
    assert pooled.keys() == keys and pooled.length_per_key() == dims
    assert pooled.values().shape == (B, sum(dims))
    parts = torch.split(pooled.values(), dims, 1)
    assert list(pooled.to_dict()) == keys
    for f, part in zip(keys, parts):
        assert torch.equal(pooled.to_dict()[f], part) and torch.equal(pooled[f], part)
    for f in unpooled:
        j = jagged[f]
        assert isinstance(j, keyed.JaggedEmbeddings)
        assert j.lengths().tolist() == b[f][2].tolist()
        assert j.offsets().tolist() == [0] + b[f][2].cumsum(0).tolist()
        assert len(j.to_dense()) == B and [len(x) for x in j.to_dense()] == b[f][2].tolist()
        assert torch.equal(torch.cat(j.to_dense()), j.values())
    if theirs is not None:
        kt, jt = theirs
        assert kt.keys() == pooled.keys() and kt.length_per_key() == pooled.length_per_key()
        torch.testing.assert_close(kt.values(), pooled.values())
        for f in keys:
            torch.testing.assert_close(kt[f], pooled[f])
        for f in unpooled:
            torch.testing.assert_close(jt[f].values(), jagged[f].values())
            assert jt[f].lengths().tolist() == jagged[f].lengths().tolist()
            assert jt[f].offsets().tolist() == jagged[f].offsets().tolist()
            for x, y in zip(jt[f].to_dense(), jagged[f].to_dense()):
                torch.testing.assert_close(x, y)


@pytest.mark.parametrize("fault, said", [
    ("raise OSError('Could not load this library: fbgemm_gpu_py.so')", "OSError: Could not load this library"),
    ("import fbgemm_gpu_not_installed_here", "ModuleNotFoundError: No module named 'fbgemm_gpu_not_installed_here'")],
    ids=["library", "dependency"])
def test_a_torchrec_that_does_not_load_is_passed_over_with_one_warning(tmp_path, fault, said):
    """An installed torchrec whose fbgemm_gpu was built for another torch fails to import with an
    OSError, not an ImportError; one whose dependency is missing, with an ImportError that is not
    about torchrec. A fake torchrec that fails so on import stands in for each here (the real
    mismatch needs a second torch build; torch 2.11 beside this torchrec gave the first). The
    collection warns once, naming the error, and returns its own look-alikes; later forwards
    neither import again nor warn."""
    fake = tmp_path / "torchrec"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "import pathlib\n"
        f"n = pathlib.Path({str(tmp_path / 'imports')!r})\n"
        "n.write_text(str(int(n.read_text()) + 1) if n.exists() else '1')\n"
        f"{fault}\n")
    code = (
        "import warnings, torch, tieredemb\n"
        "from tieredemb import EmbeddingBagConfig as C, TieredEmbeddingBagCollection as EBC\n"
        "ebc = EBC([C('t', 10, 4, ['f'])], optimizer=tieredemb.SGD(lr=0.1))\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    for _ in range(3):\n"
        "        out = ebc({'f': (torch.tensor([1, 2, 3]), torch.tensor([0, 1]))})\n"
        "print(type(out).__name__, tuple(out.values().shape))\n"
        "print(len([x for x in w if issubclass(x.category, RuntimeWarning)]))\n"
        "print([str(x.message) for x in w][0])\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path)] + sys.path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    kind, warned, message = done.stdout.splitlines()
    assert kind == "KeyedEmbeddings (2, 4)"
    assert warned == "1"
    assert f"torchrec is installed but does not import ({said}" in message
    assert (tmp_path / "imports").read_text() == "1"


def test_torchrecs_dlrm_trains_with_our_collection_as_with_its_own():
    """torchrec.models.dlrm.DLRM, given our collection for its EmbeddingBagCollection (it reads
    embedding_bag_configs() for the dims and features): loaded from the torchrec model's
    state_dict (our keys are torchrec's), it trains as that model does, SGD on both."""
    torchrec = pytest.importorskip("torchrec")
    from torchrec.models.dlrm import DLRM

    specs = [("user", 300, ["user_id", "friend_id"]), ("item", 200, ["item_id"]), ("cat", 50, ["category"])]
    theirs_ebc = torchrec.EmbeddingBagCollection(tables=[torchrec.EmbeddingBagConfig(
        name=n, num_embeddings=r, embedding_dim=8, feature_names=f) for n, r, f in specs])
    ours_ebc = TieredEmbeddingBagCollection([EmbeddingBagConfig(n, r, 8, f) for n, r, f in specs],
                                            optimizer=tieredemb.SGD(lr=0.05), cache_bytes=2000)
    torch.manual_seed(0)
    theirs = DLRM(embedding_bag_collection=theirs_ebc, dense_in_features=5, dense_arch_layer_sizes=[16, 8],
                  over_arch_layer_sizes=[16, 1])
    ours = DLRM(embedding_bag_collection=ours_ebc, dense_in_features=5, dense_arch_layer_sizes=[16, 8],
                over_arch_layer_sizes=[16, 1])
    ours.load_state_dict(theirs.state_dict())  # dense layers and every table, one call
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.05)
    opt_ours = torch.optim.SGD([p for n, p in ours.named_parameters() if "embedding_bag_collection" not in n], lr=0.05)
    g = torch.Generator().manual_seed(4)
    keys = [f for _, _, fs in specs for f in fs]
    rows = {f: r for _, r, fs in specs for f in fs}
    for step in range(5):
        lengths = torch.randint(0, 4, (len(keys) * B,), generator=g)
        values = torch.cat([torch.randint(0, rows[f], (int(n),), generator=g)
                            for f, n in zip(keys, lengths.view(len(keys), B).sum(1))])
        kjt = torchrec.KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)
        dense, label = torch.randn(B, 5, generator=g), torch.rand(B, generator=g).round()
        losses = []
        for model, opt in ((theirs, opt_theirs), (ours, opt_ours)):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, kjt).squeeze(1), label)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-6), step
    for n, r, _ in specs:
        torch.testing.assert_close(ours_ebc.read_rows(n, torch.arange(r)),
                                   theirs_ebc.embedding_bags[n].weight.detach(), rtol=1e-5, atol=1e-6)
    assert ours_ebc.device == torch.device("cpu")


def test_a_weighted_collection_pools_a_feature_given_no_weights_with_weight_1():
    """Mutant g8 (collection.py _batch: the features of a group given without per_sample_weights
    beside one given them got weight 0 instead of 1): no test mixed weighted and unweighted
    features of one group."""
    ebc = tieredemb.TieredEmbeddingBagCollection([tieredemb.EmbeddingBagConfig("t", 100, 4, ["f", "g"])],
                                                 optimizer=tieredemb.SGD(lr=0.1))
    ids, starts = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2])
    w = torch.tensor([0.5, 1.0, 2.0, 0.25])
    out = ebc({"f": (ids, starts, w), "g": (ids + 10, starts)}).to_dict()
    rows = ebc.read_rows("t", torch.arange(100))
    torch.testing.assert_close(out["g"], torch.stack([rows[11] + rows[12], rows[13] + rows[14]]))
    torch.testing.assert_close(out["f"], torch.stack([0.5 * rows[1] + rows[2], 2 * rows[3] + 0.25 * rows[4]]))


def test_inverse_indices_naming_other_keys_are_refused_by_name():
    """Mutant y6 (keyed.py _strides: the check that inverse_indices name the KJT's keys removed): a
    KeyError from deep inside the lookup instead of the ValueError that names the rule."""
    ebc = tieredemb.TieredEmbeddingBagCollection(
        [tieredemb.EmbeddingBagConfig("a", 100, 4, ["f1"]), tieredemb.EmbeddingBagConfig("b", 50, 4, ["f2"])],
        optimizer=tieredemb.SGD(lr=0.1))
    values, lengths = torch.tensor([1, 2, 3, 4]), torch.tensor([1, 1, 1, 1])
    inverse = (["f1", "zz"], torch.tensor([[0, 0, 0, 0], [0, 1, 2, 0]]))
    with pytest.raises(ValueError, match="inverse_indices must be"):
        ebc(VariableBatchKJT(["f1", "f2"], values, lengths, [1, 3], inverse))


def test_in_torchrecs_place():
    """What a model written for torchrec's EmbeddingBagCollection does with it (a review against
    torchrec 1.9.2): its configs, is_weighted given by position, device=None, a KeyedJaggedTensor
    carrying features of other modules, FeatureProcessedEmbeddingBagCollection (it adds the
    configs' feature_names as lists), and torch.fx / torchrec.fx tracing (the collection one node)."""
    torchrec = pytest.importorskip("torchrec")
    from torchrec.modules.feature_processor_ import PositionWeightedModule
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
    import torchrec.fx

    theirs = [torchrec.EmbeddingBagConfig(num_embeddings=30, embedding_dim=4, name="t1", feature_names=["f1"]),
              torchrec.EmbeddingBagConfig(num_embeddings=20, embedding_dim=4, name="t2", feature_names=["f2", "f3"],
                                          pooling=torchrec.PoolingType.MEAN, data_type=torchrec.DataType.FP16),
              torchrec.EmbeddingBagConfig(num_embeddings=10, embedding_dim=2, name="t3")]  # (features: [name])
    ebc = TieredEmbeddingBagCollection(theirs, False, device=None, optimizer=tieredemb.SGD(lr=0.1))
    assert [(t.name, t.feature_names, t.pooling, t.dtype) for t in ebc.embedding_bag_configs()] == [
        ("t1", ["f1"], "sum", torch.float32), ("t2", ["f2", "f3"], "mean", torch.float16), ("t3", ["t3"], "sum",
                                                                                            torch.float32)]
    assert ebc.embedding_bag_configs()[0].init == tieredemb.Init("uniform", -(1 / 30) ** 0.5, (1 / 30) ** 0.5)
    peer = torchrec.EmbeddingBagCollection(tables=theirs)
    for t in theirs:
        peer.embedding_bags[t.name].weight.data.copy_(ebc.read_rows(t.name, torch.arange(t.num_embeddings)))
    kjt = torchrec.KeyedJaggedTensor(keys=["other", "f3", "t3", "f1", "f2"],
                                     values=torch.tensor([99, 1, 2, 3, 4, 5, 6, 7, 8, 9]),
                                     lengths=torch.tensor([1, 0, 2, 1, 1, 0, 1, 2, 0, 2]))
    torch.testing.assert_close(ebc(kjt).values(), peer(kjt).values(), rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match=r"features: missing \['f2'\]"):
        ebc(torchrec.KeyedJaggedTensor(keys=["f1", "f3", "t3"], values=torch.tensor([1, 2, 3]),
                                       lengths=torch.tensor([1, 1, 1])))
    with pytest.raises(ValueError, match=r"table 't': its init_fn .* cannot be run here"):
        TieredEmbeddingBagCollection([torchrec.EmbeddingBagConfig(num_embeddings=3, embedding_dim=2, name="t",
                                                                  init_fn=torch.nn.init.xavier_uniform_)])
    zeros = TieredEmbeddingBagCollection([torchrec.EmbeddingBagConfig(num_embeddings=3, embedding_dim=2, name="t",
                                                                      init_fn=torch.nn.init.zeros_)])
    assert zeros.embedding_bag_configs()[0].init == tieredemb.Init("zeros")
    with pytest.raises(TypeError, match=r"takes tieredemb.EmbeddingBagConfig tables \(or torchrec's\), got dict"):
        TieredEmbeddingBagCollection([{"name": "t"}])

    summed = [t for t in TABLES if t.pooling == "sum"]  # (per-sample weights: sum pooling)
    weighted = TieredEmbeddingBagCollection(summed, True, optimizer=tieredemb.SGD(lr=0.1))
    assert weighted.is_weighted()
    keys = [f for t in summed for f in t.feature_names]
    fp = FeatureProcessedEmbeddingBagCollection(weighted, {f: PositionWeightedModule(6) for f in keys})
    b = batch(3)
    kjt = torchrec.KeyedJaggedTensor(keys=keys, values=torch.cat([b[f][0] for f in keys]),
                                     lengths=torch.cat([b[f][2] for f in keys]))
    assert fp(kjt).values().shape == (B, sum(t.embedding_dim * len(t.feature_names) for t in summed))

    class Model(torch.nn.Module):
        def __init__(self, ebc):
            super().__init__()
            self.ebc, self.top = ebc, torch.nn.Linear(14, 1)

        def forward(self, kjt):
            return self.top(self.ebc(kjt).values())

    model = Model(ebc)
    for trace in (torch.fx.symbolic_trace, torchrec.fx.symbolic_trace):
        traced = trace(model)
        assert [n.op for n in traced.graph.nodes].count("call_function") == 1  # (the collection, one node)
        assert torch.equal(traced(kjt_of := torchrec.KeyedJaggedTensor(
            keys=["f1", "f2", "f3", "t3"], values=torch.tensor([1, 2, 3, 4, 5]),
            lengths=torch.tensor([1, 1, 1, 0, 1, 0, 0, 1]))), model(kjt_of))
    before = ebc.read_rows("t1", torch.arange(30))
    traced(kjt_of).sum().backward()  # (trains through the traced model)
    assert not torch.equal(ebc.read_rows("t1", torch.arange(30)), before)

    class Bags(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = tieredemb.TieredEmbeddingBag(10, 4, "sum")

        def forward(self, ids, offsets):
            return self.bag(ids, offsets) * 2

    bags = Bags()
    traced = torch.fx.symbolic_trace(bags)
    ids, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 2])
    assert torch.equal(traced(ids, offsets), bags(ids, offsets))


def test_a_host_budget_below_tier_0s_is_refused(tmp_path):
    """A review of memory: host_bytes under cache_bytes was raised to tier 0's size without a
    word (64 MiB asked, 645 MiB taken); a single table is refused so."""
    tables = [EmbeddingBagConfig("a", 40_000, 16, ["a"]), EmbeddingBagConfig("b", 20_000, 8, ["b"])]
    with pytest.raises(ValueError, match=r"host_bytes 20000: group0's share is \d+ rows, fewer than its tier 0's \d+; "
                                         r"a host cache holds tier 0's rows and more"):
        TieredEmbeddingBagCollection(tables, cache_bytes=400_000, host_bytes=20_000, ssd_path=tmp_path / "c")
    assert not (tmp_path / "c").exists()
    TieredEmbeddingBagCollection(tables, cache_bytes=400_000, host_bytes=400_000, ssd_path=tmp_path / "c")


def test_padding_idx_none_is_what_a_collection_has_anyway():
    """(A review: padding_idx=None was refused, with advice to leave padding ids out.)"""
    c = TieredEmbeddingBagCollection([EmbeddingBagConfig("t", 10, 4, ["f"])], padding_idx=None)
    assert c({"f": (torch.tensor([1, 2]), torch.tensor([0, 1]))}).values().shape == (2, 4)
