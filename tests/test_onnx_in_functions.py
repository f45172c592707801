"""ONNX in: a file with model-local functions (FunctionProto) that normconv converts to a higher opset. The
converter drops the functions, so they are inlined first: the file exports, the written file computes what the input
computes in onnxruntime (fresh inputs, two shapes), and the notes say only what the file needs."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T, helper as h

from tests import onnx_in_graphs as G

D = 16


def _ln_then_local_act(opset=13):
    """A top-level torch-style LayerNorm followed by an unrelated local function my.MyAct (a Relu wrapper)."""
    ln = G.layernorm_torch(opset, D, affine=True)
    fn = h.make_function("my", "MyAct", ["a"], ["b"], [h.make_node("Relu", ["a"], ["b"])], [h.make_opsetid("", opset)])
    nodes = list(ln.graph.node)
    nodes[-1].output[0] = "ln"
    g = h.make_graph(nodes + [h.make_node("MyAct", ["ln"], ["y"], domain="my")], "g", list(ln.graph.input),
                     list(ln.graph.output), list(ln.graph.initializer))
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset), h.make_opsetid("my", 1)], functions=[fn],
                        producer_name="hand-built")


def _run(path, x):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _ops(path):
    m = onnx.load(str(path))
    return [n.op_type for n in m.graph.node], [f.name for f in m.functions]


def _same_in_ort(src, out):
    rng = np.random.default_rng(7)
    for batch, seq in ((2, 5), (3, 7)):
        x = (rng.standard_normal((batch, seq, D)) * 3 + 1).astype(np.float32)
        np.testing.assert_allclose(_run(out, x), _run(src, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("build", [_ln_then_local_act, lambda: G.layernorm_in_function(13, D)],
                         ids=["unrelated-function", "layernorm-inside-function"])
def test_a_file_with_local_functions_exports_after_opset_conversion(cli, tmp_path, build):
    src = G.save(build(), tmp_path / "in.onnx")
    onnx.checker.check_model(src, full_check=True)
    code, out, err = cli("export", src, "-o", tmp_path / "out.onnx", "--json")
    assert code == 0, err
    r = json.loads(out[out.index("{"):])
    assert r["extra"]["converted_from"] == 13 and r["extra"]["fused"] == {"layernorm": 1}
    ops, functions = _ops(tmp_path / "out.onnx")
    assert ops.count("LayerNormalization") == 1 and "ReduceMean" not in ops and functions == []
    onnx.checker.check_model(str(tmp_path / "out.onnx"), full_check=True)
    _same_in_ort(src, tmp_path / "out.onnx")


def test_inspect_note_names_only_what_the_file_needs(cli, tmp_path):
    src = G.save(_ln_then_local_act(), tmp_path / "in.onnx")
    code, out, _ = cli("inspect", src, "--json")
    assert code == 0
    r = json.loads(out[out.index("{"):])
    note = next(n for n in r["notes"] if "convert" in n)
    assert "RMSNorm" not in note and "for LayerNormalization" in note and "my.MyAct inlined" in note
    assert r["after"].get("LayerNormalization") == 1 and r["after"].get("Relu") == 1  # the function's body kept


def test_a_library_message_about_a_temp_file_names_no_temp_path(tmp_path):
    from normconv.onnx.onnx_in import _public

    tmp = tmp_path / ".out.onnx.1234.normconv-tmp"
    said = _public(f"Load model from {tmp}/converted.onnx failed; {tmp}/out.onnx too", tmp, tmp_path / "out.onnx")
    assert str(tmp) not in said and "normconv-tmp" not in said and str(tmp_path / "out.onnx") in said
