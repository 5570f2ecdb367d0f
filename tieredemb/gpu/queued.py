"""A residency queued without a wait for the device: what zero-copy (gpu/zerocopy.py) and a store
read on the tier's stream (gpu/storeio.py) share. The plan's counts stay on the device
(SetIndex.plan_queued), every move reads its count there, and the counters are added up there
(read by stats()); the subclass moves the rows (queued_work)."""

from __future__ import annotations

from .index import SetIndex


class QueuedResidency:
    """A DeviceTier's queued residencies. releases_since: events after the releases queued since
    the last queued residency (DeviceTier.count_release appends them)."""

    def __init__(self, tier):
        self.tier = tier
        self.releases_since: list = []

    def queues(self, check, allow_overflow: bool) -> bool:
        """Whether a residency is queued without a wait (residency): host ids (no verdict to read),
        overflow allowed, a set-associative index of one part (Triton's)."""
        index = self.tier.index
        return (check is None and allow_overflow and isinstance(index, SetIndex) and index.partitions is None
                and index.kernels == "triton")

    def residency(self, unique, num_unique, pin: bool, allow_overflow: bool = True):
        """DeviceTier.resident(), queued without a wait for the device: the plan's counts stay there
        (SetIndex.plan_queued), every move reads its count there, and the counters are added up
        there (read by stats()). The host's one decision, more overflow slots, is made before the
        plan from what it knows: the overflow slots are kept at least the ids of the batches
        pinned here and of this one, so no plan needs more than are free (the price: up to that
        many rows of tier 0's pool more). That count drops when a release is queued, so the plan
        first waits, on the device, for every release queued since the last one (each on the
        stream that computed with its batch, maybe still behind its backward). The misses are
        counted on the device only (the returned count is 0: the prefetcher's row counters leave
        them out, as they do a whole-table tier's draws). On the tier's stream, as resident's.
        allow_overflow: resident()'s (queues() said whether this one takes such a batch at all)."""
        tier = self.tier
        for event in self._room(unique.numel(), forget=True):
            tier.stream.wait_event(event)
        with tier.index_lock:
            slots = self.queued_work(unique, num_unique, pin)
        return slots, 0, tier.record()

    def forget_done_releases(self) -> None:
        """Drops the releases the device has done (a queued residency's wait for them would be
        none), so that they do not pile up while residencies wait for their plans (device ids; a
        prefetcher's, not allowed overflow, every batch). Orders nothing and waits for nothing."""
        with self.tier.pool_lock:
            self.releases_since = [e for e in self.releases_since if not e.query()]

    def _room(self, n: int, forget: bool) -> list:
        """The overflow slots made at least the ids of the batches pinned here and of n more (rare:
        a batch larger than before, or more of them in flight; a grow waits for the device).
        Returns the releases the host no longer counts, to wait for (forget: no later residency
        needs to wait for them again). The count is read with them, under one lock: a release
        queued after is still counted."""
        tier = self.tier
        with tier.pool_lock:
            released, pinned = self.releases_since, tier.pinned_ids
            if forget:
                self.releases_since = []
        with tier.index_lock:
            short = pinned + n - tier.index.overflow_slots
            if short > 0:
                tier.grow(max(short, tier.index.overflow_slots))
        return list(released)

    def queued_work(self, unique, num_unique, pin: bool, captured: bool = False):
        """A queued residency's device work on the current stream (the plan, the rows moved, the
        commit), under index_lock: its slots."""
        raise NotImplementedError

    def settle(self) -> None:
        """Brings the host's view of what the queued residencies did up to date (the store told,
        the counters added); the caller has ordered the current stream after them."""

    def close(self) -> None:
        """Lets go of what the device may still use (after it is done with it)."""
