"""kestrel_models.trt.build_engine against a stand-in `tensorrt` module (none of this project's
machines has TensorRT): the progress display, precision flags, INT8 calibration batches and
its cache, and the clear errors. What this cannot show: that a real TensorRT accepts it."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import kestrel_models.trt as ktrt


def _fake_trt(calibrator_api: bool = True) -> types.ModuleType:
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "10.99-standin"
    trt.fed = []  # pointers handed to the builder by the calibrator

    class Logger:
        WARNING = 2

        def __init__(self, level: int) -> None:
            self.level = level

    class IProgressMonitor:
        def __init__(self) -> None:
            pass

    class BuilderFlag:
        FP16, BF16, INT8 = "FP16", "BF16", "INT8"

    class MemoryPoolType:
        WORKSPACE = "WORKSPACE"

    class OnnxParser:
        num_errors = 0

        def __init__(self, network: object, logger: Logger) -> None:
            pass

        def parse(self, data: bytes) -> bool:
            return data.startswith(b"onnx")

    class Config:
        def __init__(self) -> None:
            self.flags: set[str] = set()
            self.progress_monitor = None
            self.int8_calibrator = None

        def set_flag(self, flag: str) -> None:
            self.flags.add(flag)

        def set_memory_pool_limit(self, pool: str, size: int) -> None:
            self.workspace = size

    class Builder:
        def __init__(self, logger: Logger) -> None:
            pass

        def create_network(self, flags: int) -> object:
            return object()

        def create_builder_config(self) -> Config:
            trt.config = Config()
            return trt.config

        def build_serialized_network(self, network: object, cfg: Config) -> bytes:
            pm = cfg.progress_monitor
            if pm is not None:  # what TensorRT does: nested phases, steps, finishes
                pm.phase_start("Building engine", None, 2)
                pm.phase_start("Tactic selection", "Building engine", 3)
                for i in range(3):
                    assert pm.step_complete("Tactic selection", i) is True
                pm.phase_finish("Tactic selection")
                pm.step_complete("Building engine", 0)
                pm.step_complete("Building engine", 1)
                pm.phase_finish("Building engine")
            cal = cfg.int8_calibrator
            if cal is not None and cal.read_calibration_cache() is None:
                assert cal.get_batch_size() == 1
                while (ptrs := cal.get_batch(["images"])) is not None:
                    trt.fed.append(ptrs)
                cal.write_calibration_cache(memoryview(b"calibration-table"))
            return b"engine:" + ",".join(sorted(cfg.flags)).encode()

    for cls in (Logger, IProgressMonitor, BuilderFlag, MemoryPoolType, OnnxParser, Builder):
        setattr(trt, cls.__name__, cls)
    if calibrator_api:
        class IInt8EntropyCalibrator2:
            def __init__(self) -> None:
                pass
        trt.IInt8EntropyCalibrator2 = IInt8EntropyCalibrator2
    return trt


@pytest.fixture
def onnx_file(tmp_path: Path) -> Path:
    p = tmp_path / "m.onnx"
    p.write_bytes(b"onnx-standin")
    return p


@pytest.fixture
def cpu_copies(monkeypatch) -> None:
    """Calibration batches go to 'the device' as CPU tensors (data_ptr() works the same)."""
    monkeypatch.setattr(ktrt, "_cuda_copy", lambda a: torch.from_numpy(np.ascontiguousarray(a)))


def test_fp16_build_writes_the_engine_and_shows_progress(monkeypatch, onnx_file, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_trt())
    lines: list[str] = []
    out = ktrt.build_engine(onnx_file, tmp_path / "e" / "m.engine", "fp16", log=lines.append)
    assert out.read_bytes() == b"engine:FP16" and not out.with_suffix(".engine.partial").exists()
    assert lines[0] == "[tensorrt] Building engine (2 steps)"
    assert "[tensorrt]   Tactic selection (3 steps)" in lines  # nested: indented
    assert "[tensorrt]   Tactic selection: 3/3" in lines  # the last step always shows
    assert lines[-1] == "[tensorrt] Building engine: done"
    silent = ktrt.build_engine(onnx_file, tmp_path / "s.engine", "bf16", log=None)
    assert silent.read_bytes() == b"engine:BF16"


def test_int8_calibrates_on_the_given_batches_then_reuses_the_cache(
        monkeypatch, onnx_file, tmp_path, cpu_copies):
    trt = _fake_trt()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    frames = np.random.default_rng(0).integers(0, 256, (3, 2, 3, 8, 8), dtype=np.uint8)
    cache = tmp_path / "m.calib"
    lines: list[str] = []
    out = ktrt.build_engine(onnx_file, tmp_path / "m.engine", "int8",
                            calibration=({"images": f} for f in frames),
                            calibration_cache=cache, log=lines.append)
    assert out.read_bytes() == b"engine:FP16,INT8"  # INT8 with FP16 fallback
    assert len(trt.fed) == 3 and all(len(p) == 1 and p[0] > 0 for p in trt.fed)
    assert cache.read_bytes() == b"calibration-table"
    assert lines[-1] == "[tensorrt] int8 calibration: 3 batches fed"
    trt.fed.clear()  # a rebuild with the cache and no frames: no calibration pass
    ktrt.build_engine(onnx_file, tmp_path / "m2.engine", "int8", calibration_cache=cache,
                      log=None)
    assert trt.fed == []


def test_clear_errors(monkeypatch, onnx_file, tmp_path, cpu_copies):
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_trt())
    with pytest.raises(ValueError, match="'precision' = 'int8': needs calibration batches"):
        ktrt.build_engine(onnx_file, tmp_path / "a.engine", "int8")
    with pytest.raises(ValueError, match="parameter 'precision' = 'fp8'"):
        ktrt.build_engine(onnx_file, tmp_path / "a.engine", "fp8")
    with pytest.raises(ValueError, match=r"calibration batch 0 has no input \['images'\]"):
        ktrt.build_engine(onnx_file, tmp_path / "a.engine", "int8",
                          calibration=[{"pixels": np.zeros(4, np.uint8)}], log=None)
    with pytest.raises(RuntimeError, match="could not parse"):
        bad = tmp_path / "bad.onnx"
        bad.write_bytes(b"garbage")
        ktrt.build_engine(bad, tmp_path / "a.engine", "fp16", log=None)
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_trt(calibrator_api=False))
    with pytest.raises(RuntimeError, match="no implicit-quantization calibrator"):
        ktrt.build_engine(onnx_file, tmp_path / "a.engine", "int8",
                          calibration=[{"images": np.zeros(4, np.uint8)}], log=None)
    assert not (tmp_path / "a.engine").exists()
