"""The input side of `kestrel_bench perception-node` (perception_node.py).

Two ways to publish the frame sets (N cameras: CameraInfo + rgb8 Image; one PointCloud2):
  one         ONE process (`--role publisher`) publishes each whole set with sequential
              publish() calls (cloud, CameraInfos, Images), all stamped with the wall clock just
              before the first call. "Publishing one input set" = that process's publish() calls.
  per-sensor  one process per sensor (`--role sensor --sensor {0..cams-1 | cloud}`), as on a
              robot with one driver per sensor and hardware-triggered cameras: frame i is
              triggered at wall clock `start_ns + i * period_ns` in every process and every
              message of frame i is stamped with exactly that trigger time; the processes
              serialise and send in parallel. "Publishing one input set" = max over the sensors
              of (publish() end - trigger).
A sensor process creates its publishers, waits (bounded) for the node's subscriptions, prints
"ready", reads the common start time (ns) from stdin, publishes its frames and writes a JSON
(stamps, start lateness, publish durations) that the main process merges (`merge_sensor_runs`).
"""

from __future__ import annotations

import argparse
import json
import math
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from kestrel_bench.repo import ensure_paths

ensure_paths("kestrel_common")

NODE = "perception"
PUBLISHERS = ("one", "per-sensor")
READY = "ready"  # the line a sensor process prints once the node subscribes to its topics
SPIN_NS = 1_000_000  # the last 1 ms before a trigger is busy-waited (see wait_until_ns)
START_DELAY_NS = 500_000_000  # start time = the moment all sensors are ready + 0.5 s


@dataclass(frozen=True)
class InputConfig:
    """What the publisher side sends. Validated on construction (ValueError names the field)."""

    cams: int  # cameras per set (>= 1)
    image_hw: tuple[int, int]  # (H, W) of every image, px
    points: int  # LiDAR points per cloud (0 = no cloud)
    rate: float  # frame sets per second, Hz
    frames: int  # timed frames (after the untimed warm-up frames)
    warmup_s: float = 2.0  # untimed frames first (discovery transients), s
    publishers: str = "one"  # "one" | "per-sensor"

    def __post_init__(self) -> None:
        checks = (("cams", self.cams >= 1, "must be >= 1"),
                  ("image_hw", len(self.image_hw) == 2 and min(self.image_hw) >= 1,
                   "must be (H, W) with H, W >= 1"),
                  ("points", self.points >= 0, "must be >= 0"),
                  ("rate", 0.1 <= self.rate <= 1000, "must be in [0.1, 1000] Hz"),
                  ("frames", self.frames >= 1, "must be >= 1"),
                  ("warmup_s", self.warmup_s >= 0, "must be >= 0"),
                  ("publishers", self.publishers in PUBLISHERS, f"must be one of {PUBLISHERS}"))
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"parameter '{name}' = {getattr(self, name)!r}: {why}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> InputConfig:
        return cls(args.cams, tuple(args.image_hw), args.points, args.rate, args.frames,
                   args.publisher_warmup_s, getattr(args, "publishers", "one"))

    @property
    def warmup_frames(self) -> int:
        return int(round(self.warmup_s * self.rate))

    @property
    def period_ns(self) -> int:
        return rate_period_ns(self.rate)

    def sensors(self) -> list[str]:
        """Sensor names of the per-sensor mode: "0".."cams-1", then "cloud" (if points > 0)."""
        return [str(c) for c in range(self.cams)] + (["cloud"] if self.points else [])

    def cli(self) -> list[str]:
        return ["--cams", str(self.cams), "--image-hw", *map(str, self.image_hw),
                "--points", str(self.points), "--rate", repr(self.rate),
                "--frames", str(self.frames), "--publisher-warmup-s", repr(self.warmup_s)]


def rate_period_ns(rate_hz: float) -> int:
    """Frame period in integer ns: every process derives the same one from the same rate."""
    return int(round(1e9 / rate_hz))


def trigger_schedule(start_ns: int, period_ns: int, frames: int, first: int = 0) -> list[int]:
    """Wall-clock trigger times (ns) of frames first .. first+frames-1: start + i * period,
    computed per frame (no accumulated drift), identical in every process."""
    if period_ns <= 0:
        raise ValueError(f"parameter 'period_ns' = {period_ns}: must be > 0")
    if frames < 0 or first < 0:
        raise ValueError(f"parameters 'frames' = {frames}, 'first' = {first}: must be >= 0")
    return [int(start_ns) + (first + i) * int(period_ns) for i in range(frames)]


def wait_until_ns(target_ns: int, spin_ns: int = SPIN_NS,
                  clock: Callable[[], int] = time.time_ns,
                  sleep: Callable[[float], None] = time.sleep) -> int:
    """Return at the first clock() reading >= target_ns (wall clock, ns); returns that reading.

    Sleeps (rate control) until ~spin_ns before the target, then spins on the clock: a
    sleep alone wakes up late by the timer slack + scheduler latency (50 us to over 1 ms on a
    loaded machine), and the sensor processes must start a frame at the same instant, as
    hardware-triggered sensors do. Spinning costs up to spin_ns of one core per frame."""
    while True:
        now = clock()
        left = target_ns - now
        if left <= 0:
            return now
        if left > spin_ns:
            sleep((left - spin_ns) / 1e9)


def merge_sensor_runs(runs: Sequence[dict]) -> dict:
    """Merge the per-sensor JSONs (one per process) into one record per frame.

    Each run: {"sensor": name, "stamps_ns": [F], "start_lateness_ns": [F] (publish start -
    trigger), "publish_ns": [F] (publish duration)}. Every sensor must report the same stamps
    (ValueError otherwise). Returns stamps_ns [F]; publish_s [F] = max over sensors of
    (publish end - trigger), s; trigger_lateness_s [F] = max over sensors of the start
    lateness, s; sensors; publish_end_by_sensor_s {sensor: [F]}, s."""
    if not runs:
        raise ValueError("no sensor runs to merge")
    ref = runs[0]
    stamps = [int(s) for s in ref["stamps_ns"]]
    end_by, late_by = {}, {}
    for run in runs:
        name = str(run["sensor"])
        if name in end_by:
            raise ValueError(f"sensor '{name}' reported twice")
        st, late, dur = run["stamps_ns"], run["start_lateness_ns"], run["publish_ns"]
        if not len(st) == len(late) == len(dur):
            raise ValueError(f"sensor '{name}': stamps_ns, start_lateness_ns, publish_ns have "
                             f"different lengths ({len(st)}, {len(late)}, {len(dur)})")
        if len(st) != len(stamps):
            raise ValueError(f"sensor '{name}' reported {len(st)} frames, sensor "
                             f"'{ref['sensor']}' {len(stamps)}: stamps disagree")
        for i, (a, b) in enumerate(zip(stamps, st, strict=True)):
            if int(a) != int(b):
                raise ValueError(f"stamps disagree at frame {i}: sensor '{name}' {int(b)} ns, "
                                 f"sensor '{ref['sensor']}' {a} ns (diff {int(b) - a} ns)")
        end_by[name] = [(int(x) + int(d)) / 1e9 for x, d in zip(late, dur, strict=True)]
        late_by[name] = [int(x) / 1e9 for x in late]
    return {"stamps_ns": stamps,
            "publish_s": [max(v[i] for v in end_by.values()) for i in range(len(stamps))],
            "trigger_lateness_s": [max(v[i] for v in late_by.values())
                                   for i in range(len(stamps))],
            "sensors": list(end_by), "publish_end_by_sensor_s": end_by}


class SetPublisher:
    """Publishers of one frame set, or of some of its sensors (`sensors`: camera indices and/or
    "cloud"; None = all): cloud, then CameraInfos, then Images, all with one stamp. The
    messages are built once here; publish() only sets stamps."""

    def __init__(self, node, cams: int, hw: tuple[int, int], points: int, seed: int,
                 sensors: Sequence[int | str] | None = None) -> None:
        from kestrel_common.base_node import SENSOR_QOS
        from kestrel_common.conversions import make_camera_info, make_header, numpy_to_image
        from kestrel_common.conversions import xyz_to_pointcloud2
        from sensor_msgs.msg import CameraInfo, Image, PointCloud2

        h, w = hw
        chosen = {str(s) for s in (sensors if sensors is not None else
                                   [*range(cams), "cloud"])}
        cam_ids = [c for c in range(cams) if str(c) in chosen]
        rng = np.random.default_rng(seed)
        K = np.array([[w / 2, 0.0, w / 2], [0.0, w / 2, h / 2], [0.0, 0.0, 1.0]])
        # every camera's pixels are drawn (same draws in every process: camera c's image and
        # the cloud are the same whichever process publishes them); pixels: [H, W, 3] uint8
        pixels = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(cams)]
        self.images = [numpy_to_image(pixels[c], "rgb8", make_header(0, f"cam{c}_optical"))
                       for c in cam_ids]
        self.infos = [make_camera_info(K, w, h, make_header(0, f"cam{c}_optical"))
                      for c in cam_ids]
        r = 2 + 28 * rng.random(points)
        a = 2 * math.pi * rng.random(points)
        xyz = np.stack([r * np.cos(a), r * np.sin(a), -0.5 + 3 * rng.random(points)], 1)  # m
        self.cloud = (xyz_to_pointcloud2(xyz.astype(np.float32), make_header(0, "world"))
                      if points and "cloud" in chosen else None)
        pre = f"/{NODE}/input"
        self.pub_img = [node.create_publisher(Image, f"{pre}/camera_{c}/image", SENSOR_QOS)
                        for c in cam_ids]
        self.pub_info = [node.create_publisher(CameraInfo, f"{pre}/camera_{c}/camera_info",
                                               SENSOR_QOS) for c in cam_ids]
        self.pub_cloud = (node.create_publisher(PointCloud2, f"{pre}/points", SENSOR_QOS)
                          if "cloud" in chosen else None)

    def wait_for_node(self, timeout: float) -> bool:
        """Poll (bounded by timeout, s) until every topic has a subscriber."""
        deadline = time.monotonic() + timeout
        pubs = [*self.pub_img, *self.pub_info, *([self.pub_cloud] if self.pub_cloud else [])]
        while time.monotonic() < deadline:
            if all(p.get_subscription_count() > 0 for p in pubs):
                return True
            time.sleep(0.05)
        return False

    def publish(self, stamp_ns: int | None = None) -> tuple[int, float]:
        """Publish the set stamped `stamp_ns` (None: the wall clock now). Returns (stamp ns,
        seconds spent, from just before the stamp was read to the last publish() return)."""
        from kestrel_common.conversions import ns_to_stamp

        t0 = time.perf_counter()
        stamp_ns = time.time_ns() if stamp_ns is None else int(stamp_ns)
        st = ns_to_stamp(stamp_ns)
        if self.cloud is not None:
            self.cloud.header.stamp = st
            self.pub_cloud.publish(self.cloud)
        for pub, msg in zip(self.pub_info, self.infos, strict=True):
            msg.header.stamp = st
            pub.publish(msg)
        for pub, msg in zip(self.pub_img, self.images, strict=True):
            msg.header.stamp = st
            pub.publish(msg)
        return stamp_ns, time.perf_counter() - t0


def _finish(node, out: str, record: dict) -> None:
    import rclpy

    Path(out).write_text(json.dumps(record))
    time.sleep(1.0)  # let DDS deliver the last set before the writers are destroyed
    node.destroy_node()
    rclpy.try_shutdown()


def run_publisher(args: argparse.Namespace) -> int:
    """--role publisher: publish `frames` sets at `rate` Hz, write their stamps to JSON."""
    import rclpy

    cfg = InputConfig.from_args(args)
    rclpy.init()
    node = rclpy.create_node("perception_bench_publisher")
    sp = SetPublisher(node, cfg.cams, cfg.image_hw, cfg.points, seed=1)
    if not sp.wait_for_node(30.0):
        print("publisher: the node's subscriptions did not appear within 30 s", file=sys.stderr)
        return 2
    stamps, pub_s = [], []
    period = 1.0 / cfg.rate
    t_next = time.perf_counter()
    for i in range(cfg.warmup_frames + cfg.frames):
        delay = t_next - time.perf_counter()
        if delay > 0:
            time.sleep(delay)  # rate control, not synchronisation
        s, dt = sp.publish()
        if i >= cfg.warmup_frames:
            stamps.append(s)
            pub_s.append(dt)
        t_next += period
    _finish(node, args.stamps_out, {"stamps_ns": stamps, "publish_s": pub_s})
    return 0


def run_sensor(args: argparse.Namespace) -> int:
    """--role sensor: one sensor's driver. Ready line, start time from stdin, then frame i at
    start + i * period, stamped with that trigger time; writes its JSON to --stamps-out."""
    import rclpy

    cfg = InputConfig.from_args(args)
    name = args.sensor
    if name not in cfg.sensors():
        print(f"sensor: parameter 'sensor' = {name!r}: must be one of {cfg.sensors()}",
              file=sys.stderr)
        return 2
    rclpy.init()
    node = rclpy.create_node(f"perception_bench_sensor_{name}")
    sp = SetPublisher(node, cfg.cams, cfg.image_hw, cfg.points, seed=1, sensors=[name])
    if not sp.wait_for_node(30.0):
        print(f"sensor {name}: the node's subscriptions did not appear within 30 s",
              file=sys.stderr)
        return 2
    print(READY, flush=True)
    line = sys.stdin.readline()  # the main process writes it (or exits: EOF)
    if not line.strip():
        print(f"sensor {name}: no start time on stdin", file=sys.stderr)
        return 2
    triggers = trigger_schedule(int(line), cfg.period_ns, cfg.warmup_frames + cfg.frames)
    stamps, late, dur = [], [], []
    for i, trig in enumerate(triggers):
        wait_until_ns(trig)  # sleep to ~1 ms before, then spin: all sensors start together
        t0 = time.time_ns()
        sp.publish(trig)  # hardware trigger: the stamp is the trigger time, not now
        t1 = time.time_ns()
        if i >= cfg.warmup_frames:  # the warm-up frames are untimed
            stamps.append(trig)
            late.append(t0 - trig)
            dur.append(t1 - t0)
    _finish(node, args.stamps_out, {"sensor": name, "stamps_ns": stamps,
                                    "start_lateness_ns": late, "publish_ns": dur})
    return 0


def _wait_ready(procs: dict[str, subprocess.Popen], logs: dict[str, Path],
                timeout: float) -> None:
    """Wait (bounded) for every sensor process's READY line; RuntimeError otherwise."""
    lines: queue.Queue = queue.Queue()
    for name, p in procs.items():
        threading.Thread(target=lambda n=name, s=p.stdout: lines.put((n, s.readline())),
                         daemon=True).start()
    pending = set(procs)
    deadline = time.monotonic() + timeout
    while pending:
        try:
            name, line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise RuntimeError(f"sensor process(es) {sorted(pending)} not ready within "
                               f"{timeout} s") from None
        if line.strip() != READY:
            procs[name].wait(5.0)
            raise RuntimeError(f"sensor process '{name}' failed before ready (exit code "
                               f"{procs[name].poll()}): {logs[name].read_text()[-2000:]}")
        pending.discard(name)


def run_sensors(cfg: InputConfig, env: dict[str, str], run_dir: Path,
                ready_timeout: float = 60.0, cpus: tuple[int, ...] = ()) -> dict:
    """Per-sensor mode, main side: start one process per sensor, wait until all are ready,
    (cpus: pin them, every thread, to those CPUs), give them one start time, wait (bounded)
    for them and merge their JSONs. Returns merge_sensor_runs(...) + start_ns, period_ns
    (the stamps are checked against them)."""
    procs: dict[str, subprocess.Popen] = {}
    logs = {s: run_dir / f"sensor_{s}.log" for s in cfg.sensors()}
    outs = {s: run_dir / f"sensor_{s}.json" for s in cfg.sensors()}
    try:
        for s in cfg.sensors():
            with open(logs[s], "w") as log:
                procs[s] = subprocess.Popen(
                    [sys.executable, "-m", "kestrel_bench.perception_inputs", "--role", "sensor",
                     "--sensor", s, *cfg.cli(), "--stamps-out", str(outs[s])],
                    env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                    text=True)
        _wait_ready(procs, logs, ready_timeout)
        if cpus:
            from kestrel_common.affinity import pin_threads
            for p in procs.values():
                pin_threads(p.pid, cpus)
        start_ns = time.time_ns() + START_DELAY_NS
        for p in procs.values():
            p.stdin.write(f"{start_ns}\n")
            p.stdin.close()
        deadline = (time.monotonic() + START_DELAY_NS / 1e9 + 30.0
                    + (cfg.warmup_frames + cfg.frames) / cfg.rate)
        hung = []
        for s, p in procs.items():
            try:
                code = p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if not outs[s].exists():
                    raise RuntimeError(f"sensor process '{s}' did not finish its frames "
                                       f"in time: {logs[s].read_text()[-2000:]}") from None
                # its record is written before the node's teardown: only the DDS teardown hung
                # (seen once on the H200 for 1 of 7 processes); killed below, counted
                hung.append(s)
                continue
            if code != 0:
                raise RuntimeError(f"sensor process '{s}' exited with {code}: "
                                   f"{logs[s].read_text()[-2000:]}")
    finally:
        for p in procs.values():  # only on an error: the processes we started, by handle
            if p.poll() is None:
                p.kill()
                p.wait(5.0)
    merged = merge_sensor_runs([json.loads(outs[s].read_text()) for s in cfg.sensors()])
    expected = trigger_schedule(start_ns, cfg.period_ns, cfg.frames, first=cfg.warmup_frames)
    if merged["stamps_ns"] != expected:
        raise RuntimeError("the sensors' stamps are not the scheduled trigger times")
    return {**merged, "start_ns": start_ns, "period_ns": cfg.period_ns,
            "teardown_hung": hung}


def publish_inputs(cfg: InputConfig, env: dict[str, str], run_dir: Path,
                   cpus: tuple[int, ...] = ()) -> dict:
    """Run the timed publisher side in cfg.publishers mode (blocking, bounded). Returns
    stamps_ns [F], publish_s [F] (s, "publishing one input set" of the mode), publishers and,
    per-sensor, trigger_lateness_s [F] and the rest of run_sensors' record. cpus: the
    per-sensor processes' CPUs (() = not pinned)."""
    if cfg.publishers == "per-sensor":
        return {"publishers": cfg.publishers, **run_sensors(cfg, env, run_dir, cpus=cpus)}
    out = run_dir / "stamps.json"
    proc = subprocess.run([sys.executable, "-m", "kestrel_bench.perception_inputs", "--role",
                           "publisher", *cfg.cli(), "--stamps-out", str(out)], env=env,
                          timeout=cfg.frames / cfg.rate + cfg.warmup_s + 60,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"publisher failed: {proc.stderr[-2000:]}")
    return {"publishers": cfg.publishers, **json.loads(out.read_text())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=("publisher", "sensor"), required=True)
    ap.add_argument("--sensor", default="", help="--role sensor: camera index or 'cloud'")
    ap.add_argument("--cams", type=int, default=1)
    ap.add_argument("--image-hw", type=int, nargs=2, default=(640, 640), metavar=("H", "W"))
    ap.add_argument("--points", type=int, default=120_000)
    ap.add_argument("--rate", type=float, default=10.0, help="frame sets per second")
    ap.add_argument("--frames", type=int, default=200)
    ap.add_argument("--publisher-warmup-s", type=float, default=2.0)
    ap.add_argument("--stamps-out", required=True)
    args = ap.parse_args()
    try:
        InputConfig.from_args(args)
    except ValueError as exc:
        ap.error(str(exc))
    return run_sensor(args) if args.role == "sensor" else run_publisher(args)


if __name__ == "__main__":
    raise SystemExit(main())
