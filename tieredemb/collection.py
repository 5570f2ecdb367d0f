"""Many tables in one module: TieredEmbeddingBagCollection (TorchRec's EmbeddingBagCollection with
tiered tables) and TieredEmbeddingCollection (its EmbeddingCollection, unpooled); the inputs they
take and the outputs they give are in keyed.py, their state_dict, checkpoint and export table by
table in collection_state.py, their tables' configs in config.py.

    tables = [tieredemb.EmbeddingBagConfig("user", 10**8, 128, ["user_id"]),
              tieredemb.EmbeddingBagConfig("item", 10**7, 64, ["item_id", "last_item"])]
    ebc = tieredemb.TieredEmbeddingBagCollection(tables, cache_bytes="8GiB", host_bytes="64GiB",
                                                 optimizer=tieredemb.RowWiseAdagrad(lr=0.01))
    pooled = ebc(kjt)            # a torchrec KeyedTensor where torchrec imports, else a KeyedEmbeddings

Tables that agree on dim, pooling, optimizer, init, dtype and store (host memory or SSD) are one
group: their rows are one id space (table t's row r is the group's row offset[t] + r), so a batch
of every feature reading them is one lookup: one dedup, one residency pass, one kernel each way.
Tier 0's budget is split over the tables in proportion to their bytes, unless a plan
(tieredemb.planner) gives each table its share; each table's share is a partition of its group's
tier 0 (native/index/partitioned_index.h), so its hit ratio is its own. Rows never written read
as the deterministic initial value of (seed, group row), so a table in a collection starts from
other values than a table of its own with the same seed.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import warnings

import numpy as np
import torch
from torch import Tensor, nn

from .collection_prefetch import CollectionPrefetch, Prepared
from .collection_state import CollectionState
from .config import EmbeddingBagConfig, EmbeddingConfig, Init, TableConfig, from_torchrec, parse_budget
from .keyed import (InverseKeyed, KeyedEmbeddings, features_of, is_keyed_jagged, jagged, keyed,  # noqa: F401
                    keyed_lengths, variable_batch)  # (InverseKeyed and KeyedEmbeddings re-exported)
from . import collection_budget as budget, lookup
from .gpu import to_device
from .module import _CONFIG_FIELDS, _MODES, TieredEmbedding, TieredEmbeddingBag, eager_when_compiled
from .optim import Optimizer


# The table arguments a collection passes on to every group's module (the rest are each table's
# config's, or sized by the collection's budgets).
_COLLECTION_ARGS = frozenset(_CONFIG_FIELDS) - {"num_embeddings", "embedding_dim", "cache_rows", "host_rows",
                                               "partitions", "padding_idx", "dtype", "optimizer", "init",
                                               "ssd_path"} | {"ssd_options"}

class _Group:
    """Tables of one kind (dim, optimizer, init, dtype, pooling for bags) and store: one engine
    over their rows."""

    def __init__(self, tables: list[EmbeddingBagConfig], store: str, directory: str):
        self.tables = tables
        self.store = store  # "host" or "ssd"
        self.directory = directory  # its store's under ssd_path (an SSD group's)
        self.offsets = dict(zip((t.name for t in tables), np.cumsum([0] + [t.num_embeddings for t in tables])))
        self.rows = sum(t.num_embeddings for t in tables)


_ARGS = """(unique names; a feature read by one table). cache_bytes:
    tier 0's budget over all tables ('8GiB', or bytes; None: every row in tier 0), given to each
    table in proportion to its bytes (the same fraction of every table's rows); each table keeps
    its share to itself (a partition of its group's tier 0: one table's misses never evict
    another's rows). host_bytes: the host caches' budget, shared by each group's tables (None:
    none). ssd_path: a directory; each group's rows go in a store under it (None: host memory).
    plan: the planner's choice (tieredemb.planner: a Plan, its dict, or the JSON file of
    `tieredemb plan --json`) instead of cache_bytes and host_bytes: every table's tier-0 rows,
    and whether its rows are stored in host memory or on SSD (under ssd_path). optimizer / init:
    the default of tables that give none (dtype is each config's own). Other keywords (policy, seed,
    device, ssd, ...) go to every group's table (see TableConfig)."""


class _Collection(CollectionPrefetch, CollectionState, nn.Module):
    """What both collections share: tables in groups, one engine per group, the budgets, rows,
    statistics. Subclasses say what a group's engine is, and what a lookup returns."""

    _is_weighted = False  # whether a KeyedJaggedTensor's weights are per-sample weights
    _config: type = EmbeddingBagConfig  # the tables' config type

    def _kind(self, t) -> tuple:
        raise NotImplementedError

    def _engine(self, group, **args) -> nn.Module:
        raise NotImplementedError

    def __init__(self, tables: list, *, cache_bytes=None, host_bytes=None, ssd_path=None,
                 optimizer: Optimizer | None = None, init: Init | None = None, plan=None, **table_args):
        super().__init__()
        taken = sorted(set(table_args) & {"cache_rows", "host_rows", "partitions"})
        if taken:
            raise TypeError(f"a collection sizes its tables' tiers itself: give cache_bytes / host_bytes or a plan, "
                            f"not {', '.join(taken)}")
        padding_idx = table_args.pop("padding_idx", None)  # (None: no padding row, as every collection's table)
        if padding_idx is not None:
            raise TypeError(f"padding_idx={padding_idx!r}: a collection's tables have no padding row "
                            "(as torchrec's configs have none): leave such ids out of the batch")
        if "dtype" in table_args:  # (as torchrec's: each table's data type is its config's)
            raise TypeError(f"dtype={table_args['dtype']!r}: a collection's tables take their dtype from their configs "
                            "(EmbeddingBagConfig(..., dtype=...)), not from the collection")
        unknown = sorted(set(table_args) - _COLLECTION_ARGS)  # (a module's own: include_last_offset was ignored,
        if unknown:                                           # mode= a "multiple values" error, _weight taken)
            raise TypeError(f"{type(self).__name__}: unknown argument{'s' if len(unknown) > 1 else ''} "
                            f"{', '.join(unknown)}; besides its tables, cache_bytes, host_bytes, ssd_path, optimizer, "
                            f"init and plan, a collection takes: {', '.join(sorted(_COLLECTION_ARGS))}")
        if not tables:
            raise ValueError(f"{type(self).__name__} needs at least one table, got none")
        cache_bytes, host_bytes = parse_budget("cache_bytes", cache_bytes), parse_budget("host_bytes", host_bytes)
        tables = [from_torchrec(t, self._config is EmbeddingBagConfig) for t in tables]
        wrong = [t for t in tables if not isinstance(t, self._config)]
        if wrong:
            raise TypeError(f"{type(self).__name__} takes tieredemb.{self._config.__name__} tables (or torchrec's), "
                            f"got {type(wrong[0]).__name__}: {wrong[0]!r}")
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
        self._row_alignment = table_args.get("row_alignment", TableConfig.row_alignment)  # (budgets count the padding)
        if plan is not None and table_args.get("policy", "lru") != "lru":
            warnings.warn(f"a plan predicts LRU's hit rates (its curves are LRU's); policy={table_args['policy']!r} "
                          "will measure others", stacklevel=3)
        tier0, store = budget.tier0_and_store(self.tables, cache_bytes, host_bytes, ssd_path, plan,
                                              self._row_alignment)
        groups: dict = {}
        for t in self.tables:  # (a table whole in host memory apart from those cached: its group needs no tier 0,
            # and moves no row, as the planner prices it)
            whole = store[t.name] == "host" and tier0[t.name] >= t.num_embeddings
            groups.setdefault((*self._kind(t), store[t.name], whole), []).append(t)
        # An SSD group's directory is numbered as before whole tables were grouped apart (by its kind and
        # store among all groups'): directories written then open as they are.
        numbered = list(dict.fromkeys(key[:-1] for key in groups))
        self.groups = [_Group(g, key[-2], f"group{numbered.index(key[:-1])}") for key, g in groups.items()]
        self.lookups = {t.name: 0 for t in self.tables}
        self.looked_up: list = []  # the last forward's ids, per group
        self._ahead = collections.deque()  # prefetched batches (Prepared), oldest first
        self.engines = nn.ModuleList()
        hosts = budget.host_rows(self.groups, self.tables, tier0, host_bytes, self._row_alignment)
        self._record_then_open(ssd_path, lambda: self._open_groups(tier0, hosts, ssd_path, table_args))

    def _open_groups(self, tier0: dict, hosts: list, ssd_path, table_args: dict) -> None:
        """Each group's engine; if one fails, the ones opened are closed (their stores let go)."""
        try:
            for g, host in zip(self.groups, hosts):
                t0 = g.tables[0]
                parts = tuple((t.num_embeddings, tier0[t.name]) for t in g.tables)
                whole = all(cap >= rows for rows, cap in parts)
                self.engines.append(self._engine(
                    g, partitions=None if whole else parts, host_rows=host, optimizer=t0.optimizer, init=t0.init,
                    dtype=t0.dtype, ssd_path=os.path.join(ssd_path, g.directory) if g.store == "ssd" else None,
                    **table_args))
                self.engines[-1]._state_in_collection = True  # (state_dict: the collection's, table by table)
                self.engines[-1]._tables = [t.name for t in g.tables]
        except BaseException:  # (the groups opened already let go of their stores: they open again)
            for e in self.engines:
                try:
                    e.close()
                except Exception:  # (the first error is the one to see)
                    pass
            raise

    # -- input and output -----------------------------------------------------------------------
    def _prepare(self, features) -> Prepared:
        """Every feature checked, before any group is looked up (a bad one changes nothing), then
        each group's features as one lookup (Prepared). The verdict on ids on the tables' GPU is
        read by the first group's residency, before it changes anything: it goes with every
        group's lookup. A KeyedJaggedTensor on the tables' GPU is checked before it is cut into
        features (_keyed_on_device), its verdict read with its lengths."""
        keyed_check = self._keyed_on_device(features)
        given = features_of(features, None if keyed_check is None else keyed_check[0], self._is_weighted)
        missing = [f for f in self.feature_table if f not in given]
        if missing:
            raise ValueError(f"features: missing {missing} (this collection reads {list(self.feature_table)}; "
                             f"given {list(given)})")
        # (other features are left alone, as torchrec's collections leave them: one KeyedJaggedTensor
        # may feed several modules)
        given = {f: given[f] for f in self.feature_table}
        self._check_batch(given)
        if keyed_check is None:
            check = self._check_ranges(given)
        else:  # (read already: after the host's checks of the lengths and the batch, its verdict)
            from .gpu.checks import DeviceCheck

            check = DeviceCheck(keyed_check[1], False, None, self._explain(given, list(given)))
            check.raise_if(keyed_check[2])
        batches = [self._batch(group, given, check is not None) for group in self.groups]
        counts = {t.name: sum(len(given[f][0]) for f in t.feature_names) for t in self.tables}
        lookups = [(g, e, b, self._take(e, b[0], b[1])) for g, e, b in zip(self.groups, self.engines, batches)]
        return Prepared(lookups, check, counts)

    def _take(self, engine, ids: Tensor, bounds: Tensor) -> tuple:
        """The (ids, boundaries) a group's engine takes for its lookup."""
        return ids, bounds

    def _count(self, counts: dict) -> None:
        for name, n in counts.items():
            self.lookups[name] += n

    def _check_batch(self, given: dict) -> None:
        """Checks that hold across features (the bag collection's: one batch size)."""

    def _check_ranges(self, given: dict):
        """Each feature's ids within its own table (else they would read a neighbour's rows): by
        numpy on the host (torch's intra-op threads cost more there); those on the tables' GPU
        there, by one kernel launch and no wait (gpu/checks.py), the verdict returned (else None);
        those on another device by one transfer."""
        on_tables, elsewhere = [], []
        for f, (values, _, _, _) in given.items():
            if not len(values):
                continue
            if self.engines[0]._on_device(values):
                on_tables.append(f)
            elif values.device.type == "cpu":
                self._check_on_host(f, values)
            else:
                elsewhere.append((f, torch.stack(torch.aminmax(values))))
        if elsewhere:
            for (f, _), (lo, hi) in zip(elsewhere, torch.stack([r for _, r in elsewhere]).tolist()):
                _check_range(f, self.feature_table[f], lo, hi)
        if not on_tables:
            return None
        from .gpu.checks import check_runs_on_device

        return check_runs_on_device([given[f][0] for f in on_tables],
                                    [self.feature_table[f].num_embeddings for f in on_tables],
                                    self._explain(given, on_tables))

    def _explain(self, given: dict, features: list):
        """A device verdict's explanation: the host's checks of the features' ids, read back."""
        def explain():
            for f in features:
                if len(given[f][0]):
                    self._check_on_host(f, given[f][0].cpu())
        return explain

    def _keyed_on_device(self, features):
        """A KeyedJaggedTensor whose values and lengths are on the tables' GPU, every key one of
        this collection's features: each key's ids checked in its own table there, by one launch,
        then its lengths and that verdict read together (gpu/checks.py check_keyed_on_device):
        (lengths on the host, fault, faulty). One wait, where cutting it into features (its
        lengths read) and then reading the verdict took two. None for other inputs, and for a
        malformed one (the host's checks then name what is wrong)."""
        if not is_keyed_jagged(features) or variable_batch(features):
            return None  # (a batch size per key: the host cuts it into features first)
        engine, values = self.engines[0], features.values()
        if not (isinstance(values, Tensor) and engine._on_device(values)):
            return None  # (a host KJT: features_of takes its lengths, once)
        keys, lengths = list(features.keys()), keyed_lengths(features)
        if not (keys and len(set(keys)) == len(keys) and all(k in self.feature_table for k in keys)
                and values.dim() == 1 and values.dtype in (torch.int32, torch.int64) and isinstance(lengths, Tensor)
                and lengths.dim() == 1 and len(lengths) % len(keys) == 0 and not lengths.is_floating_point()
                and engine._on_device(lengths)):
            return None
        from .gpu.checks import check_keyed_on_device

        return check_keyed_on_device(values, lengths, [self.feature_table[k].num_embeddings for k in keys])

    def _check_on_host(self, feature: str, values: Tensor) -> None:
        v = values.numpy()
        _check_range(feature, self.feature_table[feature], int(v.min()), int(v.max()))

    def _batch(self, group: _Group, given: dict, on_device: bool) -> tuple:
        """Every feature of the group's tables as one lookup (the features' bags one after another;
        ids already checked, or on_device: checked there, the verdict not yet read): (ids, bag
        boundaries [B + 1], per_sample_weights, parts: [(feature, its boundaries, its InverseKeyed
        inverse or None)]). on_device: the ids on the tables' GPU, as int32 where the group's rows
        allow (its dedup sorts them in half the radix passes)."""
        ids, bounds, weights, parts = [], [np.zeros(1, dtype=np.int64)], [], []
        start = 0
        narrow = torch.int32 if on_device and group.rows < 1 << 31 else torch.int64
        for t in group.tables:
            for f in t.feature_names:
                values, b, w, inverse = given[f]
                ids.append(values.to(narrow) + int(group.offsets[t.name]))
                bounds.append(b.numpy()[1:] + start)
                weights.append(w)
                parts.append((f, b, inverse))
                start += len(values)
        flat = _cat(_on_one_device(ids))
        if on_device:  # (host features too: the group's lookup then reads the device's verdict)
            flat = to_device(flat, self.engines[0].device)
        offsets = torch.from_numpy(np.concatenate(bounds))
        psw = None
        if any(w is not None for w in weights):
            dev = next(w.device for w in weights if w is not None)  # (features without weights: 1 each)
            psw = _cat(_on_one_device([w if w is not None else torch.ones(len(i), device=dev)
                                       for w, i in zip(weights, ids)]))
        return flat, offsets, psw, parts

    @staticmethod
    def _segments(group: _Group, features) -> tuple:
        """(starts [S + 1], row_ends [S]) of a group's lookup: each table's ids, its features one
        after another, are a run of the group's rows [offset, offset + rows): runs deduplicated
        alone, in parallel (native/kernels/dedup.h)."""
        per_feature = {f: int(b[-1]) for f, b, _ in features}
        sizes = [sum(per_feature[f] for f in t.feature_names) for t in group.tables]
        ends = [int(group.offsets[t.name]) + t.num_embeddings for t in group.tables]
        return torch.from_numpy(np.cumsum([0] + sizes)), torch.tensor(ends, dtype=torch.int64)

    # -- what TorchRec's collections answer ----------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The device tier 0's rows are on (the collection's outputs are there)."""
        return self.engines[0].device

    # -- rows, state, stats ---------------------------------------------------------------------
    def _rows(self, table: str, ids) -> tuple:
        """(the table's group engine, its ids as the group's rows), ids checked to lie in the table."""
        t, engine, base = self._place_of(table)
        ids = torch.as_tensor(ids)
        if ids.is_floating_point() or ids.dtype == torch.bool:
            raise TypeError(f"table {table!r}: ids must be integers, got {ids.dtype}")
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= t.num_embeddings:
                raise IndexError(f"table {table!r}: id {lo if lo < 0 else hi} out of range [0, {t.num_embeddings})")
        return engine, ids.to(torch.int64) + base

    def read_rows(self, table: str, ids) -> Tensor:
        """The current rows of a table: float32 [n, D]."""
        engine, rows = self._rows(table, ids)
        return engine.read_rows(rows)

    def write_rows(self, table: str, ids, values: Tensor, optimizer_state: Tensor | None = None) -> None:
        engine, rows = self._rows(table, ids)
        engine.write_rows(rows, values, optimizer_state)

    def read_optimizer_state(self, table: str, ids) -> Tensor:
        engine, rows = self._rows(table, ids)
        return engine.read_optimizer_state(rows)

    def stats(self) -> dict:
        """{"tables": {table: {"group", "lookups" (ids looked up, duplicates included), "tier0":
        its own share of tier 0's counters (hits, misses, hit_rate, evictions, capacity, resident,
        ...), or None where its group holds every row in tier 0}}, "groups": {group: {"tables",
        and the group's per-tier stats (tier0, host, store or ssd, prefetch)}}}."""
        tables, groups = {}, {}
        for k, (g, e) in enumerate(zip(self.groups, self.engines)):
            s = e.stats()
            groups[f"group{k}"] = {"tables": [t.name for t in g.tables], **s}
            parts = s["tier0"].get("partitions")
            for i, t in enumerate(g.tables):
                tables[t.name] = {"group": f"group{k}", "lookups": self.lookups[t.name],
                                  "tier0": None if parts is None else parts[i]}
        return {"tables": {t.name: tables[t.name] for t in self.tables}, "groups": groups}

    def reset_stats(self) -> None:
        """The lookups, and each group's tier counters and prefetch's, back to zero, to measure a
        window of training (as TieredEmbeddingBag.reset_stats: an SSD store's own reads and
        writes, counted since it opened, go on)."""
        self.lookups = dict.fromkeys(self.lookups, 0)
        for e in self.engines:
            e.reset_stats()

    def set_learning_rate(self, lr: float) -> None:
        """Every table's optimizer's learning rate from the next backward on (see
        TieredEmbeddingBag.set_learning_rate; a group's tables share one optimizer)."""
        trained = [e for e in self.engines if e.config.optimizer is not None]
        if not trained:
            raise RuntimeError(f"{type(self).__name__}: no table has an optimizer: no learning rate to set")
        for e in trained:  # (the rate checked by the first: nothing changed if it is refused)
            e.set_learning_rate(lr)
        self.tables = [t if t.optimizer is None else dataclasses.replace(t, optimizer=dataclasses.replace(
            t.optimizer, lr=lr)) for t in self.tables]

    def get_learning_rate(self) -> float:
        """The tables' learning rate (one for all: set_learning_rate's)."""
        rates = {e.get_learning_rate() for e in self.engines if e.config.optimizer is not None}
        if len(rates) != 1:
            raise RuntimeError(f"{type(self).__name__}: the tables' groups have learning rates {sorted(rates)}")
        return rates.pop()

    def flush(self) -> None:
        """Makes every SSD-stored table durable (tables a plan keeps in host memory are not
        stored: a warning says so when they hold written rows)."""
        self._warn_rows_not_stored("flush()")
        for e in self.engines:
            e.flush()

    def _warn_rows_not_stored(self, what: str) -> None:
        """Warns if tables kept in host memory beside SSD-stored ones (a plan's choice) hold rows
        written: flush() and close() store the others only, and a collection reopened on the same
        ssd_path starts these from their initial values."""
        if all(g.store == "host" for g in self.groups):  # (no ssd_path: nothing is stored, as a module's)
            return
        held = [t.name for e, g in zip(self.engines, self.groups) if g.store == "host" and not e._closed
                and len(e._store.written_ids(0, 1)) for t in g.tables]
        if held:
            warnings.warn(f"{what}: tables {held} keep their rows in host memory (the plan's choice), so they are "
                          "not stored under ssd_path: a collection reopened there starts them from their initial "
                          "values. Keep them with export_rows(dir), or store them on SSD", stacklevel=3)

    def close(self) -> None:
        """Closes every group's table, even after one fails (its stores let go all the same); then
        raises the first failure."""
        self._warn_rows_not_stored("close()")
        failed = None
        for e in self.engines:
            try:
                e.close()
            except BaseException as exc:
                failed = failed or exc
        if failed is not None:
            raise failed

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __reduce_ex__(self, protocol):
        raise TypeError(f"{type(self).__name__} cannot be pickled or copied (copy.deepcopy, torch.save of the "
                        "module): its tables' rows live in tiers, which a copy could neither share nor duplicate. "
                        "Save state_dict() or export_rows() (over SSD: flush() or checkpoint()) and build a new one")


class TieredEmbeddingBagCollection(_Collection):
    __doc__ = f"""EmbeddingBagCollection whose tables live in tiers under one budget per tier.

    tables: EmbeddingBagConfig list {_ARGS} is_weighted: whether a KeyedJaggedTensor's weights
    are per-sample weights (False, as torchrec's default: they are left alone, as its collection
    leaves them); a dict's per_sample_weights are always applied."""

    _state_prefix = "embedding_bags"  # (TorchRec's: its state_dict keys)

    def __init__(self, tables: list, is_weighted: bool = False, **args):  # (torchrec's order)
        if not isinstance(is_weighted, bool):
            raise TypeError(f"is_weighted must be a bool, got {is_weighted!r}")
        super().__init__(tables, **args)
        self._is_weighted = is_weighted

    def is_weighted(self) -> bool:
        """Whether a KeyedJaggedTensor's weights are taken (torchrec's EmbeddingBagCollection's)."""
        return self._is_weighted

    def embedding_bag_configs(self) -> list:
        """The tables' configs, in order (as TorchRec's EmbeddingBagCollection answers: its models,
        e.g. torchrec.models.dlrm.DLRM, read the dims and feature names from them)."""
        return list(self.tables)

    def _kind(self, t) -> tuple:
        return t.embedding_dim, t.pooling, t.optimizer, t.init, t.dtype

    def _engine(self, group, **args) -> nn.Module:
        t0 = group.tables[0]
        return TieredEmbeddingBag(group.rows, t0.embedding_dim, t0.pooling, **args)

    @eager_when_compiled
    def forward(self, features):
        """features: a KeyedJaggedTensor, or {feature: (ids, offsets[, per_sample_weights])} with
        offsets [B] bag starts, or {feature: InverseKeyed}. Every feature of every table must be
        given, with the same B. Returns the pooled features in the tables' order (a torchrec
        KeyedTensor where torchrec imports, else a KeyedEmbeddings). Each group's kernels write
        its features' rows straight into the [B, sum of dims] block, one autograd node for all."""
        return self._lookup(features, self._pool)

    def _pool(self, prepared: Prepared):
        keys = [f for t in self.tables for f in t.feature_names]
        dims = [self.feature_table[f].embedding_dim for f in keys]
        width = sum(dims)
        col = dict(zip(keys, np.cumsum([0] + dims[:-1]).tolist()))
        _, _, (_, _, _, first), _ = prepared.lookups[0]
        _, b, inverse = first[0]
        samples = len(b) - 1 if inverse is None else len(inverse)
        side = samples * width  # where inverse-keyed features' distinct bags go: after the samples' rows
        parts, expand = [], []
        for group, engine, (_, _, psw, features), (flat, offsets) in prepared.lookups:
            dim, at = engine.embedding_dim, []
            for f, b, inverse in features:
                bags = len(b) - 1
                if inverse is None:
                    at.append(np.arange(bags, dtype=np.int64) * width + col[f])
                else:
                    expand.append(lookup.Expand(col[f], dim, side, bags, to_device(inverse, engine.device)))
                    at.append(np.arange(bags, dtype=np.int64) * dim + side)
                    side += bags * dim
            parts.append(lookup.Part(engine, flat, offsets, psw, _MODES[group.tables[0].pooling], True,
                                     torch.from_numpy(np.concatenate(at)), self._segments(group, features),
                                     prepared.check, (flat, offsets)))
        values = lookup.pooled_block(parts, (-(-side // width), width), samples, expand)
        return keyed(keys, dims, values)

    def _check_batch(self, given: dict) -> None:
        sizes = {f: len(b) - 1 if inverse is None else len(inverse) for f, (_, b, _, inverse) in given.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"features have different batch sizes (bags per feature): {sizes}")
        for f, (_, _, w, _) in given.items():  # (features_of checked their shape and type)
            pooling = self.feature_table[f].pooling
            if w is not None and pooling != "sum":
                raise ValueError(f"feature {f!r}: per_sample_weights need pooling 'sum', its table pools by "
                                 f"{pooling!r}")


class TieredEmbeddingCollection(_Collection):
    __doc__ = f"""EmbeddingCollection (unpooled: each id its row) whose tables live in tiers under
    one budget per tier.

    tables: EmbeddingConfig list {_ARGS}"""

    _state_prefix = "embeddings"
    _config = EmbeddingConfig

    def embedding_configs(self) -> list:
        """The tables' configs, in order (as TorchRec's EmbeddingCollection answers)."""
        return list(self.tables)

    def embedding_dim(self) -> int:
        """The tables' one dim (TorchRec's EmbeddingCollection has one); ValueError if they differ."""
        dims = sorted({t.embedding_dim for t in self.tables})
        if len(dims) != 1:
            raise ValueError(f"the tables have several dims {dims}: embedding_dim() is for collections of one")
        return dims[0]

    def _kind(self, t) -> tuple:
        return t.embedding_dim, t.optimizer, t.init, t.dtype

    def _engine(self, group, **args) -> nn.Module:
        return TieredEmbedding(group.rows, group.tables[0].embedding_dim, **args)

    @eager_when_compiled
    def forward(self, features) -> dict:
        """features: as TieredEmbeddingBagCollection's (per_sample_weights aside; offsets [B]
        start each sample's ids; each feature's B its own, as each output is jagged by its own
        samples, where the bag collection's [B, sum of dims] needs one B). Returns {feature: its
        rows, one per id, as a torchrec JaggedTensor (values [N, D], lengths [B]) where torchrec
        imports, else a JaggedEmbeddings};
        an InverseKeyed feature's samples get their distinct bag's rows."""
        return self._lookup(features, self._rows_of)

    def _rows_of(self, prepared: Prepared) -> dict:
        out = {}
        for _, engine, (_, _, _, parts), take in prepared.lookups:  # (TieredEmbedding's forward, with the verdict)
            rows = lookup.pooled(engine, *take, None, _MODES["sum"], exclude_padding=False, check=prepared.check,
                                 source=take)
            out.update(self._jagged(rows, parts))
        return {f: out[f] for t in self.tables for f in t.feature_names}

    def _take(self, engine, ids: Tensor, bounds: Tensor) -> tuple:
        return engine._bags(ids)  # (one bag per id)

    def _check_batch(self, given: dict) -> None:
        if any(w is not None for _, _, w, _ in given.values()):
            raise ValueError("per_sample_weights apply to pooled features: an EmbeddingCollection takes none")

    @staticmethod
    def _jagged(rows: Tensor, parts) -> dict:
        """{feature: its rows as a jagged tensor} from a group's rows, one per id."""
        result, at = {}, 0
        for f, b, inverse in parts:
            n = int(b[-1])
            block, lengths = rows[at:at + n], b[1:] - b[:-1]
            if inverse is not None:  # each sample: its distinct bag's rows
                inverse = inverse.cpu()  # (b and lengths are on the host)
                starts, lengths = b[:-1][inverse], lengths[inverse]
                pick = torch.repeat_interleave(starts - torch.cumsum(lengths, 0) + lengths, lengths) + \
                    torch.arange(int(lengths.sum()))
                block = block.index_select(0, to_device(pick, block.device))
            result[f] = jagged(block, to_device(lengths, block.device))
            at += n
        return result


def _check_range(feature: str, table, lo: int, hi: int) -> None:
    if lo < 0 or hi >= table.num_embeddings:
        raise IndexError(f"feature {feature!r}: id {lo if lo < 0 else hi} out of range [0, {table.num_embeddings}) "
                         f"of table {table.name!r}")


def _on_one_device(parts: list[Tensor]) -> list[Tensor]:
    """The parts on one device: where some are on a GPU (features given on different devices),
    all of them there."""
    dev = next((p.device for p in parts if p.device.type != "cpu"), None)
    return parts if dev is None else [to_device(p, dev) for p in parts]


def _cat(parts: list[Tensor]) -> Tensor:
    """torch.cat, by numpy on the host (one thread: torch's intra-op threads cost more there),
    unless a part needs its gradient (per-sample weights that require grad) or numpy has no such
    type (bfloat16)."""
    if all(p.device.type == "cpu" and not p.requires_grad and p.dtype != torch.bfloat16 for p in parts):
        return torch.from_numpy(np.concatenate([p.numpy() for p in parts]))
    return torch.cat(parts)
