"""Hand-written norms that do not upcast, behind activations of a few hundred: the half-precision failure case.

Large language and restoration models carry "massive activations": a few residual channels of a few hundred.
A norm written without a float32 cast squares them in the input's dtype, and in float16 ``x * x`` is above
65504 (the largest fp16) as soon as ``|x| > 255.9``: ``mean(x^2)`` is inf, ``rsqrt`` is 0 and the row comes
out as zeros. Nothing here is wrong in float32.

- ``NoUpcastRMSNorm``: Llama's RMSNorm without ``.to(torch.float32)`` (the spelling of many ports).
- ``NoUpcastLayerNorm``: a LayerNorm over the last dim computing ``mean((x - mu)^2)`` in the input's dtype.
- ``OutlierDecoder``: a pre-norm residual MLP stack on hidden states whose input projection writes two outlier
  channels of about +-300 into the residual stream (what ``massive activations`` look like), then the final
  no-upcast LayerNorm and a head.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import randn, random_scale_, random_shift_, seeded

OUTLIER_HIDDEN = 64
OUTLIER_CHANNELS = (3, 41)  # residual channels that carry the massive activations
OUTLIER_SCALE = 300.0


class NoUpcastRMSNorm(nn.Module):
    """RMSNorm in the input's dtype: ``x * rsqrt(mean(x^2) + eps) * w`` (no float32 cast)."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class NoUpcastLayerNorm(nn.Module):
    """LayerNorm over the last dim in the input's dtype: ``(x - mu) / sqrt(mean((x - mu)^2) + eps) * w + b``."""

    def __init__(self, hidden: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.bias = nn.Parameter(torch.zeros(hidden))
        self.eps = eps

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        xc = x - mu
        var = (xc * xc).mean(-1, keepdim=True)
        return xc / torch.sqrt(var + self.eps) * self.weight + self.bias


class OutlierBlock(nn.Module):
    """x + fc2(silu(fc1(norm(x)))) with a no-upcast RMSNorm."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = NoUpcastRMSNorm(hidden)
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        return x + self.fc2(F.silu(self.fc1(self.norm(x))))


class OutlierDecoder(nn.Module):
    """(B, L, 16) features -> Linear into a residual stream with two outlier channels of about +-300 ->
    two pre-norm blocks (NoUpcastRMSNorm) -> NoUpcastLayerNorm -> Linear head.

    Exercises: fp16 overflow of x^2 in norms that do not upcast (the fp32 model is fine).
    """

    def __init__(self, features: int = 16, hidden: int = OUTLIER_HIDDEN, layers: int = 2, out: int = 8):
        super().__init__()
        self.proj = nn.Linear(features, hidden)
        self.blocks = nn.ModuleList(OutlierBlock(hidden) for _ in range(layers))
        self.norm = NoUpcastLayerNorm(hidden)
        self.head = nn.Linear(hidden, out)
        with torch.no_grad():
            for c in OUTLIER_CHANNELS:  # massive activations: a constant-ish channel of a few hundred
                self.proj.bias[c] = OUTLIER_SCALE if c % 2 else -OUTLIER_SCALE
            for m in self.modules():
                if isinstance(m, NoUpcastRMSNorm):
                    random_scale_(m.weight)
                elif isinstance(m, NoUpcastLayerNorm):
                    random_scale_(m.weight)
                    random_shift_(m.bias)

    def forward(self, x):
        h = self.proj(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


@seeded(117)
def fp16_overflow() -> nn.Module:
    """Pre-norm stack whose hand-written norms do not upcast, fed by outlier channels of about +-300."""
    return OutlierDecoder()


def fp16_overflow_inputs() -> tuple:
    return (randn(2, 8, 16, seed=117),)


SENSOR_CHANNELS = 6
SENSOR_SCALE = (5.0, 40.0, 300.0, 900.0, 2000.0, 3000.0)  # per-channel std of the raw readings


class RawSensorNet(nn.Module):
    """(B, 6, L) raw sensor readings (std up to 3000, |x| < 65504) -> BatchNorm1d on the input (running var up to
    9e6, beyond float16's max: inf in fp16) -> GELU -> Conv1d -> LayerNorm over channels -> Linear head.

    Exercises: a BatchNorm that cannot fold (graph input before, GELU after) whose running statistics do not fit
    in float16 while its input and output do; the LayerNorm after it has headroom.
    """

    def __init__(self, channels: int = SENSOR_CHANNELS, hidden: int = 32, out: int = 4):
        super().__init__()
        self.bn = nn.BatchNorm1d(channels)
        self.conv = nn.Conv1d(channels, hidden, 3, padding=1)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, out)

    def forward(self, x):
        h = self.conv(F.gelu(self.bn(x)))
        return self.head(self.norm(h.transpose(1, 2)))


@seeded(118)
def _raw_sensor() -> nn.Module:
    return RawSensorNet()


def fp16_raw_features() -> nn.Module:
    """RawSensorNet with running statistics of raw readings (set after the zoo's random norm statistics)."""
    model = _raw_sensor()
    scale = torch.tensor(SENSOR_SCALE)
    with torch.no_grad():
        model.bn.running_mean.copy_(scale * 0.5)
        model.bn.running_var.copy_(scale * scale)
    return model


def fp16_raw_features_inputs() -> tuple:
    scale = torch.tensor(SENSOR_SCALE).reshape(1, -1, 1)
    return (randn(2, SENSOR_CHANNELS, 24, seed=118) * scale + scale * 0.5,)


class ChannelsFirstLayerNorm(nn.Module):
    """NAFNet's / ConvNeXt's LayerNorm2d: normalizes dim 1 of (N, C, H, W), in the input's dtype (no upcast)."""

    def __init__(self, channels: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.eps = eps

    def forward(self, x):
        mu = x.mean(1, keepdim=True)
        var = (x - mu).pow(2).mean(1, keepdim=True)
        y = (x - mu) / (var + self.eps).sqrt()
        return self.weight.view(1, -1, 1, 1) * y + self.bias.view(1, -1, 1, 1)


class NAFBlock(nn.Module):
    """x + conv3(gate(dwconv(conv1(LN2d(x))))) with SimpleGate (split the channels in two, multiply)."""

    def __init__(self, c: int):
        super().__init__()
        self.norm = ChannelsFirstLayerNorm(c)
        self.conv1 = nn.Conv2d(c, 2 * c, 1)
        self.dwconv = nn.Conv2d(2 * c, 2 * c, 3, padding=1, groups=2 * c)
        self.conv3 = nn.Conv2d(c, c, 1)

    def forward(self, x):
        a, b = self.dwconv(self.conv1(self.norm(x))).chunk(2, dim=1)
        return x + self.conv3(a * b)


class TinyNAFNet(nn.Module):
    """(B, 3, H, W) -> conv stem writing two feature channels of about +-300 -> 2 NAFBlocks -> LayerNorm2d ->
    conv to 3 channels + the input (image restoration's global residual).

    Exercises: a channels-first hand-written LayerNorm without upcast: (x - mean)^2 over the channel dim
    overflows float16 on the outlier channels.
    """

    def __init__(self, c: int = 16, blocks: int = 2):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(*(NAFBlock(c) for _ in range(blocks)))
        self.norm = ChannelsFirstLayerNorm(c)
        self.out = nn.Conv2d(c, 3, 3, padding=1)
        with torch.no_grad():
            for ch in (2, 9):  # feature channels of a few hundred (restoration nets' large activations)
                self.stem.bias[ch] = OUTLIER_SCALE if ch % 2 else -OUTLIER_SCALE
            for m in self.modules():
                if isinstance(m, ChannelsFirstLayerNorm):
                    random_scale_(m.weight)
                    random_shift_(m.bias)

    def forward(self, x):
        return x + self.out(self.norm(self.blocks(self.stem(x))))


@seeded(119)
def nafnet_fp16() -> nn.Module:
    """NAFNet-style restoration net whose channels-first LayerNorms do not upcast, behind +-300 channels."""
    return TinyNAFNet()


def nafnet_fp16_inputs() -> tuple:
    return (randn(2, 3, 16, 16, seed=119),)
