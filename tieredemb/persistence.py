"""Saving and restoring a table: flush, checkpoint, state_dict, export / import, and the step count.

The table's optimizer step count (one step per backward; Adam's bias correction needs it) is
part of the backing store's record: flush() stores it with the rows, atomically (a crash leaves
the old count with the old rows, or the new with the new), checkpoint() snapshots both, and
reopening an SSD table restores it.
"""

from __future__ import annotations

import glob
import json
import numbers
import os

import numpy as np
import torch
from torch import Tensor

from ssd_backend.common import DTYPE_BY_NAME, write_json_atomic

from .optim import RowLayout

# state_dict() of a table above this many bytes raises (it would hold every row in memory at
# once); export_rows() moves such tables chunk by chunk.
STATE_DICT_MAX_BYTES = 8 << 30

# Where earlier versions kept the step count of an SSD table (read once when such a table is
# reopened; flush() then stores it in the store's record).
_OLD_STEP_FILE = "tieredemb_step.json"

# A step count is below this: the native optimizer keeps it as an int64.
STEP_LIMIT = 1 << 63


def restored_step(store, ssd_path: str | None) -> int:
    """The step count stored with the table (0 for a new one)."""
    if "step" in store.state:
        return check_step(store.state["step"], f"ssd_path {ssd_path}: the stored step", "as flush() stores it")
    old = None if ssd_path is None else os.path.join(ssd_path, _OLD_STEP_FILE)
    if old is not None and os.path.exists(old):
        try:
            with open(old) as f:
                return int(json.load(f)["step"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"ssd_path {ssd_path}: {_OLD_STEP_FILE} is damaged ({e})") from None
    return 0


class Persistence:
    """The saving and restoring half of a tiered module (mixed into it): needs self._store (a
    TableStore), self.config (a TableConfig), self.step, self.layout, self.width."""

    def flush(self) -> None:
        """Returns when every update made before it is in the backing store (durable on SSD),
        with the step count."""
        self._store.flush({"step": self.step})

    def checkpoint(self, path) -> None:
        """A consistent snapshot of an SSD-backed table (rows, optimizer state, step count) at
        path, a new directory, which opens as a table (ssd_path=path)."""
        self._store.checkpoint(os.fspath(path), {"step": self.step})

    # -- export / import ----------------------------------------------------------------------
    def iter_rows(self, chunk_rows: int = 1 << 18):
        """Yields (ids [k], weights [k, D], optimizer_state [k, S]) over every row ever written,
        in id order, chunk by chunk; rows not listed hold their deterministic initial values."""
        check_chunk_rows(chunk_rows)
        self._check_open("its rows are read where it is reopened")  # (a host table's rows answered)
        start = 0
        while True:
            ids = self._store.written_ids(start, chunk_rows)
            if len(ids) == 0:
                return
            rows = self._store.read(ids)
            yield ids, self.layout.weights(rows), self.layout.state(rows)
            start = int(ids[-1]) + 1

    def export_rows(self, directory, chunk_rows: int = 1 << 18) -> int:
        """Writes the table to directory (chunk files, then meta.json) in bounded memory.
        Returns the rows written."""
        check_chunk_rows(chunk_rows)  # (before an earlier export there is removed)
        self._check_open("its rows are exported where it is reopened")
        return write_export(directory, self.iter_rows(chunk_rows), {**self.config.meta(), "step": self.step})

    def import_rows(self, directory) -> int:
        """Loads what export_rows wrote into this table (the same rows, dim and optimizer state
        width; any dtype), which must have no row written yet (rows the export leaves out then
        read as this table's initial values). The export is checked whole (its meta, every
        chunk's shapes and ids, their count) before any row is written. Returns rows."""
        self._check_open("a row imported now would be lost")
        meta = read_export_meta(directory, self.config.meta())
        chunks = check_chunks(directory, meta, self.config.embedding_dim, self.layout.state_width)
        refuse_written(directory, self._store.written_ids(0, 1), type(self).__name__)
        total = import_chunks(chunks, self.write_rows)
        self.step = meta["step"]
        return total

    # -- state_dict for tables that fit in memory ---------------------------------------------
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """torch's, but a strict load with the weight missing or a key not the table's raises before
        any row is written (torch loads what it can, then raises; a table inside a model loaded by
        the model's load_state_dict does that)."""
        if strict and not self._state_in_collection:
            refuse_unmatched_keys(type(self).__name__, state_dict, set(TABLE_KEYS), {"weight"})
        return super().load_state_dict(state_dict, strict, assign)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self._state_in_collection:  # (its collection saves its rows, table by table)
            return
        self._check_open("its rows are saved where it is reopened")
        ids = torch.arange(self.config.num_embeddings)
        save_rows(destination, prefix, self._read_all(ids), self.layout, self.config.dtype, self.step)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if self._state_in_collection:
            return
        if strict:  # (as torch's modules report keys under their prefix that are not theirs)
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k[len(prefix):] not in TABLE_KEYS)
        n, d = self.config.num_embeddings, self.config.embedding_dim
        found = rows_in_state_dict(state_dict, prefix, n, d, self.layout.state_width, missing_keys, error_msgs)
        if found is None:
            return
        w, st, step = found
        self.write_rows(torch.arange(n), w, st)
        if step is not None:
            self.step = step

    _state_in_collection = False

    def _read_all(self, ids: Tensor) -> Tensor:
        """Stored rows of ids (every row of the table, or of one of a collection's tables), unless
        that is more than state_dict() holds."""
        size = len(ids) * self.width * 4
        if size > STATE_DICT_MAX_BYTES:
            raise RuntimeError(f"state_dict() would hold {size} bytes (> {STATE_DICT_MAX_BYTES}); "
                               "use export_rows() for tables this large")
        return self._store.read(ids)


def check_chunk_rows(chunk_rows) -> None:
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows {chunk_rows!r} must be an int >= 1")


TABLE_KEYS = ("weight", "optimizer_state", "optimizer_step")  # a table's entries of a state_dict, by save_rows


def save_rows(destination: dict, prefix: str, rows: Tensor, layout, dtype: torch.dtype, step: int) -> None:
    """A table's entries of a state_dict: prefix + weight (in the table's dtype), optimizer_state,
    optimizer_step."""
    destination[prefix + "weight"] = layout.weights(rows).to(dtype)
    destination[prefix + "optimizer_state"] = layout.state(rows).clone()
    destination[prefix + "optimizer_step"] = torch.tensor(step)


def rows_in_state_dict(state_dict, prefix: str, n: int, d: int, state_width: int, missing_keys: list,
                       error_msgs: list):
    """(weight [n, d], optimizer_state [n, S] or None, step or None) of a table in state_dict, or
    None with the key missing, or a shape, dtype (not floating point) or device (meta) wrong (said
    in missing_keys / error_msgs). A state of another width (another optimizer's) is left out: the
    rows keep theirs."""
    key = prefix + "weight"
    if key not in state_dict:
        missing_keys.append(key)
        return None
    w = state_dict[key]
    if tuple(w.shape) != (n, d):
        error_msgs.append(f"size mismatch for {key}: {tuple(w.shape)} vs ({n}, {d})")
        return None
    st = state_dict.get(prefix + "optimizer_state")
    if st is not None and (st.dim() != 2 or st.shape[1] != state_width):
        st = None
    elif st is not None and st.shape[0] != n:
        error_msgs.append(f"size mismatch for {prefix}optimizer_state: {tuple(st.shape)} vs ({n}, {state_width})")
        return None
    for name, t in ((key, w), (prefix + "optimizer_state", st)):
        if t is None:
            continue
        if not t.dtype.is_floating_point:
            error_msgs.append(f"{name} must be floating point, got {t.dtype}")
            return None
        if t.device.type == "meta":
            error_msgs.append(f"{name} is on the meta device: it holds no values to load")
            return None
    step = state_dict.get(prefix + "optimizer_step")
    if step is None:
        return w, st, None
    if isinstance(step, Tensor):
        good = step.dim() == 0 and not step.dtype.is_floating_point and step.dtype != torch.bool
        step = step.item() if good else step
    try:
        step = check_step(step, f"{prefix}optimizer_step", "a 0-d integer tensor, as state_dict saves it")
    except ValueError as e:
        error_msgs.append(str(e))
        return None
    return w, st, step


def check_step(step, what: str, form: str) -> int:
    """step as an int if it is a step count: an integer (not a bool) in [0, 2**63); else ValueError
    naming what, its form (how it is saved) and the value."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or not 0 <= step < STEP_LIMIT:
        raise ValueError(f"{what} must be an integer >= 0 ({form}) and < 2**63 (the optimizer counts steps in an "
                         f"int64), got {step!r}")
    return int(step)


def refuse_unmatched_keys(module: str, state_dict, keys: set, required: set) -> None:
    """For a strict load_state_dict, before anything is written: RuntimeError (torch's message)
    if state_dict holds a key not in keys or lacks one of required."""
    unexpected = [k for k in state_dict if k not in keys]
    missing = sorted(k for k in required if k not in state_dict)
    msgs = ([f"Unexpected key(s) in state_dict: {', '.join(repr(k) for k in unexpected)}. "] if unexpected
            else []) + ([f"Missing key(s) in state_dict: {', '.join(repr(k) for k in missing)}. "] if missing else [])
    if msgs:
        raise RuntimeError(f"Error(s) in loading state_dict for {module}:\n\t" + "\n\t".join(msgs))


def write_export(directory, chunks, meta: dict) -> int:
    """chunks (ids, weights, optimizer_state) as chunk files in directory, then meta.json (meta
    and the rows written): the format export_rows writes. Returns the rows written."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    # An earlier export there goes first, its meta.json before its chunks: an export that stops
    # part way leaves no meta.json (import refuses it), and no old chunk is read with the new ones.
    for old in [os.path.join(directory, "meta.json")] + glob.glob(os.path.join(directory, "chunk_*.pt")):
        if os.path.exists(old):
            os.remove(old)
    total = 0
    for k, (ids, w, s) in enumerate(chunks):
        torch.save({"ids": ids, "weights": w, "state": s}, os.path.join(directory, f"chunk_{k:06d}.pt"))
        total += len(ids)
    write_json_atomic(os.path.join(directory, "meta.json"), {**meta, "rows": total})
    return total


def _state_words(meta: dict, where: str) -> int:
    """The optimizer state's words in a row of a table's meta: its width less the pad and the
    weights' words (which depend on its dtype: a meta without one is float32's)."""
    name = meta.get("dtype", "float32")
    if name not in DTYPE_BY_NAME:  # (the stores' names of the same three dtypes)
        raise ValueError(f"{where}: dtype {name!r} is not one of {sorted(DTYPE_BY_NAME)}")
    weights = RowLayout(meta["embedding_dim"], DTYPE_BY_NAME[name], 0).weight_words
    return meta["width"] - meta.get("row_pad", 0) - weights


def read_export_meta(directory, mine: dict) -> dict:
    """The meta.json of an export at directory, checked against a table's meta (mine): the same
    rows, dim and optimizer state width (rows of any alignment and any dtype import: the chunks
    hold the weights as float32 and the state; a 16-bit table rounds them to the nearest, as
    load_state_dict does), and its step a step count (check_step), else ValueError naming the
    field. Its "step" is then an int (0 where it has none)."""
    directory = os.fspath(directory)
    path = os.path.join(directory, "meta.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{directory} holds no export (no meta.json): export_rows writes one")
    with open(path) as f:
        meta = json.load(f)
    for field, ours, theirs in (("num_embeddings", mine["num_embeddings"], meta["num_embeddings"]),
                                ("embedding_dim", mine["embedding_dim"], meta["embedding_dim"]),
                                ("optimizer state width", _state_words(mine, "this table"),
                                 _state_words(meta, directory))):
        if theirs != ours:
            raise ValueError(f"{directory}: exported {field} {theirs} != this table's {ours}")
    meta["step"] = check_step(meta.get("step", 0), f"{path}: step", "as export_rows writes it")
    return meta


def check_chunks(directory, meta: dict, dim: int, state_width: int) -> list[str]:
    """The chunk files of an export (meta: its meta.json, read_export_meta's), checked before any
    row is written: numbered from 0 without a gap, each {ids int64 [k] in [0, rows), weights [k,
    dim], state [k, state_width or 0]} (weights and state floating point), no id listed twice in
    the export, and as many rows in all as meta.json says. ValueError naming the file and the
    rule. (Read mapped: the rows themselves are not read here; the ids are, and a bit per row of
    the table marks those listed: 125 MB for 10^9 rows.)"""
    directory = os.fspath(directory)
    paths = sorted(glob.glob(os.path.join(directory, "chunk_*.pt")))
    for k, path in enumerate(paths):
        if os.path.basename(path) != f"chunk_{k:06d}.pt":
            raise ValueError(f"{directory}: chunk_{k:06d}.pt is missing (found {os.path.basename(path)})")
    rows, total = meta["num_embeddings"], 0
    listed = np.zeros((rows + 7) // 8, np.uint8)
    for path in paths:
        try:
            c = torch.load(path, mmap=True)
            ids, w, st = c["ids"], c["weights"], c["state"]
        except Exception as e:  # (a damaged or foreign file: torch's error, named)
            raise ValueError(f"{path}: not a readable chunk of an export ({type(e).__name__}: {e})") from None
        k = len(ids) if isinstance(ids, Tensor) and ids.dim() == 1 else -1
        state_ok = isinstance(st, Tensor) and st.dim() == 2 and st.shape[0] == k and st.shape[1] in (0, state_width)
        if k < 0 or ids.dtype != torch.int64 or not isinstance(w, Tensor) or tuple(w.shape) != (k, dim) or not state_ok:
            raise ValueError(f"{path}: a chunk holds ids int64 [k], weights [k, {dim}] and state [k, {state_width}] "
                             f"(or [k, 0]), got {_shapes(ids, w, st)}")
        if k and not (0 <= int(ids.min()) and int(ids.max()) < rows):
            raise ValueError(f"{path}: ids must lie in [0, {rows}), got [{int(ids.min())}, {int(ids.max())}]")
        if not (w.dtype.is_floating_point and st.dtype.is_floating_point):
            raise ValueError(f"{path}: weights and state must be floating point, got {w.dtype} and {st.dtype}")
        _mark_listed(path, ids, listed)
        total += k
    if total != meta.get("rows", total):
        raise ValueError(f"{directory}: its chunks hold {total} rows, its meta.json says {meta['rows']}: a chunk "
                         f"is missing or damaged")
    return paths


def _mark_listed(path: str, ids: Tensor, listed: np.ndarray) -> None:
    """Marks a chunk's ids (in range) in listed (a bit per row of the table), ValueError if one is
    listed twice in the chunk or was by an earlier chunk (write_rows would refuse the one, and the
    other would keep the last chunk's value)."""
    s = ids.sort().values.numpy()
    twice = np.flatnonzero(s[1:] == s[:-1])
    if len(twice):
        raise ValueError(f"{path}: id {int(s[twice[0]])} is listed twice in this chunk; an export lists each id once")
    byte, bit = s >> 3, np.left_shift(1, s & 7).astype(np.uint8)
    earlier = np.flatnonzero(listed[byte] & bit)
    if len(earlier):
        raise ValueError(f"{path}: id {int(s[earlier[0]])} is listed in an earlier chunk too; an export lists each "
                         "id once")
    first = np.flatnonzero(np.diff(byte, prepend=-1))  # (ids sorted: each byte's bits together)
    listed[byte[first]] |= np.bitwise_or.reduceat(bit, first)


def _shapes(*tensors) -> str:
    return ", ".join(f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__ for t in tensors)


def refuse_written(directory, written: Tensor, table: str) -> None:
    """ValueError if a table importing an export has rows written already (written: some of their
    ids): the rows the export leaves out would keep them, not read as their initial values."""
    if len(written):
        raise ValueError(f"cannot import {os.fspath(directory)} into {table}: it has rows written already (id "
                         f"{int(written[0])}); an import fills a table with none, so that rows the export leaves out "
                         f"read as their initial values (import into a new table)")


def import_chunks(paths: list[str], write) -> int:
    """Each chunk (check_chunks' paths) given to write(ids, weights, optimizer_state or None).
    Returns rows."""
    total = 0
    for path in paths:
        c = torch.load(path)
        write(c["ids"], c["weights"], c["state"] if c["state"].shape[1] else None)
        total += len(c["ids"])
    return total
