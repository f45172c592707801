"""Small re-parameterizable vision models, written after their public definitions, whose outputs reach 1e4..1e15
with random BatchNorm statistics (as timm's and torchvision's do): the cases where an element-wise check refuses
an exact fold for float32 rounding alone. No timm / torchvision needed.

- RepVGG (Ding et al. 2021, "RepVGG: Making VGG-style ConvNets Great Again"; timm ``byobnet.RepVggBlock``): a
  train-time block sums conv3x3+BN, conv1x1+BN and, where shapes allow, a BN of the input, then ReLU.
- MobileOne (Vasu et al. 2023, "MobileOne: An Improved One millisecond Mobile Backbone"; timm
  ``MobileOneBlock``): a depthwise stage of k parallel conv3x3+BN branches, a conv1x1+BN "scale" branch and a BN
  skip, summed, ReLU; then a pointwise stage of k parallel conv1x1+BN branches and a BN skip.
- Inception (Szegedy et al. 2016, "Rethinking the Inception Architecture"; torchvision ``InceptionA`` with
  ``BasicConv2d`` = conv (no bias) + BN (eps 0.001) + ReLU): 1x1, 1x1->5x5, 1x1->3x3->3x3 and avgpool->1x1
  branches, concatenated.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, eps: float = 1e-5) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout, eps))


class RepVggBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.identity = nn.BatchNorm2d(cin) if cin == cout and stride == 1 else None
        self.conv_kxk = conv_bn(cin, cout, 3, stride)
        self.conv_1x1 = conv_bn(cin, cout, 1, stride)

    def forward(self, x):
        y = self.conv_kxk(x) + self.conv_1x1(x)
        return F.relu(y + self.identity(x) if self.identity is not None else y)


class MobileOneBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1, k: int = 2):
        super().__init__()
        self.dw = nn.ModuleList(conv_bn(cin, cin, 3, stride, groups=cin) for _ in range(k))
        self.dw_scale = conv_bn(cin, cin, 1, stride, groups=cin)
        self.dw_skip = nn.BatchNorm2d(cin) if stride == 1 else None
        self.pw = nn.ModuleList(conv_bn(cin, cout, 1) for _ in range(k))
        self.pw_skip = nn.BatchNorm2d(cout) if cin == cout else None

    def forward(self, x):
        y = sum(b(x) for b in self.dw) + self.dw_scale(x)
        x = F.relu(y + self.dw_skip(x) if self.dw_skip is not None else y)
        y = sum(b(x) for b in self.pw)
        return F.relu(y + self.pw_skip(x) if self.pw_skip is not None else y)


class BasicConv2d(nn.Module):
    def __init__(self, cin: int, cout: int, k: int, stride: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, stride, k // 2, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class InceptionA(nn.Module):
    def __init__(self, cin: int, pool: int):
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 16, 1)
        self.branch5x5_1, self.branch5x5_2 = BasicConv2d(cin, 12, 1), BasicConv2d(12, 16, 5)
        self.branch3x3dbl_1, self.branch3x3dbl_2 = BasicConv2d(cin, 16, 1), BasicConv2d(16, 24, 3)
        self.branch3x3dbl_3 = BasicConv2d(24, 24, 3)
        self.branch_pool = BasicConv2d(cin, pool, 1)

    def forward(self, x):
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = self.branch_pool(F.avg_pool2d(x, 3, 1, 1))
        return torch.cat([self.branch1x1(x), b5, b3, bp], 1)


class Net(nn.Module):
    """stem -> blocks -> global average pool -> a conv1x1+BN head (``head``: the last fold, where the tests plant
    a wrong one) -> logits (B, classes)."""

    def __init__(self, blocks: nn.Module, width: int, classes: int = 100):
        super().__init__()
        self.blocks = blocks
        self.head = conv_bn(width, classes, 1)

    def forward(self, x):
        return self.head(F.adaptive_avg_pool2d(self.blocks(x), 1)).flatten(1)


def randomize(model: nn.Module, gain: float, seed: int = 0) -> nn.Module:
    """Random BatchNorm statistics and affines (as the vision sweep draws them) and conv weights of std
    gain / sqrt(fan_in): each layer multiplies the activations' scale by about ``gain``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                fan_in = m.weight[0].numel()
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * gain / fan_in ** 0.5)
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) * 1.5 + 0.5)
                m.weight.copy_(1 + 0.2 * torch.randn(m.num_features, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.num_features, generator=g))
    return model.eval()


def image(batch: int = 2, size: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


def repvgg():
    widths = [3, 16, 16, 24, 24, 32, 32, 32, 32, 32, 32, 32, 32]
    blocks = nn.Sequential(*(RepVggBlock(a, b, 2 if i in (0, 2, 4) else 1)
                             for i, (a, b) in enumerate(zip(widths, widths[1:]))))
    return randomize(Net(blocks, widths[-1]), gain=8.0), (image(),)


def mobileone():
    widths = [3, 16, 16, 24, 24, 32, 32, 32, 32, 32]
    blocks = nn.Sequential(*(MobileOneBlock(a, b, 2 if i in (0, 2) else 1)
                             for i, (a, b) in enumerate(zip(widths, widths[1:]))))
    return randomize(Net(blocks, widths[-1]), gain=4.0), (image(),)


def inception():
    blocks = nn.Sequential(BasicConv2d(3, 32, 3, 2), InceptionA(32, 8), InceptionA(64, 16), InceptionA(72, 16),
                           InceptionA(72, 16), InceptionA(72, 16))
    return randomize(Net(blocks, 72), gain=4.0), (image(),)


def tiny():
    """RepVGG whose head scales its logits to ~1e-6: where atol 1e-4 passed any error."""
    model, x = repvgg()
    with torch.no_grad():
        c = 1e-6 / float(model(*x).abs().max())
        model.head[1].weight.mul_(c)  # BN(y) scaled by c: gamma and beta both
        model.head[1].bias.mul_(c)
    return model, x
