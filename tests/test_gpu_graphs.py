"""gpu/graphed.py on CPU tensors: lookups captured as CUDA graphs and replayed, their "graphs"
recorded and replayed as recorded (gpu/recorded.py: a host value baked into a launch, or a tensor
replaced between replays, goes wrong here as in a CUDA graph). Training through them equals the
ordinary path bit for bit. The CUDA capture itself runs on a GPU only (tests/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

import tieredemb
from training import finalize_what_the_graph_holds, rows_and_state, train

pytestmark = pytest.mark.interpreted
pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tieredemb.gpu.recorded import Recorded  # noqa: E402
from tieredemb.gpu.tier import collection_on_cpu_tensors, on_cpu_tensors  # noqa: E402

NUM, D = 300, 8
device_tier = on_cpu_tensors  # emb with its tier 0 replaced by a DeviceTier on CPU tensors


@triton.jit
def _add_kernel(x_ptr, value, n, BLOCK: tl.constexpr):
    at = tl.arange(0, BLOCK)
    tl.store(x_ptr + at, tl.load(x_ptr + at, mask=at < n) + value, mask=at < n)


def test_a_recorded_graph_replays_its_ops_and_launches_as_recorded():
    """What a CUDA graph does, on CPU tensors: the capture runs the work once (the first replay is
    that run); a replay redoes every op and launch with the arguments they were given then (a
    host number read at capture stays as it was), into the tensors the capture returned; a
    tensor the host replaced after the capture is not the one the replay reads or writes."""
    x, bump = torch.zeros(4), [1.0]
    state = {"y": torch.ones(4)}

    def work():
        _add_kernel[(1,)](x, bump[0], 4, BLOCK=4)
        return x * 2 + state["y"]

    graph = Recorded(work)
    out = graph.outputs
    assert x.tolist() == [1.0] * 4 and out.tolist() == [3.0] * 4
    assert graph.replay() is out and x.tolist() == [1.0] * 4  # (the capture's run)
    bump[0] = 10.0  # (baked: the replay adds 1 again)
    state["y"] = torch.full((4,), 100.0)  # (replaced: the replay still reads the old one)
    assert graph.replay() is out
    assert x.tolist() == [2.0] * 4 and out.tolist() == [5.0] * 4


@pytest.mark.parametrize("op", ["item", "nonzero"])
def test_a_recorded_graph_refuses_what_a_capture_refuses(op):
    x = torch.arange(4)
    work = {"item": lambda: x.sum().item(), "nonzero": lambda: torch.nonzero(x)}[op]
    with pytest.raises(RuntimeError, match="in a captured graph: it reads a device value on the host or its output's "
                                           "size depends on the data"):
        Recorded(work)


def test_replayed_lookups_train_bit_for_bit_as_kernels_launched_one_by_one():
    """gpu/graphed.py on CPU tensors (a "graph" is its function's work recorded and replayed as
    recorded: gpu/recorded.py): a whole-table tier 0's lookups of a shape seen twice in a row replay their forward
    and backward, and train to the very rows and outputs of the ordinary path, through a change
    of shape, an optimizer whose step size changes every step (Adam: read from the device),
    two forwards before one backward (the second takes the ordinary path: the shape's buffers are
    in use), a forward without a graph, a bad id (refused, nothing changed), and a trained
    forward whose output is dropped without its backward (the shape is free again). The capture
    itself runs on a GPU only (tests/test_gpu.py). Batches of one number of bags whose ids vary in
    number share a shape (padded)."""
    def shaped(seed, bags, length, short=0):  # (the first bag `short` ids shorter)
        g = torch.Generator().manual_seed(seed)
        n = bags * length - short
        return ((torch.rand(n, generator=g) ** 2 * NUM).long(),
                torch.cat([torch.tensor([0]), torch.arange(length - short, n, length)]), torch.randn(bags, D, generator=g))

    # 10 bags of 57-60 ids in all share one shape (60 ids: padded), 4 bags of 12 ids another
    data = [shaped(k, 10, 6, short=k) for k in range(3)] + [shaped(10 + k, 4, 3) for k in range(2)] + [shaped(20, 10, 6)]
    for opt in (lambda: tieredemb.RowWiseAdagrad(lr=0.1), lambda: tieredemb.Adam(lr=0.05)):
        kw = dict(optimizer=opt(), seed=5, padding_idx=3)
        tables = [device_tier(tieredemb.TieredEmbeddingBag(NUM, D, "sum", **kw), None, graphs=graphs)
                  for graphs in (True, False)]
        runs = []
        for emb in tables:
            outs = train(emb, data)
            (ids, offsets, grad), (ids2, offsets2, grad2) = data[0], data[1]
            first = emb(ids, offsets)
            second = emb(ids2, offsets2)  # (before the first's backward)
            (first * grad).sum().add((second * grad2).sum()).backward()
            with torch.no_grad():
                outs += [first.detach(), second.detach(), emb(ids, offsets)]
            before = rows_and_state(emb)
            with pytest.raises(IndexError, match=rf"id {NUM} out of range \[0, {NUM}\)"):
                emb(torch.cat([ids[:-1], torch.tensor([NUM])]), offsets)
            assert torch.equal(rows_and_state(emb), before)
            graphs = emb._store.tier0.graphs
            replays = graphs.stats()["replays"] if graphs is not None else 0
            dropped = emb(ids, offsets)  # (a trained forward's output dropped without its backward)
            del dropped
            outs += train(emb, data[:1])  # (its shape replayed again: nothing waits for that backward)
            if graphs is not None:
                assert graphs.stats()["replays"] >= replays + 2
            runs.append((torch.cat(outs), rows_and_state(emb), emb.stats()))
        (got, got_rows, got_stats), (want, want_rows, want_stats) = runs
        assert torch.equal(got, want) and torch.equal(got_rows, want_rows)
        counts = lambda stats: {k: v for k, v in stats["prefetch"].items() if k != "wait_seconds"}  # noqa: E731
        assert got_stats["tier0"] == want_stats["tier0"] and counts(got_stats) == counts(want_stats)
        graphs = tables[0]._store.tier0.graphs.stats()
        # (a shape's forward is captured at its second lookup and replayed at the later ones)
        assert graphs["failed"] is None and graphs["shapes"] == 2
        assert graphs["captures"] == 3  # (the second shape's backward: seen once, not captured)
        assert tables[1]._store.tier0.graphs is None


def test_a_collections_lookups_replay_one_graph_for_all_its_tables_bit_for_bit():
    """A collection of whole tables on the device path (three groups: two dims, two poolings)
    replays one graph each way for all its groups (gpu/graphed.py, on CPU tensors its functions'
    work recorded and replayed), and trains to the very outputs, rows and counters of the ordinary path, through
    features whose ids vary in number within a shape, and a batch with per-sample weights (the
    ordinary path's)."""
    tables = [tieredemb.EmbeddingBagConfig("u", 120, D, ["a", "b"]),
              tieredemb.EmbeddingBagConfig("v", 80, D, ["c"], pooling="mean"),
              tieredemb.EmbeddingBagConfig("w", 40, 4, ["d"])]
    runs, made = [], []
    for graphs in (True, False):
        col = collection_on_cpu_tensors(tieredemb.TieredEmbeddingBagCollection(
            tables, optimizer=tieredemb.RowWiseAdagrad(lr=0.1), seed=3), graphs=graphs)
        assert all(e.config.partitions is None for e in col.engines)  # (whole tables)
        g = torch.Generator().manual_seed(2)
        outs = []
        for step in range(4):
            feats = {}
            for t in tables:
                for f in t.feature_names:
                    n = 40 - (step + ord(f)) % 4  # (37 to 40 ids a feature: one shape, padded)
                    ids = torch.randint(0, t.num_embeddings, (n,), generator=g)
                    starts = torch.tensor([0, 2, 2, 5, 9, n - 1])
                    feats[f] = (ids, starts, torch.rand(n, generator=g)) if f == "a" and step == 2 else (ids, starts)
            out = col(feats)
            out.values().backward(torch.randn(out.values().shape, generator=g))
            outs.append(out.values().detach())
        rows = torch.cat([torch.cat([col.read_rows(t.name, torch.arange(t.num_embeddings)),
                                     col.read_optimizer_state(t.name, torch.arange(t.num_embeddings))], 1).reshape(-1)
                          for t in tables])
        runs.append((torch.cat(outs), rows, [e.stats()["tier0"] for e in col.engines]))
        made.append(col)
    (got, got_rows, got_stats), (want, want_rows, want_stats) = runs
    assert torch.equal(got, want) and torch.equal(got_rows, want_rows) and got_stats == want_stats
    lead = made[0].engines[0]._store.tier0.graphs.stats()
    assert lead["failed"] is None and lead["shapes"] == 1 and lead["captures"] == 2 and lead["replays"] >= 2


def test_a_replayed_forwards_graph_the_collector_judges_unreachable_still_takes_its_backward():
    """A replayed forward's graph finalized as the cyclic collector does to a live graph it
    misjudges (simulated: training.finalize_what_the_graph_holds says why): its backward still
    runs, replayed, and trains as the ordinary path (the flight's release-on-drop was its __del__,
    with a weak reference from its shape: backward raised, and the shape's buffers looked free)."""
    data = [(torch.tensor([5, 6, 250, 3, 7, 7]), torch.tensor([0, 2, 4]),
             torch.randn(3, D, generator=torch.Generator().manual_seed(k))) for k in range(4)]
    runs = []
    for graphs in (True, False):
        emb = device_tier(tieredemb.TieredEmbeddingBag(NUM, D, "sum", optimizer=tieredemb.Adam(lr=0.05), seed=5),
                          None, graphs=graphs)
        outs = train(emb, data[:3])  # (the shape captured at its second batch, replayed at the third)
        replays = lambda: emb._store.tier0.graphs.stats()["replays"] if graphs else 0  # noqa: E731
        before = replays()
        ids, offsets, grad = data[3]
        out = emb(ids, offsets)
        if graphs:
            assert replays() == before + 1 and "_Flight" in finalize_what_the_graph_holds(out)
        out.backward(grad)
        assert replays() == (before + 2 if graphs else 0)  # (its backward replayed too)
        runs.append((torch.cat(outs + [out.detach()]), rows_and_state(emb)))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_a_table_keeps_its_last_used_shapes_and_captures_a_dropped_one_again():
    """More shapes than a table keeps (gpu/graphed.py's _MOST_SHAPES): the least recently used is
    dropped, and captured again when it comes back twice; training stays bit for bit the
    ordinary path's throughout."""
    from tieredemb.gpu import graphed

    def batch(bags, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, NUM, (2 * bags,), generator=g), torch.arange(0, 2 * bags, 2), torch.randn(bags, D,
                                                                                                         generator=g)

    kinds = list(range(1, graphed._MOST_SHAPES + 2))  # (bags per batch: one shape each)
    data = [batch(b, 10 * b + k) for b in kinds for k in range(2)] + [batch(kinds[0], 99 + k) for k in range(2)]
    kw = dict(optimizer=tieredemb.SGD(lr=0.1), seed=1)
    tables = [device_tier(tieredemb.TieredEmbeddingBag(NUM, D, "sum", **kw), None, graphs=graphs)
              for graphs in (True, False)]
    runs = [(torch.cat([o.reshape(-1) for o in train(emb, data)]), rows_and_state(emb)) for emb in tables]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    stats = tables[0]._store.tier0.graphs.stats()
    # each shape's forward captured at its second batch, the first shape's twice (dropped between)
    assert stats["shapes"] == graphed._MOST_SHAPES and stats["captures"] == len(kinds) + 1


@pytest.mark.parametrize("apart", [True, False], ids=["write-back-apart", "write-back-inline"])
def test_a_zero_copy_tables_lookups_replay_graphs_bit_for_bit(apart, monkeypatch):
    """A zero-copy tier 0 (10 % of the rows here: every batch evicts, dirty rows go down into the
    mapped host rows) replays its lookups as graphs too: the queued residency (plan, moves,
    commit, pins), the pooling, and the update with the release. Outputs, rows, optimizer state,
    the tier's and the store's counters equal the ordinary path's, bit for bit, through: a shape
    captured while no overflow row is in use (its replays still find the rows another batch in
    flight pins there), a change of shape, a forward under no_grad and a trained forward dropped without its backward (their
    pins released), rows written from outside and a flush, and a batch wider than the overflow
    slots whose forward comes while a replayed batch awaits its backward (the tier grows: that
    backward runs its kernels one by one over the new tensors; the shape is captured again). No
    host store call and no waiting plan while training. Every pin is released at the end. apart:
    the victims' rows staged and written down after each replay (ZeroCopy.write_back), else by
    the swap inside the graph."""
    from tieredemb.gpu import zerocopy
    from tieredemb.gpu.index import SetIndex
    from tieredemb.tiers.host_store import HostStore

    monkeypatch.setattr(zerocopy, "WRITE_BACK_APART", apart)
    write_backs = []  # (each one's replayed: True after a replay, of the captured residency's)
    write_back = zerocopy.ZeroCopy.write_back
    monkeypatch.setattr(zerocopy.ZeroCopy, "write_back", lambda self, pending, replayed=False: (
        write_backs.append(replayed), write_back(self, pending, replayed))[1])

    def batch(seed, bags=10, length=6, rows=NUM):
        g = torch.Generator().manual_seed(seed)
        return ((torch.rand(bags * length, generator=g) ** 2 * rows).long(), torch.arange(0, bags * length, length),
                torch.randn(bags, D, generator=g))

    few = [batch(30 + k, rows=25) for k in range(2)]  # (at most 25 ids: no overflow row)
    small = [batch(k) for k in range(4)]
    other = [batch(10 + k, bags=4, length=3) for k in range(2)]
    wide = batch(20, bags=40, length=30)  # (1200 ids: more than the 1024 overflow slots a tier starts with)
    runs = []
    for graphs in (True, False):
        emb = tieredemb.TieredEmbeddingBag(NUM, D, "sum", optimizer=tieredemb.Adam(lr=0.05), cache_rows=30, seed=2)
        emb.write_rows(torch.arange(0, NUM, 7), torch.randn(len(range(0, NUM, 7)), D,
                                                            generator=torch.Generator().manual_seed(1)))
        emb = device_tier(emb, 30, zero_copy=True, graphs=graphs)
        tier = emb._store.tier0
        outs = []
        with monkeypatch.context() as m:
            for name in ("read_to", "write_from", "locate", "wrote_in_place"):
                m.setattr(HostStore, name, lambda *a, _n=name, **k: pytest.fail(f"HostStore.{_n} called"))
            m.setattr(SetIndex, "_plan", lambda *a, **k: pytest.fail("a zero_copy residency waited for its plan"))
            outs += train(emb, few[:1])
            assert emb.stats()["tier0"]["overflow"] == 0  # (the host knows no overflow row is in use)
            outs += train(emb, few[1:] + small + other + small[:2])
            # two batches of the same ids in flight (the first in 5 bags: not replayed), the second
            # replayed: it finds the rows the first pinned in overflow slots
            first, second = emb(small[0][0], torch.arange(0, 60, 12)), emb(*small[0][:2])
            (first * small[0][2][:5]).sum().add((second * small[0][2]).sum()).backward()
            outs += [first.detach(), second.detach()]
            with torch.no_grad():
                outs.append(emb(*small[2][:2]))
            dropped = emb(*small[3][:2])  # (a trained forward dropped without its backward)
            del dropped
        emb.write_rows(torch.arange(3, NUM, 11), torch.ones(len(range(3, NUM, 11)), D))
        emb.flush()
        with monkeypatch.context() as m:
            m.setattr(SetIndex, "_plan", lambda *a, **k: pytest.fail("a zero_copy residency waited for its plan"))
            first, second = emb(*small[1][:2]), emb(*wide[:2])  # (the second grows the tier: the first in flight)
            (first * small[1][2]).sum().add((second * wide[2]).sum()).backward()
            outs += [first.detach(), second.detach()] + train(emb, small[:3])
        assert tier.index.pinned == 0 and tier.pinned_ids == 0
        runs.append((torch.cat([o.reshape(-1) for o in outs]), rows_and_state(emb), emb.stats(), tier))
    (got, got_rows, got_stats, tier), (want, want_rows, want_stats, plain) = runs
    assert torch.equal(got, want) and torch.equal(got_rows.view(torch.int32), want_rows.view(torch.int32))
    assert got_stats["tier0"] == want_stats["tier0"] and got_stats["store"] == want_stats["store"]
    assert got_stats["tier0"]["dirty_writebacks"] > 0 and got_stats["store"]["rows_written"] > 0
    assert tier.generation == plain.generation == 1  # (the wide batch grew the overflow slots)
    graphs = tier.graphs.stats()
    assert graphs["failed"] is None and graphs["replays"] >= 16
    assert (write_backs.count(True) >= 8 and False in write_backs) if apart else not write_backs
    print(graphs)


def test_a_learning_rate_set_every_step_reaches_replayed_updates():
    """A backward graph reads the learning rate from a device scalar filled before each replay: a
    rate set every step (set_learning_rate: an LR schedule) trains with the rate set for it, bit
    for bit as the ordinary path, from the one graph captured (a rate baked into the graph would
    have needed a capture each, and after two the update ran without a graph)."""
    g = torch.Generator().manual_seed(7)
    data = [((torch.rand(40, generator=g) ** 2 * NUM).long(), torch.arange(0, 40, 5), torch.randn(8, D, generator=g))
            for _ in range(6)]
    runs = []
    for graphs in (True, False):
        emb = device_tier(tieredemb.TieredEmbeddingBag(NUM, D, "sum", optimizer=tieredemb.RowWiseAdagrad(lr=0.1), seed=5),
                          None, graphs=graphs)
        outs = []
        for step, batch in enumerate(data):
            emb.set_learning_rate(0.1 / (step + 1))
            outs += train(emb, [batch])
        runs.append((torch.cat(outs), rows_and_state(emb)))
        if graphs:
            stats = emb._store.tier0.graphs.stats()
            assert stats["replays"] >= 4 and stats["captures"] == 2 and stats["failed"] is None  # (forward, backward)
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
