"""The `tieredemb` command: a dispatcher. Each command's module is imported only when it runs, so
`tieredemb --help` and `--version` import neither torch nor numba."""

from __future__ import annotations

import os
import sys

# Each command: name -> (module, function, one-line help). The function takes argv and returns
# an exit status.
COMMANDS = {
    "demo": ("tieredemb.demo", "demo", "train a small model on a table larger than its cache"),
    "simulate": ("tieredemb.sim.cli", "simulate", "hit ratios of policies and tier sizes on a trace"),
    "mrc": ("tieredemb.sim.cli", "mrc", "miss-ratio curve of a trace"),
    "replay": ("tieredemb.sim.replay", "replay", "drive the real engine with a trace"),
    "trace": ("tieredemb.trace.cli", "trace", "convert | inspect | synth traces"),
    "plan": ("tieredemb.planner_cli", "plan", "each table's tier-0 rows and store, from a trace of many tables"),
}


def _usage() -> str:
    lines = ["usage: tieredemb COMMAND [options]   (tieredemb COMMAND --help for its options)",
             "       tieredemb --version", "commands:"]
    lines += [f"  {name:9s} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines.append("Traces in every supported format (.trace, libCacheSim oracleGeneral, CSV, .npy, FBGEMM .pt) "
                 "are read directly, told apart by their content.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Runs one command; returns its exit status (2 for a usage error)."""
    import importlib

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if argv else sys.stderr)  # (no command: a usage error's, on stderr)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from tieredemb import __version__

        print(f"tieredemb {__version__}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"tieredemb: unknown command {argv[0]!r}\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[argv[0]]
    try:
        return getattr(importlib.import_module(module), func)(argv[1:])
    except BrokenPipeError:  # (`tieredemb mrc t.trace | head`: the reader has what it wanted)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (no second error at exit's flush)
        return 1


if __name__ == "__main__":
    sys.exit(main())
