"""Saving and restoring a table: flush, checkpoint, state_dict, export / import, and the step count.

The table's optimizer step count (one step per backward; Adam's bias correction needs it) is
part of the backing store's record: flush() stores it with the rows, atomically (a crash leaves
the old count with the old rows, or the new with the new), checkpoint() snapshots both, and
reopening an SSD table restores it.
"""

from __future__ import annotations

import glob
import json
import os

import torch
from torch import Tensor

from ssd_backend.common import write_json_atomic

# state_dict() of a table above this many bytes raises (it would hold every row in memory at
# once); export_rows() moves such tables chunk by chunk.
STATE_DICT_MAX_BYTES = 8 << 30

# Where earlier versions kept the step count of an SSD table (read once when such a table is
# reopened; flush() then stores it in the store's record).
_OLD_STEP_FILE = "tieredemb_step.json"


def restored_step(store, ssd_path: str | None) -> int:
    """The step count stored with the table (0 for a new one)."""
    if "step" in store.state:
        return int(store.state["step"])
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
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        total = 0
        for k, (ids, w, s) in enumerate(self.iter_rows(chunk_rows)):
            torch.save({"ids": ids, "weights": w, "state": s}, os.path.join(directory, f"chunk_{k:06d}.pt"))
            total += len(ids)
        write_json_atomic(os.path.join(directory, "meta.json"), {**self.config.meta(), "step": self.step, "rows": total})
        return total

    def import_rows(self, directory) -> int:
        """Loads what export_rows wrote into this table (same shape and optimizer). Returns rows."""
        directory = os.fspath(directory)
        with open(os.path.join(directory, "meta.json")) as f:
            meta = json.load(f)
        mine = self.config.meta()
        for field in ("num_embeddings", "embedding_dim", "width"):
            if meta[field] != mine[field]:
                raise ValueError(f"{directory}: exported {field} {meta[field]} != this table's {mine[field]}")
        total = 0
        for path in sorted(glob.glob(os.path.join(directory, "chunk_*.pt"))):
            c = torch.load(path)
            self.write_rows(c["ids"], c["weights"], c["state"] if c["state"].shape[1] else None)
            total += len(c["ids"])
        self.step = meta.get("step", 0)
        return total

    # -- state_dict for tables that fit in memory ---------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        rows = self._all_rows()
        destination[prefix + "weight"] = self.layout.weights(rows).to(self.config.dtype)
        destination[prefix + "optimizer_state"] = self.layout.state(rows).clone()
        destination[prefix + "optimizer_step"] = torch.tensor(self.step)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
            return
        w = state_dict[key]
        n, d = self.config.num_embeddings, self.config.embedding_dim
        if tuple(w.shape) != (n, d):
            error_msgs.append(f"size mismatch for {key}: {tuple(w.shape)} vs ({n}, {d})")
            return
        st = state_dict.get(prefix + "optimizer_state")
        if st is not None and st.shape[1] != self.layout.state_width:
            st = None
        self.write_rows(torch.arange(n), w, st)
        if prefix + "optimizer_step" in state_dict:
            self.step = int(state_dict[prefix + "optimizer_step"])

    def _all_rows(self) -> Tensor:
        size = self.config.num_embeddings * self.width * 4
        if size > STATE_DICT_MAX_BYTES:
            raise RuntimeError(f"state_dict() would hold {size} bytes (> {STATE_DICT_MAX_BYTES}); "
                               "use export_rows() for tables this large")
        return self._store.read(torch.arange(self.config.num_embeddings))
