"""Bad input: every rejected call raises a clear error that names the bad value and the rule,
and changes nothing in any tier (invariant 5): rows, optimizer state, residency, dirty bits,
pins, stats and the step count are all as they were."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import tieredemb as te

N, D = 30, 4


def make_trained(mode: str = "sum", optimizer=None, **kw) -> te.TieredEmbeddingBag:
    """A table whose rows are spread over every tier: dirty in tier 0, dirty and clean in the host
    cache, written back to the store, and never touched."""
    kw = {"cache_rows": 3, "host_rows": 6, **kw}
    m = te.TieredEmbeddingBag(N, D, mode, optimizer=optimizer or te.Adagrad(lr=0.3), **kw)
    g = torch.Generator().manual_seed(0)
    for batch in ([0, 1, 2], [3, 4, 5], [6, 7], [8, 9, 0], [10, 11, 12], [1, 13], [14, 3, 15]):
        out = m(torch.tensor(batch), torch.tensor([0, 1]))
        (out * torch.randn(out.shape, generator=g)).sum().backward()
    with torch.no_grad():  # clean reads too
        m(torch.tensor([20, 21]), torch.tensor([0]))
    return m


def snapshot(m) -> dict:
    ids = torch.arange(m.num_embeddings)
    tiers = m._store.tiers + [m._store.bottom]
    return {
        "rows": m.read_rows(ids).clone(),
        "state": m.read_optimizer_state(ids).clone(),
        # (the backing store counts every row read, these snapshots' own reads included)
        "stats": {**m.stats(), "store": m.stats()["store"]["rows_stored"]},
        "resident": [t.index.resident_ids(0, -1).tolist() for t in tiers],
        "slots": [t.index.lookup(ids).tolist() for t in tiers],
        "dirty": [sorted(t.index.dirty_rows()[0].tolist()) for t in tiers],
        "pinned": [t.index.pinned for t in tiers],
        "step": m.step,
    }


def assert_same(a: dict, b: dict) -> None:
    assert torch.equal(a["rows"], b["rows"])
    assert torch.equal(a["state"], b["state"])
    for key in ("stats", "resident", "slots", "dirty", "pinned", "step"):
        assert a[key] == b[key], key


def test_fixture_spreads_rows_over_the_tiers():
    # The checks below are only meaningful if there is state in every tier to disturb.
    m = make_trained()
    assert [t.name for t in m._store.tiers + [m._store.bottom]] == ["tier0", "host", "store"]
    s = snapshot(m)
    assert s["dirty"][0] and s["dirty"][1] and s["resident"][2]
    assert m.stats()["tier0"]["dirty_writebacks"] > 0 and m.stats()["host"]["dirty_writebacks"] > 0


# -- forward: ids -----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [N, N + 1000, -1, 2**40])
def test_id_out_of_range_names_the_id_and_the_range(bad):
    m = make_trained()
    before = snapshot(m)
    # The valid ids of the batch come first: they must not have been made resident either.
    ids = torch.tensor([22, 23, bad, 24])
    with pytest.raises(IndexError) as e:
        m(ids, torch.tensor([0, 2]))
    assert str(bad) in str(e.value) and f"[0, {N})" in str(e.value)
    assert_same(before, snapshot(m))


def test_id_out_of_range_in_2d_input_and_in_training():
    m = make_trained()
    before = snapshot(m)
    with pytest.raises(IndexError, match=str(N + 5)):
        m(torch.tensor([[1, 2], [N + 5, 3]]))
    with torch.no_grad(), pytest.raises(IndexError, match=str(N + 5)):
        m(torch.tensor([[1, 2], [N + 5, 3]]))
    assert_same(before, snapshot(m))


def test_embedding_id_out_of_range():
    m = te.TieredEmbedding(N, D, cache_rows=3, host_rows=6, optimizer=te.SGD(lr=0.5))
    out = m(torch.tensor([[0, 1], [2, 2]]))
    out.sum().backward()
    before = snapshot(m)
    with pytest.raises(IndexError, match=rf"{N} out of range \[0, {N}\)"):
        m(torch.tensor([[5, N]]))
    assert_same(before, snapshot(m))


@pytest.mark.parametrize("ids", [torch.tensor([1.0, 2.0]), torch.tensor([True, False]), [1, 2],
                                 torch.tensor([1 + 0j, 2 + 0j])], ids=["float", "bool", "list", "complex"])
def test_non_integer_ids_are_a_type_error(ids):
    m = make_trained()
    before = snapshot(m)
    with pytest.raises(TypeError, match="input"):
        m(ids, torch.tensor([0]))
    assert_same(before, snapshot(m))


def test_embedding_non_integer_ids_are_a_type_error():
    m = te.TieredEmbedding(N, D, cache_rows=3)
    with pytest.raises(TypeError, match="float"):
        m(torch.tensor([[0.0, 1.0]]))


@pytest.mark.parametrize("shape", [(3, 0), (0, 0)])
def test_2d_bag_input_without_ids(shape):
    m = make_trained()
    before = snapshot(m)
    with pytest.raises(ValueError, match=rf"input of shape \({shape[0]}, 0\): a 2-D input's bags \(rows\) need"):
        m(torch.zeros(shape, dtype=torch.int64))  # (a ZeroDivisionError before)
    assert_same(before, snapshot(m))


@pytest.mark.parametrize("shape", [(2, 2, 2), ()])
def test_bag_input_of_wrong_rank(shape):
    m = make_trained()
    before = snapshot(m)
    with pytest.raises(ValueError, match="1-D"):
        m(torch.zeros(shape, dtype=torch.int64), None if shape else torch.tensor([0]))
    assert_same(before, snapshot(m))


# -- forward: offsets -------------------------------------------------------------------------


@pytest.mark.parametrize("offsets, match", [
    (torch.tensor([0.0, 2.0]), "offsets"),
    (torch.tensor([0, 2], dtype=torch.float64), "offsets"),
    ([0, 2], "offsets"),
], ids=["float32", "float64", "list"])
def test_non_integer_offsets_are_a_type_error(offsets, match):
    m = make_trained()
    before = snapshot(m)
    with pytest.raises(TypeError, match=match):
        m(torch.tensor([1, 2, 3]), offsets)
    assert_same(before, snapshot(m))


@pytest.mark.parametrize("offsets, include_last, match", [
    ([0, 3, 2], False, r"non-decreasing: offsets\[2\] = 2 < offsets\[1\] = 3"),
    ([0, 2, 5], False, "offsets\\[-1\\] = 5 is past the end of input \\(length 4\\)"),
    ([0, 2, 5], True, "past the end"),
    ([1, 2], False, "offsets\\[0\\] must be 0.*got 1"),
    ([-1, 2], False, "offsets\\[0\\] must be 0.*got -1"),
    ([], True, "empty"),
], ids=["decreasing", "past-end", "past-end-last", "first-not-0", "negative", "empty-last"])
def test_bad_offsets_are_a_value_error(offsets, include_last, match):
    m = make_trained(include_last_offset=include_last)
    before = snapshot(m)
    with pytest.raises(ValueError, match=match):
        m(torch.tensor([1, 2, 22, 23]), torch.tensor(offsets, dtype=torch.int64))
    assert_same(before, snapshot(m))


def test_offsets_with_2d_input_or_missing_with_1d_input():
    m = make_trained()
    before = snapshot(m)
    with pytest.raises(ValueError, match="offsets must be None"):
        m(torch.tensor([[1, 2], [3, 22]]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="offsets is required"):
        m(torch.tensor([1, 2, 22]))
    with pytest.raises(ValueError, match="offsets must be 1-D"):
        m(torch.tensor([1, 2, 22]), torch.tensor([[0, 1]]))
    assert_same(before, snapshot(m))


# -- forward: per_sample_weights --------------------------------------------------------------


@pytest.mark.parametrize("psw_shape", [(3,), (5,), (4, 1), (2, 2)])
def test_per_sample_weights_of_the_wrong_shape(psw_shape):
    m = make_trained("sum")
    before = snapshot(m)
    with pytest.raises(ValueError, match=r"per_sample_weights has shape .*expected input's shape \(4,\)"):
        m(torch.tensor([1, 2, 22, 23]), torch.tensor([0, 2]), per_sample_weights=torch.ones(psw_shape))
    assert_same(before, snapshot(m))


def test_per_sample_weights_of_the_wrong_shape_2d():
    m = make_trained("sum")
    before = snapshot(m)
    with pytest.raises(ValueError, match="per_sample_weights has shape"):
        m(torch.tensor([[1, 2], [22, 23]]), per_sample_weights=torch.ones(4))
    assert_same(before, snapshot(m))


@pytest.mark.parametrize("mode", ["mean", "max"])
def test_per_sample_weights_need_mode_sum(mode):
    m = make_trained(mode)
    before = snapshot(m)
    with pytest.raises(ValueError, match=f"mode='sum'.*mode='{mode}'"):
        m(torch.tensor([1, 2, 22, 23]), torch.tensor([0, 2]), per_sample_weights=torch.ones(4))
    assert_same(before, snapshot(m))


def test_integer_per_sample_weights_are_a_type_error():
    m = make_trained("sum")
    before = snapshot(m)
    with pytest.raises(TypeError, match="per_sample_weights"):
        m(torch.tensor([1, 2, 22, 23]), torch.tensor([0, 2]), per_sample_weights=torch.ones(4, dtype=torch.int64))
    assert_same(before, snapshot(m))


# -- pins (invariant 2 meets invariant 5) -----------------------------------------------------


def test_bad_batch_beside_pinned_rows_changes_nothing():
    m = make_trained(cache_rows=4, host_rows=8)
    held = m(torch.tensor([22, 23, 24]), torch.tensor([0]))  # in flight: 3 of 4 slots pinned
    before = snapshot(m)
    with pytest.raises(IndexError, match=str(N + 3)):  # would need overflow slots, and has a bad id
        m(torch.tensor([25, 26, 1, N + 3]), torch.tensor([0]))
    assert_same(before, snapshot(m))
    m(torch.tensor([25, 26, 1]), torch.tensor([0])).sum().backward()  # fits through overflow slots
    held.sum().backward()
    assert m._store.tier0.index.pinned == 0


# -- backward ---------------------------------------------------------------------------------


def test_backward_without_optimizer_is_a_runtime_error_naming_the_optimizer():
    m = te.TieredEmbeddingBag(N, D, "sum", cache_rows=3, host_rows=6)
    out = m(torch.tensor([1, 2, 3]), torch.tensor([0]))
    rows = m.read_rows(torch.arange(N)).clone()
    with pytest.raises(RuntimeError, match="optimizer"):
        out.sum().backward()
    assert torch.equal(m.read_rows(torch.arange(N)), rows)
    assert m.step == 0
    assert m._store.tier0.index.pinned == 0  # the failed backward still released its batch
    assert m._store.tier0.index.dirty_rows()[0].tolist() == []


def test_backward_twice_is_refused_and_updates_once():
    m = make_trained()
    out = m(torch.tensor([1, 22]), torch.tensor([0]))
    loss = out.sum()
    loss.backward(retain_graph=True)
    after_one = snapshot(m)
    with pytest.raises(RuntimeError, match="released before backward"):
        loss.backward()
    assert_same(after_one, snapshot(m))


@pytest.mark.parametrize("changed", ["offsets", "per_sample_weights"])
def test_inputs_changed_in_place_before_backward_are_refused(changed):
    # torch's EmbeddingBag raises here (its saved tensors' versions); so must we, before any update:
    # the offsets (int64 with include_last_offset: no copy is made) and the weights are the caller's.
    m = make_trained(include_last_offset=True)
    offsets, psw = torch.tensor([0, 1, 4]), torch.ones(4)
    out = m(torch.tensor([1, 22, 23, 24]), offsets, per_sample_weights=psw)
    rows, state, step = m.read_rows(torch.arange(N)).clone(), m.read_optimizer_state(torch.arange(N)).clone(), m.step
    (offsets if changed == "offsets" else psw)[1] = 3  # a loader reusing its buffer
    with pytest.raises(RuntimeError, match=f"the {changed} its forward used were modified in place"):
        out.sum().backward()
    assert torch.equal(m.read_rows(torch.arange(N)), rows)
    assert torch.equal(m.read_optimizer_state(torch.arange(N)), state)
    assert m.step == step and m._store.tier0.index.pinned == 0


# -- read_rows / write_rows -------------------------------------------------------------------


def test_read_rows_rejects_bad_ids():
    m = make_trained()
    before = snapshot(m)
    with pytest.raises(IndexError, match=rf"id {N} out of range \[0, {N}\)"):
        m.read_rows(torch.tensor([0, N]))
    with pytest.raises(IndexError, match="-3"):
        m.read_optimizer_state([-3])
    with pytest.raises(TypeError, match="integer"):
        m.read_rows(torch.tensor([0.5]))
    assert_same(before, snapshot(m))


@pytest.mark.parametrize("case", ["values-rows", "values-dim", "state-shape", "duplicate", "out-of-range",
                                  "negative", "int-values", "float-ids"])
def test_write_rows_rejects_bad_input(case):
    m = make_trained()
    before = snapshot(m)
    ids, vals, state = torch.tensor([1, 22, 5]), torch.full((3, D), 7.0), None
    exc, match = ValueError, None
    if case == "values-rows":
        vals, match = torch.full((2, D), 7.0), r"values has shape \(2, 4\), expected \(3, 4\)"
    elif case == "values-dim":
        vals, match = torch.full((3, D + 1), 7.0), r"values has shape \(3, 5\), expected \(3, 4\)"
    elif case == "state-shape":
        state, match = torch.zeros(3, D + 1), r"optimizer_state has shape \(3, 5\), expected \(3, 4\)"
    elif case == "duplicate":
        ids, match = torch.tensor([1, 22, 1]), "unique"
    elif case == "out-of-range":
        ids, exc, match = torch.tensor([1, 22, N]), IndexError, rf"{N} out of range \[0, {N}\)"
    elif case == "negative":
        ids, exc, match = torch.tensor([-1, 22, 5]), IndexError, "-1"
    elif case == "int-values":
        vals, exc, match = torch.full((3, D), 7), TypeError, "floating point"
    elif case == "float-ids":
        ids, exc, match = torch.tensor([1.0, 22.0, 5.0]), TypeError, "integer"
    with pytest.raises(exc, match=match):
        m.write_rows(ids, vals, state)
    assert_same(before, snapshot(m))


# -- constructor and optimizer arguments ------------------------------------------------------


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"policy": "fifo"}, ValueError, "'fifo'"),
    ({"cache_rows": -4}, ValueError, "cache_rows.*-4"),
    ({"cache_rows": 0}, ValueError, "cache_rows"),
    ({"host_rows": -1}, ValueError, "host_rows.*-1"),
    ({"cache_rows": 1.5}, TypeError, "cache_rows.*1.5"),
    ({"cache_rows": True}, TypeError, "cache_rows"),
    ({"cache_rows": "lots"}, ValueError, "'lots'"),
    ({"cache_rows": 8, "host_rows": 4}, ValueError, "host_rows 4 < the 8 rows of tier 0"),
    ({"mode": "median"}, ValueError, "'median'"),
    ({"num_embeddings": 0}, ValueError, "num_embeddings.*0"),
    ({"num_embeddings": 10.0}, ValueError, "num_embeddings"),
    ({"embedding_dim": -2}, ValueError, "embedding_dim.*-2"),
    ({"padding_idx": N}, ValueError, f"padding_idx {N} out of range"),
    ({"padding_idx": -N - 1}, ValueError, "padding_idx"),
    ({"seed": -1}, ValueError, "seed.*-1"),
    ({"seed": 2**64}, ValueError, r"seed must be an int in \[0, 2\*\*64\), got 18446744073709551616"),
    ({"dtype": torch.float64}, ValueError, "float64"),
    ({"device": "meta"}, ValueError, "meta"),
    ({"optimizer": "sgd"}, TypeError, "optimizer"),
], ids=lambda v: repr(v) if not isinstance(v, dict) else "-".join(map(str, v)))
def test_constructor_rejects_bad_arguments(kwargs, exc, match):
    args = {"num_embeddings": N, "embedding_dim": D, "mode": "sum", **kwargs}
    with pytest.raises(exc, match=match):
        te.TieredEmbeddingBag(args.pop("num_embeddings"), args.pop("embedding_dim"), args.pop("mode"), **args)


def test_torch_optimizer_is_rejected():
    with pytest.raises(TypeError, match="tieredemb optimizer"):
        te.TieredEmbedding(N, D, optimizer=torch.optim.SGD)


@pytest.mark.parametrize("make, match", [
    (lambda: te.SGD(lr=-0.1), "lr=-0.1"),
    (lambda: te.SGD(lr=float("nan")), "lr=nan"),
    (lambda: te.SGD(lr=float("inf")), "lr=inf"),
    (lambda: te.Adagrad(lr=-1.0), "lr=-1.0"),
    (lambda: te.Adagrad(lr=0.1, eps=0.0), "eps=0.0"),
    (lambda: te.RowWiseAdagrad(lr=0.1, eps=-1e-8), "eps"),
    (lambda: te.Adam(lr=-1e-3), "lr"),
    (lambda: te.Adam(betas=(1.0, 0.999)), "betas"),
    (lambda: te.Adam(betas=(0.9, -0.1)), "betas"),
    (lambda: te.Adam(eps=0.0), "eps"),
    (lambda: te.MomentumScaledRowWiseAdagrad(lr=0.1, scale=0), r"scale=0: must be > 0"),
    (lambda: te.MomentumScaledRowWiseAdagrad(lr=0.1, scale=float("inf")), "scale=inf"),
    # (each of these was accepted, then failed or overflowed at the first lookup or update)
    (lambda: te.SGD(lr=1e40), r"lr=1e\+40: must be a real number float32 holds \(finite, not rounding to 0\)"),
    (lambda: te.Adagrad(lr=0.1, eps=1e-50), r"eps=1e-50: must be a real number float32 holds"),  # (0: nan rows)
    (lambda: te.Adagrad(lr=0.1, eps="1e-8"), "eps='1e-8'"),
    (lambda: te.Adam(betas=(0.9,)), r"betas=\(0.9,\): must be two numbers"),
    (lambda: te.Adam(betas=(0.9, 1.0)), r"betas\[1\]=1.0: must be in \[0, 1\)"),
    (lambda: te.Init("normal", "0", 1.0), "init 'normal': a='0' must be a finite real number"),
    (lambda: te.Init("normal", 0.0, float("nan")), "b=nan must be a finite real number"),
    (lambda: te.Init("normal", 0.0, -1.0), r"b=-1.0 \(the std\) must be >= 0"),
    (lambda: te.Init("uniform", 1.0, 0.0), r"a=1.0 \(low\) must be <= b=0.0"),
    # (a review: rows of inf, and a forward of inf or nan)
    (lambda: te.Init("uniform", -1e39, 1e39), r"a=-1e\+39 must be a finite real number float32 holds"),
    (lambda: te.Init("normal", 0, 1e300), r"b=1e\+300 must be a finite real number float32 holds"),
], ids=["sgd-neg-lr", "sgd-nan-lr", "sgd-inf-lr", "adagrad-neg-lr", "adagrad-eps0", "rowwise-eps",
        "adam-neg-lr", "adam-beta1", "adam-beta2", "adam-eps0", "msrowwise-scale0", "msrowwise-scale-inf",
        "sgd-lr-past-float32", "adagrad-eps-rounds-to-0", "adagrad-eps-str", "adam-one-beta", "adam-beta2-1",
        "init-str", "init-nan", "init-neg-std", "init-uniform-reversed", "init-past-float32", "init-std-past-float32"])
def test_bad_optimizer_and_init_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_numpy_numbers_are_numbers():
    # (a review: numpy ints were refused by TableConfig, padding_idx 3 as "out of range [-20, 20)")
    c = te.TableConfig(np.int64(20), np.int32(4), padding_idx=np.int64(3), cache_rows=np.int64(4), host_rows=np.int8(9))
    assert (c.num_embeddings, c.embedding_dim, c.padding_idx, c.cache_rows, c.host_rows) == (20, 4, 3, 4, 9)
    assert all(type(v) is int for v in (c.num_embeddings, c.embedding_dim, c.padding_idx, c.cache_rows))
    with pytest.raises(ValueError, match=r"padding_idx 3.0 must be an int in \[-20, 20\)"):
        te.TableConfig(20, 4, padding_idx=3.0)
    te.Adagrad(lr=np.float64(0.1), eps=np.float32(1e-8))
    te.Adam(betas=np.array([0.9, 0.999]))
    te.Adam(betas=(np.float32(0.9), 0.999))
    te.Init("uniform", np.float32(-0.1), 0.1)


def test_rejected_constructor_does_not_disturb_a_live_table():
    # Each table owns its tiers: a failed construction next to a trained table leaves it intact.
    m = make_trained()
    before = snapshot(m)
    with pytest.raises(ValueError):
        te.TieredEmbeddingBag(N, D, "sum", cache_rows=8, host_rows=2)
    gc.collect()
    assert_same(before, snapshot(m))


@pytest.mark.parametrize("backend", ["log", "rocksdb"])
def test_a_closed_table_refuses_its_rows(tmp_path, backend):
    """A review: write_rows after close() was taken for rows still in tier 0 and then lost (the
    reopened table held the old values); reads answered for resident rows only."""
    m = te.TieredEmbeddingBag(N, D, "sum", optimizer=te.SGD(lr=0.1), cache_rows=4, ssd_path=tmp_path / "t",
                              ssd_options={"backend": backend})
    m.write_rows(torch.arange(6), torch.zeros(6, D))
    m(torch.tensor([1, 2]), torch.tensor([0])).sum().backward()  # (rows 1 and 2 in tier 0)
    before = m.read_rows(torch.arange(6))
    m.close()
    for call in (lambda: m.write_rows(torch.tensor([1, 2]), torch.full((2, D), 7.0)),
                 lambda: m.read_rows(torch.tensor([1])), lambda: m.read_optimizer_state(torch.tensor([1]))):
        with pytest.raises(RuntimeError, match=r"is closed \(close\(\) let its store go\)"):
            call()
    m = None  # (the table lets its directory go)
    gc.collect()
    reopened = te.TieredEmbeddingBag(N, D, "sum", optimizer=te.SGD(lr=0.1), cache_rows=4, ssd_path=tmp_path / "t")
    assert torch.equal(reopened.read_rows(torch.arange(6)), before)


@pytest.mark.parametrize("weight, error", [(torch.zeros(N, D + 1), r"_weight has shape \(30, 5\), expected \(30, 4\)"),
                                           (torch.zeros(N, D, dtype=torch.int64),
                                            r"_weight must be floating point, got torch.int64")])
def test_a_table_refused_for_its_weight_makes_no_store(tmp_path, weight, error):
    """A review: the SSD table was made before _weight was checked, and the corrected call was
    then refused for the stored width of the first."""
    with pytest.raises((ValueError, TypeError), match=error):
        te.TieredEmbeddingBag(N, D, ssd_path=tmp_path / "t", _weight=weight)
    assert not (tmp_path / "t").exists()
    t = te.TieredEmbeddingBag(N, D, ssd_path=tmp_path / "t", _weight=torch.ones(N, D))
    assert torch.equal(t.read_rows(torch.tensor([3])), torch.ones(1, D))


def test_errors_that_named_python_internals_name_the_value():
    """A review of bad input: each of these raised an AttributeError, a numba TypingError or
    nanobind's, or was truncated silently (float lengths, float sizes)."""
    from tieredemb import metrics, planner, sim
    from training import KJT

    ebc = te.TieredEmbeddingBagCollection([te.EmbeddingBagConfig("t", 10, 4, ["a"])])
    for lengths in (torch.tensor([1.9, 1.9, 0.2]), torch.tensor([[2, 2]]), [2, 2]):
        with pytest.raises(ValueError, match=r"KeyedJaggedTensor: lengths must be a 1-D integer tensor, got "):
            ebc(KJT(["a"], torch.tensor([1, 2, 3, 4]), lengths))
    trace = {"t": (np.arange(20) % 10, np.array([0, 10, 20]))}
    for kw, error, match in [(dict(bandwidth=5), TypeError, r"bandwidth must be a planner.Bandwidth"),
                             (dict(train="no"), TypeError, r"train must be True or False, got 'no'")]:
        with pytest.raises(error, match=match):
            planner.plan(trace, {"t": (10, 64)}, cache_bytes=10_000, **kw)
    with pytest.raises(ValueError, match=r"table 't': a trace is a pair \(ids, batch offsets\), got tuple of 3"):
        planner.plan({"t": (*trace["t"], None)}, {"t": (10, 64)}, cache_bytes=10_000)
    assert planner.Bandwidth(np.float32(1e9)).to_tier0 == 1e9
    with pytest.raises(ValueError, match=r"bandwidth ssd must be a finite number > 0 of bytes/s, got inf"):
        planner.Bandwidth(ssd=float("inf"))
    keys, offsets = np.arange(200) % 50, np.arange(0, 201, 10)
    with pytest.raises(sim.SimError, match=r"capacity 1180591620717411303424 must be a positive integer number of rows, "
                                           r"below 2\*\*63"):
        sim.simulate(keys, offsets, "lru", [2**70])
    with pytest.raises(sim.SimError, match=r"sizes must be whole row counts below 2\*\*63, got float64 \[20.5\]"):
        sim.mrc(keys, offsets, [20.5])
    with pytest.raises(sim.SimError, match=r"points 0 must be a whole number >= 1"):
        sim.mrc(keys, offsets, points=0)
    with pytest.raises(TypeError, match=r"'x': int is not a tiered table or collection"):
        metrics.prometheus({"x": 3})
    t = te.TieredEmbeddingBag(N, D, optimizer=te.Adagrad(lr=0.1))
    assert t.read_rows([]).shape == (0, D)
    t.write_rows([1], torch.ones(1, D), optimizer_state=[[0.5] * D])
    assert t.read_optimizer_state([1]).tolist() == [[0.5] * D]


@pytest.mark.parametrize("backend", ["rocksdb", "log"])
def test_numpy_and_list_hyperparameters_are_taken_as_numbers(tmp_path, backend):
    """(A review.) Init(a=np.float32) and Adam(betas=np.array / list) were taken, then a new SSD
    table failed on its JSON meta (a RocksDB directory left that no later open accepted), an
    export failed after writing its chunks, and a collection failed to group an Adam of list
    betas: they are stored as Python floats."""
    init = te.Init("uniform", np.float32(-0.1), np.float32(0.1))
    assert type(init.a) is float and type(init.b) is float
    adam = te.Adam(lr=0.01, betas=np.array([0.9, 0.99]))
    assert adam.betas == (0.9, 0.99) and adam == te.Adam(lr=0.01, betas=[0.9, 0.99]) and hash(adam)
    path = tmp_path / "t"
    with te.TieredEmbeddingBag(50, 4, "sum", cache_rows=10, ssd_path=path, ssd={"backend": backend}, init=init,
                               optimizer=adam) as emb:
        emb(torch.arange(12), torch.tensor([0, 6])).sum().backward()
        emb.export_rows(tmp_path / "export")
        rows = emb.read_rows(torch.arange(50))
    with te.TieredEmbeddingBag(50, 4, "sum", cache_rows=10, ssd_path=path, init=init, optimizer=adam) as again:
        assert torch.equal(again.read_rows(torch.arange(50)), rows)
    ebc = te.TieredEmbeddingBagCollection([te.EmbeddingBagConfig("t", 20, 4, ["f"])],
                                          optimizer=te.Adam(lr=0.01, betas=[0.9, 0.99]))
    ebc({"f": (torch.tensor([1, 2]), torch.tensor([0, 1]))}).values().sum().backward()


def test_optimizer_arguments_that_meant_something_else_are_refused():
    """(A review.) MomentumScaledRowWiseAdagrad(0.01, 8) was lr 0.01, eps 8 and c 1 (eps is second
    in RowWiseAdagrad): c is its second argument, eps a keyword. tieredemb.Optimizer, the base,
    was taken by a table, whose every backward then failed."""
    opt = te.MomentumScaledRowWiseAdagrad(0.01, 8)
    assert opt.scale == 8 and opt.eps == 1e-8
    with pytest.raises(TypeError):
        te.MomentumScaledRowWiseAdagrad(0.01, 8, 1e-6)
    with pytest.raises(TypeError, match="tieredemb.Optimizer is the base of the optimizers: give SGD"):
        te.Optimizer(0.1)


def test_a_collection_refuses_a_modules_own_arguments_and_no_tables():
    """(A review.) include_last_offset= was ignored, mode= a "multiple values" error, _weight=
    written into a group's rows; an empty collection failed at its first forward (IndexError)."""
    tables = [te.EmbeddingBagConfig("t", 10, 4, ["f"])]
    for kw in (dict(include_last_offset=True), dict(mode="sum"), dict(_weight=torch.zeros(10, 4))):
        with pytest.raises(TypeError, match=rf"TieredEmbeddingBagCollection: unknown argument {next(iter(kw))}; "):
            te.TieredEmbeddingBagCollection(tables, **kw)
    for cls in (te.TieredEmbeddingBagCollection, te.TieredEmbeddingCollection):
        with pytest.raises(ValueError, match=f"{cls.__name__} needs at least one table, got none"):
            cls([])
    te.TieredEmbeddingBagCollection(tables, seed=3, policy="lfu", row_alignment=16)  # (what it passes on)


def test_a_size_in_bytes_is_read_exactly():
    """(A review: through a float, 9007199254740993 was 9007199254740992; an int gave re's own
    TypeError.)"""
    from tieredemb.config import parse_bytes

    assert parse_bytes("9007199254740993") == 9007199254740993
    assert parse_bytes("1.3GiB") == 1395864371 and parse_bytes("1.5KiB") == 1536
    with pytest.raises(TypeError, match="a size must be a str like '512MiB', got int 1024"):
        parse_bytes(1024)


def test_a_closed_host_table_refuses_every_read_of_its_rows(tmp_path):
    """(A review: read_rows was refused, but state_dict, iter_rows and export_rows answered, as an
    SSD table's do not; import_rows named another reason.)"""
    emb = te.TieredEmbeddingBag(10, 4, "sum")
    emb.close()
    for call in (emb.state_dict, lambda: list(emb.iter_rows()), lambda: emb.export_rows(tmp_path / "x"),
                 lambda: emb.import_rows(tmp_path / "x")):
        with pytest.raises(RuntimeError, match="TieredEmbeddingBag is closed"):
            call()
    assert not (tmp_path / "x").exists()
