"""Batches with more distinct ids than tier 0 holds, and prefetch deeper than tier 0 can hold:
training gives the weights of a table held whole in tier 0, bit for bit, and of torch (within
float tolerance), for every optimizer, backing store, and with or without prefetch."""

from __future__ import annotations

import functools
import random
import threading
import time

import pytest
import torch

import tieredemb
from training import rows_and_state, train

NUM, DIM, BAGS, LEN, STEPS = 2000, 8, 40, 12, 6  # about 350 distinct ids a batch
OPTIMIZERS = {"sgd": lambda: tieredemb.SGD(lr=0.05), "adagrad": lambda: tieredemb.Adagrad(lr=0.1),
              "rowwise": lambda: tieredemb.RowWiseAdagrad(lr=0.1), "adam": lambda: tieredemb.Adam(lr=0.01)}
STORES = ["host", "host-cache", "rocksdb", "log", "slots"]


def batches(seed=0, steps=STEPS, num=NUM, bags=BAGS, length=LEN):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = (torch.rand(bags * length, generator=g) ** 2 * num).long()  # skewed: repeats within a batch
        out.append((ids, torch.arange(0, bags * length, length), torch.randn(bags, DIM, generator=g)))
    return out


def initial_weight(num=NUM):
    return torch.randn(num, DIM, generator=torch.Generator().manual_seed(42))


def make(store, cache_rows, opt, tmp_path=None, mode="sum", num=NUM, **kw):
    args = dict(cache_rows=cache_rows, optimizer=OPTIMIZERS[opt](), _weight=initial_weight(num), **kw)
    if store == "host-cache":
        args["host_rows"] = max(16, 2 * (cache_rows or 0))
    elif store != "host":
        args.update(ssd_path=tmp_path / store, ssd_options={"backend": store})
    return tieredemb.TieredEmbeddingBag(num, DIM, mode=mode, **args)






@functools.lru_cache(maxsize=None)
def whole(opt: str):
    """The reference: the table whole in tier 0, no prefetch. (outputs, rows ‖ state)."""
    emb = make("host", None, opt)
    outs = train(emb, batches())
    return outs, rows_and_state(emb)


@pytest.mark.parametrize("depth", [0, 2])
@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("cache_rows", [1, 8, 64])
def test_batches_larger_than_tier0_train_as_the_whole_table(tmp_path, cache_rows, opt, store, depth):
    emb = make(store, cache_rows, opt, tmp_path)
    outs = train(emb, batches(), depth)
    ref_outs, ref_table = whole(opt)
    for k, (got, want) in enumerate(zip(outs, ref_outs)):
        assert torch.equal(got, want), f"forward of batch {k} differs"
    assert torch.equal(rows_and_state(emb), ref_table)
    s = emb.stats()["tier0"]
    assert s["overflow_rows"] > 0 and s["capacity"] == cache_rows
    emb.flush()
    assert emb._store.tier0.index.pinned == 0
    emb.close()


@pytest.mark.parametrize("opt,make_torch", [
    ("sgd", lambda p: torch.optim.SGD(p, lr=0.05)),
    ("adagrad", lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-10)),
    ("adam", lambda p: torch.optim.SparseAdam(list(p), lr=0.01)),
])
def test_batches_larger_than_tier0_match_torch(opt, make_torch):
    sparse = opt == "adam"
    ref = torch.nn.EmbeddingBag(NUM, DIM, mode="sum", sparse=sparse, _weight=initial_weight())
    torch_opt = make_torch(ref.parameters())
    outs = []
    for ids, offsets, grad in batches():
        torch_opt.zero_grad()
        out = ref(ids, offsets)
        out.backward(grad)
        torch_opt.step()
        outs.append(out.detach())
    emb = tieredemb.TieredEmbeddingBag(NUM, DIM, mode="sum", cache_rows=8, _weight=initial_weight(),
                                       optimizer={"sgd": tieredemb.SGD(lr=0.05),
                                                  "adagrad": tieredemb.Adagrad(lr=0.1, eps=1e-10),
                                                  "adam": tieredemb.Adam(lr=0.01)}[opt])
    got = train(emb, batches())
    for a, b in zip(got, outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(emb.read_rows(torch.arange(NUM)), ref.weight.detach(), rtol=1e-4, atol=1e-5)


def test_overflow_rows_leave_tier0_once_released():
    emb = make("host", 8, "adagrad")
    ids, offsets, grad = batches()[0]
    distinct = len(torch.unique(ids))
    out = emb(ids, offsets)
    index = emb._store.tier0.index
    assert index.pinned == distinct and index.overflow == distinct - 8
    out.backward(grad)
    assert index.pinned == 0
    fresh = next(i for i in range(NUM) if i not in set(ids.tolist()))
    with torch.no_grad():  # the next batch evicts the released overflow rows (dirty: written down)
        emb(torch.tensor([fresh]), torch.tensor([0]))
    assert index.overflow == 0 and index.size <= 8
    assert emb.stats()["tier0"]["dirty_writebacks"] >= distinct - 8
    ref_table = make("host", None, "adagrad")
    train(ref_table, batches()[:1])
    assert torch.equal(rows_and_state(emb), rows_and_state(ref_table))


def test_two_forwards_sharing_overflow_rows_before_one_backward():
    """The same table looked up twice in one step (two features): the second lookup reads the
    first's overflow rows where they are, and both updates apply, as with a whole table."""
    def step(emb, a, b):
        (emb(a[0], a[1]).sum() + 2 * emb(b[0], b[1]).sum()).backward()

    data = batches(seed=3)
    small, big = make("host", 4, "sgd"), make("host", None, "sgd")
    for k in range(0, len(data) - 1, 2):
        for emb in (small, big):
            step(emb, data[k], data[k + 1])
    assert torch.equal(rows_and_state(small), rows_and_state(big))


class SlowStore:
    """A real store made slow: each read and write first sleeps a random time (a fault this test
    cannot cause for real), so that the prefetch worker and training interleave differently."""

    def __init__(self, store, rng: random.Random):
        self.store, self.rng, self.lock = store, rng, threading.Lock()

    def __getattr__(self, name):
        return getattr(self.store, name)

    def _pause(self):
        with self.lock:
            t = self.rng.random() * 0.004
        time.sleep(t)

    def read_to(self, *args):
        self._pause()
        self.store.read_to(*args)

    def write_from(self, *args):
        self._pause()
        self.store.write_from(*args)


@pytest.mark.parametrize("seed", range(12))
def test_prefetch_deeper_than_tier0_holds_never_fails(tmp_path, seed):
    """Depth 3-6 with batches of ~90 distinct ids over a tier of 250 rows (at most 2-3 batches fit),
    over a slow log store, with random pauses in the training loop: same weights as without
    prefetch, bit for bit."""
    rng = random.Random(seed)
    num, depth = 600, rng.randint(3, 6)
    data = batches(seed, steps=14, num=num, bags=16, length=8)
    ref = make("host", None, "adam", num=num)
    train(ref, data)

    emb = make("log", 250, "adam", tmp_path, num=num)
    emb._store.tier0.lower = SlowStore(emb._store.tier0.lower, rng)
    for ids, offsets, grad in tieredemb.PrefetchLoader(data, [emb], depth=depth):
        time.sleep(rng.random() * 0.003)
        out = emb(ids, offsets)
        time.sleep(rng.random() * 0.003)
        out.backward(grad)
    assert torch.equal(rows_and_state(emb), rows_and_state(ref))
    assert emb._store.tier0.index.pinned == 0
    emb.close()


def test_a_worker_waiting_for_room_finds_a_batch_released_without_a_notify(monkeypatch):
    """A batch collected while its thread holds one of the package's locks is released at the
    next residency, with no notify (locks.py): a worker waiting for room looks for such batches
    when its wait times out, and plans again then."""
    import gc

    import tieredemb.prefetch

    monkeypatch.setattr(tieredemb.prefetch, "_IDLE_EXIT_S", 0.05)
    data = batches(seed=5, steps=2, num=600, bags=16, length=8)
    distinct = [len(torch.unique(ids)) for ids, _, _ in data]
    emb = make("host", max(distinct) + 5, "sgd", num=600)
    st = emb._store
    gc.disable()  # (until the thread below collects the cycle)
    try:
        cycle = [st.prepare(data[0][0])]
        cycle.append(cycle)
        del cycle
        emb.prefetch(data[1][0], data[1][1])
        deadline = time.monotonic() + 30
        while emb.stats()["prefetch"]["room_waits"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert emb.stats()["prefetch"]["room_waits"] == 1 and st.tier0.index.pinned == distinct[0]

        def collect():
            with st.room:
                gc.collect()

        collector = threading.Thread(target=collect, daemon=True)
        collector.start()
        collector.join(60)
    finally:
        gc.enable()
    deadline = time.monotonic() + 30
    while st.tier0.index.pinned != distinct[1] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert st.tier0.index.pinned == distinct[1] and not st.orphans
    emb(data[1][0], data[1][1]).backward(data[1][2])
    assert st.tier0.index.pinned == 0
    emb.close()


def test_prefetch_waits_for_room_instead_of_overflowing(monkeypatch):
    """Two registered batches that do not fit together: the worker makes the first resident and
    waits for its backward before the second (no overflow slot is used). While nothing is released
    it does not plan again (on a GPU each plan waits for the device), though its wait wakes up to
    look for batches released without a notify."""
    import tieredemb.prefetch

    monkeypatch.setattr(tieredemb.prefetch, "_IDLE_EXIT_S", 0.05)
    data = batches(seed=5, steps=2, num=600, bags=16, length=8)
    distinct = [len(torch.unique(ids)) for ids, _, _ in data]
    emb = make("host", max(distinct) + 5, "sgd", num=600)
    for ids, offsets, _ in data:
        emb.prefetch(ids, offsets)
    deadline = time.monotonic() + 30
    while emb.stats()["prefetch"]["room_waits"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # the worker made batch 0 resident and found no room for batch 1
    time.sleep(0.5)  # (ten of the worker's wake-ups)
    assert emb.stats()["prefetch"]["room_waits"] == 1
    assert emb._store.tier0.index.pinned == distinct[0]
    for ids, offsets, grad in data:
        emb(ids, offsets).backward(grad)
    assert emb.stats()["tier0"]["overflow_rows"] == 0
    ref = make("host", None, "sgd", num=600)
    train(ref, data)
    assert torch.equal(rows_and_state(emb), rows_and_state(ref))
