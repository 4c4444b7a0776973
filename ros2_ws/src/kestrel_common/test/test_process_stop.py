"""How a node process stops (kestrel_common.process_stop, base_node): the signal watch ends the
spin at the first signal, exit_process ends the process with its code after the atexit
handlers without waiting for a stuck thread, and destroying a node takes its DDS participant
down at once (rclpy's destroy_node leaves the lifecycle state machine and action servers,
which kept the participant up until the interpreter's exit)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

COMMON = str(Path(__file__).resolve().parents[1])


def _fastdds_segments() -> set[str]:
    """The Fast DDS shared-memory files this process has mapped (its participants')."""
    with open("/proc/self/maps") as maps:
        return {line.split()[-1] for line in maps if "/dev/shm/fastdds_" in line}


def test_signal_watch_acts_on_the_first_signal_and_notes_a_later_sigterm() -> None:
    from kestrel_common.process_stop import SignalWatch, StopSignals

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signals = StopSignals()
    for sig in saved:
        signal.signal(sig, signals)
    first = threading.Event()
    calls: list[int] = []
    watch = SignalWatch(signals, "test", on_first=lambda: (calls.append(1), first.set()))
    try:
        signals.arm()
        signals.cooperate()  # spinning: a signal only sets `stop`, it raises nothing
        os.kill(os.getpid(), signal.SIGINT)
        assert first.wait(5.0)  # from the watch's own thread, whatever the main thread does
        assert signals.stop.is_set() and not signals.raised
        os.kill(os.getpid(), signal.SIGTERM)  # a later SIGTERM: noted for the forced exit
        deadline = time.monotonic() + 5.0
        while signals.term_at is None and time.monotonic() < deadline:
            time.sleep(0.01)  # polling the watch's note, bounded
        assert signals.term_at is not None and calls == [1]
    finally:
        watch.close()
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_exit_process_runs_atexit_flushes_and_does_not_wait_for_a_stuck_thread() -> None:
    script = textwrap.dedent("""
        import atexit, sys, threading, time
        from kestrel_common.process_stop import exit_process
        atexit.register(lambda: print("atexit ran", flush=True))
        threading.Thread(target=time.sleep, args=(60,), name="stuck").start()
        sys.stdout.write("unflushed")
        exit_process(3, "stand_in")
    """)
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=30, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                              [COMMON, os.environ.get("PYTHONPATH", "")])))
    took = time.monotonic() - t0
    assert done.returncode == 3, done.stderr
    assert "unflushed" in done.stdout and "atexit ran" in done.stdout
    assert "[stand_in] thread 'stuck' still running at exit" in done.stderr
    assert took < 20.0  # (the stuck thread would hold a normal exit for 60 s)


@pytest.mark.parametrize("ours", [True, False], ids=["kestrel", "rclpy"])
def test_destroy_node_takes_the_participant_down(ours: bool) -> None:
    """The participant's shared-memory segments are unmapped when the node is destroyed
    (KestrelLifecycleNode), not only at the interpreter's exit (rclpy's LifecycleNode with an
    action server: the state machine and the server still hold the node)."""
    import rclpy
    from kestrel_interfaces.action import PlanTask
    from rclpy.action import ActionServer
    from rclpy.lifecycle import LifecycleNode

    from kestrel_common.base_node import KestrelLifecycleNode

    context = rclpy.Context()
    rclpy.init(context=context)
    try:
        before = _fastdds_segments()
        if ours:
            node = KestrelLifecycleNode("stop_test", [], context=context)
        else:
            node = LifecycleNode("stop_test", context=context)
        server = ActionServer(node, PlanTask, "~/plan", lambda handle: PlanTask.Result())
        node.trigger_configure()
        assert _fastdds_segments() - before  # the participant is up
        node.destroy_node()
        left = _fastdds_segments() - before
        if ours:
            assert not left, left
        else:  # what the override is for (rclpy may fix it: then this case can go)
            assert left
            server.destroy()
            node._state_machine.destroy_when_not_in_use()
            assert not _fastdds_segments() - before
    finally:
        rclpy.try_shutdown(context=context)


def test_destroy_waitables_takes_a_plain_nodes_participant_down() -> None:
    """A plain rclpy node with an action client (the evaluator's shape): destroy_node leaves
    the client holding the node, and with it the participant; destroy_waitables ends both."""
    import rclpy
    from kestrel_interfaces.action import PlanTask
    from rclpy.action import ActionClient

    from kestrel_common.base_node import destroy_waitables

    context = rclpy.Context()
    rclpy.init(context=context)
    try:
        before = _fastdds_segments()
        node = rclpy.create_node("waitables_test", context=context)
        client = ActionClient(node, PlanTask, "/planner/plan_task")
        assert _fastdds_segments() - before  # the participant is up
        node.destroy_node()
        assert _fastdds_segments() - before  # the client still holds it
        destroy_waitables(node)
        assert not _fastdds_segments() - before
        del client
    finally:
        rclpy.try_shutdown(context=context)


def test_a_signal_handler_can_set_the_stop_flag_during_a_set_in_progress() -> None:
    """A signal that lands while the main thread is inside the stop flag's set() runs a handler
    that sets it again: with threading.Event (its lock held by the interrupted set) that hung
    a node's stop, or recursed until RecursionError. SIGALRM every 20 us for 1 s against a loop
    of set / is_set / wait must end, with every handler run."""
    script = textwrap.dedent("""
        import signal, time
        from kestrel_common.process_stop import SignalFlag, StopSignals
        assert isinstance(StopSignals().stop, SignalFlag)
        flag, n = SignalFlag(), [0]
        def handler(signum, frame):
            n[0] += 1
            flag.set()
        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, 2e-5, 2e-5)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            flag.set(); flag.is_set(); flag.wait(0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        assert not SignalFlag().wait(0.05) and flag.wait(None)
        print("handlers", n[0])
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([COMMON, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=30, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert int(done.stdout.split()[-1]) > 100
