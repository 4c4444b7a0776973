#!/usr/bin/env python3
"""Offline TensorRT engine build for the perception forward (never done at node start).

Exports the model (fixed head set and shapes) to ONNX, computes the cache key
(model hash + GPU name + TensorRT version + precision + input shapes) and builds
CACHE_DIR/perception_<key>.engine unless it exists. Exits with status 2 and a clear message
where `tensorrt` (or a CUDA GPU) is absent.

  python scripts/build_trt_engine.py --weights W.pt --config r50 --cameras 6 --precision fp16
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "models"))

from kestrel_models.perception import MultiTaskPerceptionModel, PerceptionConfig  # noqa: E402
from kestrel_models.perception.export import (  # noqa: E402
    PRECISIONS,
    TensorRTUnavailableError,
    build_engine,
    engine_cache_key,
    engine_path,
    export_onnx,
    model_hash,
    tensorrt_version,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=("tiny", "r50"), default="r50")
    ap.add_argument("--weights", default=None, help="state dict (.pt); default: random init")
    ap.add_argument("--heads", nargs="+", default=["detection", "segmentation", "depth"])
    ap.add_argument("--cameras", type=int, default=6)
    ap.add_argument("--image-hw", type=int, nargs=2, default=(640, 640))
    ap.add_argument("--precision", choices=PRECISIONS, default="fp16")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "kestrel" / "trt"))
    args = ap.parse_args()
    try:
        trt_version = tensorrt_version()
    except TensorRTUnavailableError as exc:
        print(f"[build_trt_engine] skipped: {exc}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("[build_trt_engine] skipped: no CUDA GPU here", file=sys.stderr)
        return 2
    cfg = PerceptionConfig() if args.config == "r50" else PerceptionConfig.tiny()
    model = MultiTaskPerceptionModel(cfg).eval()
    if args.weights:
        model.load_state_dict(torch.load(args.weights, map_location="cpu", weights_only=True))
    shapes = {"images": (args.cameras, 3, *args.image_hw)}
    key = engine_cache_key(model_hash(model), torch.cuda.get_device_name(), trt_version,
                           args.precision, shapes)
    out = engine_path(args.cache_dir, key)
    if out.is_file():
        print(f"[build_trt_engine] up to date: {out}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = Path(tmp) / "perception.onnx"
        export_onnx(model, onnx_path, frozenset(args.heads), tuple(args.image_hw), args.cameras)
        build_engine(onnx_path, out, args.precision)
    print(f"[build_trt_engine] built {out} (key {key})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
