"""The whole stack as separate processes over DDS (launch-free runner, same table and YAML as
stack.launch.py): every node comes up, data flows sim -> perception -> planner -> control ->
sim, and every process stops cleanly when asked (no stray processes)."""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.dds, pytest.mark.slow]


def test_stack_runs_end_to_end(env, ros_domain, run_dir, dds_guard):
    import rclpy
    from rclpy.executors import SingleThreadedExecutor

    from kestrel_bringup.monitor_node import StackMonitor
    from kestrel_bringup.run_stack import StackRunner
    from kestrel_bringup.stack_report import StackReport

    runner = StackRunner(env=env, log_dir=run_dir, echo=False)
    report = StackReport()
    context = rclpy.Context()
    rclpy.init(context=context, domain_id=ros_domain)
    monitor = StackMonitor(report, "put the red cube in the bin", plan_interval=1.0,
                           context=context)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(monitor)
    runner.start()
    try:
        deadline = time.monotonic() + 150.0
        while time.monotonic() < deadline and report.flow_failures() and not runner.exited():
            executor.spin_once(timeout_sec=0.1)
        # a little longer so that rates and loop statistics are meaningful
        settle = time.monotonic() + 3.0
        while time.monotonic() < settle:
            executor.spin_once(timeout_sec=0.1)
        exited = runner.exited()
    finally:
        codes = runner.stop()
        monitor.close()
        rclpy.try_shutdown(context=context)
    logs = {p.name: p.read_text(errors="replace")[-3000:] for p in run_dir.glob("*.log")}
    assert exited == [], f"nodes exited early: {exited}\n{logs}"
    assert report.flow_failures() == [], report.table(0.0) + f"\n{logs}"
    assert all(c in (0, -2) for c in codes.values()), f"exit codes {codes}\n{logs}"
    for p in runner.procs:
        try:
            import os
            os.killpg(p.proc.pid, 0)
            pytest.fail(f"stray processes of {p.entry.name}")
        except ProcessLookupError:
            pass
    # content checks on what flowed
    assert report.loop_stats is not None and report.loop_stats.cycles_total > 0
    assert report.sim_applied_commands > 0
