"""tieredemb: embedding tables across memory tiers (GPU HBM / host DRAM / SSD) for
recommendation models, as drop-in torch.nn.EmbeddingBag / torch.nn.Embedding replacements."""

import torch as _torch

from . import _C
from .config import Init, parse_bytes
from .module import TieredEmbedding, TieredEmbeddingBag
from .optim import SGD, Adagrad, Adam, RowWiseAdagrad
from .prefetch import PrefetchLoader, PrefetchOrderError

_C.set_num_threads(_torch.get_num_threads())

__all__ = ["TieredEmbeddingBag", "TieredEmbedding", "SGD", "Adagrad", "RowWiseAdagrad", "Adam", "Init",
           "parse_bytes", "PrefetchLoader", "PrefetchOrderError", "record"]


def __getattr__(name):
    # tieredemb.record (tieredemb.trace.record), imported on first use: the trace tools pull
    # in numba, which the modules do not need.
    if name == "record":
        from .trace import record
        return record
    raise AttributeError(f"module 'tieredemb' has no attribute {name!r}")
__version__ = "0.1.0"
