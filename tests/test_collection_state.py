"""A collection's tables saved and restored under their own names: state_dict() in TorchRec's keys
(and torchrec's loading into ours and ours into torchrec's), checkpoint() and reopening over SSD,
export / import table by table, and a directory refused when it holds other tables than the
collection would put there."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import pytest
import torch

import tieredemb
from tieredemb import EmbeddingBagConfig, EmbeddingConfig, TieredEmbeddingBagCollection, TieredEmbeddingCollection

# a and b share a group (one engine, a's rows then b's); c is a group of its own
TABLES = [EmbeddingBagConfig("a", 300, 8, ["fa", "fa2"]), EmbeddingBagConfig("b", 200, 8, ["fb"]),
          EmbeddingBagConfig("c", 50, 4, ["fc"], pooling="mean")]
B = 5


def make(tables=TABLES, **kw):
    kw.setdefault("optimizer", tieredemb.Adagrad(lr=0.1))
    return TieredEmbeddingBagCollection(tables, **kw)


def batch(seed, tables=TABLES):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for t in tables:
        for f in t.feature_names:
            lengths = torch.randint(0, 4, (B,), generator=g)
            ids = torch.randint(0, t.num_embeddings, (int(lengths.sum()),), generator=g)
            out[f] = (ids, torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]]))
    return out


def train(ebc, seeds):
    outs = []
    for s in seeds:
        out = ebc(batch(s)).values()
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1000 + s)))
        outs.append(out.detach())
    return outs


def rows_of(ebc, tables=TABLES):
    return {t.name: (ebc.read_rows(t.name, torch.arange(t.num_embeddings)),
                     ebc.read_optimizer_state(t.name, torch.arange(t.num_embeddings))) for t in tables}


def assert_same_rows(x, y):
    assert x.keys() == y.keys()
    for name in x:
        assert torch.equal(x[name][0], y[name][0]), name
        assert torch.equal(x[name][1], y[name][1]), name


def test_state_dict_holds_each_table_under_torchrecs_key():
    ebc = make()
    train(ebc, range(3))
    sd = ebc.state_dict()
    assert sorted(sd) == sorted(f"embedding_bags.{t.name}.{k}" for t in TABLES
                                for k in ("weight", "optimizer_state", "optimizer_step"))
    for t in TABLES:
        ids = torch.arange(t.num_embeddings)
        assert torch.equal(sd[f"embedding_bags.{t.name}.weight"], ebc.read_rows(t.name, ids))
        assert torch.equal(sd[f"embedding_bags.{t.name}.optimizer_state"], ebc.read_optimizer_state(t.name, ids))
        assert int(sd[f"embedding_bags.{t.name}.optimizer_step"]) == 3
    outer = torch.nn.ModuleDict({"sparse": ebc})  # inside a model: under its name
    assert sorted(outer.state_dict()) == sorted("sparse." + k for k in sd)
    unpooled = TieredEmbeddingCollection([EmbeddingConfig("e", 10, 4, ["fe"])], optimizer=tieredemb.SGD(lr=0.1))
    assert sorted(unpooled.state_dict()) == ["embeddings.e.optimizer_state", "embeddings.e.optimizer_step",
                                             "embeddings.e.weight"]
    # what TorchRec's collections answer besides (their models read them)
    assert [t.name for t in ebc.embedding_bag_configs()] == ["a", "b", "c"] and ebc.device == torch.device("cpu")
    assert [t.name for t in unpooled.embedding_configs()] == ["e"] and unpooled.embedding_dim() == 4
    two = TieredEmbeddingCollection([EmbeddingConfig("e", 10, 4, ["fe"]), EmbeddingConfig("f", 10, 8, ["ff"])],
                                    optimizer=tieredemb.SGD(lr=0.1))
    with pytest.raises(ValueError, match=r"several dims \[4, 8\]"):
        two.embedding_dim()


def test_state_dict_round_trip_trains_on_bit_for_bit():
    a = make()
    train(a, range(4))
    b = make(seed=7, cache_bytes=3000)  # other initial rows, another tier 0: the state_dict decides
    assert b.load_state_dict(a.state_dict()) is not None
    assert_same_rows(rows_of(b), rows_of(a))
    assert [e.step for e in b.engines] == [4, 4]
    for x, y in zip(train(a, range(4, 7)), train(b, range(4, 7))):
        assert torch.equal(x, y)
    assert_same_rows(rows_of(b), rows_of(a))


def test_bad_state_dicts_are_refused_and_change_nothing():
    ebc = make()
    train(ebc, range(2))
    before, good = rows_of(ebc), make(seed=3).state_dict()
    bad = dict(good)
    bad["embedding_bags.c.weight"] = torch.zeros(49, 4)  # the last table: the others come first
    with pytest.raises(RuntimeError, match=r"size mismatch for embedding_bags\.c\.weight: \(49, 4\) vs \(50, 4\)"):
        ebc.load_state_dict(bad)
    bad = {k: v for k, v in good.items() if k != "embedding_bags.b.weight"}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: .embedding_bags\.b\.weight"):
        ebc.load_state_dict(bad)
    bad = {**good, "engines.0.weight": torch.zeros(500, 8)}  # (the grouping is not a key)
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: .engines\.0\.weight"):
        ebc.load_state_dict(bad)
    bad = {**good, "embedding_bags.b.optimizer_step": torch.tensor(9)}
    with pytest.raises(RuntimeError, match=r"tables \['a', 'b'\] share a group .* optimizer_step differ: "
                                           r"\{'a': 0, 'b': 9\}"):
        ebc.load_state_dict(bad)
    bad = {**good, "embedding_bags.a.optimizer_state": torch.zeros(299, 8)}
    with pytest.raises(RuntimeError, match=r"size mismatch for embedding_bags\.a\.optimizer_state"):
        ebc.load_state_dict(bad)
    bad = {**good, "embedding_bags.c.weight": torch.zeros(50, 4, dtype=torch.long),  # the last table again
           "embedding_bags.a.optimizer_step": torch.tensor(11), "embedding_bags.b.optimizer_step": torch.tensor(11)}
    with pytest.raises(RuntimeError, match=r"embedding_bags\.c\.weight must be floating point, got torch\.int64"):
        ebc.load_state_dict(bad)
    bad = {**good, "embedding_bags.b.optimizer_state": torch.zeros(200, 8, device="meta")}
    with pytest.raises(RuntimeError, match=r"embedding_bags\.b\.optimizer_state is on the meta device"):
        ebc.load_state_dict(bad)
    assert_same_rows(rows_of(ebc), before)
    assert [e.step for e in ebc.engines] == [2, 2]
    # strict=False: what is there is loaded, what is missing is said
    result = ebc.load_state_dict({k: v for k, v in good.items() if not k.startswith("embedding_bags.b.")},
                                 strict=False)
    assert result.missing_keys == ["embedding_bags.b.weight"]
    after = rows_of(ebc)
    assert torch.equal(after["a"][0], good["embedding_bags.a.weight"]) and torch.equal(after["b"][0], before["b"][0])
    # inside a model, a strict load follows torch: the tables present are loaded, then it raises
    model = torch.nn.ModuleDict({"sparse": ebc})
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: .sparse\.embedding_bags\.b\.weight"):
        model.load_state_dict({"sparse." + k: v for k, v in make(seed=5).state_dict().items()
                               if not k.startswith("embedding_bags.b.")})
    assert torch.equal(rows_of(ebc)["c"][0], make(seed=5).read_rows("c", torch.arange(50)))


def test_torchrec_state_dicts_load_both_ways():
    torchrec = pytest.importorskip("torchrec")

    configs = [torchrec.EmbeddingBagConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                                           feature_names=list(t.feature_names),
                                           pooling=getattr(torchrec.PoolingType, t.pooling.upper()))
               for t in TABLES]
    theirs = torchrec.EmbeddingBagCollection(tables=configs)
    ours = make()
    assert ours.load_state_dict(theirs.state_dict()) is not None  # strict: optimizer state is optional

    def kjt(b):
        keys = [f for t in TABLES for f in t.feature_names]
        lengths = [torch.diff(b[f][1], append=torch.tensor([len(b[f][0])])) for f in keys]
        return torchrec.KeyedJaggedTensor(keys=keys, values=torch.cat([b[f][0] for f in keys]),
                                          lengths=torch.cat(lengths))

    b = batch(0)
    torch.testing.assert_close(ours(b).values(), theirs(kjt(b)).values())
    train(ours, range(1, 4))
    result = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert sorted(result.unexpected_keys) == sorted(f"embedding_bags.{t.name}.{k}" for t in TABLES
                                                    for k in ("optimizer_state", "optimizer_step"))
    b = batch(9)
    torch.testing.assert_close(theirs(kjt(b)).values(), ours(b).values())


def test_checkpoint_opens_as_the_collection(tmp_path):
    ebc = make(ssd_path=tmp_path / "live", cache_bytes=4000)
    train(ebc, range(3))
    ebc.checkpoint(tmp_path / "ckpt")
    at_checkpoint = rows_of(ebc)
    train(ebc, range(3, 5))
    with pytest.raises(ValueError, match=r"checkpoint path .*ckpt: already exists"):
        ebc.checkpoint(tmp_path / "ckpt")
    ebc.close()
    assert json.load(open(tmp_path / "ckpt" / "collection.json"))["groups"] == {
        "group0": [["a", 300], ["b", 200]], "group1": [["c", 50]]}
    back = make(ssd_path=tmp_path / "ckpt", cache_bytes=2000)
    assert_same_rows(rows_of(back), at_checkpoint)
    assert [e.step for e in back.engines] == [3, 3]
    back.close()
    with pytest.raises(RuntimeError, match=r"cannot checkpoint to .*: tables \['a', 'b', 'c'\] keep their rows in "
                                           r"host memory"):
        make().checkpoint(tmp_path / "host")
    assert not os.path.exists(tmp_path / "host")


def test_a_directory_of_other_tables_is_refused_before_anything_opens(tmp_path):
    same = [EmbeddingBagConfig("x", 100, 8, ["fx"]), EmbeddingBagConfig("y", 100, 8, ["fy"])]
    ebc = make(same, ssd_path=tmp_path)
    ebc.write_rows("x", torch.arange(3), torch.ones(3, 8))
    ebc.close()
    files = sorted((p, os.path.getmtime(os.path.join(d, p))) for d, _, ps in os.walk(tmp_path) for p in ps)
    # the same shapes in the other order would read each other's rows: refused
    with pytest.raises(ValueError, match=r"group0 holds tables \[x \(100 rows\), y \(100 rows\)\], this collection "
                                         r"would put \[y \(100 rows\), x \(100 rows\)\] there"):
        make(same[::-1], ssd_path=tmp_path)
    with pytest.raises(ValueError, match=r"group0 holds tables \[x \(100 rows\), y \(100 rows\)\], this collection "
                                         r"would put \[x \(100 rows\)\] there"):
        make(same[:1], ssd_path=tmp_path)
    make(same + [EmbeddingBagConfig("w", 10, 4, ["fw"])], ssd_path=tmp_path / "two").close()
    with pytest.raises(ValueError, match=r"group1 holds tables \[w \(10 rows\)\], which this collection does not"):
        make(same, ssd_path=tmp_path / "two")  # (a table left out: its rows would be left behind unseen)
    assert sorted((p, os.path.getmtime(os.path.join(d, p))) for d, _, ps in os.walk(tmp_path) if "two" not in d
                  for p in ps) == files
    back = make(same, ssd_path=tmp_path)  # the order it was made with: its rows
    assert torch.equal(back.read_rows("x", torch.arange(3)), torch.ones(3, 8))
    back.close()
    grown = make(same + [EmbeddingBagConfig("w", 10, 4, ["fw"])], ssd_path=tmp_path)  # a new group is allowed
    grown.close()
    assert json.load(open(tmp_path / "collection.json"))["groups"]["group1"] == [["w", 10]]
    # a directory without collection.json (made before collections recorded their tables): adopted,
    # with a warning, where every group it needs is there; refused where some are and some are not
    os.remove(tmp_path / "collection.json")
    with pytest.raises(ValueError, match=r"holds group0, group1 but no whole store in group2, and no collection.json"):
        make(same + [EmbeddingBagConfig("w", 10, 4, ["fw"]), EmbeddingBagConfig("v", 10, 2, ["fv"])],
             ssd_path=tmp_path)
    assert not os.path.exists(tmp_path / "group2") and not os.path.exists(tmp_path / "collection.json")
    with pytest.warns(RuntimeWarning, match=r"no collection.json: .* recorded as this collection has them"):
        adopted = make(same + [EmbeddingBagConfig("w", 10, 4, ["fw"])], ssd_path=tmp_path)
    assert torch.equal(adopted.read_rows("x", torch.arange(3)), torch.ones(3, 8))
    adopted.close()
    assert json.load(open(tmp_path / "collection.json"))["groups"]["group0"] == [["x", 100], ["y", 100]]
    # a group the record does not name, whose directory is there (a collection that failed while
    # opening, before it wrote its record): refused
    os.makedirs(tmp_path / "group2")
    with pytest.raises(ValueError, match=r"holds group2, which its collection.json does not record"):
        make(same + [EmbeddingBagConfig("w", 10, 4, ["fw"]), EmbeddingBagConfig("v", 10, 2, ["fv"])],
             ssd_path=tmp_path)


def test_a_collection_that_fails_to_open_closes_what_it_opened(tmp_path):
    tables = [EmbeddingBagConfig("x", 100, 8, ["fx"]), EmbeddingBagConfig("w", 10, 4, ["fw"])]
    make(tables, ssd_path=tmp_path).close()
    changed = [tables[0], dataclasses.replace(tables[1], optimizer=tieredemb.Adam(lr=0.1))]
    with pytest.raises(ValueError, match=r"group1: stored width 8 != requested 12"):  # group0 opened first
        make(changed, ssd_path=tmp_path)
    make(tables, ssd_path=tmp_path).close()  # group0's store was closed: it opens again in this process


def test_an_unfinished_checkpoint_is_refused(tmp_path):
    """A checkpoint cut short in its last group (that store's record, written last, missing; and
    no collection.json): refused, where adopting it would read that group's rows as new ones."""
    ebc = make(ssd_path=tmp_path / "live", ssd={"backend": "log"})
    ebc.write_rows("c", torch.arange(3), torch.full((3, 4), 7.0))
    ebc.checkpoint(tmp_path / "ckpt")
    ebc.close()
    os.remove(tmp_path / "ckpt" / "collection.json")
    os.remove(tmp_path / "ckpt" / "group1" / "log.json")
    with pytest.raises(ValueError, match=r"holds group0, group1 but no whole store in group1, and no collection.json"):
        make(ssd_path=tmp_path / "ckpt", ssd={"backend": "log"})
    assert not os.path.exists(tmp_path / "ckpt" / "collection.json")


def test_the_directory_is_locked_while_a_collection_opens_it(tmp_path, monkeypatch):
    """A second process opening the same directory waits for the first one's opening (else its
    clean-up after a failure could remove the stores the first one is making)."""
    import fcntl

    make_engine, held = TieredEmbeddingBagCollection._engine, []

    def probing(self, group, **args):
        fd = os.open(tmp_path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.append(False)
        except BlockingIOError:
            held.append(True)
        finally:
            os.close(fd)
        return make_engine(self, group, **args)

    monkeypatch.setattr(TieredEmbeddingBagCollection, "_engine", probing)
    make(ssd_path=tmp_path).close()
    assert held == [True, True]
    fd = os.open(tmp_path, os.O_RDONLY)  # and let go of once open
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)


def test_a_collection_that_fails_to_open_leaves_the_directory_as_it_was(tmp_path, monkeypatch):
    """A third table (a new group) whose store fails to open (a fault injected into the engine's
    making: the failures that reach there for real, an unwritable disk, cannot be had here for
    one group alone): the record is as before, the new group's directory is gone, and the
    collection as it was opens again."""
    tables = [EmbeddingBagConfig("x", 100, 8, ["fx"]), EmbeddingBagConfig("w", 10, 4, ["fw"])]
    make(tables, ssd_path=tmp_path).close()
    record = (tmp_path / "collection.json").read_text()
    make_engine = TieredEmbeddingBagCollection._engine

    def failing(self, group, **args):
        engine = make_engine(self, group, **args)  # (its directory is made, its store opened)
        if group.tables[0].name == "v":
            engine.close()
            raise OSError("injected: the disk failed")
        return engine

    monkeypatch.setattr(TieredEmbeddingBagCollection, "_engine", failing)
    with pytest.raises(OSError, match="injected"):
        make(tables + [EmbeddingBagConfig("v", 10, 2, ["fv"])], ssd_path=tmp_path)
    assert (tmp_path / "collection.json").read_text() == record
    assert sorted(os.listdir(tmp_path)) == ["collection.json", "group0", "group1"]
    monkeypatch.undo()
    make(tables, ssd_path=tmp_path).close()
    fresh = tmp_path / "fresh"  # the same on a new directory: nothing is left that refuses a retry
    monkeypatch.setattr(TieredEmbeddingBagCollection, "_engine", failing)
    with pytest.raises(OSError, match="injected"):
        make(tables + [EmbeddingBagConfig("v", 10, 2, ["fv"])], ssd_path=fresh)
    monkeypatch.undo()
    assert os.listdir(fresh) == []
    make(tables, ssd_path=fresh).close()
    # no table on SSD (a plan that keeps them in host memory): a failure is the failure itself,
    # and nothing is made
    with pytest.raises(ValueError, match=r"policy 'bogus'"):
        make(tables, ssd_path=tmp_path / "none", plan={"tables": [
            {"name": t.name, "rows": t.num_embeddings, "cache_rows": t.num_embeddings, "store": "host"}
            for t in tables]}, policy="bogus")
    assert not os.path.exists(tmp_path / "none")


def test_export_import_table_by_table_and_into_a_single_table(tmp_path):
    ebc = make(cache_bytes=3000)
    train(ebc, range(3))
    written = ebc.export_rows(tmp_path / "exp", chunk_rows=7)
    assert sorted(written) == ["a", "b", "c"] and all(n > 0 for n in written.values())
    assert sum(len(ids) for ids, _, _ in ebc.iter_rows("b", 7)) == written["b"]
    assert all(0 <= int(ids.min()) and int(ids.max()) < 200 for ids, _, _ in ebc.iter_rows("b", 7))
    other = make()
    assert other.import_rows(tmp_path / "exp") == written
    mine, theirs = rows_of(ebc), rows_of(other)
    for t in TABLES:  # rows written agree; the others hold each collection's initial values
        ids = torch.cat([ids for ids, _, _ in ebc.iter_rows(t.name)])
        assert torch.equal(mine[t.name][0][ids], theirs[t.name][0][ids])
        assert torch.equal(mine[t.name][1][ids], theirs[t.name][1][ids])
    assert [e.step for e in other.engines] == [3, 3]
    single = tieredemb.TieredEmbeddingBag(200, 8, "sum", optimizer=tieredemb.Adagrad(lr=0.1))
    assert single.import_rows(tmp_path / "exp" / "b") == written["b"]
    ids = torch.cat([ids for ids, _, _ in ebc.iter_rows("b")])
    assert torch.equal(single.read_rows(ids), mine["b"][0][ids]) and single.step == 3
    with pytest.raises(ValueError, match=r"exp/b: exported num_embeddings 200 != this table's 300"):
        tieredemb.TieredEmbeddingBag(300, 8, "sum", optimizer=tieredemb.Adagrad(lr=0.1)).import_rows(
            tmp_path / "exp" / "b")
    with pytest.raises(FileNotFoundError, match=r"holds no export"):
        other.import_rows(tmp_path / "nothing")
    # into a collection whose table c has a row written: refused before any table's row is written
    fresh = make()
    fresh.write_rows("c", torch.tensor([4]), torch.ones(1, 4))
    before = rows_of(fresh)
    with pytest.raises(ValueError, match=r"into table 'c': it has rows written already \(id 4\)"):
        fresh.import_rows(tmp_path / "exp")
    assert all(torch.equal(before[t][k], rows_of(fresh)[t][k]) for t in before for k in (0, 1))
    with pytest.raises(ValueError, match=r"chunk_rows 0 must be an int >= 1"):
        ebc.export_rows(tmp_path / "zero", chunk_rows=0)


def test_an_export_written_again_holds_only_the_new_rows(tmp_path):
    ebc = make()
    ebc.write_rows("b", torch.arange(4), torch.ones(4, 8))
    assert ebc.export_rows(tmp_path / "exp", chunk_rows=1)["b"] == 4  # four chunk files
    ebc.write_rows("b", torch.arange(4), torch.full((4, 8), 2.0))
    assert ebc.export_rows(tmp_path / "exp")["b"] == 4  # one chunk file: the old ones go
    other = make()
    assert other.import_rows(tmp_path / "exp")["b"] == 4
    assert torch.equal(other.read_rows("b", torch.arange(4)), torch.full((4, 8), 2.0))
    single = tieredemb.TieredEmbeddingBag(10, 4, "sum", optimizer=tieredemb.SGD(lr=0.1))
    single.write_rows(torch.arange(2), torch.ones(2, 4))
    assert single.export_rows(tmp_path / "one") == 2
    with pytest.raises(ValueError, match=r"chunk_rows 0 must be an int >= 1"):
        single.export_rows(tmp_path / "one", chunk_rows=0)
    assert sorted(os.listdir(tmp_path / "one")) == ["chunk_000000.pt", "meta.json"]  # the earlier export kept


def test_a_collection_closes_every_group_even_after_one_fails(tmp_path):
    """close() raises the first group's failure and closes the other groups all the same: their
    stores open again. (The failure: group0's store files closed under it, with rows to write.)"""
    ebc = make(ssd_path=tmp_path, ssd={"backend": "log"})
    train(ebc, [0, 1])
    ebc.engines[0]._store.bottom._file.close()
    with pytest.raises(Exception, match="closed"):
        ebc.close()
    make(ssd_path=tmp_path, ssd={"backend": "log"}).close()  # (refused as locked if a group's store were held)


def test_flush_and_close_warn_of_tables_a_plan_keeps_in_host_memory(tmp_path):
    """A plan may keep some tables in host memory beside others stored under ssd_path: flush() and
    close() store the others only (a review: a collection reopened there had silently reset them)."""
    plan = {"tables": [{"name": t.name, "cache_rows": t.num_embeddings // 2, "store": "host" if t.name == "b" else "ssd",
                        "rows": t.num_embeddings} for t in TABLES]}
    ebc = make(ssd_path=tmp_path / "s", plan=plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ebc.flush()  # (nothing written yet: nothing lost)
    train(ebc, range(2))
    kept = rows_of(ebc)
    with pytest.warns(UserWarning, match=r"flush\(\): tables \['b'\] keep their rows in host memory"):
        ebc.flush()
    with pytest.warns(UserWarning, match=r"close\(\): tables \['b'\] keep their rows in host memory .* starts them "
                                         r"from their initial values"):
        ebc.close()
    back = make(ssd_path=tmp_path / "s", plan=plan)
    now = rows_of(back)
    assert_same_rows({k: now[k] for k in "ac"}, {k: kept[k] for k in "ac"})
    assert not torch.equal(now["b"][0], kept["b"][0])  # (what the warning says)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back.close()
        host = make()  # (no ssd_path: nothing is stored, as for a module: no warning)
        train(host, range(1))
        host.close()


def test_an_ssd_groups_directory_keeps_its_number_when_whole_tables_are_grouped_apart(tmp_path):
    """A plan's tables whole in host memory are grouped apart from cached ones of their kind (since
    5cbe756); an SSD group's directory keeps the number it had before (a review: a directory written
    then was refused as holding other tables, its group now counted one further)."""
    tables = [EmbeddingBagConfig(n, 100, 4, [n + "_f"]) for n in ("B", "C", "A")]
    plan = {"tables": [{"name": "B", "cache_rows": 100, "store": "host", "rows": 100},
                       {"name": "C", "cache_rows": 10, "store": "host", "rows": 100},
                       {"name": "A", "cache_rows": 10, "store": "ssd", "rows": 100}]}
    ebc = make(tables, plan=plan, ssd_path=tmp_path / "s")
    assert [[t.name for t in g.tables] for g in ebc.groups] == [["B"], ["C"], ["A"]]
    ebc.close()
    assert sorted(os.listdir(tmp_path / "s")) == ["collection.json", "group1"]  # (as before: B and C were group0)
    make(tables, plan=plan, ssd_path=tmp_path / "s").close()
