"""Offline TensorRT engine build for the perception forward (never done at node start).

Exports the model (fixed head set and shapes) to ONNX, computes the cache key
(`export.perception_engine_key`: model hash + head set + torch / opset + GPU name + TensorRT
version + precision + input shapes, the key the node's `tensorrt_<precision>` runtime variant
looks up) and builds CACHE_DIR/perception_<key>.engine unless it exists, printing TensorRT's
optimizer phases as it goes, plus a .json beside it (what it was built from). Exits with status
2 and a clear message where `tensorrt` (or a CUDA GPU) is absent. The architecture flags must
match the node's parameters (backbone_depth, base_width, fpn_channels, head_convs, number of
class_names); the node's error for a missing engine prints this command with them.

  python -m kestrel_models.perception.build_engine --weights W.pt --cameras 6 --precision fp16
  python -m kestrel_models.perception.build_engine --weights W.pt --precision int8 \
      --calib-images frames.npy      # uint8 [N, cameras, 3, H, W]: N calibration batches
INT8 = INT8 with FP16 fallback, calibrated by TensorRT's entropy calibrator on the given
frames (use a few hundred real ones); the calibration cache is kept next to the engine.
The calibration frames are not part of the key (the node cannot know them); their hash is in
the .json.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from kestrel_models.perception import MultiTaskPerceptionModel, PerceptionConfig
from kestrel_models.perception.export import (
    ENGINE_CONFIG_FIELDS,
    PRECISIONS,
    TensorRTUnavailableError,
    build_engine,
    engine_path,
    export_onnx,
    perception_engine_key,
    tensorrt_version,
)
from kestrel_models.perception.model import load_weights


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kestrel_models.perception.build_engine",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=("tiny", "r50"), default="r50",
                    help="base architecture; the flags below override its fields")
    for f in ENGINE_CONFIG_FIELDS:  # typed like the config's own default
        ap.add_argument(f"--{f.replace('_', '-')}", type=type(getattr(PerceptionConfig(), f)),
                        default=None)
    ap.add_argument("--weights", default=None, help="state dict (.pt); default: random init")
    ap.add_argument("--heads", nargs="+", default=["detection", "segmentation", "depth"])
    ap.add_argument("--cameras", type=int, default=6)
    ap.add_argument("--image-hw", type=int, nargs=2, default=(640, 640))
    ap.add_argument("--precision", choices=PRECISIONS, default="fp16")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "kestrel" / "trt"))
    ap.add_argument("--force", action="store_true",
                    help="rebuild even if the engine for this key exists")
    ap.add_argument("--calib-images", default="",
                    help="int8: .npy of uint8 [N, cameras, 3, H, W] calibration frames")
    args = ap.parse_args(argv)
    if not 1 <= args.cameras <= 64:
        ap.error(f"parameter 'cameras' = {args.cameras}: must be in [1, 64]")
    if min(args.image_hw) < 32 or max(args.image_hw) > 8192:
        ap.error(f"parameter 'image_hw' = {list(args.image_hw)}: each side in [32, 8192] px")
    calib = None
    if args.precision == "int8":
        if not args.calib_images:
            print("[build_engine] parameter 'precision' = 'int8' needs --calib-images",
                  file=sys.stderr)
            return 2
        calib = np.load(args.calib_images, mmap_mode="r")
        want = (args.cameras, 3, *args.image_hw)
        if calib.dtype != np.uint8 or calib.ndim != 5 or tuple(calib.shape[1:]) != want:
            print(f"[build_engine] parameter 'calib_images' = {args.calib_images!r}: need "
                  f"uint8 [N, {', '.join(map(str, want))}], got {calib.dtype} "
                  f"{tuple(calib.shape)}", file=sys.stderr)
            return 2
    try:
        trt_version = tensorrt_version()
    except TensorRTUnavailableError as exc:
        print(f"[build_engine] skipped: {exc}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("[build_engine] skipped: no CUDA GPU here", file=sys.stderr)
        return 2
    cfg = PerceptionConfig() if args.config == "r50" else PerceptionConfig.tiny()
    over = {f: getattr(args, f) for f in ENGINE_CONFIG_FIELDS if getattr(args, f) is not None}
    try:
        cfg = dataclasses.replace(cfg, **over)
    except ValueError as exc:
        print(f"[build_engine] {exc}", file=sys.stderr)
        return 2
    model = MultiTaskPerceptionModel(cfg).eval()
    if args.weights:  # a state dict, or a checkpoint {"state_dict": ...} (as the node takes)
        load_weights(model, args.weights)
    heads = frozenset(args.heads)
    key = perception_engine_key(model, heads, args.cameras, tuple(args.image_hw),
                                args.precision, torch.cuda.get_device_name(), trt_version)
    out = engine_path(args.cache_dir, key)
    calib_sha = None if calib is None else \
        hashlib.sha256(np.ascontiguousarray(calib).data).hexdigest()
    if out.is_file() and not args.force:
        meta_path = out.with_suffix(".json")
        old = json.loads(meta_path.read_text()).get("calibration_sha256") \
            if meta_path.is_file() else None
        if calib_sha is not None and old != calib_sha:  # the frames are not in the key
            print(f"[build_engine] {out} exists, calibrated on other frames "
                  f"({old}); pass --force to rebuild it with these", file=sys.stderr)
            return 2
        print(f"[build_engine] up to date: {out}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = Path(tmp) / "perception.onnx"
        export_onnx(model, onnx_path, frozenset(args.heads), tuple(args.image_hw), args.cameras)
        batches = None if calib is None else ({"images": np.asarray(c)} for c in calib)
        build_engine(onnx_path, out, args.precision, calibration=batches,
                     calibration_cache=out.with_suffix(".calib") if calib is not None else None)
    command = ["python", "-m", "kestrel_models.perception.build_engine",
               *(sys.argv[1:] if argv is None else argv)]
    meta = {"key": key, "command": " ".join(command), "config": repr(cfg),
            "heads": sorted(heads), "weights": args.weights, "tensorrt": trt_version,
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
            "calibration_sha256": calib_sha}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"[build_engine] built {out} (key {key})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
