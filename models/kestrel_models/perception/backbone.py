"""ResNet backbone (BasicBlock for 18/34, Bottleneck v1.5 for 50), returning C2-C5.

Written here because torchvision is not available; layer names follow torchvision's ResNet
(conv1/bn1/layer1..layer4) so its checkpoints map onto it with a plain prefix rename.
"""

from __future__ import annotations

import torch
from torch import nn

# blocks per stage and block type for each supported depth
RESNET_SPECS: dict[int, tuple[tuple[int, int, int, int], str]] = {
    18: ((2, 2, 2, 2), "basic"),
    34: ((3, 4, 6, 3), "basic"),
    50: ((3, 4, 6, 3), "bottleneck"),
}


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = conv3x3(cin, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != planes:
            self.downsample = nn.Sequential(conv1x1(cin, planes, stride), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck: the stride sits on the 3x3 conv."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        cout = planes * self.expansion
        self.conv1 = conv1x1(cin, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, cout)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(conv1x1(cin, cout, stride), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNetBackbone(nn.Module):
    """ResNet-{18,34,50} without the classifier.

    forward(x: [B,3,H,W] normalised float, H and W multiples of 32)
      -> [C2, C3, C4, C5] at strides 4, 8, 16, 32 with `self.out_channels` channels.
    """

    def __init__(self, depth: int, base_width: int = 64) -> None:
        super().__init__()
        if depth not in RESNET_SPECS:
            raise ValueError(f"parameter 'backbone_depth' = {depth!r}: must be one of "
                             f"{tuple(RESNET_SPECS)}")
        blocks, kind = RESNET_SPECS[depth]
        block: type[BasicBlock] | type[Bottleneck] = BasicBlock if kind == "basic" else Bottleneck
        self.conv1 = nn.Conv2d(3, base_width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(base_width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        cin = base_width
        self.out_channels: list[int] = []
        stages = []
        for i, n in enumerate(blocks):
            planes = base_width * 2**i
            layers = []
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                layers.append(block(cin, planes, stride))
                cin = planes * block.expansion
            stages.append(nn.Sequential(*layers))
            self.out_channels.append(cin)
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        # zero-init the last BN of each residual branch (torchvision's zero_init_residual)
        for m in self.modules():
            if isinstance(m, Bottleneck):
                nn.init.zeros_(m.bn3.weight)
            elif isinstance(m, BasicBlock):
                nn.init.zeros_(m.bn2.weight)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))  # stride 4
        c2 = self.layer1(x)
        c3 = self.layer2(c2)
        c4 = self.layer3(c3)
        c5 = self.layer4(c4)
        return [c2, c3, c4, c5]
