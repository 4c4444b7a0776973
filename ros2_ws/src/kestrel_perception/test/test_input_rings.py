"""Shared-memory input rings (receive: processes) and the node-side hand-over, without ROS:
round trips, size limits, overwritten counts, slot ownership (held slots are never written),
and held data that stays intact while a writer process publishes as fast as it can."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from kestrel_common.shm import ShmSegment

from kestrel_perception.core.input_rings import FREE, HELD, PUBLISHED, RingLayout
from kestrel_perception.core.receivers import InputReceivers

LAYOUT = RingLayout(num_cameras=2, image_height=6, image_width=8, max_points=50, slots=5)


@pytest.fixture
def rings():
    seg = ShmSegment(f"kestrel_perception_test_{os.getpid()}", LAYOUT.size, create=True)
    fd = os.open(seg.path, os.O_RDWR)
    try:
        yield LAYOUT.rings(seg.buf, fd)
    finally:
        os.close(fd)
        seg.unlink()


def test_image_and_cloud_round_trip_and_limits(rings) -> None:
    assert len(rings) == 3 and rings[0].slot_bytes == 6 * 8 * 3 and rings[2].slot_bytes == 600
    assert rings[0].claim() is None  # nothing yet
    bgr = np.arange(6 * 8 * 3, dtype=np.uint8).reshape(6, 8, 3)
    rgb_view = bgr[:, :, ::-1]  # strided, as image_to_numpy gives for bgr8
    assert rings[0].write(rgb_view, 123, 456, "rgb8", "cam0_optical")
    item = rings[0].claim()
    assert (item.stamp_ns, item.recv_ns, item.rows, item.cols, item.encoding, item.version,
            item.frame_id) == (123, 456, 6, 8, "rgb8", 1, "cam0_optical")
    view = rings[0].view(item)  # the slot itself, no copy
    np.testing.assert_array_equal(view, rgb_view)
    assert view.base is not None and rings[0].claim() is None  # claimed once
    small = np.full((3, 4, 3), 7, np.uint8)  # a smaller image fits (the core then rejects it)
    assert rings[0].write(small, 124, 457, "rgb8", "x")
    item2 = rings[0].claim()
    assert (item2.rows, item2.cols, item2.version, item2.frame_id) == (3, 4, 2, "x")
    assert item2.slot != item.slot and (rings[0].view(item2) == 7).all()
    assert not rings[0].write(np.zeros((7, 8, 3), np.uint8), 1, 1, "rgb8", "")  # too large
    assert rings[0].version == 2
    xyz = np.random.default_rng(0).normal(size=(50, 3)).astype(np.float32)
    assert rings[2].write(xyz[:, :3], 9, 10, "xyz32", "world")
    item = rings[2].claim()
    assert (item.rows, item.cols, item.encoding) == (50, 0, "xyz32")
    np.testing.assert_array_equal(rings[2].view(item), xyz)
    assert not rings[2].write(np.zeros((51, 3), np.float32), 1, 1, "xyz32", "")
    rings[1].count("dropped_bad_encoding", 2)
    assert rings[1].counters()["dropped_bad_encoding"] == 2
    assert rings[0].counters()["dropped_bad_encoding"] == 0


def test_camera_info_record_newest_wins(rings) -> None:
    assert rings[0].read_info() is None and rings[0].info_version == 0
    k = np.array([[500.0, 0, 320], [0, 510.0, 240], [0, 0, 1]])
    rings[0].write_info(5, 6, k, 640, 480)
    rings[0].write_info(7, 8, 2 * k, 1280, 960)  # before the node read: replaces it
    info = rings[0].read_info()
    assert (info.version, info.stamp_ns, info.recv_ns, info.width, info.height) == \
        (2, 7, 8, 1280, 960)
    np.testing.assert_array_equal(info.k, 2 * k)
    assert rings[1].read_info() is None  # per camera


def test_writer_never_writes_a_held_slot(rings) -> None:
    """slots = held + 2: with 3 slots held and one published, every write finds the last
    FREE one; an unclaimed message is replaced (its slot freed), never a held one."""
    ring, img = rings[0], np.zeros((6, 8, 3), np.uint8)
    held = []
    for k in range(3):
        img[...] = k
        ring.write(img, k, 0, "rgb8", "")
        held.append(ring.claim())
    for k in range(10, 30):  # the node is busy: 20 messages, none claimed
        img[...] = k
        assert ring.write(img, k, 0, "rgb8", "")
        assert sorted(ring.state.tolist()).count(HELD) == 3
        assert sorted(ring.state.tolist()).count(PUBLISHED) == 1
    for k, it in enumerate(held):  # intact
        assert (ring.view(it) == k).all() and ring.state[it.slot] == HELD
    newest = ring.claim(release=held[0].slot)  # the newest; the oldest held goes back
    assert newest.stamp_ns == 29 and (ring.view(newest) == 29).all()
    assert ring.state[held[0].slot] == FREE and newest.version == 23


def test_receivers_hand_over_newest_count_overwritten_and_rotate_slots(rings) -> None:
    """InputReceivers.poll() on rings written in this process (no child processes)."""
    got: list = []
    rx = InputReceivers(LAYOUT, ["/a", "/b", "/c"],
                        lambda cam, st, rs, rgb, fid, t: got.append(("img", cam, st, rs, rgb, fid)),
                        lambda st, rs, xyz, t: got.append(("pts", st, rs, xyz)),
                        frame_id="world", node_name="t", pool=3, info_topics=["/ia", "/ib"],
                        on_info=lambda cam, st, rs, k, w, h: got.append(("info", cam, st, w)))
    rx.rings = rings
    img = np.zeros((6, 8, 3), np.uint8)
    rings[1].write_info(3, 0, np.eye(3), 8, 6)  # camera 1's info: handed over before its image
    rings[1].write(img, 3, 0, "rgb8", "cam1")
    assert rx.poll() == 2 and [g[0] for g in got] == ["info", "img"]
    assert got[0] == ("info", 1, 3, 8) and rx.poll() == 0
    got.clear()
    for k in range(1, 4):  # three images of camera 1 before the node looks: the newest wins
        img[...] = k
        rx.rings[1].write(img, k, k * 1_000_000_000, "rgb8", "cam1")
    rx.rings[2].write(np.ones((5, 3), np.float32), 7, 2_000_000_000, "xyz32", "world")
    assert rx.poll() == 2 and rx.poll() == 0
    (kind, cam, stamp, recv_s, rgb, fid), pts = got
    assert (kind, cam, stamp, recv_s, fid) == ("img", 1, 3, 3.0, "cam1")
    assert rgb.shape == (6, 8, 3) and (rgb == 3).all()
    assert pts[0] == "pts" and pts[3].shape == (5, 3) and (pts[3] == 1).all()
    assert rx.counters()["rx_overwritten"] == 2  # k = 1, 2 replaced before the poll
    arrays = [rgb]
    for k in range(4, 12):  # one at a time: the node holds its 3 newest, each intact
        img[...] = k
        rx.rings[1].write(img, k, 0, "rgb8", "cam1")
        rx.poll()
        arrays.append(got[-1][4])
        n = min(3, len(arrays))
        assert [int(a[0, 0, 0]) for a in arrays[-n:]] == list(range(k - n + 1, k + 1))
        assert (rings[1].state == HELD).sum() == min(3, len(arrays) + 1)  # + the first one
    assert rx.counters()["rx_overwritten"] == 2 and rx.counters()["rx_handler_errors"] == 0
    t = rx.timings(0.0)  # the last hand-over's parts (s)
    assert set(t) == {"rx_handoff", "rx_write", "rx_read", "rx_handler"}
    assert t["rx_handoff"] == rx.handing_over_since and 0.0 <= t["rx_read"] < 1.0
    assert 0.0 <= t["rx_handler"] < 1.0

    def boom(*_):
        raise RuntimeError("handler failed")

    rx.on_image = boom
    rx.rings[0].write(img, 1, 0, "rgb8", "cam0")
    assert rx.poll() == 1 and rx.counters()["rx_handler_errors"] == 1
    rx.rings = []


def test_a_message_kept_past_its_slot_is_not_intact(rings) -> None:
    """The reader gives a slot back after `pool` newer claims, whether the node kept those
    messages or not (e.g. while inactive). A message the node kept longer may then be
    overwritten: its ticket is no longer intact, so the node drops that frame (counted)."""
    tickets: list = []
    rx = InputReceivers(LAYOUT, ["/a", "/b", "/c"],
                        lambda cam, st, rs, rgb, fid, t: tickets.append((t, rgb)),
                        lambda *a: None, frame_id="world", node_name="t", pool=3)
    rx.rings = rings
    img = np.zeros((6, 8, 3), np.uint8)
    img[...] = 1
    rings[0].write(img, 1, 0, "rgb8", "")
    rx.poll()
    kept, view = tickets[0]  # the node keeps this one (its synchroniser)
    assert rx.intact([kept]) and rx.intact([None])
    for k in range(2, 6):  # 4 newer claims: the kept one's slot goes back after the 3rd
        img[...] = k
        rings[0].write(img, k, 0, "rgb8", "")
        rx.poll()
        if k == 4:
            assert not rx.intact([kept])  # given back (FREE): not trusted any more
    assert not rx.intact([kept]) and rx.intact([t for t, _ in tickets[-3:]])
    rx.rings = []


WRITER = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from kestrel_common.shm import ShmSegment
    from kestrel_perception.core.input_rings import RingLayout
    layout = RingLayout(*(int(v) for v in sys.argv[2:7]))
    seg = ShmSegment(sys.argv[1], layout.size, create=False)
    ring = layout.rings(seg.buf, os.open(seg.path, os.O_RDWR))[0]
    img = np.zeros((layout.image_height, layout.image_width, 3), np.uint8)
    print("ready", flush=True)  # imports done: the timed part starts
    k = 0
    end = time.monotonic() + float(sys.argv[7])
    while time.monotonic() < end:
        k += 1
        img[...] = k % 251
        ring.write(img, k, k, "rgb8", f"f{k}")
    print(k, flush=True)
""")


@pytest.mark.slow
def test_held_slots_stay_intact_with_a_writer_process() -> None:
    """A writer process publishes images filled with k % 251 (stamp k, frame 'f<k>') as fast
    as it can; this process claims messages and holds the last 3 (as the node's receiver
    thread does), checking every held message, again and again, while the writer goes on:
    none is ever changed under it (the writer only writes FREE slots)."""
    layout = RingLayout(num_cameras=1, image_height=64, image_width=64, max_points=1, slots=5)
    seg = ShmSegment(f"kestrel_perception_held_{os.getpid()}", layout.size, create=True)
    fd = os.open(seg.path, os.O_RDWR)
    ring = layout.rings(seg.buf, fd)[0]
    writer = subprocess.Popen([sys.executable, "-c", WRITER, seg.name, *layout.to_args(), "2.0"],
                              stdout=subprocess.PIPE, text=True)
    held: list = []
    claims, last = 0, 0
    try:
        # the writer's imports take long on a loaded machine: the reading starts once it is
        # ready (bounded)
        ready, _, _ = select.select([writer.stdout], [], [], 120.0)
        assert ready and writer.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10.0
        while writer.poll() is None and time.monotonic() < deadline:
            item = ring.claim(held.pop(0).slot if len(held) >= 3 else -1)
            if item is not None:
                assert item.frame_id == f"f{item.stamp_ns}" and item.version == item.stamp_ns
                assert item.version > last
                last = item.version
                held.append(item)
                claims += 1
            for it in held:  # one message each, unchanged since it was claimed
                assert (ring.view(it) == it.stamp_ns % 251).all(), it
        written = int(writer.communicate(timeout=30.0)[0])
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait(5)
        os.close(fd)
        seg.unlink()
    assert written > 1000 and claims > 50, (written, claims)


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


def test_close_kills_a_receiver_that_does_not_exit_and_says_so(caplog) -> None:  # noqa: ANN001
    """A receiver that outlives its stdin closing is killed after the timeout, and the node's
    log names it (a killed receiver leaves its DDS participant's files behind)."""
    import subprocess
    import sys
    rx = InputReceivers(LAYOUT, ["/a", "/b", "/c"], lambda *a: None, lambda *a: None,
                        frame_id="world", node_name="t", pool=3)
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             stdin=subprocess.PIPE)
    rx.procs.append(stuck)
    with caplog.at_level("WARNING"):
        rx.close(timeout_s=0.5)
    assert stuck.poll() is not None
    assert f"input receiver for /a (pid {stuck.pid}) did not exit" in caplog.text
