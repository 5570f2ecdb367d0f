"""The lookahead window of the native cache index (tieredemb._C.CacheIndex window_push /
window_pop) against a small Python model of the rule in /work/notes/trace_contract.md
(lookahead-k): among evictable rows, those no window batch uses go first in LRU order; then the
farthest next use first, ties in LRU order."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tieredemb import _C


def arr(ids) -> np.ndarray:
    return np.asarray(list(ids), dtype=np.int64)


class LookaheadLRU:
    """The model: LRU order in an OrderedDict (least recent first), the window as a list."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.window: list[list[int]] = []

    def access(self, batch: list[int], pinned: set[int] = frozenset()) -> list[int]:
        """One batch of unique ids; returns the victims in the order they were chosen."""
        misses = [i for i in batch if i not in self.lru]
        need = len(misses) - (self.capacity - len(self.lru))
        victims = []
        if need > 0:
            candidates = [r for r in self.lru if r not in batch and r not in pinned]
            first = {}
            for k, w in enumerate(self.window):
                for r in w:
                    first.setdefault(r, k)
            victims = [r for r in candidates if r not in first][:need]
            ranked = sorted((r for r in candidates if r in first), key=lambda r: -first[r])  # stable: LRU ties
            victims += ranked[:need - len(victims)]
        for v in victims:
            del self.lru[v]
        for i in batch:
            self.lru.pop(i, None)
            self.lru[i] = None
        return victims


def run_both(capacity, batches, windows, pins=None):
    """batches[t] is accessed with window windows[t] (a list of future batches)."""
    idx, model = _C.CacheIndex(capacity, "lru"), LookaheadLRU(capacity)
    for t, batch in enumerate(batches):
        idx.window_clear()
        for w in windows[t]:
            idx.window_push(arr(w))
        model.window = windows[t]
        pinned = set() if pins is None else pins[t]
        if pinned:
            pin_plan = idx.plan(arr(sorted(pinned)))  # pinned rows are resident: hits, no eviction
            assert pin_plan.num_misses == 0
            idx.commit(arr(sorted(pinned)), pin_plan, True, False)
            model.access(sorted(pinned))
        plan = idx.plan(arr(batch))
        idx.commit(arr(batch), plan, False, False)
        want = model.access(batch, pinned)
        assert plan.victim_ids.tolist() == want, f"batch {t}"
        if pinned:
            idx.unpin(idx.lookup(arr(sorted(pinned))))
        assert set(idx.resident_ids(0, -1).tolist()) == set(model.lru)


def test_rows_the_window_uses_are_kept_and_the_farthest_goes_first():
    idx = _C.CacheIndex(4, "lru")
    for b in ([1], [2], [3], [4]):  # LRU order, least recent first: 1 2 3 4
        idx.commit(arr(b), idx.plan(arr(b)), False, False)
    idx.window_push(arr([5, 1]))  # next batch uses 1
    idx.window_push(arr([2, 6]))  # the one after uses 2
    plan = idx.plan(arr([7, 8]))
    assert plan.victim_ids.tolist() == [3, 4]  # LRU would take 1 and 2
    plan = idx.plan(arr([7, 8, 9]))
    assert plan.victim_ids.tolist() == [3, 4, 2]  # then the farthest next use: 2 (batch 2) before 1
    assert idx.window_pop() and idx.window_batches == 1
    plan = idx.plan(arr([7, 8, 9]))
    assert plan.victim_ids.tolist() == [1, 3, 4]  # 1 no longer in the window; 2 is
    assert idx.window_pop() and not idx.window_pop()
    assert idx.plan(arr([7, 8])).victim_ids.tolist() == [1, 2]  # plain LRU again


def test_ties_in_the_window_go_in_lru_order():
    idx = _C.CacheIndex(3, "lru")
    for b in ([1], [2], [3]):
        idx.commit(arr(b), idx.plan(arr(b)), False, False)
    idx.window_push(arr([3, 1, 2]))  # all next used by the same batch
    assert idx.plan(arr([7, 8])).victim_ids.tolist() == [1, 2]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_matches_the_python_model(data):
    capacity = data.draw(st.integers(2, 12))
    universe = data.draw(st.integers(capacity + 1, 3 * capacity + 4))
    k = data.draw(st.integers(0, 4))
    n = data.draw(st.integers(1, 40))
    batch = st.lists(st.integers(0, universe - 1), min_size=1, max_size=capacity, unique=True)
    trace = [data.draw(batch) for _ in range(n + k)]
    windows = [trace[t + 1:t + 1 + k] for t in range(n)]
    run_both(capacity, trace[:n], windows)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_matches_the_python_model_with_pinned_rows(data):
    """Rows pinned by batches in flight are never victims, whatever the window says."""
    capacity = data.draw(st.integers(4, 12))
    universe = data.draw(st.integers(capacity + 1, 3 * capacity))
    n = data.draw(st.integers(1, 30))
    trace = [data.draw(st.lists(st.integers(0, universe - 1), min_size=1, max_size=capacity // 2, unique=True))
             for _ in range(n + 2)]
    windows = [trace[t + 1:t + 3] for t in range(n)]
    # The previous batch stays pinned while the next one is planned (one batch in flight).
    pins = [set() if t == 0 else set(trace[t - 1]) - set(trace[t]) for t in range(n)]
    pins = [p if len(p) + len(trace[t]) <= capacity else set() for t, p in enumerate(pins)]
    run_both(capacity, trace[:n], windows, pins)


def slide_and_check(idx, capacity: int, trace: list[list[int]], k: int) -> None:
    """Runs trace through idx (empty, window empty) with a window of the next k batches kept by
    pop() + push(), as the engine does, checking each batch's victims against the model."""
    model = LookaheadLRU(capacity)
    for w in trace[1:1 + k]:
        idx.window_push(arr(w))
    for t in range(len(trace) - k - 1):
        model.window = trace[t + 1:t + 1 + k]
        plan = idx.plan(arr(trace[t]))
        idx.commit(arr(trace[t]), plan, False, False)
        assert plan.victim_ids.tolist() == model.access(trace[t]), t
        idx.window_pop()
        idx.window_push(arr(trace[t + 1 + k]))


def test_sliding_window_by_push_and_pop_is_the_same_as_rebuilding_it():
    """A window kept by pop() + push() ranks like a fresh one."""
    rng = np.random.default_rng(0)
    trace = [rng.choice(60, size=rng.integers(1, 15), replace=False).tolist() for _ in range(400)]
    slide_and_check(_C.CacheIndex(20, "lru"), 20, trace, k=3)


def test_sliding_window_past_2_to_the_16_batches():
    """The window keeps batch numbers modulo 2^16: windows that straddle batch 65536 (for 40
    steps in the middle of the check) rank like the model. The slides before the check make no
    plans, so the index starts it empty."""
    rng = np.random.default_rng(3)
    k, capacity = 40, 20
    idx, one = _C.CacheIndex(capacity, "lru"), arr([7])
    for _ in range(k):
        idx.window_push(one)
    for _ in range(65_400):
        idx.window_pop()
        idx.window_push(one)
    for _ in range(k):
        idx.window_pop()
    trace = [rng.choice(60, size=rng.integers(1, 15), replace=False).tolist() for _ in range(300)]
    slide_and_check(idx, capacity, trace, k)


def test_a_full_window_refuses_one_more_batch():
    idx = _C.CacheIndex(10, "lru")
    one = arr([1])
    for _ in range(_C.MAX_WINDOW_BATCHES):
        idx.window_push(one)
    with pytest.raises(ValueError, match="65535 batches, the most it can"):
        idx.window_push(arr([2]))
    assert idx.window_batches == _C.MAX_WINDOW_BATCHES
    idx.window_pop()
    idx.window_push(one)  # room again


@pytest.mark.parametrize("policy", ["lfu", "clock"])
def test_other_policies_take_rows_outside_the_window_first(policy):
    rng = np.random.default_rng(1)
    idx = _C.CacheIndex(16, policy)
    for _ in range(200):
        batch = rng.choice(40, size=rng.integers(1, 8), replace=False)
        window = [rng.choice(40, size=6, replace=False) for _ in range(2)]
        idx.window_clear()
        for w in window:
            idx.window_push(w.astype(np.int64))
        resident = set(idx.resident_ids(0, -1).tolist())
        plan = idx.plan(batch.astype(np.int64))
        used = set(np.concatenate(window).tolist())
        outside = resident - set(batch.tolist()) - used
        victims = plan.victim_ids.tolist()
        assert len(set(victims)) == len(victims) == plan.num_victims
        # Rows outside the window go before any row the window uses.
        taken_outside = [v for v in victims if v not in used]
        assert victims[:len(taken_outside)] == taken_outside
        if len(victims) > len(taken_outside):
            assert len(taken_outside) == len(outside)
        idx.commit(batch.astype(np.int64), plan, False, False)


def test_window_memory_does_not_grow_with_batches():
    """10^4 batches through a window of 4: pushing and popping reuses the same buffers, so a
    long run costs what the first batches cost (RSS measured around the loop)."""
    import psutil

    idx = _C.CacheIndex(1000, "lru")
    rng = np.random.default_rng(2)
    batches = [rng.choice(10**6, size=2000, replace=False).astype(np.int64) for _ in range(16)]
    for b in batches[:4]:
        idx.window_push(b)
    for t in range(500):
        idx.window_pop()
        idx.window_push(batches[t % 16])
    rss = psutil.Process().memory_info().rss
    for t in range(10_000):
        idx.window_pop()
        idx.window_push(batches[t % 16])
    assert psutil.Process().memory_info().rss - rss < 4 << 20
    assert idx.window_batches == 4


# -- the engine: module.prefetch with prefetch_lookahead --------------------------------------

def engine_and_model(trace, capacity, depth, lookahead):
    """Trains a table on the trace with prefetch (depth batches resident ahead, lookahead more
    registered), waiting for the worker after each registration so that pins are the same as
    in the model; replays the same events on the model. Returns (engine tier-0 stats, resident
    ids, model misses, model evictions, model resident ids)."""
    import threading

    import torch

    import tieredemb

    emb = tieredemb.TieredEmbeddingBag(200, 4, mode="sum", cache_rows=capacity, optimizer=tieredemb.SGD(lr=0.1))
    emb.prefetch_lookahead = lookahead
    planned = threading.Semaphore(0)
    make_resident = emb._store.make_resident

    def instrumented(*args, **kwargs):
        result = make_resident(*args, **kwargs)
        if result is not None:  # (None: no room yet; the worker retries)
            planned.release()
        return result

    emb._store.make_resident = instrumented
    batches = [list(dict.fromkeys(b)) for b in trace]  # unique, first-occurrence order (dedup's)
    model = LookaheadLRU(capacity)
    pins: dict[int, set[int]] = {}
    counts = {"misses": 0, "evictions": 0, "registered": 0}

    def model_plan(j, upto):
        model.window = batches[j + 1:upto + 1]
        counts["misses"] += sum(r not in model.lru for r in batches[j])
        counts["evictions"] += len(model.access(batches[j], set().union(*pins.values())))
        pins[j] = set(batches[j])

    def register():
        r = counts["registered"]
        emb.prefetch(torch.tensor(trace[r]), torch.tensor([0]))
        counts["registered"] += 1
        if r - lookahead >= 0:
            assert planned.acquire(timeout=60)
            model_plan(r - lookahead, r)

    for _ in range(min(depth + lookahead, len(trace))):
        register()
    for t in range(len(trace)):
        if counts["registered"] < len(trace):
            register()
        if t not in pins:  # its forward forces it, with the batches registered so far
            model_plan(t, counts["registered"] - 1)
            out = emb(torch.tensor(trace[t]), torch.tensor([0]))
            assert planned.acquire(timeout=60)
        else:
            out = emb(torch.tensor(trace[t]), torch.tensor([0]))
        out.sum().backward()
        del pins[t]
    s = emb.stats()["tier0"]
    resident = set(emb._store.tier0.index.resident_ids(0, -1).tolist())
    return s, resident, counts["misses"], counts["evictions"], set(model.lru)


@pytest.mark.parametrize("depth, lookahead", [(1, 0), (1, 2), (2, 3), (0, 4)])
def test_engine_evicts_by_the_window_of_registered_batches(depth, lookahead):
    rng = np.random.default_rng(3)
    trace = [(rng.random(rng.integers(3, 10)) ** 2 * 120).astype(np.int64).tolist() for _ in range(150)]
    stats, resident, misses, evictions, model_resident = engine_and_model(trace, 40, depth, lookahead)
    assert (stats["misses"], stats["evictions"]) == (misses, evictions)
    assert resident == model_resident


def test_lookahead_saves_misses_over_lru():
    rng = np.random.default_rng(4)
    trace = [(rng.random(8) ** 2 * 120).astype(np.int64).tolist() for _ in range(150)]
    lru = engine_and_model(trace, 30, 1, 0)[0]["misses"]
    ahead = engine_and_model(trace, 30, 1, 4)[0]["misses"]
    assert ahead < 0.95 * lru, (ahead, lru)


@pytest.mark.parametrize("lookahead", [1, 4])
def test_engine_window_equals_the_simulators_lookahead_policy(lookahead):
    """With nothing prefetched ahead (depth 0), a batch's plan sees exactly the next `lookahead`
    registered batches and no other batch is pinned: the simulator's lookahead-k (batch mode)."""
    from tieredemb.sim import simulate

    rng = np.random.default_rng(5)
    trace = [(rng.random(rng.integers(3, 10)) ** 2 * 120).astype(np.int64).tolist() for _ in range(150)]
    stats = engine_and_model(trace, 40, 0, lookahead)[0]
    keys = np.concatenate([np.asarray(b, dtype=np.int64) for b in trace])
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in trace])]).astype(np.int64)
    sim = simulate(keys, offsets, "lookahead", [40], lookahead=lookahead).tiers[0]
    assert (stats["hits"], stats["misses"], stats["evictions"]) == (sim.hits, sim.misses, sim.evictions)
