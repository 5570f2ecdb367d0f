"""Cache simulator: LRU stack distances, multi-tier policy simulation, miss-ratio curves.

Keys are global row keys (table_base[t] + id, see tieredemb.trace); batch_offsets [B+1] split
them into the engine's batches. Every entry point takes numpy arrays.
"""

from .keys import SimError
from .mrc import MissRatioCurve, mrc, shards_sample
from .simulate import SimResult, Simulator, TierResult, parse_policy, simulate
from .stackdist import DUPLICATE, FIRST_USE, stack_distances

__all__ = ["DUPLICATE", "FIRST_USE", "MissRatioCurve", "SimError", "SimResult", "Simulator", "TierResult", "mrc",
           "parse_policy", "shards_sample", "simulate", "stack_distances"]
