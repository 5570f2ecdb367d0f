"""Cache simulator: multi-tier policy simulation, miss-ratio curves, and the engine replay
(replay.py). Keys are global row keys (table_base[t] + id, see tieredemb.trace); batch_offsets
[B+1] split them into the engine's batches. Every entry point takes numpy arrays or a trace (a
path in any format tieredemb.trace reads, or an open tieredemb.trace.TraceSource).

The names below are imported on first use (`tieredemb simulate --help` needs no numba).
stack_distances is tieredemb.trace's (the reuse analysis the LRU curve is built on).
"""

from tieredemb.trace.lazy import lazy_exports

# public name -> the module that defines it
_EXPORTS = {
    "SimError": ".errors",
    "MissRatioCurve": ".curves", "mrc": ".curves", "shards_sample": ".curves",
    "SimResult": ".simulator", "Simulator": ".simulator", "TierResult": ".simulator", "parse_policy": ".simulator",
    "simulate": ".simulator",
    "DUPLICATE": "tieredemb.trace.reuse", "FIRST_USE": "tieredemb.trace.reuse",
    "stack_distances": "tieredemb.trace.reuse",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

