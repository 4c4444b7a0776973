"""cuDNN-fused conv + bias (+ residual) + ReLU for the ResNet trunk (an `optimize.py` transform).

In the compiled forward, inductor runs every trunk conv as a cuDNN kernel (an extern call) and
then one Triton pointwise kernel that reads the conv output (and the residual) back to add the
folded-BN bias and apply the ReLU. `torch.cudnn_convolution_relu` /
`torch.cudnn_convolution_add_relu` do the bias, the residual add and the ReLU in the conv's own
epilogue, so each activation is written once; the ops stay fallback kernels inside
torch.compile and inside a CUDA graph.

The blocks must be BatchNorm-folded first (`runtime.fold_batchnorm`: each bn{i} an Identity),
so conv -> bias -> ReLU is the whole branch. On the CPU (and in any non-CUDA trace) the same
modules run the unfused ops, so the transform is exact there (tested); on CUDA the fused op
differs from conv + add + ReLU by its rounding order only (bf16, random inputs: max abs diff
0.03-0.06 per trunk shape in bench_conv_fusion; whole-model drift vs fp32 unchanged).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .backbone import BasicBlock, Bottleneck


def _check(conv: nn.Conv2d, what: str) -> None:
    if isinstance(conv.padding, str) or conv.padding_mode != "zeros" or type(conv) is not \
            nn.Conv2d:
        raise ValueError(f"conv_act 'cudnn': {what} is not a plain zero-padded nn.Conv2d "
                         f"({type(conv).__name__}, padding {conv.padding!r})")


def conv_relu(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """relu(conv(x)) in one cuDNN call on CUDA (bias in the epilogue), unfused elsewhere. The
    conv's own weights and geometry only (a zero-padded conv), never its forward: a stem conv
    whose forward builds its input first (`FusedStem`) is given the built input."""
    if x.is_cuda:
        return torch.cudnn_convolution_relu(x, conv.weight, conv.bias, conv.stride,
                                            conv.padding, conv.dilation, conv.groups)
    return F.relu(F.conv2d(x, conv.weight, conv.bias, conv.stride, conv.padding,
                           conv.dilation, conv.groups))


def conv_add_relu(conv: nn.Conv2d, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """relu(conv(x) + z) in one cuDNN call on CUDA (z: the residual, same shape as the
    output), unfused elsewhere."""
    if x.is_cuda:
        return torch.cudnn_convolution_add_relu(x, conv.weight, z, 1.0, conv.bias, conv.stride,
                                                conv.padding, conv.dilation, conv.groups)
    return F.relu(conv(x) + z)


class FusedBottleneck(nn.Module):
    """A BN-folded `Bottleneck` whose three convs carry their epilogues (same parameters,
    same names: conv1..conv3, downsample)."""

    def __init__(self, block: Bottleneck) -> None:
        super().__init__()
        self.conv1, self.conv2, self.conv3 = block.conv1, block.conv2, block.conv3
        self.downsample = block.downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = conv_relu(self.conv2, conv_relu(self.conv1, x))
        return conv_add_relu(self.conv3, out, identity)


class FusedBasicBlock(nn.Module):
    """A BN-folded `BasicBlock` with fused epilogues (ResNet-18/34)."""

    def __init__(self, block: BasicBlock) -> None:
        super().__init__()
        self.conv1, self.conv2 = block.conv1, block.conv2
        self.downsample = block.downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        return conv_add_relu(self.conv2, conv_relu(self.conv1, x), identity)


class FusedStem(nn.Module):
    """The BN-folded stem conv + ReLU as one cuDNN call on CUDA: forward(x) = relu(conv1(x)).
    A `SpaceToDepthConv2d` / `ChannelPadConv2d` stem (optimize.py) builds its input first."""

    def __init__(self, conv: nn.Conv2d) -> None:
        super().__init__()
        self.conv = conv

    @property
    def weight(self) -> torch.Tensor:  # the model reads the stem's dtype and layout from it
        return self.conv.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prepare = getattr(self.conv, "prepare_input", None)  # channel-pad / s2d stems
        y = conv_relu(self.conv, x if prepare is None else prepare(x))
        finish = getattr(self.conv, "finish_output", None)  # s2d4: the pixel shuffle
        return y if finish is None else finish(y, x.shape[-2:])


def fuse_stem(backbone: nn.Module) -> int:
    """backbone.conv1 -> `FusedStem`, backbone.relu -> Identity (the ReLU moves into the
    conv). Needs the stem BN folded (backbone.bn1 an Identity) and a zero-padded conv; returns
    1. Why: the stem's bias + ReLU would be one more pass over its [B, 64, H/2, W/2] output
    (a Triton kernel before the max-pool)."""
    if not isinstance(backbone.bn1, nn.Identity):
        raise ValueError("fuse_stem: the stem has an unfolded bn1; fold the BatchNorms first "
                         "(fold_bn)")
    conv = backbone.conv1
    if isinstance(conv.padding, str) or conv.padding_mode != "zeros":
        raise ValueError(f"fuse_stem: the stem conv is not zero-padded ({conv.padding!r}, "
                         f"{conv.padding_mode!r})")
    backbone.conv1 = FusedStem(conv)
    backbone.relu = nn.Identity()
    return 1


def fuse_residual_blocks(module: nn.Module) -> int:
    """Replace (in place) every BN-folded Bottleneck / BasicBlock under `module` by its fused
    form. Returns the number of blocks replaced. Raises ValueError naming the block when its
    BatchNorms are not folded (fold first) or a conv is not a plain Conv2d."""
    count = 0
    for parent_name, parent in list(module.named_modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, (Bottleneck, BasicBlock)):
                continue
            where = f"{parent_name}.{name}".lstrip(".")
            n = 3 if isinstance(child, Bottleneck) else 2
            for i in range(1, n + 1):
                if not isinstance(getattr(child, f"bn{i}"), nn.Identity):
                    raise ValueError(f"conv_act 'cudnn': block {where} has an unfolded "
                                     f"bn{i}; fold the BatchNorms first (fold_bn)")
                _check(getattr(child, f"conv{i}"), f"{where}.conv{i}")
            fused = FusedBottleneck(child) if n == 3 else FusedBasicBlock(child)
            setattr(parent, name, fused)
            count += 1
    return count
