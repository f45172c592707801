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
