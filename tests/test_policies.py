"""Eviction policies and the tier index, on tieredemb._C.CacheIndex directly (plan / commit /
lookup / unpin / mark_dirty), without tables or tensors in the way."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tieredemb import _C

POLICIES = ("lru", "lfu", "clock")


def arr(ids) -> np.ndarray:
    return np.asarray(list(ids), dtype=np.int64)


def access(index, ids, *, pin=False, dirty=False):
    """One batch of unique ids made resident; returns the committed plan."""
    a = arr(ids)
    plan = index.plan(a)
    index.commit(a, plan, pin, dirty)
    return plan


def resident(index) -> set[int]:
    return set(index.resident_ids(0, -1).tolist())


def slot_of(index, i: int) -> int:
    return int(index.lookup(arr([i]))[0])


def plan_fields(plan) -> tuple:
    return (plan.slots.tolist(), plan.miss_index.tolist(), plan.victim_ids.tolist(), plan.victim_slots.tolist(),
            plan.victim_dirty.tolist())


def index_state(index, ids=range(64)) -> tuple:
    d_ids, d_slots = index.dirty_rows()
    return (index.lookup(arr(ids)).tolist(), index.size, index.pinned, dict(index.stats()), d_ids.tolist(),
            d_slots.tolist())


# -- LRU ------------------------------------------------------------------------------------


def test_lru_evicts_least_recently_used():
    idx = _C.CacheIndex(3, "lru")
    for i in (1, 2, 3, 1):  # 1 is used again: 2 is now the least recent
        access(idx, [i])
    assert access(idx, [4]).victim_ids.tolist() == [2]
    assert resident(idx) == {1, 3, 4}
    assert access(idx, [5]).victim_ids.tolist() == [3]
    # Two misses at once: victims come best first (least recent first).
    access(idx, [4])
    assert access(idx, [6, 7]).victim_ids.tolist() == [1, 5]
    assert resident(idx) == {4, 6, 7}


def test_lru_victim_slot_is_reused_by_the_new_row():
    idx = _C.CacheIndex(2, "lru")
    access(idx, [10])
    access(idx, [20])
    s10 = slot_of(idx, 10)
    plan = access(idx, [30])
    assert plan.victim_slots.tolist() == [s10]
    assert slot_of(idx, 30) == s10 and slot_of(idx, 10) == -1


# -- LFU ------------------------------------------------------------------------------------


def test_lfu_evicts_least_frequently_used_not_least_recent():
    idx = _C.CacheIndex(3, "lfu")
    # uses: 1 -> 5, 2 -> 3, 3 -> 2; least recent of them is 2, least frequent is 3.
    for i in (1, 2, 3, 2, 2, 1, 1, 1, 1, 3):
        access(idx, [i])
    assert access(idx, [4]).victim_ids.tolist() == [3]
    # The newcomer (one use) goes before the established rows.
    assert access(idx, [5]).victim_ids.tolist() == [4]
    assert resident(idx) == {1, 2, 5}

    lru = _C.CacheIndex(3, "lru")  # the same sequence under LRU picks a different row
    for i in (1, 2, 3, 2, 2, 1, 1, 1, 1, 3):
        access(lru, [i])
    assert access(lru, [4]).victim_ids.tolist() == [2]


@pytest.mark.parametrize("others_rounds, hot_survives", [(100, True), (1500, False)])
def test_lfu_aging_lets_a_formerly_hot_row_go(others_rounds, hot_survives):
    idx = _C.CacheIndex(4, "lfu")
    for _ in range(2000):  # row 0 is very hot for a while
        access(idx, [0])
    for _ in range(others_rounds):  # then only 1, 2, 3 are used (each fewer times than 0 was)
        access(idx, [1, 2, 3])
    victim = access(idx, [99]).victim_ids.tolist()
    assert len(victim) == 1
    if hot_survives:
        assert victim != [0] and 0 in resident(idx)
    else:
        # Without aging 0 (2000 uses) would outrank 1, 2, 3 (1500 uses each) forever.
        assert victim == [0] and 0 not in resident(idx)


# -- CLOCK ----------------------------------------------------------------------------------


def test_clock_gives_a_second_chance():
    idx = _C.CacheIndex(3, "clock")
    access(idx, [1])
    access(idx, [2])
    access(idx, [3])
    # All referenced: one sweep clears them all, then the hand takes the first: 1.
    assert access(idx, [4]).victim_ids.tolist() == [1]
    # 2 is used again: its bit is set, so the hand passes over it (clearing it) and takes 3.
    # FIFO would take 2 (the oldest); CLOCK gives it a second chance.
    access(idx, [2])
    assert access(idx, [5]).victim_ids.tolist() == [3]
    assert resident(idx) == {2, 4, 5}
    # 2 spent its second chance: unused since, it goes before 4 and 5 are swept twice.
    assert access(idx, [6]).victim_ids.tolist() == [2]


# -- plan / commit --------------------------------------------------------------------------


def _warm(idx, seq=((1,), (2,), (3,), (1,), (4,), (2,), (5,))):
    for batch in seq:
        access(idx, batch, dirty=batch[0] % 2 == 1)


@pytest.mark.parametrize("policy", POLICIES)
def test_plan_changes_nothing_until_committed(policy):
    idx = _C.CacheIndex(4, policy)
    _warm(idx)
    before = index_state(idx)
    batch = arr([7, 1, 8])
    p1 = idx.plan(batch)
    p2 = idx.plan(batch)
    assert plan_fields(p1) == plan_fields(p2)
    assert idx.size == 4 and p1.num_misses >= 2 and p1.num_victims == p1.num_misses  # a full tier evicts
    assert index_state(idx) == before
    idx.commit(batch, p2, False, False)
    assert resident(idx) >= {7, 1, 8}
    assert idx.lookup(batch).tolist() == p2.slots.tolist()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_plan_commits_only_once(policy):
    idx = _C.CacheIndex(4, policy)
    _warm(idx)
    batch = arr([7, 8])
    plan = idx.plan(batch)
    idx.commit(batch, plan, False, False)
    state = index_state(idx)
    with pytest.raises(RuntimeError, match="stale"):
        idx.commit(batch, plan, False, False)
    assert index_state(idx) == state


@pytest.mark.parametrize("policy", POLICIES)
def test_failed_plan_leaves_the_index_unchanged(policy):
    idx, twin = _C.CacheIndex(4, policy), _C.CacheIndex(4, policy)
    for t in (idx, twin):
        _warm(t)
        access(t, [1, 2, 3], pin=True)  # 3 of 4 slots pinned
    before = index_state(idx)
    with pytest.raises(ValueError, match="pinned") as e:
        idx.plan(arr([10, 11]))  # needs 2 slots, only 1 evictable
    assert "capacity 4" in str(e.value)
    assert index_state(idx) == before
    # And the policy state is untouched too: from here both behave identically.
    for batch in ([10], [11], [3, 12], [13]):
        p, q = access(idx, batch), access(twin, batch)
        assert plan_fields(p) == plan_fields(q)
    assert index_state(idx) == index_state(twin)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_failed_plans_selection_is_not_applied_by_a_later_commit(policy):
    """A commit with no selection of its own (a batch of hits) applied the last failed plan's
    clock sweep (its hand and cleared bits): later victims differed from a tier where no plan failed."""
    victims = []
    for failed in (False, True):
        idx = _C.CacheIndex(4, policy)
        access(idx, [0, 1, 2, 3])
        access(idx, [0, 1], pin=True)
        if failed:
            with pytest.raises(ValueError, match="pinned"):
                idx.plan(arr([4, 5, 6]))  # 3 new rows, 2 slots evictable
        access(idx, [2])  # hits only
        idx.unpin(idx.lookup(arr([0, 1])))
        victims.append(idx.plan(arr([7])).victim_ids.tolist())
    assert victims[0] == victims[1]


@pytest.mark.parametrize("policy", POLICIES)
def test_batch_larger_than_the_tier_is_refused(policy):
    idx = _C.CacheIndex(3, policy)
    _warm(idx)
    before = index_state(idx)
    with pytest.raises(ValueError, match="capacity 3"):
        idx.plan(arr([20, 21, 22, 23]))
    assert index_state(idx) == before


@pytest.mark.parametrize("policy", POLICIES)
def test_rows_of_the_batch_are_not_their_own_victims(policy):
    idx = _C.CacheIndex(3, policy)
    for i in (1, 2, 3):
        access(idx, [i])
    # 1 is the natural victim for every policy here, but it is part of the batch.
    plan = access(idx, [1, 4])
    assert 1 not in plan.victim_ids.tolist()
    assert {1, 4} <= resident(idx)


# -- pins -----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_pinned_slots_are_never_chosen(policy):
    idx = _C.CacheIndex(4, policy)
    access(idx, [1, 2], pin=True)  # the oldest, least used rows: every policy's first choice
    assert idx.pinned == 2
    for i in range(3, 60):
        plan = access(idx, [i])
        assert not {1, 2} & set(plan.victim_ids.tolist())
        assert {1, 2} <= resident(idx)
    # Pinned twice, unpinned once: still pinned.
    access(idx, [1], pin=True)
    idx.unpin(idx.lookup(arr([1, 2])))
    assert idx.pinned == 1
    for i in range(60, 70):
        access(idx, [i])
        assert 1 in resident(idx)
    idx.unpin(idx.lookup(arr([1])))
    assert idx.pinned == 0
    # Unpinned, it is evictable again (LFU: once others are used more often than its 2 uses).
    for _ in range(5):
        access(idx, [70, 71, 72])
    access(idx, [73])
    assert not {1, 2} & resident(idx)


@pytest.mark.parametrize("policy", POLICIES)
def test_all_pinned_refuses_any_miss(policy):
    idx = _C.CacheIndex(2, policy)
    access(idx, [1, 2], pin=True)
    with pytest.raises(ValueError, match="2 slots pinned"):
        idx.plan(arr([3]))
    # Hits need no slot: a batch of resident rows is fine.
    plan = access(idx, [2, 1])
    assert plan.num_misses == 0 and plan.num_victims == 0


# -- dirty bits -----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_victims_report_their_dirty_flags(policy):
    idx = _C.CacheIndex(3, policy)
    access(idx, [1], dirty=True)
    access(idx, [2])
    access(idx, [3])
    idx.mark_dirty(idx.lookup(arr([3])))
    assert sorted(idx.dirty_rows()[0].tolist()) == [1, 3]
    plan = access(idx, [4, 5, 6])
    flags = dict(zip(plan.victim_ids.tolist(), plan.victim_dirty.tolist()))
    assert flags == {1: 1, 2: 0, 3: 1}
    s = idx.stats()
    assert (s["evictions"], s["dirty_writebacks"], s["clean_drops"]) == (3, 2, 1)
    # New rows arrive clean, even in a slot that held a dirty row.
    assert idx.dirty_rows()[0].tolist() == []
    idx.mark_dirty(idx.lookup(arr([5])))
    idx.mark_clean(idx.lookup(arr([5])))
    plan = access(idx, [7])
    assert plan.victim_dirty.tolist() == [0]


def test_dirty_commit_and_hit_stats():
    idx = _C.CacheIndex(4, "lru")
    access(idx, [1, 2])
    access(idx, [2, 3], dirty=True)  # a hit marked dirty and a new row marked dirty
    assert sorted(idx.dirty_rows()[0].tolist()) == [2, 3]
    s = idx.stats()
    # A dirty commit is a write (a write-back or write_rows), counted apart from read lookups.
    assert (s["hits"], s["misses"], s["writes"]) == (0, 2, 2)
    idx.reset_stats()
    assert all(v == 0 for v in idx.stats().values())


def test_constructor_rejects_bad_arguments():
    with pytest.raises(ValueError, match="'fifo'"):
        _C.CacheIndex(4, "fifo")
    with pytest.raises(ValueError, match="0"):
        _C.CacheIndex(0, "lru")
    assert _C.CacheIndex(4, "clock").policy == "clock"


# -- LRU against a model --------------------------------------------------------------------


class LruModel:
    """The LRU contract in a few lines: victims are the least recent resident rows that are
    neither pinned nor part of the batch; the batch's rows become most recent, in batch order."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.order: OrderedDict[int, None] = OrderedDict()  # least recent first
        self.pins: dict[int, int] = {}

    def batch(self, ids: list[int], pin: bool) -> list[int] | None:
        batch = set(ids)
        misses = [i for i in ids if i not in self.order]
        need = len(misses) - (self.capacity - len(self.order))
        victims = []
        if need > 0:
            victims = [i for i in self.order if i not in batch and not self.pins.get(i)][:need]
            if len(victims) < need:
                return None
        for v in victims:
            del self.order[v]
        for i in ids:
            self.order[i] = None
            self.order.move_to_end(i)
            if pin:
                self.pins[i] = self.pins.get(i, 0) + 1
        return victims

    def unpin(self, ids: list[int]) -> None:
        for i in ids:
            if self.pins.get(i):
                self.pins[i] -= 1


_step = st.one_of(
    st.tuples(st.just("batch"), st.lists(st.integers(0, 11), min_size=1, max_size=6, unique=True), st.booleans()),
    st.tuples(st.just("unpin"), st.lists(st.integers(0, 11), max_size=4, unique=True), st.just(False)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(capacity=st.integers(1, 5), steps=st.lists(_step, min_size=1, max_size=40))
def test_lru_matches_a_python_model(capacity, steps):
    idx = _C.CacheIndex(capacity, "lru")
    model = LruModel(capacity)
    for kind, ids, pin in steps:
        if kind == "unpin":
            held = [i for i in ids if i in model.order]
            model.unpin(held)
            idx.unpin(idx.lookup(arr(held)))
        else:
            slots_before = {i: slot_of(idx, i) for i in model.order}
            expected = model.batch(ids, pin)
            if expected is None:
                before = index_state(idx, range(12))
                with pytest.raises(ValueError):
                    idx.plan(arr(ids))
                assert index_state(idx, range(12)) == before
            else:
                plan = access(idx, ids, pin=pin)
                assert plan.victim_ids.tolist() == expected
                # Rows that stay keep their slots.
                for i, s in slots_before.items():
                    if i in model.order:
                        assert slot_of(idx, i) == s
        assert resident(idx) == set(model.order)
        assert idx.size == len(model.order)
        assert idx.pinned == sum(1 for i, n in model.pins.items() if n and i in model.order)
