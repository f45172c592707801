"""ONNX in: a norm inside a model-local ONNX function whose boundary hides it from the rules: a function called from
several places (its values untyped: ONNX types a function per call, normconv types only a function called once),
or one whose caller passes the norm's parameters (a BatchNorm's statistics, an epsilon). Such functions, and every
function calling them, are inlined, said in a note and ``extra.inlined_functions``, and the norms fused or folded;
before, every such site was refused (type-unknown, stats-not-constant) and the file left as written. A function
whose norms inlining does not help stays a function. Each written file is run in onnxruntime against the input on
fresh inputs at two shapes."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T, helper as h, numpy_helper as nh

D = 16
C = 4


def _ln_body(opset):
    return [h.make_node("ReduceMean", ["x"], ["mu"], axes=[-1]), h.make_node("Sub", ["x", "mu"], ["d"]),
            h.make_node("Mul", ["d", "d"], ["sq"]), h.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
            h.make_node("Add", ["var", "eps"], ["ve"]), h.make_node("Sqrt", ["ve"], ["sd"]),
            h.make_node("Div", ["d", "sd"], ["n"]), h.make_node("Mul", ["n", "g"], ["y"])]


def _twice_called_ln(opset=17, read_inside=False):
    """my.LNF(x, g, eps), a LayerNorm whose scale and epsilon the call passes, called twice in a row.
    ``read_inside``: the function also returns its variance, which the graph reads (no LayerNorm fuses then)."""
    outs = ["y", "var"] if read_inside else ["y"]
    fn = h.make_function("my", "LNF", ["x", "g", "eps"], outs, _ln_body(opset), [h.make_opsetid("", opset)])
    rng = np.random.default_rng(0)
    inits = [nh.from_array(np.array(1e-5, "f4"), "eps"), nh.from_array(rng.standard_normal(D).astype("f4"), "g")]
    vi = lambda n: h.make_tensor_value_info(n, T.FLOAT, ["N", "T", D])
    first = ["a", "v1"] if read_inside else ["a"]
    nodes = [h.make_node("LNF", ["x", "g", "eps"], first, domain="my"),
             h.make_node("LNF", ["a", "g", "eps"], ["y0", "v2"] if read_inside else ["y"], domain="my")]
    if read_inside:
        nodes += [h.make_node("Add", ["v1", "v2"], ["vv"]), h.make_node("Add", ["y0", "vv"], ["y"])]
    g = h.make_graph(nodes, "g", [vi("x")], [vi("y")], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset), h.make_opsetid("my", 1)], functions=[fn])


def _conv_bn_block(opset=17, nested=False):
    """my.Block(x, w, gamma, beta, mean, var) = Relu(BN(Conv(x, w))), its weights passed by each of its two calls.
    ``nested``: the Block is called by my.Outer(x, ...), and Outer twice by the graph."""
    body = [h.make_node("Conv", ["x", "w"], ["z"], kernel_shape=[1, 1]),
            h.make_node("BatchNormalization", ["z", "gamma", "beta", "mean", "var"], ["b"], epsilon=1e-5),
            h.make_node("Relu", ["b"], ["y"])]
    params = ["w", "gamma", "beta", "mean", "var"]
    fns = [h.make_function("my", "Block", ["x", *params], ["y"], body, [h.make_opsetid("", opset)])]
    if nested:
        fns.append(h.make_function("my", "Outer", ["x", *params], ["y"],
                                   [h.make_node("Block", ["x", *params], ["y"], domain="my")],
                                   [h.make_opsetid("", opset), h.make_opsetid("my", 1)]))
    rng = np.random.default_rng(1)
    inits = [nh.from_array(rng.standard_normal((C, C, 1, 1)).astype("f4"), "w"),
             nh.from_array(rng.uniform(0.5, 2, C).astype("f4"), "gamma"),
             nh.from_array(rng.standard_normal(C).astype("f4"), "beta"),
             nh.from_array(rng.standard_normal(C).astype("f4"), "mean"),
             nh.from_array(rng.uniform(0.5, 2, C).astype("f4"), "var")]
    call = "Outer" if nested else "Block"
    vi = lambda n: h.make_tensor_value_info(n, T.FLOAT, ["N", C, "H", "W"])
    g = h.make_graph([h.make_node(call, ["x", *params], ["a"], domain="my"),
                      h.make_node(call, ["a", *params], ["y"], domain="my")], "g", [vi("x")], [vi("y")], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset), h.make_opsetid("my", 1)], functions=fns)


def _conv_bn_held(rng, c, io, kernel):
    """Conv(io[0]) -> BatchNormalization -> io[1] whose weights and statistics the function body holds as Constant
    nodes (c channels; ``kernel``: the conv's kernel shape, 1-D or 2-D)."""
    consts = {"w": rng.standard_normal((c, c, *kernel)), "gamma": rng.uniform(0.5, 2, c),
              "beta": rng.standard_normal(c), "mean": rng.standard_normal(c), "rv": rng.uniform(0.5, 2, c)}
    body = [h.make_node("Constant", [], [k], value=nh.from_array(v.astype("f4"), k)) for k, v in consts.items()]
    return body + [h.make_node("Conv", [io[0], "w"], ["z"], kernel_shape=list(kernel)),
                   h.make_node("BatchNormalization", ["z", "gamma", "beta", "mean", "rv"], [io[1]], epsilon=1e-5)]


def _saved(tmp_path, graph, fn):
    """``graph`` calling the opset-17 function ``fn`` of domain my, saved as f.onnx; (its path, the output's)."""
    src = tmp_path / "f.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("my", 1)], functions=[fn]),
              str(src))
    return src, tmp_path / "out.onnx"


def _same_in_ort(src, out, shapes):
    rng = np.random.default_rng(7)
    run = lambda p, x: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    for shape in shapes:
        x = (rng.standard_normal(shape) * 3 + 1).astype(np.float32)
        want = run(src, x)
        np.testing.assert_allclose(run(out, x), want, rtol=0, atol=1e-5 * float(np.abs(want).max()))


def _report(out):
    return json.loads(out[out.index("{"):])


def test_a_layernorm_in_a_function_called_twice_is_inlined_and_fused(cli, tmp_path):
    src, dst = tmp_path / "f.onnx", tmp_path / "out.onnx"
    onnx.save(_twice_called_ln(), str(src))
    code, out, err = cli("export", src, "-o", dst, "--json")
    assert code == 0, err
    r = _report(out)
    assert r["extra"]["inlined_functions"] == ["my.LNF"] and r["extra"]["fused"] == {"layernorm": 2}
    assert any("inlined the local function(s) my.LNF" in n for n in r["notes"])
    assert r["before"]["my.LNF"] == 2 and r["before"]["ReduceMean"] == 2  # the file's: two calls, one body
    assert "my.LNF" not in r["after"] and r["after"]["LayerNormalization"] == 2
    written = onnx.load(str(dst))
    ops = [n.op_type for n in written.graph.node]
    assert [o for o in ops if o != "Constant"] == ["LayerNormalization"] * 2 and not written.functions
    assert "my" not in {o.domain for o in written.opset_import}
    _same_in_ort(src, dst, [(2, 5, D), (3, 9, D)])


def test_inspect_says_what_export_would_inline(cli, tmp_path):
    src = tmp_path / "f.onnx"
    onnx.save(_twice_called_ln(), str(src))
    code, out, _ = cli("inspect", src, "--json")
    assert code == 0
    r = _report(out)
    assert r["extra"]["inlined_functions"] == ["my.LNF"] and any("would inline" in n for n in r["notes"])
    assert [s["applied"] for s in r["sites"]] == [True, True]


@pytest.mark.parametrize("nested", [False, True], ids=["called-twice", "inside-a-function-called-twice"])
def test_a_batchnorm_whose_statistics_the_call_passes_is_folded(cli, tmp_path, nested):
    src, dst = tmp_path / "f.onnx", tmp_path / "out.onnx"
    onnx.save(_conv_bn_block(nested=nested), str(src))
    code, out, err = cli("fold", src, "-o", dst, "--json")
    assert code == 0, err
    r = _report(out)
    assert r["extra"]["folded_batchnorm"] == 2
    assert r["extra"]["inlined_functions"] == (["my.Block", "my.Outer"] if nested else ["my.Block"])
    written = onnx.load(str(dst))
    assert sorted(n.op_type for n in written.graph.node) == ["Conv", "Conv", "Relu", "Relu"]
    assert not written.functions
    _same_in_ort(src, dst, [(1, C, 5, 6), (2, C, 8, 3)])


def test_a_function_inlining_does_not_help_stays_a_function(cli, tmp_path):
    src, dst = tmp_path / "f.onnx", tmp_path / "out.onnx"
    onnx.save(_twice_called_ln(read_inside=True), str(src))
    code, out, err = cli("export", src, "-o", dst, "--json")
    assert code == 0, err
    r = _report(out)
    assert "inlined_functions" not in r["extra"] and not any(s["applied"] for s in r["sites"])
    written = onnx.load(str(dst))
    assert [f.name for f in written.functions] == ["LNF"]
    assert [n.op_type for n in written.graph.node].count("LNF") == 2
    _same_in_ort(src, dst, [(2, 5, D), (1, 3, D)])


def test_a_batchnorm_folded_inside_a_function_called_once_is_gone_from_the_file(cli, tmp_path):
    """The fold's new weights inside a function are Constant nodes (a function holds no initializers, and onnxscript
    drops a rewrite that adds one there): before, the report said folded and the file kept the BatchNormalization."""
    body = _conv_bn_held(np.random.default_rng(1), C, ("x", "b"), (1, 1)) + [h.make_node("Relu", ["b"], ["y"])]
    fn = h.make_function("my", "Block", ["x"], ["y"], body, [h.make_opsetid("", 17)])
    vi = lambda n: h.make_tensor_value_info(n, T.FLOAT, ["N", C, "H", "W"])
    g = h.make_graph([h.make_node("Block", ["x"], ["y"], domain="my")], "g", [vi("x")], [vi("y")])
    src, dst = _saved(tmp_path, g, fn)
    code, out, err = cli("fold", src, "-o", dst, "--json")
    assert code == 0, err
    r = _report(out)
    assert r["extra"]["folded_batchnorm"] == 1 and "BatchNormalization" not in r["after"]
    written = onnx.load(str(dst))
    assert [f.name for f in written.functions] == ["Block"]  # the function kept: nothing needed inlining
    assert "BatchNormalization" not in [n.op_type for f in written.functions for n in f.node]
    _same_in_ort(src, dst, [(1, C, 5, 6), (2, C, 8, 3)])


def test_a_function_whose_inlining_only_repeats_its_folds_stays_a_function(cli, tmp_path):
    """my.Block(x, eps): a BatchNorm on a conv whose constants the body holds (folded inside the function), then a
    LayerNorm whose epsilon the graph's caller feeds (not a constant wherever it stands); called twice. Inlined, the
    plan folds the same BatchNorm twice and still refuses the LayerNorms: no more than before (the fold counted once
    per run of the body), so the function stays."""
    rng = np.random.default_rng(2)
    body = _conv_bn_held(rng, D, ("x0", "x"), (1,))
    body += [h.make_node("Constant", [], ["g"], value=nh.from_array(rng.standard_normal(8).astype("f4"), "g"))]
    body += _ln_body(17)
    fn = h.make_function("my", "Block", ["x0", "eps"], ["y"], body, [h.make_opsetid("", 17)])
    vi = lambda n: h.make_tensor_value_info(n, T.FLOAT, ["N", D, 8])
    g = h.make_graph([h.make_node("Block", ["x", "e"], ["a"], domain="my"),
                      h.make_node("Block", ["a", "e"], ["y"], domain="my")],
                     "g", [vi("x"), h.make_tensor_value_info("e", T.FLOAT, [])], [vi("y")])
    src, dst = _saved(tmp_path, g, fn)
    code, out, err = cli("fold", src, "-o", dst, "--json")
    assert code == 0, err
    r = _report(out)
    assert "inlined_functions" not in r["extra"] and r["extra"]["folded_batchnorm"] == 1
    code, out, err = cli("export", src, "-o", tmp_path / "e.onnx", "--json")
    assert code == 0, err
    r = _report(out)
    assert "inlined_functions" not in r["extra"]
    assert [s["applied"] for s in r["sites"] if s["pass"] == "fuse"] == [False]  # refused inlined or not
    written = onnx.load(str(dst))
    assert [f.name for f in written.functions] == ["Block"]
    sess = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in (src, dst)]
    for n in (1, 3):
        feed = {"x": rng.standard_normal((n, D, 8)).astype(np.float32), "e": np.array(1e-5, np.float32)}
        want = sess[0].run(None, feed)[0]
        np.testing.assert_allclose(sess[1].run(None, feed)[0], want, rtol=0, atol=1e-5 * float(np.abs(want).max()))
