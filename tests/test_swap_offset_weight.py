"""A LayerNorm whose scale is a parameter plus a constant, ``F.layer_norm(x, shape, self.weight + 1, self.bias, eps)``
(Nemotron's NemotronLayerNorm1P, Megatron's apply_layernorm_1p): the site's weight is the parameter with a weight
offset of 1, as a hand-written ``x * (1 + w)`` is read, so swap treats it as the LayerNorm it is. On a centred stream
it is RMSNorm(x) * (w + 1) + b. Every site was refused ('overrides forward and computes more than the norm'), and
rotate with it."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import normconv
from normconv.graph.capture import capture
from normconv.graph.detect import find_norms
from normconv.verify import Inputs

D = 16


class LayerNorm1P(nn.Module):
    """A module of its own (no nn.LayerNorm subclass): the weight is stored minus one."""

    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.zeros(d)), nn.Parameter(torch.zeros(d)), eps

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight + 1, self.bias, self.eps)


class PreLN(nn.Module):
    def __init__(self, vocab=40):
        super().__init__()
        self.embed = nn.Embedding(vocab, D)
        self.ln1, self.fc1, self.ln2, self.fc2 = LayerNorm1P(D), nn.Linear(D, D), LayerNorm1P(D), nn.Linear(D, D)
        self.ln_f, self.head = LayerNorm1P(D), nn.Linear(D, 7)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.fc1(F.gelu(self.ln1(h)))
        h = h + self.fc2(self.ln2(h))
        return self.head(self.ln_f(h))


def _moved(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def test_weight_plus_one_is_the_site_s_weight_with_an_offset():
    model = _moved(PreLN())
    sites = find_norms(capture(model, Inputs((torch.randint(0, 40, (2, 5)),), {})))
    assert [(s.kind, s.weight, s.weight_offset) for s in sites] == [
        ("layernorm", f"{n}.weight", 1.0) for n in ("ln1", "ln2", "ln_f")]


def test_handwritten_layernorm1p_swaps_exactly():
    model = _moved(PreLN())
    new, report = normconv.swap(model, torch.randint(0, 40, (2, 5)))
    assert report.passed and all(s.applied for s in report.sites), [s.reason for s in report.sites]
    assert not any(isinstance(m, (nn.LayerNorm, LayerNorm1P)) for m in new.modules())
    for shape in ((1, 9), (3, 4)):
        ids = torch.randint(0, 40, shape, generator=torch.Generator().manual_seed(sum(shape)))
        with torch.no_grad():
            torch.testing.assert_close(new(ids), model(ids), atol=1e-5, rtol=1e-4)


def _nemotron():
    transformers = pytest.importorskip("transformers")
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    cfg = transformers.NemotronConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=128,
                                      max_position_embeddings=64)
    return _moved(transformers.NemotronForCausalLM(cfg)), transformers


def _close(model, other):
    for batch, seq in ((1, 7), (3, 11)):
        ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seq))
        with torch.no_grad():
            ref, got = model(input_ids=ids).logits.double(), other(input_ids=ids).logits.double()
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5


def test_nemotron_swaps_exactly_in_memory():
    model, _ = _nemotron()
    new, report = normconv.swap(model, {"input_ids": torch.randint(0, 128, (2, 7))})
    assert report.passed and len(report.sites) == 5 and all(s.applied for s in report.sites)
    _close(model, new)


def test_nemotron_folder_swaps_exactly_and_loads(cli, tmp_path):
    model, transformers = _nemotron()
    model.save_pretrained(tmp_path / "in")
    code, _, err = cli("swap", tmp_path / "in", "--to", "rmsnorm", "-o", tmp_path / "out")
    assert code == 0, err
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert float(loaded.get_input_embeddings().weight.double().mean(-1).abs().max()) < 1e-6  # a writer, centred
    _close(model, loaded)


class SharedOffsetWeight(nn.Module):
    """The scale ``w + 1`` is also read by another op: the add is not the norm's alone, so it is no part of the site."""

    def __init__(self):
        super().__init__()
        self.emb, self.weight = nn.Embedding(50, 16), nn.Parameter(torch.randn(16) * 0.1)
        self.bias, self.head = nn.Parameter(torch.randn(16) * 0.1), nn.Linear(16, 4)

    def forward(self, ids):
        scale = self.weight + 1
        h = F.layer_norm(self.emb(ids), (16,), scale, self.bias, 1e-5)
        return self.head(h) + scale.sum()


def test_an_offset_scale_read_elsewhere_is_not_taken_into_the_site():
    model = SharedOffsetWeight().eval()
    cap = capture(model, Inputs((torch.randint(0, 50, (2, 7)),)), "torch.export")
    (site,) = find_norms(cap)
    adds = [n for n in cap.nodes.values() if cap.op(n) == "add" and len(cap.users(n)) > 1]
    assert adds and not set(a.name for a in adds) & set(site.nodes)  # the shared w + 1 stays outside the norm
    assert site.weight_offset == 0.0
