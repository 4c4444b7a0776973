"""The TensorRT engine runtime (trt_runtime.py, `tensorrt_*` specs) against a stand-in
`tensorrt` whose "engine" is the exported ONNX run by onnxruntime on host memory (CI has no
TensorRT and no GPU): the key the runtime looks up is the one the build
step writes, the engine's tensors are bound by name and shape, its flat outputs come back as
the model's dict (equal to the torch forward), head subsets are served from it, and a missing
engine / absent TensorRT / a CPU device fail with the parameter named and the build command.
What this cannot show: that a real TensorRT engine runs."""

from __future__ import annotations

import ctypes
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_perception import tiny_model

from kestrel_models.perception import trt_runtime
from kestrel_models.perception.export import (engine_path, export_onnx, model_hash,
                                              perception_engine_key)
from kestrel_models.perception.runtime import VARIANTS, PerceptionRuntime
from kestrel_models.perception.trt_runtime import TensorRTPerceptionModel

HW = (64, 96)
HEADS = frozenset({"detection", "segmentation", "depth"})
_NP = {"FLOAT": np.float32, "UINT8": np.uint8}


def _standin_trt(version: str = "10.99-standin") -> types.ModuleType:
    ort = pytest.importorskip("onnxruntime")
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version

    class Logger:
        WARNING = 2

        def __init__(self, level: int) -> None:
            pass

    class DataType:
        def __init__(self, name: str) -> None:
            self.name = name

        def __str__(self) -> str:
            return f"DataType.{self.name}"

    class Context:
        def __init__(self, engine: Engine) -> None:
            self.engine, self.addr = engine, {}
            self.runs = 0

        def set_tensor_address(self, name: str, ptr: int) -> None:
            self.addr[name] = ptr

        def _array(self, name: str) -> np.ndarray:  # host memory at the bound address
            shape, dt = self.engine.shapes[name], _NP[self.engine.dtypes[name]]
            n = int(np.prod(shape)) * np.dtype(dt).itemsize
            buf = (ctypes.c_char * n).from_address(self.addr[name])
            return np.frombuffer(buf, dtype=dt).reshape(shape)

        def execute_async_v3(self, stream: int) -> bool:
            res = self.engine.sess.run(None, {"images": self._array("images").copy()})
            for name, r in zip(self.engine.outs, res, strict=True):
                self._array(name)[...] = r
            self.runs += 1
            return True

    class Engine:
        def __init__(self, onnx: bytes) -> None:
            self.sess = ort.InferenceSession(onnx, providers=["CPUExecutionProvider"])
            self.outs = [o.name for o in self.sess.get_outputs()]
            ios = [*self.sess.get_inputs(), *self.sess.get_outputs()]
            self.names = [t.name for t in ios]
            self.shapes = {t.name: tuple(t.shape) for t in ios}
            self.dtypes = {t.name: "UINT8" if "uint8" in t.type else "FLOAT" for t in ios}
            self.num_io_tensors = len(self.names)
            self.contexts: list[Context] = []

        def get_tensor_name(self, i: int) -> str:
            return self.names[i]

        def get_tensor_shape(self, name: str) -> tuple:
            return self.shapes[name]

        def get_tensor_dtype(self, name: str) -> DataType:
            return DataType(self.dtypes[name])

        def create_execution_context(self) -> Context:
            self.contexts.append(Context(self))
            return self.contexts[-1]

    class Runtime:
        def __init__(self, logger: Logger) -> None:
            pass

        def deserialize_cuda_engine(self, data: bytes) -> Engine | None:
            prefix = b"standin-engine:"
            return Engine(data[len(prefix):]) if data.startswith(prefix) else None

    trt.Logger, trt.Runtime = Logger, Runtime
    return trt


@pytest.fixture
def standin(monkeypatch) -> types.ModuleType:
    trt = _standin_trt()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    # the stand-in reads host memory: let the engine runtime run on the CPU
    monkeypatch.setattr(trt_runtime, "_require_cuda", lambda device, what: None)
    return trt


def _build(model, tmp_path: Path, images: int, heads=HEADS, precision: str = "fp16",
           version: str = "10.99-standin") -> Path:
    """What kestrel_models.perception.build_engine does, with the stand-in as the builder: the
    ONNX of the forward stored under the key the runtime will compute."""
    onnx = tmp_path / "m.onnx"
    export_onnx(model, onnx, heads, HW, images)
    key = perception_engine_key(model, heads, images, HW, precision, "cpu", version)
    path = engine_path(tmp_path, key)
    path.write_bytes(b"standin-engine:" + onnx.read_bytes())
    return path


def _same(out: dict, ref: dict) -> None:
    assert out.keys() == ref.keys()
    for k, r in ref.items():
        pairs = zip(out[k], r, strict=True) if isinstance(r, list) else [(out[k], r)]
        for a, b in pairs:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=k)


@pytest.mark.slow
def test_engine_outputs_are_the_models_dict_for_every_head_subset(standin, tmp_path) -> None:
    pytest.importorskip("onnx")
    model = tiny_model().eval()
    _build(model, tmp_path, images=2)
    rt = PerceptionRuntime(model, "tensorrt_fp16", HW, cameras=2, heads=[
        HEADS, {"detection"}, {"segmentation", "depth"}], engine_dir=str(tmp_path))
    img = torch.randint(0, 256, (2, 3, *HW), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(0))
    for hs in (HEADS, frozenset({"detection"}), frozenset({"segmentation", "depth"})):
        with torch.no_grad():
            ref = model(img, hs)
        _same(rt.run(img, heads=hs), ref)
    engine = rt.model
    assert isinstance(engine, TensorRTPerceptionModel)
    assert engine.outputs["seg"].data_ptr() == rt.run(img)["seg"].data_ptr()  # static
    assert VARIANTS["tensorrt_int8"].engine == "int8"


def test_the_key_ignores_run_time_thresholds_and_follows_weights_heads_shape_and_trt(
        tmp_path) -> None:
    import dataclasses

    a = tiny_model().eval()
    b = tiny_model().eval()
    b.config = dataclasses.replace(a.config, score_threshold=0.9, nms_iou=0.1,
                                   max_detections=3)
    assert model_hash(a) == model_hash(b)  # set at run time: no new engine
    key = perception_engine_key(a, HEADS, 6, HW, "fp16", "NVIDIA H200", "10.3")
    assert key == perception_engine_key(b, HEADS, 6, HW, "fp16", "NVIDIA H200", "10.3")
    with torch.no_grad():
        next(b.parameters()).add_(1.0)
    for other in (perception_engine_key(b, HEADS, 6, HW, "fp16", "NVIDIA H200", "10.3"),
                  perception_engine_key(a, {"depth"}, 6, HW, "fp16", "NVIDIA H200", "10.3"),
                  perception_engine_key(a, HEADS, 5, HW, "fp16", "NVIDIA H200", "10.3"),
                  perception_engine_key(a, HEADS, 6, HW, "int8", "NVIDIA H200", "10.3"),
                  perception_engine_key(a, HEADS, 6, HW, "fp16", "NVIDIA H100", "10.3"),
                  perception_engine_key(a, HEADS, 6, HW, "fp16", "NVIDIA H200", "10.4")):
        assert other != key


@pytest.mark.slow
def test_the_key_is_the_same_in_another_process(tmp_path) -> None:
    """The build script and the node are two processes: the key must not depend on the
    process's string-hash seed (repr() of the heads' frozenset did)."""
    import os
    import subprocess

    import tiny_perception

    tests_dir = str(Path(tiny_perception.__file__).parent)
    code = (f"import sys, torch; sys.path.insert(0, {tests_dir!r});"
            "from tiny_perception import tiny_model;"
            "from kestrel_models.perception.export import perception_engine_key;"
            "torch.manual_seed(0); m = tiny_model();"
            "print(perception_engine_key(m, {'detection', 'segmentation', 'depth'}, 6,"
            " (64, 96), 'fp16', 'NVIDIA H200', '10.3'))")
    keys = set()
    for seed in ("1", "2", "3", "4"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env, timeout=120)
        assert res.returncode == 0, res.stderr
        keys.add(res.stdout.strip())
    assert len(keys) == 1, keys


@pytest.mark.slow
def test_the_engine_variant_runs_beside_the_lidar_projection(standin, tmp_path) -> None:
    """With LiDAR inputs (the benchmark's case) the runtime passes the cameras on; the
    engine model takes and ignores them, and the projection outputs come with its maps."""
    pytest.importorskip("onnx")
    model = tiny_model().eval()
    _build(model, tmp_path, images=2)
    rt = PerceptionRuntime(model, "tensorrt_fp16", HW, cameras=2, lidar_points=64,
                           engine_dir=str(tmp_path))
    rt.set_geometry(torch.eye(4).repeat(2, 1, 1), torch.eye(3).repeat(2, 1, 1))
    out = rt.run(torch.zeros((2, 3, *HW), dtype=torch.uint8), torch.randn(1, 64, 3))
    assert {"det_cls", "seg", "depth", "lidar_uv", "lidar_valid"} <= set(out)


@pytest.mark.slow
def test_a_missing_or_mismatched_engine_fails_naming_the_variant_and_the_build(
        standin, tmp_path) -> None:
    pytest.importorskip("onnx")
    model = tiny_model().eval()
    with pytest.raises(ValueError, match=r"parameter 'engine' = 'tensorrt': no TensorRT "
                                         r"engine for key .*Build it with: python .*"
                                         r"--cameras 2 --image-hw 64 96 --precision fp16"):
        PerceptionRuntime(model, "tensorrt_fp16", HW, cameras=2, engine_dir=str(tmp_path))
    assert not any(tmp_path.iterdir())  # nothing built, nothing written
    # an engine of other weights under this key (a stale file): its outputs may match by
    # name, but a file that is not an engine at all is refused when deserialised
    path = _build(model, tmp_path, images=2)
    path.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="could not be deserialised"):
        PerceptionRuntime(model, "tensorrt_fp16", HW, cameras=2, engine_dir=str(tmp_path))
    # an engine built for one head set does not serve another
    path = _build(model, tmp_path, images=2, heads=frozenset({"depth"}))
    key = perception_engine_key(model, HEADS, 2, HW, "fp16", "cpu", "10.99-standin")
    engine_path(tmp_path, key).write_bytes(path.read_bytes())
    with pytest.raises(ValueError, match=r"has no tensor\(s\) \['det_cls_p3'"):
        PerceptionRuntime(model, "tensorrt_fp16", HW, cameras=2, engine_dir=str(tmp_path))


def test_without_tensorrt_or_cuda_the_variant_fails_clearly(monkeypatch, tmp_path) -> None:
    model = tiny_model().eval()
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import fails as if absent
    with pytest.raises(ValueError, match="'engine' = 'tensorrt': TensorRT is not installed"):
        PerceptionRuntime(model, "tensorrt_fp16", HW, cameras=1, engine_dir=str(tmp_path))
    monkeypatch.setitem(sys.modules, "tensorrt", _standin_trt())
    with pytest.raises(ValueError, match="needs parameter 'device' = 'cuda', got 'cpu'"):
        PerceptionRuntime(model, "tensorrt_fp16", HW, cameras=1, engine_dir=str(tmp_path))
