"""A dynamic export torch.export refuses because of the height / width (timm's DLA: "The inequality, Eq(x/4 -
(((x/2)//2)), 0), cannot be solve") was made static whole: the batch pinned at the example's 1 too, though the model
runs at any batch, and ``extra.dynamic_dims`` empty, so no static dimension was listed with its code. Now the export
is tried again with the batch alone dynamic, and every static dimension is listed with its code and why
(``refused-by-export`` for the dimensions torch.export refused, ``one-size-only`` for the channels)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn

import normconv


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x))


def refusing(monkeypatch, batch_too: bool = False) -> None:
    """torch.export refuses a free height or width as it does DLA's (its guard after the fold: an inequality sympy
    cannot solve; no small model found that keeps such a guard through normconv's fold); a free batch too where
    ``batch_too`` (else any free batch is fine)."""
    real = torch.export.export

    def spatial(spec) -> bool:
        if isinstance(spec, dict):
            return any((isinstance(k, int) and k >= 2 and v is not None) or spatial(v) for k, v in spec.items())
        return isinstance(spec, (list, tuple)) and any(spatial(v) for v in spec)

    def export(*args, **kwargs):
        shapes = kwargs.get("dynamic_shapes")
        if spatial(shapes) or (batch_too and shapes is not None):
            raise NotImplementedError("The inequality, Eq(x/4 - (((x/2)//2)), 0), cannot be solve")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", export)


@pytest.fixture
def refuses_height(monkeypatch):
    refusing(monkeypatch)


def _model():
    torch.manual_seed(0)
    m = Net().eval()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-1, 1), m.bn.running_var.uniform_(0.5, 2)
    return m


def test_a_height_torch_export_refuses_keeps_the_batch_free_and_lists_every_static_dim(tmp_path, refuses_height):
    m = _model()
    path = tmp_path / "m.onnx"
    report = normconv.export(m, (torch.randn(1, 3, 16, 16),), str(path), baseline=False)
    dims = {d["name"]: d for d in report.extra["dynamic_dims"]}
    assert "pinned" not in dims["batch"] and dims["batch"]["checked"] == [1, 2]
    for name in ("height", "width"):
        assert dims[name]["code"] == "refused-by-export" and "cannot be solve" in dims[name]["pinned"]
    assert dims["x_dim1"]["code"] == "one-size-only"
    assert any("exported again with the batch alone dynamic" in n for n in report.notes), report.notes
    assert any(n.startswith("dimension height (x[2]) is static at the example's 16") for n in report.notes)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    declared = sess.get_inputs()[0].shape
    assert isinstance(declared[0], str) and declared[1:] == [3, 16, 16]
    for batch in (1, 3):
        x = torch.randn(batch, 3, 16, 16)
        with torch.no_grad():
            ref = m(x).numpy()
        got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
        np.testing.assert_allclose(got, ref, atol=1e-5 * np.abs(ref).max(), rtol=0)
