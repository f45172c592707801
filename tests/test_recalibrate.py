"""recalibrate: BatchNorm running statistics re-estimated as a cumulative average over calibration batches, each
site's change reported, nothing else changed (checked), from the API and the command line."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import bn_styles as B
import normconv
from normconv.errors import Code, NormconvError
from normconv.passes.recalibrate import RecalibrateWhy


class Dropped(nn.Module):
    """conv -> BN -> dropout -> conv -> BN: the dropout must stay off while the statistics are collected."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=0.3)
        self.drop = nn.Dropout(0.5)
        self.conv2, self.bn2 = nn.Conv2d(4, 5, 3), nn.BatchNorm2d(5)

    def forward(self, x):
        return self.bn2(self.conv2(self.drop(torch.relu(self.bn1(self.conv1(x))))))


def _expected(model: Dropped, batches: list[torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The cumulative average of each batch's mean and unbiased variance, computed here by hand."""
    stats: dict[str, list] = {"bn1": [], "bn2": []}
    m = B.randomize(Dropped()).eval()
    m.load_state_dict(model.state_dict())
    for x in batches:
        y1 = m.conv1(x)
        stats["bn1"].append((y1.mean((0, 2, 3)), y1.var((0, 2, 3), unbiased=True)))
        # bn1 normalizes with this batch's own statistics while it is being recalibrated
        z = (y1 - y1.mean((0, 2, 3), keepdim=True)) / torch.sqrt(y1.var((0, 2, 3), unbiased=False, keepdim=True)
                                                                + m.bn1.eps)
        z = z * m.bn1.weight[None, :, None, None] + m.bn1.bias[None, :, None, None]
        y2 = m.conv2(torch.relu(z))
        stats["bn2"].append((y2.mean((0, 2, 3)), y2.var((0, 2, 3), unbiased=True)))
    return {k: (torch.stack([a for a, _ in v]).mean(0), torch.stack([b for _, b in v]).mean(0))
            for k, v in stats.items()}


def test_cumulative_average_and_nothing_else_changed():
    torch.manual_seed(0)
    model = B.randomize(Dropped()).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = torch.randn(40, 3, 8, 8) * 2 + 0.5
    new, report = normconv.recalibrate(model, data, batch_size=16)  # batches of 16, 16 and 8
    with torch.no_grad():
        want = _expected(model, list(data.split(16)))
    for name in ("bn1", "bn2"):
        bn = getattr(new, name)
        torch.testing.assert_close(bn.running_mean, want[name][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(bn.running_var, want[name][1], atol=1e-5, rtol=1e-5)
        assert int(bn.num_batches_tracked) == 3 and bn.momentum == getattr(model, name).momentum
    assert not new.training and not new.bn1.training and new.drop.p == 0.5
    # nothing else changed: the same tensors, bit for bit, and the user's model untouched
    assert all(new.state_dict()[k] is v or torch.equal(new.state_dict()[k], v) for k, v in model.state_dict().items()
               if "running" not in k and "num_batches" not in k)
    assert new.conv1.weight is model.conv1.weight
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    labels = [v.label for v in report.validation]
    assert labels[0] == "drift against the original" and report.validation[0].drift
    same = next(v for v in report.validation if v.label == "the original with the new statistics")
    assert same.passed and same.max_abs_error == 0.0
    assert {s.code for s in report.sites} == {RecalibrateWhy.RECALIBRATED}
    assert report.extra["batches"] == 3 and set(report.extra["changes"]) == {"bn1", "bn2"}
    assert report.extra["unchanged_tensors"] == len(model.state_dict()) - 6
    assert all("moved by up to" in s.reason for s in report.sites)


def test_it_undoes_a_shift_of_the_data():
    """Statistics measured on other data: recalibrating on the data the model now sees brings each channel back to
    zero mean and unit variance (BN without affine)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, affine=False)).eval()
    data = torch.randn(64, 3, 6, 6) * 3 + 2
    new, report = normconv.recalibrate(model, data, batch_size=64)
    with torch.no_grad():
        out = new(data)
    assert float(out.mean((0, 2, 3)).abs().max()) < 1e-4 and float((out.var((0, 2, 3)) - 1).abs().max()) < 0.05


def test_timm_style_and_frozen_and_fixed_forwards():
    data = torch.randn(8, 3, 8, 8)
    new, report = normconv.recalibrate(B.net(B.BatchNormAct2d), data, batch_size=4)
    assert {s.code for s in report.sites} == {RecalibrateWhy.RECALIBRATED}
    assert int(new.bn1.num_batches_tracked) == 2 and isinstance(new.bn1.act, nn.ReLU)
    for style, code in ((B.FrozenBatchNorm2d, RecalibrateWhy.FROZEN), (B.MMSyncBatchNorm, RecalibrateWhy.FIXED_FORWARD)):
        with pytest.raises(NormconvError) as info:
            normconv.recalibrate(B.net(style), data)
        assert info.value.code is Code.REFUSED and info.value.pass_name == "recalibrate"
    report = normconv.inspect(B.net(B.FrozenBatchNorm2d), data[:2])
    plans = [p for s in report.sites for p in s["plan"] if p["pass"] == "recalibrate"]
    assert plans and {p["code"] for p in plans} == {RecalibrateWhy.FROZEN.value}


def test_bad_calibration_is_one_line():
    with pytest.raises(NormconvError, match="does not run through the model"):
        normconv.recalibrate(B.net(nn.BatchNorm2d), torch.randn(4, 5, 8, 8))
    with pytest.raises(NormconvError, match="share their first dim"):
        normconv.recalibrate(B.net(nn.BatchNorm2d), (torch.randn(4, 3, 8, 8), torch.randn(3, 3)))


def test_cli(cli, tmp_path):
    torch.manual_seed(0)
    src, calib, out = tmp_path / "m.pt", tmp_path / "calib.pt", tmp_path / "recal.pt"
    torch.save(B.net(nn.BatchNorm2d), src)
    torch.save(torch.randn(20, 3, 8, 8) + 1, calib)
    code, stdout, stderr = cli("recalibrate", src, "--trust-pickle", "--calibration", calib, "--batch-size", "8",
                               "-o", out, "--json")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["passed"] and report["extra"]["batches"] == 3 and report["output"] == str(out)
    assert [s["code"] for s in report["sites"]] == ["recalibrated", "recalibrated"]
    loaded = torch.load(out, weights_only=False)
    assert int(loaded.bn1.num_batches_tracked) == 3
    code, _, stderr = cli("recalibrate", "zoo:gpt", "--calibration", calib)
    assert code == 2 and "error:" in stderr and "Traceback" not in stderr


def test_output_never_written_over_the_calibration_data(cli, tmp_path):
    """-o naming the --calibration file, with --in-place, or through a symlink: refused in one line (the run's ledger
    records the calibration file); it was replaced by the pickled model, exit 0."""
    torch.manual_seed(0)
    src, calib, link = tmp_path / "m.pt", tmp_path / "calib.pt", tmp_path / "link.pt"
    torch.save(B.net(nn.BatchNorm2d), src)
    torch.save(torch.randn(8, 3, 8, 8), calib)
    link.symlink_to(calib)
    data = calib.read_bytes()
    for given, out, extra in ((calib, calib, ()), (calib, calib, ("--in-place",)), (link, calib, ()), (calib, link, ())):
        code, _, stderr = cli("recalibrate", src, "--trust-pickle", "--calibration", given, "-o", out, *extra)
        assert code == 2 and "refusing to" in stderr and len(stderr.strip().splitlines()) == 1, stderr
        assert calib.read_bytes() == data and link.is_symlink()


def test_nothing_else_changed_is_checked_on_a_model_past_the_rounding_budget(cli, tmp_path, monkeypatch):
    """A model normconv loaded itself, past the budget under which its own rounding is measured, is written in place
    by most commands; recalibrate compares the result with the original afterwards, so its original is kept: a pass
    that also changed a conv weight is caught there too (with the original written in place, both sides were the
    same tensors and the check compared nothing)."""
    from normconv.clone import owned
    from normconv.engine import rounding
    from normconv.passes import recalibrate as recal

    monkeypatch.setattr(rounding, "BUDGET_BYTES", 0)
    call = recal.Recalibrate.__call__

    def also_a_weight(self, model, cap):
        result = call(self, model, cap)
        conv = next(m for m in result.model.modules() if isinstance(m, nn.Conv2d))
        owned(result.model, conv.weight).data.add_(1.0)  # a change besides the statistics
        return result

    monkeypatch.setattr(recal.Recalibrate, "__call__", also_a_weight)
    src, calib = tmp_path / "m.pt", tmp_path / "calib.pt"
    torch.save(B.net(nn.BatchNorm2d), src)
    torch.save(torch.randn(20, 3, 8, 8) + 1, calib)
    code, _, stderr = cli("recalibrate", src, "--trust-pickle", "--calibration", calib, "-o", tmp_path / "out.pt")
    assert code != 0 and "changed besides the BatchNorm statistics" in stderr
    assert not (tmp_path / "out.pt").exists()


def test_a_last_batch_of_one_sample_joins_the_one_before():
    """33 samples at --batch-size 32: the one left over joins the batch before (a BatchNorm1d on (N, C) refuses a
    batch of one in training mode: 'Expected more than 1 value per channel'); every sample is used once."""
    from normconv.commands.recalibrate import split_batches
    from normconv.verify import Inputs

    x = torch.arange(33.0)[:, None].expand(33, 4)
    batches = split_batches(Inputs((x,)), 32)
    assert [b.args[0].shape[0] for b in batches] == [33]
    assert [b.args[0].shape[0] for b in split_batches(Inputs((x[:31],)), 10)] == [10, 10, 11]
    assert [b.args[0].shape[0] for b in split_batches(Inputs((x,)), 10)] == [10, 10, 10, 3]
    assert torch.equal(torch.cat([b.args[0] for b in batches]), x)
    assert [b.args[0].shape[0] for b in split_batches(Inputs((x[:1],)), 32)] == [1]
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6)).eval()
    new, report = normconv.recalibrate(model, torch.randn(33, 4), batch_size=32)
    assert report.passed


def test_a_half_model_takes_float32_calibration_data(cli, tmp_path):
    """A float16 model with float32 calibration data (as data almost always is) failed with torch's raw dtype error
    (exit 2). The data's floats are now cast to the model's dtype, as a half model's example inputs are, and said."""
    torch.manual_seed(0)
    model = B.randomize(B.net(nn.BatchNorm2d)).eval().half()
    data = torch.randn(12, 3, 8, 8) * 2 + 1  # float32
    new, report = normconv.recalibrate(model, data, batch_size=4)
    same, _ = normconv.recalibrate(model, data.half(), batch_size=4)  # the data cast by hand: the same statistics
    assert report.passed and any("cast from float32 to float16" in n for n in report.notes), report.notes
    assert all(t.dtype == torch.float16 for t in new.state_dict().values() if t.is_floating_point())
    for k, v in same.state_dict().items():
        assert torch.equal(new.state_dict()[k], v), k
    assert not torch.equal(new.bn1.running_mean, model.bn1.running_mean)
    src, calib, out = tmp_path / "m.pt", tmp_path / "calib.pt", tmp_path / "recal.pt"
    torch.save(model, src)
    torch.save(data, calib)
    code, stdout, stderr = cli("recalibrate", src, "--trust-pickle", "--calibration", calib, "--batch-size", "4",
                               "-i", "1,3,8,8:float16", "-o", out, "--json")
    assert code == 0, stderr
    written = torch.load(out, weights_only=False)
    for k, v in same.state_dict().items():
        assert torch.equal(written.state_dict()[k], v), k
