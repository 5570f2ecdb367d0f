"""Forward parity with torch.nn.EmbeddingBag / Embedding holding the same weights, with a tier 0
of a few rows so nearly every batch evicts."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tieredemb
from conftest import use_kernels

NUM, DIM = 64, 6


@st.composite
def bag_batches(draw):
    n_bags = draw(st.integers(0, 6))
    lengths = [draw(st.integers(0, 4)) for _ in range(n_bags)]
    ids = draw(st.lists(st.integers(0, NUM - 1), min_size=sum(lengths), max_size=sum(lengths)))
    offsets = [0]
    for length in lengths[:-1]:
        offsets.append(offsets[-1] + length)
    return ids, offsets[:n_bags], sum(lengths)


def _pair(mode, padding_idx, include_last_offset, cache_rows, host_rows, policy, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(NUM, DIM, generator=g)
    if padding_idx is not None:
        weight[padding_idx] = 0
    ref = torch.nn.EmbeddingBag(NUM, DIM, mode=mode, padding_idx=padding_idx,
                                include_last_offset=include_last_offset, _weight=weight.clone())
    ours = tieredemb.TieredEmbeddingBag(NUM, DIM, mode=mode, padding_idx=padding_idx,
                                        include_last_offset=include_last_offset, cache_rows=cache_rows,
                                        host_rows=host_rows, policy=policy, _weight=weight)
    return ref, ours


@settings(max_examples=60, deadline=None)
@given(batches=st.lists(bag_batches(), min_size=1, max_size=4),
       mode=st.sampled_from(["sum", "mean", "max"]),
       padding_idx=st.one_of(st.none(), st.integers(0, NUM - 1)),
       include_last_offset=st.booleans(),
       tiers=st.sampled_from([(24, None), (24, 40), (None, None), (64, None)]),
       policy=st.sampled_from(["lru", "lfu", "clock"]),
       weighted=st.booleans())
def test_embedding_bag_1d_matches_torch(batches, mode, padding_idx, include_last_offset, tiers, policy, weighted):
    ref, ours = _pair(mode, padding_idx, include_last_offset, *tiers, policy)
    for ids, offsets, n in batches:
        ids_t = torch.tensor(ids, dtype=torch.int64)
        off = torch.tensor(offsets + ([n] if include_last_offset else []), dtype=torch.int64)
        if include_last_offset and len(off) == 0:
            continue
        psw = torch.rand(len(ids)) if (weighted and mode == "sum") else None
        with torch.no_grad():
            expected = ref(ids_t, off, per_sample_weights=psw)
            got = ours(ids_t, off, per_sample_weights=psw)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(shape=st.tuples(st.integers(0, 5), st.integers(1, 4)), mode=st.sampled_from(["sum", "mean", "max"]),
       padding_idx=st.one_of(st.none(), st.integers(0, NUM - 1)), seed=st.integers(0, 1000))
def test_embedding_bag_2d_matches_torch(shape, mode, padding_idx, seed):
    ref, ours = _pair(mode, padding_idx, False, 24, None, "lru")
    ids = torch.randint(0, NUM, shape, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids), rtol=1e-5, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(shape=st.lists(st.integers(0, 4), min_size=0, max_size=3), padding_idx=st.one_of(st.none(), st.integers(0, NUM - 1)),
       seed=st.integers(0, 1000), tiers=st.sampled_from([(24, None), (24, 40), (None, None)]))
def test_embedding_matches_torch_any_shape(shape, padding_idx, seed, tiers):
    weight = torch.randn(NUM, DIM, generator=torch.Generator().manual_seed(seed))
    ref = torch.nn.Embedding(NUM, DIM, padding_idx=padding_idx, _weight=weight.clone())
    ours = tieredemb.TieredEmbedding(NUM, DIM, padding_idx=padding_idx, cache_rows=tiers[0], host_rows=tiers[1],
                                     _weight=weight)
    while math.prod(shape) > 20:
        shape = shape[:-1]
    ids = torch.randint(0, NUM, tuple(shape), generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        got = ours(ids)
    assert got.shape == tuple(shape) + (DIM,)
    torch.testing.assert_close(got, ref(ids))


def test_per_sample_weights_gradient_matches_torch(kernels):
    ref, _ = _pair("sum", None, False, 24, None, "lru")
    ids = torch.tensor([1, 2, 2, 9, 1])
    off = torch.tensor([0, 2])
    w_ref = torch.rand(5, requires_grad=True)
    w_ours = w_ref.detach().clone().requires_grad_(True)
    ours = tieredemb.TieredEmbeddingBag(NUM, DIM, mode="sum", cache_rows=24, optimizer=tieredemb.SGD(0.0),
                                        _weight=ref.weight.detach())
    g = torch.randn(2, DIM)
    ref(ids, off, per_sample_weights=w_ref).backward(g)
    ours(ids, off, per_sample_weights=w_ours).backward(g)
    torch.testing.assert_close(w_ours.grad, w_ref.grad)


@pytest.mark.parametrize("padding_idx", [None, 9])
def test_per_sample_weights_learn_over_a_frozen_table_as_torch(kernels, padding_idx):
    """from_pretrained(freeze=True) with weights that require grad: the output requires grad and the
    weights get torch's gradient (the padding id's is 0), the rows stay as they were. Before, no
    autograd node was made for a frozen table: backward raised, the weights got nothing."""
    weight = torch.randn(NUM, DIM, generator=torch.Generator().manual_seed(3))
    ref = torch.nn.EmbeddingBag.from_pretrained(weight, freeze=True, mode="sum", padding_idx=padding_idx)
    ours = tieredemb.TieredEmbeddingBag.from_pretrained(weight, freeze=True, mode="sum", padding_idx=padding_idx,
                                                        cache_rows=3)
    ids, off = torch.tensor([1, 2, 2, 9, 1, 30, 31]), torch.tensor([0, 2, 5])
    rows = ours.read_rows(torch.arange(NUM))
    for step in range(2):
        w_ref = torch.rand(7, generator=torch.Generator().manual_seed(step), requires_grad=True)
        w_ours = w_ref.detach().clone().requires_grad_(True)
        g = torch.randn(3, DIM, generator=torch.Generator().manual_seed(10 + step))
        out = ours(ids, off, per_sample_weights=w_ours)
        assert out.requires_grad
        ref(ids, off, per_sample_weights=w_ref).backward(g)
        out.backward(g)
        torch.testing.assert_close(w_ours.grad, w_ref.grad)
    assert torch.equal(ours.read_rows(torch.arange(NUM)), rows)
    assert ours._store.tier0.index.pinned == 0


def test_native_and_torch_kernels_agree(monkeypatch):
    """The torch-ops kernels (what runs on a GPU) give the native kernels' results on the CPU."""
    results = {}
    for k in ("native", "torch"):
        use_kernels(monkeypatch, k)
        for mode in ("sum", "mean", "max"):
            ours = tieredemb.TieredEmbeddingBag(NUM, DIM, mode=mode, padding_idx=3, cache_rows=20,
                                                optimizer=tieredemb.Adam(lr=0.05), seed=7)
            gen = torch.Generator().manual_seed(1)
            for _ in range(15):
                ids = torch.randint(0, NUM, (12,), generator=gen)
                off = torch.tensor([0, 3, 3, 8])
                ours(ids, off).backward(torch.randn(4, DIM, generator=gen))
            results[(k, mode)] = torch.cat([ours.read_rows(torch.arange(NUM)),
                                            ours.read_optimizer_state(torch.arange(NUM))], 1)
    for mode in ("sum", "mean", "max"):
        torch.testing.assert_close(results[("torch", mode)], results[("native", mode)], rtol=1e-5, atol=1e-6)
