"""ONNX files in the format's first conventions: IR version 3 (every initializer also a graph input, none of them
overridable) and weights written as ConstantOfShape (the ONNX model zoo's light files, shipped inside the onnx
package: caffe2's ResNet-50 at opset 9). An initializer a file of IR version >= 4 lists as an input is a default a
caller may override: it is never baked into a fold."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from normconv.onnx import onnx_in

LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"


def _ops(path) -> dict:
    m = onnx.load(str(path))
    out: dict[str, int] = {}
    for n in m.graph.node:
        out[n.op_type] = out.get(n.op_type, 0) + 1
    return out


def _run(path, x: np.ndarray) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return s.run(None, {s.get_inputs()[0].name: x})


def _conv_bn(tmp_path: Path, ir_version: int, listed: bool) -> Path:
    """Conv (random weight and bias, initializers) -> BatchNormalization (scale and shift initializers, mean and
    variance made by ConstantOfShape of a constant shape) -> Relu, opset 9; ``listed``: every initializer also a
    graph input (required below IR 4, an overridable default from 4 on)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((6, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "b"),
             numpy_helper.from_array(rng.uniform(0.5, 2, 6).astype(np.float32), "gamma"),
             numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "beta"),
             numpy_helper.from_array(np.array([6], dtype=np.int64), "stat_shape")]
    nodes = [helper.make_node("ConstantOfShape", ["stat_shape"], ["mean"],
                              value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.3])),
             helper.make_node("ConstantOfShape", ["stat_shape"], ["var"],
                              value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.7])),
             helper.make_node("Conv", ["x", "w", "b"], ["z"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["z", "gamma", "beta", "mean", "var"], ["y"], epsilon=1e-3),
             helper.make_node("Relu", ["y"], ["out"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, "h", "w"])]
    if listed:
        inputs += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", 6, "h", "w"])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)], ir_version=ir_version)
    path = tmp_path / f"ir{ir_version}.onnx"
    onnx.save(model, str(path))
    return path


def test_ir3_initializers_are_constants_and_constant_of_shape_is_read(tmp_path):
    src = _conv_bn(tmp_path, 3, listed=True)
    onnx.checker.check_model(str(src), full_check=True)
    r = onnx_in.run(str(src), "fold", str(tmp_path / "o.onnx"))
    out = tmp_path / "o.onnx"
    assert r.passed and r.extra["folded_batchnorm"] == 1 and "BatchNormalization" not in _ops(out)
    m = onnx.load(str(out))
    assert m.ir_version == 3 and {t.name for t in m.graph.initializer} <= {v.name for v in m.graph.input}
    assert r.extra["checker"].startswith("passed")
    for shape in ((1, 3, 8, 8), (2, 3, 13, 5)):  # fresh inputs, two shapes, against the file given
        x = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
        (a,), (b,) = _run(src, x), _run(out, x)
        assert np.abs(a).max() > 0.1 and np.abs(a - b).max() < 1e-5


def test_ir4_listed_initializers_are_overridable_and_kept(tmp_path):
    src = _conv_bn(tmp_path, 7, listed=True)
    r = onnx_in.run(str(src), "fold", str(tmp_path / "o.onnx"))
    (site,) = [s for s in r.sites if s.pass_name == "fold"]
    assert not site.applied and site.code == "overridable-initializer" and "caller may override" in site.reason
    assert r.extra["folded_batchnorm"] == 0 and _ops(tmp_path / "o.onnx").get("BatchNormalization") == 1
    # not listed: plain constants again, folded
    plain = tmp_path / "plain"
    plain.mkdir()
    r = onnx_in.run(str(_conv_bn(plain, 7, listed=False)), "fold", str(tmp_path / "p.onnx"))
    assert r.passed and r.extra["folded_batchnorm"] == 1


@pytest.mark.skipif(not (LIGHT / "light_resnet50.onnx").exists(), reason="this onnx wheel ships no light models")
def test_onnx_zoo_light_resnet50(cli, tmp_path):
    """caffe2's ResNet-50 as the onnx package ships it: IR 3, opset 9, every weight a ConstantOfShape."""
    src = LIGHT / "light_resnet50.onnx"
    assert _ops(src)["BatchNormalization"] == 53
    code, _, err = cli("fold", str(src), "-o", str(tmp_path / "r.onnx"))
    assert code == 0, err
    out = tmp_path / "r.onnx"
    assert "BatchNormalization" not in _ops(out) and _ops(out)["Conv"] == 53
    m = onnx.load(str(out))
    assert m.ir_version == 3 and {t.name for t in m.graph.initializer} <= {v.name for v in m.graph.input}
    onnx.checker.check_model(str(out), full_check=True)
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["gpu_0/data_0"]  # the initializers are no caller's inputs


def test_a_file_onnxruntime_does_not_load_is_refused_in_one_line(cli, tmp_path):
    """An opset-6 file (the onnx package's early PyTorch conversions): onnxruntime has no kernel for its ops, and
    every rewrite is validated against the file in onnxruntime: exit 2, one line naming the op, nothing written."""
    nodes = [helper.make_node("Add", ["x", "x"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    src = tmp_path / "old.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 6)], ir_version=3), str(src))
    code, out, err = cli("fold", str(src), "-o", str(tmp_path / "o.onnx"))
    assert code == 2 and "does not load in onnxruntime" in err and "Add(6)" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and not (tmp_path / "o.onnx").exists()


@pytest.mark.parametrize("ir_version", [3, 7])
def test_a_float16_file_lists_its_initializers_as_float16(tmp_path, ir_version):
    """An IR 3 file (every initializer a listed input) in float16: a weight no fold replaced (the conv after the Relu)
    is cast by the half pass, and its input entry says float16 too. Before, its entry kept the float32 the input
    declared: onnxruntime could not load the file normconv wrote (exit 2), onnx.checker refused the light SqueezeNet
    (exit 1). From IR 4 on, a listed initializer is a caller's input: it keeps its type."""
    src = _conv_bn(tmp_path, ir_version, listed=ir_version == 3)
    m = onnx.load(str(src))
    w2 = numpy_helper.from_array(np.random.default_rng(1).standard_normal((4, 6, 1, 1)).astype(np.float32), "w2")
    m.graph.initializer.append(w2)
    if ir_version == 3:
        m.graph.input.append(helper.make_tensor_value_info("w2", TensorProto.FLOAT, [4, 6, 1, 1]))
    m.graph.node.append(helper.make_node("Conv", ["out", "w2"], ["y2"]))
    m.graph.output[0].CopyFrom(helper.make_tensor_value_info("y2", TensorProto.FLOAT, ["n", 4, "h", "w"]))
    onnx.save(m, str(src))
    out = tmp_path / "h.onnx"
    # outputs up to ~30: float16's rounding there is ~0.015, past the element-wise default 1e-2 near zero
    r = onnx_in.run(str(src), "export", str(out), dtype="float16", atol=5e-2)
    assert r.passed and r.extra["checker"].startswith("passed")
    written = onnx.load(str(out))
    onnx.checker.check_model(written, full_check=True)
    types = {t.name: t.data_type for t in written.graph.initializer}
    assert types["w2"] == TensorProto.FLOAT16
    listed = {v.name: v.type.tensor_type.elem_type for v in written.graph.input}
    assert all(listed[k] == v for k, v in types.items()) if ir_version == 3 else set(listed) == {"x"}
    x = np.random.default_rng(2).standard_normal((2, 3, 8, 8)).astype(np.float32)
    (a,), (b,) = _run(src, x), _run(out, x)
    assert np.abs(a).max() > 0.1 and np.abs(a - b).max() < 2e-2 * np.abs(a).max()


def test_constant_initializers_fold_what_a_caller_could_override(cli, tmp_path):
    """--constant-initializers (onnxruntime's remove_initializer_from_input.py, as a flag): an IR 7 file listing its
    initializers as inputs has its BatchNorm folded, validated against the file as given (its inputs at their
    defaults), and the output's only input is the real one; without the flag the site says how."""
    src = _conv_bn(tmp_path, 7, listed=True)
    before = src.read_bytes()
    code, _, err = cli("fold", str(src), "-o", str(tmp_path / "k.onnx"), "--json")
    assert code == 0 and _ops(tmp_path / "k.onnx").get("BatchNormalization") == 1
    code, out, err = cli("fold", str(src), "-o", str(tmp_path / "c.onnx"), "--constant-initializers", "--json")
    assert code == 0, err
    r = __import__("json").loads(out[out.index("{"):])
    assert r["extra"]["folded_batchnorm"] == 1 and set(r["extra"]["constant_initializers"]) == {"w", "b", "gamma",
                                                                                                  "beta", "stat_shape"}
    written = onnx.load(str(tmp_path / "c.onnx"))
    assert [v.name for v in written.graph.input] == ["x"] and "BatchNormalization" not in _ops(tmp_path / "c.onnx")
    for shape in ((1, 3, 8, 8), (2, 3, 11, 7)):
        x = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
        (a,), (b,) = _run(src, x), _run(tmp_path / "c.onnx", x)
        assert np.abs(a).max() > 0.1 and np.abs(a - b).max() < 1e-5
    assert src.read_bytes() == before
    for command in ("fold", "inspect", "export"):  # a torch model: the flag refused in one line, nothing read
        code, _, err = cli(command, "zoo:resnet", "--constant-initializers", "-o", str(tmp_path / "t.onnx")) \
            if command == "export" else cli(command, "zoo:resnet", "--constant-initializers")
        assert code == 2 and "--constant-initializers goes with an .onnx input only" in err, (command, err)
    assert not (tmp_path / "t.onnx").exists()


def test_torch_legacy_export_with_initializers_as_inputs(cli, tmp_path):
    """torch.onnx.export(..., keep_initializers_as_inputs=True), an IR >= 4 file whose every weight is an overridable
    input: nothing folds by default (each site says why), everything with --constant-initializers."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1),
                          nn.BatchNorm2d(4)).eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.normal_(0, 0.3)
            m.running_var.uniform_(0.5, 2)
    src = tmp_path / "legacy.onnx"
    torch.onnx.export(model, (torch.randn(1, 3, 16, 16),), str(src), dynamo=False, opset_version=17,
                      keep_initializers_as_inputs=True, do_constant_folding=False, input_names=["x"],
                      dynamic_axes={"x": {0: "n"}})
    assert _ops(src)["BatchNormalization"] == 2 and onnx.load(str(src)).ir_version >= 4
    code, _, err = cli("fold", str(src), "-o", str(tmp_path / "d.onnx"))
    assert code == 0 and _ops(tmp_path / "d.onnx")["BatchNormalization"] == 2
    code, _, err = cli("fold", str(src), "-o", str(tmp_path / "f.onnx"), "--constant-initializers")
    assert code == 0, err
    assert "BatchNormalization" not in _ops(tmp_path / "f.onnx")
    x = np.random.default_rng(0).standard_normal((3, 3, 16, 16)).astype(np.float32)
    (a,), (b,) = _run(src, x), _run(tmp_path / "f.onnx", x)
    assert np.abs(a - b).max() < 1e-5 * max(1.0, np.abs(a).max())
