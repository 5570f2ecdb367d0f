"""Recording the lookups that embedding modules perform, into a trace file.

    with tieredemb.record({"user": user_emb, "item": item_emb}, "run.trace") as rec:
        for batch in loader:
            loss = model(batch); loss.backward(); opt.step()

Every module is one table of the trace (num_rows = its num_embeddings; named by the dict key,
else table0, table1, ... in the order given). A collection (TieredEmbeddingBagCollection,
TieredEmbeddingCollection), given alone, gives its tables, named as it names them: its trace is
what `tieredemb plan` takes. A call records all ids of its `input`, flattened
in order (the ids the module looks up, padding_idx included), after the forward returns: a call
that raises looked nothing up and records nothing.
Batches: a batch is the lookups of consecutive calls; a new batch starts when a module already
in the current batch is called again, or at rec.next_batch(). (One call per table per training
step, the usual case, makes one batch per step.) Leaving the block, normally or by an exception,
removes the hooks and closes the trace with every lookup recorded so far.
"""

from __future__ import annotations

import numpy as np
import torch

from .format import TableInfo, TraceError, TraceWriter

_KINDS = (torch.nn.Embedding, torch.nn.EmbeddingBag)


def _tables(modules) -> list[tuple[str, torch.nn.Module]]:
    if isinstance(modules, torch.nn.Module):
        named = [("table0", modules)]
    elif isinstance(modules, dict):
        named = [(str(k), m) for k, m in modules.items()]
    else:
        named = [(f"table{i}", m) for i, m in enumerate(modules)]
    if not named:
        raise TraceError("record needs at least one module")
    from tieredemb import TieredEmbedding, TieredEmbeddingBag

    seen = set()
    for name, m in named:
        if not isinstance(m, _KINDS + (TieredEmbedding, TieredEmbeddingBag)):
            raise TraceError(f"module {name!r} is a {type(m).__name__}: record takes TieredEmbeddingBag, "
                             f"TieredEmbedding, torch.nn.EmbeddingBag or torch.nn.Embedding")
        if id(m) in seen:
            raise TraceError(f"module {name!r} is given twice")
        seen.add(id(m))
    return named


def _collection_keys(ebc, base) -> list:
    """Per group of a collection, the keys of its ids (the collection's forward hook reads each
    group's ids of the last lookup, ebc.looked_up): a group's row is table t's row
    (row - group offset of t), whose trace key is base[t] + that."""
    position = {t.name: k for k, t in enumerate(ebc.tables)}
    keys = []
    for group in ebc.groups:
        ends = np.cumsum([t.num_embeddings for t in group.tables])
        shift = np.array([base[position[t.name]] - group.offsets[t.name] for t in group.tables], dtype=np.int64)
        keys.append(lambda ids, ends=ends, shift=shift: ids + shift[np.searchsorted(ends, ids, "right")])
    return keys


class Recorder:
    """Hooks modules and writes their lookups to a trace; use through record()."""

    def __init__(self, modules, path, *, chunk_lookups: int = 1 << 20):
        from tieredemb.collection import _Collection

        if isinstance(modules, _Collection):
            tables = [TableInfo(t.name, int(t.num_embeddings)) for t in modules.tables]
        else:
            named = _tables(modules)
            tables = [TableInfo(n, int(m.num_embeddings)) for n, m in named]
        self._writer = TraceWriter(path, tables, chunk_lookups=chunk_lookups, meta={"generator": "record"})
        base = self._writer.header.table_base
        self._current: list[np.ndarray] = []
        self._in_batch: set[int] = set()
        self._hooks = []
        try:
            if isinstance(modules, _Collection):
                self._hooks.append(modules.register_forward_hook(self._collection_hook(_collection_keys(modules, base))))
            else:
                for k, (_, m) in enumerate(named):
                    self._hooks.append(m.register_forward_hook(self._hook(k, lambda ids, b=base[k]: ids + b),
                                                               with_kwargs=True))
        except BaseException:
            self._remove()
            self._writer.abort()
            raise

    def _hook(self, source: int, keys):
        def hook(module, args, kwargs, output):
            ids = args[0] if args else kwargs["input"]
            self._record(source, keys, ids)
        return hook

    def _collection_hook(self, group_keys):
        def hook(module, args, output):  # each group's ids, as its one lookup had them
            for k, (keys, ids) in enumerate(zip(group_keys, module.looked_up)):
                self._record(k, keys, ids)
        return hook

    def _record(self, source: int, keys, ids: torch.Tensor) -> None:
        if source in self._in_batch:
            self.next_batch()
        flat = ids.detach().reshape(-1).to("cpu", torch.int64).numpy()  # in range: forward checked them
        self._current.append(keys(flat))
        self._in_batch.add(source)

    def next_batch(self) -> None:
        """Ends the current batch (no-op when it is empty)."""
        if self._current:
            self._writer.write_batch(np.concatenate(self._current))
        self._current, self._in_batch = [], set()

    @property
    def num_batches(self) -> int:
        """Batches written so far (the current one not included)."""
        return self._writer.header.num_batches

    @property
    def num_lookups(self) -> int:
        return self._writer.header.num_lookups + sum(a.size for a in self._current)

    def _remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def close(self) -> None:
        """Removes the hooks, writes the current batch and closes the trace."""
        self._remove()
        try:
            self.next_batch()
        finally:
            self._writer.close()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def record(modules, path, *, chunk_lookups: int = 1 << 20) -> Recorder:
    """Context manager: records every lookup of `modules` (a module, a list, a dict name ->
    module, or a collection) into the trace at `path`; see the module docstring for tables and
    batches. chunk_lookups: the lookups held in memory before they are written as one chunk of
    the trace (the most a reader then holds at once, too)."""
    return Recorder(modules, path, chunk_lookups=chunk_lookups)
