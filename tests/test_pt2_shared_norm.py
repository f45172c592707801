"""One norm module called at several places, in a .pt2: the program keeps the module as a holder of its tensors and
computes each call inline, so canonicalize refused every call ('n is called more than once and its calls share n.g:
one native module per call would untie them') and swap refused the program ('functional norm written inline in ln:
swap replaces norm modules', exit 2), though the same model as a module tree canonicalizes and swaps exactly. Now
one native module takes the holder's place and every call calls it (the tie kept), checked on each call's
recorded values; a holder whose calls one module cannot all reproduce is left as it is."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn


class HandLN(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.g, self.b = nn.Parameter(torch.rand(d) + 0.5), nn.Parameter(torch.randn(d))

    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        v = ((x - m) ** 2).mean(-1, keepdim=True)
        return self.g * (x - m) / torch.sqrt(v + 1e-5) + self.b


class Shared(nn.Module):
    """Pre-LN: one norm module before both sublayers and the head."""

    def __init__(self, norm, wide=False):
        super().__init__()
        self.e, self.n, self.f, self.g, self.h = nn.Linear(16, 32), norm(32), nn.Linear(32, 32), \
            nn.Linear(32, 32), nn.Linear(32, 4)
        self.wide = wide

    def forward(self, x):
        h = self.e(x)
        h = h + self.f(self.n(h))
        h = h + self.g(self.n(h))
        return self.h(self.n(h.double()).float() if self.wide else self.n(h))


def _program(tmp_path, norm, wide=False):
    torch.manual_seed(0)
    model = Shared(norm, wide).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    auto = torch.export.Dim.AUTO
    ep = torch.export.export(model, (torch.randn(2, 5, 16),), dynamic_shapes=({0: auto, 1: auto},))
    torch.export.save(ep, tmp_path / "m.pt2")
    return model, tmp_path / "m.pt2"


def _same(model, path):
    """The written program, loaded with torch alone, equals the model at two fresh shapes (not the example's)."""
    program = torch.export.load(str(path)).module()
    for shape in ((3, 7, 16), (1, 4, 16)):
        x = torch.randn(*shape)
        with torch.no_grad():
            torch.testing.assert_close(program(x), model(x), rtol=1e-5, atol=1e-5)
    return program


@pytest.mark.parametrize("norm", [nn.LayerNorm, HandLN], ids=["native", "handwritten"])
def test_swap_of_a_norm_module_called_three_times_in_a_pt2(cli, tmp_path, norm):
    model, path = _program(tmp_path, norm)
    code, out, _ = cli("inspect", path, "--json")
    assert code == 0
    sites = json.loads(out)["sites"]  # one site per call
    assert len(sites) == 3 and all([p["applied"] for p in s["plan"] if p["pass"] == "swap"] == [True]
                                   for s in sites), sites
    code, out, err = cli("swap", path, "--to", "rmsnorm", "-o", tmp_path / "s.pt2", "--json")
    assert code == 0, err
    swaps = [s for s in json.loads(out)["sites"] if s["pass"] == "swap"]
    assert len(swaps) == 3 and all(s["applied"] for s in swaps), swaps
    _same(model, tmp_path / "s.pt2")
    # one RMSNorm in the holder's place, called three times: one weight, the tie kept
    assert [k for k in torch.export.load(str(tmp_path / "s.pt2")).state_dict if k.startswith("n.")] == ["n.weight"]


def test_canonicalize_of_a_handwritten_norm_called_three_times_in_a_pt2(cli, tmp_path):
    model, path = _program(tmp_path, HandLN)
    code, out, err = cli("canonicalize", path, "-o", tmp_path / "c.pt2", "--json")
    assert code == 0, err
    sites = json.loads(out)["sites"]
    assert len(sites) == 3 and all(s["applied"] and s["code"] == "replaced" for s in sites), sites
    _same(model, tmp_path / "c.pt2")
    assert [k for k in torch.export.load(str(tmp_path / "c.pt2")).state_dict if k.startswith("n.")] == \
        ["n.weight", "n.bias"]  # one native module in the holder's place: the calls still share its tensors


def test_a_holder_one_module_cannot_reproduce_at_every_call_is_left_as_it_is(cli, tmp_path):
    model, path = _program(tmp_path, HandLN, wide=True)  # the last call on float64: no float32 module computes it
    code, out, err = cli("canonicalize", path, "-o", tmp_path / "c.pt2", "--json")
    assert code == 0, err
    sites = json.loads(out)["sites"]
    assert len(sites) == 3 and not any(s["applied"] for s in sites), sites
    _same(model, tmp_path / "c.pt2")
