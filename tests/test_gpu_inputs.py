"""Ids and offsets on the GPU: checked there by one kernel (gpu/checks.py), the verdict read where
the batch's residency waits for the device anyway (or by the prefetch worker), so device inputs
cost the training thread no wait of their own; a bad batch raises the error host inputs give,
before anything changes; training equals the host inputs' bit for bit.

Run on CPU tensors, the kernels under Triton's interpreter, with the device-input path forced:
the `device_inputs` fixture makes the module's and tier 0's `_on_device` answer True for a table
whose tier 0 is a DeviceTier on CPU tensors (the seam these tests use: on a GPU, CUDA tensors take
that path themselves, and tests/test_gpu.py counts its waits); host_path() undoes it for one
table."""

from __future__ import annotations

import pytest
import torch

import tieredemb
from training import rows_and_state, train

pytestmark = pytest.mark.interpreted
pytest.importorskip("triton")
from tieredemb.gpu.checks import SENTINEL32, SENTINEL64, check_on_device  # noqa: E402
from tieredemb.gpu.dedup import dedup  # noqa: E402
from tieredemb.gpu.tier import DeviceTier, collection_on_cpu_tensors, on_cpu_tensors  # noqa: E402
from tieredemb.module import _TieredBase  # noqa: E402

NUM, D = 300, 8


@pytest.fixture
def device_inputs(monkeypatch):
    monkeypatch.setattr(_TieredBase, "_on_device", lambda self, t: isinstance(self._store.tier0, DeviceTier))
    monkeypatch.setattr(DeviceTier, "_on_device", lambda self, t: True)


def host_path(emb):
    """emb's inputs taken as host inputs, in the module and in tier 0's dedup."""
    emb._on_device = lambda t: False
    if isinstance(emb._store.tier0, DeviceTier):
        emb._store.tier0._on_device = lambda t: False
    return emb


def weights():
    return torch.randn(NUM, D, generator=torch.Generator().manual_seed(1))


def table(cache_rows, mode="sum", opt=lambda: tieredemb.Adam(lr=0.05), on_device=True, pretrained=True, **kw):
    emb = tieredemb.TieredEmbeddingBag(NUM, D, mode, optimizer=opt(), cache_rows=cache_rows, seed=5,
                                       **({"_weight": weights()} if pretrained else {}), **kw)
    return on_cpu_tensors(emb, cache_rows) if on_device else emb


def batches(include_last_offset, seed=0, steps=6, bags=10, length=6):
    """Bags of `length` ids, Zipf-like; with include_last_offset, B + 1 offsets and 5 ids after
    the last bag: rows 290..294 (which no bag reads) and one far out of range (no bag's either)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = (torch.rand(bags * length, generator=g) ** 2 * 280).long()
        offsets = torch.arange(0, bags * length + (1 if include_last_offset else 0), length)
        if include_last_offset:
            ids = torch.cat([ids, torch.tensor([290, 291, 292, 10**9, 294])])
        out.append((ids, offsets, torch.randn(bags, D, generator=g)))
    return out


_TIERS = {"whole-mean": (dict(cache_rows=None), "mean"), "new-whole-sum": (dict(cache_rows=None, pretrained=False), "sum"),
          "cache64-max": (dict(cache_rows=64), "max"), "cache8-sum": (dict(cache_rows=8), "sum")}
# Without prefetch every tier with either kind of offsets; with prefetch (depth 2) every tier once,
# the kinds of offsets taken in turn (the suite's time: each case trains two tables, interpreted).
_INPUT_CASES = [(0, last, name) for name in _TIERS for last in (False, True)] + \
    [(2, k % 2 == 1, name) for k, name in enumerate(_TIERS)]


@pytest.mark.parametrize("depth, include_last_offset, tiers, mode",
                         [(d, last, *_TIERS[name]) for d, last, name in _INPUT_CASES],
                         ids=[f"{d}-{name}-{'last-offset' if last else 'starts'}" for d, last, name in _INPUT_CASES])
def test_device_inputs_train_bit_for_bit_as_host_inputs(device_inputs, include_last_offset, tiers, mode, depth):
    """The same table fed the same batches as host tensors and as device ones (the device path):
    equal outputs, rows and optimizer state, bit for bit; Adam, so a row that only the ids after
    the last bag name would show an update (a zero gradient still moves Adam's moments)."""
    runs = []
    for on_device in (False, True):
        emb = table(**tiers, mode=mode, include_last_offset=include_last_offset)
        if not on_device:
            host_path(emb)  # (on the same kind of tier)
        outs = train(emb, batches(include_last_offset), depth=depth)
        runs.append((torch.stack(outs), rows_and_state(emb)))
        assert emb._store.tier0.index.pinned == 0
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    if include_last_offset:
        assert torch.equal(runs[1][1][290:295], rows_and_state(table(**tiers, mode=mode))[290:295])


def test_per_sample_weights_of_ids_after_the_last_bag_get_no_gradient(device_inputs):
    """The device path keeps the ids after the last bag (their rows never read): their weights'
    gradient is zero, the others' as host inputs give them."""
    ids, offsets = torch.tensor([1, 2, 3, 4, 5, 7]), torch.tensor([0, 2, 4])
    grad = torch.randn(2, D, generator=torch.Generator().manual_seed(3))
    got = []
    for on_device in (False, True):
        emb = table(16, opt=lambda: tieredemb.SGD(lr=1.0), include_last_offset=True)
        if not on_device:
            host_path(emb)
        psw = torch.linspace(0.5, 1.5, 6, requires_grad=True)
        out = emb(ids, offsets, per_sample_weights=psw)
        out.backward(grad)
        got.append((out.detach(), psw.grad, rows_and_state(emb)))
    for a, b in zip(*got):
        assert torch.equal(a, b)
    assert torch.equal(got[1][1][4:], torch.zeros(2))


BAD = [  # (ids, offsets, include_last_offset, error, message)
    ([1, 2, 3], [1, 2], False, ValueError, r"offsets\[0\] must be 0"),
    ([1, 2, 3], [0, 2, 1], False, ValueError, r"offsets must be non-decreasing: offsets\[2\] = 1 < offsets\[1\] = 2"),
    ([1, 2, 3], [0, 4], False, ValueError, r"offsets\[-1\] = 4 is past the end of input \(length 3\)"),
    ([1, 2, 3], [0, 1, 5], True, ValueError, r"offsets\[-1\] = 5 is past the end of input \(length 3\)"),
    ([1, NUM + 4, 3], [0, 2], False, IndexError, rf"id {NUM + 4} out of range \[0, {NUM}\)"),
    ([1, -2, 3], [0, 1, 2], True, IndexError, rf"id -2 out of range \[0, {NUM}\)"),
]


@pytest.mark.parametrize("ids, offsets, last, error, message", BAD)
@pytest.mark.parametrize("tiers", [dict(cache_rows=None), dict(cache_rows=None, pretrained=False),
                                   dict(cache_rows=8)], ids=["whole", "new-whole", "cache8"])
@pytest.mark.parametrize("prefetched", [False, True])
def test_bad_device_inputs_raise_the_host_error_before_anything_changes(device_inputs, ids, offsets, last, error,
                                                                       message, tiers, prefetched):
    """The error host inputs give (the same type and message), raised by the forward; a
    prefetched batch's by its forward too, prefetch() itself not waiting for the verdict. The
    rows, the optimizer state and the pins are as they were."""
    emb = table(**tiers, include_last_offset=last, opt=lambda: tieredemb.SGD(lr=0.1))
    host = table(**tiers, include_last_offset=last, on_device=False)
    with pytest.raises(error, match=message):
        host(torch.tensor(ids), torch.tensor(offsets))
    train(emb, batches(last, steps=2))
    before = rows_and_state(emb)
    ids, offsets = torch.tensor(ids), torch.tensor(offsets)
    if prefetched:
        emb.prefetch(ids, offsets)
    with pytest.raises(error, match=message):
        emb(ids, offsets)
    assert torch.equal(rows_and_state(emb), before) and emb._store.tier0.index.pinned == 0
    train(emb, batches(last, seed=1, steps=2))  # (and it trains on)


@pytest.mark.parametrize("last", [False, True])
def test_a_prefetched_batch_is_recognized_by_its_tensors_without_comparing_values(device_inputs, monkeypatch, last):
    """A forward given the very tensors prefetched (as PrefetchLoader gives them) is matched to
    its registered batch by identity: on a GPU a comparison of values would wait for the device.
    Nor are they checked again: the forward takes the ids and boundaries prefetch() checked (one
    check kernel a batch, not two)."""
    import tieredemb.prefetch
    from tieredemb.gpu import checks

    launches = []
    check = checks.check_on_device
    monkeypatch.setattr(checks, "check_on_device", lambda *a: (launches.append(1), check(*a))[1])
    want = train(host_path(table(8, include_last_offset=last)), batches(last), depth=2)
    emb = table(8, include_last_offset=last)
    monkeypatch.setattr(tieredemb.prefetch, "_equal", lambda *a: pytest.fail("values compared"))
    got = train(emb, batches(last), depth=2)
    assert emb.stats()["prefetch"]["forwards"] == 6 and len(launches) == 6
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("n", [0, 5, 2500])
@pytest.mark.parametrize("last", [False, True])
def test_the_check_kernel_writes_the_boundaries_and_the_ids_looked_up(n, last):
    """Good inputs: the boundaries (with include_last_offset, an empty bag added after the last),
    the ids as int32 (they fit) with the ids after the last bag (bad ones among them) replaced by
    the sentinel, no fault. A bad id in a later block of the kernel is found."""
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, NUM, (n,), generator=g)
    end = n - 3 if last and n > 3 else n
    offsets = torch.arange(0, end, 4)
    if last:
        offsets = torch.cat([offsets, torch.tensor([end])])
        ids[end:] = 10**12
    out, bounds, check = check_on_device(ids, offsets, NUM, last)
    assert out.dtype == torch.int32 and not bool(check.fault.any())
    assert torch.equal(out[:end], ids[:end].int()) and (out[end:] == SENTINEL32).all()
    assert torch.equal(bounds, torch.cat([offsets, offsets[-1:] if last else torch.tensor([n])]))
    assert check.extra_bag == last and check.sentinel == (SENTINEL32 if last else None)
    if n > 1024:
        ids[2000] = NUM
        assert bool(check_on_device(ids, offsets, NUM, last)[2].fault.any())
    big = check_on_device(ids[:end], None, 1 << 40)[0]
    assert big.dtype == torch.int64 and torch.equal(big, ids[:end])


def test_the_dedup_leaves_the_sentinel_out():
    ids = torch.tensor([7, SENTINEL64, 3, 7, SENTINEL64, 1])
    d = dedup(ids, SENTINEL64)
    assert int(d.count) == 3 and torch.equal(d.unique[:4], torch.tensor([1, 3, 7, -1]))
    assert torch.equal(d.inverse, torch.tensor([2, 3, 1, 2, 3, 0]))
    order, row, start = d.groups  # (the dropped id's group starts where the last distinct id's ends)
    assert torch.equal(start, torch.tensor([0, 1, 2, 4, 6, 6, 6]))
    only = dedup(torch.full((4,), SENTINEL32, dtype=torch.int32), SENTINEL32)
    assert int(only.count) == 0 and (only.unique == -1).all() and torch.equal(only.groups[2], torch.tensor([0, 4, 4, 4, 4]))


def _both_paths(make, run):
    """run(emb) on a table the host-input path takes and on one the device-input path takes."""
    return [run(host_path(make())), run(make())]


def test_many_ids_after_the_last_bag_add_nothing_to_the_largest_ids_gradient(device_inputs):
    """100 ids after the last bag (several of the backward's tiles, next to the batch's largest
    id in the sort): the largest id's update is the host inputs', bit for bit; with a padding row
    too (the kernels that read every occurrence leave the ids after the last bag out)."""
    ids, offsets = torch.tensor([5, 6, 250, 3] + [1] * 100), torch.tensor([0, 3, 4])
    grad = torch.randn(2, D, generator=torch.Generator().manual_seed(5))
    for cache_rows in (None, 64):
        def run(emb):
            out = emb(ids, offsets)
            out.backward(grad)
            return out.detach(), rows_and_state(emb)

        host, dev = _both_paths(lambda: table(cache_rows, opt=lambda: tieredemb.SGD(lr=1.0), include_last_offset=True,
                                              padding_idx=3), run)
        assert torch.equal(host[0], dev[0]) and torch.equal(host[1], dev[1])


def test_strided_ids_and_offsets_are_read_as_given(device_inputs):
    """Ids and offsets that are views with strides (a column of a batch): looked up as given."""
    ids, offsets = torch.arange(200).reshape(100, 2)[:, 1] % NUM, torch.arange(0, 100, 5).reshape(10, 2)[:, 0]
    host, dev = _both_paths(lambda: table(None), lambda emb: emb(ids, offsets).detach())
    assert torch.equal(host, dev)


def test_a_batch_prefetched_on_one_path_is_taken_by_a_forward_on_the_other(device_inputs):
    """prefetch() given host tensors and the forward device ones (or the other way round), equal
    values, ids after the last bag among them: the forward takes the registered batch."""
    ids, offsets, grad = batches(True, steps=1)[0]
    for prefetch_on_device in (False, True):
        emb = table(8, include_last_offset=True)
        tier0 = emb._store.tier0
        emb._on_device = tier0._on_device = lambda t: prefetch_on_device
        emb.prefetch(ids, offsets)
        emb._on_device = tier0._on_device = lambda t: not prefetch_on_device
        emb(ids.clone(), offsets.clone()).backward(grad)
        assert emb.stats()["prefetch"]["forwards"] == 1 and emb._store.tier0.index.pinned == 0


@pytest.mark.parametrize("cache_rows", [None, 8])
def test_unpooled_lookups_of_device_ids_train_as_host_ones_and_refuse_bad_ids_at_their_forward(device_inputs,
                                                                                               cache_rows):
    """TieredEmbedding given device ids (checked by tier 0's dedup, with no offsets): the host ids'
    training bit for bit, through a PrefetchLoader; a bad id prefetched raises at its forward,
    the host's error, nothing changed."""
    g = torch.Generator().manual_seed(6)
    data = [((torch.rand(4, 5, generator=g) ** 2 * NUM).long(), torch.randn(4, 5, D, generator=g)) for _ in range(6)]

    def make():
        emb = tieredemb.TieredEmbedding(NUM, D, optimizer=tieredemb.Adam(lr=0.05), cache_rows=cache_rows, seed=2)
        return on_cpu_tensors(emb, cache_rows)

    def run(emb):
        outs = []
        with tieredemb.PrefetchLoader(data, [emb], depth=2) as loader:
            for ids, grad in loader:
                out = emb(ids)
                out.backward(grad)
                outs.append(out.detach())
        return torch.stack(outs), rows_and_state(emb)

    host, dev = _both_paths(make, run)
    assert torch.equal(host[0], dev[0]) and torch.equal(host[1], dev[1])
    emb = make()
    train_ids = data[0][0]
    emb(train_ids).backward(data[0][1])
    before = rows_and_state(emb)
    emb.prefetch(torch.tensor([[1, NUM + 2]]))
    with pytest.raises(IndexError, match=rf"id {NUM + 2} out of range \[0, {NUM}\)"):
        emb(torch.tensor([[1, NUM + 2]]))
    assert torch.equal(rows_and_state(emb), before) and emb._store.tier0.index.pinned == 0


def _collection(pooled: bool, cache_bytes, on_device=True):
    """A collection whose groups' tier 0 are device tiers on CPU tensors: tables u and x share a
    group (a row past u's end is x's, in the group's range), v and w make groups of their own."""
    if pooled:
        tables = [tieredemb.EmbeddingBagConfig("u", 120, D, ["a", "b"]), tieredemb.EmbeddingBagConfig("x", 50, D, ["e"]),
                  tieredemb.EmbeddingBagConfig("v", 80, D, ["c"], pooling="mean"),
                  tieredemb.EmbeddingBagConfig("w", 40, 4, ["d"])]
        make = tieredemb.TieredEmbeddingBagCollection
    else:
        tables = [tieredemb.EmbeddingConfig("u", 120, D, ["a", "b"]), tieredemb.EmbeddingConfig("x", 50, D, ["e"]),
                  tieredemb.EmbeddingConfig("w", 40, 4, ["d"])]
        make = tieredemb.TieredEmbeddingCollection
    col = collection_on_cpu_tensors(make(tables, optimizer=tieredemb.Adam(lr=0.05), cache_bytes=cache_bytes, seed=4))
    if not on_device:
        for engine in col.engines:
            host_path(engine)
    return col


def _features(col, seed):
    g = torch.Generator().manual_seed(seed)
    feats = {}
    for f, t in col.feature_table.items():
        ids = (torch.rand(12, generator=g) ** 2 * t.num_embeddings).long()
        if f == "b":
            feats[f] = tieredemb.InverseKeyed(ids, torch.tensor([0, 2, 2, 5, 9, 10]), torch.tensor([5, 0, 0, 3, 2, 5]))
        else:
            feats[f] = (ids, torch.tensor([0, 2, 2, 5, 9, 10]))
    return feats


def _step(col, feats, seed):
    out = col(feats)
    if isinstance(out, dict):  # (unpooled: {feature: jagged rows})
        values = torch.cat([out[f].values().reshape(-1) for f in out])
    else:
        values = out.values()
    values.backward(torch.randn(values.shape, generator=torch.Generator().manual_seed(seed)))
    return values.detach()


def _collection_rows(col):
    return [torch.cat([col.read_rows(t.name, torch.arange(t.num_embeddings)),
                       col.read_optimizer_state(t.name, torch.arange(t.num_embeddings))], 1) for t in col.tables]


def _counter(counts: dict):
    """counted(name, fn): fn, counting each call in counts[name]."""
    def counted(name, fn):
        def call(*a, **k):
            counts[name] += 1
            return fn(*a, **k)
        return call
    return counted


@pytest.mark.parametrize("pooled", [True, False], ids=["bags", "unpooled"])
@pytest.mark.parametrize("cache_bytes", [None, 3000], ids=["whole", "cached"])
def test_a_collections_device_features_are_checked_by_one_launch_and_train_as_host_ones(device_inputs, monkeypatch,
                                                                                         pooled, cache_bytes):
    """Every feature on the tables' device is range-checked by one kernel launch for the whole
    batch (gpu/checks.py check_runs_on_device), no group's tier 0 checking its ids again, the
    verdict read by the first group's residency: outputs, rows and optimizer state bit for bit
    those of the same batches given on the host."""
    from tieredemb.gpu import checks

    launches = {"runs": 0, "tier": 0}
    runs, on_device = checks.check_runs_on_device, checks.check_on_device

    counted = _counter(launches)
    monkeypatch.setattr(checks, "check_runs_on_device", counted("runs", runs))
    monkeypatch.setattr("tieredemb.gpu.tier.check_on_device", counted("tier", on_device))
    results = []
    for dev in (False, True):
        col = _collection(pooled, cache_bytes, on_device=dev)
        outs = [_step(col, _features(col, seed), seed) for seed in range(5)]
        results.append((outs, _collection_rows(col)))
    assert launches == {"runs": 5, "tier": 0}
    (host_outs, host_rows), (dev_outs, dev_rows) = results
    assert all(torch.equal(a, b) for a, b in zip(host_outs, dev_outs))
    assert all(torch.equal(a, b) for a, b in zip(host_rows, dev_rows))


@pytest.mark.parametrize("pooled", [True, False], ids=["bags", "unpooled"])
@pytest.mark.parametrize("feature, bad", [("a", 120), ("e", -1), ("d", 40)])
def test_a_collections_bad_device_feature_raises_the_host_error_before_any_group_changes(device_inputs, pooled,
                                                                                          feature, bad):
    """An id past its own table (120 in u is x's row 0 in their group: in the group's range,
    which is all a tier 0 knows), or below it, given on the device: the host's error, raised by
    the first group's residency before it or any other group changes (rows, optimizer state,
    tier-0 counts, pins)."""
    host, col = _collection(pooled, 3000, on_device=False), _collection(pooled, 3000)
    for c in (host, col):
        _step(c, _features(c, 0), 0)
    feats = _features(col, 1)
    ids, *rest = feats[feature]
    feats[feature] = (torch.cat([ids[:3], torch.tensor([bad]), ids[4:]]), *rest)
    with pytest.raises(IndexError) as want:
        host(feats)
    rows = _collection_rows(col)
    stats = col.stats()  # (after reading the rows, which counts in the stats)
    with pytest.raises(IndexError) as got:
        col(feats)
    assert str(got.value) == str(want.value) and f"feature {feature!r}: id {bad} out of range" in str(got.value)
    assert col.stats() == stats and all(torch.equal(a, b) for a, b in zip(rows, _collection_rows(col)))
    assert all(e._store.tier0.index.pinned == 0 for e in col.engines)
    _step(col, _features(col, 2), 2)  # (and it trains on)


@pytest.mark.parametrize("source, dtype", [
    (torch.arange(-5, 200_000, 3), torch.int32),  # ids narrowed as they are staged
    (torch.arange(100_000).view(1000, 100)[:, ::3], torch.int64),  # a strided view, made contiguous
    (torch.randn(70_000, requires_grad=True), torch.float32),  # weights that need their gradient
    (torch.randn(40_000, dtype=torch.bfloat16), torch.float32),  # (numpy has no bfloat16: torch converts)
    (torch.randn(40_000), torch.bfloat16)], ids=["narrowed", "strided", "grad", "from-bf16", "to-bf16"])
def test_host_inputs_staged_for_the_gpu_hold_what_torch_converts_them_to(source, dtype):
    """What gpu.to_device copies a host input of more than 64 KB into before it goes to a GPU
    (there pinned; here, with no GPU, the same copy unpinned): the values torch's own conversion
    gives, contiguous, detached."""
    from tieredemb.gpu import staged, to_device

    out = staged(source, dtype, pin=False)
    assert out.dtype == dtype and out.is_contiguous() and not out.requires_grad
    assert torch.equal(out, source.detach().to(dtype))
    assert torch.equal(to_device(source, "cpu", dtype), source.detach().to(dtype))  # (no GPU: torch's own)


def _keyed(col, seed, bad=None):
    """A KeyedJaggedTensor of every feature of col, 6 samples each (bad: (feature, id) put in)."""
    from training import KJT

    g = torch.Generator().manual_seed(seed)
    keys = list(col.feature_table)
    lengths = torch.randint(0, 4, (len(keys) * 6,), generator=g)
    values = []
    for k, f in enumerate(keys):
        n = int(lengths[k * 6:(k + 1) * 6].sum())
        values.append((torch.rand(n, generator=g) ** 2 * col.feature_table[f].num_embeddings).long())
        if bad is not None and bad[0] == f:
            values[-1][0] = bad[1]
    return KJT(keys, torch.cat(values), lengths)


@pytest.mark.parametrize("pooled", [True, False], ids=["bags", "unpooled"])
@pytest.mark.parametrize("cache_bytes", [None, 3000], ids=["whole", "cached"])
def test_a_keyed_jagged_tensor_on_the_device_is_checked_and_read_with_its_lengths(device_inputs, monkeypatch,
                                                                                  pooled, cache_bytes):
    """A KeyedJaggedTensor whose values and lengths are on the tables' device: every key's ids
    checked in its own table by one launch (the keys' boundaries summed from the lengths there),
    its lengths and that verdict read together, so no group reads a verdict again (on a GPU: one
    wait, where the lengths' read and the verdict's took two); training bit for bit as the same
    tensor on the host. A bad id raises the host's error with nothing changed; so do lengths
    that do not add up, before any verdict."""
    from tieredemb.gpu import checks

    calls = {"keyed": 0, "runs": 0, "tier": 0, "reads": 0}

    counted = _counter(calls)
    monkeypatch.setattr(checks, "check_keyed_on_device", counted("keyed", checks.check_keyed_on_device))
    monkeypatch.setattr(checks, "check_runs_on_device", counted("runs", checks.check_runs_on_device))
    monkeypatch.setattr("tieredemb.gpu.tier.check_on_device", counted("tier", checks.check_on_device))
    resolve = checks.DeviceCheck.resolve
    monkeypatch.setattr(checks.DeviceCheck, "resolve",
                        lambda self: (calls.__setitem__("reads", calls["reads"] + (not self.passed)), resolve(self)))
    from tieredemb import collection, keyed

    lengths_read = keyed.keyed_lengths
    for module in (keyed, collection):  # (the lengths taken from the tensor: once a batch, by the device check)
        monkeypatch.setattr(module, "keyed_lengths", counted("lengths", lengths_read))
    results = []
    for dev in (False, True):
        col = _collection(pooled, cache_bytes, on_device=dev)
        calls["lengths"] = 0
        outs = [_step(col, _keyed(col, seed), seed) for seed in range(4)]
        results.append((outs, _collection_rows(col)))
    assert calls == {"keyed": 4, "runs": 0, "tier": 0, "reads": 0, "lengths": 4}
    (host_outs, host_rows), (dev_outs, dev_rows) = results
    assert all(torch.equal(a, b) for a, b in zip(host_outs, dev_outs))
    assert all(torch.equal(a, b) for a, b in zip(host_rows, dev_rows))

    host = _collection(pooled, cache_bytes, on_device=False)
    for feature, bad in (("a", 120), ("e", -1), ("d", 40)):  # (120 in u: x's row 0, in their group's range)
        with pytest.raises(IndexError) as want:
            host(_keyed(host, 9, (feature, bad)))
        rows, stats = _collection_rows(col), col.stats()
        with pytest.raises(IndexError) as got:
            col(_keyed(col, 9, (feature, bad)))
        assert str(got.value) == str(want.value) and f"feature {feature!r}: id {bad} out of range" in str(got.value)
        assert col.stats() == stats and all(torch.equal(a, b) for a, b in zip(rows, _collection_rows(col)))
        assert all(e._store.tier0.index.pinned == 0 for e in col.engines)
    stats = col.stats()
    # Lengths that break a rule: the host's error, before the verdict (a bad id put in too).
    for change, error in (
            (lambda k: setattr(k, "_v", k._v[:-1]), r"lengths sum to \d+, values\(\) has \d+"),
            (lambda k: setattr(k, "_v", torch.cat([k._v, torch.tensor([999])])), r"lengths sum to \d+, values\(\) has"),
            (lambda k: (k._l.__setitem__(0, -1), k._l.__setitem__(1, k._l[1] + 1)), r"lengths must be >= 0, got -1"),
            (lambda k: (k._l.__setitem__(0, 1), k._l.__setitem__(1, 2**63 - 1), k._l.__setitem__(2, 2**63 - 1)),
             r"a length of 9223372036854775807 is past values\(\)' \d+ ids"),  # (a sum that wraps to the right one)
            (lambda k: setattr(k, "_k", [k._k[0]] + k._k[:-1]), r"keys must be unique, got \['a'\] more than once")):
        for c in (host, col):
            kjt = _keyed(c, 9, ("a", 999))
            kjt._l = kjt._l.clone()
            change(kjt)
            with pytest.raises(ValueError, match="KeyedJaggedTensor: " + error):
                c(kjt)
    assert col.stats() == stats
    _step(col, _keyed(col, 10), 10)  # (and it trains on)
