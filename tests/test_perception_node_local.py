"""perception node in this process (no executor, no other process): runtime options reaching
the core, input prestaging, set completion by a late cloud, reactivation and clock jumps, all
driven by calling the node's input callbacks directly. Marked dds with the node's tests over
DDS: each takes a ROS domain of its own (the `ros_domain` fixture)."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest
from kestrel_common.conversions import make_camera_info, make_header
from sensor_msgs.msg import Image

pytestmark = pytest.mark.dds

W, H = 128, 96  # px
K = np.array([[100.0, 0.0, 64.0], [0.0, 100.0, 48.0], [0.0, 0.0, 1.0]])
# the camera looks along world +x from (0, 0, 1): optical x = -world y, optical y = -world z,
# optical z = world x  ->  quaternion (x, y, z, w) = (-.5, .5, -.5, .5)
POSE = [0.0, 0.0, 1.0, -0.5, 0.5, -0.5, 0.5]
WALL_X = 2.0  # m: a wall of LiDAR points at world x = 2 fills the view


def wall_points() -> np.ndarray:
    ys, zs = np.meshgrid(np.arange(-1.5, 1.5, 0.04), np.arange(-0.1, 2.1, 0.04))
    return np.stack([np.full(ys.size, WALL_X), ys.ravel(), zs.ravel()], 1).astype(np.float32)


@contextlib.contextmanager
def local_node(ros_domain: int, **extra):
    """A configured PerceptionNode in this process (no executor: no timers run); 1 camera,
    the smallest model. Cleaned up afterwards."""
    import rclpy
    from rclpy.parameter import Parameter

    from kestrel_perception.perception_node import PerceptionNode

    ctx = rclpy.Context()
    rclpy.init(context=ctx, domain_id=ros_domain)
    params = {"num_cameras": 1, "model.base_width": 8, "model.fpn_channels": 32,
              "runtime.torch_threads": 1, "warmup_size": [W, H], "autostart": False,
              "gc_freeze": False, **extra}
    node = PerceptionNode(context=ctx, parameter_overrides=[
        Parameter(k, value=v) for k, v in params.items()])
    try:
        node.trigger_configure()
        yield node
    finally:
        node._active = False
        node.trigger_cleanup()
        node.destroy_node()
        rclpy.try_shutdown(context=ctx)


def test_runtime_options_reach_the_core(ros_domain):
    """runtime.* (dotted names): 'auto' on the CPU is the plain fp32 model; explicit options
    prepare a runtime with exactly those (bf16 autocast, exact rewrites, no compile)."""
    from rclpy.parameter import Parameter

    with local_node(ros_domain) as node:
        assert node.core is not None and node.core.runtime is None
        assert node.core.config.options.describe() == \
            "torch fp32, compile off, cuda_graph off, optimize off"
        # a dotted run-time parameter set while configured reaches the core
        assert node.set_parameters([Parameter("detection.score_threshold", value=0.9)]
                                   )[0].successful
        node._refresh_runtime()
        assert node.core.config.model.score_threshold == 0.9
    with local_node(ros_domain, **{"runtime.precision": "bf16", "runtime.optimize": True,
                                   "runtime.compile": "off"}) as node:
        assert node.core is not None and node.core.runtime is not None
        spec = node.core.runtime.spec
        assert (spec.precision, spec.fold_bn, spec.whole_compile, spec.cuda_graph) == \
            ("bf16", True, None, False)


def test_prestaging_never_overlaps_a_frame(ros_domain):
    """Callback processing: an input arriving from another thread (the receiver thread of
    receive 'processes') waits for the frame being processed before it writes the staging
    buffers that frame reads. The node in this process; the test holds the processing lock as
    a running frame would."""
    import threading

    with local_node(ros_domain) as node:
        node._active = True  # as activation would, without its timers (no executor here)
        staging = node.core.staging
        rgb = np.full((H, W, 3), 7, np.uint8)
        node._proc_lock.acquire()  # a frame is being processed
        t = threading.Thread(target=node._take_image,
                             args=(0, 1, time.monotonic(), rgb, "cam0"), daemon=True)
        try:
            t.start()
            t.join(0.5)  # bounded: it must still be waiting
            assert t.is_alive() and staging._staged[0] is not rgb
        finally:
            node._proc_lock.release()
        t.join(10.0)
        assert not t.is_alive() and staging._staged[0] is rgb  # staged once the frame ended
        np.testing.assert_array_equal(staging._img_np[0], rgb)


def test_a_cloud_that_completes_its_set_processes_it(ros_domain):
    """cloud_required: images + camera_info of a stamp wait for their cloud (the LiDAR is
    live); the cloud's own arrival processes the set at once (callback processing), not the
    release timer or the next image. The node in this process, no executor (no timers run)."""
    with local_node(ros_domain, camera_poses=POSE, **{"sync.slop": 0.01}) as node:
        node._active = True  # as activation would, without its timers (no executor here)
        t0 = 1_000_000_000
        pts = wall_points()
        node._take_points(t0, time.monotonic(), pts)  # the LiDAR is live from now on
        t1 = t0 + 100_000_000
        node._on_info(0, make_camera_info(K, W, H, make_header(t1, "cam0_optical")))
        node._take_image(0, t1, time.monotonic(), np.zeros((H, W, 3), np.uint8),
                         "cam0_optical")
        assert node.counters.get("processed") == 0  # waits for the cloud of t1
        node._take_points(t1, time.monotonic(), pts)
        assert node.counters.get("processed") == 1  # processed by the cloud's arrival
        assert node.counters.get("missing_cloud") == 0


def test_reactivation_forgets_old_inputs_and_reused_slots_are_not_published(ros_domain):
    """A set waiting for its cloud when the node is deactivated is gone after activation
    (with receive 'processes' its slots were reused meanwhile); and a frame whose input slots
    were reused while it was processed (InputReceivers.intact is False) is dropped, counted,
    not published. The node in this process, no executor."""
    from types import SimpleNamespace

    img = np.zeros((H, W, 3), np.uint8)
    with local_node(ros_domain, camera_poses=POSE, **{"sync.slop": 0.01}) as node:
        node.trigger_activate()
        t0, t1, t2 = 1_000_000_000, 1_100_000_000, 1_200_000_000
        pts = wall_points()
        node._take_points(t0, time.monotonic(), pts)  # the LiDAR is live from now on
        node._on_info(0, make_camera_info(K, W, H, make_header(t1, "cam0_optical")))
        node._take_image(0, t1, time.monotonic(), img, "cam0_optical")
        assert node.counters.get("processed") == 0  # waits for the cloud of t1
        node.trigger_deactivate()
        node.trigger_activate()
        node._take_points(t1, time.monotonic(), pts)  # its set was forgotten
        assert node.counters.get("processed") == 0
        node._receivers = SimpleNamespace(intact=lambda tickets: False, thread=None)
        try:
            node._on_info(0, make_camera_info(K, W, H, make_header(t2, "cam0_optical")))
            node._take_image(0, t2, time.monotonic(), img, "cam0_optical", (0, 3, 7))
            node._take_points(t2, time.monotonic(), pts, (1, 2, 5))
        finally:
            node._receivers = None  # (a stub: cleanup would close it)
        assert node.counters.get("dropped_input_overwritten") == 1
        assert node.counters.get("processed") == 0


def test_time_jumping_back_restarts_sync_and_gaps_count_lost_images(ros_domain):
    """Stamps that jump back (a bag played with --loop) do not stop the node: the set after
    the jump is processed and the jump counted; images missing from an evenly stamped stream
    are counted lost (lost_camera_0). The node in this process, no executor."""
    img = np.zeros((H, W, 3), np.uint8)
    with local_node(ros_domain, camera_poses=POSE,
                    **{"sync.slop": 0.01, "sync.cloud_required": False}) as node:
        node.trigger_activate()

        def frame(t_ns: int) -> None:
            node._on_info(0, make_camera_info(K, W, H, make_header(t_ns, "cam0_optical")))
            node._take_image(0, t_ns, time.monotonic(), img, "cam0_optical")

        t0, period = 20_000_000_000, 100_000_000
        for i in (0, 1, 2, 3, 4, 5, 8):  # 6 and 7 never arrive
            frame(t0 + i * period)
        assert node.counters.get("processed") == 7
        assert node.counters.get("lost_camera_0") == 2
        bad = Image(encoding="mono16", width=W, height=H, step=2 * W, data=bytes(2 * W * H))
        bad.header = make_header(t0 + 9 * period, "cam0_optical")
        node._on_image(0, bad)  # dropped as bad, counted as that: not also "lost"
        frame(t0 + 10 * period)
        assert node.counters.get("dropped_bad_encoding") == 1
        assert node.counters.get("lost_camera_0") == 2 and node.counters.get("processed") == 8
        frame(t0 - 10_000_000_000)  # the bag starts over, 10 s earlier
        assert node.counters.get("processed") == 9
        assert node.counters.get("time_jumps_back") == 1
        assert node.counters.get("lost_camera_0") == 2  # a jump is not a loss
