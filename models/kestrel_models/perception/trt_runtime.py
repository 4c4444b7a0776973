"""The perception forward from a prebuilt TensorRT engine (runtime option `engine: tensorrt`).

The engine comes from the offline build step (`python -m
kestrel_models.perception.build_engine`: ONNX export of the fp32 forward for one head set and
one images shape, then TensorRT at a precision). At configure the runtime computes the same key
(`export.perception_engine_key`: model hash + head set + torch / opset + GPU + TensorRT version
+ precision + shape) from the model it was given and LOOKS UP the engine: a missing one fails
configure with the build command, it is never built here.

Per call: the images (uint8 [N, 3, H, W], already on the device) are bound in place, every
output goes into a tensor allocated at configure, `execute_async_v3` runs on the caller's
current CUDA stream (no host synchronisation here), and the flat outputs come back as the
model's dict (det_cls / det_ltrb / det_ctr lists over P3-P5, seg, depth), so the post-
processing, LiDAR fusion and result message are the ones of the torch variants. Head sets
other than the engine's are its subsets: the engine runs whole and the dict holds only the
asked heads (the engine is built for the node's full head set by default).

Not in an engine: the BEV block (its ONNX takes the LiDAR cloud; not wired here), and a user's
own model (`model.path`: bring its engine through its own TensorRT runtime instead).
No machine of this project has TensorRT: this module is tested against a stand-in `tensorrt`
whose "engine" runs the exported ONNX in onnxruntime, on host memory (models/tests/
test_perception_trt.py); a real engine has not been run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..trt import TensorRTUnavailableError, tensorrt_version
from .export import (EngineMissingError, build_command, detection_output_names, find_engine,
                     output_names, perception_engine_key)
from .model import MultiTaskPerceptionModel

_TORCH_DTYPES = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16,
                 "INT32": torch.int32, "INT64": torch.int64, "UINT8": torch.uint8,
                 "BOOL": torch.bool}


def _require_cuda(device: torch.device, what: str) -> None:
    """TensorRT runs on CUDA only (the CPU tests replace this check with a stand-in engine
    that reads host memory)."""
    if device.type != "cuda":
        raise ValueError(f"{what}: needs parameter 'device' = 'cuda', got {str(device)!r}")


def default_engine_dir() -> str:
    return str(Path.home() / ".cache" / "kestrel" / "trt")


class TensorRTPerceptionModel:
    """`__call__(images, heads, points=None)` -> the model's output dict, from the engine of
    `model` (see the module docstring). Raises ValueError naming `what` (the option) when
    TensorRT is absent, the engine is missing (with the build command) or does not match."""

    def __init__(self, model: MultiTaskPerceptionModel, heads: frozenset[str], images: int,
                 image_hw: tuple[int, int], precision: str, device: torch.device,
                 engine_dir: str = "", gpu_name: str | None = None,
                 what: str = "parameter 'engine' = 'tensorrt'") -> None:
        try:
            version = tensorrt_version()
        except TensorRTUnavailableError as exc:
            raise ValueError(f"{what}: {exc}") from None
        if model.config.bev:
            raise ValueError(f"{what}: the BEV block is not part of the engine runtime; use a "
                             "torch variant for a BEV model")
        self.heads, self.device = frozenset(heads), torch.device(device)
        _require_cuda(self.device, what)
        self.config = model.config
        self.enabled_heads = self.heads
        directory = engine_dir or default_engine_dir()
        if gpu_name is None:
            gpu_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" \
                else "cpu"
        key = perception_engine_key(model, self.heads, images, image_hw, precision, gpu_name,
                                    version)
        try:
            path = find_engine(directory, key)
        except EngineMissingError as exc:
            cmd = build_command(self.heads, images, image_hw, precision, directory,
                                model.config)
            raise ValueError(f"{what}: {exc}. Build it with: {cmd}") from None
        import tensorrt as trt  # type: ignore[import-not-found]

        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self._engine = self._runtime.deserialize_cuda_engine(path.read_bytes())
        if self._engine is None:
            raise ValueError(f"{what}: the engine {path} could not be deserialised (TensorRT "
                             f"{version}; delete it and build it again)")
        self._ctx = self._engine.create_execution_context()
        self.engine_path, self.key = str(path), key
        self.names = output_names(self.heads)
        self.input_shape = (int(images), 3, int(image_hw[0]), int(image_hw[1]))
        have = {self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)}
        missing = [n for n in ("images", *self.names) if n not in have]
        if missing:
            raise ValueError(f"{what}: the engine {path} has no tensor(s) {missing} (it has "
                             f"{sorted(have)})")
        got = tuple(self._engine.get_tensor_shape("images"))
        if got != self.input_shape:
            raise ValueError(f"{what}: the engine's images are {got}, the runtime's "
                             f"{self.input_shape}")
        # outputs: allocated once, bound once (their addresses never change)
        self.outputs: dict[str, torch.Tensor] = {}
        for n in self.names:
            shape = tuple(int(d) for d in self._engine.get_tensor_shape(n))
            dtype = _TORCH_DTYPES.get(str(self._engine.get_tensor_dtype(n)).split(".")[-1],
                                      torch.float32)
            self.outputs[n] = torch.empty(shape, dtype=dtype, device=self.device)
            self._ctx.set_tensor_address(n, self.outputs[n].data_ptr())
        self._bound_images = 0

    def __call__(self, images: torch.Tensor, heads: frozenset[str] | None = None,
                 points: torch.Tensor | None = None, cameras: object = None
                 ) -> dict[str, object]:
        """images [N, 3, H, W] uint8 on the device -> the model's dict for `heads` (a subset
        of the engine's; outputs are the configure-time buffers, valid until the next call).
        points / cameras: the runtime's LiDAR inputs, used only by the BEV block, which an
        engine model does not have (refused at configure)."""
        hs = self.heads if heads is None else frozenset(heads)
        if not hs <= self.heads:
            raise ValueError(f"heads {sorted(hs)}: the engine has {sorted(self.heads)}")
        if images.dtype != torch.uint8 or tuple(images.shape) != self.input_shape:
            raise ValueError(f"images: expected uint8 {self.input_shape}, got {images.dtype} "
                             f"{tuple(images.shape)}")
        images = images.contiguous()
        ptr = images.data_ptr()
        if ptr != self._bound_images:  # the runtime's static buffer: bound once
            self._ctx.set_tensor_address("images", ptr)
            self._bound_images = ptr
        stream = torch.cuda.current_stream(self.device).cuda_stream \
            if self.device.type == "cuda" else 0
        if not self._ctx.execute_async_v3(stream):
            raise RuntimeError("TensorRT execute_async_v3 failed")
        o, out = self.outputs, {}
        if "detection" in hs:
            for kind, names in detection_output_names().items():
                out[kind] = [o[n] for n in names]
        if "segmentation" in hs:
            out["seg"] = o["seg"]
        if "depth" in hs:
            out["depth"] = o["depth"]
        return out

    # the runtime treats its model as an nn.Module in a few places
    def eval(self) -> TensorRTPerceptionModel:
        return self
