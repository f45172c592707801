"""Hand-written norms users write every day that inspect did not see at all ('0 norm sites', no near miss), so fold,
canonicalize and export silently did nothing: an epsilon held in a buffer or a tensor attribute, a frozen BatchNorm
whose statistics are viewed first (``running_var.view(1, -1, 1, 1)``, detectron-style) or indexed
(``running_var[None, :, None, None]``). Now each is one site, canonicalized exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from normconv.api import canonicalize, inspect
from normconv.verify import Inputs

METHODS = ["symbolic_trace", "torch.export"]


class RMSEpsBuffer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.register_buffer("eps", torch.tensor(1e-5))

    def forward(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))


class LNEpsAttribute(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.g, self.b = nn.Parameter(torch.rand(d) + 0.5), nn.Parameter(torch.randn(d))
        self.eps = torch.tensor(1e-5)  # a plain tensor attribute

    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        v = x.var(-1, keepdim=True, unbiased=False)
        return self.g * (x - m) / torch.sqrt(v + self.eps) + self.b


class _Stats(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.register_buffer("weight", torch.rand(c) + 0.5)
        self.register_buffer("bias", torch.randn(c))
        self.register_buffer("running_mean", torch.randn(c))
        self.register_buffer("running_var", torch.rand(c) + 0.5)


def _batch_stats(x):  # a tutorial BatchNorm in training mode: the batch's statistics (what nn.BatchNorm2d takes)
    return x.mean((0, 2, 3), keepdim=True), x.var((0, 2, 3), unbiased=False, keepdim=True)


class FrozenBNViews(_Stats):
    def forward(self, x):
        rm, rv = self.running_mean.view(1, -1, 1, 1), self.running_var.view(1, -1, 1, 1)
        if self.training:
            rm, rv = _batch_stats(x)
        return (x - rm) / torch.sqrt(rv + 1e-5) * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)


class FrozenBNIndexed(_Stats):
    def forward(self, x):
        m, v = self.running_mean[None, :, None, None], self.running_var[None, :, None, None]
        if self.training:
            m, v = _batch_stats(x)
        return (x - m) / torch.sqrt(v + 1e-5) * \
            self.weight[None, :, None, None] + self.bias[None, :, None, None]


class StatsOnTheLastDim(_Stats):
    """The statistics viewed along the last dim of an NCHW input: no BatchNorm (that normalizes dim 1)."""

    def forward(self, x):
        rm, rv = self.running_mean.view(1, 1, 1, -1), self.running_var.view(1, 1, 1, -1)
        return (x - rm) / torch.sqrt(rv + 1e-5)


def _seq(norm):
    return nn.Sequential(nn.Linear(16, 16), norm, nn.Linear(16, 3)).eval(), Inputs((torch.randn(2, 6, 16),)), \
        [(3, 5, 16), (1, 9, 16)]


def _conv(norm):
    return nn.Sequential(nn.Conv2d(4, 8, 3), norm).eval(), Inputs((torch.randn(2, 4, 10, 10),)), \
        [(3, 4, 7, 9), (1, 4, 12, 6)]


CASES = {"eps-buffer": (lambda: _seq(RMSEpsBuffer(16)), "rmsnorm", nn.RMSNorm),
         "eps-attribute": (lambda: _seq(LNEpsAttribute(16)), "layernorm", nn.LayerNorm),
         "bn-view": (lambda: _conv(FrozenBNViews(8)), "batchnorm", nn.BatchNorm2d),
         "bn-index": (lambda: _conv(FrozenBNIndexed(8)), "batchnorm", nn.BatchNorm2d)}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", list(CASES))
def test_the_norm_is_found_and_canonicalized_exactly(case, method):
    torch.manual_seed(0)
    build, kind, native = CASES[case]
    model, inputs, shapes = build()
    sites = inspect(model, inputs, method=method).sites
    assert [(s["target"], s["kind"]) for s in sites] == [("1", kind)]
    new, report = canonicalize(model, inputs, method=method)
    assert isinstance(new[1], native) and all(s.applied for s in report.sites)
    assert new[1].eps == pytest.approx(1e-5)
    with torch.no_grad():
        for shape in shapes:
            x = torch.randn(shape)
            torch.testing.assert_close(new(x), model(x), atol=1e-5, rtol=1e-5)


class FrozenViews(_Stats):  # the same statistics with no training branch (torchvision's FrozenBatchNorm2d)
    def forward(self, x):
        rm, rv = self.running_mean.view(1, -1, 1, 1), self.running_var.view(1, -1, 1, 1)
        return (x - rm) / torch.sqrt(rv + 1e-5) * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)


def test_a_frozen_spelling_is_found_and_kept():
    # nn.BatchNorm2d would take the batch's statistics in training mode: kept, said (engine/training.py's rule)
    torch.manual_seed(0)
    model, inputs, _ = _conv(FrozenViews(8))
    assert [s["kind"] for s in inspect(model, inputs).sites] == ["batchnorm"]
    new, report = canonicalize(model, inputs)
    assert [s.code for s in report.sites] == ["differs-in-training"] and isinstance(new[1], FrozenViews)


def test_statistics_along_another_dim_are_no_batchnorm():
    model, inputs, _ = _conv(StatsOnTheLastDim(10))
    model[0] = nn.Conv2d(4, 8, 1)  # keeps 10 x 10: the last dim has as many values as the statistics
    assert not [s for s in inspect(model, inputs).sites if s["kind"] == "batchnorm"]
