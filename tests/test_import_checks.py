"""Bad input to import_rows and load_state_dict is refused with an error naming the value and the
rule before anything is written: an export with an id listed twice (in a chunk or across chunks),
integer weights or state, or a step that is not a step count; a state_dict whose optimizer_step
is not one, or (strict) with a key not the table's. The table is left as it was, and a retry with
a good export or state_dict then works (an import refuses a table with rows written)."""

from __future__ import annotations

import json
import re

import pytest
import torch

import tieredemb
from tieredemb import EmbeddingBagConfig, TieredEmbeddingBagCollection

N, D = 40, 4


def trained(**kw):
    """A table three backwards in (Adam: rows, optimizer state and step to carry)."""
    emb = tieredemb.TieredEmbeddingBag(N, D, "sum", optimizer=tieredemb.Adam(lr=0.1), **kw)
    for ids in ([0, 1, 2], [5, 6, 7, 8], [10, 11, 20, 30]):
        emb(torch.tensor(ids), torch.tensor([0])).sum().backward()
    return emb


def on_ssd(tmp_path):
    return tieredemb.TieredEmbeddingBag(N, D, "sum", optimizer=tieredemb.Adam(lr=0.1), cache_rows=4,
                                        ssd_path=tmp_path / "ssd", ssd_options={"backend": "log"}, seed=7)


def stored(emb):
    ids = torch.arange(N)
    return emb.read_rows(ids), emb.read_optimizer_state(ids), emb.step


def assert_same(x, y):
    assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2] == y[2]


def assert_imported(emb, src):
    """emb holds src's rows ever written, their optimizer state, and its step."""
    ids = torch.cat([ids for ids, _, _ in src.iter_rows()])
    assert torch.equal(emb.read_rows(ids), src.read_rows(ids))
    assert torch.equal(emb.read_optimizer_state(ids), src.read_optimizer_state(ids))
    assert emb.step == src.step == 3


def damage_chunk(path, how):
    """Rewrites a chunk file of an export as a user's tool might have."""
    c = torch.load(path)
    if how == "id twice in a chunk":
        c["ids"] = torch.cat([c["ids"][:-1], c["ids"][:1]])
    elif how == "id in an earlier chunk":
        c["ids"] = torch.cat([torch.load(path.parent / "chunk_000000.pt")["ids"][:1], c["ids"][1:]])
    elif how == "integer weights":
        c["weights"] = c["weights"].to(torch.int64)
    else:
        c["state"] = c["state"].to(torch.int32)
    torch.save(c, path)


CHUNK_DAMAGE = {
    "id twice in a chunk": r"chunk_000002.pt: id (\d+) is listed twice in this chunk; an export lists each id once",
    "id in an earlier chunk": r"chunk_000002.pt: id 0 is listed in an earlier chunk too; an export lists each id once",
    "integer weights": r"chunk_000002.pt: weights and state must be floating point, got torch.int64 and torch.float32",
    "integer state": r"chunk_000002.pt: weights and state must be floating point, got torch.float32 and torch.int32",
}


@pytest.mark.parametrize("how", CHUNK_DAMAGE)
def test_an_export_that_would_fail_part_way_is_refused_before_a_row_is_written(tmp_path, how):
    """The last chunk's duplicate id or integer weights failed inside write_rows after the first
    chunks were written (and every retry was then refused: the table had rows); an id in two chunks
    or integer state was taken, the last value kept."""
    src = trained()
    src.export_rows(tmp_path / "exp", chunk_rows=4)  # (11 rows: chunks 0, 1 and 2)
    damage_chunk(tmp_path / "exp" / "chunk_000002.pt", how)
    emb = on_ssd(tmp_path)
    before = stored(emb)
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "exp")) + "/" + CHUNK_DAMAGE[how]):
        emb.import_rows(tmp_path / "exp")
    assert_same(stored(emb), before)
    src.export_rows(tmp_path / "good", chunk_rows=4)
    assert emb.import_rows(tmp_path / "good") == 11
    assert_imported(emb, src)
    emb.close()


def test_a_collection_checks_every_tables_export_before_it_writes_any(tmp_path):
    """Table a was imported, then table b's chunk failed, and a retry was refused for a."""
    tables = [EmbeddingBagConfig("a", N, D, ["fa"]), EmbeddingBagConfig("b", N, D + 4, ["fb"])]

    def collection(**kw):
        return TieredEmbeddingBagCollection(tables, optimizer=tieredemb.Adagrad(lr=0.1), cache_bytes=2000, **kw)

    src = collection()
    src({"fa": (torch.tensor([1, 2, 3]), torch.tensor([0])),
         "fb": (torch.tensor([4, 5]), torch.tensor([0]))}).values().sum().backward()
    src.export_rows(tmp_path / "exp")
    damage_chunk(tmp_path / "exp" / "b" / "chunk_000000.pt", "id twice in a chunk")
    ebc = collection(ssd_path=tmp_path / "ssd")
    ids = torch.arange(N)
    before = {t: (ebc.read_rows(t, ids), ebc.read_optimizer_state(t, ids)) for t in "ab"}
    with pytest.raises(ValueError, match=r"exp/b/chunk_000000.pt: id 4 is listed twice in this chunk"):
        ebc.import_rows(tmp_path / "exp")
    for t in "ab":
        assert torch.equal(ebc.read_rows(t, ids), before[t][0])
        assert torch.equal(ebc.read_optimizer_state(t, ids), before[t][1])
    assert [e.step for e in ebc.engines] == [0, 0]
    src.export_rows(tmp_path / "good")
    assert ebc.import_rows(tmp_path / "good") == {"a": 3, "b": 2}
    for t in "ab":
        assert torch.equal(ebc.read_rows(t, ids), src.read_rows(t, ids))
    assert [e.step for e in ebc.engines] == [1, 1]
    ebc.close()


BAD_STEPS = [-5, "abc", 2.5, 2**63, 2**70, True, None]


@pytest.mark.parametrize("step", BAD_STEPS, ids=repr)
def test_an_exports_step_must_be_a_step_count(tmp_path, step):
    """It was stored as it was (-5, 'abc', 2.5, 2**70), and every later backward failed with an
    unclear error (math domain error, str + int, nanobind's incompatible arguments)."""
    src = trained()
    src.export_rows(tmp_path / "exp", chunk_rows=4)
    meta = json.loads((tmp_path / "exp" / "meta.json").read_text())
    (tmp_path / "exp" / "meta.json").write_text(json.dumps({**meta, "step": step}))
    emb = on_ssd(tmp_path)
    before = stored(emb)
    with pytest.raises(ValueError, match=re.escape(f"exp/meta.json: step must be an integer >= 0 (as export_rows "
                                                   f"writes it) and < 2**63 (the optimizer counts steps in an int64), "
                                                   f"got {step!r}")):
        emb.import_rows(tmp_path / "exp")
    assert_same(stored(emb), before)
    src.export_rows(tmp_path / "good", chunk_rows=4)
    emb.import_rows(tmp_path / "good")
    assert_imported(emb, src)
    emb(torch.tensor([0, 1]), torch.tensor([0])).sum().backward()  # (Adam's bias correction reads the step)
    assert emb.step == 4
    emb.close()


def test_a_collections_export_step_is_checked_too(tmp_path):
    tables = [EmbeddingBagConfig("a", N, D, ["fa"]), EmbeddingBagConfig("b", N, D, ["fb"])]
    src = TieredEmbeddingBagCollection(tables, optimizer=tieredemb.SGD(lr=0.1))
    src({"fa": (torch.tensor([1, 2]), torch.tensor([0])),
         "fb": (torch.tensor([3]), torch.tensor([0]))}).values().sum().backward()
    src.export_rows(tmp_path / "exp")
    for t in "ab":  # (one step for both: the tables share a group)
        meta = json.loads((tmp_path / "exp" / t / "meta.json").read_text())
        (tmp_path / "exp" / t / "meta.json").write_text(json.dumps({**meta, "step": -3}))
    ebc = TieredEmbeddingBagCollection(tables, optimizer=tieredemb.SGD(lr=0.1), ssd_path=tmp_path / "ssd")
    with pytest.raises(ValueError, match=r"exp/a/meta.json: step must be an integer >= 0 .* got -3"):
        ebc.import_rows(tmp_path / "exp")
    assert [e.step for e in ebc.engines] == [0]
    src.export_rows(tmp_path / "good")
    assert ebc.import_rows(tmp_path / "good") == {"a": 2, "b": 1}
    assert [e.step for e in ebc.engines] == [1]
    ebc.close()


@pytest.mark.parametrize("step, shown", [(2**63, 2**63), (torch.tensor(2**63, dtype=torch.uint64), 2**63),
                                         (2**70, 2**70)], ids=["2**63", "uint64 tensor 2**63", "2**70"])
def test_a_state_dicts_step_has_an_upper_bound(tmp_path, step, shown):
    """2**63 and above were taken, and every backward after failed in nanobind's conversion."""
    src = trained()
    emb = on_ssd(tmp_path)
    before = stored(emb)
    with pytest.raises(RuntimeError, match=r"optimizer_step must be an integer >= 0 \(a 0-d integer tensor, as "
                                           r"state_dict saves it\) and < 2\*\*63 .* got " + str(shown)):
        emb.load_state_dict({**src.state_dict(), "optimizer_step": step})
    assert_same(stored(emb), before)
    emb.load_state_dict(src.state_dict())
    assert_same(stored(emb), stored(src))
    emb.close()


def test_a_strict_load_with_a_key_not_the_tables_writes_nothing(tmp_path):
    """The rows, optimizer state and step were written, and torch raised after (the collection
    refused before writing; now the single table does too)."""
    other = {"weight": torch.full((N, D), 7.0), "optimizer_state": torch.ones(N, 2 * D),
             "optimizer_step": torch.tensor(9)}
    emb = on_ssd(tmp_path)
    before = stored(emb)
    with pytest.raises(RuntimeError, match=r"Error\(s\) in loading state_dict for TieredEmbeddingBag:\n\t"
                                           r"Unexpected key\(s\) in state_dict: 'bogus'"):
        emb.load_state_dict({**other, "bogus": torch.zeros(1)})
    assert_same(stored(emb), before)
    assert emb.load_state_dict({**other, "bogus": torch.zeros(1)}, strict=False).unexpected_keys == ["bogus"]
    assert_same(stored(emb), (other["weight"], other["optimizer_state"], 9))
    emb.close()
