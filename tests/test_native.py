"""The native core's own contracts: thread-count independence, dedup, lazy host pools, and the
overflow slots of a CacheIndex (through the Python bindings)."""

import numpy as np
import pytest
import torch

import tieredemb
from tieredemb import _C


def _train(threads):
    _C.set_num_threads(threads)
    try:
        emb = tieredemb.TieredEmbeddingBag(5000, 32, mode="mean", cache_rows=900,
                                           optimizer=tieredemb.RowWiseAdagrad(lr=0.1))
        g = torch.Generator().manual_seed(0)
        for _ in range(10):
            ids = torch.randint(0, 5000, (800,), generator=g)
            emb(ids, torch.arange(0, 800, 8)).backward(torch.randn(100, 32, generator=g))
        return emb.read_rows(torch.arange(5000))
    finally:
        _C.set_num_threads(torch.get_num_threads())


def test_results_do_not_depend_on_thread_count_and_pool_restarts():
    """Threads take chunks of a loop in turn, so the cuts move with the thread count (5 threads on
    this 2-core machine also leaves workers that wake after the chunks ran out). Also a regression
    test: workers restarted by set_num_threads once reran a stale call."""
    one, two, five, one_again = _train(1), _train(2), _train(5), _train(1)
    assert torch.equal(one, two) and torch.equal(one, five) and torch.equal(one, one_again)


def test_loops_from_two_threads_at_once_give_the_same_rows():
    """A loop started while another thread's loop holds the pool runs inline on its own thread."""
    import threading

    reference = _train(2)
    results = []
    threads = [threading.Thread(target=lambda: results.append(_train(2))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and all(torch.equal(r, reference) for r in results)


def test_dedup_keeps_first_occurrence_order_and_inverse():
    ids = torch.tensor([7, 3, 7, 9, 3, 3, 0], dtype=torch.int64)
    unique, inverse = _C.dedup(ids, 10)
    assert unique.tolist() == [7, 3, 9, 0]
    assert torch.equal(torch.from_numpy(unique)[torch.from_numpy(inverse)], ids)


def test_dedup_of_a_large_batch_with_many_distinct_ids():
    ids = torch.randint(0, 10**9, (300_000,), generator=torch.Generator().manual_seed(1))
    unique, inverse = _C.dedup(ids, 10**9)
    assert torch.equal(torch.from_numpy(unique)[torch.from_numpy(inverse)], ids)
    assert len(unique) == len(torch.unique(ids))


# -- overflow slots of a CacheIndex ------------------------------------------------------------


def _ids(*v):
    return np.array(v, dtype=np.int64)


def _resident(index, ids, *, pin=True, dirty=False):
    """plan + commit of unique ids; returns the plan."""
    ids = _ids(*ids)
    plan = index.plan(ids)
    index.commit(ids, plan, pin=pin, dirty=dirty)
    return plan


def _full_and_pinned(overflow_limit):
    """A tier of capacity 4 whose 4 slots hold pinned rows 0..3."""
    index = _C.CacheIndex(4, "lru", overflow_limit=overflow_limit)
    _resident(index, range(4))
    return index


def test_a_batch_that_does_not_fit_gets_overflow_slots():
    index = _full_and_pinned(overflow_limit=16)
    plan = index.plan(_ids(*range(10, 16)))
    assert plan.num_overflow == 6 and plan.num_victims == 0
    assert sorted(plan.slots.tolist()) == list(range(4, 10))  # new overflow slots, lowest first
    index.commit(_ids(*range(10, 16)), plan, pin=True, dirty=True)
    assert (index.overflow, index.size, index.pinned) == (6, 10, 10)
    assert index.lookup(_ids(*range(10, 16))).tolist() == plan.slots.tolist()
    s = index.stats()
    assert (s["overflow_rows"], s["writes"], s["misses"]) == (6, 6, 4)
    ids, slots = index.dirty_rows()  # overflow rows are dirty rows like any other
    assert ids.tolist() == list(range(10, 16)) and slots.tolist() == list(range(4, 10))


def test_a_batch_larger_than_the_tier_overflows_beyond_its_capacity():
    index = _C.CacheIndex(4, "clock", overflow_limit=100)
    plan = _resident(index, range(50, 80))
    assert plan.num_overflow == 26 and sorted(plan.slots.tolist()) == list(range(30))
    assert index.overflow == 26 and index.overflow_limit == 100 and index.capacity == 4


def test_unpinned_overflow_rows_are_the_next_plans_victims_and_their_slots_are_freed():
    index = _full_and_pinned(overflow_limit=16)
    first = _resident(index, range(10, 16))
    index.mark_dirty(first.slots[:2])  # rows 10, 11 dirty; 12..15 clean
    index.unpin(first.slots)
    plan = index.plan(_ids(20))  # needs one slot, but every lingering overflow row leaves
    victims = dict(zip(plan.victim_ids.tolist(), plan.victim_dirty.tolist()))
    assert victims == {10: 1, 11: 1, 12: 0, 13: 0, 14: 0, 15: 0}
    assert sorted(plan.dirty_ids.tolist()) == [10, 11]
    assert plan.num_overflow == 1 and plan.slots.tolist() == [4]  # the lowest freed slot
    index.commit(_ids(20), plan, pin=True, dirty=False)
    assert index.overflow == 1 and index.size == 5
    assert index.lookup(_ids(*range(10, 16), 20)).tolist() == [-1] * 6 + [4]
    s = index.stats()
    assert (s["evictions"], s["dirty_writebacks"], s["clean_drops"], s["overflow_rows"]) == (6, 2, 4, 7)
    assert index.dirty_rows()[0].tolist() == []


def test_lingering_overflow_rows_leave_even_when_the_plan_needs_no_room():
    index = _C.CacheIndex(4, "lru", overflow_limit=8)
    plan = _resident(index, range(6))  # 4 regular slots, 2 overflow
    index.unpin(plan.slots)
    hit = index.plan(_ids(0, 1))  # all hits
    overflow_ids = [i for i, s in zip(range(6), plan.slots.tolist()) if s >= 4]
    assert hit.num_misses == 0 and sorted(hit.victim_ids.tolist()) == overflow_ids
    index.commit(_ids(0, 1), hit, pin=False, dirty=False)
    assert index.overflow == 0 and index.size == 4


def test_a_batch_that_uses_an_unpinned_overflow_row_keeps_it_in_place():
    index = _full_and_pinned(overflow_limit=16)
    first = _resident(index, range(10, 13))
    index.unpin(first.slots)
    plan = index.plan(_ids(11, 30))
    assert plan.slots[0] == first.slots[1] and 11 not in plan.victim_ids.tolist()
    assert sorted(plan.victim_ids.tolist()) == [10, 12] and plan.num_misses == 1
    index.commit(_ids(11, 30), plan, pin=True, dirty=False)
    assert index.lookup(_ids(11)).tolist() == [first.slots[1]] and index.overflow == 2
    assert index.stats()["hits"] == 1


def test_evict_after_a_failed_move_frees_overflow_and_regular_slots():
    index = _C.CacheIndex(4, "lru", overflow_limit=16)
    regular = _resident(index, range(4))
    index.unpin(regular.slots[:2])  # rows 0, 1 evictable
    over = _resident(index, range(10, 13), dirty=True)  # 10, 11 take 0's and 1's slots; 12 overflows
    index.unpin(over.slots)
    plan = index.plan(_ids(20, 21, 22))  # evicts 10, 11 (regular) and 12 (lingering overflow)
    assert sorted(zip(plan.victim_ids.tolist(), plan.victim_slots.tolist())) == [(10, 0), (11, 1), (12, 4)]
    assert plan.victim_dirty.tolist() == [1, 1, 1] and plan.num_overflow == 1
    index.evict(plan)  # the move failed after the dirty victims were written down
    assert index.lookup(_ids(10, 11, 12)).tolist() == [-1] * 3
    assert (index.overflow, index.size, index.dirty_rows()[0].tolist()) == (0, 2, [])
    s = index.stats()
    assert (s["evictions"], s["dirty_writebacks"], s["overflow_rows"]) == (5, 3, 1)
    with pytest.raises(RuntimeError, match="stale"):
        index.commit(_ids(20, 21, 22), plan, pin=True, dirty=False)
    again = _resident(index, (20, 21, 22))  # the freed slots serve the retry
    assert sorted(again.slots.tolist()) == [0, 1, 4] and index.overflow == 1


def test_overflow_limit_zero_keeps_the_capacity_error():
    index = _full_and_pinned(overflow_limit=0)
    with pytest.raises(ValueError, match=r"a batch needs 2 new rows in a tier of capacity 4 but only 0 slots "
                                         r"are free or evictable \(0 rows of the batch resident, 4 slots pinned"):
        index.plan(_ids(10, 11))
    assert index.overflow_limit == 0 and index.size == 4


def test_exceeding_the_overflow_limit_names_the_numbers_and_changes_nothing():
    index = _full_and_pinned(overflow_limit=3)
    with pytest.raises(ValueError, match="needs 5 new rows .* only 0 slots are free or evictable and 3 of its 3 "
                                         "overflow slots are free"):
        index.plan(_ids(*range(10, 15)))
    assert _resident(index, range(10, 13)).num_overflow == 3 and index.overflow == 3


def test_direct_index_never_overflows():
    index = _C.DirectIndex(100)
    plan = _resident(index, range(50))
    assert plan.num_overflow == 0 and index.overflow == 0 and index.overflow_limit == 0


def test_slot_arguments_are_checked_against_capacity_plus_overflow_limit():
    index = _full_and_pinned(overflow_limit=2)
    index.unpin(_ids(5))  # an overflow slot holding no row: ignored
    index.mark_dirty(_ids(5))
    assert index.dirty_rows()[0].tolist() == [] and index.pinned == 4
    with pytest.raises(IndexError, match=r"unpin: slot 6 out of range \[0, 6\)"):
        index.unpin(_ids(6))
    with pytest.raises(IndexError, match="mark_dirty: slot -1"):
        index.mark_dirty(_ids(-1))
    with pytest.raises(ValueError, match="overflow_limit must be >= 0"):
        _C.CacheIndex(4, "lru", overflow_limit=-1)


def test_overflow_keeps_the_index_consistent_under_random_batches():
    """Batches in flight pin their rows for 3 steps; after every plan and commit the index agrees
    with what it reports: slots unique, pinned rows never victims, every lingering overflow row a
    victim, overflow within its limit, regular slots for the policy's rows."""
    rng = np.random.default_rng(7)
    capacity, limit = 8, 40
    index = _C.CacheIndex(capacity, "lru", overflow_limit=limit)
    in_flight, pins = [], {}
    for step in range(400):
        ids = rng.choice(60, size=int(rng.integers(1, 16)), replace=False).astype(np.int64)
        before = dict(zip(range(60), index.lookup(_ids(*range(60))).tolist()))
        plan = index.plan(ids)
        victims = plan.victim_ids.tolist()
        assert not set(victims) & set(ids.tolist())
        assert all(pins.get(v, 0) == 0 for v in victims)
        lingering = {i for i, s in before.items() if s >= capacity and pins.get(i, 0) == 0 and i not in set(ids)}
        assert lingering <= set(victims)
        index.commit(ids, plan, pin=True, dirty=bool(step % 2))
        for i in ids.tolist():
            pins[i] = pins.get(i, 0) + 1
        in_flight.append(plan.slots.copy())
        slots = index.lookup(_ids(*range(60)))
        held = slots[slots >= 0]
        assert len(set(held.tolist())) == len(held) == index.size
        assert index.overflow == int((held >= capacity).sum()) <= limit
        assert (index.lookup(ids) == plan.slots).all()
        dirty_ids, dirty_slots = index.dirty_rows()
        assert (index.lookup(dirty_ids) == dirty_slots).all()
        if len(in_flight) > 3:
            done = in_flight.pop(0)
            index.unpin(done)
            for i, s in enumerate(slots.tolist()):
                if s in set(done.tolist()):
                    pins[i] -= 1
        assert index.pinned == sum(1 for c in pins.values() if c > 0)
    assert index.stats()["overflow_rows"] > 0


def test_host_pool_faults_in_a_prefix_and_keeps_the_positional_form():
    pool = _C.host_pool(1000, 8, populate_rows=10, huge_pages_rows=1000)
    assert pool.shape == (1000, 8) and not pool.any()
    pool[999] = 1.0  # the lazily reserved rest is writable
    assert _C.host_pool(4, 2, True, False).shape == (4, 2)
    with pytest.raises(ValueError, match=r"populate_rows 11 must be in \[0, rows = 10\]"):
        _C.host_pool(10, 8, populate_rows=11)
