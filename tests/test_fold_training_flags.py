"""fold refuses a model in training mode only where a module's training flag changes what it computes (a BatchNorm on
batch statistics, live dropout, a forward that reads self.training), and names that module. A Conv2d left in training
mode (timm's reparameterize_model makes new reparam_conv layers so) computes the same in either mode: it was refused
with "BatchNorm uses batch statistics there" about the conv, while export took the same model."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fold_helpers import applied, randomize_bn
from normconv.api import export, fold
from normconv.engine.training import flag_reader
from normconv.errors import NormconvError


class _Branchy(nn.Module):  # a user's module whose forward reads self.training
    def forward(self, x):
        return x * 0.5 if self.training else x


def _reparameterized() -> nn.Sequential:
    """conv -> BN -> relu -> conv, in eval mode, its last conv made anew (training mode, as a new module is)."""
    torch.manual_seed(0)
    model = randomize_bn(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1))).eval()
    model[3] = nn.Conv2d(8, 4, 1)
    assert model[3].training and not model[1].training
    return model


def test_a_conv_in_training_mode_is_folded(tmp_path):
    model = _reparameterized()
    x = torch.randn(1, 3, 16, 16)
    folded, report = fold(model, x)
    assert report.passed and set(applied(report)) == {"1"}
    assert not any(m.training for m in folded.modules())  # written in eval mode, the mode proven
    assert model[3].training  # the caller's model untouched
    assert any("training mode whose flag changes nothing" in n and "3" in n for n in report.notes)
    with torch.no_grad():
        for shape in ((1, 3, 16, 16), (3, 3, 21, 13)):  # fresh inputs; the original as given, flags and all
            y = torch.randn(shape)
            torch.testing.assert_close(folded(y), model(y), atol=1e-5, rtol=1e-4)
    assert export(model, x, tmp_path / "m.onnx", baseline=False, repeats=0).passed  # export took it already


def test_the_cli_folds_it(cli, tmp_path):
    src, out = tmp_path / "m.pt", tmp_path / "o.pt"
    torch.save(_reparameterized(), src)
    code, _, stderr = cli("--quiet", "fold", src, "--trust-pickle", "-i", "1,3,16,16", "-o", out)
    assert code == 0 and out.exists(), stderr


@pytest.mark.parametrize("live, where", [
    (nn.BatchNorm2d(8), "(1, BatchNorm2d): BatchNorm uses batch statistics"),
    (nn.Dropout(0.3), "(2, Dropout): dropout is live"),
    (_Branchy(), "(2, _Branchy): _Branchy.forward reads self.training"),
])
def test_a_module_whose_flag_matters_is_refused_by_name(live, where):
    """The first module in training mode is a conv whose flag changes nothing; the refusal names the one that
    matters, and --eval still folds."""
    torch.manual_seed(0)
    model = randomize_bn(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Identity(), nn.Conv2d(8, 4, 1)))
    model.eval()
    if isinstance(live, nn.BatchNorm2d):
        model[1].train()
    else:
        model[2] = live.train()
    model[0].train()
    x = torch.randn(2, 3, 10, 10)
    with pytest.raises(NormconvError, match="training mode") as exc:
        fold(model, x)
    assert where in str(exc.value), str(exc.value)
    folded, report = fold(model, x, eval_mode=True)
    assert report.passed and set(applied(report)) == {"1"}


def test_flag_reader():
    assert [flag_reader(m) for m in (nn.Conv2d(1, 1, 1), nn.Linear(1, 1), nn.ReLU(), nn.Sequential(),
                                     nn.LayerNorm(2), nn.MaxPool2d(2))] == [None] * 6
    for m in (nn.BatchNorm1d(2), nn.InstanceNorm2d(2), nn.Dropout(), nn.RReLU(), nn.LSTM(2, 2), _Branchy()):
        assert flag_reader(m) is not None, m
    hooked = nn.Identity()
    hooked.register_forward_hook(lambda mod, args, out: out * 2 if mod.training else out)
    assert flag_reader(hooked).startswith("a forward hook")
    traced = torch.fx.symbolic_trace(nn.Sequential(nn.Conv2d(1, 1, 1), nn.ReLU()))
    assert flag_reader(traced) is None
