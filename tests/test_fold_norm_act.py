"""fold on BatchNorm modules whose forward also applies drop + act (timm's BatchNormAct2d): the affine goes into the
conv before it and the module is replaced by its own drop and act, so the user's class comes back."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from fold_helpers import applied, bn_modules, randomize_bn, skipped
from normconv.api import fold
from tests.fixtures.bn_act import BNAct, Net, build

torch.manual_seed(0)


def _model(cls):
    return build(cls)


def _same(model, folded, shapes):
    """The folded model equals the original on fresh inputs at each shape, within 1e-5 of the output's scale."""
    g = torch.Generator().manual_seed(1)
    for shape in shapes:
        x = torch.randn(*shape, generator=g)
        with torch.no_grad():
            ref, out = model(x), folded(x)
        assert out.shape == ref.shape
        assert (out - ref).abs().max() <= 1e-5 * max(ref.abs().max(), 1.0), (out - ref).abs().max()


@pytest.mark.parametrize("cls", [Net])
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
    _same(model, folded, [(2, 3, 16, 16), (3, 3, 20, 23)])
    assert bn_modules(model) == 3 and type(model.bn1) is BNAct  # the user's model untouched


@pytest.mark.parametrize("name", ["resnext26ts"])
def test_timm_bn_act_models_keep_their_class(name):
    timm = pytest.importorskip("timm")
    model = timm.create_model(name, pretrained=False, num_classes=10)
    randomize_bn(model)
    bns = bn_modules(model)
    folded, report = fold(model, torch.randn(1, 3, 64, 64))
    assert report.passed
    assert type(folded) is type(model) and hasattr(folded, "reset_classifier")
    assert len(applied(report)) == bns - bn_modules(folded) and bn_modules(folded) < bns // 2
    _same(model, folded, [(1, 3, 64, 64), (2, 3, 96, 96)])

