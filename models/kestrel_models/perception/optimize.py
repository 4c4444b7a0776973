"""Configure-time graph transforms of a `MultiTaskPerceptionModel` that keep its outputs.

Each transform rewrites modules of the runtime's own copy of the model (never the user's model
or state dict) into an equivalent form that runs faster on GPU tensor cores: outputs are equal
in fp32 up to summation order (allclose 1e-5 on the tiny config), bf16-close after a cast.

- stem "pad4"/"pad8": the 7x7 stem conv takes its 3 input channels padded with zero channels
  (zero weights), so cuDNN needs no `nhwcAddPadding` pass and can use an aligned kernel; the pad
  sits in the conv's forward, i.e. inside the compiled region, where inductor fuses it with the
  uint8 -> float normalisation (one kernel writes the padded tensor).
- stem "s2d": the 7x7 stride-2 stem as an exact 4x4 stride-1 conv over a space-to-depth(2)
  input (MLPerf ResNet trick): 3 -> 12 channels (padded to 16), kernel padded 7 -> 8 with zeros.
- stem "s2d4": the same over a space-to-depth(4) input: 3 -> 48 channels, a 3x3 conv with 4x the
  filters (each input block gives 2x2 outputs of the original conv), then a pixel shuffle
  (fused by inductor into the max-pool that follows). Why: the s2d(2) stem is a 4x4 conv with
  64 filters over 16 channels, a GEMM too narrow to fill tensor cores; this one is 256
  filters x 432 inputs.
- pad_outputs=m: every conv whose output-channel count is not a multiple of m gets zero filters
  appended; its output is sliced back (a view, inside the compiled region).
- fcos "merged": the FCOS head's cls and box towers' first convs (same input) become one conv
  with 2x the filters plus one GroupNorm with 2x the groups (== two GNs, exactly); the box and
  centerness predictions (same input) become one 5-filter conv.
- fcos "grouped": "merged" and the rest of both towers as groups=2 convs (+ one GN each), and
  one block-diagonal prediction conv for class, box and centerness: 5 convs + 4 GNs per level
  instead of 11 convs + 8 GNs (4-conv towers).
- conv_act "cudnn": every BN-folded ResNet block's convs run with their bias, residual add and
  ReLU in cuDNN's epilogue (`conv_act.py`; CUDA only, the unfused ops elsewhere).
- fuse_stem: the same for the stem conv (bias + ReLU; with "s2d", the space-to-depth input
  is built first, then the one fused conv).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .conv_act import fuse_residual_blocks, fuse_stem
from .heads import FCOSHead, box_distances, fcos_levels

STEMS = ("plain", "pad4", "pad8", "s2d", "s2d4")
FCOS_MODES = ("plain", "merged", "grouped")
CONV_ACTS = ("plain", "cudnn")


@dataclass(frozen=True)
class OptimizeSpec:
    """Which output-preserving transforms `optimize_model` applies (defaults: none)."""

    stem: str = "plain"  # "plain", "pad4", "pad8" (input channels 3 -> 4/8), "s2d", "s2d4"
    pad_outputs: int = 0  # pad conv output channels to a multiple of this (0 = off)
    fcos: str = "plain"  # "plain", "merged", "grouped" (see the module docstring)
    conv_act: str = "plain"  # "plain", "cudnn" (trunk conv epilogues fused; needs fold_bn)
    fuse_stem: bool = False  # the stem conv's bias + ReLU in cuDNN's epilogue (needs fold_bn)

    def __post_init__(self) -> None:
        if self.stem not in STEMS:
            raise ValueError(f"parameter 'stem' = {self.stem!r}: must be one of {STEMS}")
        if self.pad_outputs < 0 or self.pad_outputs > 128:
            raise ValueError(f"parameter 'pad_outputs' = {self.pad_outputs!r}: must be in "
                             "[0, 128] (0 = off)")
        if self.fcos not in FCOS_MODES:
            raise ValueError(f"parameter 'fcos' = {self.fcos!r}: must be one of {FCOS_MODES}")
        if self.conv_act not in CONV_ACTS:
            raise ValueError(f"parameter 'conv_act' = {self.conv_act!r}: must be one of "
                             f"{CONV_ACTS}")

    @property
    def active(self) -> bool:
        return self.stem != "plain" or self.pad_outputs > 1 or self.fcos != "plain" or \
            self.conv_act != "plain" or self.fuse_stem


def _new_conv(cls: type[nn.Conv2d], like: nn.Conv2d, cin: int, cout: int, kernel: tuple,
              stride: tuple, padding: tuple, groups: int = 1, bias: bool = False) -> nn.Conv2d:
    """A zero-initialised conv of class `cls` on the device/dtype of `like`."""
    conv = cls(cin, cout, kernel, stride=stride, padding=padding, groups=groups, bias=bias,
               device=like.weight.device, dtype=like.weight.dtype)
    with torch.no_grad():
        conv.weight.zero_()
        if conv.bias is not None:
            conv.bias.zero_()
    return conv


def _check_plain(conv: nn.Conv2d, what: str) -> None:
    if conv.padding_mode != "zeros" or conv.dilation != (1, 1) or isinstance(conv.padding, str):
        raise ValueError(f"{what}: needs zero padding given as numbers and dilation 1, got "
                         f"{conv.padding_mode!r}, {conv.padding!r}, {conv.dilation!r}")


class ChannelPadConv2d(nn.Conv2d):
    """Conv over x [B, c, H, W] with c <= in_channels: zero channels appended to the input,
    whose filters are zero (same output as the unpadded conv)."""

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, channels: int) -> ChannelPadConv2d:
        _check_plain(conv, "stem padding")
        if conv.groups != 1 or channels < conv.in_channels:
            raise ValueError(f"parameter 'stem' channels = {channels}: must be >= the conv's "
                             f"{conv.in_channels} input channels (groups 1)")
        new = _new_conv(cls, conv, channels, conv.out_channels, conv.kernel_size, conv.stride,
                        conv.padding, bias=conv.bias is not None)
        with torch.no_grad():
            new.weight[:, : conv.in_channels].copy_(conv.weight)
            if conv.bias is not None:
                new.bias.copy_(conv.bias)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.prepare_input(x))

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        """[B, c, H, W] -> [B, in_channels, H, W] (zero channels appended)."""
        pad = self.in_channels - x.shape[1]
        if pad:
            x = F.pad(x, (0, 0, 0, 0, 0, pad))
        if self.weight.is_contiguous(memory_format=torch.channels_last):
            x = x.contiguous(memory_format=torch.channels_last)
        return x


class SpaceToDepthConv2d(nn.Conv2d):
    """A stride-2 conv (e.g. the 7x7/2 ResNet stem) as a stride-1 conv over space-to-depth(2)
    input: x [B, c, H, W] -> pad -> [B, 4c (zero-padded to in_channels), H'/2, W'/2] -> conv
    with ceil(k/2) taps. Exact: the kernel is zero-padded to an even size, taps regrouped."""

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, multiple: int = 8) -> SpaceToDepthConv2d:
        _check_plain(conv, "stem 's2d'")
        if conv.stride != (2, 2) or conv.groups != 1:
            raise ValueError(f"stem 's2d': needs a stride-2 conv with groups 1, got stride "
                             f"{conv.stride}, groups {conv.groups}")
        c = conv.in_channels
        # front pad of the input q = padding rounded up to even; the kernel gets q - p zeros
        # in front and is padded to an even size K'
        q = tuple(p + p % 2 for p in conv.padding)
        kp = tuple(k + (qq - p) for k, qq, p in zip(conv.kernel_size, q, conv.padding,
                                                     strict=True))
        kp = tuple(k + k % 2 for k in kp)
        cin = math.ceil(4 * c / multiple) * multiple
        new = _new_conv(cls, conv, cin, conv.out_channels, (kp[0] // 2, kp[1] // 2), (1, 1),
                        (0, 0), bias=conv.bias is not None)
        new.src_channels, new.front, new.src_kernel = c, q, conv.kernel_size
        new.src_padding = conv.padding
        w = torch.zeros(conv.out_channels, c, kp[0], kp[1], dtype=conv.weight.dtype,
                        device=conv.weight.device)
        dh, dw = q[0] - conv.padding[0], q[1] - conv.padding[1]
        w[:, :, dh: dh + conv.kernel_size[0], dw: dw + conv.kernel_size[1]] = conv.weight
        # k' = 2a + b -> channel c*4 + bh*2 + bw, tap (ah, aw)
        w = w.reshape(conv.out_channels, c, kp[0] // 2, 2, kp[1] // 2, 2)
        w = w.permute(0, 1, 3, 5, 2, 4).reshape(conv.out_channels, 4 * c, kp[0] // 2,
                                                  kp[1] // 2)
        with torch.no_grad():
            new.weight[:, : 4 * c].copy_(w)
            if conv.bias is not None:
                new.bias.copy_(conv.bias)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.prepare_input(x))

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        """[B, c, H, W] -> the padded [B, in_channels, H'/2, W'/2] input of the 4x4 conv."""
        b, c, h, w = x.shape
        pads = []  # (front, back) per spatial dim
        for size, front, k, p, taps in zip((h, w), self.front, self.src_kernel,
                                           self.src_padding, self.kernel_size, strict=True):
            out = (size + 2 * p - k) // 2 + 1  # output size of the original stride-2 conv
            pads.append((front, 2 * (out + taps - 1) - size - front))
        x = F.pad(x, (pads[1][0], pads[1][1], pads[0][0], pads[0][1]))
        hs, ws = x.shape[-2] // 2, x.shape[-1] // 2
        x = x.reshape(b, c, hs, 2, ws, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, 4 * c, hs, ws)
        if self.in_channels > 4 * c:
            x = F.pad(x, (0, 0, 0, 0, 0, self.in_channels - 4 * c))
        if self.weight.is_contiguous(memory_format=torch.channels_last):
            x = x.contiguous(memory_format=torch.channels_last)
        return x


class SpaceToDepth4Conv2d(nn.Conv2d):
    """A stride-2 conv (the 7x7/2 ResNet stem) as a stride-1 conv over a space-to-depth(r)
    input, r = 4: x [B, c, H, W] -> pad -> [B, r*r*c (zero-padded to in_channels), H'/r,
    W'/r] -> conv with `taps` x `taps` taps and (r/2)^2 x out filters -> pixel shuffle(r/2)
    -> [B, out, Ho, Wo], the original conv's output. Exact: every output sub-pixel's filter
    is the original kernel placed at its offset in the block grid, zeros elsewhere.

    Index map (per spatial dim; s = 2 the stride, p the padding, k the kernel, F = p the
    front pad, m = r/s outputs per block): output o = m*O + u reads input s*o + t - p, i.e.
    padded input r*O + (s*u + t - p + F) = block O + A, sub-position b, so tap A and input
    channel b take the weight t = r*A + b - s*u + p - F when 0 <= t < k."""

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, multiple: int = 8, block: int = 4
                  ) -> SpaceToDepth4Conv2d:
        _check_plain(conv, "stem 's2d4'")
        s = conv.stride[0]
        if conv.stride != (2, 2) or conv.groups != 1 or block % s:
            raise ValueError(f"stem 's2d4': needs a stride-2 conv with groups 1 and a block "
                             f"that is a multiple of 2, got stride {conv.stride}, groups "
                             f"{conv.groups}, block {block}")
        c, out, r, m = conv.in_channels, conv.out_channels, block, block // s
        # front pad F = p: the largest padded offset s*(m-1) + k - 1 sets the taps
        taps = [(s * (m - 1) + k - 1) // r + 1 for k in conv.kernel_size]
        cin = math.ceil(r * r * c / multiple) * multiple
        new = _new_conv(cls, conv, cin, out * m * m, tuple(taps), (1, 1), (0, 0),
                        bias=conv.bias is not None)
        new.src_channels, new.src_kernel, new.src_padding = c, conv.kernel_size, conv.padding
        new.block, new.sub = r, m
        # w6[o, uh, uw, ci, bh, bw, ah, aw]: channel order of the shuffle (o*m*m + uh*m + uw)
        # and of the space-to-depth input (ci*r*r + bh*r + bw)
        w6 = torch.zeros(out, m, m, c, r, r, taps[0], taps[1], dtype=conv.weight.dtype,
                         device=conv.weight.device)
        kh, kw = conv.kernel_size
        for uh in range(m):
            for uw in range(m):
                for th in range(kh):
                    ah, bh = divmod(s * uh + th, r)  # th = r*ah + bh - s*uh (F = p)
                    for tw in range(kw):
                        aw, bw = divmod(s * uw + tw, r)
                        w6[:, uh, uw, :, bh, bw, ah, aw] = conv.weight[:, :, th, tw]
        with torch.no_grad():
            new.weight[:, : r * r * c].copy_(
                w6.reshape(out * m * m, r * r * c, taps[0], taps[1]))
            if conv.bias is not None:
                new.bias.copy_(conv.bias.repeat_interleave(m * m))
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish_output(super().forward(self.prepare_input(x)), x.shape[-2:])

    def output_size(self, hw: tuple[int, int] | torch.Size) -> tuple[int, int]:
        """(Ho, Wo) of the original conv for an input of size hw."""
        return tuple((size + 2 * p - k) // 2 + 1 for size, p, k in zip(
            hw, self.src_padding, self.src_kernel, strict=True))

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        """[B, c, H, W] -> the padded [B, in_channels, H'/r, W'/r] input of the conv."""
        b, c, h, w = x.shape
        r, m = self.block, self.sub
        pads = []  # (front, back) per spatial dim: front = p, back up to whole blocks
        for size, out, p, taps in zip((h, w), self.output_size((h, w)), self.src_padding,
                                      self.kernel_size, strict=True):
            blocks = -(-out // m) + taps - 1  # input blocks the conv reads (no padding)
            pads.append((p, r * blocks - size - p))
        x = F.pad(x, (pads[1][0], pads[1][1], pads[0][0], pads[0][1]))
        hs, ws = x.shape[-2] // r, x.shape[-1] // r
        x = x.reshape(b, c, hs, r, ws, r).permute(0, 1, 3, 5, 2, 4).reshape(b, r * r * c, hs,
                                                                            ws)
        if self.in_channels > r * r * c:
            x = F.pad(x, (0, 0, 0, 0, 0, self.in_channels - r * r * c))
        if self.weight.is_contiguous(memory_format=torch.channels_last):
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def finish_output(self, y: torch.Tensor, hw: tuple[int, int] | torch.Size
                      ) -> torch.Tensor:
        """The conv's [B, out*m*m, Hb, Wb] -> [B, out, Ho, Wo] (pixel shuffle, then the
        sub-pixels past the original output cut off when Ho or Wo is not a multiple of m)."""
        ho, wo = self.output_size(hw)
        y = F.pixel_shuffle(y, self.sub)
        return y if y.shape[-2:] == (ho, wo) else y[..., :ho, :wo]


class SlicedConv2d(nn.Conv2d):
    """Conv with zero filters appended to reach `out_channels`; forward returns the first
    `real_out` channels (a view)."""

    real_out: int

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, multiple: int) -> SlicedConv2d:
        cout = math.ceil(conv.out_channels / multiple) * multiple
        new = _new_conv(cls, conv, conv.in_channels, cout, conv.kernel_size, conv.stride,
                        conv.padding, bias=conv.bias is not None)
        new.padding_mode, new.dilation = conv.padding_mode, conv.dilation
        new.real_out = conv.out_channels
        with torch.no_grad():
            new.weight[: conv.out_channels].copy_(conv.weight)
            if conv.bias is not None:
                new.bias[: conv.out_channels].copy_(conv.bias)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[:, : self.real_out]


def _cat_convs(convs: list[nn.Conv2d], groups: int = 1) -> nn.Conv2d:
    """Filters of `convs` stacked into one conv (same input for groups=1; with groups=len:
    conv i reads the i-th channel block of the input)."""
    a = convs[0]
    for c in convs[1:]:
        if (c.in_channels, c.kernel_size, c.stride, c.padding, c.bias is None) != \
                (a.in_channels, a.kernel_size, a.stride, a.padding, a.bias is None):
            raise ValueError("merge: convs differ in input, kernel, stride, padding or bias")
    _check_plain(a, "merge")
    cout = sum(c.out_channels for c in convs)
    new = _new_conv(nn.Conv2d, a, a.in_channels * (groups if groups > 1 else 1), cout,
                    a.kernel_size, a.stride, a.padding, groups=groups, bias=a.bias is not None)
    with torch.no_grad():
        new.weight.copy_(torch.cat([c.weight for c in convs]))
        if a.bias is not None:
            new.bias.copy_(torch.cat([c.bias for c in convs]))
    return new


def _cat_group_norms(a: nn.GroupNorm, b: nn.GroupNorm) -> nn.GroupNorm:
    """GroupNorm over [x_a; x_b] == GN_a(x_a), GN_b(x_b) (same group size, eps, affine)."""
    if a.num_channels // a.num_groups != b.num_channels // b.num_groups or a.eps != b.eps \
            or a.affine != b.affine:
        raise ValueError("merge: GroupNorms differ in group size, eps or affine")
    new = nn.GroupNorm(a.num_groups + b.num_groups, a.num_channels + b.num_channels, a.eps,
                       a.affine)
    if a.affine:
        new = new.to(device=a.weight.device, dtype=a.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(torch.cat([a.weight, b.weight]))
            new.bias.copy_(torch.cat([a.bias, b.bias]))
    return new


def _merge_layer(a: nn.Sequential, b: nn.Sequential, groups: int) -> nn.Sequential:
    """Two conv+GN+ReLU layers (heads.conv_gn_relu) -> one over 2x the channels."""
    return nn.Sequential(_cat_convs([a[0], b[0]], groups), _cat_group_norms(a[1], b[1]),
                         nn.ReLU(inplace=True))


class MergedFCOSHead(nn.Module):
    """Same forward and outputs as the given `FCOSHead`, with fewer, wider kernels.

    forward(list of P_l [B,C,H_l,W_l], strides) -> (cls, ltrb, ctr) lists as FCOSHead.
    grouped=False: first tower convs merged (C -> 2C), box+centerness merged (C -> 5).
    grouped=True: also the later tower convs (2C -> 2C, groups 2) and one block-diagonal
    prediction conv 2C -> classes + 5.
    """

    def __init__(self, head: FCOSHead, grouped: bool = False) -> None:
        super().__init__()
        self.channels = head.cls_logits.in_channels
        self.num_classes = head.cls_logits.out_channels
        self.scales = head.scales
        n = len(head.cls_tower)
        self.grouped = grouped and n > 0
        self.first: nn.Module | None = None
        self.cls_rest = self.reg_rest = self.tower = None
        self.cls_logits: nn.Module | None = None
        if n == 0:  # no towers: one conv C -> classes + 5 on P_l
            self.pred = _cat_convs([head.cls_logits, head.bbox_pred, head.centerness])
            return
        self.first = _merge_layer(head.cls_tower[0], head.reg_tower[0], groups=1)
        if not self.grouped:
            self.cls_rest, self.reg_rest = head.cls_tower[1:], head.reg_tower[1:]
            self.cls_logits = head.cls_logits
            self.pred = _cat_convs([head.bbox_pred, head.centerness])
            return
        self.tower = nn.Sequential(*(_merge_layer(a, b, groups=2) for a, b in
                                     zip(head.cls_tower[1:], head.reg_tower[1:], strict=True)))
        c, k = self.channels, self.num_classes
        pred = _new_conv(nn.Conv2d, head.cls_logits, 2 * c, k + 5, head.cls_logits.kernel_size,
                         head.cls_logits.stride, head.cls_logits.padding,
                         bias=head.cls_logits.bias is not None)
        with torch.no_grad():  # block-diagonal: classes read the cls half, box/ctr the reg half
            pred.weight[:k, :c].copy_(head.cls_logits.weight)
            pred.weight[k: k + 4, c:].copy_(head.bbox_pred.weight)
            pred.weight[k + 4:, c:].copy_(head.centerness.weight)
            if pred.bias is not None:
                pred.bias.copy_(torch.cat([head.cls_logits.bias, head.bbox_pred.bias,
                                           head.centerness.bias]))
        self.pred = pred

    def forward(self, feats: list[torch.Tensor], strides: tuple[int, ...],
                levels: tuple[int, ...] | None = None
                ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """levels: the level index of each feats entry (its Scale); default 0, 1, ..."""
        return fcos_levels(self, feats, strides, levels or tuple(range(len(feats))))

    def forward_level(self, p: torch.Tensor, stride: int, level: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One FPN level, as FCOSHead.forward_level."""
        c, k = self.channels, self.num_classes
        if self.first is None:  # no towers
            o = self.pred(p)
            logits, box, centre = o[:, :k], o[:, k: k + 4], o[:, k + 4: k + 5]
        elif self.grouped:
            o = self.pred(self.tower(self.first(p)))
            logits, box, centre = o[:, :k], o[:, k: k + 4], o[:, k + 4: k + 5]
        else:
            y = self.first(p)
            logits = self.cls_logits(self.cls_rest(y[:, :c]))
            o = self.pred(self.reg_rest(y[:, c:]))
            box, centre = o[:, :4], o[:, 4:5]
        return logits, box_distances(box, self.scales[level], stride), centre  # as FCOSHead


def pad_conv_outputs(module: nn.Module, multiple: int = 8) -> int:
    """Replace (in place) every groups-1 Conv2d under `module` whose output-channel count is not
    a multiple of `multiple` by a `SlicedConv2d`. Returns the number of convs padded."""
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Conv2d and child.groups == 1 and \
                    child.out_channels % multiple:
                setattr(parent, name, SlicedConv2d.from_conv(child, multiple))
                count += 1
    return count


def optimize_model(model: nn.Module, spec: OptimizeSpec) -> dict[str, int]:
    """Apply `spec` in place to `model` (a MultiTaskPerceptionModel, eval, ideally BN-folded
    already; conv_act "cudnn" requires it): stem, then the FCOS merge, then the output
    padding, then the fused trunk epilogues. Call it on a copy: the state dict changes (shapes
    and names). Returns what was changed: {"stem": 0/1, "fcos_merged": 0/1, "padded_convs": n,
    "fused_blocks": n}."""
    done = {"stem": 0, "fcos_merged": 0, "padded_convs": 0, "fused_blocks": 0, "fused_stem": 0}
    stem = model.backbone.conv1
    if spec.stem in ("pad4", "pad8"):
        model.backbone.conv1 = ChannelPadConv2d.from_conv(stem, int(spec.stem[3:]))
        done["stem"] = 1
    elif spec.stem == "s2d":
        model.backbone.conv1 = SpaceToDepthConv2d.from_conv(stem, max(spec.pad_outputs, 8))
        done["stem"] = 1
    elif spec.stem == "s2d4":
        model.backbone.conv1 = SpaceToDepth4Conv2d.from_conv(stem, max(spec.pad_outputs, 8))
        done["stem"] = 1
    if spec.fcos != "plain" and isinstance(model.det_head, FCOSHead):
        model.det_head = MergedFCOSHead(model.det_head, grouped=spec.fcos == "grouped")
        done["fcos_merged"] = 1
    if spec.pad_outputs > 1:
        done["padded_convs"] = pad_conv_outputs(model, spec.pad_outputs)
    if spec.conv_act == "cudnn":
        done["fused_blocks"] = fuse_residual_blocks(model.backbone)
    if spec.fuse_stem:
        done["fused_stem"] = fuse_stem(model.backbone)
    return done
