"""A monitor node for the demo and stack tests: counts every stack topic, collects latencies
from the nodes' own messages, sends PlanTask goals, and reads the sim's applied-command counter
from /diagnostics. Results accumulate in a StackReport (stack_report.py).

On its own, beside a running stack (prints the report when it ends):

    python -m kestrel_bringup.monitor_node [--instruction "put the red cube in the bin"]
        [--plan-interval 3] [--duration 30]

It ends on SIGINT/SIGTERM or after --duration; without --instruction it sends no goals.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import NoReturn

from action_msgs.msg import GoalStatus
from diagnostic_msgs.msg import DiagnosticArray
from kestrel_interfaces.action import PlanTask
from kestrel_interfaces.msg import (ControlTarget, LoopStatistics, PerceptionResult, StepStatus,
                                    TaskPlan)
from rclpy.action import ActionClient
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from geometry_msgs.msg import PointStamped
from rosgraph_msgs.msg import Clock
from sensor_msgs.msg import CameraInfo, Image, JointState, PointCloud2

from kestrel_bringup.stack_report import StackReport

BEST_EFFORT = QoSProfile(depth=10, reliability=ReliabilityPolicy.BEST_EFFORT)
RELIABLE = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
LATCHED = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                     durability=DurabilityPolicy.TRANSIENT_LOCAL)

# topic -> (type, qos). Sensor topics are published best effort; a best-effort subscription
# matches any publisher. Topics whose content the monitor does not read are subscribed raw
# (no deserialisation): counting ~1,000 msg/s must not steal the CPU the stack runs on.
CONTENT_TOPICS = {"/perception/result", "/control/loop_stats"}
TOPICS = {
    "/clock": (Clock, BEST_EFFORT),
    "/camera/image_raw": (Image, BEST_EFFORT),
    "/camera/camera_info": (CameraInfo, BEST_EFFORT),
    "/lidar/points": (PointCloud2, BEST_EFFORT),
    "/joint_states": (JointState, BEST_EFFORT),
    "/ee_position": (PointStamped, BEST_EFFORT),
    "/perception/result": (PerceptionResult, BEST_EFFORT),
    "/planner/plan": (TaskPlan, LATCHED),
    "/planner/step_status": (StepStatus, RELIABLE),
    "/control/target": (ControlTarget, RELIABLE),
    "/control/joint_command": (JointState, BEST_EFFORT),
    "/control/loop_stats": (LoopStatistics, BEST_EFFORT),
}

SIM_APPLIED_KEYS = ("joint_command_applied",)
VALIDATION = {PlanTask.Result.VALIDATION_ACCEPTED: "accepted",
              PlanTask.Result.VALIDATION_REJECTED: "rejected",
              PlanTask.Result.VALIDATION_ERROR: "error"}


class StackMonitor(Node):
    def __init__(self, report: StackReport, instruction: str, plan_interval: float = 3.0,
                 name: str = "kestrel_monitor", **kwargs) -> None:
        super().__init__(name, **kwargs)
        self.report = report
        self.instruction = instruction
        self.plan_interval = plan_interval
        for topic, (msg_type, qos) in TOPICS.items():
            self.create_subscription(msg_type, topic, self._make_cb(topic), qos,
                                     raw=topic not in CONTENT_TOPICS)
        self.create_subscription(DiagnosticArray, "/diagnostics", self._on_diag, RELIABLE)
        self._action = ActionClient(self, PlanTask, "/planner/plan_task")
        self._goal_pending = False
        self._next_goal = 0.0
        self.create_timer(0.2, self._maybe_send_goal)

    def _make_cb(self, topic: str):
        def cb(msg: object) -> None:
            self.report.on_message(topic, time.monotonic())
            if isinstance(msg, PerceptionResult):
                self.report.on_latency("perception: total", msg.latency)
                for st in msg.timings:
                    self.report.on_latency(f"perception: {st.name}", st.duration)
            elif isinstance(msg, LoopStatistics) and (msg.cycles_window > 0
                                                      or self.report.loop_stats is None):
                # a window without cycles (loop stopping, or every deadline of it missed) has
                # NaN percentiles: keep the latest window that measured something
                self.report.loop_stats = msg
        return cb

    def _on_diag(self, msg: DiagnosticArray) -> None:
        for status in msg.status:
            values = {kv.key: kv.value for kv in status.values}
            with self.report.lock:
                self.report.counters[status.name] = values
            if status.name.split("/")[-1] == "sim" or status.name.endswith(": sim"):
                for key in SIM_APPLIED_KEYS:
                    if key in values:
                        try:
                            self.report.sim_applied_commands = int(float(values[key]))
                        except ValueError:
                            pass

    # ---- planner goals -------------------------------------------------------------------------
    def _maybe_send_goal(self) -> None:
        now = time.monotonic()
        if not self.instruction or self._goal_pending or now < self._next_goal:
            return
        if self.report.count("/perception/result") == 0 or not self._action.server_is_ready():
            return
        goal = PlanTask.Goal(instruction=self.instruction, use_image=False)
        self._goal_pending = True
        self._sent_at = now
        fut = self._action.send_goal_async(goal)
        fut.add_done_callback(self._on_goal_response)

    def _on_goal_response(self, fut) -> None:
        handle = fut.result()
        if handle is None or not handle.accepted:
            self.report.on_plan("goal_rejected")
            self._done()
            return
        handle.get_result_async().add_done_callback(self._on_result)

    def _on_result(self, fut) -> None:
        res = fut.result()
        if res is None or res.status != GoalStatus.STATUS_SUCCEEDED:
            self.report.on_plan("failed")
        else:
            r = res.result
            self.report.on_plan(VALIDATION.get(r.validation_status, "unknown"))
            self.report.on_latency("planner: time to first token", r.time_to_first_token)
            self.report.on_latency("planner: plan total", r.total_time)
        self.report.on_latency("planner: goal round trip", time.monotonic() - self._sent_at)
        self._done()

    def close(self) -> None:
        """Destroy the action client, then the node. (An action client left to the node's
        destruction leaves Fast DDS shared-memory files behind.)"""
        self._action.destroy()
        self.destroy_node()

    def _done(self) -> None:
        self._goal_pending = False
        self._next_goal = time.monotonic() + self.plan_interval


def main(argv: list[str] | None = None) -> NoReturn:
    """Watch the stack until SIGINT/SIGTERM or --duration, print the report, exit 0."""
    import rclpy
    from rclpy.executors import MultiThreadedExecutor
    from rclpy.signals import SignalHandlerOptions
    from rclpy.task import Future

    from kestrel_common.process_stop import SignalWatch, StopSignals, exit_process

    argv = list(sys.argv if argv is None else argv)
    ours = argv[1:argv.index("--ros-args")] if "--ros-args" in argv else argv[1:]
    ap = argparse.ArgumentParser(prog="kestrel_bringup.monitor_node",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--instruction", default="", help="PlanTask goal to send (default: none)")
    ap.add_argument("--plan-interval", type=float, default=3.0,
                    help="s between a goal's result and the next goal")
    ap.add_argument("--duration", type=float, default=0.0, help="s; 0 = until SIGINT")
    args = ap.parse_args(ours)
    # as the nodes' run_node: rclpy's handlers off (the context stays valid to the end), the
    # first signal completes `stopped`, which ends the spin (kestrel_common.process_stop)
    signals = StopSignals()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signals)
    ros_argv = argv[:1] + (argv[argv.index("--ros-args"):] if "--ros-args" in argv else [])
    rclpy.init(args=ros_argv, signal_handler_options=SignalHandlerOptions.NO)
    report = StackReport()
    monitor = StackMonitor(report, args.instruction, args.plan_interval)
    executor = MultiThreadedExecutor(num_threads=2)
    executor.add_node(monitor)
    stopped: Future = Future()
    SignalWatch(signals, "monitor", on_first=lambda: stopped.set_result(True))
    print(f"[monitor] watching {len(TOPICS)} topics and /diagnostics", flush=True)
    t0 = time.monotonic()
    if not signals.stop.is_set():
        executor.spin_until_future_complete(
            stopped, timeout_sec=args.duration if args.duration > 0 else None)
    signals.disarm()
    executor.shutdown(timeout_sec=2.0)
    monitor.close()
    rclpy.try_shutdown(uninstall_handlers=False)  # (process_stop, step 2)
    print(report.table(time.monotonic() - t0), flush=True)
    exit_process(0, "monitor")


if __name__ == "__main__":
    main()
