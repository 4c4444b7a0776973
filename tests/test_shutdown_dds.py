"""Repeated SIGINT/SIGTERM during shutdown (Ctrl-C reaches the whole process group and
`ros2 launch` forwards another SIGINT, then SIGTERM) must still give an orderly exit."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time

import pytest
from diagnostic_msgs.msg import DiagnosticArray
from std_msgs.msg import Float64

from ros_harness import dds_shm_files, orphaned_shm_files


pytestmark = pytest.mark.dds


def test_repeated_signals_during_shutdown_exit_cleanly(launch_node, probe):
    node = launch_node("echo_node", "echo")
    out = probe.subscribe(Float64, "/echo/output/value")
    pub = probe.publisher(Float64, "/echo/input/value")
    assert probe.publish_until(pub, lambda: Float64(data=1.0), lambda: len(out.snapshot()) > 0)
    for sig in (signal.SIGINT, signal.SIGINT, signal.SIGTERM, signal.SIGINT):
        os.kill(node.proc.pid, sig)
        time.sleep(0.005)
    assert node.proc.wait(10) == 0, node.output()
    assert "Traceback" not in node.output()
    assert "terminate called" not in node.output()


def test_a_burst_of_signals_never_skips_the_orderly_stop(launch_node, probe):
    """`timeout -s INT` or a terminal's Ctrl-C signals the whole process group and `ros2 launch`
    forwards another SIGINT, often within a millisecond: a repeat that landed after the first
    KeyboardInterrupt but before the shutdown ignored signals aborted the cleanup (the node
    died with exit code -2 and left its Fast DDS shared-memory segment behind; seen under
    `ros2 launch`). A burst of signals 0.2 ms apart spans that window."""
    node = launch_node("echo_node", "echo")
    out = probe.subscribe(Float64, "/echo/output/value")
    pub = probe.publisher(Float64, "/echo/input/value")
    assert probe.publish_until(pub, lambda: Float64(data=1.0), lambda: len(out.snapshot()) > 0)
    for i in range(60):
        try:
            os.kill(node.proc.pid, signal.SIGTERM if i % 7 == 6 else signal.SIGINT)
        except ProcessLookupError:  # already gone: its exit code says whether it was orderly
            break
        time.sleep(0.0002)
    assert node.proc.wait(10) == 0, node.output()
    assert "Traceback" not in node.output()


# ---- every node: SIGINT ends it within SHUTDOWN_S, SIGTERM is honoured --------------------

SHUTDOWN_S = 2.0  # the contract: a node's own reported stop (first signal -> run_node returns)
WALL_S = 20.0  # signal -> process gone, interpreter exit (torch, DDS) on a loaded machine
NOISE = ("exception was never retrieved", "publisher's context is invalid", "Traceback",
         "terminate called")
NODES = {  # module, node name, parameters (light on the shared CPU)
    "echo": ("echo_node", "echo", {"diagnostics_period": 0.2}),
    "perception": ("kestrel_perception.perception_node", "perception",
                   {"num_cameras": 1, "model.base_width": 8, "model.fpn_channels": 32,
                    "runtime.torch_threads": 1, "warmup_size": [64, 48],
                    "diagnostics_period": 0.2}),
    "control": ("kestrel_control.control_node", "control",
                {"loop.rate_hz": 200.0, "loop.mode": "thread", "diagnostics_period": 0.2}),
    "planner": ("kestrel_planner.planner_node", "planner",
                {"model_config": "tiny", "demo_plan": "move_to red_cube speed=0.2; end",
                 "diagnostics_period": 0.2}),
    "sim": ("kestrel_sim.sim_node", "sim", {"diagnostics_period": 0.2, "lidar_n_vertical": 16}),
}


def _active(node, probe, diag, timeout: float = 120.0) -> None:
    """Bounded: the node's status appears on /diagnostics (it publishes once active)."""
    def seen(msgs: list) -> bool:
        return any(s.name == node.name for a in msgs for s in a.status) or not node.alive()

    ok = diag.wait_for(seen, timeout)
    assert ok and node.alive(), node.output()[-3000:]


@pytest.fixture
def forced_exit_shm(dds_guard):
    """A forced exit leaves the node's Fast DDS shared memory behind, as SIGKILL does: removed
    once the probe (which maps the node's ports) is closed, before dds_guard checks."""
    before = dds_shm_files()
    yield
    deadline = time.monotonic() + 2.0  # the last mappings go as the probe's participant does
    while time.monotonic() < deadline:
        new = dds_shm_files() - before
        if not new:
            break
        for name in orphaned_shm_files(new):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")
        time.sleep(0.05)  # polling the files, bounded by the deadline


def _stopped_in(output: str) -> float:
    found = re.findall(r"stopped in ([0-9.]+) s", output)
    assert found, output[-3000:]
    return float(found[-1])


@pytest.mark.slow
@pytest.mark.parametrize("which", list(NODES))
def test_sigint_stops_every_node_within_the_bound_and_quietly(launch_node, probe, which):
    module, name, params = NODES[which]
    diag = probe.subscribe(DiagnosticArray, "/diagnostics")
    node = launch_node(module, name, params=params)
    _active(node, probe, diag)
    t0 = time.monotonic()
    os.kill(node.proc.pid, signal.SIGINT)
    code = node.proc.wait(WALL_S)
    wall = time.monotonic() - t0
    out = node.output()
    assert code == 0, out[-3000:]
    own = _stopped_in(out)
    print(f"{which}: stopped in {own:.3f} s (node), {wall:.3f} s (process gone)")
    assert own <= SHUTDOWN_S, out[-3000:]
    for text in NOISE:
        assert text not in out, out[-3000:]


@pytest.mark.slow
def test_sigterm_during_a_slow_shutdown_ends_the_process(forced_exit_shm, launch_node, probe):
    """`ros2 launch` sends SIGTERM when a node has not exited 5 s after its SIGINT: once the
    orderly stop has had its grace (base_node.CLEANUP_GRACE_S) the SIGTERM ends the process
    at once, even while a worker still holds the stop up."""
    from kestrel_common.base_node import CLEANUP_GRACE_S

    diag = probe.subscribe(DiagnosticArray, "/diagnostics")
    node = launch_node("echo_node", "echo", params={"diagnostics_period": 0.2,
                                                    "stop_delay": 30.0})
    _active(node, probe, diag)
    t0 = time.monotonic()
    os.kill(node.proc.pid, signal.SIGINT)
    assert node.wait_for_output("stop_workers: taking", timeout=5.0), node.output()
    time.sleep(max(0.0, t0 + CLEANUP_GRACE_S + 0.2 - time.monotonic()))  # launch's escalation
    assert node.alive()  # a SIGINT alone lets the slow stop run
    t1 = time.monotonic()
    os.kill(node.proc.pid, signal.SIGTERM)
    code = node.proc.wait(5.0)
    print(f"SIGTERM after the grace: process gone in {time.monotonic() - t1:.3f} s")
    assert code == 128 + signal.SIGTERM, node.output()
    assert time.monotonic() - t1 < 1.0
    assert "exiting without it" in node.output()


@pytest.mark.slow
def test_sigterm_in_the_ctrl_c_burst_leaves_the_stop_its_grace(forced_exit_shm, launch_node,
                                                              probe):
    """A SIGTERM right behind the SIGINT (one burst) does not cut a slow stop short before
    the grace; afterwards it ends it."""
    from kestrel_common.base_node import CLEANUP_GRACE_S

    diag = probe.subscribe(DiagnosticArray, "/diagnostics")
    node = launch_node("echo_node", "echo", params={"diagnostics_period": 0.2,
                                                    "stop_delay": 30.0})
    _active(node, probe, diag)
    t0 = time.monotonic()
    os.kill(node.proc.pid, signal.SIGINT)
    os.kill(node.proc.pid, signal.SIGTERM)
    code = node.proc.wait(CLEANUP_GRACE_S + 3.0)
    took = time.monotonic() - t0
    assert code == 128 + signal.SIGTERM, node.output()
    assert CLEANUP_GRACE_S - 0.1 <= took < CLEANUP_GRACE_S + 1.5, took
