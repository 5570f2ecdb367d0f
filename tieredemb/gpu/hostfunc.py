"""Host work queued on a CUDA stream (the driver's cuLaunchHostFunc): a Python callable that runs
on the driver's own thread once the work queued on the stream before it is done, the stream's
later work waiting until it returns. No thread of ours waits for the device.

This is how a tier over a store can read its misses in stream order, as FBGEMM's SSD tier queues
its key-value reads between the kernels that find the misses and the ones that place them: the
plan's lists copied to pinned memory, the store read into a pinned block by a host call, the
rows moved into the pool, all queued at once. Its first use is bench/gpu_kernels.py --host-calls,
which times it against the waiting path on a GPU.

Rules for a queued callable (the driver's, and the GIL's):
- it must not call CUDA (no torch op on a device tensor, no launch): the driver forbids it, and a
  call that waits for the stream it runs in never returns;
- it runs with the GIL, taken on the driver's thread: a thread of ours that waits for the stream
  while holding the GIL would never see it run (torch's waits, synchronize() and copies to the
  host, let the GIL go);
- it must not free pinned memory: the last reference to a pinned tensor dropped there would have
  torch's pinned allocator call CUDA. So a callable (and what it holds) is dropped later, by the
  thread that queues the next one;
- what it raises is kept, not lost on the driver's thread: the first error is raised by the next
  raise_error(), and by every one after it (the stream's later work ran without what it was to do).

On CPU tensors (no stream: the tests under Triton's interpreter) a callable runs at once, and what
it raises is kept the same way.
"""

from __future__ import annotations

import ctypes
import itertools
import threading

import torch

_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_calls: dict[int, tuple] = {}  # token -> (HostCalls, callable), until it has run
_tokens = itertools.count(1)
_lock = threading.Lock()
_driver = None


def _run(token) -> None:
    """The driver's thread runs a queued callable (its token as the user data)."""
    with _lock:
        calls, fn = _calls.pop(token)
    calls._run(fn)


_TRAMPOLINE = _HOST_FN(_run)  # (kept alive with the module: the driver holds its address)


def _cu():
    global _driver
    if _driver is None:
        cu = ctypes.CDLL("libcuda.so.1")
        cu.cuLaunchHostFunc.argtypes = (ctypes.c_void_p, _HOST_FN, ctypes.c_void_p)
        cu.cuLaunchHostFunc.restype = ctypes.c_int
        cu.cuStreamIsCapturing.argtypes = (ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))
        cu.cuStreamIsCapturing.restype = ctypes.c_int
        _driver = cu
    return _driver


class HostCalls:
    """Callables queued in order on stream (a torch.cuda.Stream; None: run at once), the first
    error any of them raised kept for raise_error()."""

    def __init__(self, stream=None):
        self.stream = stream
        self.error: BaseException | None = None
        self.ran = 0  # callables run to the end (raising or not)
        self._done: list = []  # callables run, dropped by the next queue() (see the module's rules)

    def queue(self, fn) -> None:
        """fn() queued on the stream after the work queued there so far; the stream's later work
        waits for it to return. Raises the kept error first (nothing more is queued after one)."""
        self.raise_error()
        with _lock:
            self._done.clear()
        if self.stream is None:
            self._run(fn)
            return
        cu, handle, capturing = _cu(), ctypes.c_void_p(self.stream.cuda_stream), ctypes.c_int()
        token = next(_tokens)
        with _lock:
            _calls[token] = (self, fn)
        with torch.cuda.device(self.stream.device):  # (the driver's calls need the device's context current)
            code = cu.cuStreamIsCapturing(handle, ctypes.byref(capturing))
            if code == 0 and capturing.value:  # (a graph's host node would run the token once: see _run)
                code = -1
            elif code == 0:
                code = cu.cuLaunchHostFunc(handle, _TRAMPOLINE, ctypes.c_void_p(token))
        if code != 0:
            with _lock:
                _calls.pop(token, None)
            why = "the stream is being captured as a CUDA graph" if code == -1 else f"CUDA driver error {code}"
            raise RuntimeError(f"a host call cannot be queued on {self.stream}: {why}")

    def _run(self, fn) -> None:
        try:
            fn()
        except BaseException as e:  # (on the driver's thread nothing would see it)
            if self.error is None:
                self.error = e
        finally:
            with _lock:
                self.ran += 1
                self._done.append(fn)

    def raise_error(self) -> None:
        """Raises the first error a queued callable raised (a RuntimeError from it), if one did."""
        if self.error is not None:
            raise RuntimeError(f"a host call queued on {self.stream} failed: {self.error!r}") from self.error

    def pending(self) -> int:
        """Callables queued and not yet run."""
        with _lock:
            return sum(1 for calls, _ in _calls.values() if calls is self)

