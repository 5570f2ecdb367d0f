"""DLRM locality logs: the file format, profiling, and the LRU stack-distance generator."""

import math

import numpy as np
import pytest

from tieredemb.trace import (
    LocalityGenerator,
    LocalityLog,
    TraceError,
    convert,
    open_trace,
    profile,
    read_locality_log,
    synth_locality,
    write_locality_log,
)

# input/dist_emb_0.log of the dlrm repository, as it is there
DLRM_SAMPLE = "1, 2, 3, 4, 5, 6\n0, 1, 3, 4, 5\n0.55, 0.64, 0.82, 0.91, 1.0\n"


def test_reads_and_writes_dlrms_sample_log(tmp_path):
    (tmp_path / "dist_emb_0.log").write_text(DLRM_SAMPLE)
    log = read_locality_log(tmp_path / "dist_emb_0.log")
    assert log.unique.tolist() == [1, 2, 3, 4, 5, 6]
    assert log.distances.tolist() == [0, 1, 3, 4, 5]
    assert log.cdf.tolist() == [0.55, 0.64, 0.82, 0.91, 1.0]
    write_locality_log(tmp_path / "again.log", log)
    assert (tmp_path / "again.log").read_text() == DLRM_SAMPLE


def test_profile_matches_dlrms_definition():
    # 5 6 5 5 7 6: first uses are 0; 5 after 6 is at depth 2, then depth 1; 6 at the end is below 7 and 5
    log = profile([5, 6, 5, 5, 7, 6])
    assert log.unique.tolist() == [5, 6, 7]
    assert log.distances.tolist() == [0, 1, 2, 3]
    np.testing.assert_allclose(log.cdf, [3 / 6, 4 / 6, 5 / 6, 1.0])


def _reference(log, uniforms):
    """dlrm's trace_generate_lru, written plainly: a list is the LRU stack, top at the end."""
    stack, pool, out = [], list(log.unique), []
    for r in uniforms:
        if len(stack) < log.distances[-1]:
            r *= log.cdf[np.searchsorted(log.distances, len(stack), side="right") - 1]
        d = log.distances[min(np.searchsorted(log.cdf, r, side="left"), log.cdf.size - 1)]
        key = (pool.pop(0) if pool else stack.pop(0)) if d == 0 else stack.pop(len(stack) - d)
        stack.append(key)
        out.append(key)
    return out


def _random_log(rng, u):
    d = np.unique(np.concatenate([[0], rng.integers(1, u + 1, rng.integers(1, u + 1))]))
    p = rng.random(d.size)
    return LocalityLog(rng.permutation(10 * u)[:u].astype(np.int64), d.astype(np.int64), np.cumsum(p) / p.sum())


def test_generator_equals_the_plain_lru_stack_model():
    """Same draws, same ids: covers depth lookups, the restricted start, an exhausted pool (n >> u)
    and the Fenwick tree's repacking (every 2u + 2 lookups)."""
    rng = np.random.default_rng(11)
    for seed in range(6):
        log = _random_log(rng, int(rng.integers(3, 80)))
        gen = LocalityGenerator(log, seed=seed)
        got = np.concatenate([gen.next(n) for n in (1, 7, 300, 1692)])  # split calls = one stream
        assert got.tolist() == _reference(log, np.random.default_rng(seed).random(2000))


def test_profiling_a_generated_trace_reproduces_the_log():
    """Bound: after the lookup tau at which max(distances) ids are in use, every draw is an
    independent sample of the log's distribution F, and the profile measures exactly the drawn
    distance (the pool of ids is never exhausted here: u > n). So for the empirical CDF F_n,
        sup |F_n - F| <= (n - tau)/n * sup |F_(n-tau) - F| + tau/n <= eps + tau/n,
    with eps = sqrt(ln(2/delta) / (2 (n - tau))) by the Dvoretzky-Kiefer-Wolfowitz inequality,
    holding with probability 1 - delta; delta = 1e-9 makes a false failure negligible."""
    n, delta = 200_000, 1e-9
    d = np.arange(0, 41)
    p = np.concatenate([[0.15], 1.0 / d[1:] ** 0.7])
    log = LocalityLog(np.arange(1_000_000, 1_000_000 + n + 1, dtype=np.int64), d, np.cumsum(p) / p.sum())
    ids = LocalityGenerator(log, seed=5).next(n)
    got = profile(ids)
    assert got.unique.tolist() == log.unique[:got.unique.size].tolist()  # new ids in the log's order
    first = np.zeros(n, bool)
    first[np.unique(ids, return_index=True)[1]] = True
    tau = int(np.searchsorted(np.cumsum(first), d[-1])) + 1  # lookups 0..tau-1 may be restricted
    at = np.searchsorted(got.distances, d, side="right") - 1  # F_n on the log's support (step points)
    f = np.where(at >= 0, got.cdf[np.maximum(at, 0)], 0.0)
    bound = math.sqrt(math.log(2 / delta) / (2 * (n - tau))) + tau / n
    assert tau < n // 50
    assert np.abs(f - log.cdf).max() <= bound, (np.abs(f - log.cdf).max(), bound)


def test_trace_to_logs_and_back(tmp_path):
    from tieredemb.trace import synth_zipf

    synth_zipf(tmp_path / "z.trace", [300, 5000], 50, [40, 60], alpha=1.1, seed=2)
    written = convert(tmp_path / "z.trace", tmp_path / "dist_emb_{}.log")
    assert written == [str(tmp_path / "dist_emb_0.log"), str(tmp_path / "dist_emb_1.log")]
    logs = [read_locality_log(p) for p in written]
    with open_trace(tmp_path / "z.trace") as r:
        c = r.read_all()
        table = r.header.table_of(c.keys)
    ids0 = c.keys[table == 0]
    assert logs[0].unique.tolist() == profile(ids0).unique.tolist()
    h = synth_locality(tmp_path / "l.trace", logs, 30, [10, 20], seed=4)
    assert [t.num_rows for t in h.tables] == [int(g.unique.max()) + 1 for g in logs]
    h2 = synth_locality(tmp_path / "l2.trace", logs, 30, [10, 20], seed=4)
    assert (tmp_path / "l.trace").read_bytes() == (tmp_path / "l2.trace").read_bytes()
    batches = list(open_trace(tmp_path / "l.trace").batches())
    assert h2.num_lookups == 900 and all(b.size == 30 for b in batches)
    assert all(np.all(h.table_of(b[:10]) == 0) and np.all(h.table_of(b[10:]) == 1) for b in batches)


@pytest.mark.parametrize("text, message", [
    ("1, 2\n0, 1\n", "has 3 lines"),
    ("1, 2\n0, x\n0.5, 1.0\n", r"line 2 is not a comma-separated list of ints"),
    ("1, 2\n1, 2\n0.5, 1.0\n", "line 2 must be stack distances rising from 0"),
    ("1, 1\n0, 1\n0.5, 1.0\n", "line 1 must list distinct ids"),
    ("1, 2\n0, 1\n0.5, 0.9\n", "line 3 must be cumulative probabilities rising to 1"),
    ("1, 2\n0, 1\n1.0\n", "line 3 has 1 probabilities for the 2 distances"),
    ("1, 2\n0, 3\n0.5, 1.0\n", "stack distance 3 on line 2 exceeds the 2 ids of line 1"),
])
def test_bad_logs_name_the_file_and_line(tmp_path, text, message):
    (tmp_path / "bad.log").write_text(text)
    with pytest.raises(TraceError, match=message) as e:
        read_locality_log(tmp_path / "bad.log")
    assert "bad.log" in str(e.value)


def test_a_trace_with_no_lookups_exports_no_log_and_says_so(tmp_path, capsys):
    """(A review: exit 0, no file, a blank line.)"""
    from tieredemb.cli import main
    from tieredemb.trace import TableInfo, TraceWriter

    with TraceWriter(tmp_path / "empty.trace", [TableInfo("t", 50)]) as w:
        w.write_batch([])
    assert main(["trace", "convert", str(tmp_path / "empty.trace"), str(tmp_path / "e.log")]) == 2
    assert "no table is ever looked up" in capsys.readouterr().err
    assert not (tmp_path / "e.log").exists()
