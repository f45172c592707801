"""A small UNet with GroupNorm (diffusion-model style) and one InstanceNorm2d: the non-BatchNorm conv norms.

GroupNorm and InstanceNorm normalize with statistics of the sample itself, so nothing folds into the
conv; detection has to report them with their groups, eps and affine parameters, and passes must skip them.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .common import randn, seeded


def conv_gn_silu(cin: int, cout: int, groups: int, stride: int = 1) -> nn.Sequential:
    """3x3 Conv2d + GroupNorm(groups, eps=1e-6) + SiLU."""
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=stride, padding=1),
                         nn.GroupNorm(groups, cout, eps=1e-6), nn.SiLU())


class UNet(nn.Module):
    """UNet: 32x32 -> 16x16 -> 8x8 with stride-2 convs, a bottleneck with InstanceNorm2d(affine=True), then up
    with a ConvTranspose2d and an nn.Upsample, each followed by skip concatenation and conv+GroupNorm+SiLU.

    Exercises: GroupNorm with 4 and 8 groups (5 sites), InstanceNorm2d with affine parameters and no running
    statistics (eps 1e-3), and convs that read a skip concatenation before their norm.
    """

    def __init__(self, in_channels: int = 3, out_channels: int = 3):
        super().__init__()
        self.inc = conv_gn_silu(in_channels, 16, groups=4)
        self.down1 = conv_gn_silu(16, 32, groups=8, stride=2)
        self.down2 = conv_gn_silu(32, 32, groups=8, stride=2)
        self.mid = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1),
                                 nn.InstanceNorm2d(32, eps=1e-3, affine=True), nn.SiLU())
        self.up1 = nn.ConvTranspose2d(32, 32, 2, stride=2)
        self.dec1 = conv_gn_silu(32 + 32, 32, groups=8)
        self.up2 = nn.Upsample(scale_factor=2, mode="nearest")
        self.dec2 = conv_gn_silu(32 + 16, 16, groups=4)
        self.outc = nn.Conv2d(16, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.inc(x)  # 16 x 32 x 32
        x2 = self.down1(x1)  # 32 x 16 x 16
        x3 = self.mid(self.down2(x2))  # 32 x 8 x 8
        y = self.dec1(torch.cat([self.up1(x3), x2], dim=1))  # 32 x 16 x 16
        y = self.dec2(torch.cat([self.up2(y), x1], dim=1))  # 16 x 32 x 32
        return self.outc(y)


@seeded(109)
def unet() -> nn.Module:
    """GroupNorm UNet with skip concatenations, 5 GroupNorm (eps 1e-6) and 1 InstanceNorm2d (eps 1e-3)."""
    return UNet()


def unet_inputs() -> tuple:
    return (randn(2, 3, 32, 32, seed=109),)
