"""The exact edits of the residual stream (graph/residual/edits.py), computed a slice at a time to bound memory:
each must equal the edit computed on the whole tensor at once whatever the slicing (centering bit for bit)."""

from __future__ import annotations

import importlib

import pytest
import torch

from normconv.graph.residual.edits import bias_delta, center_

# the module, not the package's function of the same name
streams = importlib.import_module("normconv.graph.residual.streams")


def _whole_center(t: torch.Tensor, dim: int) -> torch.Tensor:
    work = torch.float64 if t.dtype in (torch.float32, torch.float64) else torch.float32
    w = t.to(work)
    return (w - w.mean(dim, keepdim=True, dtype=torch.float64).to(work)).to(t.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,dim", [((96, 40), 0), ((96, 40), 1), ((40, 96), -1), ((7, 33), 0), ((5, 4, 6), -1)])
def test_center_sliced_equals_center_whole(monkeypatch, dtype, shape, dim):
    monkeypatch.setattr(streams, "_SLICE_ELEMENTS", 64)  # many slices, the last one shorter, the buffer reused
    torch.manual_seed(0)
    t = (torch.randn(shape) * 3 + 1).to(dtype)
    got = center_(t.clone(), dim)
    assert torch.equal(got, _whole_center(t, dim))
    assert float(got.double().mean(dim).abs().max()) <= 1e-2 * float(t.double().abs().max())


@pytest.mark.parametrize("layout", ["out_in", "in_out"])
def test_bias_delta_sliced_equals_whole(monkeypatch, layout):
    monkeypatch.setattr(streams, "_SLICE_ELEMENTS", 50)
    torch.manual_seed(1)
    w, b = torch.randn(24, 16), torch.randn(16 if layout == "out_in" else 24)
    want = w.double() @ b.double() if layout == "out_in" else b.double() @ w.double()
    got = bias_delta(w, b, layout)
    # float64 dot products, each whole in one slice: equal up to the BLAS kernel's summation order
    assert got.dtype == torch.float64 and torch.allclose(got, want, rtol=1e-13, atol=1e-13)
