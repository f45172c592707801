"""fold on BatchNorm modules whose forward also applies drop + act (timm's BatchNormAct2d): the affine goes into the
conv before it and the module is replaced by its own drop and act, so the user's class comes back, whatever captured
the model (symbolic_trace, or torch.export where symbolic_trace fails)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fold_helpers import applied, bn_modules, randomize_bn, skipped
from normconv.api import fold
from tests.fixtures.bn_act import BNAct, Net, Untraceable, build, same_outputs, untraceable

ROOT = Path(__file__).resolve().parents[1]

torch.manual_seed(0)


def _model(cls):
    return build(cls)


@pytest.mark.parametrize("cls", [Net, Untraceable])
def test_bn_act_modules_fold_and_the_class_comes_back(cls):
    model = _model(cls)
    keys = set(model.state_dict())
    folded, report = fold(model, torch.randn(2, 3, 16, 16))
    assert report.passed and not skipped(report)
    assert len(applied(report)) == 3
    # the user's class, its own methods, no BatchNorm left; drop and act kept in place
    assert type(folded) is cls and not isinstance(folded, fx.GraphModule)
    assert hasattr(folded, "forward_features")
    assert bn_modules(folded) == 0
    assert isinstance(folded.bn1.act, nn.SiLU) and isinstance(folded.bn2.drop, nn.Dropout)
    assert isinstance(folded.bn3.act, nn.PReLU) and torch.equal(folded.bn3.act.weight, model.bn3.act.weight)
    # the BN's own keys gone, the conv biases added, every other key where it was
    gone = {k for k in keys if k.split(".")[0] in ("bn1", "bn2", "bn3") and ".act." not in k}
    assert set(folded.state_dict()) == (keys - gone) | {"conv1.bias", "conv3.bias"}
    same_outputs(model, folded, [(2, 3, 16, 16), (3, 3, 20, 23)])
    assert bn_modules(model) == 3 and type(model.bn1) is BNAct  # the user's model untouched


class FunctionalUntraceable(nn.Module):
    """F.batch_norm in the model's own forward, which symbolic_trace cannot trace: no module can replace it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3)
        self.register_buffer("mean", torch.randn(5))
        self.register_buffer("var", torch.rand(5) + 0.5)

    def forward(self, x):
        y = self.conv(x)
        if y.shape[-1] % 2:
            y = y[..., 1:]
        return F.batch_norm(y, self.mean, self.var, None, None, False, 0.1, 1e-3)


def test_under_torch_export_bn_act_modules_fold_and_only_a_functional_bn_is_not_removable():
    """D2: under torch.export the reason for a module's BN was 'functional batch_norm ... only a symbolically
    traceable model can have it removed' and nothing folded."""
    with pytest.raises(Exception):
        fx.symbolic_trace(Untraceable())
    _, report = fold(_model(Untraceable), torch.randn(2, 3, 16, 16))
    assert not any("symbolically traceable" in s.reason for s in report.sites)
    assert set(applied(report)) and not skipped(report)
    # a truly functional BN under torch.export keeps that reason: it is true there
    model = FunctionalUntraceable().eval()
    folded, report = fold(model, torch.randn(2, 3, 8, 8))
    (site,) = report.sites
    assert not site.applied and site.code.value == "not-removable"
    assert "functional batch_norm in a graph captured by torch.export" in site.reason
    assert type(folded) is FunctionalUntraceable


class SharedUntraceable(nn.Module):
    """One BNAct called twice, in a forward symbolic_trace cannot trace: no module can replace either call."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2, self.bn = nn.Conv2d(3, 4, 1), nn.Conv2d(4, 4, 1), BNAct(4)

    def forward(self, x):
        x = self.bn(self.conv2(self.bn(self.conv1(x))))
        return x[..., 1:] if x.shape[-1] % 2 else x


def test_under_torch_export_a_bn_in_a_module_that_cannot_be_replaced_says_which_and_why():
    """Its BN is not 'functional' alone: the reason names the module and why it cannot be replaced."""
    model = SharedUntraceable().eval()
    folded, report = fold(model, torch.randn(2, 3, 8, 8))
    assert [s.applied for s in report.sites] == [False, False]
    for site in report.sites:
        assert site.code.value == "not-removable"
        assert "inside bn (BNAct)" in site.reason and "called at 2 places" in site.reason, site.reason
    assert type(folded) is SharedUntraceable and bn_modules(folded) == 1


class FunctionalRoot(nn.Module):
    """A truly functional BatchNorm in the model's own forward: only a traced graph can lose it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3)
        for name, v in (("mean", torch.randn(5)), ("var", torch.rand(5) + 0.5)):
            self.register_buffer(name, v)
        self.w, self.b = nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(5))

    def forward(self, x):
        return F.relu(F.batch_norm(self.conv(x), self.mean, self.var, self.w, self.b, False, 0.1, 1e-3))


def test_a_graph_module_comes_back_only_for_a_functional_batch_norm_and_a_note_says_so():
    model = FunctionalRoot().eval()
    folded, report = fold(model, torch.randn(2, 3, 8, 8))
    assert isinstance(folded, fx.GraphModule) and set(applied(report)) == {"batch_norm"}
    assert any("GraphModule" in n and "FunctionalRoot" in n for n in report.notes), report.notes
    same_outputs(model, folded, [(2, 3, 8, 8), (1, 3, 12, 10)])


@pytest.mark.parametrize("name", ["resnext26ts", "mobilevit_xxs"])
def test_timm_bn_act_models_keep_their_class(name):
    timm = pytest.importorskip("timm")
    model = timm.create_model(name, pretrained=False, num_classes=10)
    randomize_bn(model)
    bns = bn_modules(model)
    folded, report = fold(model, torch.randn(1, 3, 64, 64))
    assert report.passed
    assert type(folded) is type(model) and hasattr(folded, "reset_classifier")
    assert len(applied(report)) == bns - bn_modules(folded) and bn_modules(folded) < bns // 2
    same_outputs(model, folded, [(1, 3, 64, 64), (2, 3, 96, 96)])


# a fresh interpreter in which normconv cannot be imported: the written model is plain torch and the user's classes
_LOAD = r"""
import sys
sys.modules["normconv"] = None
import torch
m = torch.load(sys.argv[1], weights_only=False)
assert type(m).__name__ == "Untraceable", type(m)
assert not any(isinstance(x, torch.nn.modules.batchnorm._BatchNorm) for x in m.modules())
x = torch.load(sys.argv[2])
with torch.no_grad():
    torch.save([m(t) for t in x], sys.argv[3])
"""


def test_cli_writes_the_users_class_that_loads_without_normconv(cli, tmp_path):
    out = tmp_path / "folded.pt"
    code, stdout, stderr = cli("fold", "tests.fixtures.bn_act:untraceable", "-i", "x:2,3,16,16", "-o", out,
                               "--json")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert [s["applied"] for s in report["sites"]] == [True] * 3 and report["after"]["batchnorm modules"] == 0
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(2, 3, 16, 16, generator=g), torch.randn(1, 3, 18, 21, generator=g)]
    torch.save(xs, tmp_path / "x.pt")
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # the user's own code importable, normconv blocked
    r = subprocess.run([sys.executable, "-c", _LOAD, str(out), str(tmp_path / "x.pt"), str(tmp_path / "y.pt")],
                       capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    model = untraceable()
    with torch.no_grad():
        for x, y in zip(xs, torch.load(tmp_path / "y.pt")):
            ref = model(x)
            assert (y - ref).abs().max() <= 1e-5 * max(ref.abs().max(), 1.0)
