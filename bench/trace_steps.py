"""Where a profiled training step's time goes, from a torch.profiler Chrome trace (bench_gpu.py
--profile writes one per system, each step inside a "bench_step" annotation): per step, the host's
wall time split into the training thread's torch ops, its CUDA API calls outside them (Triton's
launches among them), the time it waits while autograd's device thread runs the backward, and the
rest (Python, and native code that is not a torch op): the four add up to the step; the kernel
launches of both threads; and the GPU's busy time (the union of its kernels, copies and fills) in
the steps' span. The means over the steps are printed.

    python bench/trace_steps.py DIR/ours-hbm.trace.json [more traces]
"""

from __future__ import annotations

import json
import sys

STEP = "bench_step"


def _union(intervals: list) -> float:
    """Total length covered by the (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _clip(intervals: list, lo: float, hi: float) -> list:
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def summarize(path: str) -> dict:
    """{steps, host_ms, torch_ops_ms, cuda_api_ms, launches, backward_wait_ms, other_ms, gpu_busy_ms}:
    means per step (milliseconds; launches a count)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    # (the host's annotation: torch also writes one per GPU stream, "gpu_user_annotation")
    steps = sorted((e for e in spans if e.get("name") == STEP and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])
    if not steps:
        raise ValueError(f"{path}: no {STEP!r} annotations (profile with bench_gpu.py --profile)")
    main = steps[0]["tid"]
    ops = [(e["ts"], e["ts"] + e["dur"]) for e in spans
           if e.get("cat") == "cpu_op" and e["tid"] == main and e.get("name") != STEP]
    api = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("cat") in ("cuda_runtime", "cuda_driver")
           and e["tid"] == main]
    launches = [e for e in spans if e.get("cat") in ("cuda_runtime", "cuda_driver") and "aunch" in e.get("name", "")]
    backward = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("cat") == "cpu_op" and e["tid"] != main
                and e.get("name", "").startswith("autograd::engine::evaluate_function")]
    device = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    out = {"host": 0.0, "torch_ops": 0.0, "cuda_api": 0.0, "backward_wait": 0.0, "other": 0.0, "launches": 0}
    for s in steps:
        lo, hi = s["ts"], s["ts"] + s["dur"]
        op_t = _union(_clip(ops, lo, hi))
        busy = _union(_clip(ops + api, lo, hi))
        every = _union(_clip(ops + api + backward, lo, hi))
        out["host"] += s["dur"]
        out["torch_ops"] += op_t
        out["cuda_api"] += busy - op_t  # (CUDA calls outside any torch op)
        out["backward_wait"] += every - busy  # (the backward's thread at work, the training thread idle)
        out["other"] += max(0.0, s["dur"] - every)
        out["launches"] += sum(1 for e in launches if lo <= e["ts"] < hi)
    first, last = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
    n = len(steps)
    result = {f"{k}_ms": v / n / 1e3 for k, v in out.items() if k != "launches"}
    result.update(steps=n, launches=out["launches"] / n,
                  gpu_busy_ms=_union(_clip(device, first, last + 1e9)) / n / 1e3)
    return result


def line(name: str, r: dict) -> str:
    return (f"{name:18s} host {r['host_ms']:.3f} ms a step: torch ops {r['torch_ops_ms']:.3f}, CUDA calls outside "
            f"them {r['cuda_api_ms']:.3f}, waiting on autograd's backward thread "
            f"{r['backward_wait_ms']:.3f}, the rest (Python, native) {r['other_ms']:.3f}; {r['launches']:.0f} kernel "
            f"launches (both threads); GPU busy "
            f"{r['gpu_busy_ms']:.3f} ms a step")


def main(argv=None) -> int:
    paths = (argv if argv is not None else sys.argv[1:])
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    for path in paths:
        name = path.rsplit("/", 1)[-1].replace(".trace.json", "")
        print(line(name, summarize(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
