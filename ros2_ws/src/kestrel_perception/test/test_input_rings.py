"""Shared-memory input rings (receive: processes) and the node-side hand-over, without ROS:
round trips, size limits, overwritten counts, pool reuse, and no torn read with a writer in
another process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from kestrel_common.shm import ShmSegment

from kestrel_perception.core.input_rings import RingLayout
from kestrel_perception.core.receivers import InputReceivers

LAYOUT = RingLayout(num_cameras=2, image_height=6, image_width=8, max_points=50)


@pytest.fixture
def segment():
    seg = ShmSegment(f"kestrel_perception_test_{os.getpid()}", LAYOUT.size, create=True)
    try:
        yield seg
    finally:
        seg.unlink()


def test_image_and_cloud_round_trip_and_limits(segment) -> None:
    rings = LAYOUT.rings(segment.buf)
    assert len(rings) == 3 and rings[0].slot_bytes == 6 * 8 * 3 and rings[2].slot_bytes == 600
    out = np.zeros(rings[0].slot_bytes, np.uint8)
    assert rings[0].read_into(out) is None  # nothing yet
    bgr = np.arange(6 * 8 * 3, dtype=np.uint8).reshape(6, 8, 3)
    rgb_view = bgr[:, :, ::-1]  # strided, as image_to_numpy gives for bgr8
    assert rings[0].write(rgb_view, 123, 456, "rgb8", "cam0_optical")
    item = rings[0].read_into(out)
    assert (item.stamp_ns, item.recv_ns, item.rows, item.cols, item.encoding, item.version,
            item.frame_id) == (123, 456, 6, 8, "rgb8", 1, "cam0_optical")
    np.testing.assert_array_equal(out[:item.nbytes].reshape(6, 8, 3), rgb_view)
    small = np.full((3, 4, 3), 7, np.uint8)  # a smaller image fits (the core then rejects it)
    assert rings[0].write(small, 124, 457, "rgb8", "x")
    item = rings[0].read_into(out)
    assert (item.rows, item.cols, item.version, item.frame_id) == (3, 4, 2, "x")
    assert not rings[0].write(np.zeros((7, 8, 3), np.uint8), 1, 1, "rgb8", "")  # too large
    assert rings[0].version == 2
    xyz = np.random.default_rng(0).normal(size=(50, 3)).astype(np.float32)
    cloud_out = np.zeros(rings[2].slot_bytes, np.uint8)
    assert rings[2].write(xyz[:, :3], 9, 10, "xyz32", "world")
    item = rings[2].read_into(cloud_out)
    assert (item.rows, item.cols, item.encoding) == (50, 0, "xyz32")
    np.testing.assert_array_equal(cloud_out[:item.nbytes].view(np.float32).reshape(50, 3), xyz)
    assert not rings[2].write(np.zeros((51, 3), np.float32), 1, 1, "xyz32", "")
    rings[1].count("dropped_bad_encoding", 2)
    assert rings[1].counters()["dropped_bad_encoding"] == 2
    assert rings[0].counters()["dropped_bad_encoding"] == 0


def test_receivers_hand_over_newest_count_overwritten_and_rotate_the_pool(segment) -> None:
    """InputReceivers.poll() on rings written in this process (no child processes)."""
    got: list = []
    rx = InputReceivers(LAYOUT, ["/a", "/b", "/c"],
                        lambda cam, st, rs, rgb, fid: got.append(("img", cam, st, rs, rgb, fid)),
                        lambda st, rs, xyz: got.append(("pts", st, rs, xyz)),
                        frame_id="world", node_name="t", pool=3)
    rx.rings = LAYOUT.rings(segment.buf)
    img = np.zeros((6, 8, 3), np.uint8)
    for k in range(1, 4):  # three images of camera 1 before the node looks: the newest wins
        img[...] = k
        rx.rings[1].write(img, k, k * 1_000_000_000, "rgb8", "cam1")
    rx.rings[2].write(np.ones((5, 3), np.float32), 7, 2_000_000_000, "xyz32", "world")
    assert rx.poll() == 2 and rx.poll() == 0
    (kind, cam, stamp, recv_s, rgb, fid), pts = got
    assert (kind, cam, stamp, recv_s, fid) == ("img", 1, 3, 3.0, "cam1")
    assert rgb.shape == (6, 8, 3) and (rgb == 3).all()
    assert pts[0] == "pts" and pts[3].shape == (5, 3) and (pts[3] == 1).all()
    assert rx.counters()["rx_overwritten"] == 2
    arrays = []
    for k in range(4, 8):  # one at a time: pool buffers rotate (3), never the same twice
        img[...] = k
        rx.rings[1].write(img, k, 0, "rgb8", "cam1")
        rx.poll()
        arrays.append(got[-1][4])
    assert [int(a[0, 0, 0]) for a in arrays] == [7, 5, 6, 7]  # the 4th reused the 1st's buffer
    assert arrays[0].base is arrays[3].base and arrays[1].base is not arrays[0].base
    assert rx.counters()["rx_overwritten"] == 2 and rx.counters()["rx_handler_errors"] == 0

    def boom(*_):
        raise RuntimeError("handler failed")

    rx.on_image = boom
    rx.rings[0].write(img, 1, 0, "rgb8", "cam0")
    assert rx.poll() == 1 and rx.counters()["rx_handler_errors"] == 1
    rx.rings = []


WRITER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from kestrel_common.shm import ShmSegment
    from kestrel_perception.core.input_rings import RingLayout
    layout = RingLayout(*(int(v) for v in sys.argv[2:6]))
    seg = ShmSegment(sys.argv[1], layout.size, create=False)
    ring = layout.rings(seg.buf)[0]
    img = np.zeros((layout.image_height, layout.image_width, 3), np.uint8)
    k = 0
    end = time.monotonic() + float(sys.argv[6])
    while time.monotonic() < end:
        k += 1
        img[...] = k % 251
        ring.write(img, k, k, "rgb8", f"f{k}")
    print(k, flush=True)
""")


def test_no_torn_read_with_a_writer_process() -> None:
    """A writer process publishes images filled with k % 251 (stamp k, frame 'f<k>') as fast
    as it can; every copy this process keeps is one complete message."""
    layout = RingLayout(num_cameras=1, image_height=64, image_width=64, max_points=1)
    seg = ShmSegment(f"kestrel_perception_torn_{os.getpid()}", layout.size, create=True)
    ring = layout.rings(seg.buf)[0]
    writer = subprocess.Popen([sys.executable, "-c", WRITER, seg.name, *layout.to_args(), "1.0"],
                              stdout=subprocess.PIPE, text=True)
    out = np.zeros(ring.slot_bytes, np.uint8)
    reads, last = 0, 0
    try:
        deadline = time.monotonic() + 10.0
        while writer.poll() is None and time.monotonic() < deadline:
            item = ring.read_into(out)
            if item is None:
                continue
            data = out[:item.nbytes]
            assert (data == item.stamp_ns % 251).all(), item  # one message, not two halves
            assert item.frame_id == f"f{item.stamp_ns}" and item.version == item.stamp_ns
            assert item.version >= last
            last = item.version
            reads += 1
        written = int(writer.communicate(timeout=10.0)[0])
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait(5)
        seg.unlink()
    assert written > 1000 and reads > 100, (written, reads)


def test_receive_auto_picks_processes_only_with_cuda_and_enough_cpus() -> None:
    """receive 'auto': receiver processes where they were measured faster (CUDA device, many
    cores), the executor on small or CPU-only machines (where they were slower)."""
    from kestrel_perception.core.params import resolve_receive

    assert resolve_receive("auto", "cuda", 6, cpus=16) == "processes"
    assert resolve_receive("auto", "cuda", 6, cpus=13) == "executor"  # < 2 per receiver
    assert resolve_receive("auto", "cpu", 6, cpus=64) == "executor"
    assert resolve_receive("auto", "cuda", 1, cpus=4) == "processes"
    for explicit in ("executor", "processes"):
        assert resolve_receive(explicit, "cpu", 6, cpus=2) == explicit
