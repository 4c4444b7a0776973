#!/usr/bin/env python3
"""Run the whole Kestrel stack on the embedded simulator for a bounded time, then print a
table (topic rates, per-node latency percentiles, control-loop deadline misses) and judge the
data flow sim -> perception -> planner -> control -> sim.

    make demo                         # = scripts/run.sh python scripts/demo.py
    python scripts/demo.py --duration 60 --json out/demo.json

Exit status 0 only if every node came up and stayed up, and data flowed end to end.
Runs on its own ROS_DOMAIN_ID (default: a free one in 1..100) with localhost discovery.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from ros_harness import DomainLease  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float,
                        default=float(os.environ.get("KESTREL_DEMO_DURATION", "30")),
                        help="seconds of measured run after start-up (default 30)")
    parser.add_argument("--startup-timeout", type=float, default=60.0,
                        help="max seconds for every node to come up and data to flow")
    parser.add_argument("--instruction", default="put the red cube in the bin")
    parser.add_argument("--json", type=Path, default=None, help="write the report as JSON")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="node logs (default: a temp dir, printed at the end)")
    parser.add_argument("--quiet", action="store_true", help="do not echo node output")
    args = parser.parse_args()

    lease = DomainLease()
    os.environ["ROS_DOMAIN_ID"] = str(lease.domain_id)
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kestrel_demo_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("ROS_LOG_DIR", str(log_dir / "ros_log"))

    import rclpy
    from rclpy.executors import MultiThreadedExecutor

    from kestrel_bringup.monitor_node import StackMonitor
    from kestrel_bringup.run_stack import StackRunner
    from kestrel_bringup.stack_report import StackReport

    print(f"[demo] ROS_DOMAIN_ID={lease.domain_id}, logs in {log_dir}", flush=True)
    runner = StackRunner(log_dir=log_dir, echo=not args.quiet)
    report = StackReport()
    rclpy.init()
    monitor = StackMonitor(report, args.instruction)
    executor = MultiThreadedExecutor(num_threads=2)
    executor.add_node(monitor)
    spin = threading.Thread(target=executor.spin, daemon=True)
    spin.start()
    failures: list[str] = []
    t_start = time.monotonic()
    runner.start()
    try:
        # Start-up: wait (bounded) until every link of the chain has carried a message.
        deadline = time.monotonic() + args.startup_timeout
        while time.monotonic() < deadline and not runner.exited():
            if not report.flow_failures():
                break
            time.sleep(0.25)
        startup = time.monotonic() - t_start
        print(f"[demo] start-up took {startup:.1f} s; measuring for {args.duration:.0f} s",
              flush=True)
        end = time.monotonic() + args.duration
        while time.monotonic() < end and not runner.exited():
            time.sleep(0.25)
        early = runner.exited()
        failures += [f"node '{n}' exited early with code {c}" for n, c in early]
    finally:
        codes = runner.stop()
        executor.shutdown(timeout_sec=2.0)
        monitor.close()
        rclpy.try_shutdown()
        lease.release()
    failures += report.flow_failures()
    failures += [f"node '{n}' exit code {c} at shutdown" for n, c in codes.items()
                 if c not in (0, -2) and not any(n in f for f in failures)]
    measured = time.monotonic() - t_start
    print()
    print(report.table(measured))
    print()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(_report_json(report, measured, failures), indent=2))
    if failures:
        print("DEMO FAILED:\n  " + "\n  ".join(failures))
        print(f"node logs: {log_dir}")
        return 1
    print("DEMO OK: every node came up and data flowed sim -> perception -> planner -> "
          "control -> sim")
    return 0


def _report_json(report, duration: float, failures: list[str]) -> dict:
    import numpy as np
    out = {"duration_s": duration, "failures": failures, "plans": report.plans,
           "sim_applied_commands": report.sim_applied_commands,
           "topics": {t: {"count": s.count, "rate_hz": s.rate()} for t, s in report.topics.items()},
           "latency_ms": {}}
    for name, samples in report.latencies.items():
        arr = np.asarray(samples) * 1e3
        out["latency_ms"][name] = {"n": int(arr.size), "p50": float(np.percentile(arr, 50)),
                                   "p99": float(np.percentile(arr, 99)), "max": float(arr.max())}
    ls = report.loop_stats
    if ls is not None:
        out["control_loop"] = {"period_target_s": ls.period_target, "cycles": ls.cycles_total,
                               "deadline_misses": ls.deadline_misses,
                               "miss_causes": {k: getattr(ls, k, 0) for k in (
                                   "misses_preempted", "misses_blocked", "misses_late_wake",
                                   "misses_slow_step")},
                               "step_latency_p99_s": ls.step_latency_p99,
                               "step_latency_p999_s": ls.step_latency_p999,
                               "stale_inputs": ls.stale_inputs}
    return out


if __name__ == "__main__":
    sys.exit(main())
