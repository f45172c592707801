"""canonicalize said "inline norms were rewritten in the traced graph: the result is a torch.fx.GraphModule (the
model's own class is not kept)" whenever the result was a GraphModule: of every .pt2 (a program's module is one
already, with no class of its own), even where it replaced nothing and said "the model is unchanged" in the same
report. The note is now said only where an inline norm was rewritten in a model that had its own class."""

from __future__ import annotations

import json

import torch
import torch.nn as nn

NOTE = "inline norms were rewritten in the traced graph"


class Inline(nn.Module):
    """An RMSNorm written inline in a bigger forward (no module of its own)."""

    def __init__(self, native=False):
        super().__init__()
        self.e, self.w, self.h = nn.Linear(16, 32), nn.Parameter(torch.rand(32) + 0.5), nn.Linear(32, 4)
        self.ln = nn.LayerNorm(32) if native else None

    def forward(self, x):
        h = self.e(x)
        if self.ln is not None:
            return self.h(self.ln(h))
        return self.h(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w)


def _canonicalize(cli, tmp_path, native):
    torch.manual_seed(0)
    model = Inline(native).eval()
    auto = torch.export.Dim.AUTO
    ep = torch.export.export(model, (torch.randn(2, 5, 16),), dynamic_shapes=({0: auto, 1: auto},))
    torch.export.save(ep, tmp_path / "m.pt2")
    code, out, err = cli("canonicalize", tmp_path / "m.pt2", "-o", tmp_path / "c.pt2", "--json")
    assert code == 0, err
    program = torch.export.load(str(tmp_path / "c.pt2")).module()
    for shape in ((3, 7, 16), (1, 4, 16)):  # the written program is the model at two fresh shapes
        x = torch.randn(*shape)
        with torch.no_grad():
            torch.testing.assert_close(program(x), model(x), rtol=1e-5, atol=1e-5)
    return json.loads(out)


def test_a_pt2_canonicalize_leaves_unchanged_says_no_rewrite(cli, tmp_path):
    report = _canonicalize(cli, tmp_path, native=True)
    assert not any(s["applied"] for s in report["sites"])
    assert any("the model is unchanged" in n for n in report["notes"])
    assert not any(NOTE in n for n in report["notes"]), report["notes"]


def test_a_pt2_program_has_no_class_to_lose(cli, tmp_path):
    report = _canonicalize(cli, tmp_path, native=False)
    assert [s["applied"] for s in report["sites"]] == [True]
    assert not any(NOTE in n for n in report["notes"]), report["notes"]


def test_a_module_tree_rewritten_inline_is_told_it_comes_back_a_graph_module():
    import normconv

    torch.manual_seed(0)
    model = Inline().eval()
    new, report = normconv.canonicalize(model, (torch.randn(2, 5, 16),))
    assert isinstance(new, torch.fx.GraphModule)
    assert any(NOTE in n for n in report.notes), report.notes
