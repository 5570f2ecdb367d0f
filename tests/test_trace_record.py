"""The recorder on real modules in a training loop."""

import numpy as np
import pytest
import torch

import tieredemb
from tieredemb.trace import TraceError, open_trace, record


def _batches(path):
    with open_trace(path) as r:
        return r.header, [b.tolist() for b in r.batches()]


def test_records_a_training_loop_over_four_kinds_of_module(tmp_path):
    torch.manual_seed(0)
    tiered_bag = tieredemb.TieredEmbeddingBag(5000, 8, mode="sum", cache_rows=100,
                                              optimizer=tieredemb.RowWiseAdagrad(lr=0.1))
    tiered = tieredemb.TieredEmbedding(300, 8, cache_rows=20, optimizer=tieredemb.SGD(lr=0.1))
    bag = torch.nn.EmbeddingBag(40, 8, mode="sum")
    emb = torch.nn.Embedding(10, 8)
    opt = torch.optim.SGD(list(bag.parameters()) + list(emb.parameters()), lr=0.1)
    expected = []
    with record({"tb": tiered_bag, "t": tiered, "bag": bag, "emb": emb}, tmp_path / "run.trace") as rec:
        for step in range(6):
            a = torch.randint(0, 5000, (12,))
            b = torch.randint(0, 300, (2, 3))
            c = torch.randint(0, 40, (4, 2))  # 2-D input: bags by row
            e = torch.randint(0, 10, (5,))
            w = torch.rand(12)
            out = (tiered_bag(a, torch.tensor([0, 5]), per_sample_weights=w).sum() + tiered(b).sum()
                   + bag(input=c).sum() + emb(e).sum())
            opt.zero_grad()
            out.backward()
            opt.step()
            expected.append(a.tolist() + (b.reshape(-1) + 5000).tolist() + (c.reshape(-1) + 5300).tolist()
                            + (e + 5340).tolist())
        assert rec.num_batches == 5 and rec.num_lookups == 6 * 31  # the 6th batch is still open
    header, got = _batches(tmp_path / "run.trace")
    assert [(t.name, t.num_rows) for t in header.tables] == [("tb", 5000), ("t", 300), ("bag", 40), ("emb", 10)]
    assert got == expected
    for m in (tiered_bag, tiered, bag, emb):
        assert not m._forward_hooks


def test_batches_split_on_a_repeated_module_and_on_next_batch(tmp_path):
    a, b = torch.nn.Embedding(100, 4), torch.nn.Embedding(100, 4)
    with record([a, b], tmp_path / "x.trace") as rec:
        a(torch.tensor([1, 2]))
        b(torch.tensor([3]))
        b(torch.tensor([4]))      # b again: a new batch
        rec.next_batch()
        rec.next_batch()          # an empty batch is not written
        a(torch.tensor([5]))
    header, got = _batches(tmp_path / "x.trace")
    assert [t.name for t in header.tables] == ["table0", "table1"]
    assert got == [[1, 2, 103], [104], [5]]


def test_failed_calls_record_nothing_and_exceptions_keep_the_trace(tmp_path):
    emb = torch.nn.Embedding(10, 4)
    with pytest.raises(RuntimeError, match="boom"):
        with record(emb, tmp_path / "x.trace"):
            emb(torch.tensor([1]))
            with pytest.raises(IndexError):
                emb(torch.tensor([3, 10]))  # out of range: forward raises, nothing looked up
            emb(torch.tensor([2]))
            raise RuntimeError("boom")
    assert not emb._forward_hooks
    assert _batches(tmp_path / "x.trace")[1] == [[1], [2]]


def test_bad_module_arguments(tmp_path):
    emb = torch.nn.Embedding(10, 4)
    with pytest.raises(TraceError, match="module 'x' is a Linear"):
        record({"x": torch.nn.Linear(2, 2)}, tmp_path / "a.trace")
    with pytest.raises(TraceError, match="module 'table1' is given twice"):
        record([emb, emb], tmp_path / "b.trace")
    with pytest.raises(TraceError, match="at least one module"):
        record([], tmp_path / "c.trace")
    assert not emb._forward_hooks


def test_a_recorded_trace_replays_the_same_unique_rows(tmp_path):
    """What the engine saw per batch (its unique rows) is what the trace holds."""
    from tieredemb.sim import stack_distances

    emb = tieredemb.TieredEmbeddingBag(1000, 4, mode="sum", cache_rows=1000, optimizer=tieredemb.SGD(lr=0.1))
    gen = torch.Generator().manual_seed(1)
    with record(emb, tmp_path / "x.trace"):
        for _ in range(20):
            ids = torch.randint(0, 60, (30,), generator=gen)
            emb(ids, torch.tensor([0, 10, 20])).sum().backward()
    misses = emb.stats()["tier0"]["misses"]
    with open_trace(tmp_path / "x.trace") as r:
        c = r.read_all()
    dist = stack_distances(c.keys, c.batch_offsets)
    assert misses == int(np.sum(dist == -1))  # a cache holding every row misses first uses only
