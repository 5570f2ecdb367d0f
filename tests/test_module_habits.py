"""What torch users do with a module, on a tiered table: torch's constructor arguments, the weight
attribute, strict state_dict loads, .to()/.double(), copies, torch.compile, `with`. Each was a
silent wrong result or a bare error before; torch's modules are the reference."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import tieredemb

N, D = 20, 4


def _bag(**kw):
    return tieredemb.TieredEmbeddingBag(N, D, mode="sum", optimizer=tieredemb.SGD(lr=0.1), **kw)


def _collection():
    cfg = tieredemb.EmbeddingBagConfig(name="t", num_embeddings=N, embedding_dim=D, feature_names=["f"])
    return tieredemb.TieredEmbeddingBagCollection([cfg], optimizer=tieredemb.SGD(lr=0.1))


def test_torch_arguments_at_their_defaults_are_taken_and_the_others_refused():
    ids, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 1])
    w = torch.randn(N, D)
    plain = tieredemb.TieredEmbeddingBag(N, D, mode="sum", _weight=w)
    with_torch_args = tieredemb.TieredEmbeddingBag(N, D, mode="sum", _weight=w, sparse=True, max_norm=None,
                                                   norm_type=2.0, scale_grad_by_freq=False)
    assert torch.equal(plain(ids, offsets), with_torch_args(ids, offsets))
    with pytest.raises(ValueError, match=r"max_norm=1.0 is not supported"):
        tieredemb.TieredEmbeddingBag(N, D, mode="sum", max_norm=1.0)
    with pytest.raises(ValueError, match=r"scale_grad_by_freq=True is not supported"):
        tieredemb.TieredEmbedding(N, D, scale_grad_by_freq=True)
    with pytest.raises(ValueError, match=r"mode None is not one of .* torch's is max_norm"):
        tieredemb.TieredEmbeddingBag.from_pretrained(w, True, None)  # (torch's third: max_norm)
    # torch.nn.Embedding's third positional argument is padding_idx; _freeze as torch's
    emb = tieredemb.TieredEmbedding(N, D, 0, _weight=w, _freeze=True)
    ref = torch.nn.Embedding(N, D, 0, _weight=w.clone(), _freeze=True)
    assert emb.padding_idx == 0 and not emb._grad_anchor.requires_grad
    assert torch.equal(emb(torch.tensor([0, 5])), ref(torch.tensor([0, 5])))
    assert "mode='sum'" in repr(plain)


def test_the_weight_attribute_says_where_the_rows_are():
    """`emb.weight = Parameter(w)` was taken as a new, unused parameter: the table kept its rows."""
    emb = _bag()
    with pytest.raises(AttributeError, match="has no weight tensor: its rows live in tiers.*read_rows"):
        emb.weight
    with pytest.raises(AttributeError, match="cannot take a weight tensor.*write_rows"):
        emb.weight = torch.nn.Parameter(torch.zeros(N, D))
    assert [name for name, _ in emb.named_parameters()] == ["_grad_anchor"]


def test_a_strict_load_names_keys_that_are_not_the_tables():
    model = torch.nn.ModuleDict({"emb": _bag()})
    state = {**model.state_dict(), "emb.wieght": torch.zeros(N, D), "emb.extra": torch.zeros(1)}
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "emb.wieght", "emb.extra"'):
        model.load_state_dict(state)
    assert model.load_state_dict(state, strict=False).missing_keys == []


@pytest.mark.parametrize("step", [torch.tensor(-1), -3, torch.tensor(2.7), torch.tensor([1, 2]), True],
                         ids=["negative", "negative int", "float", "two", "bool"])
def test_a_bad_optimizer_step_is_refused_and_loads_nothing(step):
    """A negative step was taken (Adam's next backward then divided by zero or failed in math), a
    float one was cut to an int, a 1-D one failed with torch's message; a load now names the rule."""
    src = tieredemb.TieredEmbeddingBag(N, D, mode="sum", optimizer=tieredemb.Adam(lr=0.1))
    src(torch.tensor([1, 2]), torch.tensor([0])).sum().backward()
    emb = tieredemb.TieredEmbeddingBag(N, D, mode="sum", optimizer=tieredemb.Adam(lr=0.1), seed=7)
    before = emb.state_dict()
    with pytest.raises(RuntimeError, match=r"optimizer_step must be an integer >= 0 \(a 0-d integer tensor"):
        emb.load_state_dict({**src.state_dict(), "optimizer_step": step})
    after = emb.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and emb.step == 0
    emb.load_state_dict({**src.state_dict(), "optimizer_step": 5})  # (a plain int is taken)
    assert emb.step == 5


def test_a_backward_that_fails_takes_no_step(monkeypatch):
    """The step was counted before the update: a backward that raised still moved it on. (The fault is
    injected at the update's call: a valid table has no way left to make it fail.)"""
    emb = tieredemb.TieredEmbeddingBag(N, D, mode="sum", optimizer=tieredemb.Adam(lr=0.1))
    emb(torch.tensor([1, 2]), torch.tensor([0])).sum().backward()
    out = emb(torch.tensor([1, 2]), torch.tensor([0]))

    def fail(*args, **kwargs):
        raise MemoryError("injected")

    monkeypatch.setattr(tieredemb.kernels, "backward_update", fail)
    with pytest.raises(MemoryError, match="injected"):
        out.sum().backward()
    assert emb.step == 1


@pytest.mark.parametrize("convert", ["double", "half", "bfloat16", "meta"])
def test_a_dtype_or_device_change_is_refused_not_ignored(convert):
    """.double() converted the zero-size anchor parameter only: the output stayed float32 on the CPU
    while parameters() said float64, and the next layer failed."""
    model = torch.nn.Sequential(_bag(), torch.nn.Linear(D, 1))
    apply = (lambda m: m.to("meta")) if convert == "meta" else (lambda m: getattr(m, convert)())
    with pytest.raises(RuntimeError, match="TieredEmbeddingBag cannot be (converted|moved) to"):
        apply(model)
    model.float().to("cpu")  # (no change: taken)


@pytest.mark.parametrize("make", [_bag, _collection], ids=["module", "collection"])
def test_a_copy_is_refused_with_the_way_to_save(make):
    m = make()
    for copy_it in (copy.deepcopy, pickle.dumps, lambda x: torch.save(x, io.BytesIO())):
        with pytest.raises(TypeError, match="cannot be pickled or copied.*state_dict"):
            copy_it(torch.nn.Sequential(m))


@pytest.mark.parametrize("make", [_bag, _collection], ids=["module", "collection"])
def test_torch_compile_of_a_model_that_holds_a_table(make):
    """Dynamo traced the host-side numpy and native calls and failed; the table's forward now runs
    eagerly inside the compiled model, with the same values and training."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(D, 1)

    def loss(table, ids, offsets):
        out = table(ids, offsets) if isinstance(table, tieredemb.TieredEmbeddingBag) else \
            table({"f": (ids, offsets)})["f"]
        return linear(out).square().sum()

    eager, compiled = make(), make()
    step = torch.compile(loss, backend="eager")
    for k in range(3):
        ids, offsets = torch.randint(0, N, (12,)), torch.tensor([0, 3, 7])
        a, b = loss(eager, ids, offsets), step(compiled, ids, offsets)
        assert torch.equal(a, b), k
        a.backward()
        b.backward()
    rows = (lambda t: t.read_rows(torch.arange(N))) if make is _bag else (lambda t: t.read_rows("t", torch.arange(N)))
    assert torch.equal(rows(eager), rows(compiled))


def test_with_closes_the_table(tmp_path):
    with _bag(ssd_path=tmp_path / "t") as emb:
        emb.write_rows(torch.arange(2), torch.ones(2, D))
    with _bag(ssd_path=tmp_path / "t") as emb:  # (the first let its table go: it opens)
        assert torch.equal(emb.read_rows(torch.arange(2)), torch.ones(2, D))


def test_a_closed_table_takes_no_more_lookups_and_no_late_backward(tmp_path):
    """After close(), a backward of a batch looked up before it 'succeeded' into the let-go tier 0
    (its update and step lost: the reopened table had neither), and a host table went on training."""
    emb = _bag(cache_rows=4, ssd_path=tmp_path / "t", ssd_options={"backend": "log"})
    before = emb.read_rows(torch.arange(1))
    out = emb(torch.tensor([0]), torch.tensor([0]))
    emb.close()
    with pytest.raises(RuntimeError, match="was closed before this batch's backward: its update would be lost"):
        out.sum().backward()
    for call in (lambda: emb(torch.tensor([0]), torch.tensor([0])), lambda: emb.prefetch(torch.tensor([0]),
                                                                                             torch.tensor([0]))):
        with pytest.raises(RuntimeError, match="is closed"):
            call()
    with _bag(cache_rows=4, ssd_path=tmp_path / "t") as emb:
        assert emb.step == 0 and torch.equal(emb.read_rows(torch.arange(1)), before)
