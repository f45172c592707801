"""A .pt2 program's plans are what its commands then do. ``fold`` and ``export`` lift a program's functional convs /
linears into native modules before they fold (passes/lift_layers.py), but ``inspect`` (and export's own plan)
planned on the program as loaded, where a conv is ``aten.conv2d`` on constant weights: a conv -> BatchNorm was said
not to fold ('c is a functional conv ...: left as is') while ``fold`` folded it and ``export`` wrote no
BatchNormalization. The fold-family plans are now made on the program as lifted (engine/plans.PLANNERS)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.bn, self.act = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()

    def forward(self, x):
        return self.act(self.bn(self.c(x)))


class LinearBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.f, self.bn, self.act = nn.Linear(12, 8), nn.BatchNorm1d(8), nn.ReLU()

    def forward(self, x):
        return self.act(self.bn(self.f(x)))


def _program(tmp_path, cls, example):
    torch.manual_seed(0)
    model = cls().eval()
    with torch.no_grad():  # trained-looking statistics
        model.bn.running_mean.normal_()
        model.bn.running_var.uniform_(0.5, 2.0)
        model.bn.weight.normal_()
        model.bn.bias.normal_()
    dims = ({0: torch.export.Dim.AUTO},)
    torch.export.save(torch.export.export(model, (example,), dynamic_shapes=dims), tmp_path / "m.pt2")
    return model, tmp_path / "m.pt2"


@pytest.mark.parametrize("cls,example", [(ConvBN, torch.randn(2, 3, 10, 10)), (LinearBN, torch.randn(4, 12))],
                         ids=["conv", "linear"])
def test_inspect_plans_the_fold_that_fold_does(cli, tmp_path, cls, example):
    model, path = _program(tmp_path, cls, example)
    code, out, _ = cli("inspect", path, "--json")
    assert code == 0
    (site,) = json.loads(out)["sites"]
    planned = {p["pass"]: p for p in site["plan"]}
    assert planned["fold"]["applied"] and planned["fold"]["code"] == "fold-backward", planned["fold"]
    assert planned["export"]["code"] == "folded", planned["export"]  # export folds it: no BatchNormalization

    code, out, _ = cli("fold", path, "-o", tmp_path / "f.pt2", "--json")
    assert code == 0
    done = {s["pass"]: s for s in json.loads(out)["sites"] if s["target"] == "bn"}
    assert (done["fold"]["applied"], done["fold"]["code"]) == (planned["fold"]["applied"], planned["fold"]["code"])
    folded = torch.export.load(str(tmp_path / "f.pt2")).module()
    for batch in (3, 5):  # fresh inputs at two shapes, neither the example's
        x = torch.randn(batch, *example.shape[1:])
        torch.testing.assert_close(folded(x), model(x), rtol=1e-5, atol=1e-5)


def test_export_plan_of_a_program_says_the_fold(cli, tmp_path):
    _, path = _program(tmp_path, ConvBN, torch.randn(2, 3, 10, 10))
    code, out, _ = cli("export", path, "-o", tmp_path / "m.onnx", "--json")
    assert code == 0
    report = json.loads(out)
    (planned,) = [s for s in report["sites"] if s["pass"] == "export"]
    assert planned["code"] == "folded", planned
    assert report["extra"]["passes"][0] == "lift"
    import onnx

    assert "BatchNormalization" not in {n.op_type for n in onnx.load(str(tmp_path / "m.onnx")).graph.node}
