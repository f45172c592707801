"""Norms in a .pt2: the program's module keeps each user module as a holder of its tensors that is never called (its
graph computes the norm), so canonicalize, which hooked the holder to record the norm's calls, recorded none and
replaced nothing ('the norm did not run on the example inputs', exit 0, model unchanged), and swap refused a pre-LN
program ('handwritten norm written inline ... canonicalize could not make it one'; a native nn.LayerNorm: 'functional
norm written inline', exit 2) though the same model as a factory swaps exactly. A holder's norm is rewritten in the
program's graph: a native module in the holder's place, called where the norm was."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn


class LN(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.gamma, self.beta = nn.Parameter(torch.rand(d) + 0.5), nn.Parameter(torch.randn(d))

    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        v = x.var(-1, keepdim=True, unbiased=False)
        return self.gamma * (x - m) / torch.sqrt(v + 1e-6) + self.beta


class Block(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.n1, self.f = norm(16), nn.Linear(16, 16)

    def forward(self, x):
        return x + self.f(self.n1(x))


class PreLN(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.emb, self.blocks = nn.Linear(16, 16), nn.Sequential(Block(norm), Block(norm))
        self.final, self.head = norm(16), nn.Linear(16, 5)

    def forward(self, x):
        return self.head(self.final(self.blocks(self.emb(x))))


SHAPES = ((3, 5, 16), (1, 9, 16))  # neither is the example's


def _program(tmp_path, norm):
    torch.manual_seed(0)
    model = PreLN(norm).eval()
    if norm is nn.LayerNorm:  # trained-looking affine
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, nn.LayerNorm):
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.normal_()
    auto = torch.export.Dim.AUTO
    ep = torch.export.export(model, (torch.randn(2, 6, 16),), dynamic_shapes=({0: auto, 1: auto},))
    torch.export.save(ep, tmp_path / "m.pt2")
    return model, tmp_path / "m.pt2"


def _matches(path, model):
    new = torch.export.load(str(path)).module()
    with torch.no_grad():
        for shape in SHAPES:
            x = torch.randn(shape)
            torch.testing.assert_close(new(x), model(x), atol=1e-5, rtol=1e-5)
    return new


def test_canonicalize_replaces_the_handwritten_norms_of_a_pt2(cli, tmp_path):
    model, src = _program(tmp_path, LN)
    out = tmp_path / "out.pt2"
    code, stdout, stderr = cli("--quiet", "canonicalize", src, "-o", out, "--json")
    assert code == 0, stderr
    import json

    sites = json.loads(stdout)["sites"]
    assert sorted(s["target"] for s in sites if s["applied"]) == ["blocks.0.n1", "blocks.1.n1", "final"]
    new = _matches(out, model)
    assert sum(n.target is torch.ops.aten.layer_norm.default for n in new.graph.nodes) == 3


@pytest.mark.parametrize("norm", [LN, nn.LayerNorm], ids=["handwritten", "native"])
def test_swap_to_rmsnorm_takes_a_pre_ln_pt2(cli, tmp_path, norm):
    model, src = _program(tmp_path, norm)
    out = tmp_path / "out.pt2"
    code, _, stderr = cli("--quiet", "swap", src, "--to", "rmsnorm", "-o", out)
    assert code == 0, stderr
    new = _matches(out, model)
    ops = {n.target for n in new.graph.nodes}
    assert torch.ops.aten.rms_norm.default in ops and torch.ops.aten.layer_norm.default not in ops
