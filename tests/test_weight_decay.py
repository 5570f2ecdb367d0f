"""Weight decay (every optimizer's weight_decay and weight_decay_mode): torch's optimizers where a
step touches every row (they decay every row, we the rows a step touches), FBGEMM's row-wise
Adagrad rule where it touches some, on the native kernels and the torch-ops twin."""

import pytest
import torch

import tieredemb
from tieredemb.optim import from_meta

NUM, DIM, STEPS = 60, 8, 40


def initial_weight():
    return torch.randn(NUM, DIM, generator=torch.Generator().manual_seed(42))


def batches(every_row: bool):
    """Bags of 4 ids (every row in each step's first NUM ids when every_row; else the last 10 rows
    never) and their gradients."""
    g = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        skewed = (torch.rand(40, generator=g) ** 3 * (NUM - 10)).long()
        ids = torch.cat([torch.randperm(NUM, generator=g), skewed]) if every_row else skewed
        yield ids, torch.arange(0, len(ids), 4), torch.randn(len(ids) // 4, DIM, generator=g)


def train_ours(optimizer, every_row, **tiers):
    emb = tieredemb.TieredEmbeddingBag(NUM, DIM, mode="sum", optimizer=optimizer, _weight=initial_weight(), **tiers)
    for ids, offsets, grad in batches(every_row):
        emb(ids, offsets).backward(grad)
    return emb


CASES = {  # ours, torch's (dense: it decays every row each step)
    "sgd-l2": (lambda: tieredemb.SGD(lr=0.05, weight_decay=0.3),
               lambda p: torch.optim.SGD(p, lr=0.05, weight_decay=0.3)),
    "adagrad-l2": (lambda: tieredemb.Adagrad(lr=0.1, eps=1e-10, weight_decay=0.2),
                   lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-10, weight_decay=0.2)),
    "adam-l2": (lambda: tieredemb.Adam(lr=0.01, weight_decay=0.5),
                lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.5)),
    "adamw": (lambda: tieredemb.Adam(lr=0.01, weight_decay=0.5, weight_decay_mode="decoupled"),
              lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.5)),
}


@pytest.mark.parametrize("case", CASES)
def test_weight_decay_matches_torchs_where_every_row_steps(case, kernels):
    """(Adam: ours adds eps to sqrt(v) before the bias correction, torch's Adam after it: a
    relative 1e-5 here.)"""
    ours, theirs = CASES[case]
    ref = torch.nn.EmbeddingBag(NUM, DIM, mode="sum", _weight=initial_weight())
    opt = theirs(ref.parameters())
    for ids, offsets, grad in batches(every_row=True):
        opt.zero_grad()
        ref(ids, offsets).backward(grad)
        opt.step()
    got = train_ours(ours(), every_row=True, cache_rows=None)
    plain = train_ours(ours().__class__(lr=ours().lr), every_row=True, cache_rows=None)
    ids = torch.arange(NUM)
    torch.testing.assert_close(got.read_rows(ids), ref.weight.detach(), rtol=1e-4, atol=1e-5)
    assert (got.read_rows(ids) - plain.read_rows(ids)).abs().max() > 1e-3  # (the decay shows)


def rowwise_reference(lr, eps, decay, mode):
    """FBGEMM's EXACT_ROWWISE_ADAGRAD with weight decay (its CUDA kernel's rule; its CPU TBE,
    fbgemm-gpu-cpu 1.8.0, leaves weight_decay out): for each row a step touches, g its summed
    gradient: L2: g += decay * w; acc += mean(g^2); w -= lr * g / (sqrt(acc) + eps). DECOUPLE:
    acc += mean(g^2); w = (1 - lr * decay) * w - lr * g / (sqrt(acc) + eps)."""
    w = initial_weight().clone().requires_grad_(True)
    acc = torch.zeros(NUM)
    for ids, offsets, grad in batches(every_row=False):
        w.grad = None
        torch.nn.functional.embedding_bag(ids, w, offsets, mode="sum").backward(grad)
        with torch.no_grad():
            for r in torch.unique(ids).tolist():
                g = w.grad[r] + (decay * w[r] if mode == "l2" else 0)
                acc[r] += (g * g).mean()
                keep = 1 - lr * decay if mode == "decoupled" else 1
                w[r] = keep * w[r] - lr * g / (torch.sqrt(acc[r]) + eps)
    return w.detach(), acc


@pytest.mark.parametrize("mode", ["l2", "decoupled"])
def test_rowwise_adagrad_decays_as_fbgemm_and_only_the_rows_a_step_touches(mode, kernels):
    expected, acc = rowwise_reference(0.1, 1e-8, 0.3, mode)
    opt = tieredemb.RowWiseAdagrad(lr=0.1, eps=1e-8, weight_decay=0.3, weight_decay_mode=mode)
    got = train_ours(opt, every_row=False, cache_rows=20, host_rows=30)
    ids = torch.arange(NUM)
    torch.testing.assert_close(got.read_rows(ids), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.read_optimizer_state(ids)[:, 0], acc, rtol=1e-5, atol=1e-7)
    never = torch.ones(NUM, dtype=torch.bool)
    for ids_, _, _ in batches(every_row=False):
        never[ids_] = False
    assert never.any() and torch.equal(got.read_rows(ids[never]), initial_weight()[never])


def test_a_collections_tables_decay_with_their_optimizers():
    """Tables of one collection with and without decay: each as a single table with its optimizer."""
    decayed = tieredemb.RowWiseAdagrad(lr=0.1, weight_decay=0.3, weight_decay_mode="decoupled")
    tables = [tieredemb.EmbeddingBagConfig("a", NUM, DIM, ["fa"], optimizer=decayed),
              tieredemb.EmbeddingBagConfig("b", NUM, DIM, ["fb"], optimizer=tieredemb.RowWiseAdagrad(lr=0.1))]
    ebc = tieredemb.TieredEmbeddingBagCollection(tables, cache_bytes=NUM * 20 * 4)
    for t in tables:
        ebc.write_rows(t.name, torch.arange(NUM), initial_weight())
    singles = [tieredemb.TieredEmbeddingBag(NUM, DIM, mode="sum", optimizer=t.optimizer, _weight=initial_weight())
               for t in tables]
    for ids, offsets, grad in batches(every_row=False):
        out = ebc({"fa": (ids, offsets), "fb": (ids, offsets)})
        ((out["fa"] + out["fb"]) * grad).sum().backward()
        for emb in singles:
            emb(ids, offsets).backward(grad)
    for t, emb in zip(tables, singles):
        assert torch.equal(ebc.read_rows(t.name, torch.arange(NUM)), emb.read_rows(torch.arange(NUM)))
    assert not torch.equal(ebc.read_rows("a", torch.arange(NUM)), ebc.read_rows("b", torch.arange(NUM)))


def test_weight_decay_is_checked_kept_and_keyword_only(tmp_path):
    for bad, message in [(dict(weight_decay=-0.1), r"weight_decay=-0.1: must be >= 0"),
                         (dict(weight_decay=float("nan")), r"weight_decay=nan: must be a real number"),
                         (dict(weight_decay="0.1"), r"weight_decay='0.1': must be a real number"),
                         (dict(weight_decay_mode="adamw"),
                          r"weight_decay_mode='adamw': must be one of \('l2', 'decoupled'\)")]:
        with pytest.raises(ValueError, match=message):
            tieredemb.Adagrad(lr=0.1, **bad)
    assert tieredemb.Adagrad(0.1, 1e-5).eps == 1e-5  # (positional arguments as before)
    opt = tieredemb.Adam(lr=0.01, weight_decay=0.25, weight_decay_mode="decoupled")
    assert from_meta(opt.to_meta()) == opt
    assert from_meta({"name": "adagrad", "lr": 0.1, "eps": 1e-10}).weight_decay == 0  # (a meta from before)
    emb = tieredemb.TieredEmbeddingBag(NUM, DIM, optimizer=opt, ssd_path=tmp_path / "t")
    emb.set_learning_rate(0.5)
    assert emb.optimizer.weight_decay == 0.25 and emb.optimizer.weight_decay_mode == "decoupled"


@pytest.mark.parametrize("backend", ["log", "rocksdb"])
def test_a_table_stored_before_weight_decay_reopens(tmp_path, backend):
    """A review: tables stored before the weight decay fields were refused on reopen (their meta's
    optimizer had no such fields). A table without weight decay stores none; one with it reopens
    with it only."""
    import json

    opt = tieredemb.RowWiseAdagrad(lr=0.1)
    t = tieredemb.TieredEmbeddingBag(NUM, DIM, optimizer=opt, ssd_path=tmp_path / "t", ssd_options={"backend": backend})
    assert "weight_decay" not in json.dumps(t.config.meta())
    t.close()
    tieredemb.TieredEmbeddingBag(NUM, DIM, optimizer=opt, ssd_path=tmp_path / "t").close()
    decayed = tieredemb.RowWiseAdagrad(lr=0.1, weight_decay=0.2)
    w = tieredemb.TieredEmbeddingBag(NUM, DIM, optimizer=decayed, ssd_path=tmp_path / "w",
                                     ssd_options={"backend": backend})
    w.close()
    tieredemb.TieredEmbeddingBag(NUM, DIM, optimizer=decayed, ssd_path=tmp_path / "w").close()
    with pytest.raises(ValueError, match=r"stored optimizer .* != requested"):
        tieredemb.TieredEmbeddingBag(NUM, DIM, optimizer=opt, ssd_path=tmp_path / "w")
