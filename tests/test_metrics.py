"""Tables' statistics as JSON and in Prometheus' text exposition format, with Prometheus' naming
conventions (units in names, _total on counters), parsed back by a strict reading of the format."""

from __future__ import annotations

import json
import re

import torch

import tieredemb
import tieredemb.metrics

_SAMPLE = re.compile(r'^(tieredemb_[a-z_]+)\{((?:[a-z]+="[^"]*",?)+)\} (\S+)$')


def _tables(tmp_path):
    user = tieredemb.TieredEmbeddingBag(500, 4, "sum", cache_rows=20, host_rows=40, optimizer=tieredemb.SGD(lr=0.1))
    item = tieredemb.TieredEmbeddingBag(300, 8, "sum", cache_rows=10, ssd_path=tmp_path / "item",
                                        ssd_options={"backend": "log"}, optimizer=tieredemb.SGD(lr=0.1))
    for t in (user, item):
        for k in range(5):
            t(torch.arange(k * 30, k * 30 + 30), torch.arange(0, 30, 3)).sum().backward()
    return {"user": user, "item": item}


def test_prometheus_text_follows_the_format_and_the_naming_conventions(tmp_path):
    tables = _tables(tmp_path)
    text = tieredemb.metrics.prometheus(tables)
    kinds, values = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            kinds[name] = kind
            assert kind in ("counter", "gauge")
            assert name.endswith("_total") == (kind == "counter"), name
            assert re.search(r"_(total|rows|ratio|bytes|seconds)$", name), name
        elif line.startswith("# HELP "):
            assert len(line.split(" ", 3)[3]) > 10
        else:
            m = _SAMPLE.match(line)
            assert m, line
            assert m.group(1) in kinds  # TYPE comes before its samples
            labels = dict(kv.split("=") for kv in m.group(2).split(","))
            values[(m.group(1), labels["table"], labels.get("tier", labels.get("store")))] = float(m.group(3))
    s = tables["user"].stats()
    assert values[("tieredemb_tier_hits_total", '"user"', '"tier0"')] == s["tier0"]["hits"]
    assert values[("tieredemb_tier_capacity_rows", '"user"', '"host"')] == 40
    assert values[("tieredemb_store_read_rows_total", '"item"', '"ssd"')] == tables["item"].stats()["ssd"]["reads"]
    assert ("tieredemb_prefetch_wait_seconds_total", '"user"', None) in values
    assert json.loads(tieredemb.metrics.as_json(tables))["user"]["tier0"]["misses"] == s["tier0"]["misses"]
    tables["item"].close()


def test_a_collection_gives_every_table_its_own_series(tmp_path):
    tables = [tieredemb.EmbeddingBagConfig("a", 400, 4, ["fa"]), tieredemb.EmbeddingBagConfig("b", 200, 4, ["fb"]),
              tieredemb.EmbeddingBagConfig("c", 100, 8, ["fc"])]
    ebc = tieredemb.TieredEmbeddingBagCollection(tables, cache_bytes=2000, host_bytes=6000,
                                                 optimizer=tieredemb.SGD(lr=0.1))
    for k in range(4):
        ebc({"fa": (torch.arange(40) + 40 * k, torch.tensor([0, 20])), "fb": (torch.arange(6), torch.tensor([0, 3])),
             "fc": (torch.arange(9), torch.tensor([0, 4]))}).values().sum().backward()
    text = tieredemb.metrics.prometheus({"ebc": ebc})
    values = {}
    for line in text.splitlines():
        if not line.startswith("#"):
            m = _SAMPLE.match(line)
            assert m, line
            values[(m.group(1), m.group(2))] = float(m.group(3))
    s = ebc.stats()
    for t in ("a", "b", "c"):
        assert values[("tieredemb_lookups_total", f'collection="ebc",table="{t}"')] == s["tables"][t]["lookups"]
        assert values[("tieredemb_tier_hits_total", f'collection="ebc",table="{t}",tier="tier0"')] == \
            s["tables"][t]["tier0"]["hits"]
    assert values[("tieredemb_lookups_total", 'collection="ebc",table="a"')] == 160
    assert values[("tieredemb_tier_misses_total", 'collection="ebc",table="a",tier="tier0"')] == 160
    assert values[("tieredemb_tier_capacity_rows", 'collection="ebc",group="group0",tier="host"')] == \
        s["groups"]["group0"]["host"]["capacity"]
    # tier 0 is counted per table only (the groups' totals would count it twice)
    assert not any(k[1].startswith('collection="ebc",group=') and "tier0" in k[1] for k in values)
    assert json.loads(tieredemb.metrics.as_json({"ebc": ebc}))["ebc"]["tables"]["b"]["lookups"] == 24


def test_an_unpooled_collection_gives_every_table_its_own_series():
    tables = [tieredemb.EmbeddingConfig("a", 400, 4, ["fa"]), tieredemb.EmbeddingConfig("b", 200, 4, ["fb"])]
    ec = tieredemb.TieredEmbeddingCollection(tables, cache_bytes=1000, optimizer=tieredemb.SGD(lr=0.1))
    out = ec({"fa": (torch.arange(30), torch.tensor([0, 10])), "fb": (torch.arange(5), torch.tensor([0, 2]))})
    sum(o.values().sum() for o in out.values()).backward()
    text = tieredemb.metrics.prometheus({"ec": ec})
    assert 'tieredemb_lookups_total{collection="ec",table="a"} 30' in text
    assert 'tieredemb_lookups_total{collection="ec",table="b"} 5' in text
    assert 'tieredemb_tier_misses_total{collection="ec",table="a",tier="tier0"} 30' in text
    assert json.loads(tieredemb.metrics.as_json({"ec": ec}))["ec"]["tables"]["b"]["lookups"] == 5


def test_label_values_are_escaped_as_the_format_says():
    """A table's name with a backslash, a double quote and a newline: each escaped (\\\\, \\", \\n), so
    the line stays one sample whose label reads back as the name."""
    name = 'we"ird\\na\nme'
    emb = tieredemb.TieredEmbeddingBag(50, 4, "sum", cache_rows=10, optimizer=tieredemb.SGD(lr=0.1))
    emb(torch.arange(6), torch.tensor([0, 3])).sum().backward()
    text = tieredemb.metrics.prometheus({name: emb})
    label = re.compile(r'table="((?:[^"\\\n]|\\[\\"n])*)"')
    misses = [line for line in text.splitlines() if line.startswith("tieredemb_tier_misses_total{")]
    assert len(misses) == 1 and misses[0].endswith(',tier="tier0"} 6')
    got = label.search(misses[0]).group(1)
    assert got == 'we\\"ird\\\\na\\nme'
    unescaped = re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), got)
    assert unescaped == name
