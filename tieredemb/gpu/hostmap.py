"""Host memory pinned and mapped into a GPU's address space, for zero-copy (gpu/moves.py).

Through the CUDA driver API (libcuda, which every NVIDIA driver installs): a failed registration
then leaves no error behind in the runtime for torch's next kernel launch to report as its own.
The range is first advised MADV_DONTFORK, so a process forked later (a DataLoader's workers) gets
no copy of the pinned table (it has no use for it) and the parent's pages stay the GPU's.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

_PORTABLE, _DEVICEMAP = 1, 2  # CU_MEMHOSTREGISTER_*: every context; a device address
_MADV_DONTFORK, _MADV_DOFORK = 10, 11


def _cuda_error(cu, code: int) -> str:
    text = ctypes.c_char_p()
    cu.cuGetErrorString(code, ctypes.byref(text))
    return f"{text.value.decode() if text.value else 'unknown error'} ({code})"


def pin_and_map(owner, rows: torch.Tensor, device: torch.device) -> weakref.finalize:
    """Pins rows (a contiguous host tensor starting on a page: HostStore's) and maps them into
    device; every page becomes memory now. Returns the release: a callable (once; later calls do
    nothing) that waits for the device and unregisters the rows, called by itself when owner is
    collected (it keeps rows alive until then). RuntimeError, changing nothing, when the driver
    refuses (e.g. too little memory to pin)."""
    ptr, nbytes = rows.data_ptr(), rows.numel() * rows.element_size()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(ptr, nbytes, _MADV_DONTFORK) != 0:
        raise OSError(ctypes.get_errno(), f"madvise(MADV_DONTFORK) of the {nbytes} bytes of host rows failed")
    cu = ctypes.CDLL("libcuda.so.1")
    with torch.cuda.device(device):
        torch.cuda.synchronize()  # (and the device's context is this thread's, for the driver call)
        code = cu.cuMemHostRegister_v2(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes),
                                       ctypes.c_uint(_PORTABLE | _DEVICEMAP))
    if code != 0:
        libc.madvise(ptr, nbytes, _MADV_DOFORK)
        raise RuntimeError(f"zero_copy: could not pin the table's {nbytes} bytes of host rows and map them into "
                           f"{device}: {_cuda_error(cu, code)}; the table must fit in host memory, or leave zero_copy off")
    return weakref.finalize(owner, _unmap, cu, rows, device)


def _unmap(cu, rows: torch.Tensor, device: torch.device) -> None:
    torch.cuda.synchronize(device)  # (no kernel may still read or write the rows)
    code = cu.cuMemHostUnregister(ctypes.c_void_p(rows.data_ptr()))
    if code != 0:
        raise RuntimeError(f"unregistering the zero_copy host rows from {device} failed: {_cuda_error(cu, code)}")
