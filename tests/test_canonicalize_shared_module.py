"""A hand-written norm module called at two places (a shared qk_norm on q and on k, one LayerNorm read before each
sublayer): the module is replaced by one native module, so both calls keep reading one weight. Before, both sites
were refused ("called more than once and its calls share qk_norm.weight"), and swap refused such a model as a norm
canonicalize could not make a module."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import normconv
from normconv.verify import Inputs

METHODS = ["symbolic_trace", "torch.export"]


class RMS(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))


class LN(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.gamma, self.beta = nn.Parameter(torch.rand(d) + 0.5), nn.Parameter(torch.randn(d))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return self.gamma * (x - mean) / torch.sqrt(var + 1e-6) + self.beta


class QKNorm(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.q, self.k, self.qk_norm, self.o = nn.Linear(d, d), nn.Linear(d, d), RMS(d), nn.Linear(d, 3)

    def forward(self, x):
        q, k = self.qk_norm(self.q(x)), self.qk_norm(self.k(x))
        return self.o(torch.softmax(q @ k.transpose(-1, -2) / 4, -1) @ x)


class PreNormShared(nn.Module):
    """Pre-LN: one hand-written LayerNorm read before both sublayers and the head."""

    def __init__(self, d=16):
        super().__init__()
        self.inp, self.n, self.a, self.b, self.head = (nn.Linear(8, d), LN(d), nn.Linear(d, d), nn.Linear(d, d),
                                                       nn.Linear(d, 3))

    def forward(self, x):
        h = self.inp(x)
        h = h + self.a(self.n(h))
        h = h + self.b(self.n(h))
        return self.head(self.n(h))


def _same_at_fresh_shapes(new, model, shapes):
    with torch.no_grad():
        for shape in shapes:
            x = torch.randn(*shape)
            torch.testing.assert_close(new(x), model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_a_shared_qk_norm_becomes_one_native_module(method):
    torch.manual_seed(0)
    model = QKNorm().eval()
    new, report = normconv.canonicalize(model, Inputs((torch.randn(2, 6, 16),)), method=method)
    sites = [s for s in report.sites if s.target == "qk_norm"]
    assert len(sites) == 2 and all(s.applied for s in sites), [s.reason for s in sites]
    assert isinstance(new.qk_norm, nn.RMSNorm) and torch.equal(new.qk_norm.weight, model.qk_norm.weight)
    assert len(list(new.parameters())) == len(list(model.parameters()))  # still one weight for q and k
    _same_at_fresh_shapes(new, model, [(3, 5, 16), (1, 9, 16)])


def test_swap_takes_a_pre_ln_model_whose_norm_module_is_shared():
    torch.manual_seed(0)
    model = PreNormShared().eval()
    new, report = normconv.swap(model, (torch.randn(2, 6, 8),), to="rmsnorm")
    assert not any(isinstance(m, (nn.LayerNorm, LN)) for m in new.modules())
    _same_at_fresh_shapes(new, model, [(3, 5, 8), (1, 9, 8)])
