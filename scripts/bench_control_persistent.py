#!/usr/bin/env python3
"""cuda_persistent's two trade-offs, measured (a benchmark, not a test; GPU only):

1. step latency vs resident programs: the backend step (host request -> answer) at the
   reference sizes for each --programs count and --batches, back to back and with the 1 kHz
   loop's ~950 us idle gap before each step (busy-waited, as the loop does);
2. what a resident kernel costs other GPU work: bf16 4096^2 matmuls on another stream, their
   rate alone vs with the kernel resident and ticked at 1 kHz, per programs count and
   nanosleep backoff; the ticker either in a second process pinned to its own CPU
   (--cotenant-mode process: two CUDA contexts, which the GPU time-slices without MPS) or in a
   thread of this process (--cotenant-mode thread: one context, the kernels share the SMs;
   the GIL is shared too, switch interval 100 us, so the matmul launches can wait on it).

  python scripts/bench_control_persistent.py --out docs/benchmarks/control_persistent_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common  # noqa: E402
import bench_control as bc  # noqa: E402 (puts models/ on sys.path)
from kestrel_models.control.persistent_step import PersistentTritonBackend  # noqa: E402
from kestrel_models.control.policy import PolicyConfig, build_policy  # noqa: E402
from kestrel_models.control.runtimes import policy_from_actor_critic  # noqa: E402


def make(programs: int, batch: int, backoff_ns: int = 0) -> PersistentTritonBackend:
    policy = policy_from_actor_critic(build_policy(PolicyConfig(), seed=1))
    return PersistentTritonBackend(policy, batch, programs=programs, backoff_ns=backoff_ns)


def step_times(backend: PersistentTritonBackend, iters: int, gap_us: float) -> np.ndarray:
    """Backend step durations (s) with `gap_us` of busy-waiting before each one."""
    clock, gap_ns = time.perf_counter_ns, int(gap_us * 1e3)
    out = np.empty(iters)
    for i in range(iters + 100):
        end = clock() + gap_ns
        while clock() < end:
            pass
        a = clock()
        backend.step()
        if i >= 100:
            out[i - 100] = (clock() - a) * 1e-9
    return out


def ticker_main(programs: int, backoff_ns: int, seconds: float) -> None:
    """Child process: builds the backend (compile + launch), prints 'ready', then steps it at
    1 kHz for `seconds` and prints the step percentiles as JSON."""
    backend = make(programs, 1, backoff_ns)
    step_times(backend, 200, 950.0)
    print("ready", flush=True)
    times = step_times(backend, int(seconds * 1000), 950.0)
    backend.close()
    print(json.dumps(bc.pct(times)), flush=True)


def cotenant_thread(spec: str, seconds: float) -> tuple[float, dict]:
    """The kernel resident and ticked at 1 kHz by a thread of this process while the matmuls
    run: (matmul rate, step percentiles)."""
    import threading

    programs, backoff = (int(v) for v in spec.split(":"))
    backend = make(programs, 1, backoff)
    step_times(backend, 200, 950.0)
    done, times = threading.Event(), []

    def tick() -> None:
        while not done.is_set():
            times.append(step_times(backend, 100, 950.0))

    sys.setswitchinterval(1e-4)
    thread = threading.Thread(target=tick)
    thread.start()
    try:
        rate = matmul_rate(seconds)
    finally:
        done.set()
        thread.join(10.0)
        sys.setswitchinterval(5e-3)
        backend.close()
    return rate, bc.pct(np.concatenate(times))


def matmul_rate(seconds: float) -> float:
    """bf16 4096^2 matmuls per second on a side stream."""
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(5):
            x @ x
        stream.synchronize()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(20):
                x @ x
            stream.synchronize()
            n += 20
    return n / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--programs", default="16,32,64,128", help="'' = co-tenant part only")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--iters", type=int, default=5000)
    ap.add_argument("--cotenant", default="64:0,64:200,128:0", help="programs:backoff_ns list")
    ap.add_argument("--cotenant-s", type=float, default=3.0)
    ap.add_argument("--cotenant-mode", choices=("process", "thread"), default="process")
    ap.add_argument("--ticker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("skipped: needs a CUDA GPU")
        return 0
    torch.set_num_threads(1)
    if args.ticker:
        p, b = (int(v) for v in args.ticker.split(":"))
        ticker_main(p, b, args.cotenant_s + 1.0)
        return 0
    result = {"machine": bench_common.machine_info(),
              "commit": args.commit or bench_common.git_commit(),
              "command": " ".join(sys.argv), "steps": {}, "cotenant": {}}
    print("## backend step, us (p50 / p99 / p99.9 / max)")
    for batch in (int(b) for b in args.batches.split(",") if args.programs):
        for programs in (int(p) for p in args.programs.split(",")):
            backend = make(programs, batch)
            for gap in (0.0, 950.0):
                r = bc.pct(step_times(backend, args.iters, gap))
                result["steps"][f"B{batch}_P{programs}_gap{gap:g}"] = r
                print(f"  batch {batch} programs {programs:3d} gap {gap:3.0f} us: {r['p50']:6.1f}"
                      f" / {r['p99']:6.1f} / {r['p999']:6.1f} / {r['max']:6.1f}", flush=True)
            backend.close()
    alone = matmul_rate(args.cotenant_s)
    result["cotenant"]["matmul_per_s_alone"] = alone
    print(f"## co-tenant: bf16 4096^2 matmuls alone {alone:.0f}/s")
    cpus = sorted(os.sched_getaffinity(0))
    result["cotenant"]["mode"] = args.cotenant_mode
    for spec in args.cotenant.split(",") if args.cotenant_mode == "thread" else ():
        rate, step = cotenant_thread(spec, args.cotenant_s)
        result["cotenant"][spec] = {"matmul_per_s": rate, "share_of_alone": rate / alone,
                                    "step_us": step}
        print(f"  programs:backoff {spec:7s} (thread): matmuls {rate:6.0f}/s "
              f"({100 * rate / alone:3.0f} % of alone); step p50 {step['p50']:.1f} p99.9 "
              f"{step['p999']:.1f} us", flush=True)
    for spec in args.cotenant.split(",") if args.cotenant_mode == "process" else ():
        cmd = [sys.executable, __file__, "--ticker", spec, "--cotenant-s", str(args.cotenant_s)]
        if len(cpus) > 1:  # the ticker on its own CPU
            cmd = ["taskset", "-c", str(cpus[-1])] + cmd
            os.sched_setaffinity(0, set(cpus[:-1]))
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        line = child.stdout.readline().strip()  # the kernel is resident and ticking from here
        if line != "ready":
            raise RuntimeError(f"ticker {spec}: {line!r} instead of 'ready'")
        rate = matmul_rate(args.cotenant_s)
        out, _ = child.communicate(timeout=60)
        os.sched_setaffinity(0, set(cpus))
        step = json.loads(out.strip().splitlines()[-1])
        result["cotenant"][spec] = {"matmul_per_s": rate, "share_of_alone": rate / alone,
                                    "step_us": step}
        print(f"  programs:backoff {spec:7s}: matmuls {rate:6.0f}/s ({100 * rate / alone:3.0f} %"
              f" of alone); step p50 {step['p50']:.1f} p99.9 {step['p999']:.1f} us", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
