"""The native core's own contracts: thread-count independence, dedup, lazy host pools, the
overflow slots of a CacheIndex, and rows of 16-bit weights (through the Python bindings)."""

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from test_random_init import mix64, row_key  # the numpy twins of random.cc's hashes
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


@pytest.mark.parametrize("src", [torch.int64, torch.int32])
def test_host_ids_for_the_gpu_are_checked_and_narrowed_in_one_pass(src):
    """gpu/checks.checked_ids: a host batch bound for a GPU tier 0, copied into a new tensor as
    int32 where every id fits (as int64 past 2^31 rows), the first id out of range named."""
    from tieredemb.gpu.checks import checked_ids

    ids = torch.tensor([7, 0, 99, 7, 42, 5, 3, 1], dtype=src)[::2]  # (not contiguous)
    got = checked_ids(ids, 100, pin=False)
    assert got.dtype == torch.int32 and got.tolist() == [7, 99, 42, 3] and got.data_ptr() != ids.data_ptr()
    wide = checked_ids(ids, (1 << 31) + 1, pin=False)
    assert wide.dtype == torch.int64 and wide.tolist() == [7, 99, 42, 3]
    for bad, rows in (([5, 100, -1, 200], 100), ([5, -3, 100], 100), ([0, 1 << 31], 1 << 31)):
        first = next(i for i in bad if not 0 <= i < rows)
        with pytest.raises(IndexError, match=rf"^id {first} out of range \[0, {rows}\)$"):
            checked_ids(torch.tensor(bad, dtype=torch.int64), rows, pin=False)
    assert checked_ids(torch.empty(0, dtype=src), 10, pin=False).numel() == 0
    assert checked_ids(torch.tensor([3, 4], dtype=torch.int16), 10, pin=False).tolist() == [3, 4]
    with pytest.raises(ValueError, match="out has 2 entries, the ids 3"):
        _C.checked_copy(np.arange(3), 10, np.empty(2, np.int32))


@pytest.mark.parametrize("threads", [1, 5])
def test_a_large_host_batch_is_checked_in_ranges_on_the_pool(threads):
    """checked_copy takes ranges of 16K ids on the pool's threads: the copy is whole, and the id
    out of range is found and named in any range, the last included, whatever the thread count."""
    from tieredemb.gpu.checks import checked_ids

    ids = torch.randint(0, 1000, (100_003,), generator=torch.Generator().manual_seed(2))
    _C.set_num_threads(threads)
    try:
        assert torch.equal(checked_ids(ids, 1000, pin=False), ids.to(torch.int32))
        for at, bad in ((100_002, 1000), (50_000, -7), (3, 5000)):
            broken = ids.clone()
            broken[at] = bad
            with pytest.raises(IndexError, match=rf"^id {bad} out of range \[0, 1000\)$"):
                checked_ids(broken, 1000, pin=False)
    finally:
        _C.set_num_threads(torch.get_num_threads())


def test_dedup_of_a_large_batch_with_many_distinct_ids():
    ids = torch.randint(0, 10**9, (300_000,), generator=torch.Generator().manual_seed(1))
    unique, inverse = _C.dedup(ids, 10**9)
    assert torch.equal(torch.from_numpy(unique)[torch.from_numpy(inverse)], ids)
    assert len(unique) == len(torch.unique(ids))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("wide", [False, True], ids=["uint32 keys", "int64 keys"])
def test_dedup_of_segments_of_disjoint_ranges_is_the_whole_batchs(threads, wide):
    """A collection's batch (each table's ids a run of its own row range, an empty run among
    them) deduplicated run by run, in parallel, equals the dedup of the whole batch."""
    g = np.random.default_rng(3)
    scale = 10**10 if wide else 1
    ends = np.array([1000, 1000, 50_000, 50_100, 4_000_000]) * scale
    lengths = [3000, 0, 20_000, 700, 9000]
    runs = [g.integers(lo, hi, n) for lo, hi, n in zip([0, *ends[:-1]], ends, lengths)]
    ids = torch.from_numpy(np.concatenate(runs))
    starts = torch.from_numpy(np.cumsum([0] + lengths))
    _C.set_num_threads(threads)
    try:
        whole = _C.dedup(ids, int(ends[-1]))
        runwise = _C.dedup(ids, int(ends[-1]), starts, torch.from_numpy(ends))
    finally:
        _C.set_num_threads(torch.get_num_threads())
    assert np.array_equal(runwise[0], whole[0]) and np.array_equal(runwise[1], whole[1])


_OUT_OF_MEMORY_CHILD = """
import resource, numpy as np, torch
from tieredemb import _C
_C.set_num_threads(2)
n = 6_000_000
ids = torch.from_numpy(np.random.default_rng(0).permutation(2 * n)[:n])
starts, ends = torch.tensor([0, n // 2, n]), torch.tensor([2 * n, 2 * n])
ids[n // 2:] = ids[n // 2:] % n + n
ids[:n // 2] %= n
ends[0] = n
small = (ids[:1000] % n).contiguous()
_C.dedup(small, 2 * n, torch.tensor([0, 1000]), torch.tensor([2 * n]))  # the pool's threads up
size = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize"))
resource.setrlimit(resource.RLIMIT_AS, (size + 60 * 2**20, resource.RLIM_INFINITY))
try:
    _C.dedup(ids, 2 * n, starts, ends)
    print("no error")
except MemoryError:
    print("MemoryError")
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
whole, runs = _C.dedup(ids, 2 * n), _C.dedup(ids, 2 * n, starts, ends)
print("equal after" if np.array_equal(whole[0], runs[0]) and np.array_equal(whole[1], runs[1]) else "differ")
"""


def test_running_out_of_memory_in_a_parallel_loop_raises_and_the_pool_lives_on():
    """Real allocation failures (the address space capped with RLIMIT_AS, in a child process)
    inside the threads of a dedup by runs: MemoryError, not a crash, and the next loops on the
    same pool give the right result."""
    done = subprocess.run([sys.executable, "-c", _OUT_OF_MEMORY_CHILD], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["MemoryError", "equal after"], done.stdout


def test_dedup_segments_are_checked_by_value():
    ids, ends = torch.tensor([1, 2, 5, 7]), torch.tensor([4, 8])
    bad = [((torch.tensor([0, 2, 4]), torch.tensor([4, 6])), IndexError,
            r"id 7 out of range \[4, 6\) of its segment 1"),
           ((torch.tensor([0, 3, 4]), ends), IndexError, r"id 5 out of range \[0, 4\) of its segment 0"),
           ((torch.tensor([0, 2, 3]), ends), ValueError, r"segment starts must run from 0 to the 4 ids, got 0 .. 3"),
           ((torch.tensor([0, 3, 2, 4]), torch.tensor([4, 4, 8])), ValueError, r"non-decreasing, got starts\[2\] = 2"),
           ((torch.tensor([0, 2, 4]), torch.tensor([4, 9])), ValueError, r"row_ends must ascend within \[0, 8\]"),
           ((torch.tensor([0, 4]), ends), ValueError, r"2 segments \(row_ends\) need 3 starts, got 2"),
           ((torch.tensor([0, 2, 4]), None), ValueError, r"give starts and row_ends together")]
    for (starts, row_ends), error, message in bad:
        with pytest.raises(error, match=message):
            _C.dedup(ids, 8, starts, row_ends)


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


def test_a_host_pool_past_the_address_space_is_refused_by_size():
    """rows x row bytes wrapped: a 1-byte mapping was made for 2^60 rows (found under UBSan)."""
    for rows, width in ((2**60, 4), (4, 2**62), (2**63 - 1, 4)):
        with pytest.raises(ValueError, match="past the address space"):
            _C.host_pool(rows, width)


def test_host_pool_faults_in_a_prefix_and_keeps_the_positional_form():
    pool = _C.host_pool(1000, 8, populate_rows=10, huge_pages_rows=1000)
    assert pool.shape == (1000, 8) and not pool.any()
    pool[999] = 1.0  # the lazily reserved rest is writable
    assert _C.host_pool(4, 2, True, False).shape == (4, 2)
    with pytest.raises(ValueError, match=r"populate_rows 11 must be in \[0, rows = 10\]"):
        _C.host_pool(10, 8, populate_rows=11)


# -- reduced-precision weights: float16 / bfloat16 rows, float32 optimizer state -----------------
#
# A row of 16-bit weights holds weight d as the 16-bit value at byte 2d; its weights take
# weight_words = (dim + 1) / 2 float32 words (the last half-word of an odd dim is padding, 0) and
# the float32 optimizer state follows. The kernels compute in float32 on the decoded weights.

F16, BF16 = 1, 2
_DTYPE = {F16: torch.float16, BF16: torch.bfloat16}
_BITS16 = pytest.mark.parametrize("wt", [F16, BF16], ids=["float16", "bfloat16"])


def _halves(x, wt):
    """torch's round-to-nearest-even of float32 x to the 16-bit type, as int16 bits."""
    return torch.as_tensor(x).to(_DTYPE[wt]).view(torch.int16)


def _pack(w, wt, extra=0):
    """float32 [n, dim] -> rows of 16-bit weights (rounded by torch), then `extra` state words."""
    n, dim = w.shape
    h = torch.zeros(n, 2 * _C.weight_words(wt, dim), dtype=torch.int16)
    h[:, :dim] = _halves(w, wt)
    return torch.cat([h.view(torch.float32), torch.zeros(n, extra)], 1).contiguous()


def _weights(rows, dim, wt):
    """The 16-bit weights of rows as int16 bits [n, dim]."""
    return rows[:, :_C.weight_words(wt, dim)].contiguous().view(torch.int16)[:, :dim]


def _decoded(rows, dim, wt):
    """The 16-bit weights of rows as float32 [n, dim] (exact)."""
    return _weights(rows, dim, wt).view(_DTYPE[wt]).float()


def _padding(rows, dim, wt):
    """The padding half-word of rows of an odd dim as int16 [n, 1] ([n, 0] for an even dim)."""
    words = _C.weight_words(wt, dim)
    return rows[:, :words].contiguous().view(torch.int16)[:, dim:]


def test_weight_words_and_the_weight_type_is_checked():
    assert [_C.weight_words(t, 5) for t in (0, F16, BF16)] == [5, 3, 3]
    assert _C.weight_words(F16, 128) == 64
    for call in (lambda: _C.weight_words(5, 8),
                 lambda: _C.init_rows(np.arange(2), np.zeros((2, 8), np.float32), 8, 0, 0.0, 1.0, 0, -1, weights=5)):
        with pytest.raises(ValueError, match=r"weights type 5 is not 0 \(float32\), 1 \(float16\) or 2 \(bfloat16\)"):
            call()
    with pytest.raises(ValueError, match=r"dim 9 must be in \[1, 2 \* row width = 8\] for 16-bit weights"):
        _C.init_rows(np.arange(2), np.zeros((2, 4), np.float32), 9, 0, 0.0, 1.0, 0, -1, weights=F16)


@_BITS16
@pytest.mark.parametrize("dim", [1, 13, 64])
@pytest.mark.parametrize("kind", [0, 1, 2])
def test_init_rows_are_the_float32_draws_rounded_to_nearest_even(wt, dim, kind):
    ids = np.array([0, 5, 7, 10**9, 123456789], np.int64)
    want = np.empty((len(ids), dim), np.float32)
    _C.init_rows(ids, want, dim, kind, -0.5, 2.0, 42, 7)
    width = _C.weight_words(wt, dim) + 3
    got = np.full((len(ids), width), np.nan, np.float32)  # init writes every word of its rows
    _C.init_rows(ids, got, dim, kind, -0.5, 2.0, 42, 7, weights=wt)
    got = torch.from_numpy(got)
    assert torch.equal(_weights(got, dim, wt), _halves(want, wt))
    assert not _padding(got, dim, wt).any() and not got[:, _C.weight_words(wt, dim):].any()
    # read_or_init: absent rows (src row -1) are the same initial rows; present rows are copied
    src = torch.randn(3, width)
    dst = torch.zeros(4, width)
    copied = _C.read_or_init(src, torch.tensor([2, -1, 0, -1]), torch.tensor([9, 5, 9, 10**9]), dst,
                             torch.tensor([3, 0, 1, 2]), dim, kind, -0.5, 2.0, 42, 7, weights=wt)
    assert copied == 2 and torch.equal(dst[3], src[2]) and torch.equal(dst[1], src[0])
    assert torch.equal(dst[0], got[1]) and torch.equal(dst[2], got[3])


def _bags(seed, rows, num_unique, n, num_bags):
    """A deduplicated batch: slots of its unique rows in a pool of `rows`, inverse [n], offsets
    [num_bags + 1] (some bags empty)."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(rows, generator=g)[:num_unique]
    inverse = torch.randint(0, num_unique, (n,), generator=g)
    inverse[:num_unique] = torch.arange(num_unique)  # every unique row occurs
    inner = torch.sort(torch.randint(0, n + 1, (num_bags - 1,), generator=g)).values
    offsets = torch.cat([torch.tensor([0]), inner, torch.tensor([n])])
    return slots, inverse, offsets, torch.rand(n, generator=g) + 0.5


def _forward(pool, dim, batch, mode, weighted, skip_u, wt):
    slots, inverse, offsets, psw = batch
    out = torch.empty(len(offsets) - 1, dim)
    argmax = torch.empty((len(offsets) - 1) * dim, dtype=torch.int64) if mode == 2 else None
    _C.pool_forward(pool, dim, slots, inverse, offsets, psw if weighted else None, mode, skip_u, out, argmax,
                    weights=wt)
    return out, argmax


@_BITS16
@pytest.mark.parametrize("dim", [5, 13, 40, 128])
@pytest.mark.parametrize("mode, weighted", [(0, False), (0, True), (1, False), (2, False)])
def test_forward_of_16bit_rows_is_the_float32_forward_of_the_decoded_weights(wt, dim, mode, weighted):
    batch = _bags(dim + mode, rows=300, num_unique=60, n=500, num_bags=64)
    pool = _pack(torch.randn(300, dim, generator=torch.Generator().manual_seed(3)), wt, extra=2)
    decoded = _decoded(pool, dim, wt)
    for skip_u in (-1, 4):
        out, argmax = _forward(pool, dim, batch, mode, weighted, skip_u, wt)
        want, want_argmax = _forward(decoded, dim, batch, mode, weighted, skip_u, 0)
        assert torch.equal(out, want)
        assert mode != 2 or torch.equal(argmax, want_argmax)


def _opt(kind, *, sr=False, seed=0, step=0, lr=0.05):
    o = _C.OptimizerArgs()
    o.kind, o.lr, o.adam_step_size = kind, lr, lr * 0.9
    o.stochastic_rounding, o.sr_seed, o.step = sr, seed, step
    return o


def _state(kind, rows, dim, g):
    """Optimizer state [rows, state_width] that the optimizer can continue from."""
    s = torch.rand(rows, _C.state_width(kind, dim), generator=g)
    if kind == 3:
        s[:, :dim] -= 0.5  # Adam's first moment has either sign
    return s


def _backward(pool, dim, batch, mode, weighted, opt, wt, unique_ids=None):
    """Forward (for max pooling's argmax), then the fused backward; returns psw_grad."""
    slots, inverse, offsets, psw = batch
    _, argmax = _forward(pool, dim, batch, mode, weighted, 2, wt)
    grad = torch.randn(len(offsets) - 1, dim, generator=torch.Generator().manual_seed(11))
    psw_grad = torch.empty(len(inverse))
    _C.pool_backward_update(pool, dim, slots, inverse, offsets, psw if weighted else None, mode, 2, grad, argmax,
                            opt, 5, psw_grad if weighted else None, weights=wt, unique_ids=unique_ids)
    return psw_grad


@_BITS16
@pytest.mark.parametrize("kind", [0, 1, 2, 3], ids=["sgd", "adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("dim, mode, weighted", [(13, 0, True), (40, 1, False), (128, 2, False)])
def test_backward_updates_the_decoded_weights_then_rounds_to_nearest_even(wt, kind, dim, mode, weighted):
    g = torch.Generator().manual_seed(kind)
    batch = _bags(dim, rows=200, num_unique=50, n=400, num_bags=48)
    w, state = torch.randn(200, dim, generator=g), _state(kind, 200, dim, g)
    pool = torch.cat([_pack(w, wt), state], 1)
    reference = torch.cat([_decoded(pool, dim, wt), state], 1)  # float32 rows of the same values
    psw_grad = _backward(pool, dim, batch, mode, weighted, _opt(kind), wt)
    want_psw_grad = _backward(reference, dim, batch, mode, weighted, _opt(kind), 0)
    assert torch.equal(_weights(pool, dim, wt), _halves(reference[:, :dim], wt))
    assert torch.equal(pool[:, _C.weight_words(wt, dim):], reference[:, dim:])  # the state, bit for bit
    assert not _padding(pool, dim, wt).any()
    assert not weighted or torch.equal(psw_grad, want_psw_grad)
    changed = (_weights(pool, dim, wt) != _halves(w, wt)).any(1)
    assert changed.sum() >= 40  # the batch's rows moved (not the frozen or skipped ones)


def _stochastic_reference(x, wt, ids, seed, step):
    """The documented stochastic rounding of float32 x [n, dim] (row i is row id ids[i]), in
    numpy: int16 bits [n, dim]. Weight d of row id takes r = the high 32 bits of
    mix64(row_key(seed, id) + (step << 20) + d + 1)."""
    n, dim = x.shape
    keys = np.array([(row_key(seed, int(i)) + (step << 20)) % 2**64 for i in ids], np.uint64)
    with np.errstate(over="ignore"):
        r = (mix64(keys[:, None] + np.arange(1, dim + 1, dtype=np.uint64)) >> np.uint64(32)).astype(np.uint32)
    nearest = _halves(x, wt).numpy().view(np.uint16)
    x = x.numpy()
    finite = np.isfinite(x)
    if wt == BF16:  # a uniform 16-bit value added to the magnitude, then truncated
        out = ((x.view(np.uint32) + (r >> np.uint32(16))) >> np.uint32(16)).astype(np.uint16)
    else:  # lo: toward zero; hi: the next half away from zero; hi with probability frac
        half_abs = lambda h: (h & np.uint16(0x7FFF)).view(np.float16).astype(np.float32)  # noqa: E731
        ax = np.abs(x)
        lo = np.where(half_abs(nearest) > ax, nearest - np.uint16(1), nearest).astype(np.uint16)
        hi = (lo + np.uint16(1)).astype(np.uint16)
        hi_inf = (hi & np.uint16(0x7FFF)) == 0x7C00
        with np.errstate(invalid="ignore", divide="ignore"):
            frac = np.where(hi_inf | ~finite, np.float32(0), (ax - half_abs(lo)) / (half_abs(hi) - half_abs(lo)))
        u = (r >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)
        out = np.where(u < frac, hi, lo)
    return torch.from_numpy(np.where(finite, out, nearest).view(np.int16))


def _round_through_sgd(targets, wt, *, sr, ids=None, seed=0, step=0):
    """Rows of zero weights, each alone in a bag, one SGD step (lr 1) with gradient -targets: the
    optimizer computes exactly the targets in float32, and the kernel rounds them into the rows.
    Returns the rows' weights as int16 bits."""
    n, dim = targets.shape
    pool = torch.zeros(n, _C.weight_words(wt, dim))
    offsets, slots = torch.arange(n + 1), torch.arange(n)
    _C.pool_backward_update(pool, dim, slots, slots, offsets, None, 0, -1, -targets, None,
                            _opt(0, sr=sr, seed=seed, step=step, lr=1.0), -1, None, weights=wt,
                            unique_ids=None if ids is None else torch.as_tensor(ids, dtype=torch.int64))
    assert not _padding(pool, dim, wt).any()
    return _weights(pool, dim, wt)


def _edge_values(wt):
    """float32 values around the 16-bit type's limits: zeros, ties, subnormals, overflow, inf, NaN."""
    common = [0.0, 1.0, -1.0, 1 / 3, -1 / 3, 1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8,
              float("inf"), float("-inf"), float("nan"), 1e-30, -1e-40]
    if wt == F16:
        return common + [65504.0, 65519.0, 65520.0, 70000.0, -1e6, 2**-24, 2**-25, 3 * 2**-26, -1e-8,
                         6.1e-5, 6.0e-5, 5.96e-8]
    return common + [3.4e38, -3.4e38, 3.3895e38, 1.2e-38, 1e-45]


@_BITS16
def test_round_to_nearest_even_matches_torch_at_the_edges(wt):
    targets = torch.randn(20, 13, generator=torch.Generator().manual_seed(1)) * 10.0 ** torch.arange(-8, 5)
    edges = torch.tensor(_edge_values(wt), dtype=torch.float32)
    targets.view(-1)[:len(edges)] = edges
    got, want = _round_through_sgd(targets, wt, sr=False), _halves(targets, wt)
    nan = torch.isnan(targets)
    assert torch.equal(got[~nan], want[~nan]) and torch.isnan(got.view(_DTYPE[wt])[nan]).all()


@_BITS16
def test_stochastic_rounding_is_the_documented_function_of_seed_id_step_and_column(wt):
    g = torch.Generator().manual_seed(wt)
    edges = torch.tensor(_edge_values(wt), dtype=torch.float32)
    targets = torch.randn(64, 13, generator=g) * 10.0 ** torch.randint(-6, 5, (64, 13), generator=g)
    targets.view(-1)[:len(edges)] = edges
    ids = torch.randint(0, 10**12, (64,), generator=g)
    got = _round_through_sgd(targets, wt, sr=True, ids=ids, seed=99, step=7)
    want = _stochastic_reference(targets, wt, ids.numpy(), 99, 7)
    nan = torch.isnan(targets)
    assert torch.equal(got[~nan], want[~nan]) and torch.isnan(got.view(_DTYPE[wt])[nan]).all()
    assert torch.equal(got, _round_through_sgd(targets, wt, sr=True, ids=ids, seed=99, step=7))  # every run
    other_step = _round_through_sgd(targets, wt, sr=True, ids=ids, seed=99, step=8)
    assert not torch.equal(got, other_step)
    # each value is one of the two 16-bit neighbours of the float32 value (itself if it has one)
    nearest = _halves(targets, wt).view(_DTYPE[wt])
    below = torch.where(nearest <= targets, nearest, torch.nextafter(nearest, torch.full_like(nearest, -math.inf)))
    above = torch.where(nearest >= targets, nearest, torch.nextafter(nearest, torch.full_like(nearest, math.inf)))
    finite = torch.isfinite(targets)
    for rounded in (got, other_step):
        value = rounded.view(_DTYPE[wt])
        assert ((value == below) | (value == above))[finite].all()


@_BITS16
def test_stochastic_rounding_lets_sub_ulp_updates_accumulate_without_bias(wt):
    """Weights 1.5 moved by 0.3 ulp a step: rounding to nearest even never moves them; stochastic
    rounding moves them by 0.3 ulp a step on average, with a mean rounding error of 0. Over
    2048 rows x 64 columns x 8 steps the mean's standard deviation is < 0.001 ulp."""
    ulp = 2.0**-10 if wt == F16 else 2.0**-7
    rows, dim, steps = 2048, 64, 8
    ids = torch.arange(rows) * 7919 + 3
    offsets, slots = torch.arange(rows + 1), torch.arange(rows)
    grad = torch.full((rows, dim), 0.3 * ulp)
    finals = {}
    for sr in (False, True):
        pool = _pack(torch.full((rows, dim), 1.5), wt)
        errors = []
        for step in range(1, steps + 1):
            before = _decoded(pool, dim, wt)
            _C.pool_backward_update(pool, dim, slots, slots, offsets, None, 0, -1, grad, None,
                                    _opt(0, sr=sr, seed=5, step=step, lr=1.0), -1, None, weights=wt, unique_ids=ids)
            x = before - grad  # the float32 update
            after = _decoded(pool, dim, wt)
            assert ((after == x.to(_DTYPE[wt]).float()) | (after == before) | (after == before - ulp)).all()
            errors.append((after - x) / ulp)
        finals[sr] = ((_decoded(pool, dim, wt) - 1.5) / ulp).mean().item()
        mean_error = torch.stack(errors).double().mean().item()
    assert finals[False] == 0.0
    assert abs(finals[True] + 0.3 * steps) < 0.05
    assert abs(mean_error) < 0.01


def test_stochastic_rounding_needs_the_unique_ids_and_leaves_float32_rows_alone():
    batch = _bags(0, rows=50, num_unique=10, n=40, num_bags=8)
    pool = _pack(torch.randn(50, 8), BF16)
    with pytest.raises(ValueError, match="stochastic rounding of 16-bit weights needs unique_ids"):
        _backward(pool, 8, batch, 0, False, _opt(0, sr=True), BF16)
    with pytest.raises(ValueError, match=r"unique_ids has 3 entries for 10 unique rows"):
        _backward(pool, 8, batch, 0, False, _opt(0, sr=True), BF16, unique_ids=torch.arange(3))
    rounded = torch.randn(50, 8)
    plain = rounded.clone()
    _backward(rounded, 8, batch, 0, False, _opt(0, sr=True), 0)  # float32 rows: nothing to round
    _backward(plain, 8, batch, 0, False, _opt(0), 0)
    assert torch.equal(rounded, plain)


def test_out_at_is_checked_before_anything_is_written():
    """pool_forward / pool_backward_update with out_at (each bag's row in a wider block): a
    start that puts a row outside the block, or an out_at of the wrong length, is refused by
    value, and neither the block nor the pool changes."""
    pool = torch.rand(10, 4)
    slots, inverse, offsets = torch.arange(3), torch.tensor([0, 1, 2, 1]), torch.tensor([0, 2, 4])
    block = torch.zeros(3, 5)
    for out_at, error, message in ((torch.tensor([0, 12]), IndexError,
                                    r"out_at\[1\] = 12 puts a row of 4 floats outside its 15 floats"),
                                   (torch.tensor([-1, 0]), IndexError, r"out_at\[0\] = -1"),
                                   (torch.tensor([0]), ValueError, r"out_at has 1 entries for 2 bags")):
        before = pool.clone()
        with pytest.raises(error, match=message):
            _C.pool_forward(pool, 4, slots, inverse, offsets, None, 0, -1, block, None, out_at=out_at)
        assert torch.equal(block, torch.zeros(3, 5))
        with pytest.raises(error, match=message.replace("pool_forward out", "grad_output")):
            _C.pool_backward_update(pool, 4, slots, inverse, offsets, None, 0, -1, block, None,
                                    tieredemb.SGD(lr=1.0).native_args(1), -1, None, out_at=out_at)
        assert torch.equal(pool, before)
    _C.pool_forward(pool, 4, slots, inverse, offsets, None, 0, -1, block, None, out_at=torch.tensor([11, 0]))
    assert torch.equal(block.view(-1)[11:15], pool[0] + pool[1]) and torch.equal(block.view(-1)[:4], pool[2] + pool[1])
