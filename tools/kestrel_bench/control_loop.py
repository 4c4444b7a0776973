"""The control loop with ROS I/O live, for `kestrel_bench control --loops` (needs rclpy).

A separate process (`python -m kestrel_bench.control_loop --publisher RATE`) publishes
sensor_msgs/JointState at RATE Hz on absolute deadlines and, as a robot driver would, counts the
commands with a RELIABLE subscriber; this process's subscription writes the joint states into
the runner's double buffer (executor thread). Loop modes:
  thread      the loop on a thread of this process, publishing each command directly (the
              node's thread mode);
  process     the node's process mode (kestrel_control.core.loop_process): the loop in a child
              interpreter over shared memory running the C tick; a publisher thread here,
              woken by the loop's eventfd, publishes the commands (delivery latency = tick
              start -> publish call);
  process_py  the same with the Python tick.
Only standard messages are used (no kestrel_interfaces needed).
"""

from __future__ import annotations

import array
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from kestrel_bench import stats
from kestrel_bench.repo import ensure_paths

ensure_paths("kestrel_common")
from kestrel_common.spin_thread import SpinThread  # noqa: E402

N_JOINTS = 6
NAMES = [f"joint_{i}" for i in range(N_JOINTS)]
TOPIC_IN, TOPIC_OUT = "/kestrel_bench/joint_states", "/kestrel_bench/joint_command"
MODES = ("thread", "process", "process_py")


def parse_cpus(text: str) -> tuple[int, ...]:
    return tuple(int(c) for c in text.split(",") if c != "") if text else ()


def _qos(reliable: bool, depth: int):  # noqa: ANN202
    from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy

    return QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=depth,
                      reliability=ReliabilityPolicy.RELIABLE if reliable
                      else ReliabilityPolicy.BEST_EFFORT)


def publisher_main(rate: float, cpus: str) -> None:
    """JointState at `rate` Hz until stdin closes; prints `commands_received N` at the end."""
    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from sensor_msgs.msg import JointState

    if cpus:
        os.sched_setaffinity(0, set(parse_cpus(cpus)))
    rclpy.init()
    node = rclpy.create_node("kestrel_bench_publisher")
    pub = node.create_publisher(JointState, TOPIC_IN, _qos(False, 1))  # sensor: best effort
    received = [0]
    node.create_subscription(JointState, TOPIC_OUT,  # the command QoS: RELIABLE, depth 10
                             lambda _m: received.__setitem__(0, received[0] + 1), _qos(True, 10))
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    spin = SpinThread(executor, name="publisher_spin")
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    msg = JointState(name=NAMES, position=[0.1] * N_JOINTS, velocity=[0.0] * N_JOINTS)
    period, t0, k = int(1e9 / rate), time.monotonic_ns(), 0
    while not stop.is_set():
        k += 1
        delay = t0 + k * period - time.monotonic_ns()
        if delay > 0:
            time.sleep(delay * 1e-9)
        now = time.time_ns()
        msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(now, 1_000_000_000)
        msg.position[0] = 0.1 + 0.1 * np.sin(k * 1e-3)
        pub.publish(msg)
    print(f"commands_received {received[0]}", flush=True)
    if spin.stop(timeout_s=2.0):
        node.destroy_node()
    rclpy.try_shutdown()


def stop_publisher(pub: subprocess.Popen, out_file: Any) -> int | None:
    """Close the publisher's stdin, wait; the commands its subscriber got (None if unknown)."""
    if pub.stdin is not None and not pub.stdin.closed:
        pub.stdin.close()
    try:
        pub.wait(10)
    except subprocess.TimeoutExpired:
        pub.kill()
        pub.wait(5)
        return None
    out_file.seek(0)
    for line in out_file.read().decode(errors="replace").splitlines():
        if line.startswith("commands_received "):
            return int(line.split()[1])
    return None


class RosIo:
    """In-process node: subscription -> the runner's joint-state buffer; command publisher."""

    def __init__(self, runner: Any, js_buffer: Any = None) -> None:
        import rclpy
        from rclpy.executors import SingleThreadedExecutor
        from sensor_msgs.msg import JointState

        rclpy.init()
        self.rclpy = rclpy
        self.node = rclpy.create_node("kestrel_bench_control")
        self.runner = runner
        self.js_buffer = js_buffer if js_buffer is not None else runner.joint_states
        self.received = self.published = 0
        self.delivery = np.zeros(400_000)  # process mode: s from tick start to publish call
        self.n_delivery = 0
        self.node.create_subscription(JointState, TOPIC_IN, self._on_js, _qos(False, 1))
        self.pub = self.node.create_publisher(JointState, TOPIC_OUT, _qos(True, 10))
        self.msg = JointState(name=NAMES)
        self.msg.position = array.array("d", [0.0] * N_JOINTS)
        self.view = np.frombuffer(self.msg.position, dtype=np.float64)
        executor = SingleThreadedExecutor()
        executor.add_node(self.node)
        self.spin = SpinThread(executor, name="control_io_spin")

    def _on_js(self, msg: Any) -> None:
        self.received += 1
        stamp = msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec
        pos = np.frombuffer(msg.position, dtype=np.float64)

        def fill(slot: np.ndarray) -> None:
            slot[0] = pos
            slot[1] = 0.0

        self.js_buffer.write_with(fill, stamp)

    def _publish(self, command: np.ndarray, stamp_ns: int) -> None:
        np.copyto(self.view, command)
        stamp = self.msg.header.stamp
        stamp.sec, stamp.nanosec = divmod(stamp_ns, 1_000_000_000)
        self.pub.publish(self.msg)
        self.published += 1

    def publish_from_thread(self, _robot: int, command: np.ndarray, stamp_ns: int) -> None:
        """Process mode: the LoopProcess publisher thread hands over the newest command."""
        self._publish(command, stamp_ns)
        if self.n_delivery < self.delivery.shape[0]:
            self.delivery[self.n_delivery] = (time.time_ns() - stamp_ns) * 1e-9
            self.n_delivery += 1

    def tick(self, _deadline_ns: int) -> None:
        now = time.time_ns()
        command, info = self.runner.step(now)
        if info.valid:
            self._publish(command, now)

    def close(self) -> None:
        if self.spin.stop(timeout_s=2.0):
            self.node.destroy_node()
        self.rclpy.try_shutdown()


def tail_pattern(lat: np.ndarray, wake: np.ndarray, rate: float) -> dict:
    """When the slow cycles happen: steps above the run's p99 and wake-ups later than 200 us,
    their count and most common spacings in cycles (a periodic disturbance shows as a spacing
    of rate / its frequency), the 10 latest wake-ups (cycle, us), and the slowest 0.1 % by
    phase of each second in 100 ms bins (a once-a-second disturbance fills one bin)."""
    out: dict = {}
    if lat.size == 0:
        return out
    for name, idx in (("slow_steps", np.flatnonzero(lat > np.percentile(lat, 99))),
                      ("late_wakes", np.flatnonzero(wake > 200e-6))):
        gaps = np.diff(idx)
        vals, counts = np.unique(gaps, return_counts=True) if gaps.size else ([], [])
        top = sorted(zip(counts, vals, strict=True), reverse=True)[:5]
        out[name] = {"count": int(idx.size),
                     "common_spacing_cycles": [[int(v), int(c)] for c, v in top]}
    out["latest_wakes"] = [[int(i), float(wake[i]) * 1e6] for i in np.argsort(wake)[-10:][::-1]]
    slow = np.flatnonzero(lat > np.percentile(lat, 99.9))
    per_s = max(1, int(round(rate)))
    out["slowest_0.1pct_by_phase_of_1s"] = [
        int(b) for b in np.bincount((slow % per_s) * 10 // per_s, minlength=10)]
    return out


def step_histogram(samples_us: np.ndarray, bins: int = 60) -> dict:
    """Loop step latencies -> {"edges": [bins + 1] us, log-spaced, "counts": [bins]} (the
    report's histogram with the deadline); {} without samples."""
    a = np.asarray(samples_us, dtype=np.float64)
    a = a[np.isfinite(a) & (a > 0)]
    if a.size == 0:
        return {}
    lo, hi = a.min(), a.max()
    edges = np.geomspace(lo, hi * 1.001 if hi > lo else lo * 2, bins + 1)
    counts, _ = np.histogram(a, bins=edges)
    return {"edges": [round(float(e), 3) for e in edges], "counts": counts.tolist()}


def run_loop(config: Any, rate: float, cycles: int, mode: str, args: Any) -> dict:
    """One loop with ROS I/O live. Returns {"summary": step-latency seconds summary (ms),
    "metrics": {...}, "extra": {...}} or {"skipped": reason}."""
    from kestrel_control.core.loop_process import LoopProcess, LoopSettings
    from kestrel_control.core.miss_cause import CAUSES
    from kestrel_control.core.policy_runner import PolicyRunner
    from kestrel_control.core.rt_loop import RealtimeLoop
    from kestrel_control.core.stats import LoopStats

    from kestrel_bench.power import PowerMeter

    loop_cpus = parse_cpus(args.loop_cpus)
    proc = runner = loop = None
    try:
        if mode in ("process", "process_py"):
            proc = LoopProcess(config, LoopSettings(
                period_s=1.0 / rate, spin_s=args.spin_us * 1e-6, rt_priority=args.rt_priority,
                cpu_affinity=loop_cpus, lock_memory=args.lock_memory, manage_gc=True,
                switch_interval_s=args.gil_switch_us * 1e-6, native_tick=mode == "process",
                miss_attribution=not args.no_miss_attribution), start_timeout_s=300.0,
                stats_capacity=cycles + 10_000)
            info = proc.start()
        else:
            runner = PolicyRunner(config)
    except ValueError as exc:
        if proc is not None:
            proc.close()
        return {"skipped": str(exc)}
    pub_out = tempfile.TemporaryFile()
    pub = subprocess.Popen([sys.executable, "-m", "kestrel_bench.control_loop", "--publisher",
                            str(args.pub_rate), "--cpus", args.publisher_cpus],
                           stdin=subprocess.PIPE, stdout=pub_out)
    io = RosIo(runner, proc.joint_states[0] if proc is not None else None)
    meter = PowerMeter() if config.backend.startswith("cuda") else None
    try:
        deadline = time.monotonic() + 30.0
        while io.received < 10 and time.monotonic() < deadline:
            time.sleep(0.05)  # bounded wait for the publisher's discovery
        if io.received < 10:
            return {"skipped": "no joint states from the publisher process within 30 s"}
        received0 = io.received
        if proc is not None:
            loop_stats = proc.stats
            applied = proc.activate(io.publish_from_thread, timeout_s=60.0)
        else:
            loop_stats = LoopStats(1.0 / rate, capacity=cycles + 10_000)
            loop = RealtimeLoop(1.0 / rate, io.tick, loop_stats, spin_s=args.spin_us * 1e-6,
                                rt_priority=args.rt_priority, cpu_affinity=list(loop_cpus) or None,
                                lock_memory=args.lock_memory, manage_gc=True,
                                switch_interval_s=args.gil_switch_us * 1e-6,
                                miss_attribution=not args.no_miss_attribution,
                                name=f"bench-{config.backend}")
            applied = loop.start(timeout_s=30.0)  # mlockall of a CUDA process can take s
        if meter is not None:
            meter.start()
        t_start = time.monotonic()
        limit = t_start + cycles / rate * 3 + 30
        # counted from the reply to activate: the loop may have ticked while it came back
        target = loop_stats.cycles + loop_stats.deadline_misses + cycles
        while loop_stats.cycles + loop_stats.deadline_misses < target and time.monotonic() < limit:
            time.sleep(0.2)  # progress poll of a bounded wait
        if meter is not None:
            meter.stop()
        if proc is not None:
            proc.deactivate()
        else:
            loop.stop(2.0)
        wall = time.monotonic() - t_start
        commands_received = stop_publisher(pub, pub_out)  # after the loop stopped publishing
        period = loop_stats.period.since(0)
        wake = loop_stats.wake_error.since(0)
        lat = loop_stats.step_latency.since(0)
        us = 1e6
        metrics = {
            "cycles": int(loop_stats.cycles), "deadline_misses": int(loop_stats.deadline_misses),
            "stale_inputs": int(loop_stats.stale_inputs),
            "step_errors": int(loop_stats.step_errors),
            **{name: int(getattr(loop_stats, name)) for name in CAUSES},
            "wake_error_p50_us": stats.summary(wake, us).get("p50"),
            "wake_error_p999_us": stats.summary(wake, us).get("p999"),
            "wake_error_max_us": stats.summary(wake, us).get("max"),
            "period_jitter_p999_us": stats.summary(np.abs(period - 1.0 / rate), us).get("p999"),
            "commands_published": io.published,
            "commands_received_by_subscriber": commands_received,
            "joint_states_received": io.received - received0, "wall_s": wall}
        extra: dict = {"rt_settings": applied, "tail": tail_pattern(lat, wake, rate)}
        if proc is not None:
            extra["loop_process"] = {"pid": info["pid"], "native_tick": info.get("native_tick", ""),
                                     "commands_coalesced": proc.coalesced}
            d = stats.summary(io.delivery[:io.n_delivery], us)
            metrics["delivery_p50_us"], metrics["delivery_p999_us"] = d.get("p50"), d.get("p999")
        print(f"  loop {config.backend}@{rate:g}Hz [{mode}]: {loop_stats.cycles} cycles, misses "
              f"{loop_stats.deadline_misses}, step p50 {stats.summary(lat, us).get('p50', 0):.1f}"
              f" p99.9 {stats.summary(lat, us).get('p999', 0):.1f} us", flush=True)
        power = meter.result(items=int(loop_stats.cycles), item="control step") if meter else None
        return {"latency_ms": stats.summary(lat, 1e3), "metrics": metrics, "extra": extra,
                "power": power, "histogram_us": step_histogram(lat * us)}
    finally:
        io.close()
        if proc is not None:
            proc.close()
        if runner is not None:
            runner.close()
        if pub.poll() is None:
            stop_publisher(pub, pub_out)
        pub_out.close()


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="the joint-state publisher process of the loop")
    ap.add_argument("--publisher", type=float, required=True, help="rate, Hz")
    ap.add_argument("--cpus", default="")
    a = ap.parse_args()
    publisher_main(a.publisher, a.cpus)
