"""What the training tests share: a training loop over (ids, offsets, grad) batches, with or
without a PrefetchLoader, a table's rows and optimizer state in one tensor, and a
KeyedJaggedTensor as the collections read one."""

from __future__ import annotations

import gc
import types

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


def finalize_what_the_graph_holds(out: torch.Tensor) -> list[str]:
    """Does to what the autograd graph of `out` holds what Python's cyclic collector does to the
    objects it judges unreachable: runs the __del__ of each of the package's objects there (and
    their weak references would be cleared). A simulated fault, for it cannot be produced on
    demand: the collector judges a live graph unreachable when another thread, without the GIL,
    gives the graph's output a second owner between the collector's two passes over torch's
    tensors (bench/gc_race.py shows it, with torch alone and with a table). Returns the names of
    the package's classes found there (so a test sees it reached the batch)."""
    seen, todo, found = set(), [out.grad_fn], []
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, (type, types.ModuleType, torch.nn.Module)):
            continue  # (a module is reachable from outside the graph: never judged unreachable)
        seen.add(id(o))
        cls = type(o)
        if cls.__module__.startswith("tieredemb"):
            found.append(cls.__name__)
            if hasattr(cls, "__del__"):
                cls.__del__(o)
        todo.extend(gc.get_referents(o))
        if isinstance(o, torch.autograd.graph.Node):  # (torch's own nodes hold theirs in C++)
            todo.extend(f for f, _ in o.next_functions if f is not None)
    return found
