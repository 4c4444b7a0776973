"""run_node's stop path (serve_node, the part that returns): a signal ends the spin through the
SignalWatch; an executor error caused by a shutdown of the context is the orderly stop (exit
0), any other executor error still propagates; exit_process ends a process with its code
after the atexit handlers. Stand-in node and executor: no DDS needed.

Seen in CI (when rclpy's SIGINT handler still shut the context down): the executor was
between its shutdown check and building its next wait set, so spin raised RCLError "the
given context is not valid" and the control node exited 1."""

from __future__ import annotations

import signal

import pytest


class _Param:
    value = False  # autostart off: run_node goes straight to spin()


class _Node:
    stopped = False

    def __init__(self) -> None:
        pass

    def get_logger(self):  # noqa: ANN201
        return type("L", (), {"info": staticmethod(print), "error": staticmethod(print),
                              "fatal": staticmethod(print)})()

    def get_parameter(self, name: str) -> _Param:
        return _Param()

    def get_name(self) -> str:
        return "stand_in"

    def stop_workers(self) -> None:
        _Node.stopped = True

    def destroy_node(self) -> None:
        pass


class _Executor:
    shutdown_first = True

    def add_node(self, node) -> None:  # noqa: ANN001
        pass

    def spin_until_future_complete(self, future) -> None:  # noqa: ANN001
        import rclpy
        from rclpy._rclpy_pybind11 import RCLError

        if _Executor.shutdown_first:
            rclpy.shutdown()  # someone else shut the context down
        raise RCLError("failed to initialize wait set: the given context is not valid, either "
                       "rcl_init() was not called or rcl_shutdown() was called.")

    def shutdown(self, timeout_sec: float | None = None) -> None:
        pass


@pytest.fixture
def stand_ins(monkeypatch):
    from kestrel_common import base_node

    monkeypatch.setattr(base_node, "make_executor", lambda node, num_threads=4: _Executor())
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    _Node.stopped = False
    yield base_node
    _close_watchdog(base_node)
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def _close_watchdog(base_node) -> None:  # noqa: ANN001
    """run_node leaves its exit watchdog to the process exit: this process goes on."""
    if base_node.exit_watchdog is not None:
        base_node.exit_watchdog.close()
        base_node.exit_watchdog = None


def test_executor_error_after_shutdown_is_the_orderly_stop(stand_ins, capsys) -> None:
    _Executor.shutdown_first = True
    assert stand_ins.serve_node(_Node, []) == 0
    assert _Node.stopped  # the rest of the shutdown ran
    assert "executor stopped at shutdown" in capsys.readouterr().err


def test_executor_error_while_running_still_raises(stand_ins) -> None:
    from rclpy._rclpy_pybind11 import RCLError

    _Executor.shutdown_first = False
    with pytest.raises(RCLError, match="context is not valid"):
        stand_ins.serve_node(_Node, [])
    assert _Node.stopped


def test_stop_signals_raise_once_then_only_set_stop() -> None:
    """The first SIGINT/SIGTERM leaves spin(); repeats (the group's Ctrl-C plus `ros2 launch`
    forwarding its own SIGINT, then SIGTERM) must not interrupt the orderly stop."""
    from kestrel_common.base_node import StopSignals

    early = StopSignals()  # before run_node's try: a signal is only noted ...
    early(signal.SIGINT, None)
    assert early.stop.is_set() and not early.raised
    with pytest.raises(KeyboardInterrupt):  # ... and raised once armed, inside the try
        early.arm()
    early(signal.SIGTERM, None)  # no second one
    signals = StopSignals()
    signals.arm()
    with pytest.raises(KeyboardInterrupt):
        signals(signal.SIGINT, None)
    assert signals.stop.is_set()
    signals(signal.SIGINT, None)  # no second KeyboardInterrupt
    signals(signal.SIGTERM, None)
    late = StopSignals()
    late.arm()
    late.disarm()  # shutdown began without a signal (e.g. autostart failed)
    late(signal.SIGINT, None)
    assert late.stop.is_set()


class _SignalledExecutor(_Executor):
    """The spin is ended by a real SIGINT (the SignalWatch completes the future it spins
    until, from its own thread), and more arrive while it unwinds."""

    seen_handler = None
    ended_by_future = False

    def spin_until_future_complete(self, future) -> None:  # noqa: ANN001
        import os
        import time

        _SignalledExecutor.seen_handler = signal.getsignal(signal.SIGINT)
        try:
            os.kill(os.getpid(), signal.SIGINT)
            deadline = time.monotonic() + 5.0
            while not future.done() and time.monotonic() < deadline:
                time.sleep(0.01)  # (what the executor's wait does; no exception comes)
            _SignalledExecutor.ended_by_future = future.done()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGINT):
                os.kill(os.getpid(), sig)  # repeats during the unwinding
                sum(range(100))  # bytecode boundaries: pending handlers run here


def test_repeated_real_signals_leave_the_cleanup_complete(monkeypatch) -> None:
    from kestrel_common import base_node

    monkeypatch.setattr(base_node, "make_executor",
                        lambda node, num_threads=4: _SignalledExecutor())
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    _Node.stopped = False
    try:
        assert base_node.serve_node(_Node, []) == 0
    finally:
        _close_watchdog(base_node)
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert isinstance(_SignalledExecutor.seen_handler, base_node.StopSignals)
    assert _SignalledExecutor.ended_by_future
    assert _Node.stopped


def test_a_sigterm_after_the_grace_forces_the_exit_one_in_the_burst_waits() -> None:
    from kestrel_common.base_node import CLEANUP_GRACE_S, StopSignals

    signals = StopSignals()
    signals.arm()
    with pytest.raises(KeyboardInterrupt):
        signals(signal.SIGINT, None)
    t0 = signals.first_at
    signals(signal.SIGTERM, None)  # same burst
    signals.disarm()
    assert not signals.force_exit_due(t0 + 0.5)
    assert signals.force_exit_due(t0 + CLEANUP_GRACE_S)
    alone = StopSignals()  # a single SIGTERM is the orderly stop, never a forced one
    alone.arm()
    with pytest.raises(KeyboardInterrupt):
        alone(signal.SIGTERM, None)
    alone.disarm()
    assert alone.term_at is None and not alone.force_exit_due(alone.first_at + 60.0)


class _StoppedExecutor(_Executor):
    """The first signal completed the future: spin returns."""

    def spin_until_future_complete(self, future) -> None:  # noqa: ANN001
        pass


def test_the_stop_leaves_the_signal_dispositions_alone(stand_ins, monkeypatch) -> None:
    """rclpy's C uninstall_signal_handlers sets SIGINT and SIGTERM to SIG_DFL and back even
    when rclpy installed no handler: a signal of a Ctrl-C burst that lands in between kills
    the process (exit code -2) before its stop ends. The stop must not call it; afterwards
    a late SIGINT is ignored."""
    from rclpy.impl.implementation_singleton import rclpy_implementation

    calls: list[str] = []
    monkeypatch.setattr(rclpy_implementation, "uninstall_signal_handlers",
                        lambda: calls.append("uninstall_signal_handlers"))
    monkeypatch.setattr(stand_ins, "make_executor",
                        lambda node, num_threads=4: _StoppedExecutor())
    assert stand_ins.serve_node(_Node, []) == 0
    assert _Node.stopped
    assert calls == []
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN


_CRASH = """
import sys
sys.path.insert(0, {here!r})
import test_run_node as t
from kestrel_common import base_node


class _Crash(t._Executor):
    def spin_until_future_complete(self, future):
        import ctypes
        ctypes.string_at(0)  # a crash in native code, as a DDS or torch bug would be


base_node.make_executor = lambda node, num_threads=4: _Crash()
base_node.serve_node(t._Node, [])
"""


def test_a_crash_in_native_code_prints_every_thread_s_stack() -> None:
    """A node process that dies of SIGSEGV (a native library's bug) leaves the Python stack of
    each thread in its log, not only the exit code -11."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", _CRASH.format(here=here)], capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, PYTHONFAULTHANDLER=""))
    assert proc.returncode == -signal.SIGSEGV, proc.stderr[-2000:]
    assert "Fatal Python error: Segmentation fault" in proc.stderr, proc.stderr[-2000:]
    assert "in spin_until_future_complete" in proc.stderr  # where the main thread was
    assert proc.stderr.count("hread 0x") >= 2  # and the other threads (the signal watch)
