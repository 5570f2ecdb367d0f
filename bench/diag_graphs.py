"""Where a whole table's graphed (cuda_graphs=True) and eager lookups part, step by step, on a GPU: the
data of tests/test_gpu.py's test_cuda_graphs_train_bit_for_bit_as_kernels_launched_one_by_one, by pooling mode
(arguments: max, sum, mean; default max) and by rows and rounding (fp16 rounded stochastically or to
the nearest, fp32), each path run twice (is it deterministic?), and the stochastic case against the
CPU engine too. It prints the first step where two runs part, the rows and columns that differ and
how often those rows occur in the step's ids. Written for the thirty-fourth session's failure of that
test with max pooling of fp16 rows rounded stochastically (bench/RESULTS.md); needs a GPU."""
from __future__ import annotations

import sys

import torch

import tieredemb

NUM, DIM = 300, 16


def shaped(seed, bags, length, short=0):
    g = torch.Generator().manual_seed(seed)
    n = bags * length - short
    return ((torch.rand(n, generator=g) ** 2 * NUM).long(),
            torch.cat([torch.tensor([0]), torch.arange(length - short, n, length)]), torch.randn(bags, DIM, generator=g))


def table(emb):
    ids = torch.arange(NUM)
    return torch.cat([emb.read_rows(ids), emb.read_optimizer_state(ids)], 1)


def run(mode, kw, graphs, device):
    data = [shaped(k, 16, 5, short=k) for k in range(4)] + [shaped(10 + k, 7, 3) for k in range(4)] + [shaped(20, 16, 5)]
    emb = tieredemb.TieredEmbeddingBag(NUM, DIM, mode, padding_idx=5, seed=3, device=device,
                                       **({"cuda_graphs": graphs} if device == "cuda" else {}), **kw())
    outs, tabs = [], []
    for ids, offsets, grad in data:
        out = emb(ids, offsets)
        outs.append(out.detach().cpu())
        out.backward(grad.to(device))
        tabs.append(table(emb))
    (ids, offsets, grad), (ids2, offsets2, grad2) = data[0], data[1]
    first, second = emb(ids, offsets), emb(ids2, offsets2)
    (first * grad.to(device)).sum().add((second * grad2.to(device)).sum()).backward()
    outs += [first.detach().cpu(), second.detach().cpu()]
    tabs.append(table(emb))
    return outs, tabs, data


def compare(name, a, b):
    (oa, ta, data), (ob, tb, _) = a, b
    for k, (x, y, s, t) in enumerate(zip(oa, ob, ta, tb)):
        if not torch.equal(x, y) or not torch.equal(s, t):
            rows = (s != t).any(1).nonzero().flatten().tolist()
            bags = (x != y).any(1).nonzero().flatten().tolist()
            print(f"{name}: first parted at step {k}: outputs equal {torch.equal(x, y)} (bags {bags[:8]}), "
                  f"rows differing {rows[:12]}")
            for r in rows[:3]:
                cols = (s[r] != t[r]).nonzero().flatten().tolist()
                print(f"   row {r} cols {cols[:8]}: {s[r][cols[:4]].tolist()} vs {t[r][cols[:4]].tolist()}")
            if k < len(data):
                ids = data[k][0]
                for r in rows[:3]:
                    print(f"   row {r} occurs {(ids == r).sum().item()} times in the step's ids")
            return
    print(f"{name}: equal at every step")


SGD16SR = lambda: dict(optimizer=tieredemb.SGD(lr=0.1), dtype=torch.float16, stochastic_rounding=True)  # noqa: E731
CASES = {"fp16-sr": SGD16SR,
         "fp16-nearest": lambda: dict(optimizer=tieredemb.SGD(lr=0.1), dtype=torch.float16),
         "fp32-sgd": lambda: dict(optimizer=tieredemb.SGD(lr=0.1))}
if not torch.cuda.is_available():
    sys.exit("diag_graphs: no CUDA device here (it compares CUDA graphs with kernels launched one by one)")
for mode in sys.argv[1:] or ["max"]:
    for case, kw in CASES.items():
        g1, g2 = run(mode, kw, True, "cuda"), run(mode, kw, True, "cuda")
        e1, e2 = run(mode, kw, False, "cuda"), run(mode, kw, False, "cuda")
        compare(f"{mode} {case} graphs run 1 / run 2", g1, g2)
        compare(f"{mode} {case} eager run 1 / run 2", e1, e2)
        compare(f"{mode} {case} graphs / eager", g1, e1)
        if case == "fp16-sr":
            compare(f"{mode} {case} eager / cpu", e1, run(mode, kw, False, "cpu"))
            compare(f"{mode} {case} graphs / cpu", g1, run(mode, kw, False, "cpu"))
