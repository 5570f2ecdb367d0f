"""numba building blocks shared by the reuse analysis (reuse.py) and the simulator (tieredemb.sim):
the kernel decorators, two LLVM intrinsics, and the one-line notice of a cold compile cache.

Importing this module imports numba (about 0.2 s); calling the first compiled function costs
numba's target set-up (about 0.3 s) whether it is loaded from the cache or not.
"""

from __future__ import annotations

import contextlib
import sys

import numba
from llvmlite import ir
from numba.core import cgutils, event
from numba.extending import intrinsic

# Every kernel: compiled once to the on-disk cache, GIL released, and without numba's reference
# counting (_nrt=False: arrays come in from Python and are never allocated inside), which otherwise
# costs atomic increments on every call and measured 20-50x slower per lookup.
kernel = numba.njit(cache=True, nogil=True, _nrt=False)
# The per-lookup path, inlined into its callers: a call passes every array as a struct (up to a
# hundred words per call here), which LLVM does not inline away for functions this size.
inline = numba.njit(cache=True, nogil=True, _nrt=False, inline="always")


@intrinsic
def prefetch(typingctx, arr, idx):
    """prefetch(arr, i): asks the CPU to bring arr[i] (1-D) into cache; the per-key tables are
    far larger than the caches and the loop is otherwise bound by their load latency."""
    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])  # read, keep, data
        return context.get_dummy_value()
    return numba.types.void(arr, idx), codegen


@intrinsic
def popcount(typingctx, x):
    """Number of set bits of a uint64 (one instruction: llvm.ctpop)."""
    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i64, [i64]), "llvm.ctpop.i64")
        return builder.call(fn, [args[0]])
    return numba.types.uint64(numba.types.uint64), codegen


class _FirstCompile(event.Listener):
    """Prints `line` to `stream` once, when numba starts compiling one of tieredemb's functions (a
    cache miss; loads from the on-disk cache raise no compile event). numba's own, such as a typed
    Dict's constructor, compile in every process: they say nothing."""

    def __init__(self, line: str, stream):
        self.line, self.stream, self.said = line, stream, False

    def on_start(self, event):
        fn = getattr((event.data or {}).get("dispatcher"), "py_func", None)
        if not self.said and getattr(fn, "__module__", "tieredemb").startswith("tieredemb"):
            self.said = True
            print(self.line, file=self.stream, flush=True)

    def on_end(self, event):
        pass


@contextlib.contextmanager
def compile_notice(command: str, stream=None):
    """Inside the block, the first numba compilation prints one line to `stream` (default stderr):
    the cache is cold, and a first run compiles for up to 20 s. Nothing when the cache is warm."""
    line = (f"tieredemb {command}: compiling numba kernels (first run only, up to about 20 s; later runs load "
            f"them from numba's cache)")
    with event.install_listener("numba:compile", _FirstCompile(line, stream or sys.stderr)):
        yield
