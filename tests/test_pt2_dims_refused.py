"""A .pt2 written where torch.export refuses the dynamic height / width (timm's DLA after the fold: "The inequality,
Eq(x/4 - (((x/2)//2)), 0), cannot be solve") was written with every dimension pinned, the batch too, though the model
runs at any batch, and ``extra.dynamic_dims`` empty. As the ONNX export does (tests/test_dims_refused.py), the
program is now exported again with the batch alone dynamic, then static; every static dimension is listed with its
code (``refused-by-export``, ``one-size-only``)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_dims_refused import _model, refusing as _refusing


def _program(tmp_path):
    m = _model()
    auto = torch.export.Dim.AUTO  # the user's program: batch, height and width dynamic
    ep = torch.export.export(m, (torch.randn(2, 3, 16, 16),), dynamic_shapes=({0: auto, 2: auto, 3: auto},))
    torch.export.save(ep, tmp_path / "m.pt2")
    return m, tmp_path / "m.pt2"


def _dims(cli, monkeypatch, tmp_path, batch_too):
    model, path = _program(tmp_path)
    _refusing(monkeypatch, batch_too)
    code, out, _ = cli("fold", path, "-o", tmp_path / "f.pt2", "--json")
    assert code == 0
    monkeypatch.undo()
    report = json.loads(out)
    return model, report, {d["name"]: d for d in report["extra"]["dynamic_dims"]}


def test_pt2_keeps_the_batch_free_where_torch_export_refuses_the_height(cli, monkeypatch, tmp_path):
    model, report, dims = _dims(cli, monkeypatch, tmp_path, batch_too=False)
    assert "pinned" not in dims["batch"], dims["batch"]
    for name in ("height", "width"):
        assert dims[name]["code"] == "refused-by-export" and "cannot be solve" in dims[name]["pinned"]
    assert dims["x_dim1"]["code"] == "one-size-only"
    assert any("exported again with the batch alone dynamic" in n for n in report["notes"]), report["notes"]
    program = torch.export.load(str(tmp_path / "f.pt2")).module()  # as a user loads it: torch alone
    for batch in (3, 1):  # fresh inputs at two batches, neither the example's 2
        x = torch.randn(batch, 3, 16, 16)
        with torch.no_grad():
            torch.testing.assert_close(program(x), model(x), rtol=1e-5, atol=1e-5)


def test_pt2_lists_every_dim_torch_export_refused_when_the_batch_is_refused_too(cli, monkeypatch, tmp_path):
    _, report, dims = _dims(cli, monkeypatch, tmp_path, batch_too=True)
    for name in ("batch", "height", "width"):
        assert dims[name]["code"] == "refused-by-export" and "cannot be solve" in dims[name]["pinned"], dims[name]
    assert any("every dimension pinned" in n for n in report["notes"]), report["notes"]
    program = torch.export.load(str(tmp_path / "f.pt2")).module()
    with pytest.raises(Exception):  # the program holds the example's batch: a guard, not a wrong answer
        program(torch.randn(3, 3, 16, 16))
