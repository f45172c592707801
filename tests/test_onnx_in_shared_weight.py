"""ONNX in: a conv weight read by two convs (a module called twice, as torch exports a Siamese branch), each followed
by a BatchNorm. Where both BNs scale alike, both fold into one W·s that both convs read (the file does not grow, the
old weight goes); where they differ, folding would need a copy of the weight per conv: refused, shared-weight, as
before. Run in onnxruntime against the input on fresh inputs at two shapes."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T, helper as h, numpy_helper as nh

C = 6


def _siamese(same_scale: bool):
    rng = np.random.default_rng(3)
    f = lambda a, n: nh.from_array(np.asarray(a, "f4"), n)
    inits = [f(rng.standard_normal((C, C, 3, 3)) * 0.3, "w"), f(rng.standard_normal(C), "cb1"),
             f(rng.standard_normal(C), "cb2")]
    nodes = []
    g1, v1 = rng.uniform(0.5, 2, C), rng.uniform(0.5, 2, C)
    for i in (1, 2):
        # the second BN: another shift, and the same scale γ / sqrt(σ² + ε) or another
        g, var = (g1, v1) if i == 1 or same_scale else (rng.uniform(0.5, 2, C), rng.uniform(0.5, 2, C))
        inits += [f(g, f"g{i}"), f(rng.standard_normal(C), f"b{i}"), f(rng.standard_normal(C), f"m{i}"),
                  f(var, f"v{i}")]
        nodes += [h.make_node("Conv", [f"x{i}", "w", f"cb{i}"], [f"z{i}"], pads=[1, 1, 1, 1], name=f"conv{i}"),
                  h.make_node("BatchNormalization", [f"z{i}", f"g{i}", f"b{i}", f"m{i}", f"v{i}"], [f"y{i}"],
                              name=f"bn{i}")]
    nodes.append(h.make_node("Sub", ["y1", "y2"], ["d"]))
    vi = lambda n: h.make_tensor_value_info(n, T.FLOAT, ["N", C, "H", "W"])
    g = h.make_graph(nodes, "g", [vi("x1"), vi("x2")], [vi("d")], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def _run(path, feeds):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.mark.parametrize("same_scale", [True, False], ids=["same-scale", "other-scale"])
def test_a_weight_two_convs_read(cli, tmp_path, same_scale):
    src, dst = tmp_path / "s.onnx", tmp_path / "out.onnx"
    onnx.save(_siamese(same_scale), str(src))
    code, out, err = cli("fold", src, "-o", dst, "--json")
    assert code == 0, err
    r = json.loads(out[out.index("{"):])
    written = onnx.load(str(dst))
    inits = {t.name for t in written.graph.initializer}
    if same_scale:
        assert r["extra"]["folded_batchnorm"] == 2 and "BatchNormalization" not in r["after"]
        weights = {n.input[1] for n in written.graph.node if n.op_type == "Conv"}
        assert len(weights) == 1 and "w" not in inits  # one folded weight, the old one gone
        assert sum(1 for t in written.graph.initializer if list(t.dims) == [C, C, 3, 3]) == 1
    else:
        assert r["extra"]["folded_batchnorm"] == 0
        assert {s["code"] for s in r["sites"]} == {"shared-weight"}
    rng = np.random.default_rng(5)
    for n, hw in ((1, (7, 5)), (2, (12, 9))):
        feeds = {k: rng.standard_normal((n, C, *hw)).astype(np.float32) for k in ("x1", "x2")}
        want = _run(src, feeds)
        np.testing.assert_allclose(_run(dst, feeds), want, rtol=0, atol=1e-5 * float(np.abs(want).max()))
