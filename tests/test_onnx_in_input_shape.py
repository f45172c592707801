"""ONNX in: an -i value that contradicts the file's declared input (rank, a fixed dimension, the dtype) is refused
in one line naming the -i value and the declaration it contradicts; a shape too large to run is said to be so.
Exit 2, nothing written."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest

from tests import onnx_in_graphs as G


@pytest.mark.parametrize("given, why", [
    ("x:1,4,8", "3 dimension(s) given, 4 declared"),
    ("x:1,5,8,8", "dimension 1: 5 given, 4 declared"),
    ("x:1,4,8,8:int64", "int64 given"),
    ("x:1,4,8,8:float16", "float16 given"),
])
def test_an_input_shape_that_contradicts_the_file_names_both(cli, tmp_path, given, why):
    src = G.save(G.conv_bn(cin=4), tmp_path / "cb.onnx")
    code, out, err = cli("fold", src, "-o", tmp_path / "o.onnx", "-i", given, "--json")
    assert code == 2 and not (tmp_path / "o.onnx").exists()
    line = json.loads(out[out.index("{"):])["error"]
    assert f"-i {given} contradicts" in line and "declared float[n,4,h,w]" in line and why in line
    assert "declared shapes" not in line and len(err.strip().splitlines()) == 1


def test_an_input_shape_too_large_to_run_is_said_so(cli, tmp_path):
    src = G.save(G.conv_bn(cin=4), tmp_path / "cb.onnx")
    code, out, _ = cli("fold", src, "-o", tmp_path / "o.onnx", "-i", "x:100000,4,1000,1000", "--json")
    assert code == 2 and not (tmp_path / "o.onnx").exists()
    assert "too large to run" in json.loads(out[out.index("{"):])["error"]


def test_an_input_shape_that_agrees_is_validated_there_without_a_dtype(cli, tmp_path):
    src = G.save(G.conv_bn(cin=4), tmp_path / "cb.onnx")
    code, out, _ = cli("fold", src, "-o", tmp_path / "o.onnx", "-i", "x:2,4,8,8", "--json")
    assert code == 0
    r = json.loads(out[out.index("{"):])
    assert r["extra"]["folded_batchnorm"] == 1 and r["validation"][0]["label"].find("x=(2, 4, 8, 8)") >= 0
    x = np.random.default_rng(3).standard_normal((3, 4, 5, 7)).astype(np.float32)
    run = lambda p: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(run(tmp_path / "o.onnx"), run(src), rtol=1e-4, atol=1e-4)
