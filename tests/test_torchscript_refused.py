"""A TorchScript module (torch.jit.script / trace) from a factory or the API: it was 'the model rejected its example
inputs' (normconv's own AttributeError on the script module's parameter dict, exit 2), which blames inputs the model
runs fine on. Now it is said for what it is, in one line, exit 2."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import normconv
from normconv.errors import NormconvError


def _model():
    return nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4)).eval()


def test_a_scripted_factory_is_refused_as_torchscript(cli, tmp_path, monkeypatch):
    (tmp_path / "scripted.py").write_text(
        "import torch, torch.nn as nn\n"
        "def build():\n"
        "    m = nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4)).eval()\n"
        "    return torch.jit.script(m), (torch.randn(2, 4, 8, 8),)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, stdout, stderr = cli("fold", "scripted:build", "-o", tmp_path / "out.pt")
    assert code == 2
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "TorchScript modules are not supported" in lines[0], stderr
    assert "rejected its example inputs" not in stderr
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("compile_", [torch.jit.script, lambda m: torch.jit.trace(m, torch.randn(2, 4, 8, 8))],
                         ids=["script", "trace"])
def test_the_api_refuses_torchscript(compile_):
    with pytest.raises(NormconvError, match="TorchScript modules are not supported; pass the eager module"):
        normconv.fold(compile_(_model()), (torch.randn(2, 4, 8, 8),))
