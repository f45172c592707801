"""ONNX in: --opset outside the range --help documents (17 to 23) is one line, exit 2, nothing written (99 carried
onnx's truncated assertion text; 24 wrote an opset-24 file); inside it the file is converted and validated."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tests import onnx_in_graphs as G


@pytest.mark.parametrize("opset", ["99", "24", "0"])
def test_an_opset_outside_the_documented_range_is_one_line(cli, tmp_path, opset):
    src = G.save(G.layernorm_torch(18), tmp_path / "ln.onnx")
    code, out, err = cli("export", src, "-o", tmp_path / "o.onnx", "--opset", opset, "--json")
    assert code == 2 and not (tmp_path / "o.onnx").exists() and len(err.strip().splitlines()) == 1
    r = json.loads(out[out.index("{"):])
    assert r["code"] == "bad-input" and (f"unsupported --opset {opset}: normconv exports opsets 17 to 23" in r["error"]
                                         or "below the file's opset" in r["error"])
    code, help_text, _ = cli("export", "--help")
    assert "17 to 23" in " ".join(help_text.split())


def test_an_opset_inside_the_range_converts_and_validates(cli, tmp_path):
    src = G.save(G.layernorm_torch(18), tmp_path / "ln.onnx")
    code, _, err = cli("export", src, "-o", tmp_path / "o.onnx", "--opset", "23")
    assert code == 0, err
    m = onnx.load(str(tmp_path / "o.onnx"))
    assert next(o.version for o in m.opset_import if o.domain == "") == 23
    assert [n.op_type for n in m.graph.node].count("LayerNormalization") == 1
    rng = np.random.default_rng(1)
    for shape in ((2, 5, 16), (3, 7, 16)):
        x = rng.standard_normal(shape).astype(np.float32)
        run = lambda p: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        np.testing.assert_allclose(run(tmp_path / "o.onnx"), run(src), rtol=1e-5, atol=1e-5)
