"""Exact LN -> RMSNorm past writers that are not Linear / Embedding: a parameter added to the stream (position
embedding, class token joined with cat), a conv patch embedding reached through flatten / transpose, an in-place
add_; and refusals that name the op when no weights-only rewrite exists (grouped conv)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import normconv
from normconv.errors import NormconvError
from normconv.verify import Inputs, run

D = 32


def _randomize(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.split(".")[-1] in ("cls", "pos", "cls_token", "position_embeddings"):
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    return model


class Block(nn.Module):
    def __init__(self, inplace=False):
        super().__init__()
        self.inplace = inplace
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 64), nn.Linear(64, D)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).reshape(b, n, 3, 4, D // 4).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, D)
        x = x + self.proj(a)
        h = self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x.add_(h) if self.inplace else x + h


class ViT(nn.Module):
    """Pre-LN ViT: conv patches -> flatten/transpose, class token by cat, learned position embedding (Parameters)."""

    def __init__(self, groups=1, inplace=False):
        super().__init__()
        self.patch = nn.Conv2d(4, D, 8, 8, groups=groups)
        self.cls = nn.Parameter(torch.randn(1, 1, D))
        self.pos = nn.Parameter(torch.randn(1, 17, D))
        self.blocks = nn.Sequential(Block(inplace), Block(inplace))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, 10)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.norm(self.blocks(x))[:, 0])


def _exact(model, x, x2):
    new, report = normconv.swap(model, x)
    assert not any(isinstance(m, nn.LayerNorm) for m in new.modules())
    ref, out = run(model, Inputs((x2,))), run(new, Inputs((x2,)))  # a second batch size, checked here
    ref, out = getattr(ref, "logits", ref), getattr(out, "logits", out)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    return new


@pytest.mark.parametrize("inplace", [False, True])
def test_handwritten_vit_swaps_exactly(inplace):
    torch.manual_seed(0)
    model = _randomize(ViT(inplace=inplace)).eval()
    new = _exact(model, torch.randn(2, 4, 32, 32), torch.randn(5, 4, 32, 32))
    # the writers were centered along the hidden axis: conv over output channels, parameters along D
    assert new.patch.weight.double().mean(0).abs().max() < 1e-6 and new.patch.bias.double().mean().abs() < 1e-6
    assert new.pos.double().mean(-1).abs().max() < 1e-6 and new.cls.double().mean(-1).abs().max() < 1e-6
    assert model.pos.double().mean(-1).abs().max() > 1e-3  # the user's model is untouched


def test_grouped_conv_writer_is_refused_by_name():
    torch.manual_seed(0)
    model = ViT(groups=2).eval()
    with pytest.raises(NormconvError, match="patch is a grouped conv"):
        normconv.swap(model, torch.randn(2, 4, 32, 32))


def tiny_hf_vit() -> nn.Module:
    """HF ViTForImageClassification (hidden 32, 2 layers, 32 px, patch 8) with every weight, the position
    embeddings and the class token random: centering / rotating them is visible."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                 image_size=32, patch_size=8, num_labels=10)
    model = _randomize(transformers.ViTForImageClassification(cfg)).eval()
    with torch.no_grad():
        model.vit.embeddings.position_embeddings.normal_()
        model.vit.embeddings.cls_token.normal_()
    return model


def test_hf_vit_swaps_exactly():
    _exact(tiny_hf_vit(), torch.randn(2, 3, 32, 32), torch.randn(3, 3, 32, 32))
