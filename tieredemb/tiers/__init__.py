"""The tiers of a table, top to bottom (see table.py for the picture): CacheTier (tier 0 and the
host cache), HostStore (every row in host memory), and the RowStore interface below every tier,
which the SSD stores of ssd_backend implement too."""

from .cache import CacheTier
from .host_store import HostStore
from .rowstore import RowInit, RowStore
from .table import ResidentBatch, TableStore

__all__ = ["CacheTier", "HostStore", "ResidentBatch", "RowInit", "RowStore", "TableStore"]
