"""Helpers the fold tests share: BN statistics far from (0, 1), counting BN modules, and a checked fold."""

from __future__ import annotations

import torch
import torch.nn as nn

from normconv.api import fold


def randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    """Running stats and affine far from (0, 1), so a wrong axis or a dropped term shows in the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                c = m.num_features
                m.running_mean.copy_(torch.randn(c, generator=g) * 3 + 1)
                m.running_var.copy_(torch.rand(c, generator=g) * 5 + 0.2)
                if m.weight is not None:
                    m.weight.copy_(torch.randn(c, generator=g) * 2)
                    m.bias.copy_(torch.randn(c, generator=g) * 2)
    return model.eval()


def bn_modules(model: nn.Module) -> int:
    return sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def checked_fold(model: nn.Module, x, **kw):
    """fold(), plus an independent allclose of the two models on ``x`` (not only the report's word)."""
    folded, report = fold(model, x, **kw)
    xs = x if isinstance(x, tuple) else (x,)
    with torch.no_grad():
        ref, out = model(*xs), folded(*xs)
    atol, rtol = {torch.float64: (1e-9, 1e-7), torch.float16: (1e-2, 1e-2)}.get(ref.dtype, (1e-4, 1e-4))
    assert out.dtype == ref.dtype
    assert torch.allclose(out, ref, atol=atol, rtol=rtol), (out - ref).abs().max()
    assert report.passed
    assert all(s.reason for s in report.sites)
    return folded, report


def applied(report) -> dict[str, str]:
    return {s.target: s.reason for s in report.sites if s.applied}


def skipped(report) -> dict[str, str]:
    return {s.target: s.reason for s in report.sites if not s.applied}
