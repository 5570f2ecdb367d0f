"""Configuration of a table: TableConfig (frozen), Init, and sizes like '512MiB'; a collection's
tables: EmbeddingBagConfig and EmbeddingConfig (TorchRec's names).

    cfg = tieredemb.TableConfig(10**8, 128, cache_rows="4GiB", host_rows="32GiB",
                                ssd_path="/nvme/t", ssd=tieredemb.LogOptions(),
                                optimizer=tieredemb.RowWiseAdagrad(lr=0.01))
    emb = tieredemb.TieredEmbeddingBag(cfg, mode="sum")

The modules' keyword arguments build the same object; every value is checked once, here, with an
error that names the value and the rule.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
import re
from fractions import Fraction

import torch

from ssd_backend import detect_backend
from ssd_backend.options import DEFAULT_BACKEND, LogOptions, RocksDBOptions, SlotOptions, StoreOptions, parse_options

from .optim import WEIGHT_TYPES, Optimizer, RowLayout

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

POLICIES = ("lru", "lfu", "clock")
__all__ = ["TableConfig", "Init", "parse_bytes", "parse_rows", "POLICIES",
           "RocksDBOptions", "LogOptions", "SlotOptions", "StoreOptions"]


def parse_bytes(text: str) -> int:
    """'512MiB' -> 536870912, '1.3GiB' -> 1395864371: whole bytes, a fraction of one dropped
    (exact: no float on the way, which moved sizes past 2**53). Raises ValueError naming the text
    for anything else, and TypeError for what is not a str."""
    if not isinstance(text, str):
        raise TypeError(f"a size must be a str like '512MiB', got {type(text).__name__} {text!r}")
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"size {text!r} is not a number of bytes like '512MiB', '4GB' or '1048576'")
    return math.floor(Fraction(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_budget(name: str, value) -> int | None:
    """A tier's budget in bytes: a size ('8GiB') or an int >= 1; None stays None. Errors name
    the argument and the value."""
    if value is None:
        return None
    if isinstance(value, str):
        value = parse_bytes(value)
    elif isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a size like '8GiB' or a number of bytes, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1 byte, got {value!r}")
    return int(value)


def whole(v) -> int | None:
    """v as a Python int where it is an integer (Python's, numpy's, a 0-d integer tensor's: not a
    bool), else None."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) and not (
            isinstance(v, torch.Tensor) and v.ndim == 0 and not v.dtype.is_floating_point and not v.dtype.is_complex
            and v.dtype != torch.bool):
        return None
    return int(v)


def parse_rows(name: str, value: int | str | None, row_bytes: int) -> int | None:
    """A tier capacity given in rows (int) or bytes ('512MiB') -> rows; None stays None."""
    if value is None:
        return None
    rows = whole(value)
    if rows is None and not isinstance(value, str):
        raise TypeError(f"{name} must be a number of rows or a size like '512MiB', got {value!r}")
    if rows is None:
        rows = parse_bytes(value) // row_bytes
    if rows <= 0:
        raise ValueError(f"{name} must hold at least one row, got {value!r}")
    return rows


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@dataclasses.dataclass(frozen=True)
class Init:
    """How rows never written start: a function of (seed, row id) only.

    kind 'normal' (a = mean, b = std; torch's default for embeddings is normal(0, 1)),
    'uniform' (a = low, b = high) or 'zeros'. The padding row always starts at zero."""

    kind: str = "normal"
    a: float = 0.0
    b: float = 1.0

    def __post_init__(self):
        if self.kind not in ("normal", "uniform", "zeros"):
            raise ValueError(f"init kind {self.kind!r} is not one of 'normal', 'uniform', 'zeros'")
        for name, v in (("a", self.a), ("b", self.b)):
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) \
                    or abs(v) > _FLOAT32_MAX:
                raise ValueError(f"init {self.kind!r}: {name}={v!r} must be a finite real number float32 holds "
                                 f"(|{name}| <= {_FLOAT32_MAX:.8g})")
            object.__setattr__(self, name, float(v))  # (a numpy number as a float: a table's meta is JSON)
        if self.kind == "normal" and self.b < 0:
            raise ValueError(f"init 'normal': b={self.b!r} (the std) must be >= 0")
        if self.kind == "uniform" and self.a > self.b:
            raise ValueError(f"init 'uniform': a={self.a!r} (low) must be <= b={self.b!r} (high)")

    @property
    def code(self) -> int:
        return ("normal", "uniform", "zeros").index(self.kind)


def check_weight_dtype(dtype, where: str = "") -> None:
    """ValueError (its message starting with where) unless dtype is a weights' dtype."""
    if dtype not in WEIGHT_TYPES:
        raise ValueError(f"{where}dtype {dtype!r} is not supported: use torch.float32, torch.float16 or torch.bfloat16")


def _positive_int(name: str, v) -> int:
    n = whole(v)
    if n is None or n <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return n


def _check_partitions(partitions, num_embeddings: int, cache_rows) -> tuple:
    try:
        parts = tuple((int(r), int(c)) for r, c in partitions)
    except (TypeError, ValueError):
        raise TypeError(f"partitions must be ((rows, tier-0 rows), ...), got {partitions!r}") from None
    if not parts:
        raise ValueError("partitions is empty: give ((rows, tier-0 rows), ...), or None")
    for k, (rows, cap) in enumerate(parts):
        if rows <= 0 or not 1 <= cap <= rows:
            raise ValueError(f"partition {k}: ({rows}, {cap}) must have rows >= 1 and tier-0 rows from 1 to the rows")
    total = sum(r for r, _ in parts)
    if total != num_embeddings:
        raise ValueError(f"partitions cover {total} rows, not num_embeddings={num_embeddings}")
    if cache_rows is not None and cache_rows != sum(c for _, c in parts):
        raise ValueError(f"cache_rows {cache_rows} differs from the partitions' {sum(c for _, c in parts)} tier-0 rows: "
                         "give one of them")
    return parts


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """One table: its shape, its tiers and how rows start, train and are stored.

    num_embeddings, embedding_dim: the table is [num_embeddings, embedding_dim].
    cache_rows: tier 0's capacity, in rows or bytes ('512MiB', counting the optimizer state);
        None: tier 0 holds the whole table. A batch may use more distinct rows than this: the
        rows that do not fit are served from overflow slots (see README, Tiers).
    host_rows: the host cache's capacity (rows or bytes), at least tier 0's; None: no host cache.
    partitions: tier 0 split by id range, ((rows, tier-0 rows), ...) in id order: the first
        partition holds ids [0, rows_0) in tier-0 rows of its own, the next the following rows_1
        ids, and so on (the rows sum to num_embeddings; tier-0 rows from 1 to the rows). Each
        partition evicts only its own rows: a collection's tables each get their share (see
        tieredemb.planner). cache_rows is then the sum of the tier-0 rows (None or equal to it).
    ssd_path: a directory for the SSD store (the backing store); None: host memory.
    ssd: the SSD backend and its settings (RocksDBOptions, LogOptions, SlotOptions, or the dict
        {"backend": name, **settings}); None: the backend the directory holds, else RocksDB.
    policy: eviction policy of the cache tiers: 'lru', 'lfu' or 'clock'.
    optimizer: the fused optimizer (SGD, Adagrad, RowWiseAdagrad, MomentumScaledRowWiseAdagrad,
        Adam); None: inference only.
    init, seed: rows never written read as init's draw for (seed, row id).
    padding_idx: a row that starts at zero and is never updated (torch's padding_idx).
    device: where tier 0 lives: 'cpu' or 'cuda[:k]' (None: torch's default device).
    dtype: the weights' dtype in every tier: float32, float16 or bfloat16 (half the bytes moved and
        stored); the optimizer state stays float32, and the math is float32 (pooled outputs too).
    stochastic_rounding: with a 16-bit dtype, the updated weights are rounded stochastically
        (unbiased; deterministic: a function of seed, row id, step and column) instead of to the
        nearest.
    zero_copy: on cuda, with the rows in host memory right below tier 0 (no ssd_path, no host
        cache, cache_rows below num_embeddings), the GPU reads tier 0's misses straight from the
        host rows and writes its dirty victims straight into them (as FBGEMM's UVM table is read):
        the host rows are pinned and mapped into the GPU when the table is made, so they must fit
        in host memory; the GPU keeps one byte per row saying whether it was ever written, and
        tier 0 as many overflow slots as the batches in flight have ids (so a batch is made
        resident with no wait). Off by default.
    cuda_graphs: on cuda, with tier 0 holding the whole table (cache_rows None), lookups of a batch
        shape seen before replay CUDA graphs of their forward and backward instead of launching
        each kernel from Python (gpu/graphed.py says which lookups). The same results, bit for
        bit. On by default; False: every lookup launches its kernels one by one.
    row_alignment: bytes every stored row is padded to a whole number of, with zero words after
        the optimizer's state, in every tier (and stored so: reopening a store needs the same): a
        power of two from 4 (no padding) to 4096. 128 starts each row on a GPU cache line, where
        zero_copy's kernels read and write host rows over the bus fastest (on an H100, 20K rows
        swapped both ways: 340-358 us as rows of 160 words, 415-439 us as rows of 129); the
        moves leave the pad words out. The weights and the optimizer's state, and so training,
        are the same whatever the alignment.

    Sizes given in bytes are resolved to rows, and ssd_options dicts to typed options, when the
    config is made: the fields then read as rows and StoreOptions.
    """

    num_embeddings: int
    embedding_dim: int
    cache_rows: int | str | None = None
    host_rows: int | str | None = None
    partitions: tuple[tuple[int, int], ...] | None = None
    ssd_path: str | None = None
    ssd: StoreOptions | dict | None = None
    policy: str = "lru"
    optimizer: Optimizer | None = None
    init: Init = Init()
    seed: int = 0
    padding_idx: int | None = None
    device: torch.device | str | None = "cpu"
    dtype: torch.dtype = torch.float32
    stochastic_rounding: bool = False
    zero_copy: bool = False
    cuda_graphs: bool = True
    row_alignment: int = 4

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        set_("num_embeddings", _positive_int("num_embeddings", self.num_embeddings))
        set_("embedding_dim", _positive_int("embedding_dim", self.embedding_dim))
        n = self.num_embeddings
        if self.padding_idx is not None:
            pad = whole(self.padding_idx)
            if pad is None:
                raise ValueError(f"padding_idx {self.padding_idx!r} must be an int in [{-n}, {n})")
            if not -n <= pad < n:
                raise ValueError(f"padding_idx {self.padding_idx!r} out of range [{-n}, {n})")
            set_("padding_idx", pad % n)
        check_weight_dtype(self.dtype)
        if not isinstance(self.stochastic_rounding, bool):
            raise TypeError(f"stochastic_rounding must be a bool, got {self.stochastic_rounding!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r} is not one of {POLICIES}")
        if self.optimizer is not None and not isinstance(self.optimizer, Optimizer):
            raise TypeError("optimizer must be a tieredemb optimizer (SGD, Adagrad, RowWiseAdagrad, "
                            f"MomentumScaledRowWiseAdagrad, Adam), got {type(self.optimizer).__name__}")
        if not isinstance(self.init, Init):
            raise TypeError(f"init must be a tieredemb.Init, got {type(self.init).__name__}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be an int in [0, 2**64), got {self.seed!r}")
        # (None: torch's default device, as torch's modules take it)
        device = torch.get_default_device() if self.device is None else torch.device(self.device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device {device} is not supported: use 'cpu' or 'cuda'")
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            # the GPU current now, as torch's modules take it: a bare "cuda" would name whichever
            # GPU is current on the calling thread at each later use (its streams, its waits)
            device = torch.device("cuda", torch.cuda.current_device())
        set_("device", device)
        a = self.row_alignment
        if isinstance(a, bool) or not isinstance(a, int) or not 4 <= a <= 4096 or a & (a - 1):
            raise ValueError(f"row_alignment must be a power of two from 4 to 4096 (bytes a row is padded to a whole "
                             f"number of), got {a!r}")
        row_bytes = self.width * 4
        set_("cache_rows", parse_rows("cache_rows", self.cache_rows, row_bytes))
        set_("host_rows", parse_rows("host_rows", self.host_rows, row_bytes))
        if self.partitions is not None:
            set_("partitions", _check_partitions(self.partitions, n, self.cache_rows))
            set_("cache_rows", sum(c for _, c in self.partitions))
        tier0 = self.tier0_rows
        if not isinstance(self.cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be a bool, got {self.cuda_graphs!r}")
        if not isinstance(self.zero_copy, bool):
            raise TypeError(f"zero_copy must be a bool, got {self.zero_copy!r}")
        host_cache = self.host_rows is not None and self.host_rows < n
        if self.zero_copy and (device.type != "cuda" or self.ssd_path is not None or host_cache or tier0 >= n):
            raise ValueError(f"zero_copy=True with device={str(device)!r}, cache_rows={self.cache_rows!r}, ssd_path="
                             f"{self.ssd_path!r}, host_rows={self.host_rows!r}: zero_copy is for a cuda tier 0 smaller "
                             "than the table, right above its rows in host memory (device 'cuda', cache_rows < "
                             "num_embeddings, no ssd_path, no host cache)")
        if self.host_rows is not None and self.host_rows < tier0:
            raise ValueError(f"host_rows {self.host_rows} < the {tier0} rows of tier 0 (cache_rows="
                             f"{self.cache_rows!r}): the host cache must be at least as large as tier 0")
        if self.ssd_path is None:
            if self.ssd is not None:
                raise ValueError("ssd options were given without ssd_path: give the SSD store a directory")
        else:
            set_("ssd_path", os.fspath(self.ssd_path))
            set_("ssd", parse_options(self.ssd, detect_backend(self.ssd_path) or DEFAULT_BACKEND))
            if self.dtype != torch.float32 and self.ssd is not None and self.ssd.storage_dtype != torch.float32:
                raise ValueError(f"storage_dtype {self.ssd.storage_dtype} with dtype {self.dtype}: the rows' weights are "
                                 "already 16-bit; storage_dtype must stay torch.float32 (the store keeps rows as they are)")
            state = self.optimizer.state_width(self.embedding_dim) if self.optimizer else 0
            if self.ssd is not None and self.ssd.storage_dtype != torch.float32 and state:
                raise ValueError(
                    f"storage_dtype {self.ssd.storage_dtype} with optimizer {type(self.optimizer).__name__}: the store "
                    f"casts whole rows, so the optimizer's {state} float32 state word(s) a row would be rounded to "
                    "16 bits on every eviction (Adam's second moment to 0, an Adagrad sum past 65504 to inf); "
                    "storage_dtype is for tables whose optimizer keeps no state (SGD, or none). For 16-bit weights "
                    "with float32 state give dtype=torch.float16 or torch.bfloat16 (in every tier) instead")

    @functools.cached_property  # (asked for on every lookup; the config is frozen)
    def layout(self) -> RowLayout:
        """How a stored row holds the weights and the optimizer's state."""
        values = RowLayout(self.embedding_dim, self.dtype,
                           self.optimizer.state_width(self.embedding_dim) if self.optimizer else 0)
        align = self.row_alignment // 4
        return dataclasses.replace(values, pad=-values.words % align)

    @property
    def width(self) -> int:
        """32-bit words per stored row: the weights, then the optimizer's state, then the padding."""
        return self.layout.width

    @property
    def tier0_rows(self) -> int:
        return min(self.cache_rows or self.num_embeddings, self.num_embeddings)

    def meta(self) -> dict:
        """What a stored table must match when reopened (JSON-able)."""
        pad = self.layout.pad  # (named only where there is some: tables stored before keep their meta)
        return {"num_embeddings": self.num_embeddings, "embedding_dim": self.embedding_dim, "width": self.width,
                **({"row_pad": pad} if pad else {}),
                "dtype": str(self.dtype).removeprefix("torch."), "seed": self.seed,
                "optimizer": self.optimizer.to_meta() if self.optimizer else None,
                "init": {"kind": self.init.kind, "a": self.init.a, "b": self.init.b},
                "padding_idx": self.padding_idx,
                # (it changes the arithmetic as the optimizer's settings do; named only where set, so
                # that tables stored before keep their meta)
                **({"stochastic_rounding": True} if self.stochastic_rounding and self.dtype != torch.float32 else {})}


EXPORT_MARKER = "export.json"  # (a collection's export's record, beside its tables' directories)


def _check_table(t) -> None:
    if not isinstance(t.name, str) or not t.name:
        raise TypeError(f"a table's name must be a non-empty str, got {t.name!r}")
    if t.name in (".", "..", EXPORT_MARKER, EXPORT_MARKER + ".tmp") or any(c in t.name for c in "/\\\0"):
        raise ValueError(f"table name {t.name!r}: a table's name names its directory in an export: no '/', '\\' "
                         f"or NUL, and not '.', '..' or {EXPORT_MARKER!r} (a collection's export's record)")
    for field in ("num_embeddings", "embedding_dim"):
        value = getattr(t, field)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"table {t.name!r}: {field} must be an int >= 1, got {value!r}")
        object.__setattr__(t, field, int(value))
    if isinstance(t.feature_names, str) or not all(isinstance(f, str) for f in t.feature_names):
        raise TypeError(f"table {t.name!r}: feature_names must be a list of feature names, got {t.feature_names!r}")
    object.__setattr__(t, "feature_names", list(t.feature_names))  # (a list, as torchrec's: its modules add them)
    if not t.feature_names:
        raise ValueError(f"table {t.name!r} has no features: give feature_names")
    check_weight_dtype(t.dtype, f"table {t.name!r}: ")


@dataclasses.dataclass(frozen=True)
class EmbeddingConfig:
    """One table of a TieredEmbeddingCollection: name; num_embeddings x embedding_dim; the
    features that read it (each id gets its row, unpooled); optimizer and init (None: the
    collection's); dtype of the weights."""

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...] | list[str]
    optimizer: Optimizer | None = None
    init: Init | None = None
    dtype: torch.dtype = torch.float32

    def __post_init__(self):
        _check_table(self)


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
        _check_table(self)
        if self.pooling not in ("sum", "mean"):
            raise ValueError(f"table {self.name!r}: pooling {self.pooling!r} is not 'sum' or 'mean'")


_TORCHREC_DTYPES = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}


def _init_of(t, name: str, ours: str) -> Init:
    """A torchrec config's init as an Init: its init_fn (torchrec makes one, uniform between
    weight_init_min and weight_init_max, +-sqrt(1 / num_embeddings) by default) where it is
    torch.nn.init's uniform_, normal_ or zeros_ with its arguments, or none."""
    fn = getattr(t, "init_fn", None)
    if fn is None:
        bound = math.sqrt(1 / t.num_embeddings) if t.num_embeddings > 0 else 0.0
        return Init("uniform", -bound if t.weight_init_min is None else t.weight_init_min,
                    bound if t.weight_init_max is None else t.weight_init_max)
    base, kw = (fn.func, fn.keywords) if isinstance(fn, functools.partial) and not fn.args else (fn, {})
    if base is torch.nn.init.uniform_ and set(kw) <= {"a", "b"}:
        return Init("uniform", kw.get("a", 0.0), kw.get("b", 1.0))
    if base is torch.nn.init.normal_ and set(kw) <= {"mean", "std"}:
        return Init("normal", kw.get("mean", 0.0), kw.get("std", 1.0))
    if base is torch.nn.init.zeros_ and not kw:
        return Init("zeros")
    raise ValueError(f"table {name!r}: its init_fn {fn!r} cannot be run here (rows start on first use, as a function "
                     "of the seed and the row): torch.nn.init's uniform_, normal_ or zeros_ (as a functools.partial) "
                     f"can, or give a tieredemb.{ours} with init=tieredemb.Init(...)")


def from_torchrec(t, pooled: bool):
    """A torchrec EmbeddingBagConfig (pooled) or EmbeddingConfig as ours; ours as it is. Its name,
    rows, dim, features ([name] where none), pooling and data_type carry over; its rows start
    as its init_fn draws them (_init_of), as a function of the seed and the row here, not from
    torch's generator."""
    ours = EmbeddingBagConfig if pooled else EmbeddingConfig
    if isinstance(t, (EmbeddingBagConfig, EmbeddingConfig)) or not type(t).__module__.startswith("torchrec"):
        return t  # (ours, or not a config at all: the collection's checks name it)
    name = getattr(t, "name", "?")
    data_type = getattr(getattr(t, "data_type", None), "name", "FP32")
    if data_type not in _TORCHREC_DTYPES:
        raise ValueError(f"table {name!r}: data_type {data_type} is not supported: FP32, FP16 or BF16")
    args = dict(name=name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                feature_names=list(t.feature_names) or [name], init=_init_of(t, name, ours.__name__),
                dtype=_TORCHREC_DTYPES[data_type])
    if pooled:
        pooling = getattr(getattr(t, "pooling", None), "name", "SUM")
        if pooling not in ("SUM", "MEAN"):
            raise ValueError(f"table {name!r}: pooling {pooling} is not SUM or MEAN")
        args["pooling"] = pooling.lower()
    return ours(**args)
