"""Compiles every Triton kernel of tieredemb/gpu, in every specialization the package launches,
to machine code for an NVIDIA GPU (argv[1]: compute capability, e.g. 90 for an H100), with no
GPU present: Triton's own launcher binds the arguments (its real specialization of each one),
then compiles through ptxas to a cubin instead of launching. Run by tests/test_gpu_compile.py in
a process of its own (without TRITON_INTERPRET, which chooses the interpreter at import).
Prints one line per kernel compiled: name, then the constexpr values, the barriers in its PTX, and
the cubin's bytes. With argv[2] == "accesses", instead: how wide the global accesses of the moves
and of the lookup's kernels are, by row width (accesses()); with "16x2", the 16-bit integer adds in
the update kernel's machine code (sixteen_bit_adds())."""

from __future__ import annotations

import itertools
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, said out loud

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


class Offline:
    """The active driver: names the GPU to compile for and launches nothing."""

    def __init__(self, capability: int):
        self.target = GPUTarget("cuda", capability, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def main() -> None:
    driver.set_active(Offline(int(sys.argv[1])))
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        constants = {k: v for k, v in kwargs.items() if k.isupper()}
        print(self.fn.__name__, constants, kernel.asm["ptx"].count("bar.sync"), len(kernel.asm["cubin"]), flush=True)
        return kernel

    JITFunction.run = compile_only

    import tieredemb
    from tieredemb.gpu import checks, dedup, moves, plan_kernels, pooling, rowinit
    from tieredemb.gpu.direct_index import DirectIndex
    from tieredemb.gpu.index import SetIndex
    from tieredemb.tiers.rowstore import RowInit

    # the set-associative plan's kernels: each policy, with and without partitions, overflow rows
    # in use and a window; 32 ways (the default) and 4
    for parts in (None, ((100, 40), (60, 24))):
        for ways in (32, 4):
            for policy in ("lru", "lfu"):
                index = SetIndex(64, policy, torch.device("cpu"), ways=ways, overflow=8, partitions=parts)
                ids = torch.arange(20)
                out = [torch.empty(20, dtype=torch.int64), torch.empty(20, dtype=torch.int32)]
                for in_use in (0, 1):
                    index.overflow_in_use = in_use
                    plan_kernels.find(ids, torch.tensor([20]), index, *out)
                    plan_kernels.lookup(ids, index, out[0])
                for window in (None, (ids, ids)):
                    plan_kernels.assign(out[1], ids, index, window, out[0])
    # the rest of a plan, and its commit: the dirty victims' rows carried or not
    index = SetIndex(64, "lru", torch.device("cpu"), ways=4, overflow=8)
    ids, found = torch.arange(20), torch.full((20,), -1)
    for guess in (0, 5):
        placed = plan_kernels.place(ids, torch.tensor([20]), 100, index, found, found, torch.zeros(72, 9), guess)
    plan_kernels.bind(placed, 2)
    plan_kernels.bind(placed, None)  # (its count read on the device: a queued plan's)
    plan_kernels.release(ids, index.pins)
    for lingering in (False, True):
        for pin in (False, True):
            plan_kernels.commit(ids, placed, index, lingering, pin)

    # zero-copy moves: rows moved, and dirty victims noted written (the written bits kept on the
    # device); misses swapped in, their victims out. (160, 129): rows padded to 128-byte lines, their
    # pad left out (row_alignment)
    for width, words in ((9, 9), (32, 32), (129, 129), (160, 129)):
        rows = torch.zeros(20, width)
        written, found = torch.zeros(20, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64)
        moves.move_rows(rows, ids, rows, ids, words=words)
        for count in (None, torch.tensor([7])):  # (and with counts read on the device: a queued residency's)
            moves.move_rows(rows, ids, rows, ids, written=written, count=count, src_from=4, words=words)
            for victims in (None, ids):
                moves.swap_rows(rows, ids, victims, rows, ids, mark=5, written=written, found=found, count=count,
                                words=words)
            # (the victims staged in device memory, written down apart: ZeroCopy.write_back)
            moves.swap_rows(rows, ids, ids, rows, ids, mark=5, written=written, found=found, count=count,
                            staging=torch.zeros(20, width), words=words)

    for n in (1, 3000):  # a batch's dedup (n = 1: no scan to read), of device ids and of host ids as int32
        for dtype, sentinel in ((torch.int64, checks.SENTINEL64), (torch.int32, checks.SENTINEL32)):
            dedup.dedup(torch.zeros(n, dtype=dtype))
            dedup.dedup(torch.zeros(n, dtype=dtype), sentinel)  # (ids after the last bag left out)
    # device inputs' checks: ids of either type, with offsets of either type or none, include_last_offset
    # or not, narrowed to int32 or not (a table of more than 2^31 - 1 rows)
    for n in (1, 3000):
        for ids_type in (torch.int64, torch.int32):
            for offsets in (None, torch.tensor([0, 1]), torch.tensor([0, 1], dtype=torch.int32)):
                for last in ((False, True) if offsets is not None else (False,)):
                    for rows in (1000, 1 << 40):
                        checks.check_on_device(torch.zeros(n, dtype=ids_type), offsets, rows, last)
        # a collection's features, one run each (of one type, and of both)
        for types in ((torch.int64,), (torch.int32,), (torch.int64, torch.int32)):
            checks.check_runs_on_device([torch.zeros(n, dtype=t) for t in types], [1000] * len(types), None)

    opts = [tieredemb.SGD(lr=0.1), tieredemb.Adagrad(lr=0.1), tieredemb.RowWiseAdagrad(lr=0.1),
            tieredemb.MomentumScaledRowWiseAdagrad(lr=0.1, scale=4), tieredemb.Adam(lr=0.1)]
    g = torch.Generator().manual_seed(0)
    # a dim Triton compiles in as a constant, one column block, the benchmarks' 128, several
    # blocks; 40 occurrences: more than a tile at every dim but 1, so hot rows' partial sums too
    for dim in (1, 8, 128, 200):
        unique = torch.arange(10)
        inverse = torch.randint(0, 10, (40,), generator=g)
        offsets = torch.tensor([0, 3, 10, 40])
        grad = torch.zeros(3, dim)
        for weights, width in ((0, dim + 2 * dim), (1, dim // 2 + 2 * dim), (2, dim // 2 + 2 * dim)):
            pool = torch.zeros(40, width)
            dirty = torch.zeros(40, dtype=torch.uint8)
            for mode, skip in itertools.product((0, 1, 2), (-1, 3)):  # (3: a padding row left out of the bags)
                pooling.forward(pool, dim, unique, unique, inverse, offsets, None, mode, skip, weights)
            for skip in (-1, 3):
                pooling.forward(pool, dim, unique, unique, inverse, offsets, torch.ones(40), 0, skip, weights)
            # bags placed in a wider block (a collection's [B, sum of dims]), each way
            block, at = torch.zeros(3, 2 * dim), torch.tensor([0, 2 * dim, dim])
            for mode in (0, 1, 2):
                pooling.forward(pool, dim, unique, unique, inverse, offsets, None, mode, -1, weights, block, at)
            pooling.forward(pool, dim, unique, unique, inverse, offsets, torch.ones(40), 0, -1, weights, block, at)
            saved = (None, torch.ones(3), torch.zeros(3, dim, dtype=torch.int64))  # (the forward's, by mode)
            for mode in (0, 1, 2):
                pooling.backward_update(pool, dirty, dim, unique, unique, torch.tensor([10]), inverse, offsets,
                                        torch.ones(40) if mode == 0 else None, mode, -1, 1, block, saved[mode],
                                        opts[2], 2, mode == 0, weights, False, 7, at)
            for mode in (0, 1, 2):
                for opt in opts:
                    for stochastic in ((False, True) if weights else (False,)):
                        # every optimizer on float32 sums; the other modes and the 16-bit weights
                        # (both roundings) with row-wise Adagrad
                        if not ((weights, mode) == (0, 0) or opt.kind == 2):
                            continue
                        if weights and mode:
                            continue
                        for step, sr_seed in ((1, 1), (2, 7)):  # (Triton compiles 1s in as constants)
                            pooling.backward_update(pool, dirty, dim, unique, unique, torch.tensor([10]), inverse,
                                                    offsets, None, mode, -1, 1, grad,
                                                    saved[mode], opt, step, mode == 0, weights,
                                                    stochastic, sr_seed)
            for opt in opts:  # (a CUDA graph's update: its scalars, the rate among them, on the device)
                pooling.backward_update(pool, dirty, dim, unique, unique, torch.tensor([10]), inverse, offsets, None,
                                        0, -1, 1, grad, None, opt, 2, False, weights, bool(weights), 7,
                                        scalars=pooling.step_scalars(pool.device))
            for rows in (None, torch.arange(10)):
                for kind, seed in ((0, 1), (1, 5), (2, 0)):
                    rowinit.init_rows(unique, pool, rows, dim, kind, 0.0, 1.0, seed, 1, weights)
            for kind, seed in ((0, 1), (1, 5)):  # (a tier's misses: only the rows marked as never stored)
                rowinit.init_rows(unique, pool, unique, dim, kind, 0.0, 1.0, seed, 1, weights, marked=0x7FA55A5A)
                # (a zero-copy residency queued without a wait: the misses' count read on the device)
                rowinit.init_rows(unique, pool, unique, dim, kind, 0.0, 1.0, seed, 1, weights, marked=0x7FA55A5A,
                                  count=torch.tensor([4]))
            # a whole-table tier's residency, rows drawn as they are first missed
            direct = DirectIndex(40, torch.device("cpu"))
            for kind, seed in ((0, 1), (1, 5)):
                init = RowInit(dim, kind, 0.0, 1.0, seed, 1, weights)
                plan_kernels.draw(unique, torch.tensor([10]), direct, pool, init, torch.empty(10, dtype=torch.int64))


def accesses() -> None:
    """argv[2] == "accesses": the move, swap, forward and update kernels compiled for rows of
    width words of which the first `words` move (or, for the forward and the update, are the
    weights: dim 128 with row-wise Adagrad), one line each: kernel, width, words, then its global
    loads and stores of 16 bytes and of 4 (counted in its PTX), and the registers a thread ptxas
    gives it ("?" if it says none)."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    driver.set_active(Offline(int(sys.argv[1])))
    launch = JITFunction.run
    last = {}

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        last["ptx"] = kernel.asm["ptx"]
        return kernel

    JITFunction.run = compile_only
    import tieredemb
    from tieredemb.gpu import moves, pooling

    def report(name, width, words):
        ptx = last["ptx"]
        counts = [ptx.count(f"{op}.global.{kind}") for op in ("ld", "st") for kind in ("v4.b32", "b32")]
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "k.ptx")
            with open(path, "w") as f:
                f.write(ptx)
            arch = re.search(r"\.target (sm_\w+)", ptx).group(1)
            done = subprocess.run([get_ptxas(int(sys.argv[1])).path, "-v", f"--gpu-name={arch}", path, "-o",
                                   os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
        regs = re.search(r"Used (\d+) registers", done.stdout + done.stderr)
        print(name, width, words, *counts, regs.group(1) if regs else "?", flush=True)

    ids, count = torch.arange(20), torch.tensor([7])  # (a queued residency's: its count on the device)
    for width, words in ((128, 128), (160, 160), (160, 129), (129, 129)):
        rows = torch.zeros(20, width)
        moves.move_rows(rows, ids, rows, ids, words=words, count=count)
        report("move", width, words)
        written, found = torch.zeros(20, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64)
        moves.swap_rows(rows, ids, ids, rows, ids, mark=5, written=written, found=found, words=words,
                        count=count, staging=torch.zeros(20, width))
        report("swap", width, words)
    unique, offsets = torch.arange(10), torch.tensor([0, 3, 10, 40])
    inverse = torch.randint(0, 10, (40,), generator=torch.Generator().manual_seed(0))
    for width in (129, 160):
        pooling.forward(torch.zeros(40, width), 128, unique, unique, inverse, offsets, None, 0, -1, 0)
        report("forward", width, 128)
        pooling.backward_update(torch.zeros(40, width), torch.zeros(40, dtype=torch.uint8), 128, unique, unique,
                                torch.tensor([10]), inverse, offsets, None, 0, -1, 1, torch.zeros(3, 128), None,
                                tieredemb.RowWiseAdagrad(lr=0.1), 2, True, 0, False, 7)
        report("update", width, 128)


def sixteen_bit_adds() -> None:
    """argv[2] == "16x2": the update kernel for 16-bit weights rounded stochastically, each pooling
    mode, its rate passed or read from the device (a CUDA graph's), one line each: its constants,
    then the 16-bit integer adds in its machine code (cuobjdump -sass: VIADD.16x2 and kin). ptxas of
    CUDA 12.8 and 12.9 (Triton 3.6) compiled such an add of 1 as an add of 0 in one lane of four
    in the max-pooling update (bench/RESULTS.md, thirty-fourth session); the kernel now has none."""
    import re
    import subprocess
    import tempfile

    from triton import knobs

    driver.set_active(Offline(int(sys.argv[1])))
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        if self.fn.__name__ == "_update_kernel":
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "k.cubin")
                with open(path, "wb") as f:
                    f.write(kernel.asm["cubin"])
                sass = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", path], capture_output=True, text=True,
                                      check=True).stdout
            constants = {k: kwargs[k] for k in ("MODE", "WEIGHTS", "STOCHASTIC", "LR_READ")}
            print(constants, len(sass.splitlines()), len(re.findall(r"\.16x2\b", sass)), flush=True)
        return kernel

    JITFunction.run = compile_only
    import tieredemb
    from tieredemb.gpu import pooling

    dim, unique, offsets = 16, torch.arange(10), torch.tensor([0, 3, 10, 40])
    inverse = torch.randint(0, 10, (40,), generator=torch.Generator().manual_seed(0))
    saved = (None, torch.ones(3), torch.zeros(3, dim, dtype=torch.int64))  # (the forward's, by mode)
    for weights in (1, 2):
        pool, dirty = torch.zeros(40, (dim + 1) // 2 + dim), torch.zeros(40, dtype=torch.uint8)
        for mode in (0, 1, 2):
            for scalars in (None, pooling.step_scalars(torch.device("cpu"))):
                pooling.backward_update(pool, dirty, dim, unique, unique, torch.tensor([10]), inverse, offsets, None,
                                        mode, -1, 1, torch.zeros(3, dim), saved[mode], tieredemb.SGD(lr=0.1), 2,
                                        False, weights, True, 7, scalars=scalars)


if __name__ == "__main__":
    {"accesses": accesses, "16x2": sixteen_bit_adds}.get(sys.argv[2] if sys.argv[2:] else None, main)()
