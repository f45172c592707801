"""ONNX in: a file that draws random numbers (a VAE's sampling: RandomNormalLike added to a BatchNorm's output).
Unseeded, each run of the input and of the output draws anew, so a comparison measured the noise and refused an
exact fold (exit 1). The comparison now seeds each unseeded random op alike in both files (by its output's name);
the file written keeps its ops as the input has them (unseeded). Judged here on its own: both files seeded by the
test, run in onnxruntime on fresh inputs at two shapes; an input with external data too."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T, helper as h, numpy_helper as nh

C = 4


def _sampling(op="RandomNormalLike"):
    rng = np.random.default_rng(1)
    f = lambda a, n: nh.from_array(np.asarray(a, "f4"), n)
    inits = [f(rng.standard_normal((C, C, 3, 3)), "w"), f(rng.uniform(.5, 2, C), "g"), f(rng.standard_normal(C), "b"),
             f(rng.standard_normal(C), "m"), f(rng.uniform(.5, 2, C), "v")]
    nodes = [h.make_node("Conv", ["x", "w"], ["z"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             h.make_node("BatchNormalization", ["z", "g", "b", "m", "v"], ["mu"]),
             h.make_node(op, ["mu"], ["eps"], scale=0.1) if op == "RandomNormalLike" else
             h.make_node(op, ["mu"], ["eps"], low=-0.1, high=0.1),
             h.make_node("Add", ["mu", "eps"], ["y"])]
    vi = lambda n: h.make_tensor_value_info(n, T.FLOAT, ["N", C, "H", "W"])
    return h.make_model(h.make_graph(nodes, "g", [vi("x")], [vi("y")], inits), opset_imports=[h.make_opsetid("", 17)])


def _seeded(path, seed=5.0):
    m = onnx.load(str(path))
    for n in m.graph.node:
        if n.op_type.startswith("Random"):
            n.attribute.append(h.make_attribute("seed", seed))
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("external", [False, True], ids=["inline", "external-data"])
@pytest.mark.parametrize("op", ["RandomNormalLike", "RandomUniformLike"])
def test_a_file_that_draws_random_numbers_folds(cli, tmp_path, op, external):
    src, dst = tmp_path / "vae.onnx", tmp_path / "out.onnx"
    onnx.save(_sampling(op), str(src), save_as_external_data=external, size_threshold=0)
    code, out, err = cli("fold", src, "-o", dst, "--json")
    assert code == 0, err
    r = json.loads(out[out.index("{"):])
    assert r["extra"]["folded_batchnorm"] == 1
    assert all("1 random op(s) seeded alike" in v["label"] for v in r["validation"])
    written = onnx.load(str(dst))
    rand = [n for n in written.graph.node if n.op_type == op]
    assert len(rand) == 1 and not any(a.name == "seed" for a in rand[0].attribute)  # as the input has it
    a, b = _seeded(src), _seeded(dst)
    rng = np.random.default_rng(9)
    for shape in ((1, C, 7, 5), (2, C, 12, 9)):
        x = rng.standard_normal(shape).astype(np.float32)
        want = a.run(None, {"x": x})[0]
        np.testing.assert_allclose(b.run(None, {"x": x})[0], want, rtol=0, atol=1e-5 * float(np.abs(want).max()))
