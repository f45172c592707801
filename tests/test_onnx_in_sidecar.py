"""ONNX in: the output's external data file (OUT.onnx.data) never replaces a file the user did not name. An existing
one is refused before any work, in one line naming it, unless --overwrite or it is the external data of the OUT the
run replaces (a rerun); a rerun from OUT's own folder (a relative -o) writes as the first run did."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import onnxruntime as ort

from tests import onnx_in_graphs as G


def _external(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save_model(G.conv_bn(), str(src), save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    return src


def _same(src, out):
    x = np.random.default_rng(5).standard_normal((2, 4, 9, 7)).astype(np.float32)
    run = lambda p: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(run(out), run(src), rtol=1e-4, atol=1e-4)


def test_an_unnamed_existing_sidecar_is_refused_unless_overwrite(cli, tmp_path):
    src = _external(tmp_path)
    (tmp_path / "out.onnx.data").write_text("precious user data\n")
    code, out, err = cli("fold", src, "-o", tmp_path / "out.onnx", "--json")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert (tmp_path / "out.onnx.data").read_text() == "precious user data\n" and not (tmp_path / "out.onnx").exists()
    line = json.loads(out[out.index("{"):])["error"]
    assert str(tmp_path / "out.onnx.data") in line and "--overwrite" in line
    code, _, _ = cli("fold", src, "-o", tmp_path / "out.onnx", "--overwrite")
    assert code == 0
    assert "BatchNormalization" not in [n.op_type for n in onnx.load(str(tmp_path / "out.onnx")).graph.node]
    _same(src, tmp_path / "out.onnx")


def test_a_rerun_replaces_its_own_sidecar_from_a_relative_path(cli, tmp_path, monkeypatch):
    src = _external(tmp_path)
    monkeypatch.chdir(tmp_path)
    for _ in range(2):  # the second run replaces out.onnx and the data it reads
        code, _, err = cli("fold", "m.onnx", "-o", "out.onnx")
        assert code == 0, err
    assert sorted(os.listdir(tmp_path)) == ["m.onnx", "m.onnx.data", "out.onnx", "out.onnx.data"]
    _same(src, tmp_path / "out.onnx")
