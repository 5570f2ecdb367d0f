"""`tieredemb trace convert | inspect | synth`, and the input options that every command reading a
trace shares (add_input_args / open_input: simulate, mrc and replay use them too)."""

from __future__ import annotations

import argparse
import json
import sys

from ..output import status_stream
from .format import TraceError

INPUT_HELP = ("The input's format is told from its content: a tieredemb .trace, a libCacheSim oracleGeneral file "
              "(e.g. *.oracleGeneral.bin), a CSV of batch,table,id lines, an integer .npy array or an FBGEMM .pt "
              "request file; files of the other formats are read as they are, no conversion needed.")


def add_input_args(p: argparse.ArgumentParser) -> None:
    """The options that say how to read a trace file of another format (detect.open_any)."""
    g = p.add_argument_group("reading formats other than .trace", INPUT_HELP)
    g.add_argument("--from", dest="src_format", choices=["trace", "pt", "oracle", "csv", "npy"],
                   help="read the input as this format, whatever its content suggests")
    g.add_argument("--batch-size", type=int, metavar="N",
                   help="lookups per batch for inputs that carry no batches: required for a 1-D .npy and a CSV "
                        "without a batch column; oracleGeneral: default a new batch wherever clock_time changes; "
                        ".pt: samples per batch (default: the file's B samples are one batch). A batch is what the "
                        "engine deduplicates and keeps resident at once (--mode batch)")
    g.add_argument("--rows", type=int, nargs="+", help="table sizes: one for all tables or one per table "
                                                        "(default: each table's largest id + 1)")
    g.add_argument("--tables", type=int, dest="num_tables", metavar="T",
                   help=".pt without lengths: the number of tables T")
    g.add_argument("--remap", action="store_true", help="oracleGeneral: renumber ids 0, 1, ... in order of first use "
                                                        "(for hashed 64-bit ids; the table size is then the ids seen)")


def input_options(a: argparse.Namespace) -> dict:
    """add_input_args' values as detect.open_any's options (fmt included)."""
    return {"fmt": a.src_format, "rows": _one_or_list(a.rows), "batch_size": a.batch_size,
            "num_tables": a.num_tables, "remap": a.remap}


def open_input(path, a: argparse.Namespace):
    """The trace at `path` (any format), read as add_input_args' options say."""
    from .detect import open_any

    return open_any(path, **input_options(a))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tieredemb trace", description="trace files: convert, inspect, synthesize")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--no-progress", action="store_true", help="no progress bars (default: bars on a terminal)")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", parents=[common], help="convert between our .trace and pt / oracleGeneral / csv / npy / log",
                       description="One side is a tieredemb .trace. The source's format comes from its content "
                                   "(or --from), the destination's from its extension (.trace .pt .oracleGeneral[.bin] "
                                   ".csv .npy .log) or --to. trace -> log writes one dlrm locality log per table.")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--to", dest="dst_format", choices=["trace", "pt", "oracle", "csv", "npy", "log"])
    c.add_argument("--obj-size", type=int, help="oracle export: obj_size of every request (default 1)")
    c.add_argument("--chunk-lookups", type=int, default=None,
                   help="an import's lookups per compressed chunk of the .trace written (default 1048576)")
    add_input_args(c)

    i = sub.add_parser("inspect", parents=[common], help="lookups, unique rows, per-table counts, reuse histogram",
                       description="Counts of a trace file in any supported format.")
    i.add_argument("trace")
    i.add_argument("--json", action="store_true", help="print a JSON object")
    i.add_argument("--no-reuse", action="store_true", help="skip the reuse histogram")
    add_input_args(i)

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
    if a.dst == "-":  # (it wrote a file named "-")
        raise TraceError("destination '-': give a file name (or /dev/stdout, for a text format)")
    from .conversion import convert
    from .detect import source_format

    src = source_format(a.src, a.src_format)
    if src == "trace":
        given = [flag for flag, v in (("--batch-size", a.batch_size), ("--rows", a.rows), ("--tables", a.num_tables),
                                      ("--remap", a.remap)) if v]
        if given:
            raise TraceError(f"{a.src} is a tieredemb trace: {', '.join(given)} "
                             f"{'applies' if len(given) == 1 else 'apply'} to the source of an import, "
                             f"not to an export")
        if a.chunk_lookups is not None:  # (it was ignored without a word)
            raise TraceError(f"--chunk-lookups applies to the .trace an import writes, not to an export of {a.src}")
        options = {} if a.obj_size is None else {"obj_size": a.obj_size}
    else:
        if a.obj_size is not None:
            raise TraceError(f"--obj-size applies to an export to oracleGeneral, not to an import of {a.src}")
        options = {k: v for k, v in input_options(a).items() if k != "fmt"}
        if a.chunk_lookups is not None:
            options["chunk_lookups"] = a.chunk_lookups
    result = convert(a.src, a.dst, src_format=src, dst_format=a.dst_format, progress=progress, **options)
    say = status_stream(a.dst)
    if isinstance(result, list):  # locality logs
        print("\n".join(f"wrote {p}" for p in result), file=say)
    elif result is not None:
        print(f"wrote {a.dst}: {result.num_batches:,} batches, {result.num_lookups:,} lookups, "
              f"tables {', '.join(f'{t.name} ({t.num_rows:,} rows)' for t in result.tables)} "
              f"(table sizes: {result.meta['rows']})", file=say)
    else:
        print(f"wrote {a.dst}", file=say)
    return 0


def _inspect(a) -> int:
    from .stats import describe, format_description

    info = describe(a.trace, reuse=not a.no_reuse, **input_options(a))
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
    print(f"wrote {a.out}: {h.num_batches:,} batches, {h.num_lookups:,} lookups over {len(h.tables)} table(s)",
          file=status_stream(a.out))
    return 0


def trace(argv: list[str]) -> int:
    """Entry point of `tieredemb trace`; returns the exit status (2 on a bad trace or argument,
    with one line on stderr naming it)."""
    a = _parser().parse_args(argv)
    progress = not a.no_progress and sys.stderr.isatty()
    commands = {"convert": lambda: _convert(a, progress), "inspect": lambda: _inspect(a),
                "synth": lambda: _synth(a, progress)}
    try:
        if a.command == "inspect" and a.no_reuse:  # counts only: numpy, no numba start-up
            return commands[a.command]()
        from .jit import compile_notice

        with compile_notice(f"trace {a.command}"):
            return commands[a.command]()
    except BrokenPipeError:  # (the reader went away: cli.main ends quietly)
        raise
    except (TraceError, OSError) as e:
        print(f"tieredemb trace {a.command}: {e}", file=sys.stderr)
        return 2
