"""fold into conv / linear subclasses that only change __init__ (torchvision's video ``Conv3DSimple`` /
``Conv3DNoTemporal``, a user's ``class Conv(nn.Conv2d)``): symbolic_trace traces through them (they are not torch.nn's
own), so the layer's call reads its weight with a get_attr; that read is the layer's own, not the forward's."""

from __future__ import annotations

import torch
import torch.nn as nn

from fold_helpers import randomize_bn, skipped
from normconv.api import fold


class Conv3DNoTemporal(nn.Conv3d):
    """torchvision.models.video.resnet's: a Conv3d whose __init__ fixes its kernel; forward is nn.Conv3d's."""

    def __init__(self, cin, cout, stride=1):
        super().__init__(cin, cout, kernel_size=(1, 3, 3), stride=(1, stride, stride), padding=(0, 1, 1), bias=False)


class Lin(nn.Linear):
    def __init__(self, cin, cout):
        super().__init__(cin, cout, bias=False)


class Block(nn.Module):
    """VideoResNet's BasicBlock: Sequential(conv, BN, ReLU), Sequential(conv, BN), the residual, a linear head."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Sequential(Conv3DNoTemporal(3, 6), nn.BatchNorm3d(6), nn.ReLU())
        self.conv2 = nn.Sequential(Conv3DNoTemporal(6, 3), nn.BatchNorm3d(3))
        self.head = nn.Sequential(Lin(3, 5), nn.BatchNorm1d(5))

    def forward(self, x):
        y = torch.relu(self.conv2(self.conv1(x)) + x)
        return self.head(y.mean((2, 3, 4)))


def test_bns_after_layer_subclasses_fold_and_the_result_is_the_same():
    torch.manual_seed(0)
    model = randomize_bn(Block()).eval()
    folded, report = fold(model, torch.randn(2, 3, 4, 8, 8))
    assert report.passed and not skipped(report), skipped(report)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in folded.modules())
    assert type(folded.conv1[0]) is Conv3DNoTemporal and type(folded.head[0]) is Lin  # the user's classes stay
    g = torch.Generator().manual_seed(3)
    for shape in ((2, 3, 4, 8, 8), (1, 3, 3, 10, 7)):
        x = torch.randn(*shape, generator=g)
        with torch.no_grad():
            ref, out = model(x), folded(x)
        assert float((out - ref).abs().max()) <= 1e-5 * float(ref.abs().max()), shape
