"""Many tables in one module: TieredEmbeddingBagCollection, TorchRec's EmbeddingBagCollection with
tiered tables, and the inputs it takes (KeyedJaggedTensor, dicts, inverse-keyed batches).

    tables = [tieredemb.EmbeddingBagConfig("user", 10**8, 128, ["user_id"]),
              tieredemb.EmbeddingBagConfig("item", 10**7, 64, ["item_id", "last_item"])]
    ebc = tieredemb.TieredEmbeddingBagCollection(tables, cache_bytes="8GiB", host_bytes="64GiB",
                                                 optimizer=tieredemb.RowWiseAdagrad(lr=0.01))
    pooled = ebc(kjt)            # a torchrec KeyedTensor where torchrec imports, else a KeyedEmbeddings

Tables that agree on dim, pooling, optimizer, init and dtype are one group: their rows are one
id space (table t's row r is the group's row offset[t] + r), so a batch of every feature reading
them is one lookup: one dedup, one residency pass, one kernel each way. The budget of a tier is
split over the groups (and so over their tables) in proportion to the tables' rows, unless a
plan gives each table its share (tables_budget). Rows never written read as the deterministic
initial value of (seed, group row), so a table in a collection starts from other values than a
table of its own with the same seed.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch
from torch import Tensor, nn

from .config import Init, TableConfig, parse_bytes
from .module import TieredEmbeddingBag
from .optim import Optimizer


@dataclasses.dataclass(frozen=True)
class EmbeddingBagConfig:
    """One table of a collection: name; num_embeddings x embedding_dim; the features that read it
    (each feature a bag per sample); pooling 'sum' or 'mean'; optimizer and init (None: the
    collection's); dtype of the weights."""

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...] | list[str]
    pooling: str = "sum"
    optimizer: Optimizer | None = None
    init: Init | None = None
    dtype: torch.dtype = torch.float32

    def __post_init__(self):
        object.__setattr__(self, "feature_names", tuple(self.feature_names))
        if not self.feature_names:
            raise ValueError(f"table {self.name!r} has no features: give feature_names")
        if self.pooling not in ("sum", "mean"):
            raise ValueError(f"table {self.name!r}: pooling {self.pooling!r} is not 'sum' or 'mean'")


@dataclasses.dataclass(frozen=True)
class InverseKeyed:
    """A feature's batch given as its distinct bags and, per sample, which one it is (RecD's
    inverse-keyed jagged tensor): values and offsets [U + 1] of the U distinct bags, inverse [B]."""

    values: Tensor
    offsets: Tensor
    inverse: Tensor


class KeyedEmbeddings:
    """The pooled features, as torchrec's KeyedTensor has them (used where torchrec is not
    installed): keys(), values() [B, sum of dims], length_per_key(), to_dict() {key: [B, D]}."""

    def __init__(self, keys: list[str], lengths: list[int], values: Tensor):
        self._keys, self._lengths, self._values = keys, lengths, values

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> Tensor:
        return self._values

    def length_per_key(self) -> list[int]:
        return self._lengths

    def to_dict(self) -> dict[str, Tensor]:
        return dict(zip(self._keys, torch.split(self._values, self._lengths, dim=1)))

    def __getitem__(self, key: str) -> Tensor:
        return self.to_dict()[key]


def _keyed(keys, lengths, values):
    try:
        from torchrec.sparse.jagged_tensor import KeyedTensor
    except ImportError:
        return KeyedEmbeddings(keys, lengths, values)
    return KeyedTensor(keys=keys, length_per_key=lengths, values=values)


class _Group:
    """Tables that share dim, pooling, optimizer, init and dtype: one engine over their rows."""

    def __init__(self, tables: list[EmbeddingBagConfig]):
        self.tables = tables
        self.offsets = dict(zip((t.name for t in tables), np.cumsum([0] + [t.num_embeddings for t in tables])))
        self.rows = sum(t.num_embeddings for t in tables)


class TieredEmbeddingBagCollection(nn.Module):
    """EmbeddingBagCollection whose tables live in tiers under one budget per tier.

    tables: EmbeddingBagConfig list (unique names; a feature read by one table). cache_bytes /
    host_bytes: the budget of tier 0 and of the host cache over all tables ('8GiB', or bytes;
    None: every row in tier 0 / no host cache). ssd_path: a directory; each group's rows go in a
    store under it (None: host memory). optimizer / init: the default of tables that give none.
    tables_budget: {table: (tier-0 rows, host rows)} from a plan, instead of the split in
    proportion to the tables' rows. Other keywords (policy, seed, device, ssd_options,
    stochastic_rounding) go to every group's table (see TableConfig)."""

    def __init__(self, tables: list[EmbeddingBagConfig], *, cache_bytes=None, host_bytes=None, ssd_path=None,
                 optimizer: Optimizer | None = None, init: Init | None = None, tables_budget: dict | None = None,
                 **table_args):
        super().__init__()
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"table names must be unique, got {names}")
        features = [f for t in tables for f in t.feature_names]
        if len(set(features)) != len(features):
            raise ValueError(f"a feature is read by one table; features {sorted(f for f in set(features) if features.count(f) > 1)} "
                             "appear in several")
        self.tables = [dataclasses.replace(t, optimizer=t.optimizer or optimizer, init=t.init or init or Init())
                       for t in tables]
        self.feature_table = {f: t for t in self.tables for f in t.feature_names}
        groups: dict = {}
        for t in self.tables:
            groups.setdefault((t.embedding_dim, t.pooling, t.optimizer, t.init, t.dtype), []).append(t)
        self.groups = [_Group(g) for g in groups.values()]
        total_rows = sum(t.num_embeddings for t in self.tables)
        self.engines = nn.ModuleList()
        for k, g in enumerate(self.groups):
            t0 = g.tables[0]
            width = TableConfig(1, t0.embedding_dim, optimizer=t0.optimizer, dtype=t0.dtype).width
            cache, host = self._budget(g, cache_bytes, host_bytes, width, total_rows, tables_budget)
            self.engines.append(TieredEmbeddingBag(
                g.rows, t0.embedding_dim, t0.pooling, cache_rows=cache, host_rows=host, optimizer=t0.optimizer,
                init=t0.init, dtype=t0.dtype, ssd_path=None if ssd_path is None else os.path.join(ssd_path, f"group{k}"),
                **table_args))

    @staticmethod
    def _budget(group, cache_bytes, host_bytes, width, total_rows, tables_budget):
        """The group's tier-0 and host-cache rows: the sum of its tables' shares."""
        if tables_budget is not None:
            cache = sum(tables_budget[t.name][0] for t in group.tables)
            host = sum(tables_budget[t.name][1] or 0 for t in group.tables) or None
            return min(cache, group.rows), (None if host is None else max(host, min(cache, group.rows)))

        def share(budget):
            if budget is None:
                return None
            total = parse_bytes(budget) if isinstance(budget, str) else int(budget)
            return max(1, int(total * group.rows / total_rows) // (width * 4))
        cache, host = share(cache_bytes), share(host_bytes)
        if host is not None and cache is not None:
            host = max(host, min(cache, group.rows))
        return cache, host

    # -- input ----------------------------------------------------------------------------------
    def _features(self, features) -> dict:
        """features -> {feature: (ids int64 [N], bag boundaries [B + 1], weights or None, inverse or None)}."""
        if hasattr(features, "keys") and callable(getattr(features, "values", None)) and \
                not isinstance(features, dict):  # a KeyedJaggedTensor (duck-typed)
            keys = list(features.keys())
            values = features.values()
            weights = features.weights_or_none()
            lengths = features.lengths()
            stride = len(lengths) // max(len(keys), 1)
            bounds = torch.zeros(len(lengths) + 1, dtype=torch.int64)
            torch.cumsum(lengths.to("cpu", torch.int64), 0, out=bounds[1:])
            out = {}
            for k, key in enumerate(keys):
                b = bounds[k * stride:(k + 1) * stride + 1]
                lo, hi = int(b[0]), int(b[-1])
                out[key] = (values[lo:hi], b - lo, None if weights is None else weights[lo:hi], None)
            return out
        out = {}
        for key, item in features.items():
            if isinstance(item, InverseKeyed):
                out[key] = (item.values, _bounds(item.offsets, len(item.values)), None, item.inverse.to(torch.int64))
            else:
                ids, offsets = item[0], item[1]
                out[key] = (ids, _bounds(offsets, len(ids)), item[2] if len(item) > 2 else None, None)
        return out

    def forward(self, features):
        """features: a KeyedJaggedTensor, or {feature: (ids, offsets[, per_sample_weights])} with
        offsets [B] bag starts, or {feature: InverseKeyed}. Every feature of every table must be
        given, with the same B. Returns the pooled features in the tables' order (a torchrec
        KeyedTensor where torchrec imports, else a KeyedEmbeddings)."""
        given = self._features(features)
        missing = [f for f in self.feature_table if f not in given]
        unknown = [f for f in given if f not in self.feature_table]
        if missing or unknown:
            raise ValueError(f"features: missing {missing}, unknown {unknown} (this collection reads "
                             f"{list(self.feature_table)})")
        pooled = {}
        for group, engine in zip(self.groups, self.engines):
            pooled.update(self._lookup(group, engine, given))
        keys = [f for t in self.tables for f in t.feature_names]
        batch = {v.shape[0] for v in pooled.values()}
        if len(batch) > 1:
            raise ValueError(f"features have different batch sizes: {sorted(batch)}")
        return _keyed(keys, [self.feature_table[f].embedding_dim for f in keys], torch.cat([pooled[f] for f in keys], 1))

    def _lookup(self, group: _Group, engine, given: dict) -> dict:
        """Every feature of the group's tables in one lookup: the features' bags one after another."""
        ids, bounds, weights, parts = [], [np.zeros(1, dtype=np.int64)], [], []
        start = 0
        for t in group.tables:
            for f in t.feature_names:
                values, b, w, inverse = given[f]
                values = values.to(torch.int64)
                v = values.numpy() if values.device.type == "cpu" else values.cpu().numpy()
                if v.size and (v.min() < 0 or v.max() >= t.num_embeddings):
                    bad = int(v.min()) if v.min() < 0 else int(v.max())
                    raise IndexError(f"feature {f!r}: id {bad} out of range [0, {t.num_embeddings}) of table {t.name!r}")
                ids.append(values + int(group.offsets[t.name]))
                bounds.append(b.numpy()[1:] + start)
                weights.append(w)
                parts.append((f, len(b) - 1, inverse))
                start += len(values)
        flat = torch.cat(ids)
        offsets = torch.from_numpy(np.concatenate(bounds)[:-1])
        psw = None
        if any(w is not None for w in weights):
            psw = torch.cat([w if w is not None else torch.ones(len(i)) for w, i in zip(weights, ids)])
        out = engine(flat, offsets, per_sample_weights=psw)
        result, row = {}, 0
        for f, bags, inverse in parts:
            block = out[row:row + bags]
            result[f] = block if inverse is None else block.index_select(0, inverse.to(block.device))
            row += bags
        return result

    # -- rows, state, stats ---------------------------------------------------------------------
    def _where(self, table: str):
        for group, engine in zip(self.groups, self.engines):
            if table in group.offsets:
                return engine, int(group.offsets[table])
        raise KeyError(f"no table {table!r}; tables: {[t.name for t in self.tables]}")

    def read_rows(self, table: str, ids) -> Tensor:
        """The current rows of a table: float32 [n, D]."""
        engine, base = self._where(table)
        return engine.read_rows(torch.as_tensor(ids) + base)

    def write_rows(self, table: str, ids, values: Tensor, optimizer_state: Tensor | None = None) -> None:
        engine, base = self._where(table)
        engine.write_rows(torch.as_tensor(ids) + base, values, optimizer_state)

    def read_optimizer_state(self, table: str, ids) -> Tensor:
        engine, base = self._where(table)
        return engine.read_optimizer_state(torch.as_tensor(ids) + base)

    def stats(self) -> dict:
        """Per group of tables: {"tables": names, and the group's per-tier stats}."""
        return {f"group{k}": {"tables": [t.name for t in g.tables], **e.stats()}
                for k, (g, e) in enumerate(zip(self.groups, self.engines))}

    def flush(self) -> None:
        for e in self.engines:
            e.flush()

    def close(self) -> None:
        for e in self.engines:
            e.close()


def _bounds(offsets: Tensor, n: int) -> Tensor:
    """Bag starts [B] -> boundaries [B + 1] (as a host int64 tensor)."""
    o = offsets.to("cpu", torch.int64)
    return torch.cat([o, torch.tensor([n])])
