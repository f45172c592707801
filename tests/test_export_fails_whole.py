"""A model torch.onnx cannot convert at all (XLNet: "Cannot find a compatible OpOverload for aten.sub"), captured by
torch.export: after the dynamic tries, the static export starts from the capture's ExportedProgram, and when that
failed too the fallback asked the program for its forward's parameters, which it has not: an internal error (exit
3, "'ExportedProgram' object has no attribute 'forward'") in place of the one-line refusal (exit 2) naming the
exporter's reason. A static export has no dynamic places to give up."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn


class Unsplittable(nn.Module):
    """LayerNorm over rows it counts with len(): symbolic_trace cannot (len of a Proxy), torch.export can."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(8)

    def forward(self, x):
        return self.ln(x) * len(x)


@pytest.fixture
def onnx_refuses(monkeypatch):
    def export(*args, **kwargs):
        raise RuntimeError("Cannot find a compatible OpOverload for aten.sub with the provided arguments.")

    monkeypatch.setattr(torch.onnx, "export", export)


def test_an_unconvertible_model_is_refused_in_one_line(tmp_path, cli, onnx_refuses):
    torch.manual_seed(0)
    model = Unsplittable().eval()
    src, out = tmp_path / "m.pt", tmp_path / "m.onnx"
    torch.save(model, src)
    code, _, err = cli("export", src, "--trust-pickle", "-i", "x:2,5,8", "-o", out)
    assert code == 2, err
    assert "cannot export" in err and "Cannot find a compatible OpOverload" in err and "internal error" not in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
