"""tieredemb: embedding tables across memory tiers (GPU HBM / host DRAM / SSD) for
recommendation models, as drop-in torch.nn.EmbeddingBag / torch.nn.Embedding replacements.

The public names are imported on first use: `import tieredemb` alone loads neither torch nor
numba, so the command-line tools that need neither start in milliseconds.
"""

from .trace.lazy import lazy_exports

__version__ = "0.1.0"

# public name -> the submodule that defines it
_EXPORTS = {
    "TieredEmbeddingBag": ".module", "TieredEmbedding": ".module",
    "SGD": ".optim", "Adagrad": ".optim", "RowWiseAdagrad": ".optim", "MomentumScaledRowWiseAdagrad": ".optim",
    "Adam": ".optim", "Optimizer": ".optim",
    "TableConfig": ".config", "Init": ".config", "parse_bytes": ".config",
    "RocksDBOptions": ".config", "LogOptions": ".config", "SlotOptions": ".config",
    "PrefetchLoader": ".loader", "PrefetchOrderError": ".prefetch",
    "record": ".trace",
    "TieredEmbeddingBagCollection": ".collection", "EmbeddingBagConfig": ".config", "InverseKeyed": ".collection",
    "TieredEmbeddingCollection": ".collection", "EmbeddingConfig": ".config",
    "plan": ".planner",
}

__all__ = sorted(_EXPORTS)
# (submodules too, as tieredemb.metrics.prometheus reads after `import tieredemb`)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
