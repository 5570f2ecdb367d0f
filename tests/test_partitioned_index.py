"""PartitionedIndex (native/index/partitioned_index.h): a tier split by id range, each part with
its own capacity and eviction order. It must behave exactly as independent CacheIndexes over the
parts' own id streams, with their slots laid out one after another."""

from __future__ import annotations

import numpy as np
import pytest

from tieredemb import _C

PARTS = [(300, 20), (100, 100), (600, 35)]  # (rows, capacity): the middle one whole


def _index():
    ends = np.cumsum([r for r, _ in PARTS]).tolist()
    return _C.PartitionedIndex(ends, [c for _, c in PARTS], "lru", [r - c for r, c in PARTS])


def _global(k, local):
    """A part's slot -> the partitioned index's: regular slots, then overflow slots, part by part."""
    caps = [c for _, c in PARTS]
    overs = [r - c for r, c in PARTS]
    total = sum(caps)
    return np.where(local < caps[k], sum(caps[:k]) + local, total + sum(overs[:k]) + local - caps[k])


def test_equals_one_cache_index_per_part_on_random_batches():
    rng = np.random.default_rng(0)
    ends = np.cumsum([r for r, _ in PARTS])
    starts = ends - np.array([r for r, _ in PARTS])
    whole = _index()
    parts = [_C.CacheIndex(c, "lru", overflow_limit=r - c) for r, c in PARTS]
    pinned = []  # slots of batches still pinned: (global, per part)
    for step in range(300):
        ids = rng.choice(ends[-1], size=int(rng.integers(1, 90)), replace=False).astype(np.int64)
        plan = whole.plan(ids)
        part_of = np.searchsorted(ends, ids, "right")
        expected_slots = np.empty(len(ids), dtype=np.int64)
        sub = []
        for k, sub_index in enumerate(parts):
            mine = ids[part_of == k]
            p = sub_index.plan(mine) if len(mine) or sub_index.overflow else None
            sub.append((mine, p))
            if p is None:
                continue
            expected_slots[part_of == k] = _global(k, p.slots)
            assert sorted(plan.victim_ids[np.isin(plan.victim_ids, np.arange(starts[k], ends[k]))]) == \
                sorted(p.victim_ids)
        assert plan.slots.tolist() == expected_slots.tolist()
        assert sorted(plan.miss_ids) == sorted(np.concatenate([p.miss_ids for _, p in sub if p is not None]))
        assert plan.num_overflow == sum(p.num_overflow for _, p in sub if p is not None)
        dirty = bool(step % 3 == 0)
        whole.commit(ids, plan, True, dirty)
        for (mine, p), sub_index in zip(sub, parts):
            if p is not None:
                sub_index.commit(mine, p, True, dirty)
        pinned.append((plan.slots.copy(), [(k, p.slots.copy()) for k, (_, p) in enumerate(sub) if p is not None]))
        while len(pinned) > int(rng.integers(0, 3)):  # release some batches, oldest first
            g, per_part = pinned.pop(0)
            whole.unpin(g)
            for k, s in per_part:
                parts[k].unpin(s)
        assert whole.size == sum(p.size for p in parts) and whole.pinned == sum(p.pinned for p in parts)
    stats = whole.partition_stats()
    for k, p in enumerate(parts):
        s = dict(p.stats())
        assert {key: stats[k][key] for key in s} == s
        assert stats[k]["capacity"] == PARTS[k][1] and stats[k]["resident"] == p.size
    assert whole.stats()["misses"] == sum(p.stats()["misses"] for p in parts)
    # the dirty rows, in increasing (global) slot order
    ids, slots = whole.dirty_rows()
    assert slots.tolist() == sorted(slots.tolist())
    want = sorted((int(_global(k, s)), int(i)) for k, p in enumerate(parts) for i, s in zip(*p.dirty_rows()))
    assert list(zip(slots.tolist(), ids.tolist())) == want
    # resident ids ascend across parts; a limit stops in the middle of one
    everything = whole.resident_ids(0, -1)
    assert everything.tolist() == sorted(np.concatenate([p.resident_ids(0, -1) for p in parts]).tolist())
    assert whole.resident_ids(int(everything[5]), 7).tolist() == everything[5:12].tolist()
    looked = whole.lookup(everything)
    assert (looked >= 0).all() and len(set(looked.tolist())) == len(looked)


def test_one_parts_stream_never_evicts_anothers_rows():
    index = _index()
    first = np.arange(20, dtype=np.int64)  # fills part 0
    index.commit(first, index.plan(first), False, False)
    for k in range(10):  # part 2's rows only, many more than its capacity
        ids = np.arange(400 + 30 * k, 430 + 30 * k, dtype=np.int64)
        index.commit(ids, index.plan(ids), False, False)
    assert (index.lookup(first) >= 0).all()
    assert index.partition_stats()[0]["evictions"] == 0 and index.partition_stats()[2]["evictions"] > 0


def test_window_stale_plans_and_bad_arguments():
    index = _index()
    ahead = np.array([1, 2, 350], dtype=np.int64)
    index.window_push(ahead)
    assert index.window_batches == 1
    assert index.window_pop() and index.window_batches == 0
    ids = np.array([5, 6], dtype=np.int64)
    plan = index.plan(ids)
    index.commit(ids, plan, False, False)
    with pytest.raises(RuntimeError, match="stale batch plan"):
        index.commit(ids, plan, False, False)
    with pytest.raises(ValueError, match=r"partition 1: end 5 must be > its start 10 \(ends ascend\)"):
        _C.PartitionedIndex([10, 5], [2, 3], "lru", [0, 0])
    with pytest.raises(ValueError, match=r"partition 0: capacity 0 must be >= 1"):
        _C.PartitionedIndex([10], [0], "lru", [0])
    with pytest.raises(ValueError, match=r"policy 'fifo' is not one of"):
        _C.PartitionedIndex([10], [2], "fifo", [0])
    with pytest.raises(ValueError, match=r"the same length >= 1, got 2, 1, 2"):
        _C.PartitionedIndex([10, 20], [2], "lru", [0, 0])
    assert _C.CacheIndex(4, "lru").partitions == 0 and _index().partitions == 3


_RACE = """
import threading
import numpy as np
from tieredemb import _C

ends, caps = [200000, 400000, 600000], [50000, 50000, 50000]
index = _C.PartitionedIndex(ends, caps, "lru", [0, 0, 0])
ids = np.arange(0, 600000, 4, dtype=np.int64)  # 50,000 in each part: every regular slot
plan = index.plan(ids)
index.commit(ids, plan, True, False)
slots = np.ascontiguousarray(plan.slots)
window = np.arange(1, 600000, 2, dtype=np.int64)

def worker():  # what the prefetch worker does
    for _ in range(150):
        index.window_push(window)
        index.window_pop()

thread = threading.Thread(target=worker)
thread.start()
for _ in range(150):  # what a backward does, on the training thread
    index.mark_dirty(slots)
    index.unpin(slots)
    plan = index.plan(ids)
    index.commit(ids, plan, True, False)
thread.join()
assert index.pinned == len(ids) and index.size == len(ids), (index.pinned, index.size)
print("ok")
"""


def test_window_and_pin_calls_from_two_threads_share_no_scratch(tmp_path):
    """The index releases the GIL in every call; a window push (the prefetch worker) and an unpin
    or mark_dirty (a backward) may run at once from two threads. Their per-part splits must be
    their own (they once shared one buffer: a double free). Run in a child process, so a crash
    fails this test instead of the suite."""
    import subprocess
    import sys
    script = tmp_path / "race.py"
    script.write_text(_RACE)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])
