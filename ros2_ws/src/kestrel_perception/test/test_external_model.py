"""PerceptionCore with a user's own model (model_path + output contract): its decoded boxes go
through the same threshold, class-wise NMS and LiDAR / depth fusion as the reference model's,
and contract errors fail at construction (= the node's configure) naming the parameter."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kestrel_models.perception import PerceptionConfig, PositionSource
from kestrel_perception.core import CameraModel, FrameSet, PerceptionCore, PerceptionCoreConfig
from torch import nn

torch.set_num_threads(1)
H, W = 96, 128
K = np.array([[100.0, 0.0, 64.0], [0.0, 100.0, 48.0], [0.0, 0.0, 1.0]])
NAMES = ("background", "cube", "cup", "table")
ROLES = ("boxes:output0", "scores:output1", "labels:output2", "seg:output3", "depth:output4")


class UserModel(nn.Module):
    """Two overlapping 'cube' boxes (0.9, 0.8), one 'cup' box (0.7); depth 2 m; seg = table.
    Every tensor is made on the input's device (a model that hard-codes a device in its
    forward and is traced there keeps that device: a file traced on the CPU that way fails
    configure on CUDA, named by `check()`)."""

    def forward(self, images: torch.Tensor):
        b, h, w, dev = images.shape[0], images.shape[2], images.shape[3], images.device
        z = images.float().mean() * 0
        boxes = torch.tensor([[10.0, 10.0, 50.0, 50.0], [12.0, 12.0, 52.0, 52.0],
                              [80.0, 20.0, 110.0, 60.0]], device=dev)
        seg = torch.zeros((b, 4, h // 2, w // 2), device=dev) + z
        seg[:, 3] = 1.0
        return (boxes.expand(b, 3, 4) + z,
                torch.tensor([0.9, 0.8, 0.7], device=dev).expand(b, 3) + z,
                torch.tensor([1, 1, 2], device=dev).expand(b, 3), seg,
                torch.full((b, 1, h, w), 2.0, device=dev) + z)


def extrinsic() -> np.ndarray:
    T = np.eye(4)  # camera at base (0, 0, 1) looking along base +x
    T[:3, :3] = np.array([[0.0, 0, 1], [-1, 0, 0], [0, -1, 0]])
    T[:3, 3] = (0.0, 0.0, 1.0)
    return T


FORMATS = ("torchscript", "exported_program", "onnx")


def save_user_model(path_stem, fmt: str) -> str:
    """UserModel saved as a user would: scripted TorchScript (.pt; scripting keeps
    `images.device`, tracing would bake the CPU in), torch.export (.pt2) or ONNX (.onnx,
    dynamic camera axis), all on the CPU."""
    m, x = UserModel().eval(), torch.zeros((1, 3, H, W), dtype=torch.uint8)
    if fmt == "torchscript":
        path = f"{path_stem}.pt"
        torch.jit.save(torch.jit.script(m), path)
    elif fmt == "exported_program":
        path = f"{path_stem}.pt2"
        cams = torch.export.Dim("cameras", min=1, max=16)  # traced at 2: 1 would specialise
        torch.export.save(torch.export.export(m, (x.expand(2, -1, -1, -1).contiguous(),),
                                              dynamic_shapes=({0: cams},)), path)
    else:
        path = f"{path_stem}.onnx"
        torch.onnx.export(m, (x,), path, input_names=["images"], dynamo=False,
                          output_names=[f"output{i}" for i in range(5)],
                          dynamic_axes={"images": {0: "cameras"}})
    return path


@pytest.fixture(scope="module", params=FORMATS)
def model_file(request, tmp_path_factory) -> str:
    return save_user_model(tmp_path_factory.mktemp("m") / "user", request.param)


def config(model_file: str, **kw: object) -> PerceptionCoreConfig:
    base: dict = dict(model=PerceptionConfig.tiny(num_classes=4, score_threshold=0.3,
                                                  max_detections=12),
                      class_names=NAMES, model_path=model_file, model_outputs=ROLES,
                      warmup_image_hw=(H, W), warmup_cameras=1)
    base.update(kw)
    return PerceptionCoreConfig(**base)


def check_fused_like_the_reference(core: PerceptionCore) -> None:
    """One frame through the core: NMS, LiDAR and predicted-depth positions, seg and depth."""
    assert core.heads == {"detection", "segmentation", "depth"}
    # LiDAR points 3 m in front, inside the cube box (pixels 20..40): base (3, y, z)
    u, v = np.meshgrid(np.linspace(22, 38, 5), np.linspace(22, 38, 5))
    xc, yc = (u.ravel() - 64) / 100 * 3.0, (v.ravel() - 48) / 100 * 3.0
    pts = np.stack([np.full_like(xc, 3.0), -xc, 1.0 - yc], 1).astype(np.float32)
    img = np.zeros((H, W, 3), np.uint8)
    out = core.process(FrameSet(7, [img], [CameraModel(K, W, H, "cam0", extrinsic())], pts))
    dets = sorted(out.detections, key=lambda d: -d.score)
    assert [(d.class_name, round(d.score, 3)) for d in dets] == [("cube", 0.9), ("cup", 0.7)]
    cube, cup = dets
    assert cube.position_source == PositionSource.LIDAR
    np.testing.assert_allclose(cube.position, [3.0, 0.34 * 3, 1 + 0.18 * 3], atol=0.05)
    assert cup.position_source == PositionSource.PREDICTED_DEPTH  # no LiDAR point in it
    assert cup.position[0] == pytest.approx(2.0, abs=0.05)  # 2 m predicted depth, along +x
    assert np.all(out.masks[0] == 3) and np.allclose(out.depths[0], 2.0)


@pytest.mark.slow
def test_user_model_detections_fused_like_the_reference(model_file) -> None:
    """Each format (TorchScript, ExportedProgram, ONNX) through the core on the CPU."""
    check_fused_like_the_reference(PerceptionCore(config(model_file)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", FORMATS)
def test_user_model_files_saved_on_the_cpu_run_on_cuda(fmt, tmp_path) -> None:
    """A file exported on a CPU machine runs on CUDA: an ExportedProgram keeps its export
    device in the graph (`.module().to("cuda")` failed its device assertion), so it is moved
    with torch.export's move_to_device_pass; every output ends on the device."""
    if fmt == "onnx":
        pytest.importorskip("onnxruntime")
    core = PerceptionCore(config(save_user_model(tmp_path / "user", fmt), device="cuda"))
    raw = core.external(torch.zeros((2, 3, H, W), dtype=torch.uint8, device="cuda"))
    assert all(t.is_cuda for t in raw.values())
    assert core.external.host_outputs == []  # ("cuda" vs "cuda:0" is no host output)
    check_fused_like_the_reference(core)


def test_a_head_switch_must_leave_the_model_one_of_its_heads() -> None:
    from kestrel_perception.core.params import missing_model_heads

    off = {"enable_detection": False, "enable_segmentation": True, "enable_depth": True}
    why = missing_model_heads(off, frozenset({"detection"}))
    assert "none of the model's heads ['detection']" in why and "'enable_detection'" in why
    assert missing_model_heads(off, frozenset({"detection", "depth"})) == ""


def test_contract_errors_fail_at_construction(model_file) -> None:
    with pytest.raises(ValueError, match=r"parameter 'model.outputs'.*'logits' \(seg\) not "
                                         "found"):
        PerceptionCore(config(model_file, model_outputs=("seg:logits",)))
    with pytest.raises(ValueError, match=r"parameter 'model.outputs'.*seg has shape"):
        PerceptionCore(config(model_file, class_names=NAMES[:3], support_classes=(),
                              model=PerceptionConfig.tiny(num_classes=3),
                              model_outputs=("seg:output3",)))
    with pytest.raises(ValueError, match="parameter 'runtime.compile' = 'whole'.*runs as "
                                         "exported"):
        config(model_file, compile="whole")
    wrong = "torch" if model_file.endswith(".onnx") else "onnxruntime"
    with pytest.raises(ValueError, match=f"parameter 'runtime.engine' = '{wrong}'.*a user "
                                         "model runs as exported"):
        config(model_file, engine=wrong)
    with pytest.raises(ValueError, match="parameter 'model.path'.*not both"):
        config(model_file, weights_path=model_file)


@pytest.mark.slow
def test_the_exported_reference_model_runs_through_the_onnx_path(tmp_path) -> None:
    """export_onnx of the reference model, loaded back as a user model with the raw FCOS
    role (`fcos:` = the export's names) plus seg and depth: the same detections, mask and
    depth as the reference model with the same weights (decode and NMS are the core's)."""
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from kestrel_models.perception import MultiTaskPerceptionModel
    from kestrel_models.perception.export import export_onnx

    model_cfg = PerceptionConfig.tiny(num_classes=4, score_threshold=0.05, max_detections=12)
    torch.manual_seed(3)
    ref_model = MultiTaskPerceptionModel(model_cfg).eval()
    weights, onnx = tmp_path / "w.pt", tmp_path / "ref.onnx"
    torch.save(ref_model.state_dict(), weights)
    export_onnx(ref_model, onnx, image_hw=(H, W), images_per_call=1)
    base = dict(model=model_cfg, class_names=NAMES, warmup_image_hw=(H, W), warmup_cameras=1)
    ref = PerceptionCore(PerceptionCoreConfig(**base, weights_path=str(weights)))
    ext = PerceptionCore(PerceptionCoreConfig(
        **base, model_path=str(onnx), model_outputs=("fcos:", "seg:seg", "depth:depth")))
    assert ext.heads == {"detection", "segmentation", "depth"}
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
    cam = CameraModel(K, W, H, "cam0", extrinsic())
    a, b = (c.process(FrameSet(1, [img], [cam], None)) for c in (ref, ext))
    assert len(a.detections) == len(b.detections) > 0
    sa = sorted(a.detections, key=lambda d: -d.score)
    sb = sorted(b.detections, key=lambda d: -d.score)
    np.testing.assert_allclose([d.score for d in sa], [d.score for d in sb], atol=1e-4)
    np.testing.assert_allclose(np.stack([d.box_xyxy for d in sa]),
                               np.stack([d.box_xyxy for d in sb]), atol=1e-2)
    assert (a.masks[0] == b.masks[0]).mean() > 0.99
    np.testing.assert_allclose(a.depths[0], b.depths[0], atol=1e-3)
    with pytest.raises(ValueError, match="not both"):
        PerceptionCore(PerceptionCoreConfig(**base, model_path=str(onnx), model_outputs=(
            "fcos:", "boxes:b", "scores:s", "labels:l")))
    with pytest.raises(ValueError, match=r"det_cls_p3 has shape \(1, 3, 12, 16\), expected "
                                         r"\[1, 5 classes"):
        PerceptionCore(PerceptionCoreConfig(
            model=PerceptionConfig.tiny(num_classes=6), class_names=(*NAMES, "a", "b"),
            warmup_image_hw=(H, W), warmup_cameras=1, model_path=str(onnx),
            model_outputs=("fcos:",)))
