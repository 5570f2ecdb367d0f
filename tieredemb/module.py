"""TieredEmbeddingBag / TieredEmbedding: drop-in torch.nn.EmbeddingBag / Embedding whose rows
live in tiers. nn.Module and autograd glue only; the tiers are store.py, the math kernels.py."""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import Tensor, nn

from . import kernels
from .config import POLICIES, Init, parse_rows
from .optim import Optimizer
from .prefetch import Prefetcher
from .store import RowInit, TableStore

_MODES = {"sum": 0, "mean": 1, "max": 2}


class _Batch:
    """A batch made resident in tier 0: pinned until backward ran or the graph was freed."""

    __slots__ = ("table", "unique", "inverse", "slots", "offsets", "psw", "mode", "skip_u", "frozen_u",
                 "argmax", "grad_state", "released")

    def __init__(self, table, unique, inverse, slots, offsets, psw, mode, skip_u, frozen_u):
        self.table, self.unique, self.inverse, self.slots = table, unique, inverse, slots
        self.offsets, self.psw, self.mode = offsets, psw, mode
        self.skip_u, self.frozen_u = skip_u, frozen_u
        self.argmax = None
        self.grad_state = None
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.table._store.release(self.slots)

    def __del__(self):
        try:
            self.release()
        except Exception:
            pass


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, batch: _Batch, psw: Tensor | None, anchor: Tensor) -> Tensor:
        ctx.batch = batch
        return batch.table._pool_forward(batch)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        batch = ctx.batch
        psw_grad = batch.table._backward(batch, grad_out, need_psw_grad=ctx.needs_input_grad[1])
        return None, psw_grad, None


class _TieredBase(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, *, padding_idx: int | None, cache_rows,
                 host_rows, ssd_path, policy: str, optimizer: Optimizer | None, seed: int, device, dtype,
                 _weight: Tensor | None, init: Init | None, ssd_options: dict | None):
        super().__init__()
        for name, v in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx {padding_idx} out of range [{-num_embeddings}, {num_embeddings})")
            padding_idx = padding_idx % num_embeddings
        if dtype not in (None, torch.float32):
            raise ValueError(f"dtype {dtype} is not supported: tiers hold float32 rows "
                             "(the SSD tier can store them as float16/bfloat16)")
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is not one of {POLICIES}")
        if optimizer is not None and not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be a tieredemb optimizer (SGD, Adagrad, RowWiseAdagrad, Adam), "
                            f"got {type(optimizer).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.optimizer = optimizer
        self.seed = seed
        self.init_spec = init or Init()
        self.policy = policy
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device} is not supported: use 'cpu' or 'cuda'")
        self.width = embedding_dim + (optimizer.state_width(embedding_dim) if optimizer else 0)
        row_bytes = self.width * 4
        self.cache_rows = parse_rows("cache_rows", cache_rows, row_bytes)
        self.host_rows = parse_rows("host_rows", host_rows, row_bytes)
        tier0_rows = min(self.cache_rows or num_embeddings, num_embeddings)
        if self.host_rows is not None and self.host_rows < tier0_rows:
            raise ValueError(f"host_rows {self.host_rows} < the {tier0_rows} rows of tier 0 (cache_rows="
                             f"{cache_rows!r}): the host cache must be at least as large as tier 0")
        self.step = 0
        # A zero-size parameter that makes autograd call our backward (the rows themselves are
        # not parameters: they live in the tiers and are updated by the fused optimizer).
        self._grad_anchor = nn.Parameter(torch.empty(0))
        self._init_rows = RowInit(embedding_dim, self.init_spec.code, self.init_spec.a, self.init_spec.b, seed,
                                  -1 if padding_idx is None else padding_idx)
        backing = None
        self.ssd_path = None if ssd_path is None else os.fspath(ssd_path)
        if self.ssd_path is not None:
            backing = self._open_ssd(self.ssd_path, ssd_options or {})
            self.step = _read_step(self.ssd_path)
        self._store = TableStore(num_embeddings=num_embeddings, width=self.width, init=self._init_rows,
                                 cache_rows=self.cache_rows, host_rows=self.host_rows, backing=backing,
                                 policy=policy, device=self.device)
        self._prefetch = Prefetcher(self._store)
        if _weight is not None:
            if tuple(_weight.shape) != (num_embeddings, embedding_dim):
                raise ValueError(f"_weight has shape {tuple(_weight.shape)}, expected "
                                 f"({num_embeddings}, {embedding_dim})")
            self.write_rows(torch.arange(num_embeddings), _weight.detach())

    # -- rows ---------------------------------------------------------------------------------
    def table_meta(self) -> dict:
        return {"num_embeddings": self.num_embeddings, "embedding_dim": self.embedding_dim, "width": self.width,
                "dtype": "float32", "seed": self.seed,
                "optimizer": self.optimizer.to_meta() if self.optimizer else None,
                "init": {"kind": self.init_spec.kind, "a": self.init_spec.a, "b": self.init_spec.b},
                "padding_idx": self.padding_idx}

    def _open_ssd(self, path: str, options: dict):
        """options: ssd_options, e.g. {"backend": "rocksdb" | "slots", "direct_reads": True, ...}."""
        import ssd_backend

        return ssd_backend.open_store(path, self.width, self._init_rows, self.table_meta(), **options)

    def _check_ids(self, ids) -> Tensor:
        ids = torch.as_tensor(ids)
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"ids must be an integer tensor, got {ids.dtype}")
        return ids.reshape(-1).to(torch.int64)

    def read_rows(self, ids) -> Tensor:
        """ids: int [n]. Returns float32 [n, D] (CPU): current values wherever the rows live."""
        return self._store.read(self._check_ids(ids))[:, :self.embedding_dim]

    def read_optimizer_state(self, ids) -> Tensor:
        """ids: int [n]. Returns float32 [n, S]: the optimizer state stored with each row."""
        return self._store.read(self._check_ids(ids))[:, self.embedding_dim:]

    def write_rows(self, ids, values: Tensor, optimizer_state: Tensor | None = None) -> None:
        """Sets rows: ids int [n] unique; values [n, D]; optimizer_state [n, S] (kept if None)."""
        ids = self._check_ids(ids)
        values = torch.as_tensor(values)
        if tuple(values.shape) != (len(ids), self.embedding_dim):
            raise ValueError(f"values has shape {tuple(values.shape)}, expected ({len(ids)}, {self.embedding_dim})")
        if not values.dtype.is_floating_point:
            raise TypeError(f"values must be floating point, got {values.dtype}")
        state_w = self.width - self.embedding_dim
        if optimizer_state is not None and tuple(optimizer_state.shape) != (len(ids), state_w):
            raise ValueError(f"optimizer_state has shape {tuple(optimizer_state.shape)}, expected ({len(ids)}, {state_w})")
        if len(torch.unique(ids)) != len(ids):
            raise ValueError("write_rows ids must be unique")
        rows = self._store.read(ids)  # validates the range before anything changes
        rows[:, :self.embedding_dim] = values.detach().cpu().to(torch.float32)
        if optimizer_state is not None:
            rows[:, self.embedding_dim:] = optimizer_state.detach().cpu().to(torch.float32)
        self._store.write(ids, rows)

    def flush(self) -> None:
        """Returns when every update made before it is in the backing store (durable on SSD)."""
        self._store.flush()
        if self.ssd_path is not None:
            _write_step(self.ssd_path, self.step)

    def checkpoint(self, path) -> None:
        """A consistent snapshot of an SSD-backed table at path, which opens as a table."""
        if self._store.backing is None:
            raise RuntimeError("checkpoint() needs an SSD tier (ssd_path=...); use export_rows() otherwise")
        with self._store.lock:
            self.flush()
            self._store.backing.checkpoint(os.fspath(path))
            _write_step(os.fspath(path), self.step)

    def close(self) -> None:
        """Flushes and releases the tiers (the SSD store's lock); the table is unusable after.
        Closing twice is allowed."""
        if getattr(self, "_closed", False):
            return
        self._prefetch.shutdown()
        self.flush()
        self._store.close()
        self._closed = True

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
        """Per tier: hits, misses, evictions, dirty_writebacks, clean_drops, bytes moved, hit_rate;
        under "prefetch": rows forwards found prefetched vs read themselves, and time waited
        (see Prefetcher.stats)."""
        return {**self._store.stats(), "prefetch": self._prefetch.stats()}

    def reset_stats(self) -> None:
        self._store.reset_stats()
        self._prefetch.reset_stats()

    # -- export / import ----------------------------------------------------------------------
    def iter_rows(self, chunk_rows: int = 1 << 18):
        """Yields (ids [k], weights [k, D], optimizer_state [k, S]) over every row ever written,
        in id order, chunk by chunk; rows not listed hold their deterministic initial values."""
        self.flush()
        start = 0
        while True:
            ids = self._store.written_ids(start, chunk_rows)
            if len(ids) == 0:
                return
            rows = self._store.read(ids)
            yield ids, rows[:, :self.embedding_dim], rows[:, self.embedding_dim:]
            start = int(ids[-1]) + 1

    def export_rows(self, directory, chunk_rows: int = 1 << 18) -> int:
        """Writes the table to directory (meta.json + chunk files) in bounded memory. Returns rows."""
        import json

        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        total = 0
        for k, (ids, w, s) in enumerate(self.iter_rows(chunk_rows)):
            torch.save({"ids": ids, "weights": w, "state": s}, os.path.join(directory, f"chunk_{k:06d}.pt"))
            total += len(ids)
        with open(os.path.join(directory, "meta.json"), "w") as f:
            json.dump({**self.table_meta(), "step": self.step, "rows": total}, f)
        return total

    def import_rows(self, directory) -> int:
        """Loads what export_rows wrote into this table (same shape and optimizer). Returns rows."""
        import glob
        import json

        directory = os.fspath(directory)
        with open(os.path.join(directory, "meta.json")) as f:
            meta = json.load(f)
        mine = self.table_meta()
        for field in ("num_embeddings", "embedding_dim", "width"):
            if meta[field] != mine[field]:
                raise ValueError(f"{directory}: exported {field} {meta[field]} != this table's {mine[field]}")
        total = 0
        for path in sorted(glob.glob(os.path.join(directory, "chunk_*.pt"))):
            c = torch.load(path)
            self.write_rows(c["ids"], c["weights"], c["state"] if c["state"].shape[1] else None)
            total += len(c["ids"])
        self.step = meta.get("step", 0)
        return total

    # -- state_dict for tables that fit in memory --------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        rows = self._all_rows()
        destination[prefix + "weight"] = rows[:, :self.embedding_dim].clone()
        destination[prefix + "optimizer_state"] = rows[:, self.embedding_dim:].clone()
        destination[prefix + "optimizer_step"] = torch.tensor(self.step)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
            return
        w = state_dict[key]
        if tuple(w.shape) != (self.num_embeddings, self.embedding_dim):
            error_msgs.append(f"size mismatch for {key}: {tuple(w.shape)} vs "
                              f"({self.num_embeddings}, {self.embedding_dim})")
            return
        st = state_dict.get(prefix + "optimizer_state")
        if st is not None and st.shape[1] != self.width - self.embedding_dim:
            st = None
        self.write_rows(torch.arange(self.num_embeddings), w, st)
        if prefix + "optimizer_step" in state_dict:
            self.step = int(state_dict[prefix + "optimizer_step"])

    def _all_rows(self) -> Tensor:
        limit = int(os.environ.get("TIEREDEMB_STATE_DICT_MAX_BYTES", 8 << 30))
        if self.num_embeddings * self.width * 4 > limit:
            raise RuntimeError(f"state_dict() would hold {self.num_embeddings * self.width * 4} bytes "
                               f"(> {limit}); use export_rows() for tables this large")
        return self._store.read(torch.arange(self.num_embeddings))

    # -- forward / backward -------------------------------------------------------------------
    def _lookup(self, ids: Tensor, offsets: Tensor, psw: Tensor | None, mode: int, exclude_padding: bool) -> Tensor:
        """ids int64 [N]; offsets int64 [B + 1]. Returns [B, D]."""
        unique, inverse, slots = self._prefetch.take(ids, offsets)
        pad_u = -1
        if self.padding_idx is not None:
            hit = (unique == self.padding_idx).nonzero()
            pad_u = int(hit[0, 0]) if len(hit) else -1
        batch = _Batch(self, unique, inverse, slots, offsets, psw, mode, pad_u if exclude_padding else -1, pad_u)
        training = torch.is_grad_enabled() and self._grad_anchor.requires_grad
        if not training:
            try:
                return self._pool_forward(batch)
            finally:
                batch.release()
        try:
            return _Lookup.apply(batch, psw, self._grad_anchor)
        except BaseException:
            batch.release()
            raise

    def _pool_forward(self, batch: _Batch) -> Tensor:
        return kernels.forward(self._store.tier0.pool, self.embedding_dim, batch)

    def _backward(self, batch: _Batch, grad_out: Tensor, need_psw_grad: bool) -> Tensor | None:
        if batch.released:
            raise RuntimeError("this batch's rows were released before backward (was the forward run under "
                               "no_grad, or backward called twice?)")
        try:
            if self.optimizer is None:
                raise RuntimeError(f"{type(self).__name__} has no optimizer: pass optimizer=tieredemb.SGD(lr=...) "
                                   "(or Adagrad, RowWiseAdagrad, Adam); its update is fused into backward")
            self.step += 1
            psw_grad = kernels.backward_update(self._store.tier0.pool, self.embedding_dim, batch, grad_out,
                                               self.optimizer, self.step, need_psw_grad)
            touched = batch.slots if batch.frozen_u < 0 else torch.cat(
                [batch.slots[:batch.frozen_u], batch.slots[batch.frozen_u + 1:]])
            self._store.mark_dirty(touched)
            return psw_grad
        finally:
            batch.release()

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        return s + (f", cache_rows={self.cache_rows}, host_rows={self.host_rows}, policy={self.policy!r}, "
                    f"optimizer={self.optimizer}")


# The table's optimizer step count (Adam's bias correction needs it) beside the SSD store's
# files; written after every flush, atomically, so a reopened table goes on counting.
_STEP_FILE = "tieredemb_step.json"


def _write_step(directory: str, step: int) -> None:
    import json

    path = os.path.join(directory, _STEP_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump({"step": step}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_step(directory: str) -> int:
    import json

    try:
        with open(os.path.join(directory, _STEP_FILE)) as f:
            return int(json.load(f)["step"])
    except FileNotFoundError:
        return 0
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"ssd_path {directory}: {_STEP_FILE} is damaged ({e})") from None


def _check_int_tensor(name: str, t) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of integer ids, got {type(t).__name__}")
    if t.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"{name} must have an integer dtype (int64 or int32), got {t.dtype}")
    return t


class TieredEmbeddingBag(_TieredBase):
    """torch.nn.EmbeddingBag whose rows live in tiers (tier 0 cache, host cache, backing store)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, mode: str = "mean", *, padding_idx=None,
                 include_last_offset: bool = False, cache_rows=None, host_rows=None, ssd_path=None,
                 policy: str = "lru", optimizer: Optimizer | None = None, seed: int = 0, device=None,
                 dtype=torch.float32, _weight: Tensor | None = None, init: Init | None = None,
                 ssd_options: dict | None = None):
        if mode not in _MODES:
            raise ValueError(f"mode {mode!r} is not one of 'sum', 'mean', 'max'")
        self.mode = mode
        self.include_last_offset = include_last_offset
        super().__init__(num_embeddings, embedding_dim, padding_idx=padding_idx, cache_rows=cache_rows,
                         host_rows=host_rows, ssd_path=ssd_path, policy=policy, optimizer=optimizer, seed=seed,
                         device=device, dtype=dtype, _weight=_weight, init=init, ssd_options=ssd_options)

    @classmethod
    def from_pretrained(cls, embeddings: Tensor, freeze: bool = True, mode: str = "mean", padding_idx=None,
                        include_last_offset: bool = False, **kwargs) -> "TieredEmbeddingBag":
        """Like torch.nn.EmbeddingBag.from_pretrained; kwargs are the tier arguments."""
        if embeddings.dim() != 2:
            raise ValueError(f"embeddings must be 2-D, got shape {tuple(embeddings.shape)}")
        m = cls(embeddings.shape[0], embeddings.shape[1], mode, padding_idx=padding_idx,
                include_last_offset=include_last_offset, _weight=embeddings, **kwargs)
        m._grad_anchor.requires_grad_(not freeze)
        return m

    def forward(self, input: Tensor, offsets: Tensor | None = None, per_sample_weights: Tensor | None = None) -> Tensor:
        """input: int [N] ids with offsets int [B] bag starts (B + 1 with include_last_offset),
        or int [B, L] with offsets None. per_sample_weights: float, input's shape, mode 'sum'.
        Returns [B, D]."""
        flat, offsets_full = self._bags(input, offsets)
        psw = None
        if per_sample_weights is not None:
            if self.mode != "sum":
                raise ValueError(f"per_sample_weights is only supported with mode='sum', this bag has mode={self.mode!r}")
            if not isinstance(per_sample_weights, Tensor) or not per_sample_weights.dtype.is_floating_point:
                raise TypeError("per_sample_weights must be a floating point tensor")
            if per_sample_weights.shape != input.shape:
                raise ValueError(f"per_sample_weights has shape {tuple(per_sample_weights.shape)}, "
                                 f"expected input's shape {tuple(input.shape)}")
            psw = per_sample_weights.reshape(-1)
        out = self._lookup(flat, offsets_full, psw, _MODES[self.mode], exclude_padding=True)
        return out.to(per_sample_weights.dtype) if psw is not None and psw.dtype != out.dtype else out

    def prefetch(self, input: Tensor, offsets: Tensor | None = None) -> None:
        """Registers a future batch (forward's input and offsets): its rows are made resident in
        tier 0 by a background worker and stay pinned until that batch's backward. Forwards of
        registered batches must come in registration order. Bad ids raise here; nothing changes."""
        self._prefetch.register(*self._bags(input, offsets))

    def _bags(self, input: Tensor, offsets: Tensor | None) -> tuple[Tensor, Tensor]:
        """forward's (input, offsets), checked -> (ids [N], bag boundaries int64 [B + 1])."""
        _check_int_tensor("input", input)
        if input.dim() == 2:
            if offsets is not None:
                raise ValueError("offsets must be None when input is 2-D [B, L] (each row is a bag)")
            bags, length = input.shape
            return input.reshape(-1), torch.from_numpy(np.arange(0, (bags + 1) * length, length, dtype=np.int64)[:bags + 1])
        if input.dim() == 1:
            if offsets is None:
                raise ValueError("offsets is required when input is 1-D (bag starts, int [B])")
            _check_int_tensor("offsets", offsets)
            if offsets.dim() != 1:
                raise ValueError(f"offsets must be 1-D, got shape {tuple(offsets.shape)}")
            return input, self._normalize_offsets(offsets.to("cpu", torch.int64), len(input))
        raise ValueError(f"input must be 1-D (with offsets) or 2-D [B, L], got shape {tuple(input.shape)}")

    def _normalize_offsets(self, offsets: Tensor, n: int) -> Tensor:
        """torch's offsets -> [B + 1] bag boundaries, checked. In numpy: torch's intra-op
        threads cost milliseconds per call on a busy machine for these few element-wise ops."""
        if len(offsets) == 0:
            if self.include_last_offset:
                raise ValueError("offsets must not be empty with include_last_offset=True")
            return torch.zeros(1, dtype=torch.int64)
        o = offsets.numpy()
        if o[0] != 0:
            raise ValueError(f"offsets[0] must be 0 (the first bag starts at the first id), got {int(o[0])}")
        if len(o) > 1:
            down = np.flatnonzero(o[1:] < o[:-1])
            if len(down):
                k = int(down[0]) + 1
                raise ValueError(f"offsets must be non-decreasing: offsets[{k}] = {int(o[k])} < "
                                 f"offsets[{k - 1}] = {int(o[k - 1])}")
        if o[-1] > n:
            raise ValueError(f"offsets[-1] = {int(o[-1])} is past the end of input (length {n})")
        if self.include_last_offset:
            return offsets.contiguous()
        return torch.from_numpy(np.append(o, n))


class TieredEmbedding(_TieredBase):
    """torch.nn.Embedding whose rows live in tiers."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, padding_idx=None, cache_rows=None,
                 host_rows=None, ssd_path=None, policy: str = "lru", optimizer: Optimizer | None = None,
                 seed: int = 0, device=None, dtype=torch.float32, _weight: Tensor | None = None,
                 init: Init | None = None, ssd_options: dict | None = None):
        super().__init__(num_embeddings, embedding_dim, padding_idx=padding_idx, cache_rows=cache_rows,
                         host_rows=host_rows, ssd_path=ssd_path, policy=policy, optimizer=optimizer, seed=seed,
                         device=device, dtype=dtype, _weight=_weight, init=init, ssd_options=ssd_options)

    @classmethod
    def from_pretrained(cls, embeddings: Tensor, freeze: bool = True, padding_idx=None, **kwargs) -> "TieredEmbedding":
        """Like torch.nn.Embedding.from_pretrained; kwargs are the tier arguments."""
        if embeddings.dim() != 2:
            raise ValueError(f"embeddings must be 2-D, got shape {tuple(embeddings.shape)}")
        m = cls(embeddings.shape[0], embeddings.shape[1], padding_idx=padding_idx, _weight=embeddings, **kwargs)
        m._grad_anchor.requires_grad_(not freeze)
        return m

    def forward(self, input: Tensor) -> Tensor:
        """input: int ids of any shape [*]. Returns [*, D]."""
        out = self._lookup(*self._bags(input), None, _MODES["sum"], exclude_padding=False)
        return out.reshape(*input.shape, self.embedding_dim)

    def prefetch(self, input: Tensor) -> None:
        """Registers a future batch (forward's input): see TieredEmbeddingBag.prefetch."""
        self._prefetch.register(*self._bags(input))

    @staticmethod
    def _bags(input: Tensor) -> tuple[Tensor, Tensor]:
        """ids of any shape -> (ids [N], one bag per id: boundaries [N + 1])."""
        _check_int_tensor("input", input)
        flat = input.reshape(-1)
        return flat, torch.from_numpy(np.arange(len(flat) + 1, dtype=np.int64))
