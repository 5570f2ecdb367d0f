"""Synthetic Zipf traces: the distribution, the permutation, reuse between batches, seeds."""

import numpy as np
import pytest

from tieredemb.trace import TraceError, ZipfSampler, open_trace, synth_zipf


@pytest.mark.parametrize("alpha", [0.0, 0.7, 1.0, 1.3, 3.0])
def test_ranks_follow_zipf(alpha):
    """Each rank's count is Binomial(n, p_r): |count/n - p_r| stays within 5.5 standard deviations
    for all 60 ranks except with probability < 60 * 4e-8."""
    rows, n = 60, 300_000
    s = ZipfSampler(rows, alpha, seed=9)
    ids = np.concatenate([s.next_batch(n // 3) for _ in range(3)])
    rank_of = np.empty(rows, np.int64)
    rank_of[s.permutation(np.arange(rows))] = np.arange(rows)
    freq = np.bincount(rank_of[ids], minlength=rows) / n
    p = np.arange(1, rows + 1, dtype=np.float64) ** -alpha
    p /= p.sum()
    assert np.all(np.abs(freq - p) <= 5.5 * np.sqrt(p * (1 - p) / n))


@pytest.mark.parametrize("rows", [1, 2, 7, 1000, 4097])
def test_permutation_is_a_bijection(rows):
    perm = ZipfSampler(rows, 1.0, seed=3).permutation(np.arange(rows))
    assert sorted(perm.tolist()) == list(range(rows))
    if rows > 100:  # and it moves rows around
        assert np.mean(perm == np.arange(rows)) < 0.05


def test_huge_tables_need_no_memory():
    s = ZipfSampler(10**12, 1.05, seed=1)
    ids = s.next_batch(100_000)
    assert ids.min() >= 0 and ids.max() < 10**12
    top = np.bincount(np.unique(ids, return_inverse=True)[1]).max() / ids.size
    m, n, a = 10**6, 10**12, 1.05  # P(rank 1) = 1 / sum r^-a: exact to m, then the midpoint integral
    p1 = 1 / (np.sum(np.arange(1, m + 1, dtype=np.float64) ** -a) + ((m + 0.5) ** (1 - a) - (n + 0.5) ** (1 - a)) / (a - 1))
    assert abs(top - p1) < 5 * np.sqrt(p1 * (1 - p1) / ids.size)  # p1 = 0.064


def test_reuse_copies_the_previous_batch_at_chosen_positions():
    same = ZipfSampler(10**6, 0.5, reuse=1.0, seed=2)
    first = same.next_batch(500)
    assert np.array_equal(same.next_batch(500), first)
    half = ZipfSampler(10**6, 0.5, reuse=0.5, seed=2)
    a, b = half.next_batch(1000), half.next_batch(1000)
    assert 500 <= np.sum(a == b) <= 520  # 500 copied; a few equal by chance
    assert np.sum(a == half.next_batch(1000)) < 300  # reuse reaches back one batch only


def test_batches_drawn_alone_equal_the_batches_drawn_in_turn():
    """batch(i, n) is what the benchmarks' workload draws: batch i on its own, in any order."""
    s = ZipfSampler(10**6, 1.05, seed=4)
    in_turn = [s.next_batch(300) for _ in range(4)]
    alone = ZipfSampler(10**6, 1.05, seed=4)
    for i in (3, 0, 2, 1):
        assert np.array_equal(alone.batch(i, 300), in_turn[i])
    assert not np.array_equal(in_turn[0], in_turn[1])
    assert np.array_equal(alone.hottest(5), alone.permutation(np.arange(5)))
    ids = np.concatenate(in_turn)
    assert np.mean(np.isin(ids, alone.hottest(1000))) > 0.4  # the hottest 0.1% of rows draw most lookups
    with pytest.raises(TraceError, match=r"rank 1000000 out of range \[0, 1000000\)"):
        alone.permutation([5, 10**6])


def test_seeds_make_traces_deterministic(tmp_path):
    synth_zipf(tmp_path / "a.trace", [100, 10**5], 20, [5, 50], alpha=1.2, reuse=0.3, seed=7)
    synth_zipf(tmp_path / "b.trace", [100, 10**5], 20, [5, 50], alpha=1.2, reuse=0.3, seed=7)
    h = synth_zipf(tmp_path / "c.trace", [100, 10**5], 20, [5, 50], alpha=1.2, reuse=0.3, seed=8)
    assert (tmp_path / "a.trace").read_bytes() == (tmp_path / "b.trace").read_bytes()
    assert (tmp_path / "a.trace").read_bytes() != (tmp_path / "c.trace").read_bytes()
    assert h.meta == {"generator": "zipf", "alpha": 1.2, "reuse": 0.3, "seed": 8}
    for b in open_trace(tmp_path / "a.trace").batches():
        assert b.size == 55 and np.all(b[:5] < 100) and np.all(b[5:] >= 100)


def test_bad_parameters():
    with pytest.raises(TraceError, match="alpha -1"):
        ZipfSampler(10, -1)
    with pytest.raises(TraceError, match="reuse 1.5"):
        ZipfSampler(10, 1, reuse=1.5)
    with pytest.raises(TraceError, match="rows 0"):
        ZipfSampler(0, 1)
    with pytest.raises(TraceError, match="lookups per batch: 3 values given for 2 tables"):
        synth_zipf("/nonexistent/x.trace", [10, 10], 5, [1, 2, 3])
