"""A linear that reads a norm and adds its own bias after its matmul (FalconLinear: ``x @ W.T + self.bias``, Falcon
with bias=True, the Falcon-RW layout) takes the norm's bias into that bias: (n + b) W^T + c = n W^T + (W b + c). The
bias was not seen ('has no bias parameter' in a folder, 'adds its bias outside its matmul' in memory), so every norm
kept its bias as an add after the RMSNorm, and rotate refused on that add."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import normconv
from tests.test_swap_offset_weight import _moved  # parameters moved off their init, seeded


class MatmulLinear(nn.Linear):
    def forward(self, x):
        return x @ self.weight.T + self.bias


class Model(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.embed, self.ln, self.fc, self.proj = nn.Embedding(30, d), nn.LayerNorm(d), MatmulLinear(d, d), \
            nn.Linear(d, d)
        self.out = nn.LayerNorm(d)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.proj(F.gelu(self.fc(self.ln(h))))
        return self.out(h)


def test_the_bias_of_a_matmul_linear_takes_the_norm_s_bias():
    model = _moved(Model())
    new, report = normconv.swap(model, torch.randint(0, 30, (2, 5)), method="torch.export")
    assert "bias folds into 1 consumer" in report.sites[0].reason, report.sites[0].reason
    assert isinstance(new.ln, nn.RMSNorm) and isinstance(new.fc, MatmulLinear)
    for shape in ((1, 9), (3, 4)):
        ids = torch.randint(0, 30, shape)
        with torch.no_grad():
            torch.testing.assert_close(new(ids), model(ids), atol=1e-5, rtol=1e-4)


def _falcon_rw():
    transformers = pytest.importorskip("transformers")
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    cfg = transformers.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
                                    new_decoder_architecture=False, multi_query=False, parallel_attn=False,
                                    bias=True)
    return _moved(transformers.FalconForCausalLM(cfg)), transformers


def _close(model, other):
    for batch, seq in ((1, 7), (3, 11)):
        ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seq))
        with torch.no_grad():
            ref, got = model(input_ids=ids).logits.double(), other(input_ids=ids)
        got = (got.logits if hasattr(got, "logits") else got[0] if isinstance(got, (tuple, list)) else got).double()
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5


def test_falcon_rw_folder_folds_every_norm_bias_and_loads(cli, tmp_path):
    import json

    model, transformers = _falcon_rw()
    model.save_pretrained(tmp_path / "in")
    code, out, err = cli("--quiet", "swap", tmp_path / "in", "--to", "rmsnorm", "-o", tmp_path / "out", "--json")
    assert code == 0, err
    reasons = [s["reason"] for s in json.loads(out)["sites"]]
    assert all("stays an add" not in r for r in reasons[:4]), reasons  # the final norm feeds lm_head (no bias)
    _close(model, transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval())


def test_falcon_rw_rotates_exactly():
    model, _ = _falcon_rw()
    new, report = normconv.rotate(model, {"input_ids": torch.randint(0, 128, (2, 7))})
    assert report.passed
    _close(model, new)
