"""A user's own multi-task perception model (TorchScript, ExportedProgram or ONNX) behind a
declared output contract, callable like `MultiTaskPerceptionModel` (no rclpy).

The contract names which of the model's outputs plays which role (any subset; a role left out
switches its head off):
  boxes   [B, N, 4] float, x1 y1 x2 y2 in input-image pixels   } decoded detections, before
  scores  [B, N]    float in [0, 1]                             } score threshold and NMS
  labels  [B, N]    int class index in [0, num_classes)         } (Kestrel applies both)
  seg     [B, K, h, w] class logits (K = num_classes; any h, w: resized to the input size)
  depth   [B, 1, h, w] metric depth, m (any h, w: resized to the input size)
  fcos    the reference FCOS head's raw maps, as `export.export_onnx` names them: the value
          is a name prefix ('' for the export's own names), the outputs <prefix>det_cls_p3..p5
          [B, num_classes - 1 (background excluded), h_l, w_l] logits, <prefix>det_ltrb_p3..p5
          [B, 4, h_l, w_l] px and <prefix>det_ctr_p3..p5 [B, 1, h_l, w_l] logits; decoded
          and NMSed like the reference model (so an exported reference model runs in ONNX
          Runtime: `model.outputs: ['fcos:', 'seg:seg', 'depth:depth']`)
Input: one tensor [B, 3, H, W] (`input_name` for ONNX), RGB, in `input_format`:
  uint8    0..255 uint8 (the model normalises itself)
  float01  float32 in [0, 1]
  imagenet float32 (x / 255 - mean) / std with the ImageNet mean/std
Boxes, scores and labels come together (all three or none), and not with fcos. Everything
is checked once at load (`check`): a missing output, a wrong rank or size, a class count that
does not match fails with a ValueError naming the parameter and the value, before the node
goes active.

Formats: "torchscript" (torch.jit.save; .pt/.ts/.jit), "exported_program" (torch.export.save;
.pt2) and "onnx" (onnxruntime; CUDA provider when the device is cuda and it is available);
"auto" picks by file extension. The wrapper returns the keys the core's device region reads:
det_boxes / det_scores / det_labels / seg / depth.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .export import detection_output_names

__all__ = ["FORMATS", "INPUT_FORMATS", "OutputContract", "ExternalPerceptionModel",
           "parse_outputs", "resolve_format"]

FORMATS = ("auto", "torchscript", "exported_program", "onnx")
INPUT_FORMATS = ("uint8", "float01", "imagenet")
ROLES = ("boxes", "scores", "labels", "seg", "depth", "fcos")
# output names of the `fcos` role: the reference head's, as export_onnx names them
fcos_names = detection_output_names
_EXT = {".pt": "torchscript", ".ts": "torchscript", ".jit": "torchscript",
        ".pt2": "exported_program", ".onnx": "onnx"}
_MEAN = (0.485, 0.456, 0.406)
_STD = (0.229, 0.224, 0.225)


def _fail(name: str, value: object, why: str) -> ValueError:
    return ValueError(f"parameter '{name}' = {value!r}: {why}")


def resolve_format(path: str, fmt: str) -> str:
    """The format of a model file: `fmt`, or with "auto" the one its extension names.
    Raises ValueError naming model.format."""
    if fmt not in FORMATS:
        raise _fail("model.format", fmt, f"must be one of {FORMATS}")
    if fmt != "auto":
        return fmt
    found = _EXT.get(Path(path).suffix.lower(), "")
    if not found:
        raise _fail("model.format", "auto", f"cannot tell the format of '{Path(path).name}' "
                    f"(extensions {sorted(_EXT)}); set model.format")
    return found


def parse_outputs(items: list[str] | tuple[str, ...]) -> dict[str, str]:
    """['boxes:dets', 'scores:conf', ...] (role:output_name) -> {role: output_name}."""
    out: dict[str, str] = {}
    for item in items:
        role, sep, name = str(item).partition(":")
        role, name = role.strip(), name.strip()
        if not sep or role not in ROLES or (not name and role != "fcos"):
            raise _fail("model.outputs", list(items),
                        f"each entry must be '<role>:<output name>' with role in {ROLES}")
        if role in out:
            raise _fail("model.outputs", list(items), f"role '{role}' given twice")
        out[role] = name
    det = {"boxes", "scores", "labels"} & out.keys()
    if det and len(det) != 3:
        raise _fail("model.outputs", list(items), "boxes, scores and labels come together")
    if det and "fcos" in out:
        raise _fail("model.outputs", list(items), "decoded boxes or the raw fcos maps, not "
                    "both")
    if not out:
        raise _fail("model.outputs", list(items), "names no output: the model would do nothing")
    return out


@dataclass(frozen=True)
class OutputContract:
    outputs: dict[str, str]  # role -> the model's output name (see the module docstring)
    input_name: str = "images"
    input_format: str = "uint8"

    def __post_init__(self) -> None:
        if self.input_format not in INPUT_FORMATS:
            raise _fail("model.input_format", self.input_format, f"must be one of "
                        f"{INPUT_FORMATS}")

    @property
    def heads(self) -> frozenset[str]:
        """The reference model's head names this contract provides."""
        h = set()
        if "boxes" in self.outputs or "fcos" in self.outputs:
            h.add("detection")
        if "seg" in self.outputs:
            h.add("segmentation")
        if "depth" in self.outputs:
            h.add("depth")
        return frozenset(h)


class ExternalPerceptionModel:
    """Loads the file once; `__call__(images uint8 [B,3,H,W] on the device, heads)` -> dict."""

    def __init__(self, path: str, fmt: str, contract: OutputContract,
                 device: torch.device | str = "cpu") -> None:
        p = Path(path)
        if not p.is_file():
            raise _fail("model.path", path, "file not found")
        fmt = resolve_format(path, fmt)
        self.path, self.format, self.contract = str(p), fmt, contract
        self.device = torch.device(device)
        self.heads = contract.heads
        self._names: list[str] = []  # output names in the model's order (torch formats)
        self.host_outputs: list[str] = []  # outputs the model returns off the device (check())
        try:
            if fmt == "torchscript":
                self._fn = torch.jit.load(str(p), map_location=self.device).eval()
            elif fmt == "exported_program":
                self._fn = self._exported_program(str(p))
            else:
                self._fn = self._onnx_runtime_model(str(p))
        except ValueError:
            raise
        except Exception as exc:  # any load failure is a parameter error
            msg = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
            raise _fail("model.path", path, f"cannot load as {fmt}: {msg}") from exc

    def _exported_program(self, path: str):
        """An ExportedProgram's module on the device. Why not `.module().to(device)`: the
        graph keeps the export's device as constants (`_assert_tensor_metadata(device=cpu)`
        checks, tensors made with a device argument), so a CPU-exported file moved that way
        fails, or returns CPU outputs, on CUDA. `move_to_device_pass` rewrites them."""
        ep = torch.export.load(path)
        if self.device.type != "cpu":
            from torch.export.passes import move_to_device_pass

            ep = move_to_device_pass(ep, self.device)
        return ep.module()

    def _onnx_runtime_model(self, path: str):
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise _fail("model.format", "onnx", "onnxruntime is not installed") from exc
        providers = ["CPUExecutionProvider"]
        if self.device.type == "cuda" and "CUDAExecutionProvider" in \
                ort.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        sess = ort.InferenceSession(path, providers=providers)
        inputs = [i.name for i in sess.get_inputs()]
        if self.contract.input_name not in inputs:
            raise _fail("model.input_name", self.contract.input_name,
                        f"the ONNX model's inputs are {inputs}")
        self._names = [o.name for o in sess.get_outputs()]
        return sess

    # ---- running ---------------------------------------------------------------------------
    def _prepare(self, images: torch.Tensor) -> torch.Tensor:
        fmt = self.contract.input_format
        if fmt == "uint8":
            return images.contiguous()
        x = images.float().div_(255.0)
        if fmt == "imagenet":
            mean = torch.tensor(_MEAN, device=x.device).view(1, 3, 1, 1)
            std = torch.tensor(_STD, device=x.device).view(1, 3, 1, 1)
            x = (x - mean) / std
        return x.contiguous()

    def _named_outputs(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Run the model; returns {output name: tensor} where the model left it (ONNX
        Runtime: on the host)."""
        if self.format == "onnx":
            res = self._fn.run(None, {self.contract.input_name: x.cpu().numpy()})
            return {n: torch.from_numpy(r) for n, r in zip(self._names, res, strict=True)}
        with torch.inference_mode():
            out = self._fn(x)
        if isinstance(out, torch.Tensor):
            out = (out,)
        # tuple/list outputs are named output0, output1, ... (also the usual ONNX names)
        return dict(out) if isinstance(out, dict) else {f"output{i}": t
                                                       for i, t in enumerate(out)}

    def _on_device(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every output on the device. A torch model that makes an output with a fixed device
        (torch.tensor(..., device="cpu")) would hand the core host tensors: moved here (a
        no-op when already on the device); check() names such outputs at load so the copy
        is a known cost, not a surprise."""
        return {n: t.to(self.device) if isinstance(t, torch.Tensor) else t
                for n, t in named.items()}

    def _raw_outputs(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Run the model; returns {output name: tensor on the device}."""
        return self._on_device(self._named_outputs(x))

    def __call__(self, images: torch.Tensor, heads: frozenset[str] | None = None
                 ) -> dict[str, torch.Tensor]:
        """images: [B,3,H,W] uint8 on the device -> the core's raw dict (see the docstring)."""
        heads = self.heads if heads is None else frozenset(heads) & self.heads
        h, w = int(images.shape[-2]), int(images.shape[-1])
        got = self._raw_outputs(self._prepare(images))
        o = self.contract.outputs
        raw: dict[str, torch.Tensor] = {}
        if "detection" in heads and "fcos" in o:  # raw maps: the reference decode
            for kind, names in fcos_names(o["fcos"]).items():
                raw[kind] = [got[n].float() for n in names]  # type: ignore[assignment]
        elif "detection" in heads:
            raw["det_boxes"] = got[o["boxes"]].float()
            raw["det_scores"] = got[o["scores"]].float()
            raw["det_labels"] = got[o["labels"]].long()
        for role, key, mode in (("seg", "segmentation", "bilinear"), ("depth", "depth",
                                                                        "bilinear")):
            if key in heads:
                t = got[o[role]].float()
                if tuple(t.shape[-2:]) != (h, w):
                    t = F.interpolate(t, size=(h, w), mode=mode, align_corners=False)
                raw[role] = t
        return raw

    def _check_fcos(self, got: dict[str, torch.Tensor], batch: int, num_classes: int) -> str:
        """Why the raw FCOS maps do not fit the reference decode ('' if they do)."""
        names = fcos_names(self.contract.outputs["fcos"])
        for lv, (c, b, z) in enumerate(zip(*names.values(), strict=True)):
            sc, sb, sz = (tuple(got[n].shape) for n in (c, b, z))
            if len(sc) != 4 or sc[0] != batch or sc[1] != num_classes - 1:
                return (f"{c} has shape {sc}, expected [{batch}, {num_classes - 1} classes "
                        "(background excluded), h, w]")
            if sb != (batch, 4, *sc[2:]) or sz != (batch, 1, *sc[2:]):
                return (f"{b} {sb} / {z} {sz} must be [{batch}, 4 / 1, {sc[2]}, {sc[3]}] like "
                        f"{c} (level P{3 + lv})")
        return ""


    def check(self, batch: int, image_hw: tuple[int, int], num_classes: int) -> None:
        """Run once on zeros and validate every declared output (names, ranks, sizes)."""
        h, w = image_hw
        x = torch.zeros((batch, 3, h, w), dtype=torch.uint8, device=self.device)
        try:
            named = self._named_outputs(self._prepare(x))
        except Exception as exc:
            msg = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
            raise _fail("model.path", self.path, f"fails on a [{batch}, 3, {h}, {w}] "
                        f"{self.contract.input_format} input: {msg}") from exc
        got = self._on_device(named)
        outs = [(r, n) for r, n in self.contract.outputs.items() if r != "fcos"]
        if "fcos" in self.contract.outputs:
            outs += [("fcos", n) for names in fcos_names(self.contract.outputs["fcos"]).values()
                     for n in names]
        for role, name in outs:
            if name not in got:
                raise _fail("model.outputs", [f"{r}:{n}" for r, n in outs],
                            f"output '{name}' ({role}) not found; the model returns "
                            f"{sorted(got)}")
        # the declared outputs a torch-format model itself returns off the device (copied
        # there every frame); ONNX Runtime's host outputs are its known cost, not listed
        self.host_outputs = [] if self.format == "onnx" else [
            n for _, n in outs if isinstance(named[n], torch.Tensor)
            and named[n].device.type != self.device.type]  # (cuda vs cuda:0: the same)
        o, shape = self.contract.outputs, {r: tuple(got[n].shape) for r, n in outs
                                           if r != "fcos"}
        why = self._check_fcos(got, batch, num_classes) if "fcos" in o else ""
        if "boxes" in o:
            b, s, lab = shape["boxes"], shape["scores"], shape["labels"]
            if len(b) != 3 or b[0] != batch or b[2] != 4:
                why = f"boxes has shape {b}, expected [{batch}, N, 4]"
            elif s != b[:2] or lab != b[:2]:
                why = f"scores {s} and labels {lab} must be [{batch}, {b[1]}] like boxes"
        if not why and "seg" in o:  # (after fcos)
            sg = shape["seg"]
            if len(sg) != 4 or sg[0] != batch or sg[1] != num_classes:
                why = f"seg has shape {sg}, expected [{batch}, {num_classes} classes, h, w]"
        if not why and "depth" in o:
            d = shape["depth"]
            if len(d) != 4 or d[0] != batch or d[1] != 1:
                why = f"depth has shape {d}, expected [{batch}, 1, h, w]"
        if why:
            raise _fail("model.outputs", [f"{r}:{n}" for r, n in outs], why)
