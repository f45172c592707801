"""Channels-first LayerNorm modules (timm's and torchvision's ``LayerNorm2d``: a LayerNorm subclass whose forward
permutes the channels last, normalizes them, and permutes back; ConvNeXt, EdgeNeXt, FocalNet, GC ViT, DaViT). Swap
replaces the whole module by ``MovedDimNorm(RMSNorm)``, and the stream decides as for any LayerNorm: after a conv,
which centers over its output channels, exact; after a depthwise conv, refused for that reason, not because the
module "overrides forward"."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import normconv
from normconv.nn.modules import MovedDimNorm


class LayerNorm2d(nn.LayerNorm):  # torchvision/models/convnext.py, timm/layers/norm.py
    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class Transposed(nn.LayerNorm):  # normalizes the last dim of a transposed input and does not transpose back
    def forward(self, x):
        return F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps)


class Stem(nn.Module):
    """ConvNeXt's stem and a downsample: conv -> LayerNorm2d -> conv; ``depthwise``: the norm reads a depthwise conv."""

    def __init__(self, depthwise: bool = False, norm=LayerNorm2d) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1, groups=8) if depthwise else nn.Conv2d(3, 8, 4, stride=2)
        self.depthwise = depthwise
        self.norm = norm(8, eps=1e-6)
        self.down = nn.Conv2d(8, 16, 2, stride=2)

    def forward(self, x):
        y = self.norm(self.conv(x))
        return self.down(y) if y.dim() == 4 and y.shape[1] == 8 else y


def _net(**kw):
    torch.manual_seed(0)
    net = Stem(**kw).eval()
    with torch.no_grad():
        net.norm.weight.uniform_(0.5, 1.5)
        net.norm.bias.normal_(0, 0.5)
    return net


def test_a_channels_first_layernorm_after_a_conv_swaps_exactly():
    net = _net()
    x = torch.randn(2, 3, 16, 16)
    new, report = normconv.swap(net, x)
    assert report.passed and report.extra["swapped"] == 1
    assert isinstance(new.norm, MovedDimNorm) and any(isinstance(m, nn.RMSNorm) for m in new.norm.modules())
    assert type(net.norm) is LayerNorm2d  # the user's model untouched
    (site,) = [s for s in report.to_json()["sites"] if s["pass"] == "swap"]
    # the bias stays an add; the reason names the module's own permute back, not a reader ("permute reads ...")
    assert site["code"] == "exact-bias-kept" and "norm puts the normalized dim back in place" in site["reason"]
    for shape in ((1, 3, 16, 16), (3, 3, 24, 20)):  # fresh inputs, two shapes
        other = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(new(other), net(other), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kw, code", [({"depthwise": True}, "stream-refused"),
                                      ({"norm": Transposed}, "overrides-forward")])
def test_what_it_cannot_swap_says_the_real_reason(kw, code):
    net = _net(**kw)
    x = torch.randn(2, 8 if kw.get("depthwise") else 3, 16, 16)
    report = normconv.inspect(net, x).to_json()
    (site,) = report["sites"]
    swap = next(p for p in site["plan"] if p["pass"] == "swap" and p["reason"].startswith("--to rmsnorm"))
    assert swap["code"] == code, swap
    with pytest.raises(normconv.NormconvError):
        normconv.swap(net, x)
