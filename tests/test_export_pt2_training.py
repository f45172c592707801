"""export of a .pt2 exported in training mode (BatchNorm with batch statistics in the graph): fold refused it (exit 2,
training mode), export ran, missed its validation (exit 1: the ONNX computes the running statistics, the program the
batch's) and suggested the atol that would pass, which writes a file computing something else than the program.
export now refuses it as fold does, by fold's own check (``refuse_training``), before any work."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn


@pytest.fixture(scope="module")
def train_pt2(tmp_path_factory):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1)).train()
    path = tmp_path_factory.mktemp("pt2train") / "cnn_train.pt2"
    torch.export.save(torch.export.export(model, (torch.randn(2, 3, 16, 16),)), path)
    return path


@pytest.mark.parametrize("extra", [[], ["--atol", "0.5"]])
def test_export_refuses_a_training_mode_program_as_fold_does(cli, tmp_path, train_pt2, extra):
    out = tmp_path / "t.onnx"
    code, stdout, stderr = cli("export", train_pt2, "-o", out, "--no-baseline", "--json", *extra)
    obj = json.loads(stdout)
    assert (code, obj["code"], obj["exit_code"]) == (2, "bad-input", 2), stderr
    assert "is in training mode" in stderr and "captured in training mode" in stderr and "atol" not in stderr
    assert len(stderr.strip().splitlines()) == 1 and not out.exists()
    code, _, fold_err = cli("fold", train_pt2, "-o", tmp_path / "f.pt2")
    assert code == 2 and "is in training mode" in fold_err
