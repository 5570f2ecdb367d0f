"""`tieredemb trace convert | inspect | synth`."""

from __future__ import annotations

import argparse
import json
import sys

from .format import TraceError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tieredemb trace", description="trace files: convert, inspect, synthesize")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--no-progress", action="store_true", help="no progress bars (default: bars on a terminal)")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", parents=[common], help="convert between our .trace and pt / oracleGeneral / csv / npy / log",
                       description="One side is a tieredemb .trace. Formats come from the extensions "
                                   "(.trace .pt .oracleGeneral[.bin] .csv .npy .log) or --from/--to. "
                                   "trace -> log writes one dlrm locality log per table.")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--from", dest="src_format", choices=["trace", "pt", "oracle", "csv", "npy"])
    c.add_argument("--to", dest="dst_format", choices=["trace", "pt", "oracle", "csv", "npy", "log"])
    c.add_argument("--rows", type=int, nargs="+", help="table sizes: one for all tables or one per table "
                                                        "(default: each table's largest id + 1)")
    c.add_argument("--batch-size", type=int, help="lookups per batch (npy 1-D, csv without a batch column, "
                                                  "oracle: default a batch per clock_time); pt: samples per batch "
                                                  "(default: the file's B samples are one batch)")
    c.add_argument("--tables", type=int, dest="num_tables", help="pt without lengths: the number of tables T")
    c.add_argument("--remap", action="store_true", help="oracle: renumber ids 0, 1, ... in order of first use")
    c.add_argument("--obj-size", type=int, help="oracle export: obj_size of every request (default 1)")
    c.add_argument("--chunk-lookups", type=int, default=1 << 20, help="lookups per compressed chunk")

    i = sub.add_parser("inspect", parents=[common], help="lookups, unique rows, per-table counts, reuse histogram")
    i.add_argument("trace")
    i.add_argument("--json", action="store_true", help="print a JSON object")
    i.add_argument("--no-reuse", action="store_true", help="skip the reuse histogram")

    s = sub.add_parser("synth", parents=[common], help="write a Zipf or locality-log trace",
                       description="Zipf: P(rank r) ~ r^-alpha over a seeded permutation of each table. "
                                   "Locality logs: dlrm's LRU stack-distance model, one table per log.")
    s.add_argument("out")
    kind = s.add_mutually_exclusive_group(required=True)
    kind.add_argument("--zipf", type=float, metavar="ALPHA", help="Zipf exponent (0 = uniform)")
    kind.add_argument("--logs", nargs="+", metavar="LOG", help="dlrm locality logs (dist_emb_*.log), one per table")
    s.add_argument("--rows", type=int, nargs="+", help="table sizes (Zipf: required; logs: default largest id + 1)")
    s.add_argument("--batches", type=int, required=True)
    s.add_argument("--lookups", type=int, nargs="+", required=True, help="lookups per batch: one for every table "
                                                                         "or one per table")
    s.add_argument("--reuse", type=float, default=0.0, help="Zipf: fraction of a batch repeating the previous "
                                                            "batch's id at the same position")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--chunk-lookups", type=int, default=1 << 20)
    return p


def _one_or_list(values):
    return None if values is None else values[0] if len(values) == 1 else values


def _convert(a, progress: bool) -> int:
    from .convert import convert, detect_format

    src, dst = detect_format(a.src, a.src_format), detect_format(a.dst, a.dst_format)
    if src == "trace":
        options = {"obj_size": a.obj_size} if dst == "oracle" and a.obj_size else {}
    else:
        options = {"rows": _one_or_list(a.rows), "batch_size": a.batch_size, "chunk_lookups": a.chunk_lookups}
        if src == "pt":
            options["num_tables"] = a.num_tables
        if src == "oracle":
            options["remap"] = a.remap
    result = convert(a.src, a.dst, src_format=src, dst_format=dst, progress=progress, **options)
    if isinstance(result, list):  # locality logs
        print("\n".join(f"wrote {p}" for p in result))
    elif result is not None:
        print(f"wrote {a.dst}: {result.num_batches:,} batches, {result.num_lookups:,} lookups, "
              f"tables {', '.join(f'{t.name} ({t.num_rows:,} rows)' for t in result.tables)} "
              f"(table sizes: {result.meta['rows']})")
    else:
        print(f"wrote {a.dst}")
    return 0


def _inspect(a) -> int:
    from .stats import describe, format_description

    info = describe(a.trace, reuse=not a.no_reuse)
    print(json.dumps(info, indent=1) if a.json else format_description(info))
    return 0


def _synth(a, progress: bool) -> int:
    lookups = _one_or_list(a.lookups)
    if a.zipf is not None:
        from .synth import synth_zipf

        if a.rows is None:
            raise TraceError("--zipf needs --rows (one table size, or one per table)")
        h = synth_zipf(a.out, a.rows, a.batches, lookups, alpha=a.zipf, reuse=a.reuse, seed=a.seed,
                       chunk_lookups=a.chunk_lookups, progress=progress)
    else:
        from .locality import read_locality_log, synth_locality

        logs = [read_locality_log(p) for p in a.logs]
        h = synth_locality(a.out, logs, a.batches, lookups, rows=_one_or_list(a.rows), seed=a.seed,
                           chunk_lookups=a.chunk_lookups, progress=progress)
    print(f"wrote {a.out}: {h.num_batches:,} batches, {h.num_lookups:,} lookups over {len(h.tables)} table(s)")
    return 0


def trace(argv: list[str]) -> int:
    """Entry point of `tieredemb trace`; returns the exit status (1 on a bad trace or argument)."""
    a = _parser().parse_args(argv)
    progress = not a.no_progress and sys.stderr.isatty()
    try:
        if a.command == "convert":
            return _convert(a, progress)
        if a.command == "inspect":
            return _inspect(a)
        return _synth(a, progress)
    except (TraceError, FileNotFoundError) as e:
        print(f"tieredemb trace {a.command}: {e}", file=sys.stderr)
        return 2
