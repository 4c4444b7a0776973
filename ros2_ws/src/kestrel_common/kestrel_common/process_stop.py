"""How a node process stops: its SIGINT/SIGTERM handling and its exit (no rclpy here;
base_node.run_node wires these to the executor and the node).

The stop, in order:
1. the first SIGINT or SIGTERM: SignalWatch sees it at once through the wakeup fd and calls
   its `on_first` (run_node: completes the future the executor spins until), so spin ends
   at once and without an exception. During autostart (no spin yet) StopSignals raises
   KeyboardInterrupt instead. Why not raise in spin too: a KeyboardInterrupt raised inside
   rclpy's own calls can come out as another exception (pybind11 turned one in
   `take_message` into "RuntimeError: Unable to convert call argument") or leave a task
   failed. rclpy installs no handler of its own: its handler shuts the context down at the
   signal, under callbacks and worker threads that still publish ("publisher's context is
   invalid", then "The following exception was never retrieved" when the failed task is
   collected).
2. run_node's orderly stop, the context still valid: workers, executor, node (its DDS
   entities and, with the last of them, the participant), then the context, shut down with
   `uninstall_handlers=False`: rclpy's uninstall (its default for the default context) runs
   even when it installed no handler, and sets SIGINT, then SIGTERM, to SIG_DFL and back; a
   signal of the burst that lands in between kills the process (exit code -2, the stop cut
   short).
3. exit_process: a bounded join of the threads left, the atexit handlers, the streams
   flushed, os._exit. The interpreter's finalisation is skipped: it collects the whole heap
   (models, torch, message classes) and runs every extension's static destructors, which
   took seconds per node when the stack's nodes stopped together on a small machine, and
   none of it is needed once the DDS participant is gone (tests/test_shutdown_dds.py bounds
   each process's exit time and the CPU its stop uses).
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import os
import select
import signal
import sys
import threading
import time
from typing import Any, Callable, NoReturn

# How long the orderly stop (stop workers, executor, node, context) may take after the first
# SIGINT/SIGTERM before a further SIGTERM ends the process without finishing it.
CLEANUP_GRACE_S = 2.0
# exit_process: how long the threads still running (none, after an orderly stop) may take in
# all before the process ends without them
THREAD_JOIN_S = 0.5


class SignalFlag:
    """A stop flag for signal handlers to set: `set`, `is_set`, `wait` like threading.Event,
    without its lock. Python runs a handler in the main thread between two bytecodes, so a
    signal that lands while that thread is inside Event.set (or Event.wait's bookkeeping) holds
    the Event's lock runs a handler whose Event.set waits for that same lock: the process hangs
    (seen once in ~20 bursts of 60 SIGINT/SIGTERM 0.2 ms apart; faulthandler showed the handler
    nested in itself). Assigning a bool takes no lock; `wait` polls."""

    POLL_S = 0.02

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """True once set; False after `timeout` s (None: no limit) if not."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._set:
            left = self.POLL_S if deadline is None else deadline - time.monotonic()
            if left <= 0.0:
                return False
            time.sleep(min(self.POLL_S, left))  # polling the flag, bounded by the deadline
        return True


class StopSignals:
    """run_node's SIGINT/SIGTERM handler. Every signal sets `stop`; while armed (autostart),
    the first one also raises KeyboardInterrupt, once.

    Why: Ctrl-C (or `timeout -s INT`) reaches every process of the group and `ros2 launch`
    forwards another SIGINT, then SIGTERM, often within a millisecond. With the default
    handler, a repeat that arrived after the first KeyboardInterrupt but before the shutdown
    ignored signals raised a second KeyboardInterrupt inside the cleanup: the node died with
    exit code -2 and left its Fast DDS shared-memory segment in /dev/shm (seen once in ~12
    stops of the stack under `ros2 launch`)."""

    def __init__(self) -> None:
        self.stop = SignalFlag()  # (not threading.Event: see SignalFlag)
        self.raised = False
        # arm() .. cooperate(): the first signal raises (before: nothing to unwind yet; after:
        # spin ends through SignalWatch)
        self.armed = False
        self.first_at: float | None = None  # time.monotonic() of the first signal
        self.shutdown_at: float | None = None  # of disarm(): the orderly stop began
        self.term_at: float | None = None  # of a SIGTERM that was not the first signal

    def __call__(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if signum == signal.SIGTERM and (self.first_at is not None
                                         or self.shutdown_at is not None):
            self.term_at = self.term_at or now
        self.first_at = self.first_at or now
        self.stop.set()
        if self.armed and not self.raised:
            self.raised = True
            raise KeyboardInterrupt

    def arm(self) -> None:
        """Inside run_node's try: from now on the first signal raises. One that came before
        (during rclpy.init or the node's construction) raises here, once."""
        self.armed = True
        if self.stop.is_set() and not self.raised:
            self.raised = True
            raise KeyboardInterrupt

    def cooperate(self) -> None:
        """Autostart is over: from now on signals only set `stop` (SignalWatch ends spin)."""
        self.armed = False

    def disarm(self) -> None:
        """Shutdown has begun: later signals must not interrupt it (a later SIGTERM may end
        the process instead: force_exit_due)."""
        self.raised = True
        self.shutdown_at = self.shutdown_at or time.monotonic()

    def stop_began(self) -> float | None:
        """When the stop began: the first signal, or disarm() when none came."""
        times = [t for t in (self.first_at, self.shutdown_at) if t is not None]
        return min(times) if times else None

    def force_exit_due(self, now: float) -> bool:
        """A SIGTERM after the first signal ends the process once the orderly stop has had
        CLEANUP_GRACE_S: at once for `ros2 launch`'s escalation (sent 5 s after its SIGINT),
        only after the grace for one that came in the same burst as the Ctrl-C."""
        began = self.stop_began()
        return (self.term_at is not None and began is not None
                and now >= max(self.term_at, began + CLEANUP_GRACE_S))


class SignalWatch:
    """A thread that sees each SIGINT/SIGTERM as it arrives: the C-level handler writes the
    signal number to the wakeup fd at once, whatever the main thread is doing.

    - The first signal: `on_first()` (run_node: completes the future the executor spins
      until; its done callback wakes the executor's wait).
    - A later SIGTERM: ends the process (exit code 128 + SIGTERM) once
      StopSignals.force_exit_due, even while the main thread is blocked in a C call (a DDS
      entity being destroyed, a thread join), naming the step of the stop that overran and
      dumping every thread's stack (faulthandler) to stderr first.
    Made in the main thread (set_wakeup_fd); lives to the process exit."""

    def __init__(self, signals: StopSignals, name: str,
                 on_first: Callable[[], None] | None = None) -> None:
        self._signals, self.name, self._on_first = signals, name, on_first
        self.step = "spin"  # the step of the stop under way (run_node sets it), for the log
        self._seen = False
        self._done = threading.Event()
        self._read, write = os.pipe()
        os.set_blocking(write, False)
        self._write = write
        self._old_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._run, name="signal_watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            ready, _, _ = select.select([self._read], [], [], 0.02)
            if ready:
                for signum in os.read(self._read, 64):
                    self._on_signal(signum)
            if not self._done.is_set() and self._signals.force_exit_due(time.monotonic()):
                os.write(2, f"[{self.name}] SIGTERM: the orderly stop took longer than "
                            f"{CLEANUP_GRACE_S} s (at step '{self.step}'), exiting without "
                            "it; where each thread was:\n".encode())
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                os._exit(128 + signal.SIGTERM)

    def _on_signal(self, signum: int) -> None:
        first, self._seen = not self._seen, True
        if signum == signal.SIGTERM and not first:
            # (StopSignals notes it too, but only once the main thread runs Python again)
            self._signals.term_at = self._signals.term_at or time.monotonic()
        if first and self._on_first is not None:
            try:
                self._on_first()
            except Exception as exc:  # noqa: BLE001 - the watch must go on (force exit)
                _say(f"[{self.name}] stop signal: {exc!r}")

    def close(self) -> None:
        """Stop watching (a process that goes on after run_node's stop: tests)."""
        self._done.set()
        self._thread.join(1.0)
        signal.set_wakeup_fd(self._old_fd)
        os.close(self._read)
        os.close(self._write)


def exit_process(code: int, name: str) -> NoReturn:
    """End the process with `code` after the node's orderly stop, without the interpreter's
    finalisation (see the module docstring): a bounded join of the non-daemon threads still
    running (each named on stderr), the atexit handlers, the Python and C streams flushed,
    then os._exit."""
    deadline = time.monotonic() + THREAD_JOIN_S
    for thread in threading.enumerate():
        if thread is threading.main_thread() or thread.daemon:
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            _say(f"[{name}] thread '{thread.name}' still running at exit: not waited for")
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)  # CPython: what exit would run
    if run_exitfuncs is not None:
        run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to flush there
            pass
    try:
        ctypes.CDLL(None).fflush(None)  # what C libraries printed through stdio
    except (OSError, AttributeError):
        pass
    os._exit(code)


def _say(text: str) -> None:
    try:
        os.write(2, (text + "\n").encode())
    except OSError:
        pass
