"""The `tieredemb` command. `tieredemb demo` trains a small model on a table larger than its cache."""

from __future__ import annotations

import argparse
import sys
import time

import torch


def _zipf_sampler(rows: int, alpha: float, seed: int):
    """Draws ids with P(rank r) ~ 1/r^alpha over a fixed random permutation of the table."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, rows + 1, dtype=torch.float64).pow(-alpha)
    cdf = torch.cumsum(weights, 0)
    cdf /= cdf[-1].clone()
    perm = torch.randperm(rows, generator=g)

    def sample(n: int) -> torch.Tensor:
        ranks = torch.searchsorted(cdf, torch.rand(n, generator=g, dtype=torch.float64)).clamp_(max=rows - 1)
        return perm[ranks]

    return sample


def demo(argv: list[str]) -> int:
    from tqdm import tqdm

    import tieredemb

    p = argparse.ArgumentParser(prog="tieredemb demo", description=demo.__doc__)
    p.add_argument("--rows", type=int, default=2_000_000, help="rows of the embedding table")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--cache-rows", type=int, default=None, help="tier 0 rows (default: rows // 20)")
    p.add_argument("--host-rows", type=int, default=None, help="host cache rows (default: none)")
    p.add_argument("--ssd-path", default=None, help="put the backing store on SSD at this directory")
    p.add_argument("--ssd-backend", default=None, choices=["log", "rocksdb", "slots"],
                   help="SSD store for a new table (default rocksdb; log is the fast one for training)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=2048, help="bags per batch")
    p.add_argument("--bag-len", type=int, default=20)
    p.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the ids")
    p.add_argument("--policy", default="lru", choices=["lru", "lfu", "clock"])
    args = p.parse_args(argv)
    cache_rows = args.cache_rows or max(1, args.rows // 20)

    torch.manual_seed(0)
    emb = tieredemb.TieredEmbeddingBag(args.rows, args.dim, mode="sum", cache_rows=cache_rows,
                                       host_rows=args.host_rows, ssd_path=args.ssd_path, policy=args.policy,
                                       ssd_options={"backend": args.ssd_backend} if args.ssd_backend else None,
                                       optimizer=tieredemb.RowWiseAdagrad(lr=0.05))
    # A two-tower-ish toy: pooled embedding -> MLP -> click logit; the label depends on the ids.
    mlp = torch.nn.Sequential(torch.nn.Linear(args.dim, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adagrad(mlp.parameters(), lr=0.05)
    sample = _zipf_sampler(args.rows, args.alpha, seed=1)
    offsets = torch.arange(0, args.batch * args.bag_len, args.bag_len)
    print(f"table: {args.rows:,} rows x {args.dim} ({args.rows * emb.width * 4 / 2**20:,.0f} MiB with optimizer state); "
          f"tier 0 holds {cache_rows:,} rows ({100 * cache_rows / args.rows:.1f}%)"
          + (f", host cache {args.host_rows:,} rows" if args.host_rows else "")
          + (f", SSD at {args.ssd_path}" if args.ssd_path else ", backing store in host memory"))
    lookups, start, loss_avg = 0, time.perf_counter(), None
    bar = tqdm(range(args.steps), desc="training", unit="batch")
    for step in bar:
        ids = sample(args.batch * args.bag_len)
        label = ((ids.view(args.batch, args.bag_len) % 7) == 0).any(1).float()
        logit = mlp(emb(ids, offsets)).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, label)
        opt.zero_grad()
        loss.backward()
        opt.step()
        lookups += ids.numel()
        loss_avg = loss.item() if loss_avg is None else 0.9 * loss_avg + 0.1 * loss.item()
        if step % 10 == 0:
            hit = emb.stats()["tier0"]["hit_rate"]
            bar.set_postfix(loss=f"{loss_avg:.4f}", tier0_hit=f"{hit:.3f}")
    emb.flush()
    elapsed = time.perf_counter() - start
    print(f"\n{args.steps} steps in {elapsed:.1f} s: {lookups / elapsed:,.0f} lookups/s "
          f"(forward + backward + fused optimizer, incl. the MLP)")
    print(f"final loss (moving average): {loss_avg:.4f}")
    print("per-tier statistics:")
    for tier, s in emb.stats().items():
        if tier == "prefetch":
            print(f"  prefetch: {s['registered']} batches registered, {s['prefetched_rows']:,} rows prefetched, "
                  f"{s['demand_misses']:,} rows read on demand, forwards waited {s['wait_seconds']:.2f} s")
        elif "hit_rate" in s:
            print(f"  {tier:6s} hit rate {s['hit_rate']:.3f}  hits {s['hits']:,}  misses {s['misses']:,}  "
                  f"evictions {s['evictions']:,} (dirty write-backs {s['dirty_writebacks']:,}, "
                  f"clean drops {s['clean_drops']:,})  moved {s['bytes_moved'] / 2**20:,.1f} MiB")
        else:
            print(f"  {tier:6s} {s}")
    emb.close()
    return 0


# Each command: name -> (module, function, one-line help). The function takes argv and returns
# an exit status; modules are imported only when their command runs.
COMMANDS = {
    "demo": ("tieredemb.cli", "demo", "train a small model on a table larger than its cache"),
    "simulate": ("tieredemb.sim.cli", "simulate", "hit ratios of policies and tier sizes on a trace"),
    "mrc": ("tieredemb.sim.cli", "mrc", "miss-ratio curve of a trace"),
    "replay": ("tieredemb.sim.replay", "replay", "drive the real engine with a trace"),
    "trace": ("tieredemb.trace.cli", "trace", "convert | inspect | synth traces"),
}


def _usage() -> str:
    lines = ["usage: tieredemb COMMAND [options]   (tieredemb COMMAND --help for its options)", "commands:"]
    lines += [f"  {name:9s} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import importlib

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"tieredemb: unknown command {argv[0]!r}\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[argv[0]]
    return getattr(importlib.import_module(module), func)(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
