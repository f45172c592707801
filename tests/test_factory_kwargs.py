"""A factory returning ``(model, {"x": t, "bias": b})``: the dict was passed as one positional argument ("the model
rejected its example inputs ... must be Tensor, not dict"); it is forward's keyword arguments by name, as the
Python API reads a mapping, so a keyword-only forward can be given its example through the factory form."""

from __future__ import annotations

import torch
import torch.nn as nn


class KwOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(16, 16), nn.BatchNorm1d(16)

    def forward(self, x, *, bias):
        return self.bn(self.lin(x)) + bias


def make():
    torch.manual_seed(0)
    return KwOnly().eval(), {"x": torch.randn(4, 16), "bias": torch.randn(16)}


def test_a_factory_gives_keyword_inputs_as_a_dict(cli, tmp_path, monkeypatch):
    (tmp_path / "kwfac.py").write_text(open(__file__).read())
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    from normconv.io.load import load

    loaded = load("kwfac:make")
    assert loaded.inputs.args == () and sorted(loaded.inputs.kwargs) == ["bias", "x"]
    code, _, err = cli("fold", "kwfac:make", "-o", tmp_path / "f.pt")
    assert code == 0, err
    model, inputs = make()
    folded = torch.load(tmp_path / "f.pt", weights_only=False)
    assert not any(isinstance(m, nn.BatchNorm1d) for m in folded.modules())
    torch.testing.assert_close(folded(**inputs), model(**inputs))
