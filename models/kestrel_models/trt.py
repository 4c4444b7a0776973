"""TensorRT helpers shared by the perception engine build and the control policy backend.

`tensorrt` is optional (it is in no registry these machines reach, and the CPU CI has no GPU):
every entry point raises `TensorRTUnavailableError` with the reason where it is absent, and the
callers turn that into their own clear, parameter-naming error.
"""

from __future__ import annotations

from pathlib import Path

PRECISIONS = ("fp32", "fp16", "bf16")


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


def build_engine(onnx_path: str | Path, out_path: str | Path, precision: str = "fp16",
                 workspace_gib: float = 4.0) -> Path:
    """Build a TensorRT engine from an ONNX file (needs `tensorrt` and a GPU); written to
    `out_path` atomically (a temporary file renamed), so a crashed build leaves no engine."""
    if precision not in PRECISIONS:
        raise ValueError(f"parameter 'precision' = {precision!r}: must be one of {PRECISIONS}")
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
    if precision == "fp16":
        cfg.set_flag(trt.BuilderFlag.FP16)
    elif precision == "bf16":
        cfg.set_flag(trt.BuilderFlag.BF16)
    engine = builder.build_serialized_network(network, cfg)
    if engine is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_path}")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".partial")
    tmp.write_bytes(bytes(engine))
    tmp.replace(out)
    return out
