"""`normconv fold` on the command line: exit codes, files written or not, JSON shape, dtype kept."""

from __future__ import annotations

import json

import torch
import torch.nn as nn

from normconv.io.load import load
from normconv.models import get


def test_fold_writes_a_loadable_model(cli, tmp_path):
    out = tmp_path / "resnet_folded.pt"
    code, stdout, stderr = cli("fold", "zoo:resnet", "-o", out)
    assert code == 0, stderr
    assert "8 applied, 0 skipped" in stdout and "PASSED" in stdout and "batchnorm modules" in stdout
    loaded = load(str(out))  # normconv's own pickle: carries its example inputs
    assert type(loaded.model).__name__ == "ResNet"
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in loaded.model.modules())
    z = get("resnet")
    x = z.example_inputs()
    with torch.no_grad():
        assert torch.allclose(loaded.model(*x), z.build().eval()(*x), atol=1e-4, rtol=1e-4)


def test_json_report(cli):
    code, stdout, stderr = cli("fold", "zoo:mlp", "--json")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["command"] == "fold" and report["output"] is None
    assert [(s["target"], s["applied"]) for s in report["sites"]] == [("input_bn", True), ("bn1", True),
                                                                       ("bn2", True)]
    assert report["passed"] and report["validation"][0]["max_abs_error"] < 1e-5
    assert report["before"]["batchnorm modules"] == 3 and report["after"]["batchnorm modules"] == 0
    assert "latency ms" not in report["before"], "timing is opt-in (--bench): it costs extra forwards"
    assert report["after"]["parameters"] < report["before"]["parameters"]
    code, stdout, stderr = cli("fold", "zoo:mlp", "--json", "--bench")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["before"]["latency ms"] > 0 and report["after"]["latency ms"] > 0


def test_beyond_tolerance_exits_1_and_writes_nothing(cli, tmp_path):
    out = tmp_path / "never.pt"
    code, stdout, stderr = cli("fold", "zoo:deconv", "-o", out, "--atol", "0", "--rtol", "0")
    assert code == 1
    assert "beyond tolerance" in stderr and "nothing written" in stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_fp16_model_stays_fp16(cli, tmp_path):
    out = tmp_path / "conv3d_fp16.pt"
    code, _, stderr = cli("fold", "zoo:conv3d", "--dtype", "float16", "-o", out)
    assert code == 0, stderr
    model = load(str(out)).model
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert model.conv1.bias is not None and model.conv1.bias.dtype == torch.float16


def test_training_mode_needs_eval(cli, tmp_path):
    src = tmp_path / "train.pt"
    torch.save(get("conv1d").build().train(), src)
    out = tmp_path / "out.pt"
    code, _, stderr = cli("fold", src, "-i", "x:2,4,64", "-o", out)
    assert code == 2 and "training mode" in stderr and "--eval" in stderr
    assert not out.exists()
    code, stdout, stderr = cli("fold", src, "-i", "x:2,4,64", "-o", out, "--eval")
    assert code == 0, stderr
    assert out.exists() and not load(str(out)).model.training


def test_bad_inputs_exit_2(cli, tmp_path):
    code, _, stderr = cli("fold", tmp_path / "missing.pt")
    assert code == 2 and "no such file" in stderr
    code, _, stderr = cli("fold", "zoo:resnet", "-o", tmp_path / "nodir" / "x.pt")
    assert code == 2 and "does not exist" in stderr
    code, _, stderr = cli("fold", "zoo:nope")
    assert code == 2 and "unknown zoo model" in stderr
    code, _, stderr = cli("fold", "zoo:resnet", "-o", tmp_path / "x.pt", "--atol", "-1")
    assert code == 2 and "--atol" in stderr and not (tmp_path / "x.pt").exists()


def test_model_without_batchnorm_is_written_unchanged_with_a_note(cli, tmp_path):
    code, stdout, _ = cli("fold", "zoo:gpt", "-o", tmp_path / "g.pt", "--json")
    report = json.loads(stdout)
    assert code == 0 and report["sites"] == [] and "the model has no BatchNorm; it is unchanged" in report["notes"]


def test_no_output_flag_writes_nothing(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, stdout, _ = cli("fold", "zoo:inline_norm")
    assert code == 0 and "1 applied" in stdout and list(tmp_path.iterdir()) == []
