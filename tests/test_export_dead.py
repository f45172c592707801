"""A norm whose result reaches no model output (LiLT's last layout layer, MaskFormer's unused backbone norm) is dead
code the ONNX exporter drops: export and inspect say so instead of claiming one fused op for it, and a norm read
only through an in-place op is live."""

from __future__ import annotations

import collections

import onnx
import pytest
import torch
import torch.nn as nn

from normconv.api import export, inspect


class TwoBranchLayer(nn.Module):
    """LiLT-style: a text and a layout branch, each ending in a LayerNorm; the layout input steers the text branch,
    and the model returns only the text result."""

    def __init__(self, d=16):
        super().__init__()
        self.text, self.layout = nn.Linear(d, d), nn.Linear(d, d)
        self.text_ln, self.layout_ln = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x, y):
        return self.text_ln(x + self.text(x + y)), self.layout_ln(y + self.layout(y))


class DeadBranchModel(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.layers = nn.ModuleList(TwoBranchLayer(d) for _ in range(2))

    def forward(self, x):
        y = x
        for layer in self.layers:
            x, y = layer(x, y)
        return x  # the last layer's layout result is computed and dropped


class InPlaceResidual(nn.Module):
    """The norm's result reaches the output only through an in-place add (its own node has no reader)."""

    def __init__(self, d=16):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        h = self.fc(x)
        h.add_(self.ln(x))
        return h


def _export_plan(report):
    return {s.target: s for s in report.sites if s.pass_name == "export"}


@pytest.mark.parametrize("opset", [17, 23])
def test_a_dead_norm_is_reported_not_exported(tmp_path, opset):
    torch.manual_seed(0)
    model, x = DeadBranchModel().eval(), torch.randn(2, 5, 16)
    path = tmp_path / "m.onnx"
    report = export(model, (x,), str(path), opset=opset)
    assert report.passed
    plan = _export_plan(report)
    dead = sorted(t for t, s in plan.items() if not s.applied)
    assert dead == ["layers.1.layout_ln"]
    assert "reaches no model output" in plan["layers.1.layout_ln"].reason
    ops = collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)
    assert ops["LayerNormalization"] == sum(s.applied for s in plan.values()) == 3


@pytest.mark.parametrize("method", ["symbolic_trace", "torch.export"])
def test_inspect_names_the_dead_norm(method):
    torch.manual_seed(0)
    rep = inspect(DeadBranchModel().eval(), (torch.randn(2, 5, 16),), method=method).to_json()
    reasons = {s["target"]: p["reason"] for s in rep["sites"] for p in s["plan"] if p["pass"] == "export"}
    assert [t for t, r in reasons.items() if "reaches no model output" in r] == ["layers.1.layout_ln"]


@pytest.mark.parametrize("method", ["symbolic_trace", "torch.export"])
def test_a_norm_read_through_an_in_place_op_is_live(method):
    torch.manual_seed(0)
    rep = inspect(InPlaceResidual().eval(), (torch.randn(2, 5, 16),), method=method).to_json()
    [site] = rep["sites"]
    assert [p["reason"] for p in site["plan"] if p["pass"] == "export"] == ["one LayerNormalization"]


class SharedNormOneCallDead(nn.Module):
    """PegasusX: one LayerNorm applied to the tokens and to the global tokens; the last global result is dropped."""

    def __init__(self, d=16):
        super().__init__()
        self.fc, self.ln = nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x):
        tokens, global_tokens = self.ln(self.fc(x)), self.ln(x + 1.0)
        del global_tokens  # computed, never read
        return tokens


def test_a_module_with_one_dead_call_exports_its_live_call(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "m.onnx"
    report = export(SharedNormOneCallDead().eval(), (torch.randn(2, 5, 16),), str(path), opset=17)
    plans = [s for s in report.sites if s.pass_name == "export" and s.target == "ln"]
    assert sorted(s.applied for s in plans) == [False, True]  # one entry per call
    assert [n.op_type for n in onnx.load(str(path)).graph.node].count("LayerNormalization") == 1
