"""Saving and restoring a collection's tables, each under its own name: state_dict() in TorchRec's
keys, checkpoint(), export / import table by table, and the record of which tables an SSD
directory holds.

A collection keeps the tables of one group in one engine (collection.py), so the engines' own
state_dict entries would be by group ("engines.0.weight") and depend on the grouping. The
collection writes and reads every table's rows itself instead, under TorchRec's keys
(`embedding_bags.<table>.weight` for a bag collection, `embeddings.<table>.weight` unpooled), so a
torchrec EmbeddingBagCollection's state_dict loads into one, and one's into torchrec's (with
strict=False: ours also holds each table's optimizer_state and optimizer_step).

On SSD a group's rows are one store, table after table, under ssd_path/group<k>. Which tables a
store holds, and in what order, is written to ssd_path/collection.json when the collection is
made (before its stores open); a collection opened over the directory must put the same tables
in the same places (else a table would read another's rows), and is refused otherwise, before
any store is opened. (Each store checks its rows' width and meta itself when it opens.)
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import uuid
import warnings

import torch

import ssd_backend
from ssd_backend.common import build_directory, write_json_atomic

from .config import EXPORT_MARKER
from .persistence import (TABLE_KEYS, check_chunk_rows, check_chunks, import_chunks, read_export_meta,
                          refuse_unmatched_keys, refuse_written, rows_in_state_dict, save_rows, write_export)

MANIFEST = "collection.json"
_FORMAT = "tieredemb-collection-1"


class CollectionState:
    """The saving and restoring half of a collection (mixed into _Collection): needs self.tables,
    self.groups, self.engines, and the subclass's _state_prefix."""

    _state_prefix = ""

    def _table_places(self):
        """(table config, its group's engine, its first row in the group) for every table."""
        for group, engine in zip(self.groups, self.engines):
            for t in group.tables:
                yield t, engine, int(group.offsets[t.name])

    # -- state_dict ------------------------------------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for t, engine, base in self._table_places():
            rows = engine._read_all(torch.arange(base, base + t.num_embeddings))
            save_rows(destination, f"{prefix}{self._state_prefix}.{t.name}.", rows, engine.layout, t.dtype, engine.step)

    def _keys(self, prefix: str) -> set:
        return {f"{prefix}{self._state_prefix}.{t.name}.{field}" for t in self.tables
                for field in TABLE_KEYS}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """torch's, but a strict load with a table missing or a key unknown raises before any table
        is written (torch loads what it can, then raises; a collection inside a model loaded by
        the model's load_state_dict does that)."""
        if strict:
            mine = self._keys("")
            refuse_unmatched_keys(type(self).__name__, state_dict, mine, {k for k in mine if k.endswith(".weight")})
        return super().load_state_dict(state_dict, strict, assign)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """Every table's rows (and optimizer state and step, where given) from its keys. A table
        of the wrong shape or dtype, or a group's tables at different steps, is an error, and then
        no table is written; a table missing is said in missing_keys, and the others are loaded."""
        found, errors = [], []
        for t, engine, base in self._table_places():
            key = f"{prefix}{self._state_prefix}.{t.name}."
            got = rows_in_state_dict(state_dict, key, t.num_embeddings, t.embedding_dim, engine.layout.state_width,
                                     missing_keys, errors)
            if got is not None:
                found.append((t, engine, base, *got))
        for engine in self.engines:  # (a group's tables are stepped together: one count)
            steps = {t.name: step for t, e, _, _, _, step in found if e is engine and step is not None}
            if len(set(steps.values())) > 1:
                errors.append(f"tables {sorted(steps)} share a group and so a step count, but their "
                              f"optimizer_step differ: {steps}")
        mine = self._keys(prefix)
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in mine)
        error_msgs.extend(errors)
        if errors:  # (load_state_dict will raise: write nothing)
            return
        for t, engine, base, w, st, step in found:
            engine.write_rows(torch.arange(base, base + t.num_embeddings), w, st)
            if step is not None:
                engine.step = step

    # -- checkpoint ----------------------------------------------------------------------------------
    def checkpoint(self, path) -> None:
        """A consistent snapshot of every table (rows, optimizer state, step counts) at path, a new
        directory, which opens as this collection (ssd_path=path, the same tables and plan). Every
        table must be stored on SSD. It is built beside path (path + '.partial-<pid>') and renamed
        to path once whole: a crash leaves no directory at path."""
        held = [t.name for g in self.groups if g.store != "ssd" for t in g.tables]
        if held:
            raise RuntimeError(f"cannot checkpoint to {path}: tables {held} keep their rows in host memory; "
                               "use export_rows(dir), or store them on SSD (ssd_path, or a plan that does)")
        def build(to: str) -> None:
            os.makedirs(to)
            for engine, group in zip(self.engines, self.groups):
                engine.checkpoint(os.path.join(to, group.directory))
            self._write_manifest(to)

        build_directory(os.fspath(path), build)  # (whole or not at all: a checkpoint cut short opened as a new one)

    # -- export / import -----------------------------------------------------------------------------
    def iter_rows(self, table: str, chunk_rows: int = 1 << 18):
        """Yields (ids [k], weights [k, D], optimizer_state [k, S]) of a table's rows ever written,
        in id order, chunk by chunk; rows not listed hold their deterministic initial values."""
        check_chunk_rows(chunk_rows)
        t, engine, base = self._place_of(table)
        start, end = base, base + t.num_embeddings
        while start < end:
            ids = engine._store.written_ids(start, chunk_rows)
            ids = ids[ids < end]
            if len(ids) == 0:
                return
            rows = engine._store.read(ids)
            yield ids - base, engine.layout.weights(rows), engine.layout.state(rows)
            start = int(ids[-1]) + 1

    def export_rows(self, directory, chunk_rows: int = 1 << 18) -> dict:
        """Writes every table to directory/<table> in bounded memory, in the format of
        TieredEmbeddingBag.export_rows (a table's export imports into a single-table module, and
        such a module's into the collection's table; rows never written are not listed, and read
        as the importing table's initial values). Returns {table: rows written}."""
        check_chunk_rows(chunk_rows)
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        # export.json lists each table's export: this one's tables leave it first (an export cut
        # short leaves them unlisted, and import refuses them), and are listed once all are written.
        # (Another collection's tables exported into the same directory keep their entries.)
        mine = {t.name for t in self.tables}
        listed = {n: v for n, v in _export_record(directory).items() if n not in mine}
        write_json_atomic(os.path.join(directory, EXPORT_MARKER), {"tables": listed})
        export = uuid.uuid4().hex
        out = {}
        for t, engine, _ in self._table_places():
            meta = {**engine.config.meta(), "num_embeddings": t.num_embeddings, "table": t.name, "step": engine.step,
                    "export": export}
            out[t.name] = write_export(os.path.join(directory, t.name), self.iter_rows(t.name, chunk_rows), meta)
        write_json_atomic(os.path.join(directory, EXPORT_MARKER),
                          {"tables": {**listed, **dict.fromkeys(out, export)}})
        return out

    def import_rows(self, directory) -> dict:
        """Loads what export_rows wrote: every table from directory/<table>, into tables with no
        row written yet (rows an export leaves out then read as their initial values). Every
        table's export is checked whole (rows, dim, row width, step, its chunks; a group's tables
        one step count) before any table's row is written. Returns {table: rows}."""
        places = list(self._table_places())
        where = {t.name: os.path.join(os.fspath(directory), t.name) for t, _, _ in places}
        metas = {t.name: read_export_meta(where[t.name], self._export_shape(t, e)) for t, e, _ in places}
        _check_one_export(os.fspath(directory), metas)
        for engine, group in zip(self.engines, self.groups):
            steps = {t.name: metas[t.name]["step"] for t in group.tables}
            if len(set(steps.values())) > 1:
                raise ValueError(f"{directory}: tables {sorted(steps)} share a group and so a step count, but "
                                 f"were exported at different steps: {steps}")
        chunks = {t.name: check_chunks(where[t.name], metas[t.name], t.embedding_dim, e.layout.state_width)
                  for t, e, _ in places}
        for t, engine, base in places:
            written = engine._store.written_ids(base, 1)
            refuse_written(where[t.name], written[written < base + t.num_embeddings] - base, f"table {t.name!r}")
        out = {}
        for t, engine, _ in places:
            out[t.name] = import_chunks(chunks[t.name],
                                        lambda ids, w, s, name=t.name: self.write_rows(name, ids, w, s))
            engine.step = metas[t.name]["step"]
        return out

    @staticmethod
    def _export_shape(t, engine) -> dict:
        return {"num_embeddings": t.num_embeddings, "embedding_dim": t.embedding_dim, "width": engine.width,
                "row_pad": engine.layout.pad, "dtype": str(t.dtype).removeprefix("torch.")}

    def _place_of(self, table: str):
        for place in self._table_places():
            if place[0].name == table:
                return place
        raise KeyError(f"no table {table!r}; tables: {[t.name for t in self.tables]}")

    # -- which tables an SSD directory holds -----------------------------------------------------------
    def _stored_layout(self) -> dict:
        """{group<k>: [[table, rows], ...]} of the groups stored on SSD."""
        return {g.directory: [[t.name, t.num_embeddings] for t in g.tables] for g in self.groups if g.store == "ssd"}

    def _check_manifest(self, ssd_path: str) -> None:
        """Raises ValueError, before any store is opened, if ssd_path holds other tables in a
        group's place than this collection would put there. A directory without a record (made
        before collections kept one) is adopted, with a warning, where every group it needs is
        there (each store still checks its rows' width and meta when opened)."""
        want = self._stored_layout()
        path = os.path.join(ssd_path, MANIFEST)
        present = [g for g in want if os.path.exists(os.path.join(ssd_path, g))]
        if not os.path.exists(path):
            unfinished = [g for g in want if ssd_backend.detect_backend(os.path.join(ssd_path, g)) is None]
            if present and unfinished:
                raise ValueError(f"ssd_path {ssd_path} holds {', '.join(present)} but no whole store in "
                                 f"{', '.join(unfinished)}, and no {MANIFEST} (an unfinished checkpoint?): it is not "
                                 "a whole collection's directory")
            if present:
                warnings.warn(f"ssd_path {ssd_path} has no {MANIFEST}: its groups' tables are now recorded as this "
                              f"collection has them ({self._described(want)}); a collection that puts other tables "
                              "there will be refused", RuntimeWarning, stacklevel=4)
            return
        try:
            with open(path) as f:
                record = json.load(f)
            stored = record["groups"]
            if record.get("format") != _FORMAT or not isinstance(stored, dict):
                raise ValueError(f"format {record.get('format')!r}")
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"ssd_path {ssd_path}: {MANIFEST} is damaged ({e})") from None
        for g in sorted(set(stored) | set(want)):
            if g not in want:
                raise ValueError(f"ssd_path {ssd_path}: {g} holds tables {_names(stored[g])}, which this collection "
                                 "does not store there; give the tables (and plan) it was made with, or move "
                                 f"{g} away")
            if g not in stored and g in present:
                raise ValueError(f"ssd_path {ssd_path} holds {g}, which its {MANIFEST} does not record (a collection "
                                 f"that failed while opening?): move {g} away")
            if g in stored and stored[g] != want[g]:
                raise ValueError(f"ssd_path {ssd_path}: {g} holds tables {_names(stored[g])}, this collection would "
                                 f"put {_names(want[g])} there; give the tables in the order (and with the plan) "
                                 "they were stored with")

    @staticmethod
    def _described(layout: dict) -> str:
        return "; ".join(f"{g}: {_names(entries)}" for g, entries in layout.items())

    def _record_then_open(self, ssd_path, open_groups) -> None:
        """open_groups() under ssd_path's record: checked (_check_manifest), then written with this
        collection's groups before any store opens. If opening fails, the directory is left as it
        was: the record as before, the group directories this attempt made removed. The
        directory is locked (flock) from the check to the end of the opening, so a process
        opening it at the same time waits, and then sees what this one made."""
        if ssd_path is None:
            open_groups()
            return
        ssd_path = os.fspath(ssd_path)
        if not self._stored_layout():  # (no table on SSD: nothing to record, but what is there must agree)
            self._check_manifest(ssd_path)
            open_groups()
            return
        os.makedirs(ssd_path, exist_ok=True)
        fd = os.open(ssd_path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._check_manifest(ssd_path)
            path = os.path.join(ssd_path, MANIFEST)
            before = None
            if os.path.exists(path):
                with open(path) as f:
                    before = json.load(f)
            made = [g for g in self._stored_layout() if not os.path.exists(os.path.join(ssd_path, g))]
            self._write_manifest(ssd_path)
            try:
                open_groups()
            except BaseException:
                for g in made:
                    shutil.rmtree(os.path.join(ssd_path, g), ignore_errors=True)
                if before is None:
                    os.remove(path)
                else:
                    write_json_atomic(path, before)
                raise
        finally:
            os.close(fd)  # (and the lock with it)

    def _write_manifest(self, ssd_path: str) -> None:
        layout = self._stored_layout()
        if layout:
            os.makedirs(ssd_path, exist_ok=True)
            write_json_atomic(os.path.join(ssd_path, MANIFEST), {"format": _FORMAT, "groups": layout})


def _export_record(directory: str) -> dict:
    """{table: export id} of export.json at directory ({} where there is none)."""
    try:
        with open(os.path.join(directory, EXPORT_MARKER)) as f:
            tables = json.load(f)["tables"]
    except FileNotFoundError:
        return {}
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{directory}: {EXPORT_MARKER} is damaged ({e})") from None
    if not isinstance(tables, dict):
        raise ValueError(f"{directory}: {EXPORT_MARKER} is damaged (its tables are not a mapping)")
    return tables


def _check_one_export(directory: str, metas: dict) -> None:
    """ValueError unless each table's export at directory is one a collection's export_rows
    finished: its meta.json names the export export.json lists for it (a re-export cut short
    between two tables left some of each). A table whose meta.json names none (a single table's
    export, or one written before export.json was) is taken as it is."""
    listed = _export_record(directory)
    unfinished = sorted(n for n, m in metas.items() if m.get("export") is not None and listed.get(n) != m["export"])
    if unfinished:
        raise ValueError(f"{directory}: tables {unfinished} are of an export_rows that did not finish (its "
                         f"{EXPORT_MARKER} does not list them): export again")


def _names(entries) -> str:
    return "[" + ", ".join(f"{name} ({rows} rows)" for name, rows in entries) + "]"
