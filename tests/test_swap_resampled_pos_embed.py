"""A position embedding resampled to the input's token grid before it is added (timm's ViTs with dynamic image size,
NaFlexViT: ``F.interpolate`` of the table, bicubic with antialias, bilinear, linear in 1-d): the resampling is the
same linear map for every channel, so centering the table along its channels centers what reaches the stream, and
the swap is exact at every input size (each size resamples differently)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import normconv

D = 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn, self.mlp = nn.Linear(D, D), nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, mode: str, antialias: bool = False):
        super().__init__()
        self.mode, self.antialias = mode, antialias
        self.patch = nn.Conv2d(3, D, 4, stride=4)
        grid = (1, D, 5) if mode == "linear" else (1, D, 5, 5)
        self.pos_embed = nn.Parameter(torch.randn(grid))
        self.blocks = nn.Sequential(Block(), Block())
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, 3)

    def forward(self, x):
        x = self.patch(x)  # (B, D, h, w)
        if self.mode == "linear":  # a 1-d table resampled to the number of tokens
            x = x.flatten(2)
            pos = F.interpolate(self.pos_embed, size=x.shape[-1], mode="linear", align_corners=False)
        else:
            pos = F.interpolate(self.pos_embed, size=x.shape[-2:], mode=self.mode, antialias=self.antialias,
                                **({} if self.mode.startswith("nearest") else {"align_corners": False}))
            x, pos = x.flatten(2), pos.flatten(2)
        x = (x + pos).transpose(1, 2)  # (B, N, D)
        return self.head(self.norm(self.blocks(x)).mean(1))


@pytest.mark.parametrize("mode, antialias", [("bicubic", True), ("bilinear", False), ("linear", False),
                                             ("nearest-exact", False)])
def test_a_resampled_position_embedding_is_centered_and_the_swap_is_exact(mode, antialias):
    torch.manual_seed(0)
    net = ViT(mode, antialias).eval()
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "norm" in name:
                p.add_(0.5 * torch.randn_like(p))
    before = net.pos_embed.detach().clone()
    new, report = normconv.swap(net, torch.randn(2, 3, 32, 32))
    assert report.passed and report.extra["swapped"] == 5
    assert torch.equal(net.pos_embed, before)  # the user's model untouched
    assert new.pos_embed.mean(1).abs().max() < 1e-6  # the table centered along its channels
    for shape in ((1, 3, 24, 24), (3, 3, 40, 28)):  # other grids: other resamplings
        other = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(new(other), net(other), atol=1e-5, rtol=1e-4)
