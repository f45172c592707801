"""An input dimension that torch.export itself specializes to the example's size (HF Mamba's scan, a Python loop over
the sequence; LongT5's blocks of 16) was written static with nothing said: no note, no entry in dynamic_dims, and
dynamic_axes listed the size ('16') as if it were a dimension's name. Now every input dimension the written file
holds to the example's size is in dynamic_dims with its code and reason, a dimension the original runs at other
sizes of is said in a note, and dynamic_axes names dynamic axes only."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn as nn

import normconv


class Scan(nn.Module):
    """Token ids -> embedding -> LayerNorm -> a recurrence unrolled by a Python loop over the sequence (as HF
    Mamba's slow path scans): traced, the loop holds for the example's length only; eager, it runs at any."""

    def __init__(self, vocab: int = 32, c: int = 8):
        super().__init__()
        self.emb, self.norm, self.mix, self.head = nn.Embedding(vocab, c), nn.LayerNorm(c), nn.Linear(c, c), \
            nn.Linear(c, 4)

    def forward(self, input_ids):
        x = self.norm(self.emb(input_ids))
        h, outs = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = torch.tanh(self.mix(h) + x[:, t])
            outs.append(h)
        return self.head(torch.stack(outs, 1))


def _model() -> Scan:
    torch.manual_seed(0)
    m = Scan().eval()
    with torch.no_grad():
        m.norm.weight.uniform_(0.5, 1.5)
        m.norm.bias.uniform_(-0.5, 0.5)
    return m


def _run(path, ids):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: ids.numpy()})[0]


def test_a_sequence_the_trace_specializes_is_listed_said_and_no_size_is_a_name(tmp_path):
    m, ids = _model(), torch.randint(0, 32, (2, 16))
    path = tmp_path / "m.onnx"
    report = normconv.export(m, (ids,), str(path))
    dims = {d["name"]: d for d in json.loads(json.dumps(report.extra["dynamic_dims"], default=str))}
    seq = dims["sequence"]
    assert seq["inputs"] == ["input_ids[1]"] and seq["example"] == 16 and seq["code"] == "specialized-by-export"
    assert "sequence = 17" in seq["pinned"]
    assert "pinned" not in dims["batch"]
    assert any(n.startswith("dimension sequence (input_ids[1]) is static at the example's 16") for n in report.notes)
    axes = report.extra["dynamic_axes"]
    assert all(isinstance(name, str) and not name.isdigit() for a in axes.values() for name in a.values())
    assert list(next(iter(axes.values())).values()) == ["batch"]
    declared = [d.dim_param or d.dim_value for d in onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim]
    assert declared[1] == 16 and isinstance(declared[0], str)
    for batch in (2, 3):  # the example's sequence, and the batch the file claims is free
        x = torch.randint(0, 32, (batch, 16))
        with torch.no_grad():
            ref = m(x).numpy()
        np.testing.assert_allclose(_run(path, x), ref, atol=1e-5, rtol=1e-5)


def test_a_dimension_the_model_takes_at_one_size_only_is_listed_as_such(tmp_path):
    m = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)).eval()
    report = normconv.export(m, (torch.randn(2, 3, 8, 8),), str(tmp_path / "c.onnx"))
    channels = [d for d in report.extra["dynamic_dims"] if d.get("code") == "one-size-only"]
    assert [(d["inputs"], d["example"]) for d in channels] == [(["input[1]"], 3)]
    assert any("input[1] = 3" in n for n in report.notes)
    assert {d["name"] for d in report.extra["dynamic_dims"] if "pinned" not in d} == {"batch", "height", "width"}
