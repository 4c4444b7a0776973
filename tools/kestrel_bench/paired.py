"""`kestrel_bench paired`: the CI gate's input, same-run ratios that hold on a busy machine.

Baseline and optimized paths are timed INTERLEAVED: `--blocks` rounds, each timing `--per-block`
calls of one path then of the other (the order alternating), so both see the same machine load
at the same moments. The recorded ratio is baseline p10 / optimized p10 over all the calls:
the least-disturbed tenth of each path, which is what the code costs when the machine lets
it run (medians swing with the neighbours' load on a shared machine, the p10s do not). A path
2x slower halves its ratio whatever the machine's speed.

Pairs (on the CPU, seconds each):
  control_tick   the control node's full tick (PolicyRunner.step: inputs, safety, inference,
                 command), backend cpu_eager (baseline) vs onnxruntime (optimized)
  control_step   the backend step alone, same backends
ratios: <pair>_p10 (baseline p10 / optimized p10, interleaved calls).

  python -m kestrel_bench paired --out docs/benchmarks/gate_cpu     # the committed baseline
  python -m kestrel_bench paired --out /tmp/gate && python -m kestrel_bench gate \
      /tmp/gate.json --baseline docs/benchmarks/gate_cpu.json --only 'ratios.*' \
      --tolerance ratios=0.4
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable

import numpy as np

from kestrel_bench import record as rec_mod
from kestrel_bench import stats
from kestrel_bench.repo import ensure_paths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=int, default=30, help="interleaved rounds")
    parser.add_argument("--per-block", type=int, default=40, help="calls per path per round")
    parser.add_argument("--baseline", default="cpu_eager", help="baseline control backend")
    parser.add_argument("--optimized", default="onnxruntime", help="optimized control backend")
    rec_mod.add_common_arguments(parser)


def interleaved(base: Callable[[], object], opt: Callable[[], object], blocks: int,
                per_block: int, warmup: int = 20) -> tuple[np.ndarray, np.ndarray, float]:
    """(baseline seconds [blocks*per_block], optimized seconds [same], baseline p10 /
    optimized p10)."""
    for _ in range(warmup):
        base()
        opt()
    tb = np.empty((blocks, per_block))
    to = np.empty((blocks, per_block))
    clock = time.perf_counter_ns

    def timed(fn: Callable[[], object], out: np.ndarray) -> None:
        for i in range(per_block):
            a = clock()
            fn()
            out[i] = (clock() - a) * 1e-9

    gc.collect()
    gc.disable()
    try:
        for b in range(blocks):
            first, second = ((base, tb), (opt, to)) if b % 2 == 0 else ((opt, to), (base, tb))
            timed(first[0], first[1][b])
            timed(second[0], second[1][b])
    finally:
        gc.enable()
    return tb.ravel(), to.ravel(), float(np.percentile(tb, 10) / np.percentile(to, 10))


def _control_pair(baseline: str, optimized: str, cache: str) -> dict[str, tuple]:
    """pair name -> (baseline fn, optimized fn, close fns) for the control tick and step."""
    from kestrel_control.core.policy_runner import PolicyRunner

    from kestrel_bench.control import make_config
    from kestrel_bench.control_loop import N_JOINTS

    runners = [PolicyRunner(make_config(name, cache, 64)) for name in (baseline, optimized)]
    js = np.zeros((2, N_JOINTS))
    count = [0]

    def tick(runner: PolicyRunner) -> Callable[[], object]:
        def fn() -> None:
            count[0] += 1
            js[0, 0] = 1e-4 * (count[0] % 1000)
            now = time.time_ns()
            runner.joint_states.write(js, now)
            runner.step(now + 1000)
        return fn

    return {"control_tick": (tick(runners[0]), tick(runners[1])),
            "control_step": (runners[0].backend.step, runners[1].backend.step),
            "_close": tuple(r.close for r in runners)}


def run(args: argparse.Namespace) -> int:
    ensure_paths("kestrel_models", "kestrel_common", "kestrel_control")
    import tempfile

    import torch

    torch.set_num_threads(1)
    config = {"blocks": args.blocks, "per_block": args.per_block, "baseline": args.baseline,
              "optimized": args.optimized, "threads": 1,
              "pairs": ["control_tick", "control_step"]}
    record = rec_mod.Record("paired", config=config, argv=args.argv, commit=args.commit)
    with tempfile.TemporaryDirectory() as cache:
        try:
            pairs = _control_pair(args.baseline, args.optimized, cache)
        except ValueError as exc:
            print(f"paired: {exc}")
            return 2
        try:
            for name in config["pairs"]:
                base, opt = pairs[name]
                tb, to, ratio = interleaved(base, opt, args.blocks, args.per_block)
                record.add(f"{name}:{args.baseline}", "baseline",
                           latency_ms=stats.summary(tb, 1e3))
                record.add(f"{name}:{args.optimized}", "optimized",
                           latency_ms=stats.summary(to, 1e3))
                record.ratio(f"{name}_p10", ratio)
                print(f"  {name}: {args.baseline} p10 {np.percentile(tb, 10) * 1e6:.1f} us, "
                      f"{args.optimized} p10 {np.percentile(to, 10) * 1e6:.1f} us, "
                      f"ratio {ratio:.2f}", flush=True)
        finally:
            for close in pairs["_close"]:
                close()
    record.note("ratios: baseline p10 / optimized p10 over interleaved calls (the CI gate "
                "compares these; absolute latencies depend on the machine and its load)")
    rec_mod.finish(record, args)
    return 0
