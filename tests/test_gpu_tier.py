"""The GPU tier 0 (tieredemb/gpu: device-resident index, Triton kernels) run on CPU tensors, the
Triton kernels under Triton's interpreter: the same logic as on a GPU, checked without one.
Training through it equals the CPU engine within float tolerance (its sums have other orders),
is bit for bit the same from run to run, and keeps the engine's rules: pins, overflow slots,
write-back, flush, prefetch, the lookahead window."""

from __future__ import annotations

import pytest
import torch

import tieredemb
from training import batches, rows_and_state, train
from tieredemb import _C

pytestmark = pytest.mark.interpreted
pytest.importorskip("triton")
from tieredemb.gpu import pooling, rowinit  # noqa: E402
from tieredemb.gpu.index import SetIndex  # noqa: E402
from tieredemb.gpu.tier import collection_on_cpu_tensors, on_cpu_tensors  # noqa: E402

NUM, D = 300, 8
OPTIMIZERS = {"sgd": lambda: tieredemb.SGD(lr=0.1), "adagrad": lambda: tieredemb.Adagrad(lr=0.1),
              "rowwise": lambda: tieredemb.RowWiseAdagrad(lr=0.1), "adam": lambda: tieredemb.Adam(lr=0.05),
              "msrowwise": lambda: tieredemb.MomentumScaledRowWiseAdagrad(lr=0.1, scale=4),
              "adagrad-l2": lambda: tieredemb.Adagrad(lr=0.1, weight_decay=0.2),
              "adamw": lambda: tieredemb.Adam(lr=0.05, weight_decay=0.3, weight_decay_mode="decoupled")}


device_tier = on_cpu_tensors  # emb with its tier 0 replaced by a DeviceTier on CPU tensors


def weights(num=NUM):
    return torch.randn(num, D, generator=torch.Generator().manual_seed(1))






_TIER_CASES = {"whole": dict(cache_rows=None), "cache64": dict(cache_rows=64), "cache8": dict(cache_rows=8),
               "host": dict(cache_rows=40, host_rows=80)}
_MODES = ["sum", "mean", "max"]
# Every optimizer with every tier, the pooling mode taken in turn so that every pair of the three
# (optimizer and tier, optimizer and mode, tier and mode) is met: 28 cases, not the 84 of all
# three crossed (the suite's time; the mode's kernels do not depend on the tier's residency).
_ENGINE_CASES = [(opt, _MODES[(i + j) % 3], tier) for i, opt in enumerate(sorted(OPTIMIZERS))
                 for j, tier in enumerate(_TIER_CASES)]


@pytest.mark.parametrize("opt, mode, tiers", [(o, m, _TIER_CASES[t]) for o, m, t in _ENGINE_CASES],
                         ids=[f"{t}-{m}-{o}" for o, m, t in _ENGINE_CASES])
def test_trains_as_the_cpu_engine(opt, mode, tiers):
    ref = tieredemb.TieredEmbeddingBag(NUM, D, mode, optimizer=OPTIMIZERS[opt](), _weight=weights(), padding_idx=3)
    dev = device_tier(tieredemb.TieredEmbeddingBag(NUM, D, mode, optimizer=OPTIMIZERS[opt](), _weight=weights(),
                                                   padding_idx=3, **tiers), tiers["cache_rows"])
    data = batches()
    for got, want in zip(train(dev, data), train(ref, data)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows_and_state(dev), rows_and_state(ref), rtol=1e-5, atol=1e-5)
    assert dev._store.tier0.index.pinned == 0


def test_bit_for_bit_from_run_to_run_with_prefetch_and_overflow(tmp_path):
    runs = []
    for k in range(2):
        emb = device_tier(tieredemb.TieredEmbeddingBag(
            NUM, D, "sum", optimizer=tieredemb.Adam(lr=0.05), _weight=weights(), cache_rows=8,
            ssd_path=tmp_path / f"t{k}", ssd_options={"backend": "log"}), 8)
        outs = train(emb, batches(seed=2), depth=2)
        runs.append((torch.stack(outs), rows_and_state(emb)))
        assert emb.stats()["tier0"]["overflow_rows"] > 0
        emb.close()
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_per_sample_weights_and_unpooled_lookups():
    ref = tieredemb.TieredEmbeddingBag(NUM, D, "sum", optimizer=tieredemb.Adagrad(lr=0.1), _weight=weights())
    dev = device_tier(tieredemb.TieredEmbeddingBag(NUM, D, "sum", optimizer=tieredemb.Adagrad(lr=0.1),
                                                   _weight=weights(), cache_rows=32), 32)
    for ids, offsets, grad in batches(seed=4, steps=4):
        outs = []
        for emb in (ref, dev):
            psw = torch.linspace(0.5, 1.5, len(ids), requires_grad=True)
            emb(ids, offsets, per_sample_weights=psw).backward(grad)
            outs.append(psw.grad)
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows_and_state(dev), rows_and_state(ref), rtol=1e-5, atol=1e-5)
    ref_e = tieredemb.TieredEmbedding(NUM, D, optimizer=tieredemb.SGD(lr=0.5), _weight=weights(), padding_idx=0)
    dev_e = device_tier(tieredemb.TieredEmbedding(NUM, D, optimizer=tieredemb.SGD(lr=0.5), _weight=weights(),
                                                  padding_idx=0, cache_rows=16), 16)
    ids = torch.tensor([[0, 5, 5], [7, 0, 299]])
    for emb in (ref_e, dev_e):
        emb(ids).pow(2).sum().backward()
    torch.testing.assert_close(rows_and_state(dev_e), rows_and_state(ref_e), rtol=1e-5, atol=1e-5)


def test_per_sample_weights_learn_over_a_frozen_device_table():
    """A frozen table (from_pretrained(freeze=True)) on the GPU path: the weights' gradient as the
    CPU path's (its rows gathered from the device pool), the rows unchanged, nothing left pinned."""
    grads = []
    for cache_rows in (None, 32):
        emb = tieredemb.TieredEmbeddingBag.from_pretrained(weights(), freeze=True, mode="sum", cache_rows=cache_rows)
        if cache_rows:
            emb = device_tier(emb, cache_rows)
        before = emb.read_rows(torch.arange(NUM))
        got = []
        for ids, offsets, grad in batches(seed=4, steps=3):
            psw = torch.linspace(0.5, 1.5, len(ids), requires_grad=True)
            emb(ids, offsets, per_sample_weights=psw).backward(grad)
            got.append(psw.grad)
        grads.append(torch.cat(got))
        assert torch.equal(emb.read_rows(torch.arange(NUM)), before)
        assert emb._store.tier0.index.pinned == 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-5)


def test_flush_writes_every_update_down_and_rows_read_where_they_live():
    dev = device_tier(tieredemb.TieredEmbeddingBag(NUM, D, "sum", optimizer=tieredemb.SGD(lr=0.1), cache_rows=32,
                                                   host_rows=64), 32)
    train(dev, batches(seed=5))
    before = rows_and_state(dev)
    new = torch.arange(3 * D, dtype=torch.float32).reshape(3, D)
    resident = dev._store.tier0.lookup(torch.arange(NUM))
    hot = int((resident >= 0).nonzero()[0][0])
    dev.write_rows(torch.tensor([hot, 299, 298]), new)  # one in tier 0, the others below
    dev.flush()
    assert dev._store.tier0.index.dirty_rows()[0].numel() == 0
    rows = torch.empty(NUM, dev.width)
    dev._store.bottom.read_to(torch.arange(NUM), rows, torch.arange(NUM))
    expected = before.clone()
    expected[[hot, 299, 298], :D] = new
    assert torch.equal(rows[:, :D], expected[:, :D]) and torch.equal(rows_and_state(dev)[:, :D], expected[:, :D])


def test_rows_never_written_are_drawn_on_the_device_as_on_the_host():
    ids = torch.tensor([0, 1, 5, 12345, 10**9, 2**40, 7])
    for kind, a, b in [(0, 0.0, 1.0), (1, -0.5, 0.25), (2, 0.0, 0.0)]:
        for dim, width in [(8, 8), (5, 7), (128, 129)]:
            want = torch.empty(len(ids), width)
            _C.init_rows(ids, want, dim, kind, a, b, 42, 7)
            got = torch.full((len(ids), width), 9.0)
            rowinit.init_rows(ids, got, None, dim, kind, a, b, 42, 7)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (kind, dim)
    # A whole-table tier 0 draws its first misses itself: the rows a host table reads.
    dev = device_tier(tieredemb.TieredEmbeddingBag(NUM, D, "sum", seed=9), None)
    assert dev._store.tier0.init_misses_here
    with torch.no_grad():
        got = dev(torch.arange(NUM), torch.arange(NUM))
    assert torch.equal(got, tieredemb.TieredEmbeddingBag(NUM, D, "sum", seed=9).read_rows(torch.arange(NUM)))


@pytest.mark.parametrize("chunk, cap", [(4, 3), (64, None)], ids=["chunks-of-4-by-3-programs", "one-chunk-a-program"])
def test_marked_rows_are_drawn_in_chunks_and_only_they(chunk, cap, monkeypatch):
    """rowinit.init_rows with marked and count (a tier's misses never stored, their count on the
    device): exactly the rows i < count whose destination is >= 0 and whose first word is the
    mark are drawn, as the host draws them; every other row is left as it was. As chunks of 4
    taken by 3 programs 12 apart, and as one chunk a program."""
    from tieredemb.tiers.rowstore import DEFERRED_MARK

    monkeypatch.setattr(rowinit, "INIT_CHUNK", chunk)
    monkeypatch.setattr(rowinit, "INIT_PROGRAMS", cap)
    g = torch.Generator().manual_seed(8)
    n, count, width, dim = 50, 41, 9, 8
    ids = torch.randint(0, 10**6, (n,), generator=g)
    rows = torch.randperm(60, generator=g)[:n]
    rows[torch.rand(n, generator=g) < 0.1] = -1
    out = torch.randn(60, width, generator=g)
    marked = torch.rand(n, generator=g) < 0.6
    out.view(torch.int32)[rows[marked & (rows >= 0)], 0] = DEFERRED_MARK
    want = out.clone()
    take = marked & (rows >= 0) & (torch.arange(n) < count)
    _C.init_rows(ids[take], drawn := torch.empty(int(take.sum()), width), dim, 0, 0.0, 1.0, 3, -1)
    want[rows[take]] = drawn
    rowinit.init_rows(ids, out, rows, dim, 0, 0.0, 1.0, 3, -1, marked=DEFERRED_MARK, count=torch.tensor([count]))
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    # (11 chunks of 4 below count, rows drawn in most: each of the 3 programs takes several; marks past count)
    assert take.sum() > 12 and (marked & (rows >= 0) & ~take).any()


@pytest.mark.parametrize("chunk, cap", [(8, 3), (64, None)], ids=["chunks-of-8-by-3-programs", "one-chunk-a-program"])
def test_a_whole_table_draw_sets_slots_draws_new_rows_once_and_counts_them(chunk, cap, monkeypatch):
    """plan_kernels.draw over a batch's distinct ids, U of n: slots = the ids (-1 past U); the rows
    not held yet drawn as the host draws them, and now held; rows held already left as they are;
    counts [drawn, seen] added to. As chunks of 8 ids taken by 3 programs 24 apart, and as one
    chunk a program."""
    from tieredemb.gpu import plan_kernels
    from tieredemb.gpu.direct_index import DirectIndex
    from tieredemb.tiers.rowstore import RowInit

    monkeypatch.setattr(plan_kernels, "DRAW_CHUNK", chunk)
    monkeypatch.setattr(plan_kernels, "DRAW_PROGRAMS", cap)
    g = torch.Generator().manual_seed(4)
    rows, dim, width, n, u = 400, 6, 7, 90, 70
    index = DirectIndex(rows, torch.device("cpu"))
    held_before = torch.rand(rows, generator=g) < 0.4
    index.held[:rows] = held_before
    pool = torch.randn(rows + 1, width, generator=g)
    before = pool.clone()
    ids = torch.randperm(rows, generator=g)[:n]
    index.drawn.copy_(torch.tensor([5, 11]))
    init = RowInit(dim, 0, 0.0, 1.0, 13, 2)
    slots = torch.full((n,), 77, dtype=torch.int64)
    plan_kernels.draw(ids, torch.tensor([u]), index, pool, init, slots)
    want_slots = torch.cat([ids[:u], torch.full((n - u,), -1)])
    assert torch.equal(slots, want_slots)
    new = ids[:u][~held_before[ids[:u]]]
    assert len(new) > 2 * 8 * 3  # (more chunks than programs: every program takes several)
    want = before.clone()
    _C.init_rows(new, drawn := torch.empty(len(new), width), dim, 0, 0.0, 1.0, 13, 2)
    want[new] = drawn
    assert torch.equal(pool.view(torch.int32), want.view(torch.int32))
    assert torch.equal(index.held[:rows], held_before | torch.isin(torch.arange(rows), ids[:u]))
    assert index.drawn.tolist() == [5 + len(new), 11 + u]


@pytest.mark.parametrize("dtype, align", [(torch.float32, 128), (torch.bfloat16, 4)])
def test_a_new_whole_table_draws_its_rows_in_one_launch_and_trains_as_the_cpu_engine(dtype, align):
    """A whole-table tier 0 over a new table makes a batch resident in one kernel launch (rows
    drawn in place, no torch op, nothing waits): training, stats and rows equal the CPU engine's;
    a bad id is refused before anything changes; once rows are stored below, misses are read.
    align: the device table's rows padded to that many bytes (row_alignment), the CPU engine's not."""
    kw = dict(optimizer=tieredemb.RowWiseAdagrad(lr=0.1), seed=5, padding_idx=3, dtype=dtype)
    ref = tieredemb.TieredEmbeddingBag(NUM, D, "sum", **kw)
    dev = device_tier(tieredemb.TieredEmbeddingBag(NUM, D, "sum", row_alignment=align, **kw), None)
    tier = dev._store.tier0
    assert tier.init_misses_here
    launches = []
    index_draw = tier.index.draw
    tier.index.draw = lambda *a: launches.append(1) or index_draw(*a)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    data = batches(seed=7)
    for got, want in zip(train(dev, data[:4]), train(ref, data[:4])):
        torch.testing.assert_close(got, want, **tol)
    assert len(launches) == 4
    stat = lambda emb: {k: emb.stats()["tier0"][k] for k in ("hits", "misses")}  # noqa: E731
    assert stat(dev) == stat(ref) and stat(dev)["misses"] > 0
    dev.reset_stats()
    ref.reset_stats()
    before = rows_and_state(dev)
    with pytest.raises(IndexError, match=rf"id {NUM} out of range \[0, {NUM}\)"):
        dev(torch.tensor([299, NUM]), torch.tensor([0]))
    assert torch.equal(rows_and_state(dev), before) and stat(dev) == {"hits": 0, "misses": 0}
    for got, want in zip(train(dev, data[4:6]), train(ref, data[4:6])):
        torch.testing.assert_close(got, want, **tol)
    assert stat(dev) == stat(ref)
    untouched = int(tier.index.held.logical_not().nonzero()[0])  # a row no batch read yet
    for emb in (dev, ref):  # a row stored below: from now on misses are read from below
        emb.write_rows(torch.tensor([untouched]), torch.ones(1, D))
    assert not tier.init_misses_here
    for got, want in zip(train(dev, data[6:]), train(ref, data[6:])):
        torch.testing.assert_close(got, want, **tol)
    assert len(launches) == 6
    torch.testing.assert_close(rows_and_state(dev), rows_and_state(ref), **tol)


@pytest.mark.parametrize("below", ["host", "log", "host-cache"])
def test_misses_never_stored_are_drawn_by_the_device_tier(tmp_path, below):
    """A cache tier 0 reading its misses from a store: the store only marks the rows it never
    stored, and tier 0 draws them (bit for bit the host's draw); with a host cache between,
    the host draws them (the cache keeps them)."""
    kw = {"host": {}, "log": dict(ssd_path=tmp_path / "t", ssd_options={"backend": "log"}),
          "host-cache": dict(host_rows=64)}[below]
    dev = device_tier(tieredemb.TieredEmbeddingBag(NUM, D, "sum", cache_rows=16, seed=9, **kw), 16)
    assert dev._store.tier0.draws_misses == (below != "host-cache")
    with torch.no_grad():
        got = torch.cat([dev(torch.arange(k, k + 50), torch.arange(50)) for k in range(0, NUM, 50)])
    want = tieredemb.TieredEmbeddingBag(NUM, D, "sum", seed=9).read_rows(torch.arange(NUM))
    assert torch.equal(got, want)
    assert torch.equal(dev.read_rows(torch.arange(NUM)), want)  # host reads draw them too, undeferred


def test_set_index_keeps_pinned_rows_and_lends_overflow_slots():
    index = SetIndex(4, "lru", torch.device("cpu"), overflow=2)
    first = torch.tensor([10, 11, 12, 13])

    def admit(ids):
        while isinstance(plan := index.plan(ids, torch.tensor([len(ids)]), 100), int):
            index.grow(plan)  # too few overflow slots: add what the plan asks for
        index.commit(plan, pin=True)
        return plan

    p1 = admit(first)
    assert sorted(p1.slots.tolist()) == [0, 1, 2, 3] and p1.num_overflow == 0
    p2 = admit(torch.tensor([20, 21, 22]))  # every regular slot pinned: overflow, grown past 2
    assert p2.num_overflow == 3 and all(s >= 4 for s in p2.slots.tolist()) and index.overflow_slots >= 3
    assert index.lookup(torch.tensor([21]))[0] == p2.slots[1]
    index.unpin(p2.slots)
    p3 = admit(torch.tensor([30]))  # the released overflow rows leave; 30 finds no regular slot either
    assert p3.num_victims == 3 and index.lookup(torch.tensor([20, 21, 22])).tolist() == [-1, -1, -1]
    index.unpin(p1.slots)
    p4 = admit(torch.tensor([40, 41]))  # LRU: the oldest of the first batch go
    assert p4.num_overflow == 0 and p4.num_victims >= 2
    assert index.stats()["overflow_rows"] == 4


def test_bad_ids_are_refused_before_anything_changes():
    dev = device_tier(tieredemb.TieredEmbeddingBag(NUM, D, "sum", optimizer=tieredemb.SGD(lr=0.1), cache_rows=8), 8)
    train(dev, batches(steps=2))
    before = rows_and_state(dev)
    with pytest.raises(IndexError, match=rf"id {NUM + 4} out of range \[0, {NUM}\)"):
        dev(torch.tensor([1, NUM + 4]), torch.tensor([0]))
    assert torch.equal(rows_and_state(dev), before) and dev._store.tier0.index.pinned == 0


@pytest.mark.parametrize("kind", ["set", "direct"])
def test_an_index_plan_refuses_bad_ids_itself_and_changes_nothing(kind):
    """Device ids are range-checked by the plan, in the transfer it makes anyway (no wait of
    their own): a bad id among a batch's distinct ids is named, whatever its place, and the
    index is as it was."""
    from tieredemb.gpu.direct_index import DirectIndex

    cpu = torch.device("cpu")
    index = SetIndex(8, "lru", cpu, overflow=2) if kind == "set" else DirectIndex(50, cpu)
    index.commit(index.plan(torch.tensor([1, 2, 3, -1]), torch.tensor([3]), 50), pin=False)
    # (tags and step: a plan's own marks of its batch's slots, read by that plan alone, and the count
    # of plans made, which only has to grow)
    state = {k: t.clone() for k, t in vars(index).items() if isinstance(t, torch.Tensor) and k not in ("tags", "step")}
    for bad, ids in ((50, [1, 4, 50, -1]), (-3, [-3, 2, 7, 9]), (10**12, [0, 10**12, 0, 0])):
        with pytest.raises(IndexError, match=rf"id {bad} out of range \[0, 50\)"):
            index.plan(torch.tensor(ids), torch.tensor([3 if ids[-1] == -1 else 2 if bad == 10**12 else 4]), 50)
    assert all(torch.equal(t, getattr(index, k)) for k, t in state.items()) and index.version == 1


@pytest.mark.parametrize("carried", [False, True], ids=["rows-fetched-after", "rows-in-the-plans-transfer"])
def test_dirty_victims_ride_the_plans_transfer_when_the_guess_covers_them(carried, monkeypatch):
    """A plan's one transfer carries the rows of as many dirty victims as the last batch had, and
    a slack: when they are all, writing them down waits for nothing more; when the plan carries
    too few (here: none), they are fetched after. Either way training equals the CPU engine's."""
    import tieredemb.gpu.tier as gpu_tier

    monkeypatch.setattr(gpu_tier, "_DIRTY_SLACK", 10**6)  # (capped at the most a plan can have)
    ref = tieredemb.TieredEmbeddingBag(NUM, D, "sum", optimizer=tieredemb.Adagrad(lr=0.1), _weight=weights())
    dev = device_tier(tieredemb.TieredEmbeddingBag(NUM, D, "sum", optimizer=tieredemb.Adagrad(lr=0.1),
                                                   _weight=weights(), cache_rows=16), 16)
    tier = dev._store.tier0
    if not carried:
        plan = tier.index.plan
        monkeypatch.setattr(tier.index, "plan", lambda ids, count, num_embeddings, *_, **__: plan(ids, count, num_embeddings))
    fetched = []
    to_host = tier.pool.to_host
    monkeypatch.setattr(tier.pool, "to_host", lambda slots: (fetched.append(len(slots)), to_host(slots))[1])
    data = batches()
    for got, want in zip(train(dev, data), train(ref, data)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    written = tier.bytes_out // tier.row_bytes
    assert written > 0 and sum(fetched) == (0 if carried else written)
    torch.testing.assert_close(rows_and_state(dev), rows_and_state(ref), rtol=1e-5, atol=1e-5)


def test_pooling_kernels_match_the_native_ones():
    g = torch.Generator().manual_seed(0)
    for opt in OPTIMIZERS.values():
        o = opt()
        for mode in (0, 1, 2):
            width = D + o.state_width(D)
            pool = torch.randn(50, width, generator=g).abs()
            ids = torch.randint(0, 20, (30,), generator=g)
            offsets = torch.tensor([0, 3, 3, 10, 17, 30])
            unique, inverse = (torch.from_numpy(a) for a in _C.dedup(ids, 100))
            slots = unique * 2 + 1
            native, triton_pool = pool.clone(), pool.clone()
            out_n = torch.empty(5, D)
            argmax = torch.empty(5 * D, dtype=torch.int64) if mode == 2 else None
            _C.pool_forward(native, D, slots, inverse, offsets, None, mode, 2, out_n, argmax)
            grad = torch.randn(5, D, generator=g)
            _C.pool_backward_update(native, D, slots, inverse, offsets, None, mode, 2, grad, argmax,
                                    o.native_args(3), 2, None)
            out_t, argmax_t = pooling.forward(triton_pool, D, slots, unique, inverse, offsets, None, mode,
                                              int(unique[2]))
            dirty = torch.zeros(50, dtype=torch.uint8)
            pooling.backward_update(triton_pool, dirty, D, slots, unique, torch.tensor([len(unique)]), inverse,
                                    offsets, None, mode, int(unique[2]), int(unique[2]), grad, argmax_t, o, 3, False)
            torch.testing.assert_close(out_t, out_n, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(triton_pool, native, rtol=1e-5, atol=1e-5)
            assert sorted(dirty.nonzero().squeeze(1).tolist()) == sorted(
                s for k, s in enumerate(slots.tolist()) if k != 2)


def test_kernels_write_and_read_each_bag_where_out_at_places_it():
    """Native and Triton: bags pooled into a wider block at out_at (a collection's [B, sum of
    dims]) equal the [B, D] output, nothing else in the block is written, and the backward that
    reads each bag's gradient there (NaN everywhere else) updates the rows as the plain one."""
    g = torch.Generator().manual_seed(5)
    bags, width = 5, 3 * D + 2
    out_at = torch.tensor([4 * width + 1, 2 * width + D + 2, 0, width + 2 * D, 3 * width + 1])
    for opt in OPTIMIZERS.values():
        o = opt()
        for mode in (0, 1, 2):
            pool = torch.randn(50, D + o.state_width(D), generator=g).abs()
            ids = torch.randint(0, 20, (30,), generator=g)
            offsets = torch.tensor([0, 3, 3, 10, 17, 30])
            psw = torch.rand(30, generator=g) if mode == 0 else None
            unique, inverse = (torch.from_numpy(a) for a in _C.dedup(ids, 100))
            slots = unique * 2 + 1
            grad = torch.randn(bags, D, generator=g)
            block_grad = torch.full((bags, width), float("nan"))
            block_grad.view(-1)[out_at[:, None] + torch.arange(D)] = grad
            argmax = torch.empty(bags * D, dtype=torch.int64) if mode == 2 else None
            plain, placed = pool.clone(), pool.clone()
            out = torch.empty(bags, D)
            _C.pool_forward(plain, D, slots, inverse, offsets, psw, mode, -1, out, argmax)
            psw_grad = torch.empty(30) if psw is not None else None
            _C.pool_backward_update(plain, D, slots, inverse, offsets, psw, mode, -1, grad, argmax, o.native_args(3), -1,
                                    psw_grad)
            block = torch.full((bags, width), float("nan"))
            _C.pool_forward(placed, D, slots, inverse, offsets, psw, mode, -1, block, argmax, out_at=out_at)
            assert torch.equal(block.view(-1)[out_at[:, None] + torch.arange(D)], out)
            assert int(block.isnan().sum()) == bags * (width - D)
            placed_psw_grad = torch.empty(30) if psw is not None else None
            _C.pool_backward_update(placed, D, slots, inverse, offsets, psw, mode, -1, block_grad, argmax,
                                    o.native_args(3), -1, placed_psw_grad, out_at=out_at)
            assert torch.equal(placed, plain)
            if psw is not None:
                assert torch.equal(placed_psw_grad, psw_grad)
            # Triton, the same block
            tri = pool.clone()
            block_t = torch.full((bags, width), float("nan"))
            _, argmax_t = pooling.forward(tri, D, slots, unique, inverse, offsets, psw, mode, -1, 0, block_t, out_at)
            torch.testing.assert_close(block_t, block, rtol=1e-6, atol=1e-6, equal_nan=True)
            psw_grad_t = pooling.backward_update(tri, torch.zeros(50, dtype=torch.uint8), D, slots, unique,
                                                 torch.tensor([len(unique)]), inverse, offsets, psw, mode, -1, -1,
                                                 block_grad, argmax_t, o, 3, psw is not None, at=out_at)
            torch.testing.assert_close(tri, plain, rtol=1e-5, atol=1e-5)
            if psw is not None:
                torch.testing.assert_close(psw_grad_t, psw_grad, rtol=1e-5, atol=1e-5)


def test_hot_rows_are_summed_tile_by_tile_as_the_native_kernels_sum_them():
    """A row with more occurrences than a kernel's tile (a Zipf batch's hottest row has thousands)
    is summed a tile per program, its tiles' partial sums then added a tile at a time; the padding
    row, hot too, is left alone. Dim 300: tiles of 8 occurrences, so a row of 300 occurrences has
    38 partial sums, added over five tiles; warm rows of 10-30 occurrences side by side put two
    tile starts in one window of the chunk kernel. Every mode, with per-sample weights, 16-bit
    weights and placed output: the native kernels' update within float tolerance, the same bits
    run to run, and whether the update runs a program per occurrence or five programs, each taking
    the unique rows five apart (pooling.UPDATE_PROGRAMS)."""
    dim, n, bags = 300, 500, 37
    g = torch.Generator().manual_seed(11)
    ids = torch.where(torch.rand(n, generator=g) < 0.6, 7, torch.randint(0, 12, (n,), generator=g))  # and 11 warm ones
    ids[torch.rand(n, generator=g) < 0.2] = 3  # the padding row
    offsets = torch.cat([torch.tensor([0]), torch.sort(torch.randint(0, n + 1, (bags - 1,), generator=g)).values,
                         torch.tensor([n])])
    unique, inverse = (torch.from_numpy(a) for a in _C.dedup(ids, 100))
    assert int(torch.bincount(inverse).max()) > 8 * 32  # more partial sums than one tile of them
    pad = int((unique == 3).nonzero())
    slots = unique * 2 + 1
    out_at = torch.randperm(bags, generator=g) * (dim + 5) + 2
    grad = torch.randn(bags, dim, generator=g)
    block_grad = torch.full((bags * (dim + 5) + 2,), float("nan"))
    block_grad[out_at[:, None] + torch.arange(dim)] = grad
    for opt, weights in ((tieredemb.RowWiseAdagrad(lr=0.1), 0), (tieredemb.Adagrad(lr=0.1), 2)):
        width = (dim if weights == 0 else (dim + 1) // 2) + opt.state_width(dim)
        pool = torch.randn(100, width, generator=g).abs()  # (the optimizer state: no negative sums)
        if weights:  # bfloat16 weights, two to a word
            pool[:, :dim // 2] = torch.randn(100, dim, generator=g).to(torch.bfloat16).view(torch.float32)
        for mode in (0, 1, 2):
            psw = torch.rand(n, generator=g) if mode == 0 else None
            native = pool.clone()
            out_n = torch.empty(bags, dim)
            argmax = torch.empty(bags * dim, dtype=torch.int64) if mode == 2 else None
            _C.pool_forward(native, dim, slots, inverse, offsets, psw, mode, pad, out_n, argmax, weights=weights)
            _C.pool_backward_update(native, dim, slots, inverse, offsets, psw, mode, pad, grad, argmax,
                                    opt.native_args(3), pad, None, weights=weights)
            runs = []
            for programs in (None, 5):
                tri, block = pool.clone(), torch.full((bags * (dim + 5) + 2,), float("nan"))
                _, argmax_t = pooling.forward(tri, dim, slots, unique, inverse, offsets, psw, mode, 3, weights, block,
                                              out_at)
                default = pooling.UPDATE_PROGRAMS
                try:
                    pooling.UPDATE_PROGRAMS = programs
                    pooling.backward_update(tri, torch.zeros(100, dtype=torch.uint8), dim, slots, unique,
                                            torch.tensor([len(unique)]), inverse, offsets, psw, mode, 3, 3, block_grad,
                                            argmax_t, opt, 3, False, weights, at=out_at)
                finally:
                    pooling.UPDATE_PROGRAMS = default
                runs.append((tri, block))
            out_t = runs[0][1][out_at[:, None] + torch.arange(dim)]
            torch.testing.assert_close(out_t, out_n, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(runs[0][0], native, rtol=1e-4, atol=1e-5)
            assert torch.equal(runs[0][0].view(torch.int32), runs[1][0].view(torch.int32)), (opt, mode)
            assert torch.equal(runs[0][1].view(torch.int32), runs[1][1].view(torch.int32)), (opt, mode)


def test_a_collection_on_the_device_path_trains_as_on_the_cpu():
    """A collection whose groups' tier 0 are device tiers (Triton kernels writing the [B, sum of
    dims] block in place) against the same collection on the CPU kernels: weighted and
    inverse-keyed features, a cached group, three groups of different dims and poolings."""
    tables = [tieredemb.EmbeddingBagConfig("u", 120, D, ["a", "b"]),
              tieredemb.EmbeddingBagConfig("v", 80, D, ["c"], pooling="mean"),
              tieredemb.EmbeddingBagConfig("w", 40, 4, ["d"])]
    kw = dict(optimizer=tieredemb.RowWiseAdagrad(lr=0.1), cache_bytes=4000)
    cpu = tieredemb.TieredEmbeddingBagCollection(tables, **kw)
    dev = collection_on_cpu_tensors(tieredemb.TieredEmbeddingBagCollection(tables, **kw))
    assert [tieredemb.kernels.implementation(e._store.tier0.pool) for e in dev.engines] == ["triton"] * 3
    assert all(e.config.partitions for e in dev.engines)  # each table cached: a share of tier 0
    g = torch.Generator().manual_seed(2)
    for step in range(5):
        feats = {}
        for t in tables:
            for f in t.feature_names:
                ids = torch.randint(0, t.num_embeddings, (12,), generator=g)
                starts = torch.tensor([0, 2, 2, 5, 9, 10])
                if f == "b":
                    feats[f] = tieredemb.InverseKeyed(ids, starts, torch.tensor([5, 0, 0, 3, 2, 5]))
                elif f == "a":
                    feats[f] = (ids, starts, torch.rand(12, generator=g))
                else:
                    feats[f] = (ids, starts)
        out_c, out_d = cpu(feats), dev(feats)
        torch.testing.assert_close(out_d.values(), out_c.values(), rtol=1e-5, atol=1e-5)
        grad = torch.randn(out_c.values().shape, generator=g)
        out_c.values().backward(grad)
        out_d.values().backward(grad)
    for t in tables:
        ids = torch.arange(t.num_embeddings)
        torch.testing.assert_close(dev.read_rows(t.name, ids), cpu.read_rows(t.name, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("stochastic", [False, True])
def test_16_bit_weights_train_as_on_the_cpu(dtype, stochastic):
    """Reduced precision on the device tier: the same float32 math, rounded (to the nearest, or
    stochastically with the native kernels' random bits): within a unit of the 16-bit type."""
    kw = dict(dtype=dtype, stochastic_rounding=stochastic, optimizer=tieredemb.Adam(lr=0.05), seed=5)
    ref = tieredemb.TieredEmbeddingBag(NUM, D, "mean", **kw)
    dev = device_tier(tieredemb.TieredEmbeddingBag(NUM, D, "mean", cache_rows=16, **kw), 16)
    for got, want in zip(train(dev, batches(seed=6, steps=5)), train(ref, batches(seed=6, steps=5))):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    unit = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    rows = torch.arange(NUM)
    assert (dev.read_rows(rows) - ref.read_rows(rows)).abs().max() <= 4 * unit * ref.read_rows(rows).abs().max()
    torch.testing.assert_close(dev.read_optimizer_state(rows), ref.read_optimizer_state(rows), rtol=5e-2, atol=1e-3)
    assert dev.width == ref.width == (D + 1) // 2 + 2 * D


def test_prefetch_with_a_host_cache_below_trains_as_the_cpu_engine():
    """The window reaches the host cache too (its ids brought to the host by the prefetch worker)."""
    kw = dict(optimizer=tieredemb.RowWiseAdagrad(lr=0.1), _weight=weights())
    ref = tieredemb.TieredEmbeddingBag(NUM, D, "sum", **kw)
    dev = device_tier(tieredemb.TieredEmbeddingBag(NUM, D, "sum", cache_rows=32, host_rows=64, **kw), 32)
    data = batches(seed=8, steps=10)
    for got, want in zip(train(dev, data, depth=2), train(ref, data)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows_and_state(dev), rows_and_state(ref), rtol=1e-5, atol=1e-5)
    assert dev._store.tiers[1].index.stats()["hits"] > 0


def test_partitioned_tier_keeps_each_parts_rows_and_counts_each_part():
    parts = ((100, 32), (200, 64))
    ref = tieredemb.TieredEmbeddingBag(NUM, D, "sum", optimizer=tieredemb.Adagrad(lr=0.1), _weight=weights())
    dev = device_tier(tieredemb.TieredEmbeddingBag(NUM, D, "sum", optimizer=tieredemb.Adagrad(lr=0.1),
                                                   _weight=weights(), partitions=parts), None, partitions=parts)
    data = batches(seed=4, steps=10)
    for got, want in zip(train(dev, data), train(ref, data)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows_and_state(dev), rows_and_state(ref), rtol=1e-5, atol=1e-5)
    s = dev.stats()["tier0"]
    p = s["partitions"]
    assert [q["capacity"] for q in p] == [32, 64] and s["capacity"] == 96
    for k, (lo, hi) in enumerate([(0, 100), (100, 300)]):  # every distinct id of a batch is a hit or a miss
        want = sum(len(torch.unique(b[0][(b[0] >= lo) & (b[0] < hi)])) for b in data)
        assert p[k]["hits"] + p[k]["misses"] == want
    assert sum(q["misses"] for q in p) == s["misses"] and sum(q["evictions"] for q in p) == s["evictions"]
    # a part's stream alone never evicts another part's rows
    index = dev._store.tier0.index
    before = p[0]["evictions"]
    for k in range(5):
        hot = torch.arange(100 + 40 * k, 140 + 40 * k)
        dev(hot, torch.arange(0, 40, 4)).sum().backward()
    after = dev.stats()["tier0"]["partitions"]
    assert after[0]["evictions"] == before and after[1]["evictions"] > p[1]["evictions"]
    assert after[0]["resident"] == p[0]["resident"] and index.pinned == 0


def test_a_small_partition_leaves_the_others_their_ways():
    """A 1-row part made every part's sets 1-way (ways = the smallest part's capacity): a table
    whose hot rows fit its 202 rows evicted them all the same (139 evictions, 69 % more misses
    than the CPU path). Every set has the largest part's ways now; the small part gets one set."""
    parts = ((2000, 202), (10, 1))
    hot = torch.randperm(2000, generator=torch.Generator().manual_seed(5))[:150]
    stats = []
    for on_device in (False, True):
        emb = tieredemb.TieredEmbeddingBag(2010, 4, "sum", optimizer=tieredemb.SGD(lr=0.1), partitions=parts)
        if on_device:
            emb = device_tier(emb, None, partitions=parts)
        g = torch.Generator().manual_seed(0)
        for _ in range(10):
            emb(hot[torch.randint(0, 150, (64,), generator=g)], torch.arange(0, 64, 8)).sum().backward()
        stats.append(emb.stats()["tier0"]["partitions"][0])
    assert stats[1]["evictions"] == stats[0]["evictions"] == 0
    assert (stats[1]["hits"], stats[1]["misses"]) == (stats[0]["hits"], stats[0]["misses"])


def test_the_backward_finds_each_occurrences_bag_and_each_hot_rows_tiles():
    """_prep_kernel: the bag of the occurrence at each sorted position, and (asked for, as the
    per-sample weights' gradient asks) each occurrence's bag, by a binary search of the offsets
    (empty bags anywhere, one bag, a bag count not a power of two), and each row's tiles of TILE
    occurrences (0 for a row of at most TILE), as torch's repeat_interleave and arithmetic give them."""
    g = torch.Generator().manual_seed(0)
    for bags in (1, 2, 3, 7, 300, 1000):
        lengths = torch.randint(0, 4, (bags,), generator=g)
        lengths[torch.rand(bags, generator=g) < 0.3] = 0
        lengths[-1] += 1
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        n = int(offsets[-1])
        count = torch.bincount(torch.randint(0, max(1, n // 3), (n,), generator=g), minlength=n)
        start = torch.cat([torch.zeros(1, dtype=torch.int64), count.cumsum(0)])
        order = torch.randperm(n, generator=g)
        want = torch.repeat_interleave(torch.arange(bags), lengths)
        for by_occurrence in (False, True):
            sorted_bag, bag, tiles = (torch.full((n,), -5, dtype=torch.int64) for _ in range(3))
            chunk = torch.full((n + 1,), 7)
            pooling._prep_kernel[(-(-n // 256),)](offsets, bags, order, start, n, sorted_bag, bag, tiles, chunk,
                                                   bags.bit_length() + 1, BY_OCCURRENCE=by_occurrence, TILE=2,
                                                   BLOCK=256)
            assert torch.equal(sorted_bag, want[order]), bags
            assert torch.equal(bag, want) if by_occurrence else bool((bag == -5).all()), bags
            assert torch.equal(tiles, torch.where(count > 2, (count + 1) // 2, 0)) and chunk[0] == 0


@pytest.mark.parametrize("where", ["cpu", "device-tier"])
def test_ids_after_the_last_bag_belong_to_no_bag(where):
    """include_last_offset with offsets[-1] < len(ids): the ids after the last bag belong to no
    bag. torch.nn.EmbeddingBag's forward leaves them out (its CPU backward does not: it gives them
    the last bag's gradient, and their per-sample weights uninitialized values); the table leaves
    them out of both, on either path: the same as torch given only the ids before offsets[-1],
    their rows not updated and their weights' gradient zero. (The device backward once gave them
    the last bag's gradient.)"""
    ids, offsets = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 2, 3])
    grad = torch.randn(2, D, generator=torch.Generator().manual_seed(3))
    ref = torch.nn.EmbeddingBag(NUM, D, mode="sum", include_last_offset=True, _weight=weights().clone())
    psw_ref = torch.linspace(0.5, 1.5, 5)[:3].requires_grad_(True)
    want = ref(ids[:3], offsets, per_sample_weights=psw_ref)
    want.backward(grad)
    emb = tieredemb.TieredEmbeddingBag(NUM, D, "sum", include_last_offset=True, optimizer=tieredemb.SGD(lr=1.0),
                                       _weight=weights(), cache_rows=16)
    if where == "device-tier":
        emb = device_tier(emb, 16)
    psw = torch.linspace(0.5, 1.5, 5, requires_grad=True)
    got = emb(ids, offsets, per_sample_weights=psw)
    got.backward(grad)
    torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(psw.grad, torch.cat([psw_ref.grad, torch.zeros(2)]), rtol=1e-5, atol=1e-5)
    rows = emb.read_rows(torch.arange(NUM))
    torch.testing.assert_close(rows, weights() - ref.weight.grad, rtol=1e-5, atol=1e-5)  # SGD, lr 1
    assert torch.equal(rows[[4, 5]], weights()[[4, 5]])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=["device-ids", "host-ids-narrowed"])
@pytest.mark.parametrize("n", [1, 7, 2500])
def test_the_device_dedup_gives_the_distinct_ids_inverse_and_grouping(dtype, n):
    """gpu/dedup.py on int64 ids (as device ids reach it) and int32 (host ids, once checked): the
    distinct ids ascending, -1 after; ids == unique[inverse]; U; each distinct id's occurrences
    in occurrence order, and start past U at N. (2500: several of the group kernel's blocks.)"""
    from tieredemb.gpu.dedup import dedup

    ids = (torch.rand(n, generator=torch.Generator().manual_seed(n)) ** 2 * 900).long().to(dtype)
    d = dedup(ids)
    expect = torch.unique(ids.long())
    u = len(expect)
    assert d.unique.dtype == d.inverse.dtype == torch.int64
    assert int(d.count) == u and torch.equal(d.unique[:u], expect) and (d.unique[u:] == -1).all()
    assert torch.equal(d.unique[d.inverse], ids.long())
    order, row, start = d.groups
    assert torch.equal(order, torch.sort(ids.long(), stable=True).indices) and torch.equal(row, d.inverse[order])
    assert torch.equal(start[:u], torch.searchsorted(ids.long()[order], expect)) and (start[u:] == n).all()


@pytest.mark.parametrize("width,cols,per_sm", [(7, 64, 8), (32, 64, None), (129, 64, 1), (129, 256, 8)])
def test_the_move_kernel_copies_rows_and_notes_them_written(width, cols, per_sm, monkeypatch):
    from tieredemb.gpu import PerMultiprocessor, moves
    from tieredemb.gpu.moves import WROTE, move_rows

    monkeypatch.setattr(moves, "MOVE_COLS", cols)  # (256: a row of 129 words in one round, not three)
    assert moves._launch_args(width, width)["COLS"] == min(cols, 1 << (width - 1).bit_length())
    # (per_sm None: a program a block of 16 rows; 1: one program takes every block, on CPU tensors)
    monkeypatch.setattr(moves, "MOVE_PROGRAMS", per_sm and PerMultiprocessor(per_sm))
    assert moves._grid(45, torch.empty(0), torch.empty(0)) == (1 if per_sm == 1 else 3,)

    g = torch.Generator().manual_seed(width)
    src, dst = torch.randn(50, width, generator=g), torch.randn(60, width, generator=g)
    src_rows = torch.randint(-1, 50, (45,), generator=g)  # (45: three of the kernel's programs)
    dst_rows = torch.randperm(60, generator=g)[:45]
    want = dst.clone()
    want[dst_rows[src_rows >= 0]] = src[src_rows[src_rows >= 0]]  # (a row with no source is left alone)
    move_rows(src, src_rows, dst, dst_rows)
    assert torch.equal(dst, want)
    # src_from: only the rows from there on; written: those moved noted WROTE; count: the first count[0]
    written = torch.zeros(60, dtype=torch.uint8)
    rows = torch.arange(45)
    move_rows(dst, rows, src, rows, written=written, count=torch.tensor([30]), src_from=10)
    assert torch.equal(src[10:30], dst[10:30]) and not torch.equal(src[:10], dst[:10])
    assert not torch.equal(src[30:45], dst[30:45])
    assert written.tolist() == [0] * 10 + [WROTE] * 20 + [0] * 30
    before = dst.clone()
    move_rows(src, torch.tensor([3, 4]), dst, torch.tensor([-1, 5]))  # (an entry with no destination moves nothing)
    assert torch.equal(dst[5], src[4]) and torch.equal(dst[torch.arange(60) != 5], before[torch.arange(60) != 5])


def test_a_moves_programs_are_counted_for_the_device_it_runs_on_whichever_side_is_host_rows(monkeypatch):
    """Host rows mapped into a GPU are CPU tensors to torch: a move that writes them down (the
    write-back, the lingering rows) gets the programs of the device its other side is on, not of
    one multiprocessor. (A tensor on torch's "meta" device stands in for device memory, and a
    device of 132 multiprocessors for an H100: this machine has none.)"""
    from tieredemb import gpu
    from tieredemb.gpu import PerMultiprocessor, moves, zerocopy

    monkeypatch.setattr(gpu, "multiprocessors", lambda device: 1 if device.type == "cpu" else 132)
    pool, host = torch.empty(8, 4, device="meta"), torch.empty(8, 4)
    blocks = 20000 // moves.MOVE_ROWS
    per_sm = moves.MOVE_PROGRAMS.count * 132
    assert moves._grid(20000, host, pool) == moves._grid(20000, pool, host) == (per_sm,)  # read in, written down
    assert moves._grid(20000, pool, host, PerMultiprocessor(2)) == (2 * 132,)
    assert moves._grid(20000, pool, host, zerocopy.WRITE_BACK_PROGRAMS) == (16,)  # (the write-back's: 16 in all)
    assert moves._grid(20000, pool, pool, PerMultiprocessor(64)) == (blocks,)  # (capped by the blocks)
    assert moves._grid(20000, host, host) == (moves.MOVE_PROGRAMS.count,)  # (CPU tensors: the interpreter's one)


@pytest.mark.parametrize("width,cols,per_sm", [(5, 64, None), (129, 64, 1), (129, 256, 8)])
def test_the_swap_kernel_writes_each_slots_victim_down_before_reading_its_miss_in(width, cols, per_sm, monkeypatch):
    """Each miss's slot: its dirty victim (if any) written down to the host rows first, noted
    WROTE; then the miss read in where its host row was ever written (counted), else marked."""
    from tieredemb.gpu import PerMultiprocessor, moves
    from tieredemb.gpu.moves import WROTE, swap_rows
    from tieredemb.tiers.rowstore import DEFERRED_MARK

    monkeypatch.setattr(moves, "MOVE_COLS", cols)  # (256: a row of 129 words in one round, not three)
    assert moves._launch_args(width, width)["COLS"] == min(cols, 1 << (width - 1).bit_length())
    # (per_sm None: a program a block of 16 rows; 1: one program takes every block, on CPU tensors)
    monkeypatch.setattr(moves, "MOVE_PROGRAMS", per_sm and PerMultiprocessor(per_sm))
    assert moves._grid(18, torch.empty(0), torch.empty(0)) == (1 if per_sm == 1 else 2,)

    g = torch.Generator().manual_seed(3)
    host, pool = torch.randn(40, width, generator=g), torch.randn(20, width, generator=g)
    written = (torch.rand(40, generator=g) < 0.5).to(torch.uint8)
    order = torch.randperm(40, generator=g)
    ids, victims = order[:18], torch.where(torch.rand(18, generator=g) < 0.6, order[20:38], -1)  # (disjoint)
    slots = torch.randperm(20, generator=g)[:18]
    slots[5] = -1  # (a slot < 0 takes nothing)
    found = torch.zeros(1, dtype=torch.int64)
    live = slots >= 0
    stored = live & (written[ids] != 0)
    want_host, want_pool, want_written = host.clone(), pool.clone(), written.clone()
    out = live & (victims >= 0)
    want_host[victims[out]] = pool[slots[out]]  # (the slot's row before the miss came)
    want_written[victims[out]] = WROTE
    want_pool[slots[stored]] = host[ids[stored]]
    want_pool.view(torch.int32)[slots[live & ~stored], 0] = DEFERRED_MARK
    swap_rows(pool, slots, victims, host, ids, mark=DEFERRED_MARK, written=written, found=found)
    assert torch.equal(pool.view(torch.int32), want_pool.view(torch.int32))  # (words: the marks are NaNs)
    assert torch.equal(host, want_host) and torch.equal(written, want_written) and int(found) == int(stored.sum())
    assert out.sum() > 3 and stored.sum() > 3 and (live & ~stored).sum() > 3
    assert (out & ~stored).sum() > 0  # (a victim written down from a slot whose miss is then marked)
    # no victims (None), and count: the first count[0] entries only
    before = pool.clone()
    found.zero_()
    written.fill_(1)
    swap_rows(pool, slots[:4], None, host, ids[:4], mark=DEFERRED_MARK, written=written, found=found,
              count=torch.tensor([2]))
    assert torch.equal(pool[slots[:2]], host[ids[:2]]) and int(found) == 2
    assert torch.equal(pool[slots[2:4]].view(torch.int32), before[slots[2:4]].view(torch.int32))
    # a count that ends in the second block of 16: the entries before it only
    before = pool.clone()
    swap_rows(pool, slots, None, host, ids, mark=DEFERRED_MARK, written=written, found=found,
              count=torch.tensor([17]))
    took = slots[:17] >= 0
    assert slots[17] >= 0 and torch.equal(pool[slots[:17][took]], host[ids[:17][took]])
    assert torch.equal(pool[slots[17]].view(torch.int32), before[slots[17]].view(torch.int32))
    with pytest.raises(ValueError, match="host rows of 4 words swapped with rows of"):
        swap_rows(pool, slots, None, host[:, :4], ids, mark=DEFERRED_MARK, written=written, found=found)


@pytest.mark.parametrize("per_sm,count", [(None, None), (1, 11)])
def test_a_staged_swap_leaves_the_victims_rows_for_a_write_back_apart(per_sm, count, monkeypatch):
    """staging=: each victim's row goes to staging row i (noted WROTE at once), the host rows
    untouched; once move_rows writes the block down (as ZeroCopy.write_back does), host rows,
    pool, written bits and found count equal the swap that writes the victims down itself. count:
    the entries from count[0] on neither stage nor read."""
    from tieredemb.gpu import PerMultiprocessor, moves
    from tieredemb.gpu.moves import move_rows, swap_rows
    from tieredemb.tiers.rowstore import DEFERRED_MARK

    monkeypatch.setattr(moves, "MOVE_PROGRAMS", per_sm and PerMultiprocessor(per_sm))
    width = 129
    g = torch.Generator().manual_seed(4)
    host, pool = torch.randn(40, width, generator=g), torch.randn(20, width, generator=g)
    written = (torch.rand(40, generator=g) < 0.5).to(torch.uint8)
    order = torch.randperm(40, generator=g)
    ids, victims = order[:18], torch.where(torch.rand(18, generator=g) < 0.6, order[20:38], -1)
    slots = torch.randperm(20, generator=g)[:18]
    slots[5] = -1  # (a slot < 0 takes nothing)
    counted = None if count is None else torch.tensor([count])
    want = [host.clone(), pool.clone(), written.clone(), torch.zeros(1, dtype=torch.int64)]
    swap_rows(want[1], slots, victims, want[0], ids, mark=DEFERRED_MARK, written=want[2], found=want[3],
              count=counted)
    host_before, pool_before = host.clone(), pool.clone()
    staging, found = torch.full((20, width), 7.0), torch.zeros(1, dtype=torch.int64)
    swap_rows(pool, slots, victims, host, ids, mark=DEFERRED_MARK, written=written, found=found, count=counted,
              staging=staging)
    assert torch.equal(host, host_before)  # (nothing written down yet)
    assert torch.equal(pool.view(torch.int32), want[1].view(torch.int32))
    assert torch.equal(written, want[2]) and int(found) == int(want[3])
    out = (slots >= 0) & (victims >= 0) & (torch.arange(18) < (18 if count is None else count))
    assert out.sum() > 3 and torch.equal(staging[:18][out], pool_before[slots[out]])
    assert (staging[:18][~out] == 7.0).all() and (staging[18:] == 7.0).all()
    move_rows(staging, torch.arange(18), host, victims, count=counted)
    assert torch.equal(host, want[0]) and not torch.equal(host, host_before)
    with pytest.raises(ValueError, match=r"a staging block of \(10, 129\) for 18 rows of 129 words: too small"):
        swap_rows(pool, slots, victims, host, ids, mark=DEFERRED_MARK, written=written, found=found,
                  staging=torch.empty(10, width))


@pytest.mark.parametrize("staged", [False, True])
def test_the_moves_leave_a_rows_pad_words_out(staged):
    """words=: only each row's first words move, by move_rows and by swap_rows (the victims' rows
    either way), the rest of every destination row left as it was; words from 1 to the width."""
    from tieredemb.gpu.moves import move_rows, swap_rows
    from tieredemb.tiers.rowstore import DEFERRED_MARK

    width, words = 32, 9
    g = torch.Generator().manual_seed(5)
    host, pool = torch.randn(40, width, generator=g), torch.randn(20, width, generator=g)
    written = torch.ones(40, dtype=torch.uint8)
    order = torch.randperm(40, generator=g)
    ids, victims, slots = order[:18], order[20:38], torch.randperm(20, generator=g)[:18]
    want_host, want_pool = host.clone(), pool.clone()
    want_host[victims, :words] = pool[slots, :words]
    want_pool[slots, :words] = host[ids, :words]
    staging = torch.full((18, width), 7.0) if staged else None
    swap_rows(pool, slots, victims, host, ids, mark=DEFERRED_MARK, written=written,
              found=torch.zeros(1, dtype=torch.int64), staging=staging, words=words)
    if staged:
        assert (staging[:, words:] == 7.0).all()
        move_rows(staging, torch.arange(18), host, victims, words=words)
    assert torch.equal(pool, want_pool) and torch.equal(host, want_host)
    for bad in (0, 33):
        with pytest.raises(ValueError, match=f"words={bad}: the words of a row moved must be from 1 to the row's 32"):
            move_rows(pool, slots, host, ids, words=bad)
    assert torch.equal(host, want_host)


def test_a_kernels_programs_are_one_per_item_a_positive_cap_or_so_many_per_multiprocessor():
    from tieredemb.gpu import PerMultiprocessor, programs

    cpu = torch.device("cpu")
    assert (programs(10, None, cpu), programs(10, 3, cpu), programs(2, 3, cpu)) == (10, 3, 2)
    assert (programs(100, PerMultiprocessor(32), cpu), programs(10, PerMultiprocessor(32), cpu)) == (32, 10)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=f"None \\(one per item\\), a positive int or a PerMultiprocessor, "
                                             f"got {bad!r}"):
            programs(10, bad, cpu)
        with pytest.raises(ValueError, match=f"programs per multiprocessor must be a positive int, got {bad!r}"):
            PerMultiprocessor(bad)


# (each case with one optimizer: zero_copy changes how rows move, not the update; both optimizers run)
# (prefetch at cache 8: no batch fits beside another, so each is made resident once none is in
# flight, the same whatever the worker's timing, and every counter can be compared; test_gpu.py's
# prefetch case at 100 rows cannot: see its _counted_alike)
@pytest.mark.parametrize("cache_rows, depth, dtype, opt, apart, align",
                         [(8, 0, torch.float32, "adam", True, 4), (64, 0, torch.float32, "rowwise", True, 4),
                          (8, 2, torch.float32, "rowwise", True, 4), (8, 0, torch.bfloat16, "adam", True, 4),
                          (8, 0, torch.float32, "rowwise", False, 4), (8, 2, torch.float32, "adam", False, 4),
                          (8, 0, torch.float32, "rowwise", True, 128), (8, 0, torch.bfloat16, "adam", False, 64)],
                         ids=["cache8-adam", "cache64-rowwise", "prefetch-rowwise", "bf16-adam", "inline-rowwise",
                              "inline-prefetch-adam", "aligned-rowwise", "aligned-inline-bf16-adam"])
def test_zero_copy_trains_bit_for_bit_as_the_host_copies(cache_rows, depth, dtype, opt, apart, align, monkeypatch):
    """zero_copy: tier 0's kernels read misses from the host rows and write dirty victims into them
    (apart: staged, then written down by a launch of their own: ZeroCopy.write_back; else by the
    swap itself), and which rows were ever written is known on the device (the host store is not
    called at all while training); the same outputs, rows, optimizer state and counters as the
    copies through host blocks, also across rows written from outside and a flush between the
    batches. (cache 8: overflow slots and lingering rows leaving and coming back.) Without
    prefetch every residency is queued with no wait (ZeroCopy.residency: its counts on the
    device). align: the zero-copy table's rows padded to that many bytes (row_alignment; the
    copies' are not), which its moves leave out: the pad words stay zero in the host rows."""
    from tieredemb.gpu import zerocopy
    from tieredemb.tiers.host_store import HostStore

    monkeypatch.setattr(zerocopy, "WRITE_BACK_APART", apart)

    def make(zero_copy):
        emb = tieredemb.TieredEmbeddingBag(NUM, D, "sum", optimizer=OPTIMIZERS[opt](), cache_rows=cache_rows, seed=2,
                                           dtype=dtype, row_alignment=align if zero_copy else 4)
        emb.write_rows(torch.arange(0, NUM, 7), weights()[:len(range(0, NUM, 7))])  # some rows stored, the rest drawn
        return device_tier(emb, cache_rows, zero_copy=zero_copy)

    def between(emb):  # rows written from outside, some held in tier 0, most not; then every row flushed down
        emb.write_rows(torch.arange(3, NUM, 11), weights()[:len(range(3, NUM, 11))] * 2)
        emb.flush()

    data = batches(seed=6, steps=6)
    plain = make(False)
    plain_outs = train(plain, data[:3], depth=depth)
    between(plain)
    plain_outs += train(plain, data[3:], depth=depth)
    copied = make(True)
    assert copied._store.tier0.zero_copy.rows is copied._store.host_store.rows
    assert (copied.layout.pad > 0) == (align != 4)  # (aligned: rows that are padded)
    outs, write_backs = [], []
    for first, part in ((True, data[:3]), (False, data[3:])):
        with monkeypatch.context() as m:
            for name in ("read_to", "write_from", "locate", "wrote_in_place"):
                m.setattr(HostStore, name, lambda *a, _n=name, **k: pytest.fail(f"HostStore.{_n} called with zero_copy"))
            write_back = zerocopy.ZeroCopy.write_back
            m.setattr(zerocopy.ZeroCopy, "write_back", lambda self, *a, **k: (write_backs.append(1),
                                                                              write_back(self, *a, **k))[1])
            if depth == 0:  # (the training thread's residencies are queued: no plan waits to read its counts)
                m.setattr(SetIndex, "_plan", lambda *a, **k: pytest.fail("a zero_copy residency waited for its plan"))
            outs += train(copied, part, depth=depth)
        if first:
            between(copied)
            # (the pool's pad words spoiled on purpose: moves that carried them would spoil the host rows')
            copied._store.tier0.pool.rows[:, copied.layout.words:] = 7.0
    assert [torch.equal(a, b) for a, b in zip(outs, plain_outs)] == [True] * 6
    assert (len(write_backs) >= 6) if apart else not write_backs  # (every batch evicts dirty rows here)
    st, st_plain = copied.stats(), plain.stats()
    assert st["store"] == st_plain["store"] and st["store"]["rows_written"] > 0
    counted = lambda emb, st: {k: st["tier0"][k] / (emb.layout.words * 4 if k.startswith("bytes") else 1)  # noqa: E731
                               for k in ("hits", "misses", "bytes_in", "bytes_out")}  # (zero-copy moves no pad)
    assert counted(copied, st) == counted(plain, st_plain)
    assert torch.equal(rows_and_state(copied).view(torch.int32), rows_and_state(plain).view(torch.int32))
    words, host_rows = copied.layout.words, copied._store.host_store.rows
    assert copied.width == (plain.width if align == 4 else 32)  # (9 or 20 words padded to 32)
    assert (host_rows[:, words:] == 0).all() and (host_rows[:, :words] != 0).any(1).sum() > NUM // 2


def test_zero_copy_is_refused_where_no_host_rows_sit_right_below(tmp_path):
    emb = tieredemb.TieredEmbeddingBag(NUM, D, cache_rows=8, host_rows=40)
    with pytest.raises(ValueError, match="zero_copy needs the table's rows in host memory right below tier 0"):
        device_tier(emb, 8, zero_copy=True)


@pytest.mark.parametrize("order", ["reversed", "shuffled"])
def test_the_interpreter_can_run_a_launchs_programs_out_of_order(order, request):
    """conftest's --program-order, which shows a kernel that depends on the order of its programs
    (a GPU keeps none), does reorder them: each program takes a ticket as it runs."""
    if request.config.getoption("--program-order") != "grid":
        pytest.skip("this run already reorders every launch's programs")
    import triton
    import triton.language as tl
    from conftest import program_order

    @triton.jit
    def ticket(counter, out):
        tl.store(out + tl.atomic_add(counter, 1), tl.program_id(0) * 4 + tl.program_id(1))

    def run():
        counter, out = torch.zeros(1, dtype=torch.int32), torch.full((24,), -1, dtype=torch.int32)
        ticket[(6, 4)](counter, out)
        return out.tolist()

    assert run() == list(range(24))
    undo = program_order(order, seed=3)
    try:
        seen = run()
    finally:
        undo()
    assert sorted(seen) == list(range(24))
    assert seen == (list(range(23, -1, -1)) if order == "reversed" else seen) and seen != list(range(24))
    assert run() == list(range(24))


def _trained_beside_a_cpu_table(zero_copy: bool):
    """A tier 0 of 8 rows on CPU tensors and the CPU engine's table, both trained on the same 3
    batches: (the device table, the CPU one, the batches)."""
    kw = dict(optimizer=tieredemb.SGD(lr=0.1), _weight=weights(), cache_rows=8)
    emb = device_tier(tieredemb.TieredEmbeddingBag(NUM, D, "sum", **kw), 8, zero_copy=zero_copy)
    ref = tieredemb.TieredEmbeddingBag(NUM, D, "sum", **kw)
    data = batches(steps=3)
    train(emb, data)
    train(ref, data)
    return emb, ref, data


def _reads_as(emb, ref) -> None:
    """Every row of emb reads as ref's, before and after emb's flush (within float tolerance: the
    GPU path's sums have other orders)."""
    every = torch.arange(NUM)
    torch.testing.assert_close(emb.read_rows(every), ref.read_rows(every), rtol=1e-5, atol=1e-5)
    emb.flush()
    torch.testing.assert_close(emb.read_rows(every), ref.read_rows(every), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("zero_copy", [False, True], ids=["waiting", "zero_copy"])
def test_a_residency_that_fails_after_its_moves_changes_no_value(zero_copy):
    """A residency that failed after the misses' rows were moved into the victims' slots, before
    the commit (a CUDA out-of-memory inside it, a KeyboardInterrupt: injected here, as neither can
    be had on CPU tensors), left the victims' ids naming slots that held other rows; a flush then
    wrote those under the victims' ids. The slots are emptied now: every row reads as before."""
    emb, ref, data = _trained_beside_a_cpu_table(zero_copy)
    index = emb._store.tier0.index
    name = "commit_queued" if zero_copy else "commit"  # (zero-copy's residencies are queued: gpu/queued.py)

    def failing(plan, pin):
        raise MemoryError("injected: out of memory in the commit")

    setattr(index, name, failing)
    with pytest.raises(MemoryError, match="injected"):
        emb(torch.arange(250, 258), torch.tensor([0]))
    delattr(index, name)
    _reads_as(emb, ref)
    train(emb, data)
    train(ref, data)
    torch.testing.assert_close(rows_and_state(emb), rows_and_state(ref), rtol=1e-5, atol=1e-5)


def test_a_grow_out_of_memory_changes_nothing(monkeypatch):
    """Adding overflow slots grew the index first, then allocated the grown pool: out of memory
    there (injected: a GPU's cannot be had on CPU tensors) left the index larger than the pool, and
    the next batch's overflow slots past the pool's end. The pool is allocated first now."""
    from tieredemb.gpu import tier as tier_module

    kw = dict(optimizer=tieredemb.SGD(lr=0.1), _weight=weights(3000), cache_rows=8)
    emb = device_tier(tieredemb.TieredEmbeddingBag(3000, D, "sum", **kw), 8)
    ref = tieredemb.TieredEmbeddingBag(3000, D, "sum", **kw)
    tier = emb._store.tier0
    zeros = torch.zeros

    def out_of_memory(*shape, **kwargs):
        if len(shape) == 2 and shape[1] == tier.width and shape[0] > tier.pool.rows.shape[0]:
            raise torch.OutOfMemoryError("injected: out of memory for the grown pool")
        return zeros(*shape, **kwargs)

    ids, offsets = torch.arange(1500), torch.arange(0, 1500, 10)
    monkeypatch.setattr(tier_module.torch, "zeros", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        emb(ids, offsets)
    monkeypatch.setattr(tier_module.torch, "zeros", zeros)
    assert tier.index.slots_total <= tier.pool.rows.shape[0]
    for table in (emb, ref):
        table(ids, offsets).sum().backward()
    every = torch.arange(3000)
    torch.testing.assert_close(emb.read_rows(every), ref.read_rows(every), rtol=1e-5, atol=1e-5)


def test_an_interrupt_between_zero_copys_swap_and_its_write_back_changes_no_value(monkeypatch):
    """Zero-copy swaps the misses' rows into the victims' slots and the dirty victims' rows into a
    staging block, then writes the block down: an interrupt between (injected at the write-back's
    call) lost those victims' rows and left their ids naming other rows (8 rows wrong, also after
    a flush). The block is written down all the same now, and the slots are emptied."""
    from tieredemb.gpu import zerocopy

    emb, ref, _ = _trained_beside_a_cpu_table(zero_copy=True)
    write_back, calls = zerocopy.ZeroCopy.write_back, []

    def interrupted_once(self, pending, replayed=False):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return write_back(self, pending, replayed)

    monkeypatch.setattr(zerocopy.ZeroCopy, "write_back", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        emb(torch.arange(250, 258), torch.tensor([0]))
    monkeypatch.undo()
    assert len(calls) == 2  # (the staging block was there: the path under test was taken)
    _reads_as(emb, ref)
