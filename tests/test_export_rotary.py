"""A fused RotaryEmbedding-23 keeps the file's dynamic batch (``onnx.rules.repair.RotaryCacheBatch``).

At opset 23 torch's exporter fuses a Hugging Face rotary embedding into RotaryEmbedding with caches of batch 1;
onnxruntime runs such a node at batch 1 only, so every Llama-family file normconv exported had its batch and sequence
pinned to the example's. The repair broadcasts the caches to X's batch."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper

import normconv
from normconv.onnx.passes.repair import RepairDownconverted

from .hf_tiny import lm_onnx_error, tiny_llama


def _rotary_file(path) -> None:
    """RotaryEmbedding-23 of x (B, 2, S, 8) with caches (1, S, 4): what torch's fusion leaves."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 2, "S", 8])
    cos = helper.make_tensor_value_info("cos", TensorProto.FLOAT, [1, "S", 4])
    sin = helper.make_tensor_value_info("sin", TensorProto.FLOAT, [1, "S", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 2, "S", 8])
    node = helper.make_node("RotaryEmbedding", ["x", "cos", "sin"], ["y"], interleaved=0, num_heads=2)
    graph = helper.make_graph([node], "rotary", [x, cos, sin], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]), str(path))


def _rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """q * cos + rotate_half(q) * sin, caches (1, S, D/2) broadcast over batch and heads."""
    c, s = np.concatenate([cos, cos], -1)[:, None], np.concatenate([sin, sin], -1)[:, None]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * c + rotated * s


def test_caches_of_batch_1_are_broadcast_to_the_batch(tmp_path):
    import onnxruntime as ort

    src, fixed = tmp_path / "in.onnx", tmp_path / "fixed.onnx"
    _rotary_file(src)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2, 5, 8)).astype(np.float32)
    angles = rng.standard_normal((1, 5, 4)).astype(np.float32)
    feed = {"x": x, "cos": np.cos(angles), "sin": np.sin(angles)}
    with pytest.raises(Exception, match="cos_cache"):  # onnxruntime on the file as torch leaves it: batch 1 only
        ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, feed)

    model = ir.load(str(src))
    repair = RepairDownconverted()
    assert repair(model).modified and len(repair.fixed) == 1
    assert RepairDownconverted()(model).modified is False  # once: the broadcast caches are not matched again
    ir.save(model, str(fixed))
    onnx.checker.check_model(str(fixed), full_check=True)
    sess = ort.InferenceSession(str(fixed), providers=["CPUExecutionProvider"])
    for batch in (3, 1):
        f = dict(feed, x=x[:batch])
        np.testing.assert_allclose(sess.run(None, f)[0], _rotary(x[:batch], feed["cos"], feed["sin"]), atol=1e-6)


def test_a_static_batch_of_1_is_left_alone(tmp_path):
    src = tmp_path / "in.onnx"
    _rotary_file(src)
    model = ir.load(str(src))
    model.graph.inputs[0].shape = ir.Shape([1, 2, "S", 8])
    assert RepairDownconverted()(model).modified is False


def test_a_llama_exports_with_dynamic_batch_and_sequence(tmp_path):
    model, inputs = tiny_llama()
    out = tmp_path / "llama.onnx"
    report = normconv.export(model, inputs, str(out))
    dims = {d["name"]: d for d in report.extra["dynamic_dims"]}
    assert not dims["batch"].get("pinned") and not dims["sequence"].get("pinned"), dims  # pinned before the repair
    assert dims["batch"]["checked"] and dims["sequence"]["checked"]
    graph = onnx.load(str(out)).graph
    assert sum(n.op_type == "RotaryEmbedding" for n in graph.node) == 4  # q and k of 2 layers, fused
    assert sum(n.op_type == "RMSNormalization" for n in graph.node) == 5
    assert lm_onnx_error(out, model) <= 1e-5  # neither the example's (2, 16) nor the checked second shapes


def test_a_file_onnxruntime_refuses_is_reported_not_printed_by_onnxruntime(tmp_path, capfd):
    """The export's validation of a file onnxruntime refuses (here the unrepaired rotary node at batch 3): normconv
    raises with onnxruntime's reason; onnxruntime's own executor prints nothing on stderr (it printed its red
    '[E:onnxruntime:...]' line in the middle of normconv's report, where the export then pinned the dimensions)."""
    from normconv.onnx.validate import validate
    from normconv.verify import Inputs

    class Three(torch.nn.Module):
        def forward(self, x, cos, sin):
            return x

    src = tmp_path / "in.onnx"
    _rotary_file(src)
    x, angles = torch.randn(3, 2, 5, 8), torch.randn(1, 5, 4)
    inputs = Inputs((x, angles.cos(), angles.sin()))
    with pytest.raises(Exception, match="cos_cache"):
        validate(str(src), Three(), inputs, x, ["cpu"], None, None, repeats=0)
    assert "onnxruntime" not in capfd.readouterr().err
