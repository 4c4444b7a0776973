"""Approximate-time synchronisation of N cameras (image + camera_info) and a LiDAR cloud.

Pure Python (no rclpy). Every stream keeps a fixed-size history (deque with maxlen), so memory
never grows whatever the input rate; the consumer always takes the NEWEST complete set.

A set is complete when, for the newest possible reference image of camera 0, every camera has
an image whose stamp is within `slop` of it and a camera_info within `slop` of that image, and
(`cloud_required`, the default) a cloud within `slop` of the reference while one may still
come: the LiDAR is live (a cloud received within max(`cloud_timeout_s`, 1.5 x its period
measured from the clouds' receipt times, at most MAX_LIVE_WINDOW_S)) and no cloud stamped
after reference + slop has arrived yet (a LiDAR delivers its clouds in stamp order: after that
one, no matching cloud comes; the set goes without). So a set never goes out without the cloud
that is still on its way (which the
1.9 MB cloud usually is, after the images). The newest cloud within `slop` is attached; a set
without one (LiDAR silent, or cloud_required False) is counted as "missing_cloud". Nothing
here runs on a timer: the node calls pop_newest_set again after the live window (a timer), so
a waiting set is released when the LiDAR falls silent. Images that leave the history
unprocessed are counted through `count(name, n)`:
  "cloud_out_of_sync": (camera 0's image, one per set) its camera set was complete but no
                   cloud within `slop` came while the LiDAR was live (a lost cloud, or LiDAR
                   stamps that never fall within sync.slop of the cameras': no set forms);
  "skipped_stale": it could have formed a set, but a newer set was taken (processing slower
                   than the input rate: newest wins), or it arrived older than the last set;
  "out_of_sync":   no set could be formed with it (a partner image or camera_info missing or
                   further than `slop` away).

Time going backwards (a bag played with --loop, an earlier bag replayed, a sim restart): a
message stamped more than `jump_back_s` before the newest stamp seen on any input is a
backwards jump. As tf2 clears its buffer on a /clock jump, every stamp-ordered state is
forgotten (histories, last stamps consumed, newest cloud stamp), the jump is counted
("time_jumps_back") and reported through `on_jump(from_ns, to_ns)` once, and the message is
kept as the first of the new timeline. Without this, every later message would lie at or below
the last stamp consumed and perception would stop for good. The LiDAR's liveness (receipt times,
monotonic) is kept: sets after the jump still wait for their cloud. Messages of the old timeline
still in flight (stamped more than `jump_back_s` after the new timeline's front and at most
`jump_back_s` after the old front, received within JUMP_LEFTOVER_S of the jump) are dropped
(images counted as skipped_stale), not taken for a second jump.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SKIPPED_STALE = "skipped_stale"
OUT_OF_SYNC = "out_of_sync"
MISSING_CLOUD = "missing_cloud"
CLOUD_OUT_OF_SYNC = "cloud_out_of_sync"
TIME_JUMPS_BACK = "time_jumps_back"
MAX_LIVE_WINDOW_S = 5.0  # the LiDAR's live window never exceeds this (a slow or stalled one)
JUMP_LEFTOVER_S = 1.0  # receipt time after a jump during which old-timeline messages are dropped


@dataclass
class Stamped:
    """One received message: stamp (ns, message time), receipt time (s, monotonic), payload;
    ticket: where the payload lives when it is not the message's own memory (the input
    receivers' (sensor, slot, version), checked after the frame: InputReceivers.intact)."""

    stamp_ns: int
    recv_s: float
    data: Any
    ticket: Any = None


@dataclass
class SyncedSet:
    """A synchronised input set: one image and one camera_info per camera, maybe a cloud."""

    stamp_ns: int  # camera 0's image stamp (the set's stamp)
    images: list[Stamped]  # per camera
    infos: list[Stamped]  # per camera
    cloud: Stamped | None
    newest_recv_s: float  # receipt of the set's last message (s, monotonic): it was complete
    oldest_recv_s: float  # receipt of the set's first message (s, monotonic)


class FrameSynchronizer:
    """Thread-safe: add_* from subscription callbacks, pop_newest_set from the worker."""

    def __init__(self, num_cameras: int, slop_s: float, history: int = 8,
                 count: Callable[[str, int], Any] | None = None, *,
                 cloud_required: bool = True, cloud_timeout_s: float = 0.5,
                 jump_back_s: float = 1.0,
                 on_jump: Callable[[int, int], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if num_cameras < 1:
            raise ValueError(f"parameter 'num_cameras' = {num_cameras}: must be >= 1")
        if slop_s < 0:
            raise ValueError(f"parameter 'sync.slop' = {slop_s}: must be >= 0")
        if history < 1:
            raise ValueError(f"parameter 'history' = {history}: must be >= 1")
        if not cloud_timeout_s > 0:
            raise ValueError(f"parameter 'sync.cloud_timeout' = {cloud_timeout_s}: must be > 0")
        if not jump_back_s > slop_s:
            raise ValueError(f"parameter 'sync.jump_back' = {jump_back_s}: must be > "
                             f"sync.slop ({slop_s})")
        self.jump_back_ns = int(round(jump_back_s * 1e9))
        self._on_jump = on_jump or (lambda from_ns, to_ns: None)
        self._newest_ns: int | None = None  # newest stamp on any input (the timeline's front)
        self._leftover: tuple[int, float] | None = None  # after a jump: (old front, recv_s)
        self.cloud_required = bool(cloud_required)
        self.cloud_timeout_s = float(cloud_timeout_s)
        self._clock = clock  # same clock as the messages' recv_s (time.monotonic)
        self._last_cloud_recv_s: float | None = None
        self._newest_cloud_ns: int | None = None  # newest cloud stamp received
        self._cloud_period_s = 0.0  # EMA of the receipt intervals of consecutive clouds, s
        self._last_set_ns = -1  # stamp of the last set handed out
        self.num_cameras = num_cameras
        self.slop_ns = int(round(slop_s * 1e9))
        self._images: list[deque[Stamped]] = [deque() for _ in range(num_cameras)]
        self._infos: list[deque[Stamped]] = [deque(maxlen=history) for _ in range(num_cameras)]
        self._clouds: deque[Stamped] = deque(maxlen=history)
        self._history = history
        self._last_ns = [-1] * num_cameras  # stamp of the last image consumed, per camera
        self._count = count or (lambda name, n: None)
        self._lock = threading.Lock()

    # ---- input ----------------------------------------------------------------------------
    def _timeline(self, msg: Stamped) -> bool:
        """Track the newest stamp; on a backwards jump clear and count. False: drop `msg`
        (a message of the old timeline arriving after a jump). Under the lock."""
        t, newest = msg.stamp_ns, self._newest_ns
        if self._leftover is not None:
            old_front, at_s = self._leftover
            if msg.recv_s - at_s > JUMP_LEFTOVER_S:
                self._leftover = None
            elif newest is not None and newest < t - self.jump_back_ns <= old_front:
                return False
        if newest is not None and t < newest - self.jump_back_ns:
            self._clear_stamps()
            self._leftover = (newest, msg.recv_s)
            self._count(TIME_JUMPS_BACK, 1)
            self._on_jump(newest, t)
            newest = None
        if newest is None or t > newest:
            self._newest_ns = t
        return True

    def add_image(self, camera: int, msg: Stamped) -> None:
        with self._lock:
            if not self._timeline(msg):
                self._count(SKIPPED_STALE, 1)  # an image of the old timeline, after a jump
                return
            if msg.stamp_ns <= self._last_ns[camera]:
                self._count(SKIPPED_STALE, 1)  # older than what was already processed
                return
            q = self._images[camera]
            if len(q) >= self._history:  # evict the oldest (by arrival), counted
                self._discard(camera, q.popleft())
            q.append(msg)

    def add_info(self, camera: int, msg: Stamped) -> None:
        with self._lock:
            if self._timeline(msg):
                self._infos[camera].append(msg)

    def add_cloud(self, msg: Stamped) -> None:
        with self._lock:
            if not self._timeline(msg):
                return
            self._clouds.append(msg)
            last_recv = self._last_cloud_recv_s
            self._last_cloud_recv_s = msg.recv_s
            if last_recv is not None and msg.recv_s > last_recv:
                dt, p = msg.recv_s - last_recv, self._cloud_period_s
                if p == 0.0:
                    self._cloud_period_s = dt
                elif dt < 4.0 * p:  # a gap after silence is not the period
                    self._cloud_period_s = 0.8 * p + 0.2 * dt
            if self._newest_cloud_ns is None or msg.stamp_ns > self._newest_cloud_ns:
                self._newest_cloud_ns = msg.stamp_ns

    # ---- matching -------------------------------------------------------------------------
    def _closest(self, q: deque[Stamped] | list[Stamped], stamp_ns: int) -> Stamped | None:
        best = None
        for m in q:
            if abs(m.stamp_ns - stamp_ns) <= self.slop_ns and (
                    best is None or abs(m.stamp_ns - stamp_ns) < abs(best.stamp_ns - stamp_ns)
                    or (abs(m.stamp_ns - stamp_ns) == abs(best.stamp_ns - stamp_ns)
                        and m.stamp_ns > best.stamp_ns)):
                best = m
        return best

    def _match(self, camera: int, ref: Stamped) -> tuple[list[Stamped], list[Stamped]] | None:
        """Images and infos of all cameras matching `ref` (an image of `camera`), or None."""
        images: list[Stamped] = []
        infos: list[Stamped] = []
        for c in range(self.num_cameras):
            img = ref if c == camera else self._closest(self._images[c], ref.stamp_ns)
            if img is None:
                return None
            info = self._closest(self._infos[c], img.stamp_ns)
            if info is None:
                return None
            images.append(img)
            infos.append(info)
        return images, infos

    def _discard(self, camera: int, img: Stamped) -> None:
        if self._match(camera, img) is None:
            self._count(OUT_OF_SYNC, 1)
        elif (camera == 0 and self.cloud_required and self.lidar_live()
              and self._cloud_for(img.stamp_ns) is None and img.stamp_ns > self._last_set_ns):
            # a complete camera set that never got a cloud within slop of it: lost clouds, or
            # LiDAR stamps that never fall within sync.slop of the cameras' (no set forms)
            self._count(CLOUD_OUT_OF_SYNC, 1)
        else:
            self._count(SKIPPED_STALE, 1)

    def _cloud_for(self, ref_ns: int) -> Stamped | None:
        cloud = None
        for m in self._clouds:  # newest within slop of the reference
            if abs(m.stamp_ns - ref_ns) <= self.slop_ns and (
                    cloud is None or m.stamp_ns >= cloud.stamp_ns):
                cloud = m
        return cloud

    def live_window_s(self) -> float:
        """How long after the last cloud the LiDAR counts as live, s."""
        return max(self.cloud_timeout_s, min(1.5 * self._cloud_period_s, MAX_LIVE_WINDOW_S))

    def lidar_live(self) -> bool:
        """A cloud was received within live_window_s() (sets then wait for theirs)."""
        last = self._last_cloud_recv_s
        return last is not None and self._clock() - last < self.live_window_s()

    def pop_newest_set(self) -> SyncedSet | None:
        """The newest complete set, removed from the histories (older images are discarded and
        counted); None when no set is complete."""
        with self._lock:
            wait_cloud = self.cloud_required and self.lidar_live()
            for ref in sorted(self._images[0], key=lambda m: m.stamp_ns, reverse=True):
                found = self._match(0, ref)
                if found is None:
                    continue
                cloud = self._cloud_for(ref.stamp_ns)
                if cloud is None and wait_cloud and (
                        self._newest_cloud_ns is None
                        or self._newest_cloud_ns <= ref.stamp_ns + self.slop_ns):
                    continue  # its cloud may still be on the way
                break
            else:
                return None
            images, infos = found
            # classify the unused older images while the histories are still complete
            stale = [(c, m) for c, used in enumerate(images) for m in self._images[c]
                     if m.stamp_ns <= used.stamp_ns and m is not used]
            for c, m in stale:
                self._discard(c, m)
            for c, used in enumerate(images):
                self._images[c] = deque(m for m in self._images[c]
                                        if m.stamp_ns > used.stamp_ns)
                self._last_ns[c] = used.stamp_ns
            if cloud is None:
                self._count(MISSING_CLOUD, 1)
            self._last_set_ns = ref.stamp_ns
            parts = [*images, *infos] + ([cloud] if cloud is not None else [])
            recv = [m.recv_s for m in parts]
            return SyncedSet(ref.stamp_ns, images, infos, cloud, max(recv), min(recv))

    def clear(self) -> None:
        """Forget every input and what was learnt from them (on deactivate / reactivate, a bag
        loop or a sim restart: stamps may start over). The LiDAR state too: with the newest
        cloud stamp and period of the previous run kept, sets after a stamp reset stopped
        waiting for their cloud and were counted as missing_cloud."""
        with self._lock:
            self._clear_stamps()
            self._last_cloud_recv_s = None
            self._cloud_period_s = 0.0
            self._leftover = None

    def _clear_stamps(self) -> None:
        """Forget every stamp-ordered state (histories, stamps consumed, timeline front)."""
        for q in (*self._images, *self._infos, self._clouds):
            q.clear()
        self._last_ns = [-1] * self.num_cameras
        self._newest_cloud_ns = None
        self._last_set_ns = -1
        self._newest_ns = None
