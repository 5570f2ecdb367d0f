"""A batch's input checks on the device, so that ids and offsets on the GPU cost the training
thread no wait of their own.

Ids and offsets that live on the GPU are checked there by one kernel launch (ids in
[0, num_embeddings); offsets from 0, non-decreasing, none past the end), which also writes the
int64 bag boundaries and the ids the batch looks up. The host learns the verdict (a DeviceCheck)
where it waits for the device anyway: in the plan's one transfer of a cached tier 0, or with one
read of its own before a whole-table tier 0 draws the batch's rows; for a prefetched batch, on
the prefetch worker, the error then raised by that batch's forward. Either way before anything
changes. A failed check is explained on the host (the inputs read back, the host's checks run on
them), so the error is the one host inputs give, naming the value and the rule.

A collection's features on the GPU (collection.py) are checked the same way, each against its
own table's rows, by one launch for them all (check_runs_on_device); the first group's residency
reads the verdict, before any group changes.

With include_last_offset, the ids after the last bag belong to no bag (torch leaves them out).
Slicing them off would need their count on the host, so they stay, each replaced by SENTINEL (past
every table's rows: never checked, never made resident), and an empty bag is added after the
last: the backward finds them there, in a bag whose gradient is zero. The dedup leaves SENTINEL
out of the distinct ids (gpu/dedup.py).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import triton
import triton.language as tl

from .. import _C
from . import launch_turn, to_device

SENTINEL64 = (1 << 63) - 1
SENTINEL32 = (1 << 31) - 1
_BLOCK = 1024


def check_range(ids: np.ndarray, num_embeddings: int) -> None:
    """IndexError naming an id of ids out of [0, num_embeddings), if there is one (host ids)."""
    if ids.size and (ids.min() < 0 or ids.max() >= num_embeddings):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise IndexError(f"id {bad} out of range [0, {num_embeddings})")


def checked_ids(ids: torch.Tensor, num_embeddings: int, pin: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """Host ids (any shape) checked in [0, num_embeddings) (IndexError naming the first that is not) and
    copied, in the same native pass, into a new host tensor, pinned if pin (ready for an
    asynchronous copy to the GPU, the caller's tensor free to change at once): int32 where every
    id fits (the sort on the device then takes half the radix passes), else int64. out: a
    contiguous host tensor of the ids' size and that dtype to copy into instead."""
    if out is None:
        out = torch.empty(ids.shape, dtype=checked_dtype(num_embeddings), pin_memory=pin)
    src = ids.detach().numpy() if ids.dtype in (torch.int32, torch.int64) else ids.detach().to(torch.int64).numpy()
    _C.checked_copy(np.ascontiguousarray(src).reshape(-1), num_embeddings, out.numpy().reshape(-1))
    return out


def checked_dtype(num_embeddings: int) -> torch.dtype:
    """The dtype checked_ids gives a table's ids."""
    return torch.int32 if num_embeddings <= SENTINEL32 else torch.int64  # (as check_on_device's)


class DeviceCheck:
    """The verdict on a batch's device inputs, on the device: fault int8 [k], nonzero where a
    rule is broken. extra_bag: the boundaries end with an added empty bag (include_last_offset's
    offsets were given); sentinel: then the id that stands for the ids after the last bag, else
    None. explain: raises the host's error for the inputs, read back (the checks host inputs
    get, so the error names the value and the rule). One verdict may cover several lookups (a
    collection's groups): read as passed once, it is not read again."""

    __slots__ = ("fault", "extra_bag", "sentinel", "explain", "passed")

    def __init__(self, fault, extra_bag, sentinel, explain):
        self.fault = fault
        self.extra_bag = extra_bag
        self.sentinel = sentinel if extra_bag else None
        self.explain = explain
        self.passed = False

    def resolve(self) -> None:
        """Reads the verdict (one wait for the device, unless it was read already); raises if a
        rule is broken."""
        if not self.passed:
            self.raise_if(bool(self.fault.any()))

    def raise_if(self, faulty: bool) -> None:
        """Raises the host's error for these inputs if faulty (the verdict, read by the caller)."""
        if not faulty:
            self.passed = True
            return
        self.explain()
        raise _changed()


def _explain(ids: torch.Tensor, offsets: torch.Tensor | None, num_embeddings: int, extra_bag: bool):
    """check_on_device's explain: the host's checks of its inputs (the caller's ids and offsets)."""
    def explain():
        from ..keyed import check_starts

        host = ids.cpu().numpy()
        end = len(host)
        if offsets is not None:
            o = offsets.to("cpu", torch.int64).numpy()
            check_starts(o, end)
            if extra_bag:
                end = int(o[-1])
        check_range(host[:end], num_embeddings)
    return explain


def _changed() -> RuntimeError:
    return RuntimeError("the device found this batch's ids or offsets faulty, and they read as valid now: were "
                        "they changed after they were given (to prefetch() or forward)? (if not, please report this)")


@triton.jit(do_not_specialize=["n", "m", "num_embeddings", "runs"])
def _check_kernel(ids_ptr, n, offsets_ptr, m, num_embeddings, out_ids_ptr, bounds_ptr, fault_ptr, sentinel,
                  runs_ptr, runs, HAS_OFFSETS: tl.constexpr, LAST_GIVEN: tl.constexpr, RUNS: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Positions BLOCK * program 0 onwards. Offsets o[0 .. m-1] (HAS_OFFSETS): bounds[p] = o[p],
    and bounds[m] = o[m-1] (LAST_GIVEN: include_last_offset's, an empty bag added) or n; o[0] must
    be 0, o non-decreasing, none past n. Ids before the bags' end (bounds[m]; n without offsets):
    in [0, num_embeddings), copied to out_ids; ids after it: sentinel. RUNS (instead): the ids are
    runs, run r at positions [starts[r], starts[r + 1]) in [0, rows[r]) (runs_ptr: starts [runs +
    1], then rows [runs]); nothing is written but the verdict. fault[program] = 1 if this program
    found a rule broken, else 0."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bad = tl.zeros([BLOCK], dtype=tl.int1)
    end = n.to(tl.int64)
    if HAS_OFFSETS:
        o_live = p < m
        o = tl.load(offsets_ptr + p, mask=o_live, other=0).to(tl.int64)
        prev = tl.load(offsets_ptr + p - 1, mask=o_live & (p > 0), other=0).to(tl.int64)
        bad = o_live & (((p == 0) & (o != 0)) | (o < prev) | (o > n))
        tl.store(bounds_ptr + p, o, mask=o_live)
        if LAST_GIVEN:
            end = tl.load(offsets_ptr + m - 1).to(tl.int64)
        tl.store(bounds_ptr + p, tl.zeros([BLOCK], dtype=tl.int64) + end, mask=p == m)
    live = p < n
    ids = tl.load(ids_ptr + p, mask=live, other=0).to(tl.int64)
    in_bag = live & (p < end)
    if RUNS:
        limit = tl.zeros([BLOCK], dtype=tl.int64)
        for r in range(runs):  # (a run per feature: few)
            in_run = (p >= tl.load(runs_ptr + r)) & (p < tl.load(runs_ptr + r + 1))
            limit = tl.where(in_run, tl.load(runs_ptr + runs + 1 + r), limit)
        bad = bad | (in_bag & ((ids < 0) | (ids >= limit)))
    else:
        bad = bad | (in_bag & ((ids < 0) | (ids >= num_embeddings)))
        tl.store(out_ids_ptr + p, tl.where(in_bag, ids, sentinel), mask=live)
    tl.store(fault_ptr + tl.program_id(0), tl.max(bad.to(tl.int8), axis=0))


def check_on_device(ids: torch.Tensor, offsets: torch.Tensor | None, num_embeddings: int,
                    include_last_offset: bool = False):
    """ids int [N] on the device; offsets int [B] bag starts (B + 1 with include_last_offset, B >=
    1 then) on the same device, or None -> (ids [N] as the batch looks them up: int32 where every
    id fits, else int64, SENTINEL* after the last bag; bounds int64 [B + 1] (B + 2 with
    include_last_offset: an empty bag added) or None; the DeviceCheck). One kernel launch; waits
    for nothing."""
    n, dev = ids.numel(), ids.device
    ids = ids.contiguous()  # (the kernel reads them as flat arrays)
    offsets = None if offsets is None else offsets.contiguous()
    m = 0 if offsets is None else offsets.numel()
    narrow = num_embeddings <= SENTINEL32  # (ids sort in half the radix passes; SENTINEL32 is no row)
    sentinel = SENTINEL32 if narrow else SENTINEL64
    out = torch.empty(n, dtype=torch.int32 if narrow else torch.int64, device=dev)
    bounds = None if offsets is None else torch.empty(m + 1, dtype=torch.int64, device=dev)
    programs = max(1, triton.cdiv(max(n, m + 1), _BLOCK))
    fault = torch.empty(programs, dtype=torch.int8, device=dev)
    with launch_turn(), torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        _check_kernel[(programs,)](ids, n, offsets if offsets is not None else ids, m, num_embeddings, out,
                                   bounds if bounds is not None else out, fault, sentinel, ids, 0,
                                   HAS_OFFSETS=offsets is not None, LAST_GIVEN=include_last_offset, RUNS=False,
                                   BLOCK=_BLOCK)
    extra_bag = offsets is not None and include_last_offset
    return out, bounds, DeviceCheck(fault, extra_bag, sentinel, _explain(ids, offsets, num_embeddings, extra_bag))


def check_runs_on_device(runs: list, rows: list, explain) -> DeviceCheck:
    """Each of runs (int tensors [n_r] on one GPU, say a collection's features) in [0, rows[r]),
    by one kernel launch over their concatenation; waits for nothing. explain: raises the
    caller's error for a fault (called once the verdict is read)."""
    dev = runs[0].device
    ids = torch.cat([r.reshape(-1) for r in runs]) if len(runs) > 1 else runs[0].reshape(-1).contiguous()
    table = torch.tensor(np.concatenate([np.cumsum([0] + [r.numel() for r in runs]), rows]), dtype=torch.int64)
    return DeviceCheck(_check_runs(ids, to_device(table, dev), len(runs)), False, None, explain)


def check_keyed_on_device(values: torch.Tensor, lengths: torch.Tensor, rows: list) -> tuple:
    """A KeyedJaggedTensor's values [N] and lengths [K * B] (key-major, K = len(rows)) on one GPU:
    key k's ids in [0, rows[k]), by one launch, the keys' boundaries summed from the lengths there;
    then the lengths and that verdict read to the host in one transfer, one wait (where reading
    the lengths to cut the values into features, and then the verdict, took two). Lengths that
    break a rule only misplace the boundaries: the caller checks them on the host first. Returns
    (lengths int64 [K * B] on the host, fault int8 on the device, whether it found a rule broken)."""
    dev, lengths = values.device, lengths.reshape(-1).to(values.device)
    ends = torch.cumsum(lengths.view(len(rows), -1).sum(1, dtype=torch.int64), 0)
    table = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), ends,
                       to_device(torch.tensor(rows, dtype=torch.int64), dev)])
    fault = _check_runs(values.reshape(-1).contiguous(), table, len(rows))
    read = torch.cat([lengths, fault.to(lengths.dtype)]).cpu()  # (as given: int32 lengths read as such)
    return read[:len(lengths)].to(torch.int64), fault, bool(read[len(lengths):].any())


def _check_runs(ids: torch.Tensor, table: torch.Tensor, runs: int) -> torch.Tensor:
    """_check_kernel's RUNS launch over ids (flat, contiguous) with table (starts [runs + 1], then
    rows [runs], int64, on the ids' device) -> the fault flags."""
    dev, n = ids.device, ids.numel()
    programs = max(1, triton.cdiv(n, _BLOCK))
    fault = torch.empty(programs, dtype=torch.int8, device=dev)
    with launch_turn(), torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        _check_kernel[(programs,)](ids, n, ids, 0, 0, ids, ids, fault, 0, table, runs, HAS_OFFSETS=False,
                                   LAST_GIVEN=False, RUNS=True, BLOCK=_BLOCK)
    return fault
