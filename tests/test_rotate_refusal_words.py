"""A rotate refusal says its reason in the model's terms: the module (from the node's module stack), the parameter,
"a residual add" or "the model's output" that reads a norm's output, never a graph node's name (add_7, mul_3)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn as nn

from normconv.api import rotate
from normconv.errors import Code, NormconvError
from normconv.verify import Inputs

NODE = re.compile(r"\b(add|mul|tanh|view|linear|select|getitem|layer_norm|rms_norm)_\d+\b")


def _refusal(model, inputs) -> NormconvError:
    with pytest.raises(NormconvError) as err:
        rotate(model, inputs)
    assert err.value.code is Code.REFUSED
    assert not NODE.search(err.value.message), err.value.message
    return err.value


def test_dinov2_final_norm_bias_returned_is_said_in_model_terms():
    """DINOv2 returns its final LayerNorm's output: the swap keeps that norm's bias as an add after the RMSNorm, and
    the scale cannot fold through it (the refusal named the add's graph node, add_7)."""
    import transformers

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    config = transformers.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2,
                                       image_size=32, patch_size=8)
    model = transformers.Dinov2Model(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    err = _refusal(model, Inputs((), {"pixel_values": torch.randn(2, 3, 32, 32)}))
    assert err.pass_name == "fold-scales"
    assert "the add of layernorm.bias in layernorm reads the norm output" in err.message
    assert "returned by the model" in err.message


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        z = self.norm(x)
        return x + self.lin(z) * torch.tanh(z)


class _Gated(nn.Module):
    """A pre-norm block whose norm output is also read by a tanh inside the block: no linear takes it."""

    def __init__(self, d=16):
        super().__init__()
        self.emb = nn.Embedding(20, d)
        self.block = _Block(d)
        self.head = nn.Linear(d, 20)
        self.final = nn.RMSNorm(d)

    def forward(self, ids):
        return self.head(self.final(self.block(self.emb(ids))))


def test_a_non_linear_reader_is_named_by_its_op_and_module():
    torch.manual_seed(0)
    err = _refusal(_Gated().eval(), Inputs((torch.randint(0, 20, (2, 5)),)))
    assert "block.norm: tanh in block reads the norm output and is not a linear layer" in err.message


class _CatReader(nn.Module):
    """A pre-LN block whose norm output is read through a cat: the swap keeps the norm's bias as an add after the
    RMSNorm (normconv's BiasAfterNorm), and the scale cannot fold through that add."""

    def __init__(self, d=16):
        super().__init__()
        self.embed, self.ln, self.fc = nn.Embedding(30, d), nn.LayerNorm(d), nn.Linear(2 * d, d)
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, 5)

    def forward(self, ids):
        h = self.embed(ids)
        n = self.ln(h)
        h = h + self.fc(torch.cat([n, n.flip(1)], -1))
        return self.head(self.ln_f(h))


def test_a_norm_whose_bias_stays_after_it_is_named_by_the_model_s_module():
    """It was named by the RMSNorm inside normconv's wrapper ('ln.norm'), a module the model does not have."""
    torch.manual_seed(0)
    model = _CatReader().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    err = _refusal(model, Inputs((torch.randint(0, 30, (2, 5)),), {}))
    assert err.message.startswith("fold-scales: ln: "), err.message
    assert "ln.norm" not in err.message
