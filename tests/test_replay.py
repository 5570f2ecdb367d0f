"""tieredemb replay: the real engine driven by a trace gives tieredemb.sim's counts, exactly."""

import json

import numpy as np
import pytest

from tieredemb.cli import main
from tieredemb.sim import simulate
from tieredemb.sim.replay import ReplayError, compare, replay_trace
from tieredemb.trace import TableInfo, TraceWriter

COUNTS = ("hits", "misses", "evictions", "dirty_writebacks", "clean_drops", "writes", "rows_in", "rows_out")


def zipf_batches(rows, batches, seed, alpha=1.0, max_len=60):
    """Zipf keys over a permuted table, batches of random length (some empty): int64 keys, offsets."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_len, batches)
    lengths[3] = 0
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    p = 1.0 / np.arange(1, rows + 1) ** alpha
    keys = rng.permutation(rows)[rng.choice(rows, int(offsets[-1]), p=p / p.sum())]
    return keys.astype(np.int64), offsets


def assert_same_counts(result, sim):
    assert len(result.tiers) == len(sim.tiers)
    for mine, theirs in zip(result.tiers, sim.tiers):
        assert {f: getattr(mine, f) for f in COUNTS} == {f: getattr(theirs, f) for f in COUNTS}, mine.name
        assert mine.hit_ratio == theirs.hit_ratio
    assert (result.bottom_reads, result.bottom_writes) == (sim.bottom_reads, sim.bottom_writes)
    assert result.num_lookups == sim.lookups


@pytest.mark.parametrize("train", [False, True], ids=["forward", "train"])
@pytest.mark.parametrize("capacities", [[70], [70, 160]], ids=["one_tier", "two_tiers"])
@pytest.mark.parametrize("policy", ["lru", "lfu", "clock"])
def test_replay_equals_simulator(policy, capacities, train):
    # ~4,500 uses of tier 0: LFU ages its counts several times (every max(1024, 8 * capacity) uses).
    keys, offsets = zipf_batches(rows=600, batches=150, seed=7)
    result = replay_trace((keys, offsets), policy=policy, capacities=capacities, train=train, dim=4, total_rows=600)
    sim = simulate(keys, offsets, policy, capacities, train=train)
    assert_same_counts(result, sim)
    # The comparison is not vacuous: every tier evicted, and training wrote dirty rows down.
    for t in result.tiers:
        assert t.evictions > 0 and 0 < t.hit_ratio < 1
    assert (result.tiers[0].dirty_writebacks > 0) == train
    if len(capacities) == 2:
        assert result.tiers[1].writes == result.tiers[0].dirty_writebacks
    # The engine's own bottom tier counted the same rows crossing into it.
    assert result.bottom["reads"] == result.bottom_reads
    assert result.bottom["rows_written"] == result.bottom_writes


def write_trace(path, tables, keys, offsets, chunk_lookups):
    with TraceWriter(path, tables, chunk_lookups=chunk_lookups) as w:
        w.write_batches(keys, offsets)


def test_multi_table_trace_streams_in_chunks(tmp_path):
    tables = [TableInfo("user", 250), TableInfo("item", 400), TableInfo("ad", 150)]
    keys, offsets = zipf_batches(rows=800, batches=120, seed=3)
    path = tmp_path / "multi.trace"
    write_trace(path, tables, keys, offsets, chunk_lookups=300)  # ~12 chunks
    for policy in ("lru", "lfu", "clock"):
        result = replay_trace(path, policy=policy, capacities=[60, 150], train=True, dim=4)
        assert result.total_rows == 800 and result.num_batches == 120
        assert_same_counts(result, simulate(str(path), policy=policy, capacities=[60, 150], train=True))
        # The file, streamed chunk by chunk, replays exactly as the same batches in memory.
        in_memory = replay_trace((keys, offsets), policy=policy, capacities=[60, 150], train=True, dim=4,
                                 total_rows=800)
        assert [t.__dict__ for t in result.tiers] == [t.__dict__ for t in in_memory.tiers]


def test_first_batches_only_and_whole_table_in_tier0():
    keys, offsets = zipf_batches(rows=300, batches=40, seed=5)
    part = replay_trace((keys, offsets), policy="lru", capacities=[50], dim=4, batches=10)
    assert part.num_batches == 10 and part.num_lookups == int(offsets[10])
    assert_same_counts(part, simulate(keys[:offsets[10]], offsets[:11], "lru", [50]))
    # A tier 0 that holds every row never evicts: hits and misses still match.
    whole = replay_trace((keys, offsets), policy="clock", capacities=["100%"], dim=4, train=True)
    assert whole.capacities == [int(keys.max()) + 1] and whole.tiers[0].evictions == 0
    assert_same_counts(whole, simulate(keys, offsets, "clock", whole.capacities, train=True))


def test_ssd_backing_gives_the_same_counts(tmp_path):
    keys, offsets = zipf_batches(rows=400, batches=50, seed=11)
    on_ssd = replay_trace((keys, offsets), policy="lru", capacities=[60, 120], train=True, dim=4,
                          ssd_path=tmp_path / "ssd", total_rows=400)
    assert_same_counts(on_ssd, simulate(keys, offsets, "lru", [60, 120], train=True))
    assert on_ssd.bottom["reads"] == on_ssd.bottom_reads  # rows the SSD store was asked for


def test_compare_names_each_differing_count():
    keys, offsets = zipf_batches(rows=400, batches=40, seed=4)
    result = replay_trace((keys, offsets), policy="lru", capacities=[60], dim=4)
    assert compare(result, simulate(keys, offsets, "lru", [60])) == []
    diffs = compare(result, simulate(keys, offsets, "fifo", [60]))  # another policy: other counts
    assert "tier 0 (tier0) hits: engine 425, simulator 371" in diffs
    assert "bottom_reads: engine 550, simulator 604" in diffs


def test_batch_larger_than_tier0_is_served_by_the_engine_and_refused_by_the_simulator():
    """The engine lends a batch wider than tier 0 overflow slots; the simulator does not model
    them and says which batch it cannot simulate."""
    keys = np.arange(100, dtype=np.int64)
    offsets = np.array([0, 40, 100])
    result = replay_trace((keys, offsets), policy="lru", capacities=[50], dim=4)
    assert result.tiers[0].misses == 100 and result.tiers[0].hits == 0
    with pytest.raises(ValueError, match=r"batch 1 needs 60 rows in tier 0 \(capacity 50\)"):
        simulate(keys, offsets, "lru", [50])


def test_cli_compare_and_json(tmp_path, capsys):
    keys, offsets = zipf_batches(rows=500, batches=60, seed=2)
    path = tmp_path / "t.trace"
    write_trace(path, [TableInfo("a", 200), TableInfo("b", 300)], keys, offsets, chunk_lookups=1000)
    assert main(["replay", str(path), "--policy", "clock", "--capacity", "10%", "--capacity", "25%", "--train",
                 "--dim", "8", "--compare", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "MATCH" in out and "DIFFER" not in out
    assert "tier0 engine" in out and "host simulator" in out and "lookups/s" in out
    assert main(["replay", str(path), "--policy", "lfu", "--capacity", "50", "--json", "--compare",
                 "--no-progress"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["match"] is True and doc["differences"] == []
    assert doc["replay"]["capacities"] == [50] and doc["replay"]["num_lookups"] == int(offsets[-1])
    assert doc["replay"]["tiers"][0]["misses"] == doc["simulate"]["tiers"][0]["misses"] > 0
    assert doc["replay"]["lookups_per_s"] > 0 and doc["replay"]["batch_median_s"] > 0
    # '15%' of 500 rows is 75 rows for both commands, and their counts agree.
    assert main(["replay", str(path), "--policy", "lru", "--capacity", "15%", "--json", "--no-progress"]) == 0
    mine = json.loads(capsys.readouterr().out)
    assert main(["simulate", str(path), "--policy", "lru", "--capacity", "15%", "--json"]) == 0
    theirs = json.loads(capsys.readouterr().out)[0]
    assert mine["capacities"] == [theirs["tiers"][0]["capacity"]] == [75]
    assert mine["tiers"][0]["hits"] == theirs["tiers"][0]["hits"] > 0


@pytest.mark.parametrize("args, named", [
    (["--policy", "fifo", "--capacity", "10"], "'fifo'"),
    (["--policy", "lru", "--capacity", "0"], "'0'"),
    (["--policy", "lru", "--capacity", "150%"], "'150%'"),
    (["--policy", "lru", "--capacity", "ten"], "'ten'"),
    (["--policy", "lru", "--capacity", "50", "--capacity", "20"], "'20'"),
    (["--policy", "lru", "--capacity", "10", "--capacity", "20", "--capacity", "30"], "'30'"),
    (["--policy", "lru", "--capacity", "10", "--dim", "-3"], "-3"),
    (["--policy", "lru"], "--capacity"),
])
def test_cli_bad_input(tmp_path, capsys, args, named):
    keys, offsets = zipf_batches(rows=200, batches=5, seed=1)
    path = tmp_path / "t.trace"
    write_trace(path, [TableInfo("a", 200)], keys, offsets, chunk_lookups=1000)
    assert main(["replay", str(path), "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tieredemb replay: error: ") and err.count("\n") == 1 and named in err


def test_cli_missing_or_bad_trace(tmp_path, capsys):
    missing = tmp_path / "nope.trace"
    assert main(["replay", str(missing), "--policy", "lru", "--capacity", "10"]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and err.count("\n") == 1
    junk = tmp_path / "junk.trace"
    junk.write_bytes(b"not a trace at all, just bytes" * 4)
    assert main(["replay", str(junk), "--policy", "lru", "--capacity", "10"]) == 2
    err = capsys.readouterr().err
    assert str(junk) in err and "byte 0" in err and err.count("\n") == 1


def test_cli_reads_other_formats_directly(tmp_path, capsys):
    """An oracleGeneral file (batches by clock_time) and a 1-D .npy (--batch-size) replay, and
    --compare simulates, as their conversions to .trace do."""
    keys, offsets = zipf_batches(rows=400, batches=30, seed=4)
    path = tmp_path / "t.trace"
    write_trace(path, [TableInfo("a", 400)], keys, offsets, chunk_lookups=1000)
    np.save(tmp_path / "flat.npy", keys)
    assert main(["trace", "convert", str(path), str(tmp_path / "t.oracleGeneral.bin")]) == 0
    assert main(["trace", "convert", str(tmp_path / "t.oracleGeneral.bin"), str(tmp_path / "o.trace")]) == 0
    assert main(["trace", "convert", str(tmp_path / "flat.npy"), str(tmp_path / "flat.trace"), "--batch-size", "25",
                 "--rows", "400"]) == 0
    capsys.readouterr()
    args = ["--policy", "lru", "--capacity", "60", "--json", "--compare", "--no-progress"]
    for direct, read, converted in [("t.oracleGeneral.bin", [], "o.trace"),
                                    ("flat.npy", ["--batch-size", "25", "--rows", "400"], "flat.trace")]:
        assert main(["replay", str(tmp_path / direct), *args, *read]) == 0
        mine = json.loads(capsys.readouterr().out)
        assert main(["replay", str(tmp_path / converted), *args]) == 0
        theirs = json.loads(capsys.readouterr().out)
        assert mine["match"] and mine["simulate"] == theirs["simulate"]
        assert mine["replay"]["tiers"] == theirs["replay"]["tiers"] and mine["replay"]["num_lookups"] == keys.size
