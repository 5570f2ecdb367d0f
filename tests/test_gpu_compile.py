"""Every Triton kernel of tieredemb/gpu compiles to machine code for an H100 (sm_90), in every
specialization the package launches, on a machine with no GPU: the interpreter (test_gpu_tier.py)
checks what the kernels compute, and this checks that a GPU can run them at all. Triton
compiles some arguments in as constants (an int equal to 1, say), which the interpreter never
does: a first training step (step 1) once failed to compile this way."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")


def test_every_kernel_compiles_for_an_h100():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = os.path.join(os.path.dirname(__file__), "gpu_compile_child.py")
    done = subprocess.run([sys.executable, child, "90"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    compiled = [line.split(" ", 1)[0] for line in done.stdout.splitlines()]
    assert set(compiled) == {"_forward_kernel", "_psw_grad_kernel", "_chunk_kernel", "_update_kernel",
                             "_init_rows_kernel", "_find_kernel", "_assign_kernel", "_draw_kernel", "_group_kernel",
                             "_prep_kernel", "_tally_kernel", "_place_kernel", "_bind_kernel", "_commit_kernel",
                             "_release_kernel", "_move_kernel", "_swap_kernel", "_check_kernel"}
    assert len(compiled) > 200  # every specialization of the child's list reached the compiler
    sizes = [int(line.rsplit(" ", 1)[1]) for line in done.stdout.splitlines()]
    assert min(sizes) > 1000  # each a cubin, not an empty shell
    # A program's threads that read a row's mark must all have read it before any of them draws
    # the row over it: a barrier between, which the interpreter (one program run whole) cannot
    # show the need of. (The kernel has no other: a count of them finds it. _draw_kernel has one
    # too, but runs as one warp, and its reductions' barriers would hide it from a count.)
    marking = [line for line in done.stdout.splitlines()
               if line.startswith("_init_rows_kernel ") and "'MARKED': True" in line]
    assert len(marking) > 4 and all(int(line.rsplit(" ", 2)[1]) >= 1 for line in marking), marking
    # So must a slot's victim be read by all of a program's threads before any writes its miss over
    # it, whether the victim goes down or to a staging block (the swap kernel's barriers: its only
    # ones, as it reduces nothing but the count found, a sum whose own barrier a count above 1 sets
    # apart)
    swapping = [line for line in done.stdout.splitlines()
                if line.startswith("_swap_kernel ") and "'VICTIMS': True" in line]
    plain = [line for line in done.stdout.splitlines()
             if line.startswith("_swap_kernel ") and "'VICTIMS': False" in line]
    assert len(swapping) == 16 and len(plain) == 8  # (the victims written down, or staged: 8 each)
    assert sum("'STAGED': True" in line for line in swapping) == 8
    assert min(int(line.rsplit(" ", 2)[1]) for line in swapping) > max(int(line.rsplit(" ", 2)[1]) for line in plain)


def test_rows_that_start_on_lines_move_16_bytes_an_access():
    """Rows padded to 128-byte lines (row_alignment) are read and written 16 bytes an access by
    zero-copy's moves, though only their first 129 words of 160 move (Triton vectorizes only where
    it can prove four neighbouring words all move: the kernels move a head that is a multiple of
    16 words, then the rest), and by the forward kernel; rows of 129 words, 4 bytes off their
    lines, cannot be (the count's control). Counted in each kernel's PTX for an H100."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = os.path.join(os.path.dirname(__file__), "gpu_compile_child.py")
    done = subprocess.run([sys.executable, child, "90", "accesses"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    got = {}
    for line in done.stdout.splitlines():
        kernel, width, words, *counts, _ = line.split()  # (the last: its registers, which Triton's version sets)
        got[kernel, int(width), int(words)] = dict(zip(("ld16", "ld4", "st16", "st4"), map(int, counts)))
    for kernel in ("move", "swap"):
        assert got[kernel, 160, 129]["ld16"] > 0 and got[kernel, 160, 129]["st16"] > 0, got
        assert got[kernel, 160, 160]["ld4"] == 0 and got[kernel, 128, 128]["ld4"] == 0, got
        assert got[kernel, 129, 129]["ld16"] == 0 and got[kernel, 129, 129]["st16"] == 0, got
    assert got["forward", 160, 128]["ld16"] > 0 and got["forward", 160, 128]["ld4"] == 0, got
    assert got["forward", 129, 128]["ld16"] == 0, got
    # (the PTX holds the head's loop whatever its length: the head each launch is given is this)
    from tieredemb.gpu import moves

    assert [moves._split(words) for words in (9, 16, 129, 144, 160)] == [0, 16, 128, 144, 160]


def test_the_stochastic_rounding_update_holds_no_16_bit_integer_add():
    """The update kernel for 16-bit weights rounded stochastically, in every pooling mode, its
    rate passed or read from the device, compiles to machine code without 16-bit integer adds
    (SASS "VIADD.16x2"): ptxas of CUDA 12.8 and 12.9 compiled the rounding's hi = bits(lo) + 1 as an
    add of 0 in one lane of four in the max-pooling update, so every fourth column of an fp16 row
    rounded toward zero, on an H200, where this machine's Triton compiled it right (thirty-fourth
    session). The rounding is now done in 32 bits; this checks no such add came back."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = os.path.join(os.path.dirname(__file__), "gpu_compile_child.py")
    done = subprocess.run([sys.executable, child, "90", "16x2"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 12, lines  # (fp16 and bf16, three modes, the rate passed or read)
    for line in lines:
        sass_lines, adds = map(int, line.rsplit(" ", 2)[1:])
        assert sass_lines > 100 and adds == 0, line
