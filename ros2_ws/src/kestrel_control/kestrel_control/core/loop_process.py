"""Node side of `loop.mode: process`: the real-time loop in a child interpreter of its own.

Why: in one interpreter the rclpy executor thread (deserialising joint states at 1 kHz, running
callbacks) and the loop thread share one GIL, which stretches the tick's tail whenever ROS I/O
is live (docs/benchmarks/control_h200.md).
The child (`python -m kestrel_control.core.loop_child`, no rclpy) owns the PolicyRunner and the
RealtimeLoop; the node keeps the ROS I/O:
  subscription callbacks -> SharedLatestValue (joint states, targets) in shared memory;
  loop tick in the child -> commands into shared memory + one eventfd write;
  `LoopProcess` publisher thread (not real-time) wakes on the eventfd, reads the newest command
  of every robot and calls `publish(r, command [n] rad, stamp_ns)` (commands that the publisher
  did not get to before the next one are coalesced: the newest wins, counted);
  statistics: the child's LoopStats live in the segment (`stats`, read at ~10 Hz by the node).
Control: length-prefixed pickles over the child's stdin (commands) and stdout (replies). Its
stderr is read line by line by a thread here and handed to `log` / `warn` (the node's ROS
logger: its log_level and sinks apply): the child tags its own lines (loop_child._log), and an
untagged line (a Python warning, a traceback) is a warning. Start-up waits (bounded) for the
child's 'ready' (policy loaded, backend warmed up / graph captured) or its error, which
`start()` raises as LoopProcessError with the child's message. The child exits when its
command pipe closes (the node died) or its parent pid changes. The segment
(/dev/shm/kestrel_control_<pid>_<random>) is unlinked by `close()`, by an atexit hook and,
if the node is killed, by the child when it sees its pipe close.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import pickle
import secrets
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kestrel_control.core.shm_control import (CLOCK_SIM, CLOCK_SYSTEM, CTRL_CLOCK_MODE,
                                              CTRL_NO_CLOCK, CTRL_PARENT_PID, CTRL_SIM_TIME_NS,
                                              AUX_COMPUTE_LATENCY, ShmLayout, ShmSegment,
                                              ShmViews, require_ordered_stores)

CHILD_MODULE = "kestrel_control.core.loop_child"
# With rt_priority > 0 the node's command publisher thread runs SCHED_FIFO this much below the
# loop: on a loaded machine it then gets a core as soon as the loop wrote a command, instead of
# waiting behind the other processes.
PUBLISHER_PRIORITY_BELOW = 10
# the child's stderr lines: tagged with their level (loop_child._log), relayed to the node's log
LOG_INFO, LOG_WARN = "I|", "W|"


class LoopProcessError(ValueError):
    """The loop process failed to start, or did not answer in time (message says which)."""


class Channel:
    """Length-prefixed pickles over a pair of pipe fds; `recv` is bounded by a timeout."""

    def __init__(self, rfd: int, wfd: int) -> None:
        self.rfd, self.wfd = rfd, wfd

    def send(self, obj: Any) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self._write_all(struct.pack("<Q", len(data)) + data)

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.wfd, view):]

    def _read_exact(self, n: int, deadline: float | None) -> bytes:
        chunks, got = [], 0
        while got < n:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.rfd], [], [], wait)
            if not ready:
                raise TimeoutError
            chunk = os.read(self.rfd, n - got)
            if not chunk:
                raise EOFError("pipe closed")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def recv(self, timeout: float | None) -> Any:
        """Next object; TimeoutError when none began within `timeout` s; EOFError when the
        other side closed its end."""
        deadline = None if timeout is None else time.monotonic() + timeout
        (size,) = struct.unpack("<Q", self._read_exact(8, deadline))
        return pickle.loads(self._read_exact(size, None if deadline is None else
                                             max(deadline, time.monotonic() + 5.0)))


@dataclasses.dataclass
class LoopSettings:
    """RealtimeLoop arguments, applied in the child."""

    period_s: float = 1e-3
    spin_s: float = 200e-6
    rt_priority: int = 0
    cpu_affinity: Sequence[int] = ()
    lock_memory: bool = False
    manage_gc: bool = True
    switch_interval_s: float | None = None
    native_tick: bool = True  # the tick's common case in C (native_tick.py), where it builds
    miss_attribution: bool = True  # deadline misses by cause (miss_cause.py)


class LoopProcess:
    """Spawns and drives the loop child (see the module docstring). Not thread-safe: one
    lifecycle thread calls start/activate/deactivate/close."""

    def __init__(self, config: Any, settings: LoopSettings, *, sim_time: bool = False,
                 start_timeout_s: float = 120.0, log: Callable[[str], None] | None = None,
                 warn: Callable[[str], None] | None = None, stats_capacity: int = 16384,
                 python: str = sys.executable) -> None:
        if not start_timeout_s > 0:
            raise ValueError(f"parameter 'loop_start_timeout' = {start_timeout_s!r}: must be > 0")
        self.config, self.settings = config, settings
        self.layout = ShmLayout(config.num_robots, config.num_joints, settings.period_s,
                                stats_capacity)
        self.sim_time, self.start_timeout_s = sim_time, float(start_timeout_s)
        self._log = log or (lambda m: print(m, file=sys.stderr))
        self._warn = warn or self._log
        self._relay: threading.Thread | None = None  # the child's stderr -> log / warn
        self._python = python
        self.shm: ShmSegment | None = None
        self.views: ShmViews | None = None
        self.proc: subprocess.Popen | None = None
        self._chan: Channel | None = None
        self._efd = -1
        self._pub_thread: threading.Thread | None = None
        self._pub_stop = threading.Event()
        self.info: dict = {}  # the child's ready report (batch, source, pid, ...)
        self.applied: dict = {}  # real-time settings the child applied at activation
        self.published = 0  # commands handed to `publish`
        self.coalesced = 0  # commands replaced by a newer one before the publisher ran
        self.publish_errors = 0
        self.last_publish_error = ""
        self._closed = False
        self._old_switch: float | None = None  # the node's GIL switch interval before activate
        self.publisher_priority = "normal"  # the publisher thread's scheduling (diagnostics)

    # ---- views for the node --------------------------------------------------------------
    @property
    def joint_states(self) -> list:
        return self.views.joint_states

    @property
    def targets(self) -> list:
        return self.views.targets

    @property
    def stats(self):
        return self.views.stats

    @property
    def compute_latency_s(self) -> float:
        return float(self.views.aux[AUX_COMPUTE_LATENCY])

    @property
    def no_clock_cycles(self) -> int:
        return int(self.views.control[CTRL_NO_CLOCK])

    def set_sim_time(self, ns: int) -> None:
        """The node clock under use_sim_time (the last /clock), read by the child per tick."""
        self.views.control[CTRL_SIM_TIME_NS] = int(ns)

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> dict:
        """Create the segment, spawn the child, wait (bounded) for its ready report.
        ValueError on a weakly ordered CPU (shm_control.require_ordered_stores)."""
        require_ordered_stores()
        name = f"kestrel_control_{os.getpid()}_{secrets.token_hex(4)}"
        try:
            self.shm = ShmSegment(name, self.layout.size, create=True)
            atexit.register(self.close)
            self.views = ShmViews(self.shm.buf, self.layout)
            self.views.clear()
            ctrl = self.views.control
            ctrl[CTRL_CLOCK_MODE] = CLOCK_SIM if self.sim_time else CLOCK_SYSTEM
            ctrl[CTRL_PARENT_PID] = os.getpid()
            self._efd = os.eventfd(0, os.EFD_CLOEXEC)
            self.proc = subprocess.Popen(
                [self._python, "-m", CHILD_MODULE, "--shm", name, "--event-fd", str(self._efd),
                 "--parent-pid", str(os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(self._efd,),
                # one BLAS/OpenMP thread: the policy runs single-threaded (torch.set_num_threads
                # (1)), and idle pool threads would only be more threads to keep off the loop CPU
                env=dict(os.environ, PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1",
                         OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"))
            self._relay = threading.Thread(target=self._relay_stderr, args=(self.proc.stderr,),
                                           name="kestrel-control-loop-log", daemon=True)
            self._relay.start()
            self._chan = Channel(self.proc.stdout.fileno(), self.proc.stdin.fileno())
            self._chan.send({"config": self.config, "settings": self.settings,
                             "layout": self.layout})
            kind, payload = self._reply(self.start_timeout_s, "start")
            if kind != "ready":
                raise LoopProcessError(f"loop process failed to start: {payload}")
            self.info = payload
            return dict(payload)
        except BaseException:
            self.close()
            raise

    def _reply(self, timeout: float, what: str) -> tuple[str, Any]:
        try:
            return self._chan.recv(timeout)
        except TimeoutError:
            raise LoopProcessError(f"loop process did not answer '{what}' within {timeout:g} s "
                                   "(parameter 'loop_start_timeout')") from None
        except (EOFError, OSError, pickle.UnpicklingError):
            code = self.proc.wait(5.0) if self.proc is not None else None
            raise LoopProcessError(f"loop process exited (code {code}) during '{what}'; its "
                                   "output is in this node's log") from None

    def activate(self, publish: Callable[[int, np.ndarray, int], None],
                 timeout_s: float = 30.0) -> dict:
        """Start the publisher thread, then the child's loop (after it reset the policy state
        and the statistics). Returns the real-time settings it applied."""
        self._pub_stop.clear()
        # this (node) process too: the publisher thread waits at most this long for the GIL
        # while an executor thread runs Python (default 5 ms = 2.5 commands at 500 Hz)
        if self.settings.switch_interval_s and self._old_switch is None:
            self._old_switch = sys.getswitchinterval()
            sys.setswitchinterval(self.settings.switch_interval_s)
        self._pub_thread = threading.Thread(target=self._publish_loop, args=(publish,),
                                            name="kestrel-control-publisher", daemon=True)
        self._pub_thread.start()
        try:
            self._chan.send(("activate", None))
            kind, payload = self._reply(timeout_s, "activate")
            if kind != "active":
                raise LoopProcessError(f"loop process failed to activate: {payload}")
        except BaseException:  # refused, timed out, or the child died: nothing left running
            self._stop_publisher()
            self._restore_switch_interval()
            raise
        self.views.stats.reset_window()
        self.applied = payload
        return dict(payload)

    def deactivate(self, timeout_s: float = 5.0) -> None:
        """Stop the child's loop (bounded), then the publisher thread. Idempotent."""
        try:
            if self.proc is not None and self.proc.poll() is None and self._chan is not None:
                self._chan.send(("deactivate", None))
                self._reply(timeout_s, "deactivate")
        except (LoopProcessError, OSError) as exc:
            self._log(f"loop process deactivate: {exc}")
        finally:
            self._stop_publisher()
            self._restore_switch_interval()

    def _restore_switch_interval(self) -> None:
        if self._old_switch is not None:
            sys.setswitchinterval(self._old_switch)
            self._old_switch = None

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the child (exit, then kill), close the eventfd, unlink the segment. Idempotent;
        also runs at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        self._stop_publisher()
        proc = self.proc
        if proc is not None:
            try:
                if proc.poll() is None:
                    self._chan.send(("exit", None))
                proc.wait(timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait(timeout_s)
            if self._relay is not None:  # EOF once the child is gone: its last lines
                self._relay.join(timeout_s)
                self._relay = None
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                try:
                    stream.close()
                except OSError:
                    pass
        if self._efd >= 0:
            os.close(self._efd)
            self._efd = -1
        if self.views is not None:
            self.views.release()
        if self.shm is not None:
            self.shm.unlink()
            self.shm.close()
        atexit.unregister(self.close)

    def _relay_stderr(self, stream: Any) -> None:
        """The child's stderr, line by line, to `log` (lines tagged LOG_INFO) or `warn`
        (tagged LOG_WARN, or untagged: Python warnings, tracebacks); ends at EOF."""
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            try:
                if line.startswith(LOG_INFO):
                    self._log(line[len(LOG_INFO):])
                elif line.startswith(LOG_WARN):
                    self._warn(line[len(LOG_WARN):])
                elif line.strip():
                    self._warn(f"[control loop process] {line}")
            except Exception:  # noqa: BLE001 - a logger failing must not stop the draining
                pass

    # ---- publisher thread (not real-time) --------------------------------------------------
    def _stop_publisher(self) -> None:
        thread = self._pub_thread
        if thread is None:
            return
        self._pub_stop.set()
        if self._efd >= 0:
            os.eventfd_write(self._efd, 1)
        thread.join(2.0)
        self._pub_thread = None

    def _publish_loop(self, publish: Callable[[int, np.ndarray, int], None]) -> None:
        commands = self.views.commands
        n_robots = len(commands)
        out = np.zeros((n_robots, self.layout.num_joints))  # rad
        last = [c.version for c in commands]
        efd, stop = self._efd, self._pub_stop
        prio = self.settings.rt_priority - PUBLISHER_PRIORITY_BELOW
        if self.settings.rt_priority > 0:  # this thread only; below the loop's priority
            try:
                os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(max(1, prio)))
                self.publisher_priority = f"SCHED_FIFO {max(1, prio)}"
            except (PermissionError, OSError) as exc:
                self.publisher_priority = f"not applied ({exc})"
        while True:
            try:
                os.eventfd_read(efd)  # blocks (GIL released) until the loop wrote commands
            except OSError:
                return
            for r in range(n_robots):  # also once after stop: the loop's last commands
                version, stamp = commands[r].read_into(out[r])
                if version == last[r]:
                    continue
                if version > last[r] + 1:
                    self.coalesced += version - last[r] - 1
                last[r] = version
                try:
                    publish(r, out[r], stamp)
                    self.published += 1
                except Exception as exc:  # counted; the thread goes on
                    self.publish_errors += 1
                    self.last_publish_error = repr(exc)
            if stop.is_set():
                return
