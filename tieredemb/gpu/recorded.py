"""A CUDA graph's twin on CPU tensors: a function's device work recorded as it runs once (the
"capture"), then replayed as recorded: every torch op with the very arguments it was given (the
same tensors, the same Python numbers), every Triton launch (under the interpreter) with its
grid and arguments. The function's Python does not run again.

So what a CUDA graph would get wrong, a replay here gets wrong too, and a test on CPU tensors
shows it: a host value baked into a launch (a counter the host bumps each step), a tensor the
host replaces between replays (the graph keeps writing the old one), a result whose size
depends on the data. And what a capture refuses (a read of a device value on the host, an op
whose output size depends on the data) is refused here, with an error naming the op.

As on a GPU the capture itself does the work once here (on a GPU the capture queues nothing and
its first replay does it): the first replay after a capture returns what the capture computed.
Each replayed op's result is copied into the tensor the capture's run returned (a CUDA graph
writes its outputs in place), so the tensors the function returned stay the outputs.
"""

from __future__ import annotations

import threading

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils._python_dispatch import TorchDispatchMode

from . import launch_turn

# Ops a CUDA capture refuses: they read a device value on the host, or their output's size is data dependent.
_REFUSED = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive",
            "unique_dim", "repeat_interleave", "item", "equal", "is_nonzero"}
# Ops that only allocate: nothing to replay (a graph's allocations are made once, at capture).
_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


class Recorded:
    """fn() run once while its work is recorded; replay() does that work again (see the module)."""

    def __init__(self, fn):
        self.steps: list = []
        with _Recording(self.steps):
            self.outputs = fn()
        self.fresh = True  # (the capture's own run is the first replay's work)

    def replay(self):
        if self.fresh:
            self.fresh = False
        else:
            for step in self.steps:
                step()
        return self.outputs


_ACTIVE = threading.local()  # .recording: the recording this thread is making, if any


def _recorded_launches() -> None:
    """Makes the interpreter's launches pass through one wrapper (`run` below; installed once,
    and again if something replaced it since): each thread's launches are recorded by its own
    recording, whatever another thread's capture does meanwhile (a forward's on one, autograd's
    backward's on another)."""
    from triton.runtime.interpreter import InterpretedFunction

    if getattr(InterpretedFunction.run, "records", False):
        return
    launch = InterpretedFunction.run

    def run(kernel, *args, **kwargs):
        recording = getattr(_ACTIVE, "recording", None)
        if recording is None or recording.inside_launch:
            return launch(kernel, *args, **kwargs)
        recording.steps.append(_Launch(kernel, args, kwargs))
        recording.inside_launch += 1
        try:
            return launch(kernel, *args, **kwargs)
        finally:
            recording.inside_launch -= 1

    run.records = True
    InterpretedFunction.run = run


class _Recording(TorchDispatchMode):
    """Records the torch ops dispatched on this thread and the Triton launches it makes."""

    def __init__(self, steps: list):
        super().__init__()
        self.steps = steps
        self.inside_launch = 0

    def __enter__(self):
        _recorded_launches()
        _ACTIVE.recording = self
        try:
            return super().__enter__()
        except BaseException:
            _ACTIVE.recording = None
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _ACTIVE.recording = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.inside_launch:
            return func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        if name in _REFUSED:
            raise RuntimeError(f"{func.__name__} in a captured graph: it reads a device value on the host or its "
                               "output's size depends on the data (a CUDA graph capture refuses it)")
        out = func(*args, **kwargs)
        if name not in _ALLOCATIONS:
            args, kwargs = tree_map(lambda x: x, (args, kwargs))  # (the containers as they were now)
            self.steps.append(_Op(func, args, kwargs, out))
        return out


class _Op:
    """One torch op as recorded: called again with the same arguments, its result written into
    the recorded output."""

    __slots__ = ("func", "args", "kwargs", "out")

    def __init__(self, func, args, kwargs, out):
        self.func, self.args, self.kwargs, self.out = func, args, kwargs, out

    def __call__(self) -> None:
        new = self.func(*self.args, **self.kwargs)
        olds, _ = tree_flatten(self.out)
        news, _ = tree_flatten(new)
        for old, got in zip(olds, news):
            if not isinstance(old, torch.Tensor):
                continue
            if got.shape != old.shape:
                raise RuntimeError(f"{self.func.__name__} replayed gave shape {tuple(got.shape)}, captured "
                                   f"{tuple(old.shape)}: a graph's shapes are fixed")
            if got.data_ptr() != old.data_ptr() or got.stride() != old.stride():
                old.copy_(got)


class _Launch:
    """One Triton launch as recorded (the interpreter's run, with its grid and arguments)."""

    __slots__ = ("kernel", "args", "kwargs")

    def __init__(self, kernel, args, kwargs):
        self.kernel, self.args, self.kwargs = kernel, args, dict(kwargs)

    def __call__(self) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        with launch_turn():
            InterpretedFunction.run(self.kernel, *self.args, **self.kwargs)
