"""Sweep B, finding 1: a forward that branches on an input size (``if x.shape[1] > 2:``, a decode fast path) was
captured by a static torch.export at the example's size and checked at a second size on the same side: canonicalize
exited 0 claiming exact, and the written .pt / .pt2 / .onnx were wrong by 0.3-0.8 of the output's scale at sequence 2
and 1 (the .pt2 and .onnx reports claiming those sizes). Now the branch is found (symbolic_trace fails on it; the
original is exported once with Dim.AUTO and its range read), reported in ``extra.specialized`` with a code, and the
rewrite is checked at a size across it: proven there, or the .pt2's range is the proven one, or the command is
refused (exit 2) naming the branch and the range. A second shape that crosses the branch names it in the exit-1
message. Every written output is judged here outside normconv, at the sizes in question."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

_MODEL = '''
import torch
import torch.nn as nn


class Norm(nn.Module):
    """RMS on a 1-2 token decode step, LayerNorm from 3 tokens on (a hand-written norm)."""

    def __init__(self, d, threshold):
        super().__init__()
        self.threshold = threshold
        self.g, self.b = nn.Parameter(torch.randn(d)), nn.Parameter(torch.randn(d))

    def forward(self, x):
        if x.shape[1] > self.threshold:
            x = x - x.mean(-1, keepdim=True)
        return self.g * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) + self.b


class Net(nn.Module):
    def __init__(self, threshold):
        super().__init__()
        self.l, self.n, self.o = nn.Linear(16, 16), Norm(16, threshold), nn.Linear(16, 3)

    def forward(self, x):
        return self.o(self.n(self.l(x)))


class Outside(nn.Module):
    """The size branch in the model's own forward, the hand-written LayerNorm elsewhere: the rewrite holds on both
    paths."""

    def __init__(self):
        super().__init__()
        self.l, self.n, self.o = nn.Linear(16, 16), Norm(16, 0), nn.Linear(16, 3)

    def forward(self, x):
        h = self.l(x)
        if x.shape[1] > 2:
            h = h * 2
        return self.o(self.n(h))


def decode():
    torch.manual_seed(0)
    return Net(2).eval(), (torch.randn(2, 6, 16),)


def crossing():
    torch.manual_seed(0)
    return Net(5).eval(), (torch.randn(2, 6, 16),)


def outside():
    torch.manual_seed(0)
    return Outside().eval(), (torch.randn(2, 6, 16),)
'''


@pytest.fixture
def sized(tmp_path, monkeypatch):
    (tmp_path / "sizebranch.py").write_text(textwrap.dedent(_MODEL))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("sizebranch", None)


def _error(written, original, shape) -> float:
    torch.manual_seed(1)
    x = torch.randn(shape)
    with torch.no_grad():
        a, b = original(x), written(x)
    return float((a - b).abs().max() / a.abs().max())


def test_a_pt_over_a_size_branch_is_refused_naming_it_and_its_range(cli, sized):
    out = sized / "out.pt"
    rc, stdout, err = cli("canonicalize", "sizebranch:decode", "-o", out, "--json")
    assert rc == 2, err
    error = json.loads(stdout)
    assert error["code"] == "refused"
    assert "x.shape[1] > self.threshold" in error["error"] and "3..inf" in error["error"]
    assert not out.exists()


def test_accepted_the_report_says_the_range_and_the_pt_is_right_inside_it(cli, sized):
    import sizebranch

    out = sized / "out.pt"
    rc, stdout, err = cli("canonicalize", "sizebranch:decode", "-o", out, "--accept-specialized", "--json")
    assert rc == 0, err
    entry = json.loads(stdout)["extra"]["specialized"][0]
    assert (entry["on"], entry["code"], entry["inputs"], entry["min"], entry["max"], entry["checked"]) == \
        ("size", "accepted", ["x[1]"], 3, None, [2])
    original, _ = sizebranch.decode()
    written = torch.load(out, weights_only=False)
    assert _error(written, original, (1, 3, 16)) < 1e-5  # inside the range said
    assert _error(written, original, (1, 2, 16)) > 1e-2  # outside it: what was accepted


def test_a_pt2_takes_the_proven_sizes_only(cli, sized):
    import sizebranch

    out = sized / "out.pt2"
    rc, stdout, err = cli("canonicalize", "sizebranch:decode", "-o", out, "--json")
    assert rc == 0, err
    report = json.loads(stdout)
    entry = report["extra"]["specialized"][0]
    assert (entry["code"], entry["min"]) == ("range-clipped", 3)
    seq = next(d for d in report["extra"]["dynamic_dims"] if d["name"] == "sequence")
    assert seq["min"] == 3
    original, _ = sizebranch.decode()
    program = torch.export.load(out).module()
    for shape in ((1, 3, 16), (3, 9, 16)):
        assert _error(program, original, shape) < 1e-5
    for shape in ((1, 2, 16), (3, 1, 16)):  # the other path: refused by the program, not computed wrongly
        with pytest.raises(Exception):
            program(torch.randn(shape))


def test_export_onnx_over_a_size_branch_is_refused(cli, sized):
    out = sized / "out.onnx"
    rc, stdout, err = cli("export", "sizebranch:decode", "-o", out, "--json")
    assert rc == 2, err
    assert "3..inf" in json.loads(stdout)["error"]
    assert not out.exists()


def test_a_size_branch_the_rewrite_does_not_reach_is_proven_across_it(cli, sized):
    import sizebranch

    out = sized / "out.pt"
    rc, stdout, err = cli("canonicalize", "sizebranch:outside", "-o", out, "--json")
    assert rc == 0, err
    entry = json.loads(stdout)["extra"]["specialized"][0]
    assert (entry["code"], entry["checked"]) == ("proven-across", [2])
    original, _ = sizebranch.outside()
    written = torch.load(out, weights_only=False)
    for shape in ((1, 2, 16), (3, 1, 16), (2, 7, 16)):
        assert _error(written, original, shape) < 1e-5


def test_a_second_shape_across_the_branch_names_it(cli, sized):
    out = sized / "out.pt"
    rc, stdout, err = cli("canonicalize", "sizebranch:crossing", "-o", out)
    assert rc == 1
    assert "x.shape[1] > self.threshold" in err and "sequence = 5" in err and "6..inf" in err
    assert not out.exists()
