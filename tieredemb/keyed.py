"""The inputs and outputs of the collections (collection.py): KeyedJaggedTensors (duck-typed) and
dicts of features in, RecD's inverse-keyed batches (InverseKeyed), and torchrec's output types
out (KeyedTensor, JaggedTensor) or, where torchrec is not installed, look-alikes of them."""

from __future__ import annotations

import dataclasses
import functools
import warnings

import numpy as np
import torch
from torch import Tensor

from .prefetch import version_of


@dataclasses.dataclass(frozen=True)
class InverseKeyed:
    """A feature's batch given as its distinct bags and, per sample, which one it is (RecD's
    inverse-keyed jagged tensor): values [N] and offsets [U] (bag starts, as EmbeddingBag's) of
    the U distinct bags; inverse [B], each in [0, U)."""

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


@functools.cache
def _torchrec():
    """torchrec.sparse.jagged_tensor, or None where torchrec is not installed or does not load.
    Looked up once: a failed import is not cached by Python, and an installed torchrec whose
    fbgemm_gpu does not match torch fails (OSError, RuntimeError) only after seconds of loading,
    which every forward would otherwise pay again."""
    try:
        from torchrec.sparse import jagged_tensor
    except Exception as e:  # not installed; or installed, but it (or its fbgemm_gpu) does not load
        if isinstance(e, ImportError) and e.name in ("torchrec", "torchrec.sparse"):
            return None  # (not installed)
        warnings.warn(f"torchrec is installed but does not import ({type(e).__name__}: {str(e)[:200]}); the "
                      f"collections return tieredemb's KeyedEmbeddings and JaggedEmbeddings instead of its "
                      f"KeyedTensor and JaggedTensor", RuntimeWarning, stacklevel=3)
        return None
    return jagged_tensor


def keyed(keys, lengths, values):
    torchrec = _torchrec()
    if torchrec is None:
        return KeyedEmbeddings(keys, lengths, values)
    return torchrec.KeyedTensor(keys=keys, length_per_key=lengths, values=values)


class JaggedEmbeddings:
    """A feature's unpooled embeddings, as torchrec's JaggedTensor has them (used where torchrec
    is not installed): values() [N, D], lengths() [B], offsets() [B + 1], to_dense() (a list of
    B [L_i, D] tensors)."""

    def __init__(self, values: Tensor, lengths: Tensor):
        self._values, self._lengths = values, lengths

    def values(self) -> Tensor:
        return self._values

    def lengths(self) -> Tensor:
        return self._lengths

    def offsets(self) -> Tensor:
        zero = torch.zeros(1, dtype=torch.int64, device=self._lengths.device)
        return torch.cat([zero, torch.cumsum(self._lengths, 0)])

    def to_dense(self) -> list[Tensor]:
        return list(torch.split(self._values, self._lengths.tolist()))


def jagged(values: Tensor, lengths: Tensor):
    torchrec = _torchrec()
    if torchrec is None:
        return JaggedEmbeddings(values, lengths)
    return torchrec.JaggedTensor(values=values, lengths=lengths)


def is_keyed_jagged(features) -> bool:
    """Whether features is a KeyedJaggedTensor (duck-typed: keys() and values(), not a dict)."""
    return hasattr(features, "keys") and callable(getattr(features, "values", None)) and \
        not isinstance(features, dict)


def batch_sources(features) -> tuple:
    """The tensors a batch of features is made of, with its keys, in order (a prefetched batch's
    forward recognizes them by identity: same_sources)."""
    if is_keyed_jagged(features):
        lengths = getattr(features, "lengths", None)
        inverse = _call(features, "inverse_indices_or_none")
        return (*features.keys(), features.values(), lengths() if callable(lengths) else features.offsets(),
                _call(features, "weights_or_none"), None if inverse is None else inverse[1])
    if not isinstance(features, dict):
        return ()
    out = []
    for f, v in features.items():
        out.append(f)
        out.extend((v.values, v.offsets, v.inverse) if isinstance(v, InverseKeyed) else
                   v if isinstance(v, (tuple, list)) else (v,))
    return tuple(out)


def same_sources(a: tuple, b: tuple, versions: tuple) -> bool:
    """Whether b (batch_sources) is a: the very tensors, unchanged since their versions were taken,
    under the same keys."""
    return bool(a) and len(a) == len(b) and all(x is y if isinstance(x, Tensor) or x is None else
                                                 (not isinstance(y, Tensor) and x == y) for x, y in zip(a, b)) \
        and source_versions(b) == versions


def source_versions(sources: tuple) -> tuple:
    return tuple(version_of(t) for t in sources if isinstance(t, Tensor))


def keyed_lengths(kjt) -> Tensor:
    """A KeyedJaggedTensor's lengths, where it is (one may carry offsets only)."""
    return kjt.lengths() if callable(getattr(kjt, "lengths", None)) else torch.diff(kjt.offsets())


def features_of(features, lengths: Tensor | None = None, keyed_weights: bool = True) -> dict:
    """A KeyedJaggedTensor (duck-typed: keys(), values(), lengths() or offsets(), weights_or_none()), or
    {feature: (ids, offsets[, per_sample_weights])} with offsets [B] bag starts, or {feature:
    InverseKeyed} -> {feature: (ids [N], bag boundaries int64 [B + 1] on the host, weights or
    None, inverse int64 [B] or None)}. Every feature is checked (ValueError or TypeError naming
    it and the rule) before any is returned. lengths: a KeyedJaggedTensor's, already read to the
    host (int64). keyed_weights: whether a KeyedJaggedTensor's weights are taken (else left
    alone, as torchrec's unweighted collections leave them)."""
    if is_keyed_jagged(features):
        return _keyed_jagged(features, lengths, keyed_weights)
    if not isinstance(features, dict):
        raise TypeError(f"features must be a KeyedJaggedTensor or a dict of feature -> (ids, offsets[, "
                        f"per_sample_weights]) or InverseKeyed, got {type(features).__name__}")
    out = {}
    for key, item in features.items():
        if isinstance(item, InverseKeyed):
            ids = _ids(f"feature {key!r}", item.values)
            bounds = _bounds(key, item.offsets, len(ids))
            out[key] = (ids, bounds, None, _inverse(key, item.inverse, len(bounds) - 1))
        elif isinstance(item, (tuple, list)) and len(item) in (2, 3):
            ids = _ids(f"feature {key!r}", item[0])
            weights = _weights(f"feature {key!r}: per_sample_weights", item[2] if len(item) > 2 else None, ids,
                               "its ids'")
            out[key] = (ids, _bounds(key, item[1], len(ids)), weights, None)
        else:
            raise TypeError(f"feature {key!r}: give (ids, offsets[, per_sample_weights]) or an InverseKeyed, "
                            f"got {type(item).__name__}")
    return out


def _keyed_jagged(kjt, lengths: Tensor | None, keyed_weights: bool) -> dict:
    keys = list(kjt.keys())
    values = _ids("KeyedJaggedTensor values()", kjt.values())
    weights = _call(kjt, "weights_or_none") if keyed_weights else None
    lengths = keyed_lengths(kjt) if lengths is None else lengths
    if not isinstance(lengths, Tensor) or lengths.dtype.is_floating_point or lengths.dtype.is_complex \
            or lengths.dtype == torch.bool or lengths.dim() != 1:
        got = f"{lengths.dtype} {tuple(lengths.shape)}" if isinstance(lengths, Tensor) else type(lengths).__name__
        raise ValueError(f"KeyedJaggedTensor: lengths must be a 1-D integer tensor, got {got}")
    lengths = lengths.to("cpu", torch.int64)
    if not keys:
        raise ValueError("KeyedJaggedTensor: no keys")
    if len(set(keys)) != len(keys):
        twice = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"KeyedJaggedTensor: keys must be unique, got {twice} more than once")
    if len(lengths) and int(lengths.min()) < 0:
        raise ValueError(f"KeyedJaggedTensor: lengths must be >= 0, got {int(lengths.min())}")
    if len(lengths) and int(lengths.max()) > len(values):  # (before they are summed: a sum must not wrap)
        raise ValueError(f"KeyedJaggedTensor: a length of {int(lengths.max())} is past values()' {len(values)} ids")
    bounds = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=bounds[1:])
    if int(bounds[-1]) != len(values):
        raise ValueError(f"KeyedJaggedTensor: lengths sum to {int(bounds[-1])}, values() has {len(values)}")
    strides, inverse = _strides(kjt, keys, len(lengths))
    if keyed_weights and weights is None:  # (torchrec's weighted collection refuses it too)
        raise ValueError("KeyedJaggedTensor: the collection was built with is_weighted=True, and this batch has no "
                         "weights (weights_or_none() is None)")
    weights = _weights("KeyedJaggedTensor: weights", weights, values, "values()'")
    out, start = {}, 0
    for key, stride in zip(keys, strides):
        b = bounds[start:start + stride + 1]
        start += stride
        lo, hi = int(b[0]), int(b[-1])
        out[key] = (values[lo:hi], b - lo, None if weights is None else weights[lo:hi],
                    None if inverse is None else _inverse(key, inverse[key], stride))
    return out


def _call(kjt, method: str):
    """kjt.method() where the KeyedJaggedTensor has it (torchrec's has; a duck-typed one may not)."""
    f = getattr(kjt, method, None)
    return f() if callable(f) else None


def variable_batch(kjt) -> bool:
    """Whether a KeyedJaggedTensor has a batch size per key (torchrec's variable_stride_per_key)."""
    return bool(_call(kjt, "variable_stride_per_key"))


def _strides(kjt, keys: list, n: int) -> tuple[list, dict | None]:
    """Each key's number of bags, and each key's inverse indices (its samples' bags) where the
    KeyedJaggedTensor has them (torchrec's variable batch per key: every key's distinct bags and
    inverse_indices (keys, [K, B]) that expand them to one batch, as its EmbeddingBagCollection
    does), else None."""
    inverse = _call(kjt, "inverse_indices_or_none")
    if inverse is not None:
        names, table = inverse
        if not isinstance(table, Tensor) or table.dim() != 2 or table.shape[0] != len(names) or \
                sorted(names) != sorted(keys):
            raise ValueError(f"KeyedJaggedTensor: inverse_indices must be (its keys, a [keys, batch] tensor), got "
                             f"keys {list(names)} and {getattr(table, 'shape', type(table).__name__)}")
        inverse = dict(zip(names, table.unbind(0)))
    if variable_batch(kjt):
        strides = [int(s) for s in kjt.stride_per_key()]
        if len(strides) != len(keys) or sum(strides) != n or min(strides, default=0) < 0:
            raise ValueError(f"KeyedJaggedTensor: stride_per_key() {strides} does not split its {n} lengths into "
                             f"its {len(keys)} keys' batches")
        if inverse is None and len(set(strides)) > 1:
            raise ValueError(f"KeyedJaggedTensor: keys of different batch sizes {strides} need inverse_indices "
                             f"(each sample's bag of each key), as torchrec's EmbeddingBagCollection does")
        return strides, inverse
    if n % len(keys):  # (keys: not empty, _keyed_jagged's check)
        raise ValueError(f"KeyedJaggedTensor: {n} lengths do not split into {len(keys)} keys' batches")
    return [n // len(keys)] * len(keys), inverse


def _ids(what: str, ids) -> Tensor:
    if not isinstance(ids, Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{what}: ids must be an integer tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
    if ids.dim() != 1:
        raise ValueError(f"{what}: ids must be 1-D, got shape {tuple(ids.shape)}")
    return ids


def _weights(what: str, weights, ids: Tensor, of: str):
    """Per-sample weights (None, or a floating point tensor of the ids' shape), checked."""
    if weights is None:
        return None
    if not isinstance(weights, Tensor) or weights.shape != ids.shape:
        raise ValueError(f"{what} must be a tensor of {of} shape {tuple(ids.shape)}, got "
                         f"{getattr(weights, 'shape', type(weights).__name__)}")
    if not weights.dtype.is_floating_point:
        raise TypeError(f"{what} must be a floating point tensor, got {weights.dtype}")
    return weights


def _bounds(key, offsets, n: int) -> Tensor:
    """A feature's bag starts [B] -> boundaries [B + 1] (as a host int64 tensor), checked."""
    if not isinstance(offsets, Tensor) or offsets.is_floating_point() or offsets.dim() != 1:
        raise TypeError(f"feature {key!r}: offsets must be a 1-D integer tensor of bag starts, got "
                        f"{getattr(offsets, 'dtype', type(offsets).__name__)} {tuple(getattr(offsets, 'shape', ()))}")
    o = offsets.to("cpu", torch.int64)
    check_starts(o.numpy(), n, where=f"feature {key!r}: ")
    return torch.cat([o, torch.tensor([n])])


def _inverse(key, inverse, bags: int) -> Tensor:
    """A feature's inverse index (each sample's distinct bag), checked to be in [0, bags), as a
    tensor of its own: backward reads it again, and a caller's loader may refill theirs before."""
    if (not isinstance(inverse, Tensor) or inverse.is_floating_point() or inverse.is_complex()
            or inverse.dtype == torch.bool or inverse.dim() != 1):
        got = f"{inverse.dtype} {tuple(inverse.shape)}" if isinstance(inverse, Tensor) else type(inverse).__name__
        raise TypeError(f"feature {key!r}: inverse must be a 1-D integer tensor, got {got}")
    inverse = inverse.to(torch.int64, copy=True)
    if len(inverse):
        lo, hi = torch.stack(torch.aminmax(inverse)).tolist()
        if lo < 0 or hi >= bags:
            raise ValueError(f"feature {key!r}: inverse {lo if lo < 0 else hi} out of range [0, {bags}) "
                             f"(the feature's distinct bags)")
    return inverse


def check_starts(o: np.ndarray, n: int, where: str = "") -> None:
    """Bag starts o (int64) over n ids: from 0, non-decreasing, none past the end. ValueError
    naming the offsets (after `where`: a feature's name, say) and the first value that breaks a
    rule."""
    if not len(o):
        return
    if o[0] != 0:
        raise ValueError(f"{where}offsets[0] must be 0 (the first bag starts at the first id), got {int(o[0])}")
    if len(o) > 1 and np.count_nonzero(o[1:] < o[:-1]):  # (a batch's check: count_nonzero is all C)
        k = int(np.flatnonzero(o[1:] < o[:-1])[0]) + 1
        raise ValueError(f"{where}offsets must be non-decreasing: offsets[{k}] = {int(o[k])} < "
                         f"offsets[{k - 1}] = {int(o[k - 1])}")
    if o[-1] > n:
        raise ValueError(f"{where}offsets[-1] = {int(o[-1])} is past the end of input (length {n})")
