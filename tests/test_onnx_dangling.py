"""A rewrite whose new initializer takes a name already in the graph (onnxscript's rewriter then leaves the old value
read but unregistered): torch.onnx.export's own optimizer does it to two clamps of one tensor (timm's Gemma-4 ViT),
and normconv's BN fold can meet a file that already holds the name it picks. Both write a file that loads and
computes what the model does."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import torch
import torch.nn as nn
from onnx import TensorProto as T, helper as h

from normconv.onnx import onnx_in
from normconv.onnx.passes.dangling import RegisterDangling
from tests import onnx_in_graphs as G


class TwoClamps(nn.Module):
    """timm's Gemma-4 ViT in small: one normed tensor clamped by buffered bounds before each of two projections."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)
        for n, low in (("q", -0.5), ("k", -0.25)):
            self.register_buffer(f"{n}_min", torch.tensor(low))
            self.register_buffer(f"{n}_max", torch.tensor(0.5))

    def forward(self, x):
        h = self.norm(x)
        return self.q(torch.clamp(h, self.q_min, self.q_max)) * self.k(torch.clamp(h, self.k_min, self.k_max))


def two_clamps():
    torch.manual_seed(0)
    return TwoClamps().eval(), torch.randn(2, 5, 16)


def test_the_exporters_unregistered_clip_bounds_are_registered(cli, tmp_path):
    out = tmp_path / "clamps.onnx"
    code, stdout, stderr = cli("export", "test_onnx_dangling:two_clamps", "-o", out, "--repeats", "0")
    assert code == 0, stderr
    assert "registered as" in stdout  # said, not silent
    onnx.checker.check_model(str(out), full_check=True)
    model, _ = two_clamps()
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    for shape in ((1, 3, 16), (4, 9, 16)):  # fresh inputs at two shapes
        x = torch.randn(*shape)
        with torch.no_grad():
            want = model(x).numpy()
        got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    clips = [n for n in onnx.load(str(out)).graph.node if n.op_type == "Clip"]
    assert len(clips) == 2 and len({n.input[1] for n in clips}) == 2  # each clip its own lower bound


def test_a_fold_whose_new_weight_name_the_file_holds(tmp_path):
    proto = G.conv_bn()  # Conv(x, w) -> BN -> y; the fold names the folded weight "w_bnfold"
    g = proto.graph
    g.node[-1].output[0] = "y0"
    shift = np.linspace(-1, 1, 8, dtype=np.float32).reshape(1, 8, 1, 1)
    g.initializer.append(onnx.numpy_helper.from_array(shift, "w_bnfold"))  # taken already, by another node
    g.node.append(h.make_node("Add", ["y0", "w_bnfold"], ["y"]))
    src = G.save(proto, tmp_path / "in.onnx")
    report = onnx_in.run(src, "fold", str(tmp_path / "out.onnx"))
    assert report.passed and any(v.outputs for v in report.validation)
    x = np.random.default_rng(1).standard_normal((2, 4, 7, 5)).astype(np.float32)
    want = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(tmp_path / "out.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    ops = [n.op_type for n in onnx.load(str(tmp_path / "out.onnx")).graph.node]
    assert ops == ["Conv", "Add"]


def test_the_pass_registers_only_what_holds_a_tensor():
    graph = ir.Graph([], [], nodes=[], name="g", opset_imports={"": 21})
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    graph.inputs.append(x)
    taken = ir.Value(name="c", const_value=ir.tensor(np.ones(2, np.float32), name="c"))
    graph.initializers.add(taken)
    lost = ir.Value(name="c", const_value=ir.tensor(np.full(2, 3.0, np.float32), name="c"))  # the same name
    unknown = ir.Value(name="u")  # no tensor, no producer: left as it is
    add = ir.node("Add", [x, taken])
    mul = ir.node("Mul", [add.outputs[0], lost])
    sub = ir.node("Sub", [mul.outputs[0], unknown])
    for n in (add, mul, sub):
        graph.append(n)
    graph.outputs.append(sub.outputs[0])
    model = ir.Model(graph, ir_version=10)
    dangling = RegisterDangling()
    assert dangling(model).modified
    assert dangling.made == ["c_1"] and graph.initializers["c_1"] is lost and graph.initializers["c"] is taken
    assert not unknown.is_initializer()
    assert not RegisterDangling()(model).modified  # nothing left to register
