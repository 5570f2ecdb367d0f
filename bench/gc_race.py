"""Python's cyclic collector judging a live autograd graph unreachable, for real: torch alone, then
a tiered table's training (native/drop_guard.cc says why the table does not depend on it).

The race: torch's traversal of a tensor visits its autograd node's context only while the tensor
and the node have one owner each. The main thread makes a view of a custom Function's fresh output
(torch releases the GIL inside the op, and the view adds an owner to both); a second thread runs the
collector at that moment. If the owner is added between the collector's two passes, the context
counts as referenced only from inside the garbage, and everything that hangs off it is finalized
(its __del__ run, weak references to it cleared) though the graph is alive; the objects are
resurrected after. A table's batch released itself in __del__, so its pins went before its
backward (tests/test_gpu_inputs.py failed on a 2-core CI machine once in some hundred runs).

    python bench/gc_race.py [--seconds 30] [--switch 1e-5]

prints, for each part, the steps run and how many were finalized before their backward (torch
alone: an object on the context whose __del__ ran; the table: a backward that found its batch
released, or pins that went early). A CPU measurement; no GPU needed. The table's part hits the
race far more rarely than torch alone (its forward allocates enough after the Function's output
that the collecting thread's own collections move the graph out of the youngest generation first):
with the batch's release in __del__ it once found 1 in 17,895 steps, 0 in 53,150 another time.
"""

from __future__ import annotations

import argparse
import gc
import sys
import threading
import time

import torch


class _Held:
    """What a context holds: whether its __del__ ran."""

    __slots__ = ("finalized",)

    def __init__(self):
        self.finalized = False

    def __del__(self):
        self.finalized = True


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.held = [_Held()]
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        ctx.early = ctx.held[0].finalized
        return grad * 2


def _collecting():
    """A thread that runs the collector's youngest generation over and over, until stopped (the
    race needs a short collection, over a generation that holds the fresh graph)."""
    stop = threading.Event()

    def run():
        while not stop.is_set():
            gc.collect(0)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return stop, thread


def torch_alone(seconds: float) -> tuple[int, int]:
    """Steps of a custom Function whose output is viewed at once, and how many found their
    context's object finalized before their backward."""
    x = torch.randn(64, 8, requires_grad=True)
    steps = early = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        out = _Double.apply(x)
        view = out.reshape(8, 8, 8)  # (a second owner of the output and of its node)
        node = out.grad_fn
        del out
        view.sum().backward()
        early += node.early
        steps += 1
    return steps, early


def a_table(seconds: float) -> tuple[int, int]:
    """Steps of a TieredEmbedding (its forward views the pooled rows, as the race needs) with a
    tier 0 smaller than a batch, and how many backwards found their batch released or its pins
    gone."""
    import tieredemb

    emb = tieredemb.TieredEmbedding(1000, 8, cache_rows=64, optimizer=tieredemb.SGD(lr=0.01), seed=1)
    g = torch.Generator().manual_seed(0)
    steps = early = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ids = torch.randint(0, 1000, (4, 8), generator=g)
        out = emb(ids)
        pinned = emb._store.tier0.index.pinned
        try:
            out.backward(torch.ones_like(out))
            early += pinned != len(torch.unique(ids))
        except RuntimeError as e:
            if "released before backward" not in str(e):
                raise
            early += 1
        steps += 1
    emb.close()
    return steps, early


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="per part (default 30)")
    ap.add_argument("--switch", type=float, default=1e-5,
                    help="sys.setswitchinterval: how often the two threads trade the GIL (default 1e-5 s)")
    args = ap.parse_args(argv)
    sys.setswitchinterval(args.switch)
    for name, part in (("torch alone", torch_alone), ("a tiered table", a_table)):
        stop, thread = _collecting()
        try:
            steps, early = part(args.seconds)
        finally:
            stop.set()
            thread.join()
        print(f"{name}: {steps} steps, {early} finalized before their backward", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
