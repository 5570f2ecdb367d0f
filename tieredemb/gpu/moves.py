"""Rows moved between tier 0's pool and the host rows below it by the GPU itself (zero-copy, as
FBGEMM's UVM table is read): the host rows are pinned and mapped into the device's address space
(gpu/hostmap.py), so a kernel reads a miss's row straight from host memory, and writes a
dirty victim's row straight back, over the bus: no staging block, no host copy, no wait.

Two kernels, copying 32-bit words (any weights' dtype: rows are words):
- move_rows: dst[dst_rows[i]] = src[src_rows[i]], either way;
- swap_rows: a residency's misses, each in the slot it takes: the slot's dirty victim written
  down, then the miss read into it, by one program, as FBGEMM's cache insert does. Each of the
  bus's directions then carries its rows while the other does (two launches, one after the
  other, left one idle at a time). Or the victim's row goes to a staging block in device memory
  (staging=), and move_rows writes the block down later, on another stream: the lookup waits for
  the misses' reads only (ZeroCopy's write-back; on an H100, 20K rows of 129 words: read alone
  237-314 us, swapped both ways 415-566).

Which host rows were ever written is kept on the device (`written`: a uint8 per row of the
table): a miss is read only where written[id] != 0, else its slot's first word gets the DEFERRED
mark and rowinit.init_rows(marked=...) draws it on the device, as the host store's deferred reads
leave them; a row written down sets written[id] = WROTE. The host learns of those later, in one
pass (ZeroCopy.settle): a residency then needs nothing from the host but the plan's counts.

Both may move only each row's first words (words=): a table whose rows are padded to a whole
number of 128-byte lines (TableConfig.row_alignment) moves the words that hold values, each row
starting on a line, and leaves the pad out.

On CPU tensors (the tests, under TRITON_INTERPRET=1) the "mapped" rows are the host rows
themselves: the same kernels, the same words.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import PerMultiprocessor, launch_turn, programs

# Launch shape: rows a program moves, warps per program, the most words of a row a program moves
# at once, and the programs (gpu.programs), each taking blocks of rows a grid's stride apart. Rows
# and warps measured on an H200 (twenty-first session: 16 x 4 within a few % of the best). Words:
# 256 moves a row of 129 words in one round, 64 in three (129 of a padded row's 160: two, and the
# last word in a round of its own, _split); alone, on an H100 (twenty-fifth session, 20K rows of
# 129 words each way), 256 took 255 us host->device against 314 and swapped them in 512 against
# 566; but zero-copy's training step ran 3-4 % slower at 256 in both of two calls (82.5 and 82.8 M
# lookups/s against 85.7 and 85.6 at 64). Then one program a block of rows: a queued residency's
# lists are as long as the batch's distinct ids may be (163840), its count (~21K misses) on the
# device, so ~90 % of the programs found nothing to do and left, and at 256 words (226 registers a
# thread: half the programs resident per multiprocessor) those empty programs drained more slowly.
# Now a few programs per multiprocessor take the blocks up to the count (not yet timed on a GPU).
# Module constants, so that bench/gpu_kernels.py --moves and bench_gpu.py --move-shape can try
# others.
MOVE_ROWS, MOVE_WARPS, MOVE_COLS = 16, 4, 64
MOVE_PROGRAMS = PerMultiprocessor(8)
WROTE = 2  # written[id] of a row the device wrote down and the host has not yet been told of (1: told)


@triton.jit(do_not_specialize=["n", "src_from"])
def _move_kernel(src_ptr, src_rows_ptr, dst_ptr, dst_rows_ptr, n, count_ptr, width, words, head, src_from,
                 written_ptr, WRITTEN: tl.constexpr, COUNTED: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                 TAIL: tl.constexpr, SPLIT: tl.constexpr):
    """Entries below n (COUNTED: below count[0] too), ROWS at a time from ROWS * program on, a
    grid's stride apart, whose src_rows[i] >= src_from and dst_rows[i] >= 0: the first words of
    dst[dst_rows[i]] = those of src[src_rows[i]] (rows of width int32 words; the first head of the
    words, then, with SPLIT, the rest: _launch); WRITTEN: written[dst_rows[i]] = WROTE."""
    end = tl.minimum(n, tl.load(count_ptr)) if COUNTED else n
    for base in range(tl.program_id(0) * ROWS, end, tl.num_programs(0) * ROWS):
        i = base + tl.arange(0, ROWS)
        live = i < end
        src_row = tl.load(src_rows_ptr + i, mask=live, other=-1)
        live = live & (src_row >= src_from) & (src_row >= 0)
        dst_row = tl.load(dst_rows_ptr + i, mask=live, other=-1)
        live = live & (dst_row >= 0)
        dst_row = tl.maximum(dst_row, 0)
        if WRITTEN:
            tl.store(written_ptr + dst_row, tl.full((ROWS,), 2, tl.uint8), mask=live)  # (WROTE)
        src = src_ptr + tl.maximum(src_row, 0)[:, None] * width
        dst = dst_ptr + dst_row[:, None] * width
        for c0 in range(0, head, COLS):
            _move_cols(src, dst, c0 + tl.arange(0, COLS)[None, :], head, live)
        if SPLIT:  # (the rest after a head moved 16 bytes an access: _launch)
            for c0 in range(head, words, TAIL):
                _move_cols(src, dst, c0 + tl.arange(0, TAIL)[None, :], words, live)


@triton.jit(do_not_specialize=["n", "mark"])
def _swap_kernel(pool_ptr, slots_ptr, victims_ptr, host_ptr, ids_ptr, n, count_ptr, width, words, head, mark,
                 written_ptr, found_ptr, staging_ptr, VICTIMS: tl.constexpr, STAGED: tl.constexpr,
                 COUNTED: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, TAIL: tl.constexpr,
                 SPLIT: tl.constexpr):
    """Entries below n (COUNTED: below count[0] too; a slot < 0 takes nothing), ROWS at a time
    from ROWS * program on, a grid's stride apart: slot s = slots[i]'s row written to host row
    victims[i] where that is >= 0 (VICTIMS; STAGED: to staging row i instead; written[victims[i]]
    = WROTE), then host row ids[i] read into slot s where written[ids[i]] != 0 (those added to
    found[0]), else slot s's first word = mark. Rows of width words, of which the first words move
    (the first head of them, then, with SPLIT, the rest: _launch)."""
    end = tl.minimum(n, tl.load(count_ptr)) if COUNTED else n
    for base in range(tl.program_id(0) * ROWS, end, tl.num_programs(0) * ROWS):
        i = base + tl.arange(0, ROWS)
        live = i < end
        slot = tl.load(slots_ptr + i, mask=live, other=-1)
        live = live & (slot >= 0)
        row_id = tl.load(ids_ptr + i, mask=live, other=0)
        stored = live & (tl.load(written_ptr + row_id, mask=live, other=0) != 0)
        tl.atomic_add(found_ptr, tl.sum(stored.to(tl.int64)))
        victim = tl.load(victims_ptr + i, mask=live & VICTIMS, other=-1)
        leaves = live & (victim >= 0)
        if VICTIMS:
            tl.store(written_ptr + tl.maximum(victim, 0), tl.full((ROWS,), 2, tl.uint8), mask=leaves)  # (WROTE)
        pool = pool_ptr + slot[:, None] * width
        host = host_ptr + row_id[:, None] * width
        down = (staging_ptr + i[:, None] * width) if STAGED else (host_ptr + tl.maximum(victim, 0)[:, None] * width)
        for c0 in range(0, head, COLS):
            _swap_cols(pool, host, down, c0 + tl.arange(0, COLS)[None, :], head, stored, leaves, VICTIMS)
        if SPLIT:  # (the rest after a head moved 16 bytes an access: _launch)
            for c0 in range(head, words, TAIL):
                _swap_cols(pool, host, down, c0 + tl.arange(0, TAIL)[None, :], words, stored, leaves, VICTIMS)
        # (the mark: after the first chunk's barrier, so after every read of the victim's first word)
        tl.store(pool_ptr + slot * width, tl.full((ROWS,), mark, tl.int32), mask=live & ~stored)


@triton.jit
def _move_cols(src, dst, cols, end, live):
    """_move_kernel's columns cols (those below end) of its rows (live): from src to dst."""
    m = live[:, None] & (cols < end)
    tl.store(dst + cols, tl.load(src + cols, mask=m), mask=m)


@triton.jit
def _swap_cols(pool, host, down, cols, end, stored, leaves, VICTIMS: tl.constexpr):
    """_swap_kernel's columns cols (those below end) of its rows: the victims' (leaves) read from
    pool and written to down, the misses' (stored) read from host into pool."""
    inside = cols < end
    coming = tl.load(host + cols, mask=stored[:, None] & inside)
    if VICTIMS:  # (both loads in flight at once, then both stores)
        m = leaves[:, None] & inside
        leaving = tl.load(pool + cols, mask=m)
        tl.debug_barrier()  # (every thread's read of the slot before any thread's write to it)
        tl.store(down + cols, leaving, mask=m)
    tl.store(pool + cols, coming, mask=stored[:, None] & inside)


def _grid(n: int, src: torch.Tensor, dst: torch.Tensor, cap=None) -> tuple:
    """A move's programs, counted for the device it runs on: the side that is not host memory (host
    rows mapped into the device are CPU tensors to torch: counted by them, a move that writes them
    down would get the programs of one multiprocessor)."""
    device = dst.device if dst.device.type != "cpu" else src.device
    return (programs(triton.cdiv(n, MOVE_ROWS), MOVE_PROGRAMS if cap is None else cap, device),)


def _launch_args(width: int, words: int) -> dict:
    return dict(ROWS=MOVE_ROWS, COLS=min(MOVE_COLS, triton.next_power_of_2(words)), TAIL=_TAIL,
                SPLIT=width % _TAIL == 0 and words % _TAIL != 0, num_warps=MOVE_WARPS)


def _launch(width: int, words: int) -> tuple[int, dict]:
    """A move's head (the words its first loop moves) and its launch's constants: with SPLIT, the
    head _split gives and the rest in a loop of its own; else all the words in the first loop."""
    args = _launch_args(width, words)
    return (_split(words) if args["SPLIT"] else words), args


def _split(words: int) -> int:
    """The head of a row's words moved: the most that are a multiple of 16, which Triton is told
    of (it specializes an int argument that is), so that where rows start on 64-byte lines (a
    width that is a multiple of 16, as row_alignment >= 64 makes it) the kernels move the head 16
    bytes an access, and the rest of the words (fewer than 16) a word an access. Masked by words
    alone, 129 words of 160 moved a word an access (the PTX: ld.global.b32 where 128 or 160 of 160
    compile to ld.global.v4.b32). Only then (SPLIT: rows on lines, words not a multiple of 16) is
    the rest's loop compiled: rows of 129 words cannot start on lines, and that loop costs
    registers (for sm_90: the swap kernel at 129 words 128 a thread against 119, the move kernel
    72 against 64, which leaves 7 of its 8 programs a multiprocessor resident)."""
    return words // _TAIL * _TAIL


_TAIL = 16  # the columns of the words after the head, in one round


def _words(words: int | None, width: int) -> int:
    if words is None:
        return width
    if not 1 <= words <= width:
        raise ValueError(f"words={words}: the words of a row moved must be from 1 to the row's {width}")
    return words


def move_rows(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor, *,
              written: torch.Tensor | None = None, count: torch.Tensor | None = None, src_from: int = 0,
              programs=None, words: int | None = None) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] (float32 [*, width] words, the same width; rows int64
    [n], on the device) for each entry whose src_rows[i] >= max(src_from, 0) and dst_rows[i] >= 0
    (the others move nothing). Either side may be host rows mapped into the device
    (gpu/hostmap.py). written (uint8 [rows of dst], on the device): written[dst_rows[i]] = WROTE.
    count (an int64 on the device): only the first count[0] entries move, the lists' length being
    the most there may be (no wait for the count). programs: the launch's cap (gpu.programs;
    None: MOVE_PROGRAMS). words: only each row's first words move (a RowLayout's `words`: its pad
    left out); None: all. Queued on the current stream."""
    n, width = dst_rows.numel(), dst.shape[1]
    if src.shape[1] != width:
        raise ValueError(f"rows of {src.shape[1]} words moved into rows of {width}: the widths must match")
    words = _words(words, width)
    if n == 0:
        return
    head, args = _launch(width, words)
    with launch_turn():
        _move_kernel[_grid(n, src, dst, programs)](src.view(torch.int32), src_rows, dst.view(torch.int32),
                                                   dst_rows, n, dst_rows if count is None else count, width,
                                                   words, head, src_from, dst_rows if written is None else written,
                                                   WRITTEN=written is not None, COUNTED=count is not None, **args)


def swap_rows(pool: torch.Tensor, slots: torch.Tensor, victims: torch.Tensor | None, host: torch.Tensor,
              ids: torch.Tensor, *, mark: int, written: torch.Tensor, found: torch.Tensor,
              count: torch.Tensor | None = None, staging: torch.Tensor | None = None,
              words: int | None = None) -> None:
    """A residency's misses into their slots (pool: the device rows; host: the host rows, mapped;
    float32 [*, width] words, the same width; slots, victims, ids: int64 [n] on the device): for
    each entry i, pool[slots[i]] written to host[victims[i]] first where victims[i] >= 0 (victims
    None: none has one), then host[ids[i]] read into pool[slots[i]] where written[ids[i]] != 0
    (written: uint8 [host rows] on the device; found, int64 [1], gains those), else pool[slots[i]]'s
    first word = mark (an int32). written[victims[i]] = WROTE. No victim may be another entry's id
    (a row written down and read back by one residency: move_rows it down before). count: as
    move_rows'. staging (float32 [at least n, width] on the device): the victims' rows go to
    staging[i], not to the host rows (written[victims[i]] = WROTE all the same), for a later
    move_rows(staging, rows i, host, victims) to write down off the critical path (ZeroCopy's
    write-back). words: as move_rows'. Queued on the current stream."""
    n, width = slots.numel(), pool.shape[1]
    if host.shape[1] != width:
        raise ValueError(f"host rows of {host.shape[1]} words swapped with rows of {width}: the widths must match")
    if staging is not None and (staging.shape[1] != width or staging.shape[0] < n):
        raise ValueError(f"a staging block of {tuple(staging.shape)} for {n} rows of {width} words: too small")
    words = _words(words, width)
    if n == 0:
        return
    pool_words = pool.view(torch.int32)
    head, args = _launch(width, words)
    with launch_turn():
        _swap_kernel[_grid(n, pool, host)](pool_words, slots, slots if victims is None else victims,
                                           host.view(torch.int32), ids, n, slots if count is None else count, width,
                                           words, head, mark, written, found,
                                           pool_words if staging is None else staging.view(torch.int32),
                                           VICTIMS=victims is not None, STAGED=staging is not None,
                                           COUNTED=count is not None, **args)
