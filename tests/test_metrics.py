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
