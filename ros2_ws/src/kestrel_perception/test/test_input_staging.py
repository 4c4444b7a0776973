"""Input staging (preallocated buffers, one copy per input, no host filtering of the cloud)
and the zero-copy PointCloud2 view: same results as the previous host-filtered path."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kestrel_common.conversions import make_header, pointcloud2_to_xyz, xyz_to_pointcloud2
from kestrel_perception.core import PerceptionCore
from kestrel_perception.core.cloud_view import xyz_view
from kestrel_perception.core.staging import InputStaging
from sensor_msgs.msg import PointField

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_perception_core import core_config, frames, wall_points  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def core() -> PerceptionCore:
    return PerceptionCore(core_config(num_threads=1, point_buckets=(512, 4096, 16384)))


def test_points_one_copy_into_the_reused_buffer() -> None:
    st = InputStaging(torch.device("cpu"), (64, 256))
    pts = np.arange(100 * 3, dtype=np.float32).reshape(100, 3)
    a = st.points(pts)
    assert a.points is not None and tuple(a.points.shape) == (256, 3)  # bucket of 100 rows
    np.testing.assert_array_equal(a.points[:100].numpy(), pts)
    assert np.isnan(a.points[100:].numpy()).all() and a.pad == 156
    assert (a.host_dropped, a.truncated, a.rows_in) == (None, 0, 100)
    # a strided float64 view (e.g. x, y, z of an [N,4] array) is converted in the same copy
    xyzi = np.random.default_rng(0).normal(size=(40, 4))
    b = st.points(xyzi[:, :3])
    assert tuple(b.points.shape) == (64, 3)
    np.testing.assert_array_equal(b.points[:40].numpy(), xyzi[:, :3].astype(np.float32))
    assert b.points.data_ptr() == a.points.data_ptr()  # same preallocated buffer, no new one


def test_points_beyond_the_largest_bucket_filtered_on_the_host() -> None:
    st = InputStaging(torch.device("cpu"), (64, 256))
    pts = np.ones((300, 3), np.float32)
    pts[::10] = np.nan  # 30 NaN rows, 270 finite > 256
    s = st.points(pts)
    assert (s.host_dropped, s.truncated, s.pad) == (30, 14, 0)
    assert tuple(s.points.shape) == (256, 3) and np.isfinite(s.points.numpy()).all()


def test_cameras_packed_once_with_inverses() -> None:
    st = InputStaging(torch.device("cpu"), (64,))
    T = np.stack([np.eye(4)] * 2)
    T[1, :3, 3] = (1.0, 2.0, 3.0)
    K = np.stack([np.array([[100.0, 0, 50], [0, 100, 40], [0, 0, 1]])] * 2)
    cams = st.cameras(T, K)
    np.testing.assert_allclose(cams["T_cam_from_base"][1].numpy() @ T[1], np.eye(4))
    np.testing.assert_allclose(cams["K_inv"][0].numpy() @ K[0], np.eye(3), atol=1e-12)
    assert cams["K"].dtype == torch.float64 and tuple(cams["T_base_from_cam"].shape) == (2, 4, 4)


def test_nan_rows_give_the_same_result_as_the_filtered_cloud(core: PerceptionCore) -> None:
    """NaN rows now go to the device (invalid there) instead of being filtered on the host:
    detections, positions and the counters are those of the finite cloud alone."""
    good = wall_points(3.0, step=0.05)
    mixed = np.insert(good, np.arange(0, len(good), 7), np.nan, axis=0)  # NaNs interleaved
    n_nan = len(mixed) - len(good)
    a = core.process(frames(points=good))
    b = core.process(frames(points=mixed))
    assert (b.dropped_points, b.used_points, b.truncated_points) == (n_nan, len(good), 0)
    assert (a.dropped_points, a.used_points) == (0, len(good))
    assert len(a.detections) == len(b.detections) > 0
    for x, y in zip(a.detections, b.detections, strict=True):
        assert (x.camera_index, x.class_index, int(x.position_source)) == \
            (y.camera_index, y.class_index, int(y.position_source))
        np.testing.assert_array_equal(x.box_xyxy, y.box_xyxy)
        np.testing.assert_allclose(x.position, y.position, atol=1e-9)


def test_cloud_view_is_zero_copy_and_equals_the_generic_conversion() -> None:
    pts = np.random.default_rng(1).normal(size=(50, 3)).astype(np.float32)
    msg = xyz_to_pointcloud2(pts, make_header(0, "world"))
    view = xyz_view(msg)
    assert view is not None and not view.flags.writeable
    np.testing.assert_array_equal(view, pointcloud2_to_xyz(msg))
    assert np.shares_memory(view, np.frombuffer(msg.data, np.uint8))  # no copy


def cloud(point_step: int, offsets=(0, 4, 8), datatype=PointField.FLOAT32, big=False):
    n = 20
    raw = np.random.default_rng(2).normal(size=(n, point_step // 4)).astype(np.float32)
    fields = [SimpleNamespace(name=a, offset=o, datatype=datatype, count=1)
              for a, o in zip("xyz", offsets, strict=True)]
    return SimpleNamespace(fields=fields, width=n, height=1, point_step=point_step,
                           row_step=n * point_step, is_bigendian=big,
                           data=np.frombuffer(raw.tobytes(), np.uint8)), raw


def test_cloud_view_strided_layout_and_refusals() -> None:
    msg, raw = cloud(16)  # x, y, z, intensity
    np.testing.assert_array_equal(xyz_view(msg), raw[:, :3])
    assert xyz_view(cloud(16, offsets=(4, 8, 12))[0]) is None  # not at 0/4/8
    assert xyz_view(cloud(16, datatype=PointField.FLOAT64)[0]) is None
    assert xyz_view(cloud(16, big=True)[0]) is None
    short, _ = cloud(16)
    short.data = short.data[:-4]  # inconsistent size: left to the generic converter's error
    assert xyz_view(short) is None


def test_prestaged_images_are_used_only_for_the_same_array() -> None:
    """prestage_image copies on arrival; images() skips exactly the arrays already in their
    slot (same object) and copies every other one, so a newer or different image is never
    replaced by a stale pre-staged one."""
    st = InputStaging(torch.device("cpu"), (64,))
    st.configure_images(2, (4, 6))
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(0, 256, (4, 6, 3), dtype=np.uint8) for _ in range(3))
    assert st.prestage_image(0, a) and st.prestage_image(1, b)
    out = st.images([a, c])  # camera 1's frame image is c, not the pre-staged b
    assert st.prestaged_used == 1
    np.testing.assert_array_equal(out[0].permute(1, 2, 0).numpy(), a)
    np.testing.assert_array_equal(out[1].permute(1, 2, 0).numpy(), c)
    out = st.images([a, c])  # consumed: the same arrays again are copied, not trusted
    assert st.prestaged_used == 1
    bgr = c[:, :, ::-1]  # a strided view is staged by value too
    assert st.prestage_image(1, bgr)
    np.testing.assert_array_equal(st.images([a, bgr])[1].permute(1, 2, 0).numpy(), bgr)
    assert st.prestaged_used == 2
    # what does not fit the configured buffer is not staged (the frame path decides)
    assert not st.prestage_image(2, a)
    assert not st.prestage_image(0, np.zeros((5, 6, 3), np.uint8))
    assert not st.prestage_image(0, a.astype(np.float32))


def test_prestaged_points_are_used_only_for_the_same_cloud() -> None:
    st = InputStaging(torch.device("cpu"), (64, 256))
    pts = np.arange(100 * 3, dtype=np.float32).reshape(100, 3)
    other = pts + 1000.0
    assert st.prestage_points(pts)
    a = st.points(pts)
    assert st.prestaged_used == 1 and a.pad == 156
    np.testing.assert_array_equal(a.points[:100].numpy(), pts)
    assert np.isnan(a.points[100:].numpy()).all()
    assert st.prestage_points(pts)
    b = st.points(other)  # a different cloud than the staged one: copied
    assert st.prestaged_used == 1
    np.testing.assert_array_equal(b.points[:100].numpy(), other)
    assert not st.prestage_points(np.ones((300, 3), np.float32))  # beyond the largest bucket
    assert not st.prestage_points(np.ones((0, 3), np.float32))


def test_core_results_equal_with_prestaged_inputs(core: PerceptionCore) -> None:
    """A frame whose inputs were pre-staged (as the node's callbacks do) gives the same
    output as the same frame copied at frame time."""
    fs = frames(points=wall_points(3.0, step=0.05))
    ref = core.process(fs)
    for i, img in enumerate(fs.images):
        assert core.staging.prestage_image(i, img)
    assert core.staging.prestage_points(fs.points)
    used = core.staging.prestaged_used
    out = core.process(fs)
    assert core.staging.prestaged_used == used + len(fs.images) + 1
    assert len(out.detections) == len(ref.detections) > 0
    for x, y in zip(out.detections, ref.detections, strict=True):
        np.testing.assert_array_equal(x.box_xyxy, y.box_xyxy)
        assert x.score == y.score
    for m, r in zip(out.masks, ref.masks, strict=True):
        np.testing.assert_array_equal(m, r)


def _shm_block(slots: int, nbytes: int):
    """A [slots, nbytes] uint8 block in a MAP_SHARED mapping, as the receivers' rings."""
    import mmap

    m = mmap.mmap(-1, slots * nbytes)
    return m, np.ndarray((slots, nbytes), np.uint8, buffer=m)


_UNDO: list = []  # pin_host_memory undos of the running test (run by the fixture below)


@pytest.fixture(autouse=True)
def _unpin_after_each_test():
    """Unregister what a test page-locked while its mapping is still alive: a mapping freed
    while registered leaves CUDA believing the range is registered, and the next test's
    mapping at the same address then fails cudaHostRegister (as the node undoes before it
    unmaps its rings)."""
    yield
    while _UNDO:
        _UNDO.pop()()


def _pinned_rows(st: InputStaging, count: int, nbytes: int) -> list[np.ndarray]:
    """`count` registered buffers of `nbytes`: rows of a shared-memory block given to
    pin_host_memory (page-locked on CUDA), as the node does with the receivers' rings."""
    _m, block = _shm_block(count, nbytes)  # (the rows keep the mapping alive)
    undo, how = st.pin_host_memory([block])
    assert "failed" not in how, how
    _UNDO.append(undo)  # the closure holds no block: the rows do, until the test ends
    return [block[i] for i in range(count)]


def _from_buffers(st: InputStaging, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """Each array copied into a registered host buffer (as the input receivers fill their
    slots) and returned as the same kind of view the receivers hand over."""
    out = []
    for a in arrays:
        buf = _pinned_rows(st, 1, a.nbytes + 64)[0]
        buf[:a.nbytes] = a.reshape(-1).view(np.uint8)
        out.append(buf[:a.nbytes].view(a.dtype).reshape(a.shape))
    return out


def test_registered_buffers_are_prestaged_into_the_device_slot() -> None:
    """Inputs that are views of registered buffers go straight to the device slot on pre-staging
    (on the CPU the device slot is the host slot); the frame then copies nothing for them and
    still copies every other array. A strided view of such a buffer takes the host path."""
    st = InputStaging(torch.device("cpu"), (64, 256))
    st.configure_images(2, (4, 6))
    rng = np.random.default_rng(1)
    a, b, c = (rng.integers(0, 256, (4, 6, 3), dtype=np.uint8) for _ in range(3))
    ra, rb = _from_buffers(st, [a, b])
    assert st._registered_source(ra) is not None
    assert st._registered_source(ra[:, :, ::-1]) is None  # not C-contiguous
    assert st._registered_source(a) is None  # not from a registered buffer
    assert st.prestage_image(0, ra) and st.prestage_image(1, rb)
    assert st._dev_staged[0] is ra and st._staged[0] is None  # not through the host slot
    out = st.images([ra, c])  # camera 1's frame image is c: copied
    assert st.prestaged_used == 1
    np.testing.assert_array_equal(out[0].permute(1, 2, 0).numpy(), a)
    np.testing.assert_array_equal(out[1].permute(1, 2, 0).numpy(), c)
    assert st._dev_staged == [None, None]  # consumed
    pts = np.arange(100 * 3, dtype=np.float32).reshape(100, 3)
    (rp,) = _from_buffers(st, [pts])
    assert st.prestage_points(rp) and st._dev_staged_pts is rp
    s = st.points(rp)
    assert st.prestaged_used == 2 and (s.rows_in, s.pad, s.host_dropped) == (100, 156, None)
    assert st.prestaged_direct == 2
    np.testing.assert_array_equal(s.points[:100].numpy(), pts)
    assert np.isnan(s.points[100:].numpy()).all()
    assert st.prestage_points(rp)
    other = st.points(pts + 1.0)  # a different cloud: the host path, same result layout
    np.testing.assert_array_equal(other.points[:100].numpy(), pts + 1.0)
    assert st.prestaged_used == 2


def test_core_results_equal_with_inputs_from_registered_buffers(core: PerceptionCore) -> None:
    """The node's `receive: processes` path: inputs in the staging's own host buffers,
    pre-staged as they arrive, give the same output as the frame copied at frame time."""
    fs = frames(points=wall_points(3.0, step=0.05))
    ref = core.process(fs)
    imgs = _from_buffers(core.staging, fs.images)
    (pts,) = _from_buffers(core.staging, [fs.points])
    for i, img in enumerate(imgs):
        assert core.staging.prestage_image(i, img)
    assert core.staging.prestage_points(pts)
    out = core.process(type(fs)(fs.stamp_ns, imgs, fs.cameras, pts))
    assert len(out.detections) == len(ref.detections) > 0
    for x, y in zip(out.detections, ref.detections, strict=True):
        np.testing.assert_array_equal(x.box_xyxy, y.box_xyxy)
    for m, r in zip(out.masks + out.depths, ref.masks + ref.depths, strict=True):
        np.testing.assert_array_equal(m, r)


@pytest.mark.gpu
def test_registered_buffers_on_cuda_skip_the_host_slot() -> None:
    """CUDA: pinned registered buffers are copied to the device on the copy stream, the host
    slot is never written, and the frame's stream waits for the copies."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (CI has none)")
    st = InputStaging(torch.device("cuda"), (64, 256))
    st.configure_images(2, (4, 6))
    st._img_np[...] = 7  # sentinel: must survive
    rng = np.random.default_rng(2)
    a, b = (rng.integers(0, 256, (4, 6, 3), dtype=np.uint8) for _ in range(2))
    ra, rb = _from_buffers(st, [a, b])
    assert st._registered_source(ra).is_pinned()
    assert st.prestage_image(0, ra) and st.prestage_image(1, rb)
    out = st.images([ra, rb]).permute(0, 2, 3, 1).cpu().numpy()
    np.testing.assert_array_equal(out, np.stack([a, b]))
    assert (st._img_np == 7).all() and st.prestaged_used == 2
    pts = rng.normal(size=(100, 3)).astype(np.float32)
    (rp,) = _from_buffers(st, [pts])
    assert st.prestage_points(rp)
    s = st.points(rp).points.cpu().numpy()
    np.testing.assert_array_equal(s[:100], pts)
    assert np.isnan(s[100:]).all()


@pytest.mark.gpu
def test_cuda_mixed_sources_and_reused_pool_buffers() -> None:
    """CUDA: in one frame camera 0 comes from a registered (pinned) buffer, straight to its
    device slot, and camera 1 through the host slot; then the same pool buffers are refilled
    and pre-staged again for the next frames (as the receivers reuse their pools)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (CI has none)")
    st = InputStaging(torch.device("cuda"), (64,))
    st.configure_images(2, (4, 6))
    pool = _pinned_rows(st, 2, 4 * 6 * 3)
    rng = np.random.default_rng(3)
    for k in range(6):
        a, b = (rng.integers(0, 256, (4, 6, 3), dtype=np.uint8) for _ in range(2))
        buf = pool[k % 2]
        buf[:] = a.reshape(-1)
        ra = buf.reshape(4, 6, 3)
        assert st.prestage_image(0, ra) and st._dev_staged[0] is ra
        out = st.images([ra, b]).permute(0, 2, 3, 1).cpu().numpy()
        np.testing.assert_array_equal(out, np.stack([a, b]))
    assert st.prestaged_direct == 6


def test_pinned_caller_memory_is_prestaged_directly_until_undone() -> None:
    """pin_host_memory: rows of the caller's blocks become registered buffers (the receivers'
    shared-memory slots); inputs that are views of them skip the host slot; after undo they
    take the host path again."""
    st = InputStaging(torch.device("cpu"), (64,))
    st.configure_images(1, (4, 6))
    _m, block = _shm_block(3, 4 * 6 * 3 + 64)
    undo, how = st.pin_host_memory([block])
    assert "3 input slots" in how and "registered" in how
    a = np.random.default_rng(4).integers(0, 256, (4, 6, 3), dtype=np.uint8)
    block[1, :a.nbytes] = a.reshape(-1)
    view = block[1, :a.nbytes].reshape(4, 6, 3)
    assert st.prestage_image(0, view) and st._dev_staged[0] is view
    np.testing.assert_array_equal(st.images([view])[0].permute(1, 2, 0).numpy(), a)
    assert st.prestaged_direct == 1
    undo()
    assert st._registered_source(view) is None
    assert st.prestage_image(0, view) and st._staged[0] is view  # the host slot path


@pytest.mark.gpu
def test_cuda_pinned_shared_memory_goes_straight_to_the_device() -> None:
    """CUDA: a MAP_SHARED block is page-locked with cudaHostRegister; its rows are copied to
    the device slot on the copy stream (the host slot untouched), rewritten and copied again
    for the next frames; undo unregisters it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (CI has none)")
    st = InputStaging(torch.device("cuda"), (64,))
    st.configure_images(1, (4, 6))
    st._img_np[...] = 7  # sentinel: must survive
    _m, block = _shm_block(4, 4 * 6 * 3)
    undo, how = st.pin_host_memory([block])
    assert "page-locked" in how, how
    rng = np.random.default_rng(5)
    for k in range(8):
        a = rng.integers(0, 256, (4, 6, 3), dtype=np.uint8)
        block[k % 4] = a.reshape(-1)
        view = block[k % 4].reshape(4, 6, 3)
        assert st._registered_source(view).is_pinned()
        assert st.prestage_image(0, view)
        out = st.images([view]).permute(0, 2, 3, 1).cpu().numpy()
        np.testing.assert_array_equal(out[0], a)
    assert st.prestaged_direct == 8 and (st._img_np == 7).all()
    undo()
    assert st._registered_source(view) is None


@pytest.mark.gpu
def test_cuda_failed_registration_falls_back_and_leaves_no_cuda_error() -> None:
    """CUDA: page-locking a range that is already registered fails; pin_host_memory reports it
    (inputs then take the host slot) and clears CUDA's last error, so the next torch CUDA
    call does not raise it (it did: cudaErrorHostMemoryAlreadyRegistered surfaced in an
    unrelated .to('cuda'))."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (CI has none)")
    st = InputStaging(torch.device("cuda"), (64,))
    st.configure_images(1, (4, 6))
    _m, block = _shm_block(2, 4 * 6 * 3)
    undo, how = st.pin_host_memory([block])
    assert "page-locked" in how, how
    try:
        again, how2 = InputStaging(torch.device("cuda"), (64,)).pin_host_memory([block])
        assert "failed" in how2 and "host copy" in how2, how2
        again()  # a no-op: nothing was registered
        x = torch.arange(4, device="cuda") * 2  # would raise the left-over error
        torch.cuda.synchronize()
        assert x.tolist() == [0, 2, 4, 6]
        assert st._registered_source(block[0].reshape(4, 6, 3)) is not None  # still pinned
    finally:
        undo()


def test_clear_cuda_error_uses_torchs_own_runtime(monkeypatch) -> None:
    """clear_cuda_error looks cudaGetLastError up through torch's libtorch_cuda (RTLD_NOLOAD:
    the copy torch loaded; dlsym then searches its dependencies, i.e. torch's libcudart), and
    falls back to a tiny CUDA op (whose launch check takes the error) when that fails. Faked
    here: CI has no CUDA."""
    import os

    from kestrel_perception.core import staging

    calls: list = []
    monkeypatch.setattr(staging.torch.cuda, "cudart", lambda: SimpleNamespace())
    monkeypatch.setattr(staging.ctypes, "CDLL", lambda path, mode: (
        calls.append((os.path.basename(path), mode))
        or SimpleNamespace(cudaGetLastError=lambda: calls.append("cleared"))))
    staging.clear_cuda_error()
    assert calls == [("libtorch_cuda.so", os.RTLD_NOLOAD | os.RTLD_LAZY), "cleared"]

    def not_loaded(path, mode):
        raise OSError("not loaded")

    monkeypatch.setattr(staging.ctypes, "CDLL", not_loaded)
    ops: list = []
    monkeypatch.setattr(staging.torch, "zeros", lambda *a, **k: SimpleNamespace(
        add_=lambda v: ops.append(k.get("device"))))
    staging.clear_cuda_error()
    assert ops == ["cuda"]
