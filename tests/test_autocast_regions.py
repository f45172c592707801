"""A norm inside ``torch.autocast(..., enabled=False)`` (kept in float32 whatever the caller's autocast, as
mixed-precision code writes it) under a torch.export capture (keyword inputs, every Hugging Face model): torch.export
writes the region as one ``wrap_with_autocast`` call and the norm inside was invisible (swap: "has no layernorm",
inspect: no site). A disabled region at the top level is now its body (``graph.autocast``); an enabled one is kept."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn as nn

import normconv
from normconv.graph.autocast import inline_disabled
from normconv.graph.capture import capture
from normconv.verify import Inputs


class Float32Norm(nn.Module):
    def __init__(self, enabled: bool = False, width: int = 16):
        super().__init__()
        self.enabled = enabled
        self.fc, self.ln, self.head = nn.Linear(width, width), nn.LayerNorm(width), nn.Linear(width, 4)

    def forward(self, x):
        h = self.fc(x)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.enabled):
            h = self.ln(h.float())
        return self.head(h)


def _model(enabled=False):
    torch.manual_seed(0)
    m = Float32Norm(enabled).eval()
    with torch.no_grad():
        m.ln.weight.uniform_(0.5, 1.5)
        m.ln.bias.uniform_(-0.5, 0.5)
    return m


def test_a_disabled_region_is_its_body_and_the_norm_is_seen():
    m = _model()
    cap = capture(m, Inputs((), {"x": torch.randn(2, 5, 16)}), "torch.export")
    ops = [n.target for n in cap.gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.layer_norm.default in ops
    assert torch.ops.higher_order.wrap_with_autocast not in ops
    assert cap.owner(next(n for n in cap.gm.graph.nodes if n.target is torch.ops.aten.layer_norm.default)) == "ln"


def test_an_enabled_region_is_kept():
    m = _model(enabled=True)
    ep = torch.export.export(m, (), {"x": torch.randn(2, 5, 16)}, strict=False)
    assert inline_disabled(ep.graph_module) == 0
    assert any(n.target is torch.ops.higher_order.wrap_with_autocast for n in ep.graph_module.graph.nodes)


def test_swap_and_inspect_reach_the_norm_and_the_rewrite_is_exact_at_other_shapes():
    m = _model()
    x = torch.randn(2, 5, 16)
    report = normconv.inspect(m, {"x": x})
    assert [(s["target"], s["kind"], s["eps"]) for s in report.sites] == [("ln", "layernorm", 1e-05)]
    out, report = normconv.swap(m, {"x": x}, to="rmsnorm")
    assert [s.target for s in report.sites if s.applied] == ["ln"]
    assert isinstance(out.ln, nn.RMSNorm)
    for shape in [(1, 3, 16), (4, 9, 16)]:
        x2 = torch.randn(shape)
        with torch.no_grad():
            ref, got = m(x=x2), out(x=x2)
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_export_of_the_region_runs_in_onnxruntime_as_torch_does(tmp_path):
    m = _model()
    path = tmp_path / "m.onnx"
    normconv.export(m, {"x": torch.randn(2, 5, 16)}, str(path))
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("LayerNormalization") == 1
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for shape in [(1, 3, 16), (3, 7, 16)]:
        x = torch.randn(shape)
        got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
        with torch.no_grad():
            ref = m(x=x).numpy()
        np.testing.assert_allclose(got, ref, atol=1e-5 * np.abs(ref).max(), rtol=0)


def test_two_regions_sharing_an_input_are_both_inlined():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.LayerNorm(8), nn.LayerNorm(8)

        def forward(self, x):
            with torch.autocast("cpu", enabled=False):
                y = self.a(x.float())
            with torch.autocast("cpu", enabled=False):
                z = self.b(x.float())
            return y + z

    m = Two().eval()
    x = torch.randn(2, 3, 8)
    ep = torch.export.export(m, (), {"x": x}, strict=False)
    assert inline_disabled(ep.graph_module) == 2
    torch.testing.assert_close(ep.module()(x=x), m(x=x))
