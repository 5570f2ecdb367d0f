"""What the training tests share: a training loop over (ids, offsets, grad) batches, with or
without a PrefetchLoader, a table's rows and optimizer state in one tensor, and a
KeyedJaggedTensor as the collections read one."""

from __future__ import annotations

import torch

import tieredemb


def batches(seed=0, steps=8, num=300, dim=8, bags=10, length=6) -> list[tuple]:
    """steps batches (ids, offsets, grad) of bags bags of length ids each, skewed toward low ids
    of [0, num), with a [bags, dim] gradient: the same for a seed."""
    g = torch.Generator().manual_seed(seed)
    return [((torch.rand(bags * length, generator=g) ** 2 * num).long(), torch.arange(0, bags * length, length),
             torch.randn(bags, dim, generator=g)) for _ in range(steps)]


def train(emb, data, depth: int = 0) -> list[torch.Tensor]:
    """One forward + backward(grad) per batch (ids, offsets, grad); through a PrefetchLoader of
    that depth (its default ids_fn) when depth > 0. Returns the forwards' outputs."""
    loader = data if depth == 0 else tieredemb.PrefetchLoader(data, [emb], depth=depth)
    outs = []
    for ids, offsets, grad in loader:
        out = emb(ids, offsets)
        out.backward(grad)
        outs.append(out.detach())
    return outs


def rows_and_state(emb) -> torch.Tensor:
    """Every row's weights and optimizer state, float32 [num_embeddings, D + S]."""
    ids = torch.arange(emb.num_embeddings)
    return torch.cat([emb.read_rows(ids), emb.read_optimizer_state(ids)], 1)


class KJT:
    """A KeyedJaggedTensor as the collection reads one (keys, values, lengths, weights_or_none)."""

    def __init__(self, keys, values, lengths, weights=None):
        self._k, self._v, self._l, self._w = keys, values, lengths, weights

    def keys(self):
        return self._k

    def values(self):
        return self._v

    def lengths(self):
        return self._l

    def weights_or_none(self):
        return self._w
