"""Convolutional and MLP reference models with torch-native BatchNorm (the conv -> BN folding cases).

Each model varies one thing a BatchNorm folder has to get right: residual branches and a downsample path
(resnet), depthwise convs (mobilenet), 1-d convs with dilation and bias (conv1d), 3-d convs (conv3d),
grouped transposed convs whose output channels live on weight dim 1 (deconv), and BN on Linear outputs,
including one BN that feeds a Linear instead of following one (mlp). Every model uses its own eps.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .common import randn, seeded

# -- resnet -------------------------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: conv-bn-relu-conv-bn, plus the identity or a conv1x1+BN downsample."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """A three-block ResNet: stem conv+BN+ReLU, blocks 16 -> 16 -> 32 (stride 2) -> 32, avg pool, Linear.

    Exercises: BN after bias-free convs, a BN feeding a residual add directly (bn2), a 1x1 strided
    downsample conv+BN on the shortcut, and one ReLU module reused at several places.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(BasicBlock(16, 16))
        self.layer2 = nn.Sequential(BasicBlock(16, 32, stride=2), BasicBlock(32, 32))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


@seeded(100)
def resnet() -> nn.Module:
    """ResNet-style CNN, 8 BatchNorm2d (eps 1e-5)."""
    return ResNet()


def resnet_inputs() -> tuple:
    return (randn(2, 3, 32, 32, seed=100),)


# -- mobilenet ----------------------------------------------------------------------------------------------


def conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, act: bool = True) -> nn.Sequential:
    """Conv2d (no bias) + BatchNorm2d(eps=1e-3) [+ ReLU6], the MobileNetV2 building unit."""
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
                               nn.BatchNorm2d(cout, eps=1e-3)]
    if act:
        layers.append(nn.ReLU6(inplace=True))
    return nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    """MobileNetV2 block: [1x1 expand conv+BN+ReLU6], depthwise 3x3 conv+BN+ReLU6, 1x1 project conv+BN (linear
    bottleneck, no activation); the input is added back when stride is 1 and channels match."""

    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int):
        super().__init__()
        hidden = inp * expand_ratio
        self.use_res_connect = stride == 1 and inp == oup
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(conv_bn(inp, hidden, 1))
        layers += [conv_bn(hidden, hidden, 3, stride, groups=hidden), conv_bn(hidden, oup, 1, act=False)]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


class MobileNetV2(nn.Module):
    """A MobileNetV2 slice: stem, three inverted residual blocks (expand ratio 1 and 4, one strided), a 1x1
    head conv, pool and classifier.

    Exercises: BN after depthwise convs (groups == channels), BN right before a residual add with no
    activation, and eps 1e-3 as TensorFlow-ported checkpoints use.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            conv_bn(3, 16, 3),
            InvertedResidual(16, 16, stride=1, expand_ratio=1),
            InvertedResidual(16, 24, stride=2, expand_ratio=4),
            InvertedResidual(24, 24, stride=1, expand_ratio=4),
            conv_bn(24, 64, 1),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


@seeded(101)
def mobilenet() -> nn.Module:
    """MobileNetV2-style inverted residuals, 10 BatchNorm2d (eps 1e-3)."""
    return MobileNetV2()


def mobilenet_inputs() -> tuple:
    return (randn(2, 3, 32, 32, seed=101),)


# -- conv1d -------------------------------------------------------------------------------------------------


class Conv1dNet(nn.Module):
    """Three Conv1d + BatchNorm1d + ReLU stages on (N, C, L), then mean over L and a Linear head.

    Exercises: BatchNorm1d on 3-d input, a dilated conv (dilation 2), a strided conv, and a conv with its own
    bias (the fold must fold the bias through the BN too).
    """

    def __init__(self, num_classes: int = 5):
        super().__init__()
        self.conv1 = nn.Conv1d(4, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm1d(16, eps=1e-4)
        self.conv2 = nn.Conv1d(16, 16, 3, padding=2, dilation=2, bias=False)
        self.bn2 = nn.BatchNorm1d(16, eps=1e-4)
        self.conv3 = nn.Conv1d(16, 32, 5, stride=2, padding=2, bias=True)
        self.bn3 = nn.BatchNorm1d(32, eps=1e-4)
        self.relu = nn.ReLU()
        self.head = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.relu(self.bn2(self.conv2(x)))
        x = self.relu(self.bn3(self.conv3(x)))
        return self.head(x.mean(-1))


@seeded(102)
def conv1d() -> nn.Module:
    """Conv1d net with dilation and a biased conv, 3 BatchNorm1d (eps 1e-4)."""
    return Conv1dNet()


def conv1d_inputs() -> tuple:
    return (randn(2, 4, 64, seed=102),)


# -- conv3d -------------------------------------------------------------------------------------------------


class Conv3dNet(nn.Module):
    """Two Conv3d + BatchNorm3d + ReLU stages on (N, C, D, H, W), global pool, Linear head.

    Exercises: the 5-d weight layout, one bias-free conv and one strided conv with bias.
    """

    def __init__(self, num_classes: int = 4):
        super().__init__()
        self.conv1 = nn.Conv3d(2, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm3d(8, eps=2e-5)
        self.conv2 = nn.Conv3d(8, 16, 3, stride=2, padding=1, bias=True)
        self.bn2 = nn.BatchNorm3d(16, eps=2e-5)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.head = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.relu(self.bn2(self.conv2(x)))
        return self.head(torch.flatten(self.pool(x), 1))


@seeded(103)
def conv3d() -> nn.Module:
    """Small Conv3d net, 2 BatchNorm3d (eps 2e-5)."""
    return Conv3dNet()


def conv3d_inputs() -> tuple:
    return (randn(2, 2, 8, 16, 16, seed=103),)


# -- deconv -------------------------------------------------------------------------------------------------


class Decoder(nn.Module):
    """Upsampling decoder of ConvTranspose2d + BatchNorm2d: 8x8 -> 16x16 -> 32x32, then a 3x3 head.

    Exercises: grouped transposed convs (groups=2, weight (in, out/groups, k, k): output channels on dim 1
    per group), output_padding=1, a grouped transposed conv with bias, and a groups=1 transposed conv with
    bias followed by BN. torch's fuse_conv_bn_eval(transpose=True) gets the grouped case wrong.
    """

    def __init__(self):
        super().__init__()
        self.up1 = nn.ConvTranspose2d(8, 16, 3, stride=2, padding=1, output_padding=1, groups=2, bias=False)
        self.bn1 = nn.BatchNorm2d(16, eps=1e-3)
        self.up2 = nn.ConvTranspose2d(16, 12, 4, stride=2, padding=1, groups=2, bias=True)
        self.bn2 = nn.BatchNorm2d(12, eps=1e-3)
        self.head = nn.ConvTranspose2d(12, 4, 3, padding=1, bias=True)
        self.bn3 = nn.BatchNorm2d(4, eps=1e-3)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.up1(x)))
        x = self.relu(self.bn2(self.up2(x)))
        return self.bn3(self.head(x))


@seeded(104)
def deconv() -> nn.Module:
    """ConvTranspose2d decoder with groups=2 and output_padding, 3 BatchNorm2d (eps 1e-3)."""
    return Decoder()


def deconv_inputs() -> tuple:
    return (randn(2, 8, 8, 8, seed=104),)


# -- mlp ----------------------------------------------------------------------------------------------------


class MLP(nn.Module):
    """Input BatchNorm1d, then Linear + BatchNorm1d + ReLU twice, then a Linear head, on (N, C).

    Exercises: BN after Linear (fold into the Linear before it) and BN on the raw input, which can only be
    folded forward into the Linear after it.
    """

    def __init__(self, in_features: int = 32, hidden: int = 64, num_classes: int = 10):
        super().__init__()
        self.input_bn = nn.BatchNorm1d(in_features, eps=1e-6)
        self.fc1 = nn.Linear(in_features, hidden)
        self.bn1 = nn.BatchNorm1d(hidden, eps=1e-6)
        self.fc2 = nn.Linear(hidden, hidden)
        self.bn2 = nn.BatchNorm1d(hidden, eps=1e-6)
        self.head = nn.Linear(hidden, num_classes)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.input_bn(x)
        x = self.relu(self.bn1(self.fc1(x)))
        x = self.relu(self.bn2(self.fc2(x)))
        return self.head(x)


@seeded(105)
def mlp() -> nn.Module:
    """Linear + BatchNorm1d MLP on (N, C), 3 BatchNorm1d (eps 1e-6)."""
    return MLP()


def mlp_inputs() -> tuple:
    return (randn(4, 32, seed=105),)
