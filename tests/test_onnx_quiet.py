"""A size onnxruntime refuses while normconv tries it (a dynamic dimension at a second size) is normconv's to
report: onnxruntime's own executor log of the failure stays off the user's terminal (``onnx.validate.run_quietly``,
used by the export's dimension check and the ONNX-in size planner)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from normconv.onnx.validate import run_quietly


def _refusing_model() -> bytes:
    """Y = X + C with X declared [N, 4] and C a [2, 4] constant: any N but 1 and 2 fails in the Add kernel."""
    c = helper.make_tensor("C", TensorProto.FLOAT, [2, 4], np.ones(8, dtype=np.float32).tolist())
    graph = helper.make_graph([helper.make_node("Add", ["X", "C"], ["Y"])], "g",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 4])], [c])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def test_a_refused_size_raises_and_prints_nothing(capfd):
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(_refusing_model(), opts, providers=["CPUExecutionProvider"])
    assert run_quietly(sess, {"X": np.zeros((2, 4), np.float32)})[0].shape == (2, 4)
    capfd.readouterr()
    with pytest.raises(Exception, match="broadcast"):
        sess.run(None, {"X": np.zeros((3, 4), np.float32)})
    assert "onnxruntime" in capfd.readouterr().err  # without it, the executor prints the kernel's error
    with pytest.raises(Exception, match="broadcast"):
        run_quietly(sess, {"X": np.zeros((3, 4), np.float32)})
    assert "onnxruntime" not in capfd.readouterr().err


@pytest.mark.parametrize("make", ["parity", "validate"])
def test_a_kernel_failing_in_a_validation_session_prints_nothing(capfd, tmp_path, make):
    """The sessions normconv validates in log nothing below fatal: a kernel's failure raises, and normconv's own line
    is all the user sees (severity 3 printed the executor's ERROR line, in colour, before it)."""
    from normconv.onnx import parity, validate

    path = tmp_path / "m.onnx"
    path.write_bytes(_refusing_model())
    sess = parity.session(str(path), "disabled") if make == "parity" else \
        validate.session(str(path), "CPUExecutionProvider", "disabled")
    capfd.readouterr()
    with pytest.raises(Exception, match="broadcast"):
        sess.run(None, {"X": np.zeros((3, 4), np.float32)})
    assert "onnxruntime" not in capfd.readouterr().err
