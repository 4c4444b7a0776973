"""perception receiver: one sensor topic -> the perception node's shared-memory ring.

Not started by hand: the perception node starts one per camera image topic and one for the
LiDAR cloud when its parameter `receive.mode` is 'processes' (core/receivers.py). Why: in one
Python process the node's executor takes a set's messages one after the other, and rclpy's
take + deserialisation + conversion of each image holds the GIL, so the last message of a
set arrives late (`input_spread`, docs/benchmarks/perception_node_h200.md). Here every sensor
is received in its own interpreter, in parallel, and the node takes the arrays where they are
written.

A camera's receiver also takes its CameraInfo topic (`--info-topic`): K and size, checked as
the node does, go into the ring's info record, handed over with the images (the node's
executor then takes no per-frame message).

Per message: counted (received; the publisher's sequence gaps before it as lost, core/loss.py),
the same checks as the node's own callbacks (msg_inputs: encoding, size, cloud
frame / point count / all-NaN; drops counted in the ring and added to the node's counters of
the same name on its /diagnostics), then the array into a free slot of the ring
(core/input_rings.py: the node reads it there, no copy) and one eventfd write to wake the
node's receiver thread. It exits when its stdin closes (the node closed it, or died), or on
SIGTERM; it ignores SIGINT (Ctrl-C reaches the whole process group: the node decides).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
import time

import rclpy
from kestrel_common.affinity import pin_threads
from kestrel_common.base_node import SENSOR_QOS
from kestrel_common.conversions import (
    DISTORTION_ADVICE,
    ConversionError,
    camera_info_is_distorted,
    camera_info_to_k,
    stamp_to_ns,
)
from kestrel_common.heap import tune_malloc
from kestrel_common.process_stop import SignalFlag
from kestrel_common.shm import ShmSegment, unlink_segment
from rclpy.executors import SingleThreadedExecutor
from rclpy.signals import SignalHandlerOptions
from rclpy.utilities import remove_ros_args
from sensor_msgs.msg import CameraInfo, Image, PointCloud2

from kestrel_perception.core.input_rings import RingLayout
from kestrel_perception.core.loss import SequenceGaps, message_sequence
from kestrel_perception.msg_inputs import InputDrop, cloud_xyz, image_rgb


def _log(message: str) -> None:
    print(f"[perception receiver {os.getpid()}] {message}", file=sys.stderr, flush=True)


class Receiver:
    """Subscription callback of one sensor: message -> checks -> ring -> wake the node."""

    def __init__(self, ring, layout: RingLayout, sensor: int, event_fd: int,
                 frame_id: str) -> None:
        self.ring, self.layout, self.efd, self.frame_id = ring, layout, event_fd, frame_id
        self.is_cloud = sensor == layout.num_cameras
        self.name = "cloud" if self.is_cloud else f"camera {sensor}"
        self._logged: dict[str, float] = {}
        # messages of the topic this subscription (depth 1) never took: counted in the ring
        self._gaps = SequenceGaps("lost", ring.count)

    def drop(self, counter: str, message: str) -> None:
        self.count(counter, f"dropped ({counter}): {message}")

    def count(self, counter: str, message: str, period_s: float = 1.0) -> None:
        """Count `counter` in the ring and log `message`, at most once per `period_s` per
        counter."""
        self.ring.count(counter)
        now = time.monotonic()
        if now - self._logged.get(counter, -1e9) >= period_s:
            self._logged[counter] = now
            _log(f"{self.name}: {message}")

    def __call__(self, msg, info) -> None:  # noqa: ANN001 - info: rclpy's message info
        recv_ns = time.monotonic_ns()
        ring = self.ring
        ring.count("received")
        seq, writer = message_sequence(info)
        if seq is not None:
            self._gaps.add(seq, writer)
        try:
            if self.is_cloud:
                array = cloud_xyz(msg, self.layout.max_points, self.frame_id)
                encoding = "xyz32"
            else:
                array, encoding = image_rgb(msg), "rgb8"
        except InputDrop as exc:
            self.drop(exc.counter, str(exc))
            return
        lay = self.layout
        if not self.is_cloud and (array.shape[0] > lay.image_height
                                  or array.shape[1] > lay.image_width):
            self.drop("dropped_size_mismatch", f"image {msg.width}x{msg.height} is larger than "
                                               f"warmup_size {lay.image_width}x{lay.image_height}")
            return
        if not ring.write(array, stamp_to_ns(msg.header.stamp), recv_ns, encoding,
                          msg.header.frame_id):  # a cloud within max_points always fits
            self.drop("dropped_too_many_points", f"{array.shape[0]} points do not fit the ring")
            return
        os.eventfd_write(self.efd, 1)

    def on_info(self, msg) -> None:  # noqa: ANN001 - CameraInfo (camera receivers)
        recv_ns = time.monotonic_ns()
        try:
            k = camera_info_to_k(msg)
        except ConversionError as exc:
            self.drop("dropped_bad_camera_info", str(exc))
            return
        if camera_info_is_distorted(msg):  # used, but counted and logged (not a drop)
            self.count("unrectified_camera_info", f"camera_info has distortion D = "
                       f"{list(msg.d)}: {DISTORTION_ADVICE}", period_s=10.0)
        self.ring.write_info(stamp_to_ns(msg.header.stamp), recv_ns, k, msg.width, msg.height)
        os.eventfd_write(self.efd, 1)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    ap = argparse.ArgumentParser(description="Kestrel perception input receiver (started by "
                                             "the perception node)")
    ap.add_argument("--shm", required=True)
    ap.add_argument("--layout", nargs=len(dataclasses.fields(RingLayout)), required=True,
                    metavar="N")
    ap.add_argument("--sensor", type=int, required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--event-fd", type=int, required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    ap.add_argument("--frame-id", default="")
    ap.add_argument("--info-topic", default="", help="a camera's CameraInfo topic (optional)")
    ap.add_argument("--cpu", type=int, default=-1, help="run on this CPU alone (the node's "
                    "receive.cpus): every thread so far (imports start some), and DDS's "
                    "threads, created later, inherit it")
    args = ap.parse_args(remove_ros_args(argv)[1:])
    if args.cpu >= 0:
        pin_threads(0, {args.cpu})
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop = SignalFlag()  # set by a signal handler: no lock (process_stop.SignalFlag)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if os.getppid() != args.parent_pid:  # the node is already gone: remove its segment
        unlink_segment(args.shm)
        return 0
    # every image / cloud is received into fresh buffers: keep their pages (kestrel_common.heap)
    tune_malloc()
    layout = RingLayout.from_args(args.layout)
    seg = ShmSegment(args.shm, layout.size, create=False)
    lock_fd = os.open(seg.path, os.O_RDWR | os.O_CLOEXEC)  # the rings' record locks
    ring = layout.rings(seg.buf, lock_fd)[args.sensor]
    receiver = Receiver(ring, layout, args.sensor, args.event_fd, args.frame_id)
    rclpy.init(args=argv, signal_handler_options=SignalHandlerOptions.NO)
    node = rclpy.create_node("perception_receiver")  # named by the node's -r __node:=...
    msg_type = PointCloud2 if receiver.is_cloud else Image
    # a callback of two arguments: rclpy passes the message info (its sequence number) too
    node.create_subscription(msg_type, args.topic, receiver, SENSOR_QOS)
    if args.info_topic and not receiver.is_cloud:
        node.create_subscription(CameraInfo, args.info_topic, receiver.on_info, SENSOR_QOS)
    ring.set_ready(os.getpid())
    os.eventfd_write(args.event_fd, 1)

    def watch_stdin() -> None:  # EOF: the node closed the pipe, or died
        try:
            sys.stdin.buffer.read()
        finally:
            stop.set()

    threading.Thread(target=watch_stdin, name="stdin-watch", daemon=True).start()
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    try:
        while not stop.is_set():
            executor.spin_once(timeout_sec=0.1)
    finally:
        try:  # whatever fails here, the context still shuts down: it removes the DDS files
            executor.shutdown(timeout_sec=1.0)
            node.destroy_node()
        finally:  # (uninstall_handlers=False: kestrel_common.process_stop, step 2)
            rclpy.try_shutdown(uninstall_handlers=False)
        if os.getppid() != args.parent_pid:  # the node died without its cleanup
            seg.unlink()
        del ring, receiver
        os.close(lock_fd)
        seg.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
