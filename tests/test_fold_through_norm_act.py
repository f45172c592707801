"""fold-through on BatchNorm modules whose forward also applies drop + act (timm's BatchNormAct2d): the partial fold
reaches them as it reaches nn.BatchNorm2d, and the module becomes what is left of the BN, then its own drop and act
(timm's CoAtNet ``pre_norm``: BN -> avg pool -> 1x1 conv, its input read by the shortcut too)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import normconv
from normconv.nn.modules import ChannelAffine
from normconv.passes.fold_through import ThroughWhy
from tests.fixtures.bn_act import BNAct, same_outputs


def _randomized(bn: BNAct, seed: int) -> BNAct:
    g = torch.Generator().manual_seed(seed)
    c = bn.num_features
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(c, generator=g) * 2 + 1)
        bn.running_var.copy_(torch.rand(c, generator=g) * 3 + 0.2)
        bn.weight.copy_(torch.randn(c, generator=g) * 2)  # signs mixed
        bn.bias.copy_(torch.randn(c, generator=g))
    return bn


class PreNorm(nn.Module):
    """CoAtNet's MbConv: x feeds the shortcut and BNAct(no act) -> AvgPool2d(2) -> 1x1 conv."""

    def __init__(self, untraceable: bool = False):
        super().__init__()
        self.untraceable = untraceable
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.shortcut = nn.Sequential(nn.AvgPool2d(2), nn.Conv2d(8, 6, 1))
        self.pre_norm = _randomized(BNAct(8, act=False, drop=True), 1)
        self.down = nn.AvgPool2d(2, 2)
        self.conv1 = nn.Conv2d(8, 6, 1)

    def forward(self, x):
        x = self.stem(x)
        y = self.conv1(self.down(self.pre_norm(x))) + self.shortcut(x)
        if self.untraceable and y.shape[-1] % 2:  # a branch on a size: symbolic_trace fails, torch.export captures
            y = y[..., :-1]
        return y


class BehindRelu(nn.Module):
    """conv -> relu -> BNAct(SiLU) -> conv: the scale folds back through the relu, the sign and shift stay before
    the SiLU (it passes neither)."""

    def __init__(self):
        super().__init__()
        self.conv0 = nn.Conv2d(3, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.bn = _randomized(BNAct(8), 2)
        self.conv1 = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        return self.conv1(self.bn(self.relu(self.conv0(x))))


def _through(report):
    """The one BN's fold-through site (named by its module, or by its call where torch.export captured the model)."""
    found = [(s.applied, s.code, s.reason) for s in report.sites if s.pass_name == "fold-through"]
    assert len(found) == 1, [(s.pass_name, s.reason) for s in report.sites]
    return found[0]


@pytest.mark.parametrize("untraceable", [False, True])
def test_a_norm_act_pre_norm_folds_forward_through_an_avg_pool(untraceable):
    torch.manual_seed(0)
    model = PreNorm(untraceable).eval()
    new, report = normconv.fold(model, torch.randn(2, 3, 16, 16))
    assert report.passed
    applied, code, reason = _through(report)
    assert applied and code is ThroughWhy.FOLDED, reason
    # the BN is gone, the module's own drop is kept in its place, the user's class comes back
    assert type(new) is PreNorm and not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in new.modules())
    assert isinstance(new.pre_norm.drop, nn.Dropout)
    same_outputs(model, new, [(2, 3, 16, 16), (3, 3, 24, 20)], seed=5)
    assert type(model.pre_norm) is BNAct  # the user's model untouched


def test_a_norm_act_behind_a_relu_keeps_its_sign_and_shift_before_its_act():
    torch.manual_seed(0)
    model = BehindRelu().eval()
    new, report = normconv.fold(model, torch.randn(2, 3, 12, 12))
    assert report.passed
    applied, code, reason = _through(report)
    assert applied and code is ThroughWhy.SHIFT_OP, reason
    assert "conv0" in reason
    # what is left of the BN, then the module's own act, in that order
    assert [type(m) for m in new.bn] == [ChannelAffine, nn.Identity, nn.SiLU]
    same_outputs(model, new, [(2, 3, 12, 12), (1, 3, 20, 9)], seed=5)
