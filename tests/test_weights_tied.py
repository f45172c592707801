"""--weights W.safetensors of a model with tied weights, written by safetensors.torch.save_model (tied tensors stored
once, as transformers and normconv's own .safetensors output store them), was refused "1 missing keys": the tied
name the file leaves out counted as missing. It is read as safetensors.torch.load_model reads it, by the library's
own rule: the kept name loads every name tied to it; a key missing for any other reason is still refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file, save_model

from normconv.errors import NormconvError
from normconv.io.load import load_weights


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.ln, self.head = nn.Embedding(30, 16), nn.LayerNorm(16), nn.Linear(16, 30, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.ln(self.emb(ids)))


def tied(seed=3):
    torch.manual_seed(seed)
    return TiedLM().eval(), (torch.randint(0, 30, (2, 6)),)


def test_a_tied_model_saved_by_save_model_loads_as_load_model_loads_it(tmp_path):
    source, (ids,) = tied(3)
    with torch.no_grad():
        source.ln.weight.uniform_(0.5, 1.5)
    save_model(source, tmp_path / "w.safetensors")
    assert len(load_file(tmp_path / "w.safetensors")) == 3  # one of emb.weight / head.weight stored
    model, _ = tied(4)
    load_weights(model, str(tmp_path / "w.safetensors"))
    assert model.head.weight is model.emb.weight  # still tied
    for k, v in source.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    assert torch.equal(model(ids), source(ids))


def test_a_key_missing_for_another_reason_is_still_refused(tmp_path):
    source, _ = tied(3)
    state = {k: v.clone() for k, v in source.state_dict().items() if k not in ("head.weight", "ln.weight")}
    save_file(state, tmp_path / "w.safetensors")
    with pytest.raises(NormconvError, match=r"1 missing keys \(e.g. \['ln.weight'\]\)"):
        load_weights(tied(4)[0], str(tmp_path / "w.safetensors"))
    state.pop("emb.weight")  # neither name of the tied tensor: missing (one name, as load_model counts it)
    save_file(state, tmp_path / "w2.safetensors")
    with pytest.raises(NormconvError, match="missing keys"):
        load_weights(tied(4)[0], str(tmp_path / "w2.safetensors"))


def test_the_command_line_takes_it(cli, tmp_path, monkeypatch):
    (tmp_path / "tiedm.py").write_text(open(__file__).read())
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    save_model(tied(5)[0], tmp_path / "w.safetensors")
    code, _, err = cli("inspect", "tiedm:tied", "--weights", tmp_path / "w.safetensors")
    assert code == 0, err
