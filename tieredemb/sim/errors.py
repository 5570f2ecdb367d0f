"""The simulator's error (bad input to tieredemb.sim: policy, capacity, mode, sizes). Bad keys or
batch offsets raise tieredemb.trace.TraceError instead: they are a trace's content."""


class SimError(ValueError):
    """Bad simulator input: the message names the value and the rule."""


def too_wide(batch: int, rows: int, tier: int, capacity: int) -> SimError:
    """The engine's error for a batch whose unique rows do not fit a tier."""
    return SimError(f"batch {batch} needs {rows} rows in tier {tier} (capacity {capacity}): the simulator needs a "
                    f"batch's unique rows to fit in every tier (the engine lends such a batch overflow slots, which "
                    f"the simulator does not model); simulate sizes of at least the widest batch")


def check_below(keys, nkeys: int) -> None:
    """SimError for the first key past a simulator's nkeys keys (its arrays hold that many; the
    kernels do not check)."""
    if keys.size and keys.max() >= nkeys:
        i = int((keys >= nkeys).argmax())
        raise SimError(f"key {int(keys[i])} at lookup {i} is beyond this simulator's {nkeys} keys")
