"""Prefetch for a collection: a future batch checked and cut into groups once, each group's ids
registered with its engine's prefetcher (prefetch.py), and the forward given the same tensors
taking them as they were prepared.

Every group's prefetcher holds the same batches in the same order. An error once batches are
prefetched (a background one surfacing, a forward out of order) forgets them in every group, so
the groups never disagree about which batch is next.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from .keyed import batch_sources, is_keyed_jagged, same_sources, source_versions


class Prepared(NamedTuple):
    """A batch checked and cut into groups: lookups [(group, engine, (ids, bag boundaries [B + 1],
    per_sample_weights, parts) (see _Collection._batch), take: the (ids, boundaries) its engine
    takes)]; check: the verdict on ids on the tables' GPU, or None; counts {table: ids}. A
    prefetched batch's also: the caller's tensors (batch_sources) and their versions, and each
    group's registration number."""

    lookups: list
    check: object
    counts: dict
    sources: tuple = ()
    versions: tuple = ()
    seqs: tuple = ()


class CollectionPrefetch:
    """The prefetch half of a collection (mixed into _Collection): needs self.engines,
    self._ahead (a deque), self._prepare(features) -> Prepared, self._segments, self._count."""

    def prefetch(self, features) -> None:
        """Registers a future batch (what forward will be given): each group's rows are made
        resident in its tier 0 by a background worker, and stay pinned until that batch's
        backward (as TieredEmbeddingBag.prefetch does). Forwards of prefetched batches must come
        in order. A forward given the very tensors prefetched, unchanged, is not checked or cut
        into groups again; other tensors of the same values are compared. Bad features raise
        here, changing nothing. An error of a prefetched batch (raised by a forward or a later
        prefetch) forgets every prefetched batch: each is then made resident by its forward."""
        self._prune()
        p = self._prepare(features)
        sources = batch_sources(features)
        p = p._replace(sources=sources, versions=source_versions(sources))
        seqs = []
        try:
            for group, engine, batch, take in p.lookups:
                seqs.append(engine._prefetch.register(*take, p.check, source=take,
                                                      segments=self._segments(group, batch[3])))
        except BaseException:
            self._forget_prefetched()
            raise
        self._ahead.append(p._replace(seqs=tuple(seqs)))

    def _prepared(self, features) -> Prepared:
        """forward's batch: the oldest prefetched one, if features are its very tensors,
        unchanged (then checked and cut already); else checked and cut now."""
        self._prune()
        if self._ahead:  # (nothing prefetched: no sources to take)
            sources = batch_sources(features)
            # (weights that need their gradient are cut into groups again: the graph then runs
            # from this forward, whatever grad mode the prefetch ran in)
            if same_sources(self._ahead[0].sources, sources, self._ahead[0].versions) and \
                    not any(isinstance(t, Tensor) and t.requires_grad for t in sources):
                return self._ahead[0]
        return self._prepare(features)

    def _prune(self) -> None:
        """Forgets prefetched batches whose forward ran (or that their prefetchers forgot)."""
        while self._ahead and not self.engines[0]._prefetch.waiting(self._ahead[0].seqs[0]):
            self._ahead.popleft()

    def _forget_prefetched(self) -> None:
        """Every group's prefetched batches forgotten (unpinned), so the groups agree again."""
        self._ahead.clear()
        for e in self.engines:
            e._prefetch.shutdown()

    def _lookup(self, features, run):
        """run(prepared) over features' batch (prefetched or not), counted and recorded; an error
        once prefetched batches exist forgets them all (the groups may have taken different
        numbers of them)."""
        p = self._prepared(features)
        try:
            out = run(p)
        except BaseException:
            if self._ahead or any(e._prefetch.queue for e in self.engines):
                self._forget_prefetched()
            raise
        self._prune()
        self.looked_up = [b[0] for _, _, b, _ in p.lookups]  # each group's ids (tieredemb.record reads them)
        self._count(p.counts)
        return out

    def _prefetchers(self) -> list:
        return [e._prefetch for e in self.engines]

    def _inputs_of(self, batch):
        """What forward takes, from a loader's batch (PrefetchLoader without ids_fn): the batch,
        or the first item of a tuple / list (features, labels, ...)."""
        features = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
        if not (isinstance(features, dict) or is_keyed_jagged(features)):
            raise TypeError(f"without ids_fn a batch for a collection must be its features (a KeyedJaggedTensor or "
                            f"a dict) or a tuple / list starting with them, got {type(batch).__name__}; pass "
                            "ids_fn=lambda batch: {collection: features}")
        return features

    @property
    def prefetch_lookahead(self) -> int:
        """As TieredEmbeddingBag.prefetch_lookahead, for every group."""
        return self.engines[0].prefetch_lookahead

    @prefetch_lookahead.setter
    def prefetch_lookahead(self, k: int) -> None:
        for e in self.engines:
            e.prefetch_lookahead = k

