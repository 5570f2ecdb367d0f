"""What the training tests share: a training loop over (ids, offsets, grad) batches, with or
without a PrefetchLoader, and a table's rows and optimizer state in one tensor."""

from __future__ import annotations

import torch

import tieredemb


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
