"""ONNX in: a LayerNorm written inside a Loop body whose state input is declared without a shape (as exporters
write it) is listed with the true reason (rank-unknown: its axes cannot be placed), not as a root of a reduction
"whose result is not the input divided by it"; the same body with the state's shape declared is fused."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T, helper as h, numpy_helper as nh

D = 16


def _loop(shaped: bool, opset: int = 17):
    vi = lambda n, s, t=T.FLOAT: h.make_tensor_value_info(n, t, s)
    ln = [h.make_node("ReduceMean", ["st"], ["mu"], axes=[-1]), h.make_node("Sub", ["st", "mu"], ["d"]),
          h.make_node("Mul", ["d", "d"], ["sq"]), h.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
          h.make_node("Add", ["var", "eps"], ["ve"]), h.make_node("Sqrt", ["ve"], ["sd"]),
          h.make_node("Div", ["d", "sd"], ["n"]), h.make_node("Mul", ["n", "g"], ["st2"])]
    body = h.make_graph([h.make_node("Identity", ["cin"], ["cout"])] + ln, "body",
                        [vi("i", [], T.INT64), vi("cin", [], T.BOOL), vi("st", ["N", "T", D] if shaped else None)],
                        [vi("cout", [], T.BOOL), vi("st2", None)])
    rng = np.random.default_rng(0)
    inits = [nh.from_array(np.array(1e-5, "f4"), "eps"), nh.from_array(rng.standard_normal(D).astype("f4"), "g"),
             nh.from_array(np.array(3, "i8"), "trip")]
    g = h.make_graph([h.make_node("Loop", ["trip", "", "x"], ["y"], body=body)], "g", [vi("x", ["N", "T", D])],
                     [vi("y", ["N", "T", D])], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset)])


def test_an_unranked_loop_state_is_said_so(cli, tmp_path):
    src = tmp_path / "loop.onnx"
    onnx.save(_loop(shaped=False), str(src))
    code, out, _ = cli("inspect", src, "--json")
    assert code == 0
    sites = json.loads(out[out.index("{"):])["sites"]
    assert [(s["code"], s["applied"]) for s in sites] == [("rank-unknown", False)]
    assert "declared without a shape" in sites[0]["reason"]


@pytest.mark.parametrize("opset", [13, 17])
def test_a_shaped_loop_state_is_fused_and_computes_the_same(cli, tmp_path, opset):
    src = tmp_path / "loop.onnx"
    onnx.save(_loop(shaped=True, opset=opset), str(src))
    code, out, err = cli("export", src, "-o", tmp_path / "o.onnx", "--json")
    assert code == 0, err
    assert json.loads(out[out.index("{"):])["extra"]["fused"] == {"layernorm": 1}
    rng = np.random.default_rng(2)
    for shape in ((2, 5, D), (3, 7, D)):
        x = (rng.standard_normal(shape) * 2 + 1).astype(np.float32)
        run = lambda p: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        np.testing.assert_allclose(run(tmp_path / "o.onnx"), run(src), rtol=1e-4, atol=1e-4)
