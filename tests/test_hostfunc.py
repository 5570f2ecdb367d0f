"""Host calls (tieredemb/gpu/hostfunc.py) on the CPU: no stream, so each runs at once, and what one
raises is kept and raised by the next call, as on a GPU (tests/test_gpu.py queues them on a stream)."""

import pytest

from tieredemb.gpu.hostfunc import HostCalls


def test_without_a_stream_each_call_runs_at_once_in_order():
    calls, seen = HostCalls(None), []
    for k in range(3):
        calls.queue(lambda k=k: seen.append(k))
        assert seen == list(range(k + 1))
    assert calls.ran == 3 and calls.pending() == 0
    calls.raise_error()  # (none raised)


def test_what_a_call_raises_is_kept_and_raised_by_every_later_call():
    calls, seen = HostCalls(None), []

    def fails():
        raise OSError("the disk is gone")

    calls.queue(fails)  # (as on the driver's thread: nothing raised where it ran)
    assert calls.ran == 1 and isinstance(calls.error, OSError)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="the disk is gone") as info:
            calls.raise_error()
        assert isinstance(info.value.__cause__, OSError)
        with pytest.raises(RuntimeError, match="the disk is gone"):
            calls.queue(lambda: seen.append(1))
    assert seen == [] and calls.ran == 1  # (nothing queued after the error)


def test_a_call_is_dropped_by_the_next_queue_not_where_it_ran():
    """What a callable holds (a pinned block, on a GPU) is let go on the queuing thread: freeing
    pinned memory calls CUDA, which the driver's thread must not."""
    import gc
    import weakref

    class Held:
        pass

    calls, held = HostCalls(None), Held()
    gone = weakref.ref(held)
    calls.queue(lambda held=held: None)
    del held
    gc.collect()
    assert gone() is not None  # (kept after it ran)
    calls.queue(lambda: None)
    gc.collect()
    assert gone() is None
