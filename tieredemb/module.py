"""TieredEmbeddingBag / TieredEmbedding: drop-in torch.nn.EmbeddingBag / torch.nn.Embedding
whose rows live in tiers. The nn.Module face only: input checks and the public methods; a
lookup's flow is lookup.py, the tiers tiers/, saving and restoring persistence.py."""

from __future__ import annotations

import copy
import dataclasses
import functools
import weakref

import numpy as np
import torch
from torch import Tensor, nn

from . import lookup
from .config import TableConfig
from .keyed import check_starts
from .persistence import Persistence, restored_step
from .loader import single_module_inputs
from .prefetch import Prefetcher
from .tiers import TableStore

_MODES = {"sum": 0, "mean": 1, "max": 2}
_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(TableConfig))


def _make_config(num_embeddings, embedding_dim, padding_idx, options: dict) -> TableConfig:
    """The TableConfig of a module built from arguments: num_embeddings may already be one (then
    nothing else that TableConfig holds may be given)."""
    if "ssd_options" in options:  # the name the modules have always taken
        options["ssd"] = options.pop("ssd_options")
    unknown = sorted(set(options) - set(_CONFIG_FIELDS))
    if unknown:
        raise TypeError(f"unknown argument{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                        f"the table's arguments are: {', '.join(_CONFIG_FIELDS[2:])}, ssd_options")
    if isinstance(num_embeddings, TableConfig):
        given = [k for k, v in (("embedding_dim", embedding_dim), ("padding_idx", padding_idx)) if v is not None]
        if given or options:
            raise TypeError(f"a TableConfig holds the whole table; do not also pass {', '.join(given + sorted(options))}")
        return num_embeddings
    if embedding_dim is None:
        raise TypeError("embedding_dim is required (or pass a TableConfig as the first argument)")
    return TableConfig(num_embeddings, embedding_dim, padding_idx=padding_idx, **options)


def _pretrained_dtype(embeddings: Tensor, table_args: dict) -> None:
    """from_pretrained's dtype when none is given: 16-bit embeddings' own (torch keeps a half
    weight half); any other dtype's table is float32."""
    if embeddings.dtype in (torch.float16, torch.bfloat16):
        table_args.setdefault("dtype", embeddings.dtype)


_UNTRACED: dict = {}  # "module:Class.method" -> the method eager_when_compiled decorated


@torch.fx.wrap
def _untraced(module, method: str, *args, **kwargs):
    """module's method (named "module:Class.method"), run: a leaf of torch.fx's symbolic tracing, which
    records this call as one node (torchrec traces models so, e.g. in its train pipelines)."""
    return _UNTRACED[method](module, *args, **kwargs)


def eager_when_compiled(method):
    """method, run eagerly where a model is traced: a graph break where torch.compile traces a call
    of it, one node where torch.fx does. A lookup's host work (numpy, native calls, lengths read
    to the host) is not for tracing. torch.compiler.disable is applied there, not here: applied
    when the class is made, it would import torch._dynamo (a second or more)."""
    name = f"{method.__module__}:{method.__qualname__}"
    _UNTRACED[name] = method

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return torch.compiler.disable(method)(self, *args, **kwargs)
        return _untraced(self, name, *args, **kwargs)
    return call


def _torch_args(max_norm, scale_grad_by_freq) -> None:
    """torch's arguments that a tiered table takes at their defaults only. (norm_type matters only
    with max_norm; sparse only says how torch hands out the gradient: the rows here are updated by
    the fused optimizer in backward either way. Both are accepted and have no effect.)"""
    if max_norm is not None:
        raise ValueError(f"max_norm={max_norm!r} is not supported: torch renormalizes every looked-up row in "
                         "place at each lookup; a tiered table's rows change only by its optimizer (leave it None)")
    if scale_grad_by_freq:
        raise ValueError(f"scale_grad_by_freq={scale_grad_by_freq!r} is not supported (leave it False)")


class _TieredBase(Persistence, nn.Module):
    def __init__(self, config: TableConfig, _weight: Tensor | None):
        super().__init__()
        self.config = config
        # A zero-size parameter that makes autograd call our backward (the rows themselves are
        # not parameters: they live in the tiers and are updated by the fused optimizer). On the
        # table's device, where code that asks a module's parameters for its device looks.
        self._grad_anchor = nn.Parameter(torch.empty(0, device=config.device))
        if _weight is not None:  # (checked before the store is opened: an SSD table refused here is not made)
            _weight = torch.as_tensor(_weight)
            if tuple(_weight.shape) != (config.num_embeddings, config.embedding_dim):
                raise ValueError(f"_weight has shape {tuple(_weight.shape)}, expected "
                                 f"({config.num_embeddings}, {config.embedding_dim})")
            if not _weight.dtype.is_floating_point:
                raise TypeError(f"_weight must be floating point, got {_weight.dtype}")
        self._store = TableStore.from_config(config)
        self.step = restored_step(self._store, config.ssd_path)
        self._prefetch = Prefetcher(self._store)
        # (dropped without close(); not at exit, where the module may still train: prefetch.py stops workers then)
        weakref.finalize(self, Prefetcher.stop_soon, self._prefetch).atexit = False
        self._closed = False
        if _weight is not None:
            self.write_rows(torch.arange(config.num_embeddings), _weight.detach())

    _tables = None  # a collection's group engine: its tables' names (errors name them)

    # -- where a torch module's habits do not fit: said, not silently done ------------------------
    def __getattr__(self, name: str):
        if name == "weight":
            raise AttributeError(f"{self.described()} has no weight tensor: its rows live in tiers. Read and set "
                                 "them with read_rows() / write_rows(); state_dict() holds them as 'weight'")
        return super().__getattr__(name)

    def __setattr__(self, name: str, value) -> None:
        if name == "weight":
            raise AttributeError(f"{self.described()} cannot take a weight tensor: its rows live in tiers. Set "
                                 "them with write_rows(ids, values) or load_state_dict({'weight': ...})")
        super().__setattr__(name, value)

    def _apply(self, fn, recurse: bool = True):
        """.to(), .cuda(), .half() and the like: refused where they would change the dtype or device
        (the rows stay where and as the table keeps them; its output would not follow)."""
        anchor = self._grad_anchor
        probe = fn(anchor.detach())
        if probe.device != anchor.device or probe.dtype != anchor.dtype:
            change = f"moved to {probe.device}" if probe.device != anchor.device else f"converted to {probe.dtype}"
            raise RuntimeError(f"{self.described()} cannot be {change}: its rows stay on {anchor.device} as "
                               f"{self.config.dtype}, its output is {anchor.dtype} (give device= and dtype= when "
                               "building the table; a model's modules before it were converted already)")
        return super()._apply(fn, recurse)

    def __reduce_ex__(self, protocol):
        raise TypeError(f"{self.described()} cannot be pickled or copied (copy.deepcopy, torch.save of the "
                        "module): its rows live in tiers, which a copy could neither share nor duplicate. Save "
                        "state_dict() or export_rows() (an SSD table: flush() or checkpoint()) and build a new one")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def set_learning_rate(self, lr: float) -> None:
        """The optimizer's learning rate from the next backward on (as FBGEMM's TBE's: an LR
        schedule calls it every step; its other settings stay). A table stored on SSD reopens only
        with the optimizer it was made with, its first rate: set the rate again after."""
        if self.config.optimizer is None:
            raise RuntimeError(f"{self.described()} has no optimizer: its learning rate cannot be set")
        optimizer = dataclasses.replace(self.config.optimizer, lr=lr)  # (the rate checked there)
        config = copy.copy(self.config)  # (the rest checked already: dataclasses.replace would take ~0.1 ms)
        object.__setattr__(config, "optimizer", optimizer)
        self.config = config

    def get_learning_rate(self) -> float:
        """The optimizer's learning rate (FBGEMM's TBE's name)."""
        if self.config.optimizer is None:
            raise RuntimeError(f"{self.described()} has no optimizer")
        return self.config.optimizer.lr

    def described(self) -> str:
        """The module as errors name it."""
        return type(self).__name__ + ("" if self._tables is None else f" of tables {self._tables}")

    # The config's fields, read as the module's attributes (as torch's modules have them).
    num_embeddings = property(lambda self: self.config.num_embeddings)
    embedding_dim = property(lambda self: self.config.embedding_dim)
    padding_idx = property(lambda self: self.config.padding_idx)
    optimizer = property(lambda self: self.config.optimizer)
    cache_rows = property(lambda self: self.config.cache_rows)
    host_rows = property(lambda self: self.config.host_rows)
    ssd_path = property(lambda self: self.config.ssd_path)
    policy = property(lambda self: self.config.policy)
    seed = property(lambda self: self.config.seed)
    device = property(lambda self: self.config.device)
    width = property(lambda self: self.config.width)
    layout = property(lambda self: self.config.layout)

    def _on_device(self, t: Tensor) -> bool:
        """Whether t is on the GPU that tier 0's rows are on (its checks are then made there)."""
        return t.device.type != "cpu" and t.device == self._store.tier0.pool.device

    # -- rows ---------------------------------------------------------------------------------
    def _check_ids(self, ids) -> Tensor:
        ids = torch.as_tensor(ids)
        if ids.numel() == 0 and ids.dtype.is_floating_point:
            ids = ids.to(torch.int64)  # (no ids: torch.as_tensor([]) is float32)
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"ids must be an integer tensor, got {ids.dtype}")
        return ids.reshape(-1).to(torch.int64)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{self.described()} is closed (close() let its store go): {what}")

    def read_rows(self, ids) -> Tensor:
        """ids: int [n]. Returns float32 [n, D] (CPU): current values wherever the rows live
        (16-bit weights converted exactly)."""
        self._check_open("its rows are read where it is reopened")
        return self.layout.weights(self._store.read(self._check_ids(ids)))

    def read_optimizer_state(self, ids) -> Tensor:
        """ids: int [n]. Returns float32 [n, S]: the optimizer state stored with each row."""
        self._check_open("its rows are read where it is reopened")
        return self.layout.state(self._store.read(self._check_ids(ids)))

    def write_rows(self, ids, values: Tensor, optimizer_state: Tensor | None = None) -> None:
        """Sets rows: ids int [n] unique; values [n, D] (rounded to the nearest value of the table's
        dtype); optimizer_state [n, S] (kept if None)."""
        self._check_open("a row written now would be lost")
        ids = self._check_ids(ids)
        values = torch.as_tensor(values)
        if tuple(values.shape) != (len(ids), self.embedding_dim):
            raise ValueError(f"values has shape {tuple(values.shape)}, expected ({len(ids)}, {self.embedding_dim})")
        if not values.dtype.is_floating_point:
            raise TypeError(f"values must be floating point, got {values.dtype}")
        state_w = self.layout.state_width
        optimizer_state = None if optimizer_state is None else torch.as_tensor(optimizer_state)
        if optimizer_state is not None and tuple(optimizer_state.shape) != (len(ids), state_w):
            raise ValueError(f"optimizer_state has shape {tuple(optimizer_state.shape)}, expected ({len(ids)}, {state_w})")
        if len(torch.unique(ids)) != len(ids):
            raise ValueError("write_rows ids must be unique")
        rows = self._store.read(ids)  # validates the range before anything changes
        self.layout.set_weights(rows, values.detach().cpu())
        if optimizer_state is not None:
            self.layout.state(rows)[:] = optimizer_state.detach().cpu().to(torch.float32)
        self._store.write(ids, rows)

    def close(self) -> None:
        """Flushes and lets the backing store go (its files and the SSD directory's lock); the table
        takes no more lookups after, and stats() still answers. The tiers' memory goes when the
        module is collected. A flush that fails is raised, and the store is let go all the same;
        a second close does nothing (the first let everything go: there is nothing to try again)."""
        if self._closed:
            return
        self._prefetch.close()
        try:
            self.flush()
        finally:
            try:
                self._store.close()
            finally:
                self._closed = True

    def _prefetchers(self) -> list:
        return [self._prefetch]

    def _inputs_of(self, batch) -> tuple:
        """What forward takes, from a loader's batch (PrefetchLoader without ids_fn)."""
        return single_module_inputs(self, batch)

    @property
    def prefetch_lookahead(self) -> int:
        """How many batches registered after a prefetched batch its residency waits for, and
        plans its evictions with (rows they use are kept; the farthest next use goes first).
        0 (default): a registered batch is made resident at once. Set while none is registered."""
        return self._prefetch.lookahead

    @prefetch_lookahead.setter
    def prefetch_lookahead(self, k: int) -> None:
        self._prefetch.set_lookahead(k)

    def stats(self) -> dict:
        """Per tier ("tier0", "host"): hits, misses, writes, evictions, dirty_writebacks,
        clean_drops, overflow_rows, bytes moved, hit_rate; the backing store's counters ("store"
        in host memory, "ssd"); under "prefetch": rows forwards found prefetched vs read
        themselves, and time waited (see Prefetcher.stats)."""
        return {**self._store.stats(), "prefetch": self._prefetch.stats()}

    def reset_stats(self) -> None:
        self._store.reset_stats()
        self._prefetch.reset_stats()

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if hasattr(self, "mode"):
            s += f", mode={self.mode!r}" + (", include_last_offset=True" if self.include_last_offset else "")
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        return s + (f", cache_rows={self.cache_rows}, host_rows={self.host_rows}, policy={self.policy!r}, "
                    f"optimizer={self.optimizer}")


def _check_int_tensor(name: str, t) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of integer ids, got {type(t).__name__}")
    if t.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"{name} must have an integer dtype (int64, int32, int16, int8 or uint8), got {t.dtype}")
    return t


_TABLE_ARGS = """The table's arguments (see TableConfig, which they build; or pass a TableConfig as
    the first argument): cache_rows (tier 0's rows or bytes; None: the whole table), host_rows
    (the host cache; None: none), ssd_path (the SSD store's directory; None: host memory),
    ssd_options (its backend and settings), policy ('lru', 'lfu', 'clock'), optimizer (fused:
    SGD, Adagrad, RowWiseAdagrad, MomentumScaledRowWiseAdagrad, Adam; None: inference only),
    init and seed (rows never written), device ('cpu' or 'cuda'), dtype (float32)."""


class TieredEmbeddingBag(_TieredBase):
    __doc__ = f"""torch.nn.EmbeddingBag whose rows live in tiers (tier 0 cache, host cache, backing
    store). mode 'sum', 'mean' or 'max'; padding_idx and include_last_offset as torch's.

    {_TABLE_ARGS}"""

    def __init__(self, num_embeddings: int | TableConfig, embedding_dim: int | None = None, mode: str = "mean", *,
                 padding_idx: int | None = None, include_last_offset: bool = False, _weight: Tensor | None = None,
                 max_norm=None, norm_type: float = 2.0, scale_grad_by_freq: bool = False, sparse: bool = False,
                 **table_args):
        if not isinstance(mode, str) or mode not in _MODES:
            raise ValueError(f"mode {mode!r} is not one of 'sum', 'mean', 'max' (mode is the third positional "
                             "argument here; torch's is max_norm, which tiered tables do not support)")
        _torch_args(max_norm, scale_grad_by_freq)
        self.mode = mode
        self.include_last_offset = include_last_offset
        super().__init__(_make_config(num_embeddings, embedding_dim, padding_idx, table_args), _weight)

    @classmethod
    def from_pretrained(cls, embeddings: Tensor, freeze: bool = True, mode: str = "mean", padding_idx=None,
                        include_last_offset: bool = False, **table_args) -> "TieredEmbeddingBag":
        """Like torch.nn.EmbeddingBag.from_pretrained (but mode is the third positional argument);
        table_args as the constructor's (dtype: float16 or bfloat16 embeddings' own by default, as
        torch keeps them; else float32)."""
        if embeddings.dim() != 2:
            raise ValueError(f"embeddings must be 2-D, got shape {tuple(embeddings.shape)}")
        _pretrained_dtype(embeddings, table_args)
        m = cls(embeddings.shape[0], embeddings.shape[1], mode, padding_idx=padding_idx,
                include_last_offset=include_last_offset, _weight=embeddings, **table_args)
        m._grad_anchor.requires_grad_(not freeze)
        return m

    @eager_when_compiled
    def forward(self, input: Tensor, offsets: Tensor | None = None, per_sample_weights: Tensor | None = None) -> Tensor:
        """input: int [N] ids with offsets int [B] bag starts (B + 1 with include_last_offset),
        or int [B, L] with offsets None. per_sample_weights: float, input's shape, mode 'sum'.
        Returns [B, D]."""
        # (a batch prefetched as these very tensors was checked then: its ids and boundaries, as is)
        flat, offsets_full, check = self._prefetch.registered((input, offsets)) or self._bags(input, offsets)
        psw = None
        if per_sample_weights is not None:
            if self.mode != "sum":
                raise ValueError(f"per_sample_weights is only supported with mode='sum', this bag has mode={self.mode!r}")
            if not isinstance(per_sample_weights, Tensor) or not per_sample_weights.dtype.is_floating_point:
                raise TypeError("per_sample_weights must be a floating point tensor")
            if per_sample_weights.shape != input.shape:
                raise ValueError(f"per_sample_weights has shape {tuple(per_sample_weights.shape)}, "
                                 f"expected input's shape {tuple(input.shape)}")
            psw = per_sample_weights.reshape(-1)[:len(flat)]
        out = lookup.pooled(self, flat, offsets_full, psw, _MODES[self.mode], exclude_padding=True, check=check,
                            source=(input, offsets))
        return out.to(per_sample_weights.dtype) if psw is not None and psw.dtype != out.dtype else out

    def prefetch(self, input: Tensor, offsets: Tensor | None = None) -> None:
        """Registers a future batch (forward's input and offsets): its rows are made resident in
        tier 0 by a background worker and stay pinned until that batch's backward. Forwards of
        registered batches must come in registration order. Bad host ids and offsets raise here;
        bad ids or offsets on the GPU are checked there, without a wait here, and raise at the
        next call (that batch's forward, or a later prefetch). Nothing changes either way."""
        self._prefetch.register(*self._bags(input, offsets), source=(input, offsets))

    @staticmethod
    def forward_inputs(input: Tensor) -> int:
        """How many tensors forward takes with this input: 2 (ids, offsets) for 1-D ids, else 1."""
        return 2 if input.dim() == 1 else 1

    def _bags(self, input: Tensor, offsets: Tensor | None) -> tuple[Tensor, Tensor, object]:
        """forward's (input, offsets), checked -> (ids [N], bag boundaries int64 [B + 1], the
        verdict on device inputs or None). Host offsets are checked here. Ids and offsets both on
        tier 0's GPU are checked there, without a wait (gpu/checks.py): the boundaries are then on
        the GPU (with include_last_offset, B + 2 of them: the ids after the last bag stay, in an
        added empty bag), and the verdict is read where the batch's residency waits for the
        device anyway. (Other device ids are checked by tier 0's dedup, in the same way.)"""
        _check_int_tensor("input", input)
        if input.dim() == 2:
            if offsets is not None:
                raise ValueError("offsets must be None when input is 2-D [B, L] (each row is a bag)")
            bags, length = input.shape
            if length == 0:
                raise ValueError(f"input of shape {tuple(input.shape)}: a 2-D input's bags (rows) need at least one "
                                 "id each (torch.nn.EmbeddingBag refuses it too)")
            if self._on_device(input):
                return input.reshape(-1), torch.arange(0, (bags + 1) * length, length, device=input.device), None
            return input.reshape(-1), torch.from_numpy(np.arange(0, (bags + 1) * length, length, dtype=np.int64)[:bags + 1]), None
        if input.dim() == 1:
            if offsets is None:
                raise ValueError("offsets is required when input is 1-D (bag starts, int [B])")
            _check_int_tensor("offsets", offsets)
            if offsets.dim() != 1:
                raise ValueError(f"offsets must be 1-D, got shape {tuple(offsets.shape)}")
            if len(offsets) and self._on_device(input) and self._on_device(offsets):
                from .gpu.checks import check_on_device

                return check_on_device(input, offsets, self.num_embeddings, self.include_last_offset)
            bounds, end = self._normalize_offsets(offsets.to("cpu", torch.int64), len(input))
            # (with include_last_offset, ids after the last bag's end belong to no bag: left out in every mode, as
            # torch's sum does; README)
            return input if end == len(input) else input[:end], bounds, None
        raise ValueError(f"input must be 1-D (with offsets) or 2-D [B, L], got shape {tuple(input.shape)}")

    def _normalize_offsets(self, offsets: Tensor, n: int) -> tuple[Tensor, int]:
        """torch's offsets (int64, on the host) over n ids -> ([B + 1] bag boundaries, the last
        one), checked. In numpy: torch's intra-op threads cost milliseconds per call on a busy
        machine for these few element-wise ops."""
        if len(offsets) == 0:
            if self.include_last_offset:
                raise ValueError("offsets must not be empty with include_last_offset=True")
            return torch.zeros(1, dtype=torch.int64), 0
        o = offsets.numpy()
        check_starts(o, n)
        if self.include_last_offset:
            return offsets.contiguous(), int(o[-1])
        bounds = np.empty(len(o) + 1, dtype=np.int64)
        bounds[:-1] = o
        bounds[-1] = n
        return torch.from_numpy(bounds), n


class TieredEmbedding(_TieredBase):
    __doc__ = f"""torch.nn.Embedding whose rows live in tiers; padding_idx as torch's.

    {_TABLE_ARGS}"""

    def __init__(self, num_embeddings: int | TableConfig, embedding_dim: int | None = None,
                 padding_idx: int | None = None, max_norm=None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, sparse: bool = False, _weight: Tensor | None = None,
                 _freeze: bool = False, **table_args):
        _torch_args(max_norm, scale_grad_by_freq)
        super().__init__(_make_config(num_embeddings, embedding_dim, padding_idx, table_args), _weight)
        self._grad_anchor.requires_grad_(not _freeze)

    @classmethod
    def from_pretrained(cls, embeddings: Tensor, freeze: bool = True, padding_idx=None,
                        **table_args) -> "TieredEmbedding":
        """Like torch.nn.Embedding.from_pretrained; table_args as the constructor's (dtype: as
        TieredEmbeddingBag.from_pretrained's)."""
        if embeddings.dim() != 2:
            raise ValueError(f"embeddings must be 2-D, got shape {tuple(embeddings.shape)}")
        _pretrained_dtype(embeddings, table_args)
        return cls(embeddings.shape[0], embeddings.shape[1], padding_idx=padding_idx, _weight=embeddings,
                   _freeze=freeze, **table_args)

    @eager_when_compiled
    def forward(self, input: Tensor) -> Tensor:
        """input: int ids of any shape [*]. Returns [*, D]."""
        ids, bounds = (self._prefetch.registered((input,)) or self._bags(input))[:2]
        out = lookup.pooled(self, ids, bounds, None, _MODES["sum"], exclude_padding=False, source=(input,))
        return out.reshape(*input.shape, self.embedding_dim)

    def prefetch(self, input: Tensor) -> None:
        """Registers a future batch (forward's input): see TieredEmbeddingBag.prefetch."""
        self._prefetch.register(*self._bags(input), source=(input,))

    @staticmethod
    def forward_inputs(input: Tensor) -> int:
        """How many tensors forward takes: 1 (the ids)."""
        return 1

    def _bags(self, input: Tensor) -> tuple[Tensor, Tensor]:
        """ids of any shape -> (ids [N], one bag per id: boundaries [N + 1], on tier 0's GPU if
        the ids are)."""
        _check_int_tensor("input", input)
        flat = input.reshape(-1)
        if self._on_device(flat):
            return flat, torch.arange(len(flat) + 1, device=flat.device)
        return flat, torch.from_numpy(np.arange(len(flat) + 1, dtype=np.int64))
