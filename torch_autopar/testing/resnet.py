"""ResNet-50 (He et al. 2015, torchvision's "v1.5" layout) for planning benchmarks and tests.

Bottleneck blocks [3, 4, 6, 3] with widths 64..512 (outputs 256..2048), stride on the 3x3 convolution, batch
norm after every convolution, global average pooling and a 1000-class linear head: 25,557,032 parameters, the
same parameter names and shapes as ``torchvision.models.resnet50()`` (torchvision is not a dependency).
Initialisation is deterministic for a given ``seed`` (He-normal convolutions, batch norm at weight 1 / bias 0)
and leaves the global random state alone. Must never depend on torchvision or on anything in torch_autopar.
"""

from __future__ import annotations

import torch
import torch.nn as nn

RESNET50_LAYERS = (3, 4, 6, 3)
RESNET50_PARAMETERS = 25_557_032
"""torchvision.models.resnet50()'s parameter count."""


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carries the stride), 1x1 expand by 4; identity or projected shortcut."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int = 1):
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(out_channels))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


def _stage(in_channels: int, width: int, blocks: int, stride: int) -> nn.Sequential:
    layers = [Bottleneck(in_channels, width, stride)]
    layers += [Bottleneck(width * Bottleneck.expansion, width) for _ in range(blocks - 1)]
    return nn.Sequential(*layers)


class ResNet50(nn.Module):
    """ResNet-50 for 3-channel images (224x224 in the benchmarks; any size >= 32 works)."""

    def __init__(self, num_classes: int = 1000, layers=RESNET50_LAYERS, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):  # the layers' default init draws too; keep the caller's state
            torch.manual_seed(seed)
            self._build(num_classes, layers)
            self._initialise()

    def _build(self, num_classes: int, layers) -> None:
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = _stage(64, 64, layers[0], 1)
        self.layer2 = _stage(256, 128, layers[1], 2)
        self.layer3 = _stage(512, 256, layers[2], 2)
        self.layer4 = _stage(1024, 512, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512 * Bottleneck.expansion, num_classes)

    def _initialise(self) -> None:
        """torchvision's initialisation (the linear head keeps PyTorch's default)."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))
