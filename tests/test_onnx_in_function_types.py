"""ONNX in: a norm inside an ONNX function called from several places (its values untyped: ONNX types a function per
call, and normconv types only a function called once) is listed as type-unknown with that reason, naming the
function; it was "not-float: input is of an unknown type, not a float type". The file is left as written."""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto as T, helper as h, numpy_helper as nh

D = 16


def _twice_called_ln(opset=17):
    nodes = [h.make_node("ReduceMean", ["x"], ["mu"], axes=[-1]), h.make_node("Sub", ["x", "mu"], ["d"]),
             h.make_node("Mul", ["d", "d"], ["sq"]), h.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
             h.make_node("Add", ["var", "eps"], ["ve"]), h.make_node("Sqrt", ["ve"], ["sd"]),
             h.make_node("Div", ["d", "sd"], ["n"]), h.make_node("Mul", ["n", "g"], ["y"])]
    fn = h.make_function("my", "LNF", ["x", "g", "eps"], ["y"], nodes, [h.make_opsetid("", opset)])
    rng = np.random.default_rng(0)
    inits = [nh.from_array(np.array(1e-5, "f4"), "eps"), nh.from_array(rng.standard_normal(D).astype("f4"), "g")]
    vi = lambda n: h.make_tensor_value_info(n, T.FLOAT, ["N", "T", D])
    g = h.make_graph([h.make_node("LNF", ["x", "g", "eps"], ["a"], domain="my"),
                      h.make_node("LNF", ["a", "g", "eps"], ["y"], domain="my")], "g", [vi("x")], [vi("y")], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset), h.make_opsetid("my", 1)], functions=[fn])


def test_a_norm_in_a_function_called_twice_is_type_unknown_with_why(cli, tmp_path):
    src = tmp_path / "f.onnx"
    onnx.save(_twice_called_ln(), str(src))
    code, out, _ = cli("inspect", src, "--json")
    assert code == 0
    sites = json.loads(out[out.index("{"):])["sites"]
    assert sites and {s["code"] for s in sites} == {"type-unknown"} and not any(s["applied"] for s in sites)
    assert all("ONNX function my.LNF" in s["reason"] and "2 calls" in s["reason"] for s in sites)
