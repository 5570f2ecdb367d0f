"""The counter-based generator of initial row values (native/kernels/random.cc), through the
binding that production uses (init_rows): its statistics, its independence, and its bit-exact
reproducibility (golden values, an independent numpy reference, and element j not depending on
the row width or the buffer's alignment)."""
import math

import numpy as np
import pytest
import torch

from tieredemb import _C

N = 10**6
DIM = 128
NORMAL, UNIFORM, ZEROS = 0, 1, 2


def init(ids, dim, kind, a, b, seed, width=None, zero_id=-1, out=None):
    """init_rows of int64 ids into a float32 [len(ids), width] array (width defaults to dim)."""
    ids = np.asarray(ids, dtype=np.int64)
    if out is None:
        out = np.empty((ids.size, width or dim), np.float32)
    _C.init_rows(ids, out, dim, kind, a, b, seed, zero_id)
    return out


def normal_rows(seed, rows, dim=DIM, mean=0.0, std=1.0):
    return init(np.arange(rows), dim, NORMAL, mean, std, seed)


def uniform_rows(seed, rows, low, high, dim=DIM):
    return init(np.arange(rows), dim, UNIFORM, low, high, seed)


def corr(a, b):
    return float(np.corrcoef(a.astype(np.float64), b.astype(np.float64))[0, 1])


# ---- an independent numpy reference: the documented algorithm, one IEEE float32 op at a time --

M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
F = np.float32


def mix64(x):
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def row_key(seed, row):
    """The stream key of a row: splitmix64(seed ^ splitmix64(row + 0x632be59bd9b4e019)), where
    splitmix64(x) = mix64(x + 0x9e3779b97f4a7c15)."""
    gamma = np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        inner = mix64(np.uint64(row % 2**64) + np.uint64(0x632BE59BD9B4E019) + gamma)
        return int(mix64((np.uint64(seed) ^ inner) + gamma))


def pair_bits(key, pairs):
    p = np.arange(pairs, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return mix64(np.uint64(key) + (p + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15))


def as_float(bits):
    return bits.astype(np.uint32).view(np.float32)


def reference_normal(key, n, mean, std):
    h = pair_bits(key, (n + 1) // 2)
    m = (h >> np.uint64(40)).astype(np.int32) + 1  # u1 = m / 2^24 in (0, 1]
    ix = m.astype(np.float32).view(np.uint32) - np.uint32(0x3F3504F3)
    dk = ((ix >> np.uint32(23)).astype(np.int32) - 24).astype(np.float32)
    f = as_float((ix & np.uint32(0x7FFFFF)) + np.uint32(0x3F3504F3)) - F(1)
    s = f / (F(2) + f)
    z = s * s
    w = z * z
    lg1, lg2 = F(float.fromhex("0xaaaaaa.0p-24")), F(float.fromhex("0xccce13.0p-25"))
    lg3, lg4 = F(float.fromhex("0x91e9ee.0p-25")), F(float.fromhex("0xf89e26.0p-26"))
    r = z * (lg1 + w * lg3) + w * (lg2 + w * lg4)
    hfsq = F(0.5) * f * f
    log_u = dk * F(6.9313812256e-01) - ((hfsq - (s * (hfsq + r) + dk * F(9.0580006145e-06))) - f)
    radius = np.sqrt(F(-2) * log_u)
    b = ((h >> np.uint64(8)) & np.uint64(0xFFFFFF)).astype(np.uint32)
    q = b >> np.uint32(22)
    t = ((b & np.uint32(0x3FFFFF)).astype(np.int32) - 0x200000).astype(np.float32) * F(float.fromhex("0x1.921fb6p-22"))
    z = t * t
    sin = ((F(-1.9515295891e-4) * z + F(8.3321608736e-3)) * z - F(1.6666654611e-1)) * z * t + t
    cos = ((F(2.443315711809948e-5) * z - F(1.388731625493765e-3)) * z + F(4.166664568298827e-2)) * z * z - F(0.5) * z + F(1)
    swap = (q & np.uint32(1)).astype(bool)
    x, y = np.where(swap, sin, cos), np.where(swap, cos, sin)
    cos_a = (x.view(np.uint32) ^ ((((q + np.uint32(1)) >> np.uint32(1)) & np.uint32(1)) << np.uint32(31))).view(np.float32)
    sin_a = (y.view(np.uint32) ^ ((q >> np.uint32(1)) << np.uint32(31))).view(np.float32)
    out = np.empty(2 * len(h), np.float32)
    out[0::2] = F(mean) + F(std) * (radius * cos_a)
    out[1::2] = F(mean) + F(std) * (radius * sin_a)
    return out[:n]


# ---- statistics ----------------------------------------------------------------------------


def test_normal_moments_match_the_normal_distribution():
    x = normal_rows(seed=1, rows=N // DIM + 1).ravel()[:N].astype(np.float64)
    se = 1 / math.sqrt(N)
    m = x.mean()
    c = x - m
    var = (c**2).mean()
    skew = (c**3).mean() / var**1.5
    kurt = (c**4).mean() / var**2 - 3
    # 5 standard errors: mean se 1/sqrt(N), std sqrt(1/2N), skew sqrt(6/N), kurtosis sqrt(24/N)
    assert abs(m) < 5 * se
    assert abs(math.sqrt(var) - 1) < 5 * se * math.sqrt(0.5)
    assert abs(skew) < 5 * se * math.sqrt(6)
    assert abs(kurt) < 5 * se * math.sqrt(24)


def test_normal_mean_and_std_are_applied():
    x = normal_rows(seed=2, rows=2000, mean=0.5, std=0.01).astype(np.float64)
    assert abs(x.mean() - 0.5) < 5 * 0.01 / math.sqrt(x.size)
    assert abs(x.std() / 0.01 - 1) < 5 / math.sqrt(2 * x.size)


def test_normal_kolmogorov_smirnov_distance_is_small():
    x = np.sort(normal_rows(seed=3, rows=N // DIM + 1).ravel()[:N].astype(np.float64))
    cdf = torch.special.ndtr(torch.from_numpy(x)).numpy()
    i = np.arange(1, N + 1)
    d = max((i / N - cdf).max(), (cdf - (i - 1) / N).max())
    # 1.95 / sqrt(N) is the 0.1% critical value; a transform off by 1% in scale gives ~4e-3
    assert d < 1.95 / math.sqrt(N), d
    # the tails: |z| > 3 has probability 0.0027 and |z| <= 5.8 always (24-bit u1)
    tail = np.mean(np.abs(x) > 3)
    assert abs(tail - 0.0026998) < 5 * math.sqrt(0.0027 / N)
    assert np.abs(x).max() < 5.8


def test_uniform_range_mean_and_variance():
    low, high = -0.05, 0.05
    x = uniform_rows(seed=4, rows=N // DIM + 1, low=low, high=high).ravel()[:N]
    assert x.min() >= np.float32(low) and x.max() < np.float32(high)
    x = x.astype(np.float64)
    span = high - low
    assert abs(x.mean()) < 5 * span / math.sqrt(12 * N)
    assert abs(x.var() / (span**2 / 12) - 1) < 5 * math.sqrt(0.8 / N)  # var of (u-1/2)^2 = 1/180
    hist = np.histogram(x, bins=16, range=(low, high))[0]
    assert np.abs(hist / (N / 16) - 1).max() < 5 * math.sqrt(16 / N)


def test_uniform_never_reaches_high_when_rounding_would():
    # low + span * u rounds to high for u >= 1/2 here; the range stays [low, high)
    low, high = 1.0, float(np.nextafter(np.float32(1), np.float32(2)))
    x = init([5], 1000, UNIFORM, low, high, seed=0)
    assert (x >= np.float32(low)).all() and (x < np.float32(high)).all()


def test_state_columns_zero_and_row_zero_id_and_kind_zeros():
    x = init([3, 7, 9], 16, NORMAL, 0.0, 1.0, seed=1, width=24, zero_id=7)
    assert (x[:, 16:] == 0).all() and (x[1] == 0).all()
    assert (x[[0, 2], :16] != 0).all()
    assert (init([3, 7], 16, ZEROS, 0.0, 1.0, seed=1, width=24) == 0).all()


# ---- independence --------------------------------------------------------------------------


def test_adjacent_elements_and_adjacent_rows_are_uncorrelated():
    x = normal_rows(seed=5, rows=8000).astype(np.float64)
    bound = 5 / math.sqrt(x.size / 2)
    for a, b in [(x[:, 0::2], x[:, 1::2]), (x[:, 1:-1:2], x[:, 2::2])]:  # pair mates, neighbours
        assert abs(corr(a.ravel(), b.ravel())) < bound
        assert abs(corr(a.ravel() ** 2, b.ravel() ** 2)) < bound  # Box-Muller radius not reused
    assert abs(corr(x[:-1].ravel(), x[1:].ravel())) < 5 / math.sqrt(x.size)  # row id, id + 1
    u = uniform_rows(seed=5, rows=8000, low=0.0, high=1.0).astype(np.float64)
    assert abs(corr(u[:, :-1].ravel(), u[:, 1:].ravel())) < 5 / math.sqrt(u.size)
    assert abs(corr(u[:-1].ravel(), u[1:].ravel())) < 5 / math.sqrt(u.size)


def test_different_seeds_and_rows_give_different_draws():
    # Rows of 4 seeds x 1002 ids (negative ones too) all start differently: distinct keys.
    # (zero_id is the init's "no padding row" -1 by default: moved off the ids here.)
    starts = {tuple(row) for s in range(4)
              for row in init(np.arange(-2, 1000), 4, NORMAL, 0.0, 1.0, seed=s, zero_id=-5).view(np.uint32)}
    assert len(starts) == 4 * 1002
    a, b, c = (normal_rows(seed=s, rows=1)[0] for s in (0, 1, 0))
    assert (a == c).all() and (a != b).mean() > 0.99
    assert (normal_rows(seed=0, rows=2)[0] != normal_rows(seed=0, rows=2)[1]).mean() > 0.99


# ---- reproducibility -----------------------------------------------------------------------


@pytest.mark.parametrize("kind, a, b", [(NORMAL, 0.1, 2.0), (UNIFORM, -1.0, 3.0)])
def test_element_j_does_not_depend_on_dim_width_or_alignment(kind, a, b):
    full = init([42], 1000, kind, a, b, seed=3)[0]
    for n in list(range(1, 300)) + [511, 512, 513, 999]:  # odd n: element n-1 from the tail
        part = init([42], n, kind, a, b, seed=3, width=n + 5)[0]
        assert part[:n].view(np.uint32).tolist() == full[:n].view(np.uint32).tolist(), n
    for offset in range(1, 8):  # buffers not aligned to a vector
        buf = np.empty(1000 + offset, np.float32)
        init([42], 1000, kind, a, b, seed=3, out=buf[offset:].reshape(1, 1000))
        assert (buf[offset:].view(np.uint32) == full.view(np.uint32)).all(), offset


def test_normal_equals_an_independent_float32_reference_bit_for_bit():
    for seed, row in [(0, 0), (7, 123456789), (11, -3)]:
        for n, mean, std in [(4097, 0.0, 1.0), (129, 0.25, 0.01)]:
            out = init([row], n, NORMAL, mean, std, seed)[0]
            ref = reference_normal(row_key(seed, row), n, mean, std)
            assert (out.view(np.uint32) == ref.view(np.uint32)).all()


# normal(0.1, 0.02) (an affine step that is not the identity, so a fused mean + std * z shows)
GOLDEN_NORMAL = {
    (0, 0): [0x3E0E898E, 0x3D7567FE, 0x3DAB0664, 0x3DE9D0DC, 0x3DD9285E, 0x3DDC65EC, 0x3DB522A8, 0x3DD60815],
    (7, 123456789): [0x3DB7F0A7, 0x3DDEA292, 0x3D9DE46D, 0x3DB04BEF, 0x3DD06D59, 0x3DFB1E86, 0x3E188BF7, 0x3DE67467],
}
GOLDEN_KEYS = {(0, 0): 0x88CE4B48A6765BFC, (7, 123456789): 0xF6245905F39DA67E}
GOLDEN_UNIFORM = {
    (0, 0): [0xBF75EEFE, 0x3F7F15E6, 0x3DDC8580, 0x3CC54380, 0x3F4700AE, 0xBEED3168, 0x3F266EA6, 0x3E06C3F8],
    (7, 123456789): [0x3F190DA6, 0x3CCB6E40, 0xBE3D9380, 0x3ED8FCF4, 0x3D5141C0, 0xBE8CBC74, 0xBF6B0086, 0xBF2B97EA],
}


@pytest.mark.parametrize("seed_id", sorted(GOLDEN_NORMAL))
def test_golden_values(seed_id):
    # Pinned: a change to the generator or to how random.cc is compiled (an FMA) changes these,
    # and every stored table would read its unwritten rows differently.
    seed, row = seed_id
    assert row_key(seed, row) == GOLDEN_KEYS[seed_id]  # the reference's key derivation
    x = init([row], 8, NORMAL, 0.1, 0.02, seed)[0]
    assert x.view(np.uint32).tolist() == GOLDEN_NORMAL[seed_id]
    x = init([row], 8, UNIFORM, -1.0, 1.0, seed)[0]
    assert x.view(np.uint32).tolist() == GOLDEN_UNIFORM[seed_id]
