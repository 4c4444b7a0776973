"""ONNX export of the perception forward and TensorRT engine cache keys / build step.

The TensorRT engine is built offline (`python -m kestrel_models.perception.build_engine`), keyed by
model hash + GPU name + TensorRT version + precision + input shapes, and only *looked up* at
node start: a missing engine raises `EngineMissingError` naming the build command, it is never
rebuilt silently.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from .config import HEAD_NAMES
from .model import DET_STRIDES, MultiTaskPerceptionModel

from ..trt import PRECISIONS, TensorRTUnavailableError, build_engine, tensorrt_version

__all__ = ["PRECISIONS", "TensorRTUnavailableError", "EngineMissingError", "build_engine",
           "tensorrt_version", "engine_cache_key", "engine_path", "find_engine", "model_hash",
           "export_onnx", "output_names", "perception_engine_key", "build_command",
           "ONNX_OPSET", "ENGINE_CONFIG_FIELDS", "detection_output_names"]


ONNX_OPSET = 17  # of export_onnx, and part of the engine key


class EngineMissingError(FileNotFoundError):
    """No cached TensorRT engine matches the key (build it offline first)."""


# PerceptionConfig fields that shape the exported forward and that the build script takes as
# flags (the node's parameters set them): the error for a missing engine prints them
ENGINE_CONFIG_FIELDS = ("backbone_depth", "base_width", "fpn_channels", "num_classes",
                        "head_convs", "dense_stride", "depth_activation", "max_depth")


def detection_output_names(prefix: str = "") -> dict[str, list[str]]:
    """The FCOS head's flat output names per kind, levels P3..P5 in order:
    {"det_cls": [<prefix>det_cls_p3, ...], "det_ltrb": [...], "det_ctr": [...]}."""
    return {kind: [f"{prefix}{kind}_p{s.bit_length() - 1}" for s in DET_STRIDES]
            for kind in ("det_cls", "det_ltrb", "det_ctr")}


def output_names(heads: frozenset[str] | set[str], bev: bool = False) -> list[str]:
    """Flat output names, in the order of `ExportWrapper.forward`."""
    heads = frozenset(heads)
    names: list[str] = []
    if "detection" in heads:
        for kind_names in detection_output_names().values():
            names += kind_names
    if "segmentation" in heads:
        names.append("seg")
    if "depth" in heads:
        names.append("depth")
    if bev:
        names.append("bev_occ")
    return names


class ExportWrapper(nn.Module):
    """The model's forward for one fixed head set, returning a flat tuple (ONNX-friendly)."""

    def __init__(self, model: MultiTaskPerceptionModel, heads: frozenset[str]) -> None:
        super().__init__()
        self.model = model
        self.heads = frozenset(heads)

    def forward(self, images: torch.Tensor, points: torch.Tensor | None = None,
                T_cam_from_base: torch.Tensor | None = None, K: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, ...]:
        cams = None if T_cam_from_base is None or K is None else (T_cam_from_base, K)
        out = self.model(images, self.heads, points=points, cameras=cams)
        flat: list[torch.Tensor] = []
        if "detection" in self.heads:
            for kind in ("det_cls", "det_ltrb", "det_ctr"):
                flat += list(out[kind])
        for key in ("seg", "depth", "bev_occ"):
            if key in out:
                flat.append(out[key])  # type: ignore[arg-type]
        return tuple(flat)


def export_onnx(model: MultiTaskPerceptionModel, path: str | Path,
                heads: frozenset[str] | set[str] | None = None,
                image_hw: tuple[int, int] = (640, 640), images_per_call: int = 1,
                lidar_points: int = 0, opset: int = ONNX_OPSET) -> list[str]:
    """Export the fp32 forward (fixed head set and shapes) to ONNX at `path`.

    Inputs: "images" [images_per_call, 3, H, W] uint8 and, with a BEV model and
    lidar_points > 0, "points" [1, lidar_points, 3] float32 m, "T_cam_from_base"
    [images_per_call, 4, 4] and "K" [images_per_call, 3, 3] px (the BEV block's geometric
    lift). Returns the output names.
    """
    heads = model.enabled_heads if heads is None else frozenset(heads)
    if not heads or not heads <= model.enabled_heads:
        raise ValueError(f"parameter 'heads' = {sorted(heads)}: must be a non-empty subset of "
                         f"{sorted(model.enabled_heads)} (known: {HEAD_NAMES})")
    bev = model.bev is not None and lidar_points > 0
    was_training = model.training
    # the wrapper must be in eval mode too: export restores the *wrapper's* mode afterwards,
    # which would otherwise switch the model (BatchNorm) to training
    wrapper = ExportWrapper(model, heads).eval()
    images = torch.zeros((images_per_call, 3, *image_hw), dtype=torch.uint8)
    args: tuple[torch.Tensor, ...] = (images,)
    inputs = ["images"]
    if bev:
        n = images_per_call
        args = (images, torch.zeros((1, lidar_points, 3)), torch.eye(4).repeat(n, 1, 1),
                torch.eye(3).repeat(n, 1, 1))
        inputs += ["points", "T_cam_from_base", "K"]
    names = output_names(heads, bev)
    with torch.no_grad():
        torch.onnx.export(wrapper, args, str(path), input_names=inputs, output_names=names,
                          opset_version=opset, dynamo=False)
    model.train(was_training)
    return names


# fields of PerceptionConfig that only the post-processing reads (thresholds, slots): they are
# not in the exported forward, so changing them at run time must not change the engine key
_POSTPROCESS_FIELDS = ("score_threshold", "nms_iou", "max_detections", "pre_nms_top_k")


def model_hash(model: nn.Module) -> str:
    """sha256 over the forward's config (the post-processing fields left out) and every
    state-dict tensor (name, dtype, shape, bytes)."""
    cfg = getattr(model, "config", None)
    if dataclasses.is_dataclass(cfg):
        # canonical JSON, not repr(): a frozenset (the heads) prints in an order that changes
        # with each process's string-hash seed, and the build script and the node are two
        # processes that must compute the same key
        fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                  if f.name not in _POSTPROCESS_FIELDS}
        text = json.dumps({k: sorted(v) if isinstance(v, (set, frozenset)) else v
                           for k, v in fields.items()}, sort_keys=True, default=str)
    else:
        text = repr(cfg)
    h = hashlib.sha256(text.encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def engine_cache_key(model_sha: str, gpu_name: str, trt_version: str, precision: str,
                     shapes: dict[str, tuple[int, ...]]) -> str:
    """Key of a TensorRT engine: any change of model, GPU, TensorRT, precision or an input
    shape gives another key (first 24 hex chars of a sha256 over a canonical JSON)."""
    if precision not in PRECISIONS:
        raise ValueError(f"parameter 'precision' = {precision!r}: must be one of {PRECISIONS}")
    for field, value in (("model_sha", model_sha), ("gpu_name", gpu_name),
                         ("trt_version", trt_version)):
        if not value:
            raise ValueError(f"parameter '{field}' = {value!r}: must be non-empty")
    canon = json.dumps({"model": model_sha, "gpu": gpu_name.strip(), "trt": trt_version,
                        "precision": precision,
                        "shapes": {k: list(map(int, v)) for k, v in sorted(shapes.items())}},
                       sort_keys=True)
    return hashlib.sha256(canon.encode()).hexdigest()[:24]


def perception_engine_key(model: nn.Module, heads: frozenset[str] | set[str], images: int,
                          image_hw: tuple[int, int], precision: str, gpu_name: str,
                          trt_version: str) -> str:
    """The key of the engine of `model`'s forward for one head set and input shape, as the
    build step (`kestrel_models.perception.build_engine`) writes it and the runtime looks it
    up: model hash + head set + torch and ONNX opset versions (the export) + GPU + TensorRT
    version + precision + the images' shape [images, 3, H, W]."""
    identity = (f"{model_hash(model)}|heads={','.join(sorted(heads))}"
                f"|torch={torch.__version__}|opset={ONNX_OPSET}")
    return engine_cache_key(identity, gpu_name, trt_version, precision,
                            {"images": (int(images), 3, int(image_hw[0]), int(image_hw[1]))})


def build_command(heads: frozenset[str] | set[str], images: int, image_hw: tuple[int, int],
                  precision: str, cache_dir: str | Path, config: object | None = None) -> str:
    """The `kestrel_models.perception.build_engine` command line that builds the engine for these
    settings (named in the error when the runtime finds none)."""
    cmd = (f"python -m kestrel_models.perception.build_engine --cameras {images} --image-hw "
           f"{image_hw[0]} "
           f"{image_hw[1]} --precision {precision} --heads {' '.join(sorted(heads))} "
           f"--cache-dir {cache_dir}")
    if dataclasses.is_dataclass(config):
        for f in ENGINE_CONFIG_FIELDS:
            cmd += f" --{f.replace('_', '-')} {getattr(config, f)}"
    return cmd + " --weights <your state dict>"


def engine_path(cache_dir: str | Path, key: str) -> Path:
    return Path(cache_dir) / f"perception_{key}.engine"


def find_engine(cache_dir: str | Path, key: str) -> Path:
    """Path of the cached engine for `key`; raises EngineMissingError (never builds)."""
    p = engine_path(cache_dir, key)
    if not p.is_file():
        raise EngineMissingError(f"no TensorRT engine for key {key} in {cache_dir}: build it "
                                 "offline with python -m kestrel_models.perception.build_engine "
                                 "(never at node start)")
    return p
