"""--dtype float16 / bfloat16 on a model that keeps floating tensors as plain attributes (d2l's hand-written
BatchNorm: its running statistics are no buffers, so ``.to(half)`` leaves them float32 and the next conv meets a
float32 input with half weights). The cast model cannot run: fold, canonicalize and export ended in exit 3 "internal
error". It is the user's model failing under the cast: exit 2, one line naming the error and the attributes."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F


class BatchNorm(nn.Module):  # d2l's, as users write it: the statistics are plain tensor attributes
    def __init__(self, c):
        super().__init__()
        self.gamma = nn.Parameter(torch.rand(1, c, 1, 1) + 0.5)
        self.beta = nn.Parameter(torch.randn(1, c, 1, 1))
        self.moving_mean = torch.randn(1, c, 1, 1)
        self.moving_var = torch.rand(1, c, 1, 1) + 0.5

    def forward(self, X):
        return self.gamma * (X - self.moving_mean) / torch.sqrt(self.moving_var + 1e-5) + self.beta


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.bn, self.c2 = nn.Conv2d(3, 8, 3, padding=1), BatchNorm(8), nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        return self.c2(F.relu(self.bn(self.c1(x))))


def make():
    torch.manual_seed(0)
    return Net().eval(), (torch.randn(2, 3, 16, 16),)


@pytest.mark.parametrize("command", [["fold"], ["canonicalize"], ["export", "--no-baseline"]])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_model_the_cast_does_not_reach_is_refused_in_one_line(cli, tmp_path, monkeypatch, command, dtype):
    (tmp_path / "plainbn.py").write_text(open(__file__).read())
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / ("out.onnx" if command[0] == "export" else "out.pt")
    code, stdout, stderr = cli(*command, "plainbn:make", "--dtype", dtype, "-o", out, "--json")
    obj = json.loads(stdout)
    assert (code, obj["code"], obj["exit_code"]) == (2, "bad-input", 2), stderr
    assert len(stderr.strip().splitlines()) == 1 and f"fails when cast to {dtype}" in stderr
    assert "bn.moving_mean (float32)" in stderr and "bn.moving_var (float32)" in stderr and "register_buffer" in stderr
    assert not out.exists()


def test_the_float32_model_still_folds(cli, tmp_path, monkeypatch):
    (tmp_path / "plainbn.py").write_text(open(__file__).read())
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, stderr = cli("fold", "plainbn:make", "-o", tmp_path / "out.pt")
    assert code == 0, stderr
