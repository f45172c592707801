"""swap --to frozen-batchnorm | batchnorm | affine | groupnorm[:G] | instancenorm on BatchNorm as torch, torchvision,
timm, detectron2 and mmcv write it (tests/bn_styles.py): exact targets verified, approximate ones measured, the
group count checked, the written model loading with torch alone and exporting."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import bn_styles as B
import normconv
from normconv.errors import Code, NormconvError
from normconv.nn.modules import ChannelAffine, FrozenBatchNorm
from normconv.passes.convert_batchnorm import ConvertWhy, default_groups

X = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
STYLES = [nn.BatchNorm2d, nn.SyncBatchNorm, B.FrozenBatchNorm2d, B.D2FrozenBatchNorm2d, B.BatchNormAct2d,
          B.SyncBatchNormAct, B.FrozenBatchNormAct2d, B.BatchNormXd, B.MMSyncBatchNorm]
FROZEN = (B.FrozenBatchNorm2d, B.D2FrozenBatchNorm2d, B.FrozenBatchNormAct2d)
WITH_ACT = (B.BatchNormAct2d, B.SyncBatchNormAct, B.FrozenBatchNormAct2d)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _norm(model: nn.Module, path: str) -> nn.Module:
    m = model.get_submodule(path)
    return m.norm if isinstance(m, nn.Sequential) else m


@pytest.mark.parametrize("style", STYLES, ids=lambda s: s.__name__)
def test_to_frozen_is_exact_keeps_eps_and_the_activation(style):
    model = B.net(lambda c: style(c, eps=1e-3) if style is not B.MMSyncBatchNorm else style(c, eps=1e-3))
    before = _state(model)
    if style in FROZEN:  # already frozen: refused, naming why
        with pytest.raises(NormconvError) as info:
            normconv.swap(model, X, to="frozen-batchnorm")
        assert info.value.code is Code.REFUSED and "already frozen" in str(info.value)
        return
    new, report = normconv.swap(model, X, to="frozen-batchnorm")
    assert report.passed and report.extra["exact"] and report.extra["converted"] == 2
    assert {s.code for s in report.sites} == {ConvertWhy.FROZEN}
    for path in ("bn1", "bn2"):
        frozen = _norm(new, path)
        assert isinstance(frozen, FrozenBatchNorm) and frozen.eps == 1e-3
        assert not list(frozen.parameters()) and sorted(n for n, _ in frozen.named_buffers()) == \
            ["bias", "running_mean", "running_var", "weight"]
        if style in WITH_ACT:  # timm's activation is kept, after the frozen norm
            assert isinstance(new.get_submodule(path).act, nn.ReLU)
    torch.testing.assert_close(new(X), model(X), atol=1e-5, rtol=1e-5)
    # frozen: training mode changes nothing (no batch statistics, no update)
    new.train()
    out = new(X)
    new.eval()
    torch.testing.assert_close(out, new(X))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the user's model untouched


@pytest.mark.parametrize("style", [nn.SyncBatchNorm, B.SyncBatchNormAct, B.FrozenBatchNorm2d, B.D2FrozenBatchNorm2d,
                                   B.FrozenBatchNormAct2d, B.BatchNormXd, B.MMSyncBatchNorm], ids=lambda s: s.__name__)
def test_to_batchnorm_from_sync_and_frozen_runs_on_cpu_and_exports(style, tmp_path):
    model = B.net(style)
    new, report = normconv.swap(model, X, to="batchnorm")
    assert report.passed and report.extra["converted"] == 2
    for path in ("bn1", "bn2"):
        assert type(_norm(new, path)) is nn.BatchNorm2d
    if style in FROZEN:  # buffers became Parameters that stay frozen until asked
        assert not any(p.requires_grad for p in _norm(new, "bn1").parameters())
    if style is nn.SyncBatchNorm:  # the same Parameter objects: shared, trained as before
        assert new.bn1.weight is model.bn1.weight
    torch.testing.assert_close(new(X), model(X), atol=1e-5, rtol=1e-5)
    report = normconv.export(new, X, tmp_path / "m.onnx", baseline=False, repeats=0)
    assert report.passed and (tmp_path / "m.onnx").is_file()


def test_batchnorm_already_is_refused():
    with pytest.raises(NormconvError, match="already a torch BatchNorm"):
        normconv.swap(B.net(nn.BatchNorm2d), X, to="batchnorm")


@pytest.mark.parametrize("as_conv", [False, True])
def test_affine_for_a_standalone_batchnorm(as_conv, tmp_path):
    """Nothing to fold into (an add before, a pool after): the BN becomes a Mul + Add, or a depthwise 1x1 conv."""

    class Standalone(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 1)
            self.bn = nn.BatchNorm2d(4)

        def forward(self, x):
            return torch.sigmoid(self.bn(self.a(x) + self.b(x)))

    model = B.randomize(Standalone()).eval()
    new, report = normconv.swap(model, X, to="affine", as_conv=as_conv)
    assert report.passed and report.extra["converted"] == 1
    assert isinstance(new.bn, nn.Conv2d if as_conv else ChannelAffine)
    assert {s.code for s in report.sites if s.pass_name == "convert-batchnorm"} == \
        {ConvertWhy.AS_CONV if as_conv else ConvertWhy.AFFINE}
    torch.testing.assert_close(new(X), model(X), atol=1e-5, rtol=1e-5)
    out = tmp_path / "m.onnx"
    report = normconv.export(new, X, out, baseline=False, repeats=0)
    import onnx

    ops = {n.op_type for n in onnx.load(str(out)).graph.node}
    assert report.passed and "BatchNormalization" not in ops


def test_affine_folds_what_folds_first():
    model = B.net(nn.BatchNorm2d)  # conv -> BN everywhere: fold takes them all, nothing is left for the affine
    new, report = normconv.swap(model, X, to="affine")
    assert report.passed and report.extra["folded"] == 2 and report.extra["converted"] == 0
    assert not any(isinstance(m, (nn.BatchNorm2d, ChannelAffine)) for m in new.modules())


def test_as_conv_on_a_2d_input_says_why():
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.BatchNorm1d(6), nn.Sigmoid()).eval()
    B.randomize(model)
    with pytest.raises(NormconvError) as info:
        normconv.swap(model, torch.randn(3, 4), to="affine", as_conv=True)
    assert "1x1 conv" in str(info.value) and info.value.code is Code.REFUSED


@pytest.mark.parametrize("to", ["groupnorm", "groupnorm:4", "instancenorm"])
def test_groupnorm_and_instancenorm_are_approximate_with_drift_reported(to):
    model = B.net(B.BatchNormAct2d)
    new, report = normconv.swap(model, X, to=to)
    assert report.passed and not report.extra["exact"]  # drift is measured, never judged
    assert all(v.drift for v in report.validation) and report.extra["drift"]["max_abs_error"] > 1e-3
    cls = nn.InstanceNorm2d if to == "instancenorm" else nn.GroupNorm
    assert isinstance(new.bn1.norm, cls) and isinstance(new.bn1.act, nn.ReLU)
    if to == "groupnorm:4":
        assert new.bn1.norm.num_groups == 4 and new.bn2.norm.num_groups == 4
    assert new.bn1.norm.weight is model.bn1.weight  # the BN's own affine, shared
    assert any("approximate" in n for n in report.notes)


def test_group_count_never_erases_a_1d_signal():
    """GroupNorm(C, C) on (N, C) normalizes single values to 0 (Opacus' gcd(32, C) picks it for C <= 32)."""
    model = B.randomize(nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))).eval()
    x = torch.randn(6, 5)
    erased = nn.GroupNorm(4, 4)(model[0](x))
    assert float(erased.detach().abs().max()) < 1e-3  # what the bad count does
    with pytest.raises(NormconvError) as info:
        normconv.swap(model, x, to="groupnorm:4")
    assert "groups of one value" in str(info.value)
    with pytest.raises(NormconvError, match="do not divide"):
        normconv.swap(model, x, to="groupnorm:3")
    with pytest.raises(NormconvError, match="no spatial dims"):
        normconv.swap(model, x, to="instancenorm")
    new, report = normconv.swap(model, x, to="groupnorm")  # the default keeps two values per group at least
    assert new[1].num_groups == 2 and report.passed
    assert default_groups(4, 1) == 2 and default_groups(64, 1) == 8 and default_groups(64, 64) == 32
    assert default_groups(1, 1) == 0


def test_opacus_accepts_the_groupnorm_model():
    validators = pytest.importorskip("opacus.validators")
    model = B.net(nn.BatchNorm2d).train()  # DP training validates a model in training mode
    assert validators.ModuleValidator.validate(model, strict=False)  # BatchNorm: not DP-compatible
    new, _ = normconv.swap(model, X, to="groupnorm")
    assert validators.ModuleValidator.validate(new, strict=False) == []


def test_training_mode_batchnorm_is_frozen_from_its_running_statistics():
    model = B.net(nn.BatchNorm2d).train()
    new, report = normconv.swap(model, X, to="frozen-batchnorm")
    assert report.passed and isinstance(new.bn1, FrozenBatchNorm)
    # proven in eval mode only (a frozen module never takes batch statistics): written in eval mode
    assert model.training and not new.training and report.extra["training_mode"]["code"] == "eval-only"


def test_cli_writes_a_model_that_loads_with_torch_alone(cli, tmp_path):
    src, out = tmp_path / "m.pt", tmp_path / "frozen.pt"
    torch.save(B.net(nn.SyncBatchNorm), src)
    code, stdout, stderr = cli("swap", src, "--trust-pickle", "-i", "2,3,8,8", "--to", "frozen-batchnorm", "-o", out,
                               "--json")
    assert code == 0, stderr
    import json

    report = json.loads(stdout)
    assert report["passed"] and report["extra"]["converted"] == 2
    loaded = torch.load(out, weights_only=False)
    assert not any(type(m).__module__.startswith("normconv") for m in loaded.modules())  # torch alone loads it
    torch.testing.assert_close(loaded(X), B.net(nn.SyncBatchNorm)(X), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("args, message", [
    (("--to", "groupnorm:x"), "positive integer"),
    (("--to", "affine:2"), "only groupnorm takes a count"),
    (("--to", "frozen-batchnorm", "--as-conv"), "goes with --to affine"),
    (("--to", "frozen-batchnorm", "--approximate"), "--to frozen-batchnorm: --approximate is not supported with it"),
])
def test_cli_flags_that_do_not_fit_are_one_line_errors(cli, args, message):
    code, _, stderr = cli("swap", "zoo:resnet", *args)
    assert code == 2 and message in stderr and "Traceback" not in stderr


def test_affine_refuses_a_training_mode_model_as_fold_does(cli, tmp_path):
    """swap --to affine on a model in training mode baked the running statistics into x * s + t and said exact,
    while the model (still in training mode) had normalized with batch statistics: 0.57 of the output's scale apart.
    Now it is refused in one line as fold refuses it; --eval (eval_mode=True) converts its eval-mode self."""
    model = B.net(nn.BatchNorm2d).train()
    with pytest.raises(NormconvError, match="training mode .*per-channel affine would change it; call .eval"):
        normconv.swap(model, X, to="affine")
    new, report = normconv.swap(model, X, to="affine", eval_mode=True)
    assert report.passed and not new.training and model.training
    torch.testing.assert_close(new(X), model.eval()(X), atol=1e-5, rtol=1e-5)
    model.train()
    frozen, _ = normconv.swap(model, X, to="frozen-batchnorm")  # frozen for training: its purpose, said in README
    assert isinstance(_norm(frozen, "bn1"), FrozenBatchNorm)
    with pytest.raises(NormconvError, match="eval_mode goes with a BatchNorm target"):
        normconv.swap(model, X, to="rmsnorm", eval_mode=True)
    src = tmp_path / "train.pt"
    torch.save(model, src)
    code, _, stderr = cli("--quiet", "swap", src, "--trust-pickle", "-i", "2,3,8,8", "--to", "affine")
    assert code == 2 and "training mode" in stderr and len(stderr.strip().splitlines()) == 1
    code, _, stderr = cli("--quiet", "swap", src, "--trust-pickle", "-i", "2,3,8,8", "--to", "affine", "--eval")
    assert code == 0, stderr


def test_batchnorm_targets_obey_the_writing_flags(cli, tmp_path):
    """swap --to a BatchNorm target honours --static (and --overwrite, --accept-specialized) as every command does:
    they were dropped on this path, and a .pt2 asked --static kept dynamic dimensions."""
    import json as _json

    code, out, err = cli("swap", "zoo:resnet", "--to", "frozen-batchnorm", "-o", tmp_path / "f.pt2", "--static",
                         "--json")
    assert code == 0, err
    assert any("example's shapes only (--static)" in n for n in _json.loads(out)["notes"])


@pytest.mark.parametrize("to", ["groupnorm:", "groupnorm:0", "groupnorm:x", "affine:", "frozen-batchnorm:2"])
def test_a_bad_group_count_is_one_line(cli, to):
    """A count asked for and not given (groupnorm:, was taken as the default), or given where none goes."""
    code, _, err = cli("swap", "zoo:resnet", "--to", to)
    assert code == 2 and len(err.strip().splitlines()) == 1 and ("group count" in err or "only groupnorm" in err), err
