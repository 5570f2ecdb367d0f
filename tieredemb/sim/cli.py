"""`tieredemb simulate` and `tieredemb mrc`: hit ratios and miss-ratio curves of a trace file in
any format tieredemb.trace reads (told from its content). Bad input exits with status 2 and one
line naming the value."""

from __future__ import annotations

import argparse
import json
import sys
from fractions import Fraction

import numpy as np

from tieredemb.output import PendingFile, png_path
from tieredemb.trace.cli import add_input_args, open_input

from .errors import SimError
from .state import POLICIES


def _rows(text: str, total: int) -> int:
    """'4096' -> 4096; '1%' / '0.5%' -> that fraction of the trace's total rows (at least 1)."""
    t = text.strip()
    try:
        if t.endswith("%"):
            pct = Fraction(t[:-1])  # (exact: a float made 100% of 2**63 - 1 rows 2**63)
            if not 0 < pct <= 100:
                raise ValueError
            return min(total, max(1, round(total * pct / 100)))
        rows = int(t)
    except (ValueError, ZeroDivisionError):
        raise SimError(f"capacity {text!r}: give rows (an integer > 0) or a percentage of the trace's "
                       f"{total:,} rows in (0, 100], e.g. 1%") from None
    if not 0 < rows < 2**63:
        raise SimError(f"capacity {text!r}: rows must be > 0 and below 2**63")
    return rows


def _run(name: str, body, argv: list[str], parser: argparse.ArgumentParser) -> int:
    """Parses argv, opens the trace, runs body(args, source); bad input -> one line, status 2."""
    add_input_args(parser)
    a = parser.parse_args(argv)
    try:
        from tieredemb.trace.jit import compile_notice

        with compile_notice(name), open_input(a.trace, a) as source:
            return body(a, source)
    except BrokenPipeError:  # (the reader went away: cli.main ends quietly)
        raise
    except (ValueError, OSError) as e:  # SimError, TraceError and missing files
        print(f"tieredemb {name}: error: {e}", file=sys.stderr)
        return 2


def _progress_wanted(a) -> bool:
    return not a.json and sys.stderr.isatty()


# -- simulate ----------------------------------------------------------------------------------------
def _simulate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tieredemb simulate", description="hit ratios of policies and tier sizes on a trace")
    p.add_argument("trace", help="trace file in any supported format (see below)")
    p.add_argument("--policy", action="append",
                   help=f"{', '.join(POLICIES)} or lookahead-K; repeat to compare policies; 'lru,lfu' gives "
                        f"one policy per tier (default lru)")
    p.add_argument("--capacity", action="append", required=True,
                   help="rows of a tier (or N%% of the trace's rows); repeat for a stack, top tier first")
    p.add_argument("--mode", choices=["batch", "request"], default="batch",
                   help="batch: the engine (per-batch dedup); request: every lookup a request (libCacheSim)")
    p.add_argument("--train", action="store_true", help="every looked-up row becomes dirty (write-backs)")
    p.add_argument("--lookahead", type=int, default=None, help="K for policy lookahead")
    p.add_argument("--json", action="store_true", help="print JSON (one object per policy, in a list)")
    return p


def _lookahead_used(a, policies: list[str]) -> None:
    """SimError for --lookahead K given where no policy is the lookahead policy (it was ignored)."""
    if a.lookahead is not None and "lookahead" not in (p.lower() for p in policies):
        raise SimError(f"--lookahead {a.lookahead}: applies to the policy lookahead only (policies: "
                       f"{', '.join(policies)}); or name it lookahead-{a.lookahead}")


def _simulate(a, source) -> int:
    from .simulator import simulate as run

    _lookahead_used(a, [n.strip() for p in a.policy or ["lru"] for n in p.split(",")])
    total = source.header.total_rows
    caps = [_rows(c, total) for c in a.capacity]
    results = []
    for policy in a.policy or ["lru"]:
        names = policy.split(",")
        r = run(source, None, names if len(names) > 1 else names[0], caps, mode=a.mode, train=a.train,
                lookahead=a.lookahead, progress=_progress_wanted(a))
        results.append(r)
    if a.json:
        print(json.dumps([r.to_dict() for r in results], indent=1))
        return 0
    print(f"{a.trace}: {results[0].lookups:,} lookups in {results[0].batches:,} batches, {total:,} rows; "
          f"mode {a.mode}{', training' if a.train else ''}")
    print(f"{'policy':14s} {'tier':6s} {'capacity':>12s} {'hit ratio':>9s} {'hits':>12s} {'misses':>12s} "
          f"{'rows in':>12s} {'evictions':>12s} {'write-backs':>12s}")
    for r in results:
        for t in r.tiers:
            print(f"{t.policy:14s} {t.name:6s} {t.capacity:>12,} {t.hit_ratio:>9.4f} {t.hits:>12,} {t.misses:>12,} "
                  f"{t.rows_in:>12,} {t.evictions:>12,} {t.dirty_writebacks:>12,}")
            for pt in t.per_table or []:
                print(f"{'':14s}   {pt['table'][:20]:20s} hit ratio {pt['hit_ratio']:.4f}  "
                      f"hits {pt['hits']:,}  misses {pt['misses']:,}")
        print(f"{'':14s} bottom: {r.bottom_reads:,} rows read, {r.bottom_writes:,} rows written")
    return 0


def simulate(argv: list[str]) -> int:
    """Entry point of `tieredemb simulate`."""
    return _run("simulate", _simulate, argv, _simulate_parser())


# -- mrc ---------------------------------------------------------------------------------------------
def _mrc_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tieredemb mrc", description="miss-ratio curve of a trace")
    p.add_argument("trace", help="trace file in any supported format (see below)")
    p.add_argument("--policy", default="lru", help=f"{', '.join(POLICIES)} or lookahead-K (default lru: exact, one pass)")
    p.add_argument("--sizes", nargs="+", help="cache sizes: rows or N%% of the trace's rows")
    p.add_argument("--points", type=int, default=100, help="log-spaced sizes when --sizes is not given (default 100)")
    p.add_argument("--sample-rate", type=float, default=None, help="SHARDS sampling rate in (0, 1] for big traces")
    p.add_argument("--mode", choices=["batch", "request"], default="batch")
    p.add_argument("--lookahead", type=int, default=None, help="K for policy lookahead")
    p.add_argument("--warmup", type=int, default=0, metavar="N",
                   help="lru: the first N batches (request mode: requests) only fill the cache; the curve is "
                        "over the lookups after them (default 0)")
    p.add_argument("--png", default=None, help="write a plot to this PNG file (stdout then gets a short summary)")
    p.add_argument("--json", action="store_true", help="print JSON (every point)")
    return p


def _plot(curve, total: int, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(curve.sizes, curve.miss_ratio, marker=".", lw=1.2)
    ax.set_xscale("log")
    ax.set_xlabel("cache size (rows)")
    ax.set_ylabel("miss ratio")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    sec = ax.secondary_xaxis("top", functions=(lambda s: 100 * s / total, lambda p: p * total / 100))
    sec.set_xlabel("% of the trace's rows")
    ax.set_title(title, fontsize=10, pad=32)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


_SUMMARY_POINTS = 5  # curve points printed when the PNG carries them all


def _mrc(a, source) -> int:
    from .curves import mrc as curve_of

    if a.points <= 0:
        raise SimError(f"--points {a.points}: must be > 0")
    _lookahead_used(a, [a.policy])
    total = source.header.total_rows
    sizes = None if a.sizes is None else np.array([_rows(s, total) for s in a.sizes], np.int64)
    c = curve_of(source, None, sizes, policy=a.policy, mode=a.mode, points=a.points, sample_rate=a.sample_rate,
                 lookahead=a.lookahead, progress=_progress_wanted(a), warmup=a.warmup)
    if c.lookups == 0:  # (every ratio would be 0 / 0)
        unit = "requests" if c.mode == "request" else "batches"
        batches = source.header.num_batches
        raise SimError(f"{a.trace}: no lookups to measure a miss ratio over"
                       + (f" after the first {a.warmup:,} {unit} (--warmup)" if a.warmup else
                          f" ({batches:,} batches, all empty)" if batches else " (it holds no batches)"))
    png = a.png and png_path(a.png)  # (no extension: PATH.png, as savefig writes it)
    if png:
        rate = f", SHARDS rate {c.sample_rate:g}" if c.sample_rate else ""
        with PendingFile(png) as out:  # (a failed plot leaves the file there as it was)
            _plot(c, total, out.temp, f"{a.trace}: {c.policy}, {c.mode} mode{rate}")
    if a.json:
        print(json.dumps(c.to_dict(), indent=1))
        return 0
    unit = "requests" if c.mode == "request" else "batches"
    warmed = f"; the first {a.warmup:,} {unit} only fill the cache" if a.warmup else ""
    print(f"{a.trace}: {c.policy} miss-ratio curve over {c.lookups:,} lookups ({c.mode} mode"
          f"{f', SHARDS rate {c.sample_rate:g}' if c.sample_rate else ''}"
          f"{warmed})")
    shown = np.arange(c.sizes.size)
    if a.png and c.sizes.size > _SUMMARY_POINTS:
        shown = np.unique(np.linspace(0, c.sizes.size - 1, _SUMMARY_POINTS).round().astype(np.int64))
    print(f"{'size (rows)':>14s} {'% rows':>8s} {'miss ratio':>10s} {'hit ratio':>10s}")
    for s, m in zip(c.sizes[shown], c.miss_ratio[shown]):
        print(f"{int(s):>14,} {100 * s / total:>8.3f} {m:>10.4f} {1 - m:>10.4f}")
    if a.png:
        print(f"plot: {png} ({c.sizes.size} sizes{', of which these' if shown.size < c.sizes.size else ''}; "
              f"--json prints every point)")
    return 0


def mrc(argv: list[str]) -> int:
    """Entry point of `tieredemb mrc`."""
    return _run("mrc", _mrc, argv, _mrc_parser())
