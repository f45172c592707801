"""The original's own float32 rounding as the floor of a check (``engine.rounding``): a model whose outputs amplify
rounding (here a sine of a large argument, as a detector's box decoding amplifies its regressions) errs in float32
by more than the fixed bound of 2^10 u of its scale whatever is done to it; an exact fold of it is judged against
a multiple of what float32 costs the original itself (a float64 run), and passes. A wrong fold is still refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import normconv
from normconv.engine import rounding
from normconv.passes import fold_batchnorm
from normconv.verify import Inputs, compare, run, scale_tolerance, with_selections

from fold_helpers import randomize_bn


class Amplifying(nn.Module):
    """conv -> BN -> pooled features -> sin(30000 x): the argument's float32 rounding (~1e-3) is the output's error."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)

    def forward(self, x):
        return torch.sin(30000.0 * self.bn(self.conv(x)).mean((2, 3)))


def amplifying():
    torch.manual_seed(0)
    return randomize_bn(Amplifying()), (torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(1)),)


def test_the_model_errs_in_float32_beyond_the_fixed_bound_whatever_is_done():
    model, x = amplifying()
    floors = rounding.own_rounding(model, Inputs(x), run(model, Inputs(x)))
    assert floors is not None and floors["output"] / rounding.OWN_FACTOR > 4 * scale_tolerance(torch.float32)  # scale 1


def test_an_exact_fold_within_its_own_rounding_passes_and_says_why():
    model, x = amplifying()
    folded, report = normconv.fold(model, x)
    assert report.passed and not any(isinstance(m, nn.BatchNorm2d) for m in folded.modules())
    first = report.validation[0]
    assert first.max_scale_error > scale_tolerance(torch.float32)  # the fixed bound alone refused it
    assert "own float32 error" in first.outputs[0].note and first.outputs[0].tolerance > scale_tolerance(torch.float32)
    with torch.no_grad():  # a fresh input: still the original within float32's amplified rounding
        y = torch.randn(3, 3, 12, 12)
        assert compare(model(y), folded(y), floors=rounding.own_rounding(model, Inputs((y,)), model(y))).passed


def test_a_wrong_fold_of_the_ill_conditioned_model_is_refused(monkeypatch):
    real = fold_batchnorm.fold_backward
    monkeypatch.setattr(fold_batchnorm, "fold_backward", lambda layer, s, t: real(layer, s * (1 + 1e-4), t))
    model, x = amplifying()
    with pytest.raises(normconv.VerificationError, match="beyond tolerance"):
        normconv.fold(model, x)


def test_not_measured_where_the_model_is_not_float32_or_too_large(monkeypatch):
    model, x = amplifying()
    assert rounding.own_rounding(model.double(), Inputs((x[0].double(),)), None) is None
    monkeypatch.setattr(rounding, "BUDGET_BYTES", 16)
    model, x = amplifying()
    assert not rounding.measurable(model) and rounding.own_rounding(model, Inputs(x), run(model, Inputs(x))) is None


class TwoSelections(Amplifying):
    """Two top-k calls on the amplified features: one over 16 values, one over a single value."""

    def forward(self, x):
        y = super().forward(x)
        return y.topk(2, dim=-1).indices, y[:, :1].topk(1, dim=-1).values


def test_every_call_of_a_selection_gets_its_op_s_rate_at_its_own_scale():
    """A call over one element says little alone (its own error can be 0 by chance): each call's floor is the op's
    largest relative own error over all its calls, at the call's scale."""
    torch.manual_seed(0)
    model, x = randomize_bn(TwoSelections()), amplifying()[1]
    ref = with_selections(model, Inputs(x), run(model, Inputs(x)))
    floors = rounding.own_rounding(model, Inputs(x), ref)
    picks = {k: v for k, v in floors.items() if k.startswith("aten.topk")}
    assert sorted(picks) == ["aten.topk #1 input 0", "aten.topk #2 input 0"], floors
    inputs = [p.inputs[0] for p in ref.trace.picks]
    rates = [picks[f"aten.topk #{k + 1} input 0"] / float(t.abs().max()) for k, t in enumerate(inputs)]
    assert rates[0] > 0 and abs(rates[0] - rates[1]) <= 1e-9 * rates[0]
