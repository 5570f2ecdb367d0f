"""`tieredemb plan`: every table's tier-0 rows and store from a trace of the tables' lookups
(tieredemb.planner), printed against the proportional and equal splits, as JSON and as a PNG.

    tieredemb plan tables.trace --cache-bytes 1GiB --dim 128
    tieredemb plan tables.trace --cache-bytes 1GiB --host-bytes 16GiB --dim 64 128 64 --probe /nvme \\
        --json plan.json --png plan.png
    # then: TieredEmbeddingBagCollection(tables, plan="plan.json", ssd_path="/nvme/t")

Bad input exits with status 2 and one line naming the value.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from .output import PendingFile, png_path, status_stream

OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")


def _parser() -> argparse.ArgumentParser:
    from .trace.cli import add_input_args

    p = argparse.ArgumentParser(
        prog="tieredemb plan",
        description="Choose every table's tier-0 rows (and, with --host-bytes, which tables are stored whole in "
                    "host memory and which on SSD) from the tables' exact miss-ratio curves, to move the fewest "
                    "bytes per batch; the same model prices the budget split in proportion to the tables' bytes "
                    "and in equal shares.")
    p.add_argument("trace", help="the tables' lookups: a trace file in any supported format (one table per trace "
                                 "table, e.g. from tieredemb.record or `tieredemb trace convert`)")
    p.add_argument("--cache-bytes", required=True, help="tier 0's budget over all tables, e.g. 8GiB")
    p.add_argument("--host-bytes", help="host memory for tables stored whole there; the rest go to SSD "
                                        "(default: every table in host memory)")
    p.add_argument("--dim", type=int, nargs="+", required=True, help="embedding dim: one for all tables or one per table")
    p.add_argument("--optimizer", choices=OPTIMIZERS,
                   help="its state travels with each row (default: rowwise_adagrad; none with --inference)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32", help="weights' dtype")
    p.add_argument("--row-alignment", type=int, default=4, metavar="BYTES",
                   help="the tables' row_alignment: rows padded to a whole number of BYTES (default 4: none)")
    p.add_argument("--inference", action="store_true",
                   help="rows are only read (none written back), and hold no optimizer state")
    p.add_argument("--bandwidth-tier0", type=float, metavar="BYTES_PER_S",
                   help="host memory <-> tier 0 (default 20e9, about PCIe 4 x16; --probe measures a host tier 0)")
    p.add_argument("--bandwidth-ssd", type=float, metavar="BYTES_PER_S", help="SSD reads (default 2e9)")
    p.add_argument("--probe", metavar="DIR", nargs="?", const="",
                   help="measure the bandwidths on this machine: host copies, and SSD reads in a directory DIR "
                        "(no DIR: host copies only)")
    p.add_argument("--points", type=int, default=48,
                   help="geometric sizes on each table's curve grid, and as many where the curve falls (default 48)")
    p.add_argument("--warmup", type=int, default=0, metavar="BATCHES",
                   help="the trace's first BATCHES batches only fill tier 0; predict the batches after them "
                        "(a steady state; default 0: from a cold start)")
    p.add_argument("--json", metavar="PATH", help="write the three plans as JSON (the collection's plan= takes it)")
    p.add_argument("--png", metavar="PATH", help="write each table's curve with the chosen points")
    add_input_args(p)
    return p


def plan(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    try:
        # Every output's path is checked (a file made beside it) before anything is read or
        # written; each is moved into place only once all are whole, else none is.
        with contextlib.ExitStack() as stack:
            outputs = {flag: stack.enter_context(PendingFile(path))
                       for flag, path in (("json", a.json), ("png", a.png and png_path(a.png))) if path}
            return _plan(a, outputs)
    except BrokenPipeError:  # (the reader went away: cli.main ends quietly)
        raise
    except (ValueError, OSError) as e:  # TraceError, bad sizes, missing files
        print(f"tieredemb plan: error: {e}", file=sys.stderr)
        return 2


def _plan(a, outputs: dict[str, PendingFile]) -> int:
    import dataclasses

    import torch

    from . import optim, planner
    from .config import TableConfig
    from .trace.cli import open_input

    with open_input(a.trace, a) as source:
        header = source.header
        whole = source.read_all()
    names = [t.name for t in header.tables]
    if len(set(names)) != len(names):
        names = [f"{n}#{k}" for k, n in enumerate(names)]
    if len(a.dim) not in (1, len(names)):
        raise ValueError(f"--dim: {len(a.dim)} dims given for {len(names)} tables: give one, or one per table")
    dims = a.dim * len(names) if len(a.dim) == 1 else a.dim
    if a.inference and a.optimizer is not None:
        raise ValueError(f"--optimizer {a.optimizer}: an inference table (--inference) has no optimizer state")
    opt = None if a.inference else {"sgd": optim.SGD, "adagrad": optim.Adagrad, "rowwise_adagrad": optim.RowWiseAdagrad,
                                    "adam": optim.Adam}[a.optimizer or "rowwise_adagrad"](lr=0.01)  # (its state width)
    dtype = getattr(torch, a.dtype)
    row_bytes = [TableConfig(1, d, optimizer=opt, dtype=dtype, row_alignment=a.row_alignment).width * 4 for d in dims]
    rows = {n: t.num_rows for n, t in zip(names, header.tables)}
    traces = planner.split_trace(whole.keys, whole.batch_offsets, rows)
    say = status_stream(a.json, a.png)  # (stderr when an output is stdout: that stays whole)
    bandwidth = planner.Bandwidth()
    if a.probe is not None:
        bandwidth = planner.probe(max(row_bytes) // 4, a.probe or None)
        print(f"probed: host copies {bandwidth.to_tier0 / 1e9:.2f} GB/s"
              + (f", SSD reads {bandwidth.ssd / 1e9:.2f} GB/s" if a.probe else ""), file=say)
    if a.bandwidth_tier0 is not None:
        bandwidth = dataclasses.replace(bandwidth, to_tier0=a.bandwidth_tier0)
    if a.bandwidth_ssd is not None:
        bandwidth = dataclasses.replace(bandwidth, ssd=a.bandwidth_ssd)
    plans = planner.plan(traces, {n: (rows[n], b) for n, b in zip(names, row_bytes)}, cache_bytes=a.cache_bytes,
                         host_bytes=a.host_bytes, bandwidth=bandwidth, train=not a.inference, points=a.points,
                         warmup=a.warmup)
    print(f"{a.trace}: {len(names)} tables, {header.num_batches:,} batches, {header.num_lookups:,} lookups"
          + (f"; predicted over the batches after the first {a.warmup:,}" if a.warmup else ""), file=say)
    print(planner.report(plans), file=say)
    if "json" in outputs:
        with open(outputs["json"].temp, "w") as f:
            f.write(planner.to_json(plans))
    if "png" in outputs:
        planner.plot(plans, outputs["png"].temp)
    for flag, out in outputs.items():
        out.commit()
        print(f"{'plot' if flag == 'png' else flag}: {out.path}", file=say)
    return 0
