"""SpinThread (kestrel_common.spin_thread): an executor spun in a thread of its own and stopped
with no callback running into its shutdown. The order of the stop with a stand-in executor;
in-process, a node with a 0.5 ms timer (callbacks in flight whenever it stops) and one whose
callback does not return."""

from __future__ import annotations

import contextlib
import gc
import io
import threading
import time
from collections.abc import Iterator

import pytest

from kestrel_common.domain_lease import DomainLease
from kestrel_common.spin_thread import SpinThread

ROUNDS = 8
NEVER_RETRIEVED = "exception was never retrieved"


@pytest.fixture
def context() -> Iterator[object]:
    import rclpy

    lease = DomainLease()
    ctx = rclpy.Context()
    rclpy.init(context=ctx, domain_id=lease.domain_id)
    try:
        yield ctx
    finally:
        rclpy.try_shutdown(context=ctx)
        lease.release()


def _busy_node(ctx: object, name: str, ticks: list) -> object:
    import rclpy

    node = rclpy.create_node(name, context=ctx)
    node.create_timer(0.0005, lambda: ticks.append(1))
    return node


def test_stopping_a_busy_node_leaves_no_failed_callback_task(context) -> None:  # noqa: ANN001
    """rclpy's shutdown under a spinning executor fails the handlers still in flight ("The
    following exception was never retrieved: cannot use Destroyable ...", printed when the
    task is collected): none with SpinThread, over several stops of a busy node."""
    from rclpy.executors import SingleThreadedExecutor

    err, ticks = io.StringIO(), []
    with contextlib.redirect_stderr(err):
        for i in range(ROUNDS):
            node = _busy_node(context, f"spin_{i}", ticks)
            executor = SingleThreadedExecutor(context=context)
            executor.add_node(node)
            spin = SpinThread(executor, poll_s=0.05)
            time.sleep(0.1)  # callbacks in flight (not a synchronisation)
            assert spin.stop(5.0) and not spin.thread.is_alive()
            node.destroy_node()
            del executor, spin
        # the stopped executors' tasks (one collection: slow in a large test process); a
        # failed one would print here
        gc.collect()
    assert NEVER_RETRIEVED not in err.getvalue(), err.getvalue()
    assert len(ticks) > ROUNDS * 10  # the executor did spin the timer


class _Executor:
    """A stand-in executor: each spin_once is a handler that takes a while; shutdown records
    whether the spin thread was still running or inside a spin_once."""

    def __init__(self) -> None:
        self.context = type("Ctx", (), {"ok": staticmethod(lambda: True)})()
        self.in_spin = False
        self.spins = 0
        self.shutdowns: list[tuple[bool, bool]] = []  # (thread alive, inside spin_once)
        self.owner: SpinThread | None = None

    def spin_once(self, timeout_sec: float) -> None:
        self.in_spin = True
        time.sleep(0.003)  # the handler's work (not a synchronisation)
        self.spins += 1
        self.in_spin = False

    def wake(self) -> None:
        pass

    def shutdown(self, timeout_sec: float) -> bool:
        self.shutdowns.append((self.owner.thread.is_alive(), self.in_spin))
        return True


def test_the_executor_is_shut_down_only_after_the_loop_has_ended() -> None:
    """The order that keeps handlers off a destroyed guard condition: the loop ends, the
    thread is joined, then the executor shuts down (once)."""
    for _ in range(20):
        ex = _Executor()
        spin = SpinThread(ex, poll_s=0.01)
        ex.owner = spin
        deadline = time.monotonic() + 5.0
        while ex.spins < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert spin.stop(5.0)
        assert ex.shutdowns == [(False, False)], ex.shutdowns


def test_a_callback_that_does_not_return_keeps_the_executor_up(context) -> None:  # noqa: ANN001
    from rclpy.executors import SingleThreadedExecutor

    release, entered = threading.Event(), threading.Event()

    def stuck() -> None:
        entered.set()
        release.wait(10.0)

    import rclpy

    node = rclpy.create_node("stuck", context=context)
    node.create_timer(0.001, stuck)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node)
    spin = SpinThread(executor)
    try:
        assert entered.wait(10.0)
        assert not spin.stop(0.2)  # the callback still runs: no shutdown under it
        assert spin.thread.is_alive()
    finally:
        release.set()
    assert spin.stop(5.0)
    node.destroy_node()


def test_poll_must_be_positive() -> None:
    with pytest.raises(ValueError, match="poll_s = 0"):
        SpinThread(object(), poll_s=0)


class _Raising(_Executor):
    """A stand-in executor whose first `fails` spin_once calls raise."""

    def __init__(self, fails: int) -> None:
        super().__init__()
        self.fails = fails

    def spin_once(self, timeout_sec: float) -> None:
        if self.fails > 0:
            self.fails -= 1
            raise RuntimeError("a callback failed")
        super().spin_once(timeout_sec)


def test_on_error_decides_whether_the_spin_goes_on() -> None:
    seen: list[str] = []
    ex = _Raising(fails=3)
    spin = SpinThread(ex, poll_s=0.01, on_error=lambda e: seen.append(str(e)) or True)
    ex.owner = spin
    deadline = time.monotonic() + 5.0
    while ex.spins < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert ex.spins >= 2 and seen == ["a callback failed"] * 3  # spun on after each
    assert spin.stop(5.0)

    ex = _Raising(fails=1)
    spin = SpinThread(ex, poll_s=0.01, on_error=lambda e: False)  # ends quietly
    ex.owner = spin
    spin.thread.join(5.0)
    assert not spin.thread.is_alive() and ex.spins == 0
    assert spin.stop(5.0) and len(ex.shutdowns) == 1

    ex = _Raising(fails=1)
    errors: list = []
    hook, threading.excepthook = threading.excepthook, errors.append
    try:
        spin = SpinThread(ex, poll_s=0.01)  # no on_error: the exception ends the thread
        ex.owner = spin
        spin.thread.join(5.0)
    finally:
        threading.excepthook = hook
    assert not spin.thread.is_alive() and ex.spins == 0
    assert [type(e.exc_value) for e in errors] == [RuntimeError]
