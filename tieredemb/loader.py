"""PrefetchLoader: wraps an iterable of batches and keeps `depth` of them registered with the
tables' prefetchers (prefetch.py) ahead of the one being trained."""

from __future__ import annotations

import itertools
import weakref
from collections import deque

import torch


class PrefetchLoader:
    """Wraps an iterable of batches (e.g. a torch DataLoader) and keeps `depth` batches
    prefetched ahead of the one being trained, for one or more tiered modules.

    ids_fn(batch) -> {module: (input, offsets)}: what each module's forward will get for that
    batch (offsets None for 2-D input; a TieredEmbedding takes (input, None); a collection takes
    its features: a KeyedJaggedTensor or a dict). Every module
    must appear for every batch, and each module's forwards must come in batch order.
    For a single module it may be left out: a batch is then `input`, or a tuple / list whose
    first items are what the forward takes ((ids, offsets, ...) for 1-D bag input, (ids, ...)
    otherwise, (features, ...) for a collection; later items, e.g. labels, are not looked at).

    While batch s is yielded, batches s .. s+depth+lookahead are registered: s+1 .. s+depth are
    being made resident (pinned), and the `lookahead` after them are the eviction window (see
    TieredEmbeddingBag.prefetch_lookahead; default lookahead = depth). Any depth works whatever tier 0's
    size: a batch that does not fit beside those in flight waits for room (or, once its forward
    asks for it, uses overflow slots), with the same results.

        with PrefetchLoader(loader, [emb], depth=2) as batches:
            for ids, offsets, y in batches:
                loss_fn(head(emb(ids, offsets)), y).backward()

    Iterating again starts over (a new iterator of `loader`). The background workers stop when
    the iteration ends: exhaustion, break (the generator is closed), an exception, or close();
    registered batches not trained are released then. Errors of the background work surface
    at the next call on the training thread (next() or a forward), as the original exception."""

    def __init__(self, loader, modules, depth: int = 1, *, ids_fn=None, lookahead: int | None = None):
        modules = [modules] if hasattr(modules, "_prefetchers") else list(modules)  # (one module, or several)
        if not modules or any(not hasattr(m, "_prefetchers") for m in modules):
            raise TypeError("modules must be tiered modules (TieredEmbeddingBag / TieredEmbedding, or a collection), "
                            f"got {modules!r}")
        for name, v in (("depth", depth), ("lookahead", depth if lookahead is None else lookahead)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if ids_fn is None:
            if len(modules) != 1:
                raise TypeError(f"ids_fn is required with {len(modules)} modules "
                                "(batch -> {module: (input, offsets)})")
            ids_fn = lambda batch, m=modules[0]: {m: m._inputs_of(batch)}  # noqa: E731
        if not callable(ids_fn):
            raise TypeError(f"ids_fn must be callable (batch -> {{module: (input, offsets)}}), got {ids_fn!r}")
        self.loader = loader
        self.modules = modules
        self.depth = depth
        self.lookahead = depth if lookahead is None else lookahead
        self.ids_fn = ids_fn
        # The current iteration's generator, weakly: a `break` drops the last strong reference,
        # which closes it (CPython) and so stops the workers.
        self._running = None

    def __iter__(self):
        self.close()
        running = self._iterate()
        self._running = weakref.ref(running)
        return running

    def __enter__(self) -> "PrefetchLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Ends the current iteration (if any): stops the workers, releases untrained batches."""
        running = self._running() if self._running is not None else None
        self._running = None
        if running is not None:
            running.close()

    def _iterate(self):
        for m in self.modules:
            queued = sum(len(p.queue) for p in m._prefetchers())
            if queued:
                raise RuntimeError(f"{type(m).__name__} already has {queued} batches registered, by prefetch() or "
                                   "by another PrefetchLoader still iterating: train them (or close that loader) "
                                   "before iterating a PrefetchLoader over it")
        previous = [m.prefetch_lookahead for m in self.modules]
        source = None
        ahead: deque = deque()  # registered batches not yet yielded, oldest first
        try:
            for m in self.modules:
                m.prefetch_lookahead = self.lookahead
            source = iter(self.loader)
            counted = 0  # batches registered, or counted as registered once the source ran out
            failed = None  # the source's or ids_fn's error: raised where it stopped, after the batches before it
            for yielded in itertools.count():
                # Before batch s is yielded, s .. s+depth+lookahead count as registered.
                while counted <= yielded + self.depth + self.lookahead:
                    try:
                        batch = next(source, _END) if source is not None else _END
                        if batch is not _END:
                            self._register(batch)  # (a module it reached before one that refused it
                            # keeps it registered, after every batch yielded: shut down at the end)
                    except Exception as e:
                        failed, batch = e, _END
                    if batch is _END:
                        source = _close(source)
                        for p in self._prefetchers():
                            p.advance(1)
                    else:
                        ahead.append(batch)
                    counted += 1
                if not ahead:
                    if failed is not None:
                        raise failed
                    return
                yield ahead.popleft()
        finally:
            for p in self._prefetchers():
                p.shutdown()
            for m, k in zip(self.modules, previous):
                m.prefetch_lookahead = k
            _close(source)

    def _register(self, batch) -> None:
        inputs = self.ids_fn(batch)
        if not isinstance(inputs, dict):
            raise TypeError(f"ids_fn must return {{module: (input, offsets)}}, got {type(inputs).__name__}")
        missing = [m for m in self.modules if m not in inputs]
        extra = [m for m in inputs if all(m is not n for n in self.modules)]
        if missing or extra:
            raise ValueError(f"ids_fn must return exactly the loader's modules: missing {missing}, unknown {extra}")
        for m in self.modules:
            given = inputs[m]
            if isinstance(given, (tuple, list)):  # (input, offsets): a single table's
                input, offsets = given
                m.prefetch(input) if offsets is None else m.prefetch(input, offsets)
            else:  # a collection's features
                m.prefetch(given)

    def _prefetchers(self) -> list:
        return [p for m in self.modules for p in m._prefetchers()]


_END = object()


def single_module_inputs(module, batch) -> tuple:
    """A single-table module's (input, offsets) of a loader's batch, without ids_fn: batch is the
    forward's input, or a tuple / list starting with it (and with the offsets next, for 1-D input
    to a bag module)."""
    if isinstance(batch, torch.Tensor):
        return batch, None
    if not isinstance(batch, (tuple, list)) or not batch or not isinstance(batch[0], torch.Tensor):
        raise TypeError(f"without ids_fn a batch must be the forward's input tensor or a tuple / list "
                        f"starting with it, got {type(batch).__name__}; pass ids_fn=lambda batch: "
                        "{module: (input, offsets)}")
    takes = module.forward_inputs(batch[0])
    if len(batch) < takes or not all(isinstance(t, torch.Tensor) for t in batch[:takes]):
        raise TypeError(f"without ids_fn a batch for this {type(module).__name__} must start with "
                        f"{takes} tensors (ids, offsets), got {len(batch)} items; "
                        "pass ids_fn=lambda batch: {module: (input, offsets)}")
    return batch[0], batch[1] if takes == 2 else None


def _close(source) -> None:
    """Closes an iterator that can be closed (a generator); returns None."""
    close = getattr(source, "close", None)
    if close is not None:
        close()
