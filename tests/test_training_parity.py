"""Training parity after 100 steps against the peers, and invariance of the trained table to tier
sizes, host cache and policy (bit for bit on the CPU)."""

import pytest
import torch

import tieredemb

NUM, DIM, BAGS, LEN, STEPS = 200, 8, 16, 5, 100
TIERS = [dict(cache_rows=None), dict(cache_rows=80), dict(cache_rows=80, host_rows=120),
         dict(cache_rows=80, policy="lfu"), dict(cache_rows=90, host_rows=100, policy="clock"),
         dict(cache_rows=80, host_rows=120, row_alignment=128), dict(cache_rows=None, row_alignment=16)]


def batches(seed=0, mode_bag=True):
    g = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        # Skewed ids, so rows repeat within and across batches.
        ids = (torch.rand(BAGS * LEN, generator=g) ** 3 * NUM).long()
        offsets = torch.arange(0, BAGS * LEN, LEN)
        grad = torch.randn(BAGS, DIM, generator=g)
        yield ids, offsets, grad


def initial_weight():
    return torch.randn(NUM, DIM, generator=torch.Generator().manual_seed(42))


def train_ours(optimizer, mode="sum", **tiers):
    emb = tieredemb.TieredEmbeddingBag(NUM, DIM, mode=mode, optimizer=optimizer, _weight=initial_weight(), **tiers)
    for ids, offsets, grad in batches():
        emb(ids, offsets).backward(grad)
    return emb


def train_torch(make_opt, sparse, mode="sum"):
    ref = torch.nn.EmbeddingBag(NUM, DIM, mode=mode, sparse=sparse, _weight=initial_weight())
    opt = make_opt(ref.parameters())
    for ids, offsets, grad in batches():
        opt.zero_grad()
        ref(ids, offsets).backward(grad)
        opt.step()
    return ref.weight.detach()


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_sgd_matches_torch(mode, kernels):
    expected = train_torch(lambda p: torch.optim.SGD(p, lr=0.05), sparse=False, mode=mode)
    got = train_ours(tieredemb.SGD(lr=0.05), mode=mode, cache_rows=80).read_rows(torch.arange(NUM))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_adagrad_matches_torch(kernels):
    expected = train_torch(lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-10), sparse=False)
    got = train_ours(tieredemb.Adagrad(lr=0.1, eps=1e-10), cache_rows=80, host_rows=120)
    torch.testing.assert_close(got.read_rows(torch.arange(NUM)), expected, rtol=1e-5, atol=1e-5)


def test_adam_matches_sparse_adam(kernels):
    expected = train_torch(lambda p: torch.optim.SparseAdam(list(p), lr=0.01, betas=(0.8, 0.99), eps=1e-8), sparse=True)
    got = train_ours(tieredemb.Adam(lr=0.01, betas=(0.8, 0.99), eps=1e-8), cache_rows=80)
    torch.testing.assert_close(got.read_rows(torch.arange(NUM)), expected, rtol=1e-4, atol=1e-5)


def test_adam_takes_one_minus_beta_as_sparse_adam_does(kernels):
    """Bit for bit, three steps of one row: SparseAdam takes 1 - beta in double; 1.f - 0.999f (the
    kernels' before) is off by a relative 1.3e-5 in the second moment."""
    ours = tieredemb.TieredEmbeddingBag(4, 3, mode="sum", optimizer=tieredemb.Adam(lr=0.01), _weight=torch.ones(4, 3))
    ref = torch.nn.EmbeddingBag(4, 3, mode="sum", sparse=True, _weight=torch.ones(4, 3))
    opt = torch.optim.SparseAdam(list(ref.parameters()), lr=0.01)
    for grad in (torch.full((1, 3), 0.5), torch.tensor([[0.3, -2.0, 7.0]]), torch.tensor([[1e-3, 4.0, -0.25]])):
        ours(torch.tensor([1]), torch.tensor([0])).backward(grad)
        opt.zero_grad()
        ref(torch.tensor([1]), torch.tensor([0])).backward(grad)
        opt.step()
        state = opt.state[ref.weight]
        assert torch.equal(ours.read_optimizer_state(torch.tensor([1]))[0],
                           torch.cat([state["exp_avg"][1], state["exp_avg_sq"][1]]))
        assert torch.equal(ours.read_rows(torch.tensor([1])), ref.weight.detach()[1:2])


def test_rowwise_adagrad_matches_fbgemm(kernels):
    tbe_mod = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import ComputeDevice, EmbeddingLocation, PoolingMode

    tbe = tbe_mod.SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(NUM, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1, eps=1e-8,
        pooling_mode=PoolingMode.SUM, device="cpu")
    tbe.split_embedding_weights()[0].copy_(initial_weight())
    for ids, offsets, grad in batches():
        out = tbe(ids, torch.cat([offsets, torch.tensor([len(ids)])]))
        out.backward(grad)
    expected = tbe.split_embedding_weights()[0].detach()
    got = train_ours(tieredemb.RowWiseAdagrad(lr=0.1, eps=1e-8), cache_rows=80, host_rows=150)
    torch.testing.assert_close(got.read_rows(torch.arange(NUM)), expected, rtol=1e-5, atol=1e-5)


def train_momentum_scaled_reference(lr, eps, c):
    """Momentum-scaled row-wise AdaGrad written from its rule (tieredemb.optim's docstring says
    whence): every row a batch touches, g its summed gradient, gets acc += mean(g^2), then
    w -= lr * g / (sqrt(acc / c) + eps). Plain torch: a dense weight and its .grad."""
    w = initial_weight().clone().requires_grad_(True)
    acc = torch.zeros(NUM)
    for ids, offsets, grad in batches():
        w.grad = None
        torch.nn.functional.embedding_bag(ids, w, offsets, mode="sum").backward(grad)
        with torch.no_grad():
            for r in torch.unique(ids).tolist():
                g = w.grad[r]
                acc[r] += (g * g).mean()
                w[r] -= lr * g / (torch.sqrt(acc[r] / c) + eps)
    return w.detach(), acc


@pytest.mark.parametrize("c", [1.0, 4.0, 64.0])
def test_momentum_scaled_rowwise_adagrad_follows_its_rule(c, kernels):
    expected, acc = train_momentum_scaled_reference(0.1, 1e-8, c)
    got = train_ours(tieredemb.MomentumScaledRowWiseAdagrad(lr=0.1, eps=1e-8, scale=c), cache_rows=80, host_rows=120)
    ids = torch.arange(NUM)
    torch.testing.assert_close(got.read_rows(ids), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.read_optimizer_state(ids)[:, 0], acc, rtol=1e-5, atol=1e-7)


def test_momentum_scaled_rowwise_adagrad_at_scale_1_is_rowwise_adagrad_and_scale_moves_faster():
    """c = 1: the same weights and state as RowWiseAdagrad, bit for bit. c > 1: every touched
    row moves farther, and the accumulator is the same (it sums the same squared gradients: the
    batches give them, whatever the weights)."""
    ids = torch.arange(NUM)
    plain = train_ours(tieredemb.RowWiseAdagrad(lr=0.1), cache_rows=80)
    scaled = train_ours(tieredemb.MomentumScaledRowWiseAdagrad(lr=0.1, scale=1.0), cache_rows=80)
    assert torch.equal(scaled.read_rows(ids), plain.read_rows(ids))
    assert torch.equal(scaled.read_optimizer_state(ids), plain.read_optimizer_state(ids))
    faster = train_ours(tieredemb.MomentumScaledRowWiseAdagrad(lr=0.1, scale=16.0), cache_rows=80)
    assert torch.equal(faster.read_optimizer_state(ids), plain.read_optimizer_state(ids))
    moved = (faster.read_rows(ids) - initial_weight()).norm(dim=1)
    touched = moved > 0
    assert touched.sum() > 100
    assert (moved[touched] > (plain.read_rows(ids) - initial_weight()).norm(dim=1)[touched]).all()
    opt = tieredemb.MomentumScaledRowWiseAdagrad(lr=0.1, scale=16.0)
    assert tieredemb.optim.from_meta(opt.to_meta()) == opt


@pytest.mark.parametrize("make_opt", [lambda: tieredemb.SGD(lr=0.05), lambda: tieredemb.Adagrad(lr=0.1),
                                      lambda: tieredemb.RowWiseAdagrad(lr=0.1), lambda: tieredemb.Adam(lr=0.01),
                                      lambda: tieredemb.MomentumScaledRowWiseAdagrad(lr=0.1, scale=8),
                                      lambda: tieredemb.Adagrad(lr=0.1, weight_decay=0.1,
                                                                weight_decay_mode="decoupled")],
                         ids=["sgd", "adagrad", "rowwise", "adam", "msrowwise", "adagrad-decoupled"])
def test_result_independent_of_tiers_and_policy(make_opt):
    """Invariant 6: the same weights and optimizer state, bit for bit, whatever the tiers (and
    whatever the rows' padding)."""
    tables = [train_ours(make_opt(), mode="mean", **t) for t in TIERS]
    ids = torch.arange(NUM)
    first = torch.cat([tables[0].read_rows(ids), tables[0].read_optimizer_state(ids)], 1)
    for t, emb in zip(TIERS[1:], tables[1:]):
        got = torch.cat([emb.read_rows(ids), emb.read_optimizer_state(ids)], 1)
        assert torch.equal(got, first), f"tiers {t} differ from the whole table in tier 0"


def test_trains_a_model_end_to_end():
    """A tiny model with a tiered table learns a separable target (loss falls)."""
    torch.manual_seed(0)
    emb = tieredemb.TieredEmbeddingBag(1000, 16, mode="mean", cache_rows=100,
                                       optimizer=tieredemb.Adagrad(lr=0.5), seed=1)
    head = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    target = (torch.arange(1000) % 2).float()
    losses = []
    for step in range(300):
        ids = torch.randint(0, 1000, (32, 1))
        y = target[ids[:, 0]]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(head(emb(ids)).squeeze(1), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-30:]) / 30 < 0.5 * sum(losses[:30]) / 30


def test_adagrad_matches_torch_with_an_eps_that_shows(kernels):
    """Mutant o1 (optim.py Adagrad.apply_torch: eps inside the square root). Every Adagrad parity
    test uses eps=1e-10, where sqrt(s) + eps and sqrt(s + eps) agree to float32: eps's place in
    the formula (the torch twin's, the GPU path's reference; and the native kernel's) is untested."""
    num, dim = 50, 4
    w0 = torch.randn(num, dim, generator=torch.Generator().manual_seed(1))
    ref = torch.nn.EmbeddingBag(num, dim, mode="sum", _weight=w0.clone())
    opt = torch.optim.Adagrad(ref.parameters(), lr=0.1, eps=0.5)
    emb = tieredemb.TieredEmbeddingBag(num, dim, mode="sum", optimizer=tieredemb.Adagrad(lr=0.1, eps=0.5),
                                       _weight=w0.clone(), cache_rows=20)
    g = torch.Generator().manual_seed(2)
    for _ in range(10):
        ids, offsets = torch.randint(0, num, (24,), generator=g), torch.arange(0, 24, 4)
        grad = torch.randn(6, dim, generator=g) * 0.1
        opt.zero_grad()
        ref(ids, offsets).backward(grad)
        opt.step()
        emb(ids, offsets).backward(grad)
    torch.testing.assert_close(emb.read_rows(torch.arange(num)), ref.weight.detach(), rtol=1e-5, atol=1e-6)


def test_a_learning_rate_schedule_matches_torchs(tmp_path, kernels):
    """set_learning_rate (FBGEMM's TBE's name) from the next backward on, as a torch LR scheduler
    sets its optimizer's; the rate was fixed for a table's life (a review of FBGEMM parity). A
    store reopens with the optimizer it was made with, the rate set again after."""
    ref = torch.nn.EmbeddingBag(NUM, DIM, mode="sum", _weight=initial_weight())
    opt = torch.optim.Adagrad(ref.parameters(), lr=0.1, eps=1e-10)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)
    ours = tieredemb.TieredEmbeddingBag(NUM, DIM, mode="sum", optimizer=tieredemb.Adagrad(lr=0.1, eps=1e-10),
                                        _weight=initial_weight(), cache_rows=80, ssd_path=tmp_path / "t",
                                        ssd_options={"backend": "log"})
    for step, (ids, offsets, grad) in enumerate(batches()):
        if step == STEPS // 2:  # (a resume: the first optimizer, then the rate the schedule is at)
            ours.close()
            ours = tieredemb.TieredEmbeddingBag(NUM, DIM, mode="sum", cache_rows=80, ssd_path=tmp_path / "t",
                                                optimizer=tieredemb.Adagrad(lr=0.1, eps=1e-10))
        ours.set_learning_rate(opt.param_groups[0]["lr"])  # (the schedule's rate this step)
        assert ours.get_learning_rate() == opt.param_groups[0]["lr"]
        opt.zero_grad()
        ref(ids, offsets).backward(grad)
        opt.step()
        sched.step()
        ours(ids, offsets).backward(grad)
    torch.testing.assert_close(ours.read_rows(torch.arange(NUM)), ref.weight.detach(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"lr=-0.5: must be >= 0"):
        ours.set_learning_rate(-0.5)
    assert 0 < ours.get_learning_rate() < 0.1 * 0.9 ** (STEPS - 2)
    with pytest.raises(RuntimeError, match="has no optimizer: its learning rate cannot be set"):
        tieredemb.TieredEmbeddingBag(NUM, DIM, optimizer=None).set_learning_rate(0.1)


def test_a_collections_learning_rate():
    tables = [tieredemb.EmbeddingBagConfig("a", 50, 4, ["fa"]), tieredemb.EmbeddingBagConfig("b", 30, 8, ["fb"])]
    ebc = tieredemb.TieredEmbeddingBagCollection(tables, optimizer=tieredemb.SGD(lr=0.5))
    ebc.set_learning_rate(0.0)  # (nothing moves at rate 0)
    before = [ebc.read_rows(t.name, torch.arange(t.num_embeddings)) for t in tables]
    batch = {"fa": (torch.tensor([1, 2, 3]), torch.tensor([0, 1])), "fb": (torch.tensor([4, 5]), torch.tensor([0, 1]))}
    ebc(batch).values().sum().backward()
    assert all(torch.equal(ebc.read_rows(t.name, torch.arange(t.num_embeddings)), w) for t, w in zip(tables, before))
    ebc.set_learning_rate(0.25)
    assert ebc.get_learning_rate() == 0.25 and [t.optimizer.lr for t in ebc.embedding_bag_configs()] == [0.25, 0.25]
    ebc(batch).values().sum().backward()
    assert torch.equal(ebc.read_rows("a", torch.tensor([1])), before[0][1:2] - 0.25)


def test_a_numpy_learning_rate_is_a_python_float(tmp_path):
    """A schedule may give numpy numbers: taken as floats (a review: np.float32 was kept, and
    export_rows then failed writing it into meta.json)."""
    import numpy as np
    emb = tieredemb.TieredEmbeddingBag(NUM, DIM, optimizer=tieredemb.Adam(lr=np.float32(0.01), betas=(np.float64(0.8),
                                                                                                     0.9)))
    emb.set_learning_rate(np.float32(0.05))
    assert type(emb.get_learning_rate()) is float and all(type(b) is float for b in emb.optimizer.betas)
    emb.write_rows(torch.arange(3), torch.ones(3, DIM))
    emb.export_rows(tmp_path / "x")
