"""An executor spun in a thread of its own, for a process whose main thread does other work
(the demo, the closed-loop evaluation), and stopped so that no callback runs into its shutdown.

Why not `Thread(target=executor.spin)` and `executor.shutdown()`: rclpy's Executor.shutdown
destroys the executor's guard condition at once (its wait for the callbacks in progress is
skipped once its shutdown flag is set). A callback handler still running then (the spin
thread's own, or one a MultiThreadedExecutor handed to its workers) fails on that guard
condition, and when the garbage collector takes its task the process prints "The following
exception was never retrieved: cannot use Destroyable because destruction was requested".

SpinThread runs a SingleThreadedExecutor (every handler runs inside spin_once, in this thread)
one spin_once at a time; stop() ends the loop, joins the thread and only then shuts the
executor down. No rclpy import here: the executor comes from the caller.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class SpinThread:
    """`executor` (a SingleThreadedExecutor with its nodes added) spun in a daemon thread until
    stop(). A callback's exception ends the thread as it ends executor.spin(), unless on_error
    says to go on."""

    def __init__(self, executor: Any, name: str = "spin", poll_s: float = 0.05,
                 on_error: Callable[[Exception], bool] | None = None) -> None:
        """poll_s: the longest spin_once wait, s: how often the loop sees stop() at the latest
        (stop() also wakes the executor). on_error: called in the spin thread, inside the
        handler, with an exception spin_once raised while the context is valid; True spins
        on, False ends the thread quietly. None: the exception ends the thread."""
        if poll_s <= 0:
            raise ValueError(f"SpinThread: poll_s = {poll_s} must be > 0")
        self.executor = executor
        self._poll_s = poll_s
        self._on_error = on_error
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and self.executor.context.ok():
            try:
                self.executor.spin_once(timeout_sec=self._poll_s)
            except Exception as exc:
                # the context shut down by someone else between the check and the wait
                # (rclpy's ExternalShutdownException, among others): the loop's normal end
                if not self.executor.context.ok():
                    return
                if self._on_error is None:
                    raise
                if not self._on_error(exc):
                    return

    def stop(self, timeout_s: float = 10.0) -> bool:
        """End the loop after the spin_once in progress, join the thread, then shut the
        executor down. False when the thread did not end within timeout_s (a callback that
        does not return): the executor is then left running, not shut down under it."""
        self._stop.set()
        if self.executor.context.ok():
            self.executor.wake()  # out of the wait at once
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            return False
        self.executor.shutdown(timeout_sec=timeout_s)
        return True
