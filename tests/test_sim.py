"""Simulator: stack distances, batch-mode policies against a pure-Python model of the engine and
against the engine itself, tier stacks with write-backs, miss-ratio curves, streaming, commands."""

import itertools
import json
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tieredemb
from tieredemb.sim import (
    DUPLICATE,
    FIRST_USE,
    SimError,
    Simulator,
    mrc,
    simulate,
    stack_distances,
)
from tieredemb.sim import kernel as kernel_module
from tieredemb.sim import simulator as simulator_module
from tieredemb.sim.cli import mrc as mrc_command
from tieredemb.sim.cli import simulate as simulate_command
from tieredemb.trace import TableInfo, TraceError, TraceWriter

INF = float("inf")


# -- pure-Python models ----------------------------------------------------------------------------
def brute_stack_distances(keys, offsets=None):
    """Recency list: distance = position from the top at the start of the key's batch."""
    offsets = range(len(keys) + 1) if offsets is None else offsets
    order, out = [], []  # least recent first
    for s, e in itertools.pairwise(offsets):
        seen, uniq = set(), []
        for k in keys[s:e]:
            if k in seen:
                out.append(DUPLICATE)
                continue
            seen.add(k)
            uniq.append(k)
            out.append(order[::-1].index(k) if k in order else FIRST_USE)
        for k in uniq:
            if k in order:
                order.remove(k)
            order.append(k)
    return np.array(out, dtype=np.int64)


class ModelTier:
    """One engine tier (native/index/cache_index.cc + native/index/policy.cc), written plainly from the trace
    contract: plan (free slots 0, 1, ... first, then victims chosen among rows not in the batch),
    commit (victims leave; misses inserted and hits touched in batch order)."""

    def __init__(self, cap, policy, lookahead=0):
        self.cap, self.policy, self.k = cap, policy, lookahead
        self.slot_of, self.key_of = {}, [None] * cap
        self.free = list(range(cap - 1, -1, -1))
        self.recency = []                   # lru / lookahead: slots, least recent first
        self.fifo = []                      # fifo: slots in insertion order
        self.count, self.last, self.clock = [0] * cap, [0] * cap, 0
        self.uses, self.period = 0, max(1024, 8 * cap)
        self.ref, self.hand = [0] * cap, 0
        self.next = [INF] * cap             # belady / lookahead: the next batch using the row
        self.hits = self.misses = self.evictions = 0

    def select(self, need, batch_slots, now_batch):
        cand = [s for s in range(self.cap) if self.key_of[s] is not None and s not in batch_slots]
        if self.policy == "lru":
            return [s for s in self.recency if s in cand][:need]
        if self.policy == "fifo":
            return [s for s in self.fifo if s in cand][:need]
        if self.policy == "lfu":
            return sorted(cand, key=lambda s: (self.count[s], self.last[s]))[:need]
        if self.policy == "belady":
            return sorted(cand, key=lambda s: (-self.next[s], s))[:need]
        if self.policy == "lookahead":
            lru = [s for s in self.recency if s in cand]
            far = [s for s in lru if self.next[s] > now_batch + self.k]
            near = sorted((s for s in lru if self.next[s] <= now_batch + self.k), key=lambda s: -self.next[s])
            return (far + near)[:need]
        # clock: lap one takes unreferenced slots and clears the others; lap two takes those
        out, clear, pos = [], [], self.hand
        for step in range(2 * self.cap):
            if len(out) >= need:
                break
            if pos in cand:
                if self.ref[pos] and step < self.cap:
                    clear.append(pos)
                elif not self.ref[pos] and step < self.cap or self.ref[pos] and step >= self.cap:
                    out.append(pos)
            pos = (pos + 1) % self.cap
        for s in clear:
            self.ref[s] = 0
        self.hand = pos
        return out

    def use(self, s, new, next_batch):
        if self.policy in ("lru", "lookahead"):
            if s in self.recency:
                self.recency.remove(s)
            self.recency.append(s)
        elif self.policy == "fifo" and new:
            if s in self.fifo:
                self.fifo.remove(s)
            self.fifo.append(s)
        elif self.policy == "clock":
            self.ref[s] = 1
        elif self.policy == "lfu":
            self.count[s] = 1 if new else min(self.count[s] + 1, 1 << 30)
            self.clock += 1
            self.last[s] = self.clock
            self.uses += 1
            if self.uses >= self.period:
                self.uses = 0
                for t in range(self.cap):
                    self.count[t] >>= 1
        self.next[s] = next_batch

    def batch(self, uniq, next_batch, now_batch):
        """uniq: the batch's keys in first-occurrence order; next_batch[k]: the next batch using k."""
        hits = [k for k in uniq if k in self.slot_of]
        miss = [k for k in uniq if k not in self.slot_of]
        if len(uniq) > self.cap:
            raise ValueError("batch larger than the tier")
        take = min(len(miss), len(self.free))
        slots = [self.free.pop() for _ in range(take)]
        victims = self.select(len(miss) - take, {self.slot_of[k] for k in hits}, now_batch)
        for s in victims:
            del self.slot_of[self.key_of[s]]
            self.key_of[s] = None
        slots += victims
        for k, s in zip(miss, slots):
            self.slot_of[k], self.key_of[s] = s, k
        new = set(miss)
        for k in uniq:
            self.use(self.slot_of[k], k in new, next_batch[k])
        self.hits += len(hits)
        self.misses += len(miss)
        self.evictions += len(victims)


def model_run(keys, offsets, cap, policy, lookahead=0):
    """hits, misses, evictions of one tier in batch mode."""
    nb = len(offsets) - 1
    batches = [keys[offsets[b]:offsets[b + 1]] for b in range(nb)]
    tier = ModelTier(cap, policy, lookahead)
    for b, batch in enumerate(batches):
        uniq = list(dict.fromkeys(batch))
        nxt = {k: next((c for c in range(b + 1, nb) if k in batches[c]), INF) for k in uniq}
        tier.batch(uniq, nxt, b)
    return tier.hits, tier.misses, tier.evictions


def random_trace(rng, n, space, batches):
    keys = rng.integers(0, space, n)
    cuts = np.sort(rng.integers(0, n + 1, batches))
    return keys, np.concatenate([[0], cuts, [n]])


# -- stack distances -------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_stack_distances_match_recency_list(seed):
    rng = np.random.default_rng(seed)
    # more than 1024 distinct times forces renumbering; a wide key space forces key compaction
    keys, offsets = random_trace(rng, 4000, [5, 60, 400, 3000][seed % 4], 40)
    if seed % 2:
        keys = keys * 1_000_003
    assert np.array_equal(stack_distances(keys), brute_stack_distances(list(keys)))
    assert np.array_equal(stack_distances(keys, offsets), brute_stack_distances(list(keys), list(offsets)))


def test_stack_distances_small_example():
    #                         a  b  a  c  b  a
    assert stack_distances([0, 1, 0, 2, 1, 0]).tolist() == [-1, -1, 1, -1, 2, 2]
    # batches [a b a] [c b a]: b and a are measured against the order after batch 0 (a, b)
    assert stack_distances([0, 1, 0, 2, 1, 0], [0, 3, 6]).tolist() == [-1, -1, -2, -1, 0, 1]


# -- batch mode against the model and the engine ----------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), policy=st.sampled_from(["lru", "lfu", "clock", "fifo", "belady", "lookahead"]),
       space=st.integers(2, 60), batch=st.integers(1, 12), extra=st.integers(0, 20), k=st.integers(1, 4))
def test_batch_mode_matches_engine_model(seed, policy, space, batch, extra, k):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    keys = rng.integers(0, space, n)
    offsets = np.unique(np.concatenate([[0, n], np.arange(0, n, batch)]))
    cap = max(np.unique(keys[a:b]).size for a, b in itertools.pairwise(offsets)) + extra
    r = simulate(keys, offsets, policy, [cap], lookahead=k).tiers[0]
    assert (r.hits, r.misses, r.evictions) == model_run(list(keys), list(offsets), cap, policy, k)


def test_lfu_aging_matches_model():
    # 8 * 40 uses between halvings: a 3000-lookup trace ages the counts several times
    rng = np.random.default_rng(7)
    keys = (rng.zipf(1.3, 3000) % 200).astype(np.int64)
    offsets = np.arange(0, 3001, 10)
    r = simulate(keys, offsets, "lfu", [130]).tiers[0]
    assert (r.hits, r.misses, r.evictions) == model_run(list(keys), list(offsets), 130, "lfu")


def engine_stats(keys, offsets, rows, cache_rows, host_rows, policy, train):
    emb = tieredemb.TieredEmbeddingBag(rows, 4, mode="sum", cache_rows=cache_rows, host_rows=host_rows, policy=policy,
                                       optimizer=tieredemb.SGD(lr=0.1) if train else None)
    bag = torch.tensor([0])
    for s, e in itertools.pairwise(offsets):
        ids = torch.from_numpy(keys[s:e].copy())
        if train:
            emb(ids, bag).sum().backward()
        else:
            with torch.no_grad():
                emb(ids, bag)
    stats = emb.stats()
    emb.close()
    return stats


FIELDS = ("hits", "misses", "writes", "evictions", "dirty_writebacks", "clean_drops")


@pytest.mark.parametrize("policy", ["lru", "lfu", "clock"])
@pytest.mark.parametrize("host,train", [(False, False), (True, False), (True, True), (False, True)])
def test_simulate_equals_the_engine(policy, host, train):
    """The real engine's per-tier counters equal the simulator's, tier stack and write-backs too."""
    rng = np.random.default_rng(11)
    rows, n = 2000, 6000
    keys = (rng.zipf(1.15, n) % rows).astype(np.int64)
    offsets = np.unique(np.concatenate([[0, n], np.sort(rng.integers(0, n, 150))]))
    widest = max(np.unique(keys[a:b]).size for a, b in itertools.pairwise(offsets))
    cache, host_rows = widest + 150, (widest + 500 if host else None)
    s = engine_stats(keys, offsets, rows, cache, host_rows, policy, train)
    r = simulate(keys, offsets, policy, [cache] + ([host_rows] if host else []), train=train)
    assert {f: s["tier0"][f] for f in FIELDS} == {f: getattr(r.tiers[0], f) for f in FIELDS}
    if host:
        assert {f: s["host"][f] for f in FIELDS} == {f: getattr(r.tiers[1], f) for f in FIELDS}
    # the bottom: rows read from it (its hits + misses) and rows written into it
    assert s["store"]["reads"] == r.bottom_reads
    assert s["store"]["rows_written"] == r.bottom_writes
    if train:
        assert r.tiers[0].dirty_writebacks > 0


@pytest.mark.parametrize("mode", ["batch", "request"])
def test_one_lru_tier_fast_path_equals_the_list_kernel(mode):
    """simulate() answers one LRU tier without write-backs with an O(1) boundary kernel
    (sim/lru.py); the general kernel (Simulator) keeps an LRU list. Every counter agrees, over
    small caches (the boundary moves on most lookups) and many renumberings."""
    rng = np.random.default_rng(8)
    keys = (rng.zipf(1.1, 30000) % 6000).astype(np.int64)
    offsets = np.arange(0, 30001, 75)
    table_of = (np.arange(6000) >= 2500).astype(np.int64)
    for cap in (75, 150, 1000, 5999, 8000):
        fast = simulate(keys, offsets, "lru", [cap], mode=mode, table_base=[0, 2500])
        sim = Simulator("lru", [cap], 6000, mode=mode, table_of=table_of, table_names=["0", "1"])
        sim.feed(keys, offsets)
        assert fast == sim.result()
    for _ in range(100):
        n, space = int(rng.integers(1, 3000)), int(rng.integers(1, 300))
        keys = rng.integers(0, space, n)
        offsets = np.unique(np.concatenate([[0, n], rng.integers(0, n, int(rng.integers(0, 100)))]))
        widest = 1 if mode == "request" else max(np.unique(keys[a:b]).size for a, b in itertools.pairwise(offsets))
        cap = int(rng.integers(widest, widest + space + 2))
        sim = Simulator("lru", [cap], space, mode=mode)
        sim.feed(keys, offsets)
        assert simulate(keys, offsets, "lru", [cap], mode=mode) == sim.result()


def test_training_marks_every_row_dirty():
    # train: every victim was looked up, so every eviction from tier 0 is a write-back
    rng = np.random.default_rng(1)
    keys = rng.integers(0, 500, 5000)
    offsets = np.arange(0, 5001, 50)
    plain, trained = (simulate(keys, offsets, "lru", [100, 200], train=t) for t in (False, True))
    assert plain.tiers[0].dirty_writebacks == 0 and plain.bottom_writes == 0
    t0 = trained.tiers[0]
    assert t0.dirty_writebacks == t0.evictions > 0 and t0.clean_drops == 0
    assert trained.tiers[1].writes == t0.dirty_writebacks
    assert (t0.hits, t0.misses) == (plain.tiers[0].hits, plain.tiers[0].misses)


def test_belady_is_optimal_and_lookahead_sits_between():
    rng = np.random.default_rng(3)
    keys = (rng.zipf(1.1, 20000) % 5000).astype(np.int64)
    offsets = np.arange(0, 20001, 100)
    hit = {p: simulate(keys, offsets, p, [600], lookahead=4).hit_ratio for p in ("lru", "lfu", "clock", "fifo",
                                                                                 "s3fifo", "belady", "lookahead")}
    assert hit["belady"] == max(hit.values())
    assert hit["lookahead"] > hit["lru"]


@pytest.mark.parametrize("policy", ["lfu", "clock", "fifo"])
def test_a_chunk_of_one_lookup_writes_within_its_arrays(monkeypatch, policy):
    """A policy that does not look ahead feeds a dummy next-use array; with a chunk of one lookup
    (a trace's last), its size matched the keys' and the kernel wrote knext[key] past the end of
    a one-slot array (a segfault or a corrupted heap, compiled). The kernel's own code run by
    Python checks every index: it raised IndexError there."""
    monkeypatch.setattr(simulator_module, "run_batches", kernel_module.run_batches.py_func)
    sim = Simulator(policy, [2], nkeys=9001)
    sim.feed(np.array([5000]), np.array([0, 1]))
    sim.feed(np.array([5000, 7]), np.array([0, 1, 2]))
    assert sim.result().tiers[0].misses == 2 and sim.result().tiers[0].hits == 1


def test_the_streaming_lru_tier_refuses_keys_past_its_arrays():
    """LruTier's kernel does not check its indices: a key past nkeys (a trace whose keys exceed its
    declared rows) is refused by name, as Simulator.feed refuses it."""
    from tieredemb.sim.lru import LruTier

    tier = LruTier(10, 4, 8, per_request=False)
    with pytest.raises(SimError, match=r"key 12 at lookup 1 is beyond this simulator's 10 keys"):
        tier.feed(np.array([3, 12, 4]), np.array([0, 3]))
    tier.feed(np.array([3, 9, 4]), np.array([0, 3]))
    assert tier.distinct == 3


def test_per_table_breakdown_adds_up():
    rng = np.random.default_rng(5)
    keys = rng.integers(0, 3000, 8000)
    offsets = np.arange(0, 8001, 80)
    r = simulate(keys, offsets, "lru", [400, 800], table_base=[0, 1000, 2500])
    for t in r.tiers:
        assert [p["table"] for p in t.per_table] == ["0", "1", "2"]
        assert sum(p["hits"] for p in t.per_table) == t.hits
        assert sum(p["misses"] for p in t.per_table) == t.misses


# -- miss-ratio curves ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["request", "batch"])
def test_lru_curve_equals_per_size_simulation(mode):
    rng = np.random.default_rng(2)
    keys = (rng.zipf(1.2, 30000) % 4000).astype(np.int64) * 7919  # sparse keys: compacted
    offsets = np.arange(0, 30001, 60)
    c = mrc(keys, offsets, mode=mode, points=25)
    assert c.sizes.size > 15
    for size, miss in zip(c.sizes, c.miss_ratio):
        assert miss == simulate(keys, offsets, "lru", [int(size)], mode=mode).tiers[0].miss_ratio


@pytest.mark.parametrize("mode", ["request", "batch"])
def test_lru_curve_after_a_warm_up_counts_the_rest_only(mode):
    """warmup=W: the hits and lookups after the first W batches (requests) are the whole trace's
    minus those of its first W, each simulated on its own."""
    rng = np.random.default_rng(3)
    keys = (rng.zipf(1.1, 30000) % 5000).astype(np.int64)
    offsets = np.arange(0, 30001, 60)
    warm = 200
    cut = warm if mode == "request" else int(offsets[warm])
    c = mrc(keys, offsets, [100, 400, 1500], mode=mode, warmup=warm)
    for size, miss in zip(c.sizes, c.miss_ratio):
        whole = simulate(keys, offsets, "lru", [int(size)], mode=mode).tiers[0]
        head = simulate(keys[:cut], None if mode == "request" else offsets[:warm + 1], "lru", [int(size)],
                        mode=mode).tiers[0]
        hits, lookups = whole.hits - head.hits, whole.hits + whole.misses - head.hits - head.misses
        assert c.lookups == lookups
        assert miss == pytest.approx(1 - hits / lookups, abs=1e-12)
    assert (c.miss_ratio < mrc(keys, offsets, [100, 400, 1500], mode=mode).miss_ratio).all()  # no first touches
    with pytest.raises(SimError, match=r"warmup 500 must be in \[0, 500\)" if mode == "batch" else "warmup 30000"):
        mrc(keys, offsets, [100], mode=mode, warmup=500 if mode == "batch" else 30000)
    with pytest.raises(SimError, match=r"only the lru curve takes a warm-up"):
        mrc(keys, offsets, [100], policy="fifo", mode=mode, warmup=10)
    with pytest.raises(SimError, match=r"warmup 1.5 must be a whole number"):
        mrc(keys, offsets, [100], mode=mode, warmup=1.5)


def test_other_policy_curves_run_each_size():
    rng = np.random.default_rng(4)
    keys = (rng.zipf(1.2, 10000) % 2000).astype(np.int64)
    offsets = np.arange(0, 10001, 50)
    sizes = [60, 200, 700]
    for policy in ("clock", "belady", "lookahead-2"):
        c = mrc(keys, offsets, sizes, policy=policy, workers=2)
        assert c.miss_ratio.tolist() == [simulate(keys, offsets, policy, [s]).tiers[0].miss_ratio for s in sizes]


def test_sampled_curve_is_close_on_a_large_key_space():
    rng = np.random.default_rng(6)
    keys = (rng.zipf(1.1, 400_000) % 1_000_000).astype(np.int64)
    sizes = np.array([2000, 5000, 20000, 60000])
    exact = mrc(keys, None, sizes, mode="request")
    sampled = mrc(keys, None, sizes, mode="request", sample_rate=0.1)
    assert sampled.sample_rate == 0.1
    assert np.abs(sampled.miss_ratio - exact.miss_ratio).max() < 0.02


# -- traces, streaming, commands --------------------------------------------------------------------
@pytest.fixture
def trace_file(tmp_path):
    rng = np.random.default_rng(9)
    keys = (rng.zipf(1.2, 40000) % 3000).astype(np.int64)
    offsets = np.arange(0, 40001, 100)
    path = tmp_path / "t.trace"
    with TraceWriter(path, [TableInfo("users", 1000), TableInfo("items", 2000)], chunk_lookups=5000) as w:
        w.write_batches(keys, offsets)
    return path, keys, offsets


def test_trace_file_streamed_equals_in_memory(trace_file):
    """A file is read chunk by chunk (8 chunks here) into the same counts as its keys in memory:
    the list kernel, one LRU tier (its own kernel, resumed chunk after chunk), belady (read whole)."""
    path, keys, offsets = trace_file
    for policy, caps, train, mode in [("lru", [300, 900], True, "batch"), ("s3fifo", [300, 900], True, "batch"),
                                      ("belady", [300, 900], True, "batch"), ("lru", [300], False, "batch"),
                                      ("lru", [300], False, "request")]:
        a = simulate(str(path), None, policy, caps, train=train, mode=mode)
        b = simulate(keys, offsets, policy, caps, train=train, mode=mode, table_base=[0, 1000])
        assert [t.per_table[1]["table"] for t in a.tiers] == ["items"] * len(caps)
        assert [(t["hits"], t["misses"]) for t in a.tiers[0].per_table] == [
            (t["hits"], t["misses"]) for t in b.tiers[0].per_table]
        for ta, tb in zip(a.tiers, b.tiers):
            ta.per_table = tb.per_table = None
        assert a == b and a.tiers[0].hits > 0


def test_chunks_are_traces_too(trace_file):
    from tieredemb.trace import open_trace

    path, keys, offsets = trace_file
    with open_trace(path) as r:
        assert simulate(r.chunks(), None, "clock", [500]) == simulate(keys, offsets, "clock", [500])
        assert mrc(r.read_all(), points=5).to_dict() == mrc(keys, offsets, points=5).to_dict()


def test_simulate_command(trace_file, capsys):
    path = str(trace_file[0])
    assert simulate_command([path, "--policy", "lru", "--policy", "lfu,clock", "--capacity", "10%",
                             "--capacity", "900", "--train", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [[t["policy"] for t in r["tiers"]] for r in out] == [["lru", "lru"], ["lfu", "clock"]]
    assert out[0]["tiers"][0]["capacity"] == 300
    assert out[0]["tiers"][0]["dirty_writebacks"] > 0


@pytest.mark.parametrize("args,message", [
    (["--policy", "lruu", "--capacity", "500"], "unknown policy 'lruu'"),
    (["--capacity", "0"], "capacity '0'"),
    (["--capacity", "150%"], "capacity '150%'"),
    (["--capacity", "10"], "batch 0 needs"),
    (["--policy", "lookahead", "--capacity", "500"], "needs a window"),
])
def test_simulate_command_bad_input(trace_file, capsys, args, message):
    assert simulate_command([str(trace_file[0])] + args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_mrc_command(trace_file, tmp_path, capsys):
    path, keys, offsets = trace_file
    png = tmp_path / "curve.png"
    assert mrc_command([str(path), "--points", "12", "--png", str(png), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out["miss_ratio"] == mrc(keys, offsets, points=12).miss_ratio.tolist()
    assert mrc_command([str(path), "--points", "12"]) == 0  # no plot: every point
    assert len(capsys.readouterr().out.splitlines()) == 2 + 12
    assert mrc_command([str(path), "--points", "12", "--png", str(png)]) == 0  # the plot has them: a summary
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + 5 + 1 and lines[-1] == f"plot: {png} (12 sizes, of which these; --json prints every point)"
    assert lines[2].split()[0] == f"{out['sizes'][0]:,}" and lines[6].split()[0] == f"{out['sizes'][-1]:,}"
    assert mrc_command([str(path), "--policy", "belady", "--sizes", "20%", "50%"]) == 0
    assert "belady" in capsys.readouterr().out
    assert mrc_command([str(tmp_path / "missing.trace")]) == 2
    batches = len(offsets) - 1
    assert mrc_command([str(path), "--sizes", "150", "--warmup", str(batches // 2), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["miss_ratio"] == \
        mrc(keys, offsets, [150], warmup=batches // 2).miss_ratio.tolist()
    assert mrc_command([str(path), "--warmup", str(batches)]) == 2
    assert f"warmup {batches} must be in [0, {batches})" in capsys.readouterr().err


def test_mrc_png_without_an_extension_prints_the_file_written(trace_file, tmp_path, capsys):
    """--png plot wrote plot.png (matplotlib adds the extension) and printed "plot: plot"."""
    assert mrc_command([str(trace_file[0]), "--points", "8", "--png", str(tmp_path / "plot")]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"plot: {tmp_path / 'plot.png'} (8 sizes")
    assert sorted(os.listdir(tmp_path)) == ["plot.png", "t.trace"]
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"


def test_mrc_of_no_lookups_says_so(tmp_path, capsys):
    """A trace of empty batches printed a curve of hit ratio 1.0000 (0 / 0 taken as a hit)."""
    with TraceWriter(tmp_path / "e.trace", [TableInfo("t", 100)]) as w:
        w.write_batch([])
        w.write_batch([])
    with TraceWriter(tmp_path / "tail.trace", [TableInfo("t", 100)]) as w:
        w.write_batch([1, 2])
        w.write_batch([])
    for args, said in [(["e.trace"], "e.trace: no lookups to measure a miss ratio over (2 batches, all empty)"),
                       (["e.trace", "--json"], "e.trace: no lookups to measure a miss ratio over"),
                       (["tail.trace", "--warmup", "1"], "after the first 1 batches (--warmup)")]:
        assert mrc_command([str(tmp_path / args[0]), *args[1:]]) == 2
        out = capsys.readouterr()
        assert said in out.err and out.err.count("\n") == 1 and out.out == "", out


def test_bad_input():
    keys, offsets = np.arange(10), np.array([0, 5, 10])
    with pytest.raises(SimError, match="unknown policy 'mru'"):
        simulate(keys, offsets, "mru", [5])
    with pytest.raises(SimError, match="capacity 0"):
        simulate(keys, offsets, "lru", [5, 0])
    with pytest.raises(TraceError, match="key -3 at lookup 1"):  # bad keys are a trace's content
        simulate([1, -3], None, "lru", [5])
    with pytest.raises(TraceError, match="key -3 at lookup 1"):
        stack_distances([1, -3])
    with pytest.raises(TraceError, match="end at 10"):
        simulate(keys, [0, 5], "lru", [5])
    with pytest.raises(SimError, match="batch 0 needs 5 rows in tier 1"):
        simulate(keys, offsets, "lru", [5, 4])
    with pytest.raises(SimError, match="s3fifo needs capacity >= 20"):
        simulate(keys, offsets, "s3fifo", [10])
    with pytest.raises(SimError, match="sample rate 2"):
        mrc(keys, None, sample_rate=2)
