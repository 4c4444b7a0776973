"""TensorRT helpers shared by the perception engine build and the control policy backend.

`tensorrt` is optional (it is in no registry these machines reach, and the CPU CI has no GPU):
every entry point raises `TensorRTUnavailableError` with the reason where it is absent, and the
callers turn that into their own clear, parameter-naming error.

`build_engine` is the offline build step: ONNX -> serialized engine, with
- a progress display (a `tensorrt.IProgressMonitor` printing each optimizer phase and its steps,
  at most a few lines per second), because a large model's build takes minutes;
- precision 'fp32' | 'fp16' | 'bf16' | 'int8'. 'int8' = INT8 with FP16 fallback, calibrated
  by TensorRT's entropy calibrator on batches the caller provides (e.g. real camera frames),
  with a calibration cache file so a rebuild does not recalibrate. TensorRT releases without
  the implicit-quantization calibrator API get a clear error (quantize the ONNX with Q/DQ
  nodes instead, e.g. NVIDIA ModelOpt, and build it with 'fp16').
No machine of this project has TensorRT: this module is exercised by tests against a stand-in
`tensorrt` module (the call sequence and the calibration/progress plumbing), not a real build.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import numpy as np

PRECISIONS = ("fp32", "fp16", "bf16", "int8")

Batch = Mapping[str, np.ndarray]  # ONNX input name -> one calibration batch (its exact shape)


class TensorRTUnavailableError(RuntimeError):
    """The `tensorrt` Python package is not installed here."""


def tensorrt_version() -> str:
    """Installed TensorRT version; raises TensorRTUnavailableError with the reason."""
    try:
        import tensorrt  # type: ignore[import-not-found]
    except ImportError as exc:
        raise TensorRTUnavailableError(
            f"TensorRT is not installed ({exc}); the engine build step is skipped. Install the "
            "'tensorrt' wheel matching the CUDA driver on the target GPU machine.") from exc
    return str(tensorrt.__version__)


def _cuda_copy(a: np.ndarray):  # noqa: ANN202 - a torch CUDA tensor (kept alive by the caller)
    import torch

    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def progress_monitor(trt, log: Callable[[str], None] = print,  # noqa: ANN001
                     min_interval_s: float = 0.5):  # noqa: ANN201
    """A `trt.IProgressMonitor` that logs phase starts/finishes and step counts (throttled per
    phase to one line per `min_interval_s`, the last step always). Thread-safe: TensorRT calls
    it from its builder threads."""

    class ProgressMonitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self._lock = threading.Lock()
            self._phases: dict[str, tuple[int, int, float]] = {}  # name -> (steps, depth, t)

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            with self._lock:
                depth = self._phases[parent_phase][1] + 1 if parent_phase in self._phases else 0
                self._phases[phase_name] = (num_steps, depth, 0.0)
            log(f"[tensorrt] {'  ' * depth}{phase_name} ({num_steps} steps)")

        def step_complete(self, phase_name: str, step: int) -> bool:
            with self._lock:
                steps, depth, last = self._phases.get(phase_name, (0, 0, 0.0))
                now = time.monotonic()
                show = step + 1 == steps or now - last >= min_interval_s
                if show:
                    self._phases[phase_name] = (steps, depth, now)
            if show:
                log(f"[tensorrt] {'  ' * depth}{phase_name}: {step + 1}/{steps}")
            return True  # False would cancel the build

        def phase_finish(self, phase_name: str) -> None:
            with self._lock:
                depth = self._phases.pop(phase_name, (0, 0, 0.0))[1]
            log(f"[tensorrt] {'  ' * depth}{phase_name}: done")

    return ProgressMonitor()


def int8_calibrator(trt, batches: Iterable[Batch], cache_path: str | Path | None,  # noqa: ANN001
                    to_device: Callable[[np.ndarray], object] | None = None):  # noqa: ANN201
    """A `trt.IInt8EntropyCalibrator2` feeding `batches` (each: every network input by name, at
    the network's input shape) through device copies made by `to_device` (a CUDA tensor by
    default; anything with `data_ptr()`), reading/writing the calibration cache at
    `cache_path` (a cache present = no calibration pass)."""
    if not hasattr(trt, "IInt8EntropyCalibrator2"):
        raise RuntimeError(
            f"parameter 'precision' = 'int8': TensorRT {getattr(trt, '__version__', '?')} has no "
            "implicit-quantization calibrator; quantize the ONNX with Q/DQ nodes (e.g. NVIDIA "
            "ModelOpt) and build that with precision 'fp16'")
    cache = Path(cache_path) if cache_path else None
    copy = to_device or _cuda_copy

    class Calibrator(trt.IInt8EntropyCalibrator2):
        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)
            self._batches = iter(batches)
            self._alive: list[object] = []  # device copies of the current batch
            self.batches_fed = 0

        def get_batch_size(self) -> int:
            return 1  # explicit-batch networks: shapes come from the inputs themselves

        def get_batch(self, names: list[str]) -> list[int] | None:
            batch = next(self._batches, None)
            if batch is None:
                return None
            missing = [n for n in names if n not in batch]
            if missing:
                raise ValueError(f"calibration batch {self.batches_fed} has no input {missing}"
                                 f" (it has {sorted(batch)})")
            self._alive = [copy(batch[n]) for n in names]
            self.batches_fed += 1
            return [int(t.data_ptr()) for t in self._alive]

        def read_calibration_cache(self) -> bytes | None:
            return cache.read_bytes() if cache is not None and cache.is_file() else None

        def write_calibration_cache(self, data) -> None:  # noqa: ANN001 - a buffer
            if cache is not None:
                cache.parent.mkdir(parents=True, exist_ok=True)
                cache.write_bytes(bytes(data))

    return Calibrator()


def build_engine(onnx_path: str | Path, out_path: str | Path, precision: str = "fp16",
                 workspace_gib: float = 4.0, *, calibration: Iterable[Batch] | None = None,
                 calibration_cache: str | Path | None = None,
                 log: Callable[[str], None] | None = print) -> Path:
    """Build a TensorRT engine from an ONNX file (needs `tensorrt` and a GPU); written to
    `out_path` atomically (a temporary file renamed), so a crashed build leaves no engine.
    `log` (None: silent) receives the progress lines. 'int8' needs `calibration` batches or an
    existing `calibration_cache`."""
    if precision not in PRECISIONS:
        raise ValueError(f"parameter 'precision' = {precision!r}: must be one of {PRECISIONS}")
    has_cache = calibration_cache is not None and Path(calibration_cache).is_file()
    if precision == "int8" and calibration is None and not has_cache:
        raise ValueError("parameter 'precision' = 'int8': needs calibration batches (e.g. "
                         "--calib-images) or an existing calibration cache")
    tensorrt_version()  # raises a clear error where absent
    import tensorrt as trt  # type: ignore[import-not-found]

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(Path(onnx_path).read_bytes()):
        errs = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errs}")
    cfg = builder.create_builder_config()
    cfg.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    monitor = progress_monitor(trt, log) if log is not None else None
    if monitor is not None:
        cfg.progress_monitor = monitor  # kept referenced until the build returns
    calibrator = None
    if precision in ("fp16", "int8"):
        cfg.set_flag(trt.BuilderFlag.FP16)
    if precision == "bf16":
        cfg.set_flag(trt.BuilderFlag.BF16)
    if precision == "int8":
        calibrator = int8_calibrator(trt, calibration if calibration is not None else (),
                                     calibration_cache)
        cfg.set_flag(trt.BuilderFlag.INT8)
        cfg.int8_calibrator = calibrator
    engine = builder.build_serialized_network(network, cfg)
    if engine is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_path}")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".partial")
    tmp.write_bytes(bytes(engine))
    tmp.replace(out)
    if log is not None and calibrator is not None:
        log(f"[tensorrt] int8 calibration: {calibrator.batches_fed} batches fed")
    return out
