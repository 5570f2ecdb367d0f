"""Rows moved between tier 0's pool and the host rows below it by the GPU itself (zero-copy, as
FBGEMM's UVM table is read): the host rows are pinned and mapped into the device's address space
(gpu/hostmap.py), so a kernel reads a miss's row straight from host memory, and writes a
dirty victim's row straight back, over the bus: no staging block, no host copy, no wait.

One kernel does both directions: dst[dst_rows[i]] = src[src_rows[i]] for i < n, copying 32-bit
words (any weights' dtype: rows are words). With MARK, an entry whose src_rows[i] < 0 (a row never
written below) gets the DEFERRED mark in its first word instead, and rowinit.init_rows(marked=...)
draws it on the device, as the host store's deferred reads leave them.

Which host rows were ever written may be kept on the device too (`written`: a uint8 per row of
the table): then a miss's source row is its id, read only where written[id] != 0 (else marked),
and a dirty victim written down sets written[id] = WROTE. The host learns of those later, in one
pass (DeviceTier's settle): a residency then needs nothing from the host but the plan's counts.

On CPU tensors (the tests, under TRITON_INTERPRET=1) the "mapped" rows are the host rows
themselves: the same kernel, the same words.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launch_turn

# Launch shape: rows a program moves, warps per program. Not yet measured on a GPU (the H200's
# profile, seventeenth session: 390 us each way a step at these); module constants, so that
# bench/gpu_kernels.py --moves can try others.
MOVE_ROWS, MOVE_WARPS = 16, 4
WROTE = 2  # written[id] of a row the device wrote down and the host has not yet been told of (1: told)


@triton.jit(do_not_specialize=["n", "mark"])
def _move_kernel(src_ptr, src_rows_ptr, dst_ptr, dst_rows_ptr, n, count_ptr, width, mark, written_ptr, found_ptr,
                 MARK: tl.constexpr, SRC_WRITTEN: tl.constexpr, DST_WRITTEN: tl.constexpr, COUNTED: tl.constexpr,
                 ROWS: tl.constexpr, COLS: tl.constexpr):
    """Entries ROWS * program onwards, below n (COUNTED: below count[0] too): dst[dst_rows[i]] =
    src[src_rows[i]] (int32 words); with MARK, dst[dst_rows[i], 0] = mark where src_rows[i] < 0.
    SRC_WRITTEN: a source row counts only where written[src_rows[i]] != 0, and those found are
    added to found[0]; DST_WRITTEN: written[dst_rows[i]] = WROTE."""
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = i < n
    if COUNTED:  # (a row with no slot, dst_rows[i] < 0, moves nowhere: see plan_kernels.bind)
        live = live & (i < tl.load(count_ptr))
    dst_row = tl.load(dst_rows_ptr + i, mask=live, other=0)
    if COUNTED:
        live = live & (dst_row >= 0)
    src_row = tl.load(src_rows_ptr + i, mask=live, other=-1)
    if SRC_WRITTEN:
        stored = tl.load(written_ptr + tl.maximum(src_row, 0), mask=live & (src_row >= 0), other=0)
        src_row = tl.where(stored != 0, src_row, -1)
        tl.atomic_add(found_ptr, tl.sum((live & (src_row >= 0)).to(tl.int64)))
    if DST_WRITTEN:
        tl.store(written_ptr + dst_row, tl.full((ROWS,), 2, tl.uint8), mask=live)  # (WROTE)
    have = live & (src_row >= 0)
    src = src_ptr + tl.maximum(src_row, 0)[:, None] * width
    dst = dst_ptr + dst_row[:, None] * width
    for c0 in range(0, width, COLS):
        cols = c0 + tl.arange(0, COLS)[None, :]
        m = have[:, None] & (cols < width)
        tl.store(dst + cols, tl.load(src + cols, mask=m), mask=m)
    if MARK:
        tl.store(dst_ptr + dst_row * width, tl.full((ROWS,), mark, tl.int32), mask=live & (src_row < 0))


def move_rows(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor, *,
              mark: int | None = None, written: torch.Tensor | None = None, src_written: bool = False,
              found: torch.Tensor | None = None, count: torch.Tensor | None = None) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] (float32 [*, width] words, the same width; rows int64
    [n], on the device); with mark (an int32), dst[dst_rows[i]]'s first word = mark where
    src_rows[i] < 0. Either side may be host rows mapped into the device (gpu/hostmap.py).
    written (uint8 [rows of the host side], on the device): with src_written, a source row
    written[src_rows[i]] == 0 counts as none (marked), and found (int64 [1]) gains the rows that
    were there; else written[dst_rows[i]] = WROTE. count (an int64 on the device): only the
    first count[0] entries move, the lists' length being the most there may be (no wait for the
    count). Queued on the current stream."""
    n = dst_rows.numel()
    if n == 0:
        return
    width = dst.shape[1]
    if src.shape[1] != width:
        raise ValueError(f"rows of {src.shape[1]} words moved into rows of {width}: the widths must match")
    if src_written and found is None:
        raise ValueError("move_rows: src_written counts the rows found into `found`, which is missing")
    with launch_turn():
        _move_kernel[(triton.cdiv(n, MOVE_ROWS),)](src.view(torch.int32), src_rows, dst.view(torch.int32), dst_rows, n,
                                              dst_rows if count is None else count, width, 0 if mark is None else mark,
                                              dst_rows if written is None else written,
                                              dst_rows if found is None else found, MARK=mark is not None,
                                              SRC_WRITTEN=written is not None and src_written,
                                              DST_WRITTEN=written is not None and not src_written,
                                              COUNTED=count is not None, ROWS=MOVE_ROWS,
                                              COLS=min(64, triton.next_power_of_2(width)), num_warps=MOVE_WARPS)
