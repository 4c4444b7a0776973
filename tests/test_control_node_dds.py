"""The control node as its own process over DDS: commands from joint states, loop statistics,
counted bad inputs, hold on stale input, sim time (/clock), and configure failures; the loop
tests run in both loop modes (a thread of the node; a child process over shared memory)."""

from __future__ import annotations

import glob
import math
import threading
import time

import numpy as np
import pytest
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from kestrel_interfaces.msg import ControlTarget, LoopStatistics
from rosgraph_msgs.msg import Clock
from sensor_msgs.msg import JointState

from kestrel_common.base_node import COMMAND_QOS, SENSOR_QOS
from kestrel_common.conversions import ns_to_stamp, stamp_to_ns
from ros_harness import diagnostics_values

pytestmark = pytest.mark.dds

MODULE = "kestrel_control.control_node"
JOINTS = ["shoulder_pan", "shoulder_lift", "elbow", "wrist_1", "wrist_2", "wrist_3"]
LOWER = [-3.14159, -2.0, -2.6, -2.6, -2.6, -3.14159]
UPPER = [3.14159, 2.0, 2.6, 2.6, 2.6, 0.2]  # wrist_3 limited to 0.2 rad: clamping is exercised
Q = np.array([0.1, -0.3, 0.5, -0.7, 0.9, 0.5])  # joint positions sent, node order, rad
SCALE = 0.05  # action_scale: |command - position| <= SCALE unless clamped
RATE = 500.0
PARAMS = {"loop.rate_hz": RATE, "loop.stats_period": 0.1, "diagnostics_period": 0.2,
          "safety.max_obs_age": 0.05, "policy.action_scale": SCALE, "safety.joint_upper": UPPER,
          "safety.joint_lower": LOWER}


class JointStateSource:
    """Publishes JointState at ~200 Hz from a thread; `mode` picks what ('good', 'off', ...).

    The joint order in the message is reversed w.r.t. the node's, so reordering is tested.
    """

    def __init__(self, probe, stamp_fn) -> None:
        self.pub = probe.publisher(JointState, "/control/input/joint_states", SENSOR_QOS)
        self.stamp_fn = stamp_fn
        self.mode = "good"
        self.last_good_stamp = 0
        self.first_good_stamp = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def message(self, mode: str) -> JointState:
        names, pos = list(reversed(JOINTS)), list(reversed(Q.tolist()))
        if mode == "short":
            names, pos = names[:5], pos[:5]
        elif mode == "unknown":
            names = ["gripper"] + names[1:]
        elif mode == "nan":
            pos[2] = math.nan
        elif mode == "implausible":
            pos[2] = 1e6  # finite, but a million rad: a wrong unit or a broken encoder
        msg = JointState(name=names, position=pos, velocity=[0.0] * len(pos))
        stamp = self.stamp_fn()
        msg.header.stamp = ns_to_stamp(stamp)
        if mode == "good":
            self.last_good_stamp = stamp
            self.first_good_stamp = self.first_good_stamp or stamp
        return msg

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.mode != "off":
                self.pub.publish(self.message(self.mode))
            time.sleep(0.005)  # publishing rate, not a synchronisation

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)


def _latest(col):
    msgs = col.snapshot()
    return msgs[-1] if msgs else None


def _wait_stats(stats, pred, timeout=15.0):
    msgs = stats.wait_for(lambda m: bool(m) and pred(m[-1]), timeout)
    assert msgs and pred(msgs[-1]), f"loop_stats never satisfied the condition: {_latest(stats)}"
    return msgs[-1]


def _check_command(msg: JointState) -> np.ndarray:
    # the arm's joints, then the gripper's (gripper.joint; open: no target asked to close it)
    assert list(msg.name) == JOINTS + ["finger_left"] and len(msg.position) == 7
    q = np.asarray(msg.position)[:6]
    assert msg.position[6] == 0.0
    assert np.all(np.isfinite(q)) and np.all(q >= LOWER) and np.all(q <= UPPER), q
    return q


LOOP_MODES = pytest.mark.parametrize("loop_mode", ["thread", "process"])


@LOOP_MODES
def test_commands_stats_bad_inputs_and_stale_hold(launch_node, probe, loop_mode):
    node = launch_node(MODULE, "control", params=PARAMS | {"loop.mode": loop_mode})
    commands = probe.subscribe(JointState, "/control/output/joint_command", COMMAND_QOS)
    stats = probe.subscribe(LoopStatistics, "/control/output/loop_stats", COMMAND_QOS)
    diag = probe.subscribe(DiagnosticArray, "/diagnostics")
    target_pub = probe.publisher(ControlTarget, "/control/input/target", COMMAND_QOS)
    source = JointStateSource(probe, probe.now_ns)
    try:
        assert probe.wait_for_subscribers(target_pub, timeout=30.0), node.output()
        target = ControlTarget(mode=ControlTarget.MODE_JOINT, joint_positions=[0.0] * 6)
        target_pub.publish(target)

        # ---- good input: commands near the (reordered) positions, within the limits --------
        msgs = commands.wait_for(lambda m: len(m) >= 100, timeout=60.0)
        assert len(msgs) >= 100, node.output()
        t_probe = probe.now_ns()
        for msg in msgs[-50:]:
            q = _check_command(msg)
            np.testing.assert_array_less(np.abs(q[:5] - Q[:5]), SCALE + 1e-9)
            assert q[5] == 0.2  # 0.5 + 0.05 * tanh(a) > 0.2: clamped to joint_upper
            stamp = stamp_to_ns(msg.header.stamp)  # node clock at the tick (wall time here)
            assert source.first_good_stamp <= stamp <= t_probe
        stamps = [stamp_to_ns(m.header.stamp) for m in msgs]
        assert all(b >= a for a, b in zip(stamps, stamps[1:], strict=False))
        # the policy acts per tick (over all of them: a starved source makes the node hold, and
        # a hold repeats one command)
        assert len(set(tuple(m.position) for m in msgs)) > 1

        # ---- loop statistics: rate ~ rate_hz, every deadline served or counted --------------
        _wait_stats(stats, lambda s: s.cycles_total > 1000 and s.clamped_actions > 0)
        window = stats.snapshot()[-10:]
        assert all(s.period_target == pytest.approx(1.0 / RATE) for s in window)
        # rate from the cycle counter over the windows' own stamps (node clock), not from the
        # nominal 0.1 s stats period: a stats publication delayed on the loaded CI cores makes
        # one window longer, not the loop faster
        first, last = window[0], window[-1]
        span_s = (stamp_to_ns(last.header.stamp) - stamp_to_ns(first.header.stamp)) * 1e-9
        assert span_s > 0, [stamp_to_ns(s.header.stamp) for s in window]
        rate = (last.cycles_total - first.cycles_total) / span_s
        assert 0.5 * RATE <= rate <= 1.15 * RATE, (rate, [s.cycles_window for s in window])
        # the period statistics within the same bounds as the rate: a loop the loaded CI cores
        # slow down overruns (each miss counted) and skips to its next deadline, so its
        # periods are multiples of the target; it never runs early
        assert 0.8 / RATE <= np.median([s.period_p50 for s in window]) <= 1 / (0.5 * RATE)
        assert all(s.step_latency_max >= s.step_latency_p99 >= s.step_latency_p50 > 0
                   for s in window if s.cycles_window)
        assert all(s.period_max >= s.period_p999 >= s.period_p99 and
                   s.wake_error_max >= s.wake_error_p999 >= s.wake_error_p99
                   for s in window if s.cycles_window > 1)

        # ---- bad inputs: counted, commands keep flowing and stay finite ---------------------
        for mode, counter in (("short", "joint_state_bad_length"),
                              ("unknown", "joint_state_bad_names")):
            source.mode = mode
            got = diag.wait_for(lambda m, c=counter: int(
                diagnostics_values(m, "control").get(c, "0")) >= 1, timeout=10.0)
            assert int(diagnostics_values(got, "control").get(counter, "0")) >= 1, node.output()
        rejected_before = _latest(stats).rejected_nonfinite
        source.mode = "nan"
        _wait_stats(stats, lambda s: s.rejected_nonfinite > rejected_before + 10)
        implausible_before = _latest(stats).rejected_implausible
        source.mode = "implausible"
        _wait_stats(stats, lambda s: s.rejected_implausible > implausible_before + 10)
        source.mode = "good"
        assert probe.publish_until(
            target_pub, lambda: ControlTarget(mode=ControlTarget.MODE_JOINT,
                                              joint_positions=[0.0] * 3),
            lambda: int(diagnostics_values(diag.snapshot(), "control").get(
                "target_bad_length", "0")) >= 1, period=0.1, timeout=10.0), node.output()
        n_before = len(commands.snapshot())
        msgs = commands.wait_for(lambda m: len(m) >= n_before + 50, timeout=30.0)
        for msg in msgs[-50:]:
            q = _check_command(msg)
            np.testing.assert_array_less(np.abs(q[:5] - Q[:5]), SCALE + 1e-9)
        values = diagnostics_values(diag.snapshot(), "control")
        assert int(values["loop_rejected_nonfinite"]) > 0 and int(values["loop_cycles"]) > 0
        assert int(values["loop_rejected_implausible"]) > 0
        assert "loop_step_latency_p999" in values and "rt_gc" in values
        # deadline misses split by cause (miss_cause.py), from the loop thread or process
        causes = ("loop_misses_preempted", "loop_misses_blocked", "loop_misses_late_wake",
                  "loop_misses_slow_step")
        assert "rt_miss_attribution" in values and all(k in values for k in causes), values
        if values["rt_miss_attribution"].startswith("on"):
            assert sum(int(values[k]) for k in causes) <= int(values["loop_deadline_misses"])
        assert values["loop_mode"] == loop_mode

        # ---- stale input: counted, the last command is held ---------------------------------
        stale_before = _latest(stats).stale_inputs
        source.mode = "off"
        _wait_stats(stats, lambda s: s.stale_inputs > stale_before + 50)
        stopped_at = source.last_good_stamp  # final: the source is off

        def late(msgs: list) -> list:  # commands of ticks at which the input was stale
            return [m for m in msgs if stamp_to_ns(m.header.stamp) > stopped_at + int(0.06e9)]

        late = late(commands.wait_for(lambda m: len(late(m)) >= 50, timeout=30.0))
        assert len(late) >= 50, "commands stopped flowing while holding"
        held = {tuple(m.position) for m in late}
        assert len(held) == 1, f"commands not held: {len(held)} distinct"
        _check_command(late[-1])
        assert node.alive()
    finally:
        source.close()
    assert node.stop() == 0, node.output()
    assert "Traceback" not in node.output()
    assert not glob.glob(f"/dev/shm/kestrel_control_{node.proc.pid}_*")  # segment unlinked


@LOOP_MODES
def test_sim_time_observation_age_uses_clock_topic(launch_node, probe, loop_mode):
    """use_sim_time: stamps in sim time (far from wall time) are fresh against /clock."""
    # max_obs_age 0.5 s of sim time (100 joint states): loose enough that a loaded CI machine
    # delaying /clock against joint states does not matter, while ages taken against wall time
    # (sim stamps start at 1000 s) would make every cycle stale
    node = launch_node(MODULE, "control", params=PARAMS | {
        "use_sim_time": True, "safety.max_obs_age": 0.5, "loop.mode": loop_mode})
    sim_ns = [1000 * 10**9]  # sim time starts at 1000 s
    clock_pub = probe.publisher(Clock, "/clock", 10)
    commands = probe.subscribe(JointState, "/control/output/joint_command", COMMAND_QOS)
    stats = probe.subscribe(LoopStatistics, "/control/output/loop_stats", COMMAND_QOS)
    lock = threading.Lock()

    def sim_stamp() -> int:  # advance sim time 5 ms per joint state and publish /clock first
        with lock:
            sim_ns[0] += 5_000_000
            clock_pub.publish(Clock(clock=ns_to_stamp(sim_ns[0])))
            return sim_ns[0]

    source = JointStateSource(probe, sim_stamp)
    try:
        msgs = commands.wait_for(lambda m: len(m) >= 100, timeout=30.0)
        assert len(msgs) >= 100, node.output()
        for msg in msgs[-50:]:
            q = _check_command(msg)
            assert 1000e9 < stamp_to_ns(msg.header.stamp) <= sim_ns[0]  # node clock = /clock
            np.testing.assert_array_less(np.abs(q[:5] - Q[:5]), SCALE + 1e-9)
        s = _wait_stats(stats, lambda s: s.cycles_total > 500)
        # Ages taken against wall time would make EVERY cycle stale (sim stamps start at
        # 1000 s). Against /clock most cycles are fresh, but how many depends on the load: a
        # loaded 2-core CI machine once delayed joint states against /clock for 33 % of the
        # cycles (stale is counted, never fatal), so the bound separates the two cases only.
        assert s.stale_inputs < 0.8 * s.cycles_total, s
    finally:
        source.close()


@LOOP_MODES
def test_reactivation_sends_nothing_before_a_fresh_joint_state(launch_node, probe, loop_mode):
    """deactivate -> activate: the joint state received before (fresh by its stamp: max_obs_age
    10 s) gives no command; commands resume with the first joint state after activation. Each
    activation logs the loop's real-time scheduling at WARN."""
    from lifecycle_msgs.msg import Transition
    from lifecycle_msgs.srv import ChangeState

    node = launch_node(MODULE, "control", params=PARAMS | {
        "loop.mode": loop_mode, "safety.max_obs_age": 10.0, "loop.rt_priority": 10})
    commands = probe.subscribe(JointState, "/control/output/joint_command", COMMAND_QOS)
    cli = probe.node.create_client(ChangeState, "/control/change_state")

    def transition(tid: int) -> bool:
        fut = cli.call_async(ChangeState.Request(transition=Transition(id=tid)))
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline and not fut.done():
            time.sleep(0.02)  # polling a future, bounded
        return fut.done() and fut.result().success

    source = JointStateSource(probe, probe.now_ns)
    try:
        assert cli.wait_for_service(timeout_sec=30.0), node.output()
        assert commands.wait_for(lambda m: len(m) >= 20, timeout=30.0), node.output()
        source.mode = "off"
        assert transition(Transition.TRANSITION_DEACTIVATE), node.output()
        t_act = probe.now_ns()
        assert transition(Transition.TRANSITION_ACTIVATE), node.output()

        def since(t: int) -> list:
            return [m for m in commands.snapshot() if stamp_to_ns(m.header.stamp) > t]

        # the loop runs (1 s = 500 cycles) with only the old joint state: nothing is sent
        commands.wait_for(lambda m: len(since(t_act)) > 0, timeout=1.0)
        assert since(t_act) == [], f"{len(since(t_act))} commands from the old joint state"
        t_on = probe.now_ns()
        source.mode = "good"
        assert commands.wait_for(lambda m: len(since(t_act)) >= 20, timeout=30.0)
        assert all(stamp_to_ns(m.header.stamp) > t_on for m in since(t_act))
    finally:
        source.close()
    # real-time scheduling is never applied silently: at each activation, granted or not
    assert node.output().count("loop.rt_priority 0 turns it off") == 2, node.output()
    assert node.stop() == 0, node.output()
    assert "Traceback" not in node.output()


def test_joint_states_on_another_time_source_are_an_error_naming_the_fix(launch_node, probe):
    """The node on wall time, joint states stamped in sim time (1000 s): every observation is
    stale; /diagnostics says why, as an ERROR naming use_sim_time."""
    node = launch_node(MODULE, "control", params=PARAMS | {"loop.mode": "thread"})
    diag = probe.subscribe(DiagnosticArray, "/diagnostics")
    sim_ns = [1000 * 10**9]

    def sim_stamp() -> int:
        sim_ns[0] += 5_000_000
        return sim_ns[0]

    def error(msgs: list):
        return next((s for a in msgs for s in a.status
                     if s.name == "control" and s.level == DiagnosticStatus.ERROR), None)

    source = JointStateSource(probe, sim_stamp)
    try:
        # reported at the first diagnostics period with a joint state (0.2 s here); the bound
        # only keeps a loaded machine from failing the test
        got = diag.wait_for(lambda m: error(m) is not None, timeout=15.0)
        status = error(got)
        assert status is not None, node.output()
        assert "use_sim_time" in status.message and "time source" in status.message
        values = {kv.key: kv.value for kv in status.values}
        assert int(values["time_source_mismatches"]) > 0
    finally:
        source.close()
    assert node.stop() == 0, node.output()


@pytest.mark.parametrize(("params", "fragment"), [
    ({"safety.joint_lower": [0.0, -2.0, -2.6, -2.6, -2.6, -3.0],
      "safety.joint_upper": [-0.5, 2.0, 2.6, 2.6, 2.6, 3.0]},
     "parameter 'safety.joint_lower' = [0.0, -2.0, -2.6, -2.6, -2.6, -3.0]: joint 0 "
     "(shoulder_pan): lower 0.0 > upper -0.5"),
    ({"loop.rate_hz": 0}, "parameter 'loop.rate_hz' = 0"),
    ({"rate_hz": 500.0}, "parameter 'rate_hz' = 500.0: renamed to 'loop.rate_hz'"),
])
def test_bad_parameters_fail_configure(launch_node, params, fragment):
    node = launch_node(MODULE, "control", params=params)
    assert node.wait_for_output("autostart: configure failed", timeout=30.0), node.output()
    assert fragment in node.output()
    assert node.proc.wait(10) == 2
    assert "Traceback" not in node.output()


def test_loop_process_start_failure_fails_configure_with_its_message(launch_node):
    """loop.mode process: the child's error (here: no weights file) fails configure, named."""
    node = launch_node(MODULE, "control", params=PARAMS | {
        "loop.mode": "process", "policy.weights_path": "/nonexistent/policy_weights.pt"})
    assert node.wait_for_output("autostart: configure failed", timeout=60.0), node.output()
    assert ("loop process failed to start: ValueError: parameter 'policy.weights_path' = "
            "'/nonexistent/policy_weights.pt'") in node.output()
    assert node.proc.wait(10) == 2
    assert not glob.glob(f"/dev/shm/kestrel_control_{node.proc.pid}_*")
