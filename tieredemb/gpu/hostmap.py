"""Host memory pinned and mapped into a GPU's address space, for zero-copy (gpu/moves.py).

Through the CUDA driver API (libcuda, which every NVIDIA driver installs): a failed registration
then leaves no error behind in the runtime for torch's next kernel launch to report as its own.
The range is first advised MADV_DONTFORK, so a process forked later (a DataLoader's workers) gets
no copy of the pinned table and the parent's pages stay the GPU's. The price: in a forked child
the table's rows are not mapped at all, so a child must not read the table (a DataLoader's
workers never do); its release does nothing there.
"""

from __future__ import annotations

import ctypes
import os
import weakref

import torch

_PORTABLE, _DEVICEMAP = 1, 2  # CU_MEMHOSTREGISTER_*: every context; a device address
_OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY
_MADV_DONTFORK, _MADV_DOFORK = 10, 11


def _cuda_error(cu, code: int) -> str:
    text = ctypes.c_char_p()
    cu.cuGetErrorString(code, ctypes.byref(text))
    return f"{text.value.decode() if text.value else 'unknown error'} ({code})"


def _madvise(ptr: int, nbytes: int, advice: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(ptr, nbytes, advice) != 0:
        raise OSError(ctypes.get_errno(), f"madvise({advice}) of the {nbytes} bytes of host rows failed")


def pin_and_map(owner, rows: torch.Tensor, device: torch.device) -> weakref.finalize:
    """Pins rows (a contiguous host tensor starting on a page: HostStore's) and maps them into
    device; every page becomes memory now. Returns the release: a callable (once; later calls do
    nothing) that waits for the device and unregisters the rows, called by itself when owner is
    collected (it keeps rows alive until then). An error (RuntimeError from the driver, OSError)
    changes nothing."""
    ptr, nbytes = rows.data_ptr(), rows.numel() * rows.element_size()
    cu = ctypes.CDLL("libcuda.so.1")
    with torch.cuda.device(device):
        torch.cuda.synchronize()  # (and the device's context is this thread's, for the driver calls)
        _madvise(ptr, nbytes, _MADV_DONTFORK)
        code = cu.cuMemHostRegister_v2(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes),
                                       ctypes.c_uint(_PORTABLE | _DEVICEMAP))
    if code != 0:
        _madvise(ptr, nbytes, _MADV_DOFORK)
        hint = ": the table must fit in host memory, or leave zero_copy off" if code == _OUT_OF_MEMORY else ""
        raise RuntimeError(f"zero_copy: could not pin the table's {nbytes} bytes of host rows and map them into "
                           f"{device}: {_cuda_error(cu, code)}{hint}")
    return weakref.finalize(owner, _unmap, cu, rows, device, os.getpid())


def _unmap(cu, rows: torch.Tensor, device: torch.device, pid: int) -> None:
    if os.getpid() != pid:  # (a forked child: nothing of the rows is mapped or registered here)
        return
    ptr, nbytes = rows.data_ptr(), rows.numel() * rows.element_size()
    with torch.cuda.device(device):
        try:
            torch.cuda.synchronize()  # (no kernel may still read or write the rows)
        finally:
            code = cu.cuMemHostUnregister(ctypes.c_void_p(ptr))
    _madvise(ptr, nbytes, _MADV_DOFORK)
    if code != 0:
        raise RuntimeError(f"unregistering the zero_copy host rows from {device} failed: {_cuda_error(cu, code)}")
