"""ONNX export (checked against onnxruntime) and TensorRT engine cache keys (CPU)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from tiny_perception import tiny_model

from kestrel_models.perception.export import (
    EngineMissingError,
    ExportWrapper,
    TensorRTUnavailableError,
    build_engine,
    engine_cache_key,
    engine_path,
    export_onnx,
    find_engine,
    model_hash,
    output_names,
    tensorrt_version,
)

SHAPES = {"images": (6, 3, 640, 640), "points": (1, 131072, 3)}




def test_output_names_follow_the_wrapper_order() -> None:
    names = output_names({"detection", "depth"})
    assert names[:3] == ["det_cls_p3", "det_cls_p4", "det_cls_p5"]
    assert names[-1] == "depth" and "seg" not in names and len(names) == 10
    assert output_names({"segmentation"}, bev=True) == ["seg", "bev_occ"]


@pytest.mark.slow
@pytest.mark.parametrize("bev", [False, True])
def test_onnx_export_matches_torch_in_onnxruntime(tmp_path: Path, bev: bool) -> None:
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    model = tiny_model(bev=bev, bev_grid=8)
    heads = frozenset({"detection", "segmentation", "depth"})
    path = tmp_path / "perception.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        names = export_onnx(model, path, heads, image_hw=(64, 96), images_per_call=2,
                            lidar_points=50 if bev else 0)
    assert not model.training  # export leaves the model in eval mode (BatchNorm!)
    g = torch.Generator().manual_seed(3)
    img = torch.randint(0, 256, (2, 3, 64, 96), dtype=torch.uint8, generator=g)
    pts = torch.randn(1, 50, 3, generator=g) * 5
    pts[0, -5:] = float("nan")  # bucket padding
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {"images": img.numpy()}
    T = torch.eye(4).repeat(2, 1, 1)  # cameras at the base origin looking along base +x
    T[:, :3, :3] = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, -1.0], [1.0, 0.0, 0.0]])
    K = torch.tensor([[50.0, 0.0, 48.0], [0.0, 50.0, 32.0], [0.0, 0.0, 1.0]]).repeat(2, 1, 1)
    if bev:
        feeds.update(points=pts.numpy(), T_cam_from_base=T.numpy(), K=K.numpy())
    got = sess.run(None, feeds)
    assert [o.name for o in sess.get_outputs()] == names
    with torch.no_grad():
        ref = ExportWrapper(model, heads)(img, pts, T, K) if bev else \
            ExportWrapper(model, heads)(img)
    assert len(got) == len(ref) == len(names)
    for name, a, b in zip(names, got, ref, strict=True):
        assert a.shape == tuple(b.shape), name
        torch.testing.assert_close(torch.from_numpy(a), b, atol=1e-4, rtol=1e-4, msg=name)


def test_export_rejects_unknown_heads(tmp_path: Path) -> None:
    model = tiny_model(heads=frozenset({"depth"}))
    with pytest.raises(ValueError, match="heads"):
        export_onnx(model, tmp_path / "x.onnx", {"segmentation"}, image_hw=(64, 64))


def test_model_hash_changes_with_weights_and_config() -> None:
    a, b = tiny_model(), tiny_model()
    assert model_hash(a) == model_hash(b)
    with torch.no_grad():
        b.backbone.conv1.weight[0, 0, 0, 0] += 1e-3
    assert model_hash(a) != model_hash(b)
    assert model_hash(tiny_model(max_depth=10.0)) != model_hash(a)


def test_engine_cache_key_covers_every_field() -> None:
    base = dict(model_sha="abc", gpu_name="NVIDIA H200", trt_version="10.3.0",
                precision="fp16", shapes=SHAPES)
    k = engine_cache_key(**base)  # type: ignore[arg-type]
    assert len(k) == 24 and k == engine_cache_key(**base)  # type: ignore[arg-type]
    # shape order in the dict does not matter, every value does
    assert engine_cache_key(**{**base, "shapes": dict(reversed(list(SHAPES.items())))}) == k
    changes = [("model_sha", "abd"), ("gpu_name", "NVIDIA H100"), ("trt_version", "10.4.0"),
               ("precision", "bf16"),
               ("shapes", {**SHAPES, "images": (1, 3, 640, 640)})]
    keys = {engine_cache_key(**{**base, f: v}) for f, v in changes}  # type: ignore[arg-type]
    assert len(keys) == len(changes) and k not in keys
    with pytest.raises(ValueError, match="precision"):
        engine_cache_key(**{**base, "precision": "int4"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gpu_name"):
        engine_cache_key(**{**base, "gpu_name": ""})  # type: ignore[arg-type]


def test_missing_engine_is_never_built_silently(tmp_path: Path) -> None:
    key = engine_cache_key("abc", "NVIDIA H200", "10.3.0", "fp16", SHAPES)
    with pytest.raises(EngineMissingError, match="kestrel_models.perception.build_engine"):
        find_engine(tmp_path, key)
    assert not any(tmp_path.iterdir())  # the lookup created nothing
    engine_path(tmp_path, key).write_bytes(b"engine")
    assert find_engine(tmp_path, key) == tmp_path / f"perception_{key}.engine"


def test_tensorrt_absent_gives_a_clear_message(tmp_path: Path) -> None:
    try:
        import tensorrt  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        with pytest.raises(TensorRTUnavailableError, match="TensorRT is not installed"):
            tensorrt_version()
        with pytest.raises(TensorRTUnavailableError):
            build_engine(tmp_path / "x.onnx", tmp_path / "x.engine")
    else:
        pytest.skip("tensorrt is installed here: the absent-path is not testable")


@pytest.mark.slow
@pytest.mark.parametrize(("args", "fragment"), [
    (["--cameras", "0"], "parameter 'cameras' = 0: must be in [1, 64]"),
    (["--image-hw", "16", "640"], "parameter 'image_hw' = [16, 640]"),
])
def test_build_script_rejects_bad_shapes_before_any_work(args: list[str], fragment: str) -> None:
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "kestrel_models.perception.build_engine", *args],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and fragment in res.stderr, res.stderr
