"""The inputs and outputs of the collections (collection.py): KeyedJaggedTensors (duck-typed) and
dicts of features in, RecD's inverse-keyed batches (InverseKeyed), and torchrec's output types
out (KeyedTensor, JaggedTensor) or, where torchrec is not installed, look-alikes of them."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor


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


def keyed(keys, lengths, values):
    try:
        from torchrec.sparse.jagged_tensor import KeyedTensor
    except ImportError:
        return KeyedEmbeddings(keys, lengths, values)
    return KeyedTensor(keys=keys, length_per_key=lengths, values=values)


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
        return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(self._lengths, 0)])

    def to_dense(self) -> list[Tensor]:
        return list(torch.split(self._values, self._lengths.tolist()))


def jagged(values: Tensor, lengths: Tensor):
    try:
        from torchrec.sparse.jagged_tensor import JaggedTensor
    except ImportError:
        return JaggedEmbeddings(values, lengths)
    return JaggedTensor(values=values, lengths=lengths)


def features_of(features) -> dict:
    """A KeyedJaggedTensor (duck-typed: keys(), values(), lengths() or offsets(), weights_or_none()), or
    {feature: (ids, offsets[, per_sample_weights])} with offsets [B] bag starts, or {feature:
    InverseKeyed} -> {feature: (ids [N], bag boundaries int64 [B + 1] on the host, weights or
    None, inverse int64 [B] or None)}."""
    if hasattr(features, "keys") and callable(getattr(features, "values", None)) and \
            not isinstance(features, dict):  # a KeyedJaggedTensor (duck-typed)
        keys = list(features.keys())
        values = features.values()
        weights = features.weights_or_none()
        lengths = (features.lengths() if callable(getattr(features, "lengths", None))
                   else torch.diff(features.offsets()))  # a KeyedJaggedTensor may carry either
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


def _bounds(offsets: Tensor, n: int) -> Tensor:
    """Bag starts [B] -> boundaries [B + 1] (as a host int64 tensor)."""
    o = offsets.to("cpu", torch.int64)
    return torch.cat([o, torch.tensor([n])])
