"""Node side of `receive: processes`: input receiver processes and the thread that reads them.

`InputReceivers.start()` creates the rings' segment (input_rings.RingLayout), lets the caller
page-lock the slots (`pin`: the node's InputStaging.pin_host_memory, so a slot goes straight to
the device), starts one `python -m kestrel_perception.perception_receiver_node` per camera image
topic and one for the cloud (each subscribes to its topic and writes every usable message into a
free slot of its ring), and waits (bounded) until all of them have subscribed. A thread then
sleeps on the eventfd the receivers write after each message; woken, it claims the newest
message of every ring that has one (no copy: the handler gets a view of the slot, which stays
the node's until it claimed `pool` newer messages of that sensor, more than the node's
synchroniser keeps) and calls `on_image(cam, stamp_ns, recv_s, rgb [H,W,3] uint8, frame_id,
ticket)` or `on_points(stamp_ns, recv_s, xyz [N,3] float32, ticket)` (ticket: see `intact`), and
with `info_topics` each camera's newest CameraInfo first (`on_info(cam, stamp_ns, recv_s, K
[3,3], width, height)`): the node's own handlers, as its subscription callbacks would. Messages
replaced in a ring before the thread claimed them are counted (`overwritten`, newest wins).
`close()` ends the children through their stdin (bounded, then kill), unpins and unlinks the
segment; it also runs at interpreter exit.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import select
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np
from kestrel_common.shm import ShmSegment

from kestrel_perception.core.input_rings import RingLayout

RECEIVER_MODULE = "kestrel_perception.perception_receiver_node"
log = logging.getLogger(__name__)


class ReceiverError(RuntimeError):
    """The receivers could not be started (the message says which and why)."""


class InputReceivers:
    """See the module docstring. start/close from one (lifecycle) thread."""

    def __init__(self, layout: RingLayout, topics: Sequence[str],
                 on_image: Callable[[int, int, float, np.ndarray, str, tuple], None],
                 on_points: Callable[[int, float, np.ndarray, tuple], None], *, frame_id: str,
                 node_name: str, namespace: str = "/", ros_args: Sequence[str] = (),
                 pool: int = 11, start_timeout_s: float = 60.0,
                 python: str = sys.executable,
                 pin: Callable[[list[np.ndarray]], tuple[Callable[[], None], str]] | None = None,
                 info_topics: Sequence[str] | None = None,
                 on_info: Callable[[int, int, float, np.ndarray, int, int], None] | None = None,
                 cpus: Sequence[int] = ()) -> None:
        if len(topics) != layout.num_sensors:
            raise ValueError(f"parameter 'topics' = {len(topics)} topics: expected "
                             f"{layout.num_sensors} (cameras, then the cloud)")
        if pool < 1 or layout.slots < pool + 2:
            raise ValueError(f"pool = {pool!r} messages held per sensor: must be >= 1 and "
                             f"<= the rings' slots - 2 ({layout.slots - 2})")
        if info_topics is not None and len(info_topics) != layout.num_cameras:
            raise ValueError(f"parameter 'info_topics' = {len(info_topics)} topics: expected "
                             f"{layout.num_cameras} (one per camera)")
        self.layout, self.topics = layout, list(topics)
        # each camera's receiver also takes its CameraInfo topic (on_info(cam, stamp_ns,
        # recv_s, K [3,3], width, height), handed over before that camera's image)
        self.info_topics = list(info_topics) if info_topics is not None else None
        self.on_info = on_info
        self.cpus = list(cpus)  # receiver i runs on cpus[i % len] alone ([]: not pinned)
        self.on_image, self.on_points = on_image, on_points
        self.frame_id, self.node_name, self.namespace = frame_id, node_name, namespace
        self.ros_args, self.start_timeout_s, self.python = list(ros_args), start_timeout_s, python
        # pin(blocks): the rings' data blocks [slots, slot_bytes] uint8, one per sensor, once;
        # returns (undo, what was done); undo runs before the segment is unmapped. The node
        # passes InputStaging.pin_host_memory (page-locked on CUDA: slots go to the device)
        self.pool, self._pin = pool, pin
        self._unpin: Callable[[], None] | None = None
        self.pin_status = "not pinned"
        self._held = [deque() for _ in range(layout.num_sensors)]  # slots held, oldest first
        self._last = [0] * layout.num_sensors  # last version claimed per ring
        self._last_info = [0] * layout.num_cameras  # last CameraInfo version read per camera
        self.overwritten = 0  # messages replaced in a ring before the thread read them
        self.delivered = 0
        # time.monotonic() when the thread started handing over its current message: the node
        # reports (this - receipt in the receiver) = the hand-over delay (`rx_handoff`)
        self.handing_over_since = 0.0
        self.read_s = 0.0  # duration of the last claim of a slot (`rx_read`: lock, metadata)
        # the current message: receipt -> slot published, in its receiver (`rx_write`:
        # conversion, checks, the copy into the slot); and the duration of the last handler
        # call that returned (`rx_handler`: the node's store + pre-staging of one input)
        self.write_s = 0.0
        self.handler_s = 0.0
        self.handler_errors = 0
        self.last_error = ""
        self.shm: ShmSegment | None = None
        self._lock_fd = -1
        self.rings: list = []
        self.procs: list[subprocess.Popen] = []
        self._efd = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def _cpu(self, sensor: int) -> int | None:
        """The CPU receiver `sensor` runs on alone, or None (not pinned)."""
        return self.cpus[sensor % len(self.cpus)] if self.cpus else None

    @property
    def cpu_status(self) -> str:
        """Where the receivers run, for the node's log."""
        if not self.cpus:
            return "not pinned to CPUs"
        return f"on CPUs {[self._cpu(s) for s in range(len(self.topics))]}"

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Segment, children, wait until every child subscribed (ReceiverError on failure or
        timeout), then the reader thread."""
        name = f"kestrel_perception_{os.getpid()}_{secrets.token_hex(4)}"
        try:
            self.shm = ShmSegment(name, self.layout.size, create=True)
            atexit.register(self.close)
            self._lock_fd = os.open(self.shm.path, os.O_RDWR | os.O_CLOEXEC)
            self.rings = self.layout.rings(self.shm.buf, self._lock_fd)
            if self._pin is not None:
                self._unpin, self.pin_status = self._pin([r.data for r in self.rings])
            self._efd = os.eventfd(0, os.EFD_CLOEXEC)
            for s, topic in enumerate(self.topics):
                self.procs.append(self._spawn(name, s, topic))
            self._wait_ready()
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._run, name="perception_receivers",
                                        daemon=True)
        self._thread.start()

    def _spawn(self, shm_name: str, sensor: int, topic: str) -> subprocess.Popen:
        kind = "points" if sensor == self.layout.num_cameras else f"camera_{sensor}"
        cmd = [self.python, "-m", RECEIVER_MODULE, "--shm", shm_name,
               "--layout", *self.layout.to_args(), "--sensor", str(sensor), "--topic", topic,
               "--event-fd", str(self._efd), "--parent-pid", str(os.getpid()),
               "--frame-id", self.frame_id,
               *(["--info-topic", self.info_topics[sensor]] if self.info_topics is not None
                 and sensor < self.layout.num_cameras else []),
               *(["--cpu", str(self._cpu(sensor))] if self.cpus else []),
               "--ros-args", "-r",
               f"__node:={self.node_name}_rx_{kind}", "-r", f"__ns:={self.namespace}",
               *self.ros_args]
        # stdin: a pipe only this process writes; its EOF ends the child
        return subprocess.Popen(cmd, stdin=subprocess.PIPE, pass_fds=(self._efd,),
                                env=dict(os.environ, PYTHONUNBUFFERED="1",
                                         OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"))

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while not all(r.ready for r in self.rings):
            for s, p in enumerate(self.procs):
                if p.poll() is not None:
                    raise ReceiverError(f"input receiver for '{self.topics[s]}' exited with "
                                        f"code {p.returncode} at start (its output is in this "
                                        "node's log)")
            left = deadline - time.monotonic()
            if left <= 0:
                waiting = [self.topics[s] for s, r in enumerate(self.rings) if not r.ready]
                raise ReceiverError(f"input receivers for {waiting} did not start within "
                                    f"{self.start_timeout_s:g} s (parameter "
                                    "'receiver_start_timeout')")
            # each child writes the eventfd once it has subscribed
            if select.select([self._efd], [], [], min(left, 0.5))[0]:
                os.eventfd_read(self._efd)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and the children (stdin EOF, then kill; bounded), unlink the
        segment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._efd >= 0:
            os.eventfd_write(self._efd, 1)
        if self._thread is not None:
            self._thread.join(timeout_s)
        for p in self.procs:
            try:
                p.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for topic, p in zip(self.topics, self.procs, strict=False):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # said: a killed receiver leaves DDS files
                log.warning("input receiver for %s (pid %d) did not exit within %g s of its "
                            "stdin closing: killed", topic, p.pid, timeout_s)
                p.kill()
                p.wait(timeout_s)
        if self._efd >= 0:
            os.close(self._efd)
            self._efd = -1
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
        self.rings = []
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        if self.shm is not None:
            self.shm.unlink()
            self.shm.close()
        atexit.unregister(self.close)

    @property
    def thread(self) -> threading.Thread | None:
        """The reader thread (it runs the node's handlers)."""
        return self._thread

    # ---- diagnostics -------------------------------------------------------------------------
    def exited(self) -> list[str]:
        """Topics whose receiver process is gone (it crashed or was killed): their inputs no
        longer arrive. The node reports it on /diagnostics (ERROR); it does not restart them."""
        return [self.topics[s] for s, p in enumerate(self.procs) if p.poll() is not None]

    def counters(self) -> dict[str, int]:
        """The receivers' drop counters summed over sensors (named as the node's own drops,
        which the node adds them to), their message count as rx_received and the messages
        they never took as rx_lost, and this side's (rx_overwritten, rx_handler_errors)."""
        out: dict[str, int] = {}
        for ring in self.rings:
            for name, n in ring.counters().items():
                key = {"received": "rx_received", "lost": "rx_lost"}.get(name, name)
                out[key] = out.get(key, 0) + n
        out["rx_overwritten"] = self.overwritten
        out["rx_handler_errors"] = self.handler_errors
        return out

    def lost(self) -> list[int]:
        """Per sensor (cameras, then the cloud): messages its receiver never took (the
        publisher's sequence gaps; the node adds the ring's own to lost_<sensor>)."""
        return [ring.counters()["lost"] for ring in self.rings]

    def timings(self, newest_recv_s: float) -> dict[str, float]:
        """Hand-over timings (s) of the message whose handler is running now (the node calls
        this while processing the set that message completed): rx_handoff = its receipt in
        the receiver (`newest_recv_s`) -> its hand-over started here (ring write, wake-up,
        the messages handed over before it), of which rx_write = receipt -> slot published;
        rx_read = the claim of its slot (no copy); rx_handler = the previous input's
        hand-over (store + pre-staging)."""
        return {"rx_handoff": self.handing_over_since - newest_recv_s, "rx_write": self.write_s,
                "rx_read": self.read_s, "rx_handler": self.handler_s}

    # ---- the reader thread -------------------------------------------------------------------
    def _run(self) -> None:
        efd, stop = self._efd, self._stop
        while not stop.is_set():
            try:
                os.eventfd_read(efd)  # blocks (GIL released) until a receiver wrote
            except OSError:
                return
            if stop.is_set():
                return
            self.poll()

    def poll(self) -> int:
        """Hand over the newest message of every ring with a new one; returns how many."""
        n = 0
        cams = self.layout.num_cameras
        for s, ring in enumerate(self.rings):
            if s < cams and ring.info_version != self._last_info[s]:
                n += self._hand_over_info(s, ring)  # before the image it belongs to
            if ring.version == self._last[s]:
                continue
            held = self._held[s]
            # the oldest held slot goes back with this claim once `pool` are held
            release = held.popleft() if len(held) >= self.pool else -1
            t_read = time.monotonic()
            item = ring.claim(release)
            self.read_s = time.monotonic() - t_read
            if item is None:
                continue
            held.append(item.slot)
            self.overwritten += max(0, item.version - self._last[s] - 1)
            self._last[s] = item.version
            recv_s = item.recv_ns * 1e-9  # time.monotonic() scale
            self.write_s = (item.published_ns - item.recv_ns) * 1e-9
            self.handing_over_since = t0 = time.monotonic()
            ticket = (s, item.slot, item.version)  # checked after the frame: intact()
            try:
                if s < cams:
                    self.on_image(s, item.stamp_ns, recv_s, ring.view(item), item.frame_id,
                                  ticket)
                else:
                    self.on_points(item.stamp_ns, recv_s, ring.view(item), ticket)
            except Exception as exc:  # the node's handler; counted, the thread goes on
                self.handler_errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
            self.handler_s = time.monotonic() - t0
            n += 1
        self.delivered += n
        return n

    def _hand_over_info(self, cam: int, ring) -> int:  # noqa: ANN001
        info = ring.read_info()
        if info is None or self.on_info is None:
            return 0
        self._last_info[cam] = info.version
        self.write_s = 0.0  # (timings() of a set this CameraInfo completes)
        self.handing_over_since = t0 = time.monotonic()
        try:
            self.on_info(cam, info.stamp_ns, info.recv_ns * 1e-9, info.k, info.width,
                         info.height)
        except Exception as exc:  # the node's handler; counted, the thread goes on
            self.handler_errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
        self.handler_s = time.monotonic() - t0
        return 1

    def intact(self, tickets: list) -> bool:
        """Every (sensor, slot, version) ticket's slot still holds its message, untouched
        since it was handed over. The node checks its frame's inputs after processing them:
        a slot is given back after `pool` newer claims of its sensor, kept by the node or
        not, so a message the synchroniser kept longer could have been overwritten; that
        frame is dropped (counted), never published."""
        return all(t is None or self.rings[t[0]].holds(t[1], t[2]) for t in tickets)
