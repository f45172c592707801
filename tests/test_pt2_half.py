"""A half-precision .pt2 (torch.export.save of an fp16 model): its graph says float16 (``_assert_tensor_metadata(x,
dtype=float16)``, ``aten.to(x, float16)``), so the float32 reference canonicalize and export measure against cannot be
the program's module upcast with ``.float()``: it refused its float32 inputs ('Tensor dtype mismatch! Expected: Half,
Got: float', exit 3). The reference is the program with float32 written where it said float16
(engine.precision.upcast), and the half model export writes says float16 there again (downcast)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn


class LlamaRMS(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, h):
        dt = h.dtype
        h = h.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(dt)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l, self.n, self.o = nn.Linear(16, 16), LlamaRMS(16), nn.Linear(16, 3)

    def forward(self, x):
        return self.o(self.n(self.l(x)))


SHAPES = ((3, 5, 16), (1, 9, 16))  # neither is the example's


def _program(tmp_path):
    torch.manual_seed(0)
    model = Net().half().eval()
    auto = torch.export.Dim.AUTO
    ep = torch.export.export(model, (torch.randn(2, 6, 16).half(),), dynamic_shapes=({0: auto, 1: auto},))
    torch.export.save(ep, tmp_path / "m.pt2")
    return model, tmp_path / "m.pt2"


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.double() - want.double()).abs().max() / want.double().abs().max()
    assert err < 2e-3, err  # a couple of half ulps of the output's scale


def test_canonicalize_of_a_half_pt2_replaces_the_norm_and_matches(cli, tmp_path):
    model, src = _program(tmp_path)
    out = tmp_path / "out.pt2"
    code, _, stderr = cli("--quiet", "canonicalize", src, "-o", out)
    assert code == 0, stderr
    new = torch.export.load(str(out)).module()
    assert any(n.target is torch.ops.aten.rms_norm.default for n in new.graph.nodes)  # the norm is native now
    for shape in SHAPES:
        x = torch.randn(shape).half()
        with torch.no_grad():
            got = new(x)
            assert got.dtype == torch.float16
            _close(got, model(x))


def test_export_of_a_half_pt2_writes_a_half_onnx_that_matches(cli, tmp_path):
    import onnxruntime as ort

    model, src = _program(tmp_path)
    out = tmp_path / "out.onnx"
    code, _, stderr = cli("--quiet", "export", src, "-o", out)
    assert code == 0, stderr
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    for shape in SHAPES:
        x = torch.randn(shape).half()
        (got,) = sess.run(None, {name: x.numpy()})
        assert got.dtype == np.float16
        with torch.no_grad():
            _close(torch.from_numpy(got), model(x))
