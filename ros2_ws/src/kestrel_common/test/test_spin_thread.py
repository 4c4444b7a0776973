"""SpinThread (kestrel_common.spin_thread): an executor spun in a thread of its own and stopped
with no callback running into its shutdown. In-process: one node with a 0.5 ms timer, so that
callbacks are in flight whenever the executor stops."""

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


def _stop_rounds(ctx: object, plain: bool) -> tuple[str, int]:
    """ROUNDS starts and stops of a busy node's executor; (what the process printed on stderr
    as the stopped executors' tasks were collected, timer callbacks run)."""
    from rclpy.executors import MultiThreadedExecutor, SingleThreadedExecutor

    err, ticks = io.StringIO(), []
    for i in range(ROUNDS):
        node = _busy_node(ctx, f"spin_{i}", ticks)
        with contextlib.redirect_stderr(err):
            if plain:  # the pattern SpinThread replaces
                executor = MultiThreadedExecutor(num_threads=2, context=ctx)
                executor.add_node(node)
                thread = threading.Thread(target=executor.spin, daemon=True)
                thread.start()
                time.sleep(0.1)  # callbacks in flight (not a synchronisation)
                executor.shutdown(timeout_sec=2.0)
                thread.join(5.0)
            else:
                executor = SingleThreadedExecutor(context=ctx)
                executor.add_node(node)
                spin = SpinThread(executor, poll_s=0.05)
                time.sleep(0.1)  # callbacks in flight (not a synchronisation)
                assert spin.stop(5.0)
                assert not spin.thread.is_alive()
                del spin
            node.destroy_node()
            del executor
            gc.collect()  # the executor's tasks: a failed one prints here
    return err.getvalue(), len(ticks)


def test_stopping_leaves_no_failed_callback_task(context) -> None:  # noqa: ANN001
    printed, ticks = _stop_rounds(context, plain=False)
    assert NEVER_RETRIEVED not in printed, printed
    assert ticks > ROUNDS * 10  # the executor did spin the timer


def test_the_plain_spin_and_shutdown_fails_callback_tasks(context) -> None:  # noqa: ANN001
    """What SpinThread is for: rclpy's shutdown under a spinning MultiThreadedExecutor fails
    the handlers still in flight (if rclpy fixes it, this case can go)."""
    printed, _ = _stop_rounds(context, plain=True)
    assert NEVER_RETRIEVED in printed and "Destroyable" in printed


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
