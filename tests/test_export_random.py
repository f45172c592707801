"""A model whose forward draws random values (ViT-MAE's masking noise: torch.rand) exports to an ONNX file holding a
random op (RandomUniformLike), which onnxruntime has no kernel for at recent opsets and which, run, would draw other
numbers than torch's: the export failed in validation as a bad input ("Could not find an implementation for
RandomUniformLike"). Now it is refused as what it is: the outputs differ run to run, nothing can be compared; the hint
says how to make the forward deterministic (its ``noise`` input, where forward takes one) or --validate none."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn

import normconv
from normconv.errors import EXIT_BAD_INPUT, Code, NormconvError


class Noisy(nn.Module):
    """A conv + BatchNorm whose output gets uniform noise drawn in the forward unless ``noise`` is given."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x, noise=None):
        noise = torch.rand_like(x[:, :1]) if noise is None else noise
        return self.bn(self.conv(x)) + noise


class NoisyNoInput(Noisy):
    def forward(self, x):
        return self.bn(self.conv(x)) * torch.rand_like(x[:, :1])


def _model(cls=Noisy):
    torch.manual_seed(0)
    m = cls().eval()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-1, 1)
        m.bn.running_var.uniform_(0.5, 2)
    return m


def test_a_forward_that_draws_random_values_is_refused_with_the_input_that_replaces_the_draw(tmp_path):
    path = tmp_path / "m.onnx"
    with pytest.raises(NormconvError) as info:
        normconv.export(_model(), (torch.randn(2, 3, 8, 8),), str(path))
    exc = info.value
    assert exc.code == Code.REFUSED and exc.exit_code == EXIT_BAD_INPUT
    assert "draws random values (RandomUniformLike)" in exc.message and "cannot be compared" in exc.message
    assert "`noise`" in exc.hint and "--validate none" in exc.hint
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_without_an_input_for_the_draw_the_hint_says_validate_none(tmp_path):
    with pytest.raises(NormconvError) as info:
        normconv.export(_model(NoisyNoInput), (torch.randn(2, 3, 8, 8),), str(tmp_path / "m.onnx"))
    assert info.value.code == Code.REFUSED and "noise" not in info.value.hint
    assert "--validate none" in info.value.hint


def test_the_draw_given_as_an_input_exports_and_validates(tmp_path):
    m, x, noise = _model(), torch.randn(2, 3, 8, 8), torch.rand(2, 1, 8, 8)
    path = tmp_path / "m.onnx"
    report = normconv.export(m, (x, noise), str(path))
    assert report.passed
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": x.numpy(), "noise": noise.numpy()})[0]
    with torch.no_grad():
        np.testing.assert_allclose(got, m(x, noise).numpy(), atol=1e-5, rtol=1e-5)
