"""The reference model's forward in ONNX Runtime (runtime option `engine: onnxruntime`).

At configure the fp32 forward is exported to ONNX (`export.export_onnx`: the runtime's head
set and images shape, fixed) into a temporary file, loaded by ONNX Runtime (the CUDA provider
on a CUDA device when installed, else the CPU one) and the file removed. Per call the images go
in, and the raw FCOS maps, seg and depth come back as the model's dict, so the post-processing,
LiDAR fusion and result message are the torch runtime's (it runs through the same
wrapper as a user's ONNX model, `external.ExternalPerceptionModel`, role `fcos`).
Not exported: the BEV block (its ONNX would take the LiDAR cloud; not wired here).
"""

from __future__ import annotations

import os
import tempfile
import warnings

import torch

from .export import export_onnx
from .external import ExternalPerceptionModel, OutputContract
from .model import MultiTaskPerceptionModel


class OnnxRuntimePerceptionModel:
    """`__call__(images, heads, points=None, cameras=None)` -> the model's output dict."""

    def __init__(self, model: MultiTaskPerceptionModel, heads: frozenset[str], images: int,
                 image_hw: tuple[int, int], device: torch.device,
                 what: str = "parameter 'engine' = 'onnxruntime'") -> None:
        if model.config.bev:
            raise ValueError(f"{what}: the BEV block is not exported; use the torch engine "
                             "for a BEV model")
        self.heads = self.enabled_heads = frozenset(heads)
        self.config = model.config
        self.device = torch.device(device)
        self.input_shape = (int(images), 3, int(image_hw[0]), int(image_hw[1]))
        roles = {"fcos": ""} if "detection" in self.heads else {}
        roles.update({r: r for r, h in (("seg", "segmentation"), ("depth", "depth"))
                      if h in self.heads})
        fd, path = tempfile.mkstemp(suffix=".onnx", prefix="kestrel_perception_")
        os.close(fd)
        try:
            with warnings.catch_warnings():  # the tracer's notes on the shape checks
                warnings.simplefilter("ignore")
                export_onnx(_on_cpu(model), path, self.heads, self.input_shape[2:],
                            int(images))
            self._ext = ExternalPerceptionModel(path, "onnx", OutputContract(roles),
                                                self.device)
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from None
        finally:
            os.unlink(path)

    def __call__(self, images: torch.Tensor, heads: frozenset[str] | None = None,
                 points: torch.Tensor | None = None, cameras: object = None
                 ) -> dict[str, object]:
        """images [N, 3, H, W] uint8 (the configured shape) -> the dict for `heads` (a subset
        of the exported ones). points / cameras: only the BEV block's (refused above)."""
        hs = self.heads if heads is None else frozenset(heads)
        if not hs <= self.heads:
            raise ValueError(f"heads {sorted(hs)}: the exported model has {sorted(self.heads)}")
        if images.dtype != torch.uint8 or tuple(images.shape) != self.input_shape:
            raise ValueError(f"images: expected uint8 {self.input_shape}, got {images.dtype} "
                             f"{tuple(images.shape)}")
        return self._ext(images, hs)  # type: ignore[return-value]

    # the runtime treats its model as an nn.Module in a few places
    def eval(self) -> OnnxRuntimePerceptionModel:
        return self


def _on_cpu(model: MultiTaskPerceptionModel) -> MultiTaskPerceptionModel:
    """The model for the export: a CPU copy when it lives on another device (the export
    traces on the CPU), else the model itself (export_onnx restores its train/eval mode)."""
    if next(model.parameters()).device.type == "cpu":
        return model
    import copy

    return copy.deepcopy(model).cpu()
