"""The GPU tier 0's plan (gpu/index.py SetIndex, its find and assign steps as Triton kernels in
gpu/plan_kernels.py, here under Triton's interpreter) equals its torch-ops twin plan for plan,
state for state, on random batches: LRU and LFU, a lookahead window, pinned rows and overflow
slots, partitions, dirty rows, and sets crowded with misses."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.interpreted
pytest.importorskip("triton")
from tieredemb.gpu import plan_kernels  # noqa: E402
from tieredemb.gpu.index import SetIndex  # noqa: E402

CPU = torch.device("cpu")
FIELDS = ("slots", "fresh", "victim_slots", "miss_ids", "miss_slots", "miss_victims", "dirty_ids", "dirty_slots",
          "valid")


def _pair(kernels_first, **kw):
    a, b = SetIndex(**kw), SetIndex(**kw)
    a.kernels, b.kernels = kernels_first, "torch"
    return a, b


def _same_state(a: SetIndex, b: SetIndex) -> None:
    for name in ("slot_id", "pins", "dirty", "stamp", "uses"):  # (not the dummy slot after them)
        assert torch.equal(getattr(a, name)[:a.slots_total], getattr(b, name)[:b.slots_total]), name
    assert (a.overflow_slots, a.overflow_in_use, a.counts) == (b.overflow_slots, b.overflow_in_use, b.counts)


def _admit(index: SetIndex, ids: torch.Tensor, count: int, rows: int, guess: int = 0):
    """The plan, after growing the overflow slots as it asks; guess > 0: the first dirty victims'
    rows ride its transfer, from a pool whose row s is s, s + 0.5, s + 0.25."""
    while True:
        pool = torch.arange(index.slots_total, dtype=torch.float32)[:, None] + torch.tensor([0, 0.5, 0.25])
        plan = index.plan(ids, torch.tensor([count]), rows, pool if guess else None, guess)
        if not isinstance(plan, int):
            return plan
        index.grow(plan)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("shape", ["plain", "parts", "crowded", "wide"])
def test_the_triton_plan_equals_the_torch_twin(policy, shape, monkeypatch):
    rows, most = 400, 40
    kw = dict(capacity=48, policy=policy, device=CPU, ways=8, overflow=4)
    if shape == "parts":
        kw.update(partitions=((150, 16), (50, 8), (200, 24)))
    if shape == "crowded":  # few sets: most misses share a set with others, many find no way
        kw.update(capacity=6, ways=4)
        # and the assign kernel as 3 programs, each taking the sorted misses 3 apart
        monkeypatch.setattr(plan_kernels, "ASSIGN_PROGRAMS", 3)
    steps = 60
    if shape == "wide":  # batches and overflow slots over several of the kernels' blocks
        rows, most, steps = 5000, 700, 14
        kw.update(capacity=256, overflow=300)
    tri, twin = _pair("triton", **kw)
    g = torch.Generator().manual_seed(3)
    pinned, guessed, paired_total = [], 0, 0
    for step in range(steps):
        n = int(torch.randint(1, most, (1,), generator=g))
        ids = torch.unique((torch.rand(n, generator=g) ** 2 * rows).long())
        ids = ids[torch.randperm(len(ids), generator=g)]
        count = len(ids)
        ids = torch.cat([ids, torch.full((int(torch.randint(0, 4, (1,), generator=g)),), -1)])  # past U
        if step % 7 == 3:  # a window of the batches ahead
            for index in (tri, twin):
                index.window_clear()
            for _ in range(int(torch.randint(1, 3, (1,), generator=g))):
                ahead = torch.randint(0, rows, (12,), generator=g)
                for index in (tri, twin):
                    index.window_push(ahead, torch.tensor([10]))
        guess = int(torch.randint(0, 6, (1,), generator=g))
        plans = [_admit(index, ids, count, rows, guess) for index in (tri, twin)]
        for name in FIELDS:
            assert torch.equal(getattr(plans[0], name), getattr(plans[1], name)), (step, name)
        # each dirty victim in a set is paired with the one miss that takes its slot (zero-copy's
        # swap writes it down, then reads the miss in); none is a miss of the batch
        p = plans[0]
        paired = p.miss_victims >= 0
        in_sets = p.dirty_slots < tri.capacity
        mine, theirs = torch.sort(p.miss_slots[paired]), torch.sort(p.dirty_slots[in_sets])  # (slots: distinct)
        assert torch.equal(mine.values, theirs.values), step
        assert torch.equal(p.miss_victims[paired][mine.indices], p.dirty_ids[in_sets][theirs.indices]), step
        assert not torch.isin(p.miss_victims[paired], p.miss_ids).any(), step
        paired_total += int(paired.sum())
        carried = plans[0].dirty_rows
        assert (carried is None) == (plans[1].dirty_rows is None) == (not guess or guess < plans[0].dirty_ids.numel())
        if carried is not None:
            assert torch.equal(carried, plans[1].dirty_rows) and torch.equal(carried[:, 0], plans[0].dirty_slots.float())
            guessed += carried.shape[0]
        assert (plans[0].num_overflow, plans[0].num_victims, plans[0].lingering) == \
            (plans[1].num_overflow, plans[1].num_victims, plans[1].lingering)
        dirty = torch.rand(len(ids), generator=g) < 0.5
        for index, plan in zip((tri, twin), plans):
            index.commit(plan, pin=True)
            index.dirty[torch.where(dirty & plan.valid, plan.slots, index.slots_total)] = 1
        pinned.append(plans[0].slots)
        while pinned and (len(pinned) > 2 or torch.rand(1, generator=g) < 0.4):  # backwards release
            done = pinned.pop(0)
            for index in (tri, twin):
                index.unpin(done)
        _same_state(tri, twin)
        if step % 6 != 5 and step != steps - 1:  # (the lookups every sixth step: the interpreter's time)
            continue
        # every id's slot, by the lookup kernel and by its twin (overflow rows pinned and not, ids
        # never seen); an id < 0 is in no slot
        probe = torch.cat([torch.randint(0, rows, (64,), generator=torch.Generator().manual_seed(step)), ids[:count]])
        looked = tri.lookup(probe)
        assert torch.equal(looked, twin.lookup(probe)), step
        assert (looked >= 0).any() and tri.lookup(torch.tensor([-1, -7])).tolist() == [-1, -1]
    assert tri.counts["misses"] > 0 and tri.counts["evictions"] > 0 and guessed > 0 and paired_total > 0
    if shape != "parts":
        assert tri.counts["overflow_rows"] > 0  # the overflow path ran too


@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_a_release_landing_mid_plan_leaves_the_batchs_overflow_row_its_own(kernels, monkeypatch):
    """On a GPU a release on the compute stream may unpin a row between the plan's reads of the
    pins (nothing orders the two streams). Simulated here, as it cannot happen on CPU tensors: the
    release runs right after the plan's find step. The overflow row the batch found stays its own,
    neither a victim nor a free slot."""
    index = SetIndex(4, "lru", CPU, ways=4, overflow=2)
    index.kernels = kernels
    index.commit(_admit(index, torch.tensor([1, 2, 3, 4]), 4, 100), pin=True)  # the one set full, pinned
    b = _admit(index, torch.tensor([5]), 1, 100)
    index.commit(b, pin=True)
    assert b.slots.tolist() == [4]  # an overflow slot, pinned
    find = index._find
    monkeypatch.setattr(index, "_find", lambda *a: (find(*a), index.unpin(b.slots))[0])
    c = _admit(index, torch.tensor([5]), 1, 100)
    assert c.slots.tolist() == [4] and c.num_victims == 0 and not c.fresh.any()
    index.commit(c, pin=True)
    assert int(index.slot_id[4]) == 5 and int(index.pins[4]) == 1 and index.overflow_in_use == 1


@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_a_window_of_empty_batches_is_no_window(kernels):
    index = SetIndex(8, "lru", CPU, ways=4, overflow=2)
    index.kernels = kernels
    index.commit(_admit(index, torch.tensor([1, 2, 3, 4, 5]), 5, 100), pin=False)
    index.window_push(torch.empty(0, dtype=torch.int64), torch.tensor([0]))
    plan = _admit(index, torch.tensor([11, 12, 13]), 3, 100)
    assert plan.fresh.all() and (plan.slots >= 0).all()


def test_a_release_landing_between_tally_and_place_changes_no_victim(monkeypatch):
    """Which overflow rows linger (unpinned: victims) is read once, by the tally; place writes the
    lists from that reading. Simulated as above: a release lands right after the tally (its
    cumsum). The row it unpins stays (counted as staying, and staying), dirty as it was."""
    from tieredemb.gpu import plan_kernels

    index = SetIndex(4, "lru", CPU, ways=4, overflow=2)
    index.commit(_admit(index, torch.tensor([1, 2, 3, 4]), 4, 100), pin=True)  # the one set full, pinned
    b = _admit(index, torch.tensor([5]), 1, 100)
    index.commit(b, pin=True)
    index.dirty[b.slots] = 1
    assert b.slots.tolist() == [4]
    cumsum = torch.cumsum

    def release_then_cumsum(*a, **k):  # (once: the tally's cumsum)
        monkeypatch.undo()
        index.unpin(b.slots)
        return cumsum(*a, **k)

    monkeypatch.setattr(plan_kernels.torch, "cumsum", release_then_cumsum)
    c = _admit(index, torch.tensor([6]), 1, 100)
    assert (c.num_victims, c.lingering, c.dirty_ids.tolist(), c.victim_slots.tolist()) == (0, 0, [], [])
    assert c.slots.tolist() == [5] and c.miss_slots.tolist() == [5]  # the free overflow slot
    index.commit(c, pin=True)
    assert index.slot_id[4:6].tolist() == [5, 6] and index.dirty[4:6].tolist() == [1, 0]
    assert index.overflow_in_use == 2
