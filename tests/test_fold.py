"""normconv fold: numerical equivalence on every zoo CNN and every layout, forward folds, and each guard."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fold_helpers import applied, bn_modules, checked_fold, randomize_bn, skipped
from normconv.errors import NormconvError
from normconv.models import get
from normconv.api import fold, swap
from normconv.passes.fold_batchnorm import FOLD
from normconv.nn.modules import ChannelShift

torch.manual_seed(0)

# zoo model -> (BN sites folded, BN modules left); unet has GroupNorm / InstanceNorm only
ZOO_CNNS = {"resnet": 8, "mobilenet": 10, "conv1d": 3, "conv3d": 2, "deconv": 3, "mlp": 3, "unet": 0,
            "tutorial_bn": 3, "inline_norm": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(ZOO_CNNS))
def test_zoo_cnns_fold_exactly(name, dtype):
    z = get(name)
    model = z.build().eval().to(dtype)
    x = tuple(t.to(dtype) for t in z.example_inputs())
    folded, report = checked_fold(model, x)
    assert len(applied(report)) == ZOO_CNNS[name] and not skipped(report)
    assert bn_modules(folded) == 0
    assert report.before["batchnorm modules"] == bn_modules(model)
    assert report.after["conv modules"] == report.before["conv modules"]
    if name != "inline_norm":  # module-level edit: the user's own class, BN keys gone, the rest unchanged
        assert type(folded) is type(model)
        gone = set(model.state_dict()) - set(folded.state_dict())
        assert all(".running_" in k or ".moving_" in k or k.split(".")[-1] in ("weight", "bias", "gamma", "beta",
                                                                                 "num_batches_tracked")
                   for k in gone)
        assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in folded.modules())
    else:  # functional F.batch_norm: the traced graph comes back without it
        assert isinstance(folded, fx.GraphModule)
        assert not any("batch_norm" in str(n.target) for n in folded.graph.nodes)


def test_tutorial_bn_folds_under_either_capture():
    z = get("tutorial_bn")
    for method in ("symbolic_trace", "torch.export"):
        folded, report = checked_fold(z.build().eval(), z.example_inputs(), method=method)
        assert set(applied(report)) == {"bn1", "bn2", "bn3"}
        assert isinstance(folded.bn1, nn.Identity) and type(folded).__name__ == "TutorialBNNet"


# -- layouts -------------------------------------------------------------------------------------------------

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
CONVT = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
SIZE = {1: (2, 4, 20), 2: (2, 4, 9, 10), 3: (2, 4, 5, 6, 7)}


def _x(dims, cin=4, dtype=torch.float32):
    shape = list(SIZE[dims])
    shape[1] = cin
    return torch.randn(*shape, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("groups,transposed", [(1, False), (2, False), (4, False), (1, True), (2, True)])
def test_backward_fold_layouts(dims, bias, groups, transposed, dtype):
    if transposed:
        layer = CONVT[dims](4, 6, 3, stride=2, padding=1, output_padding=1, groups=groups, bias=bias, dilation=1)
    else:  # groups=4 on 4 input channels is depthwise (x2 multiplier); strides and dilation vary the layout
        layer = CONV[dims](4, 8, 3, stride=2 if groups == 2 else 1, padding=1, dilation=2 if groups == 4 else 1,
                           groups=groups, bias=bias)
    model = randomize_bn(nn.Sequential(layer, BN[dims](layer.out_channels), nn.ReLU()), seed=dims).to(dtype)
    folded, report = checked_fold(model, _x(dims, dtype=dtype))
    assert folded[0].weight.dtype == dtype
    if transposed and not bias:  # a bias would put torch's CPU ConvTranspose on a 3-12x slower path
        assert applied(report)["1"].startswith("fold the scale into 0 (backward); the shift stays as a ChannelShift")
        assert isinstance(folded[1], ChannelShift) and folded[0].bias is None
    else:
        assert applied(report) == {"1": "fold into 0 (backward)"}
        assert isinstance(folded[1], nn.Identity) and folded[0].bias is not None


@pytest.mark.parametrize("affine", [True, False])
def test_linear_then_bn1d_and_affine_false(affine):
    model = randomize_bn(nn.Sequential(nn.Linear(5, 7, bias=affine), nn.BatchNorm1d(7, affine=affine)))
    folded, report = checked_fold(model, torch.randn(6, 5))
    assert applied(report) == {"1": "fold into 0 (backward)"}


def test_grouped_transposed_conv_where_torch_fails():
    """torch's own fuse_conv_bn_eval(transpose=True) refuses or mis-scales groups=2; the fold is exact."""
    model = randomize_bn(nn.Sequential(nn.ConvTranspose2d(4, 6, 3, groups=2), nn.BatchNorm2d(6)))
    x = torch.randn(2, 4, 5, 5)
    checked_fold(model, x)
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    try:
        fused = fuse_conv_bn_eval(model[0], model[1], transpose=True)
        torch_ok = torch.allclose(fused(x), model(x), atol=1e-4)
    except Exception:
        torch_ok = False
    assert not torch_ok


# -- forward folds -------------------------------------------------------------------------------------------


def test_forward_fold_into_linear():
    model = randomize_bn(nn.Sequential(nn.BatchNorm1d(6), nn.Linear(6, 3, bias=False)))
    folded, report = checked_fold(model, torch.randn(5, 6))
    assert applied(report) == {"0": "fold into 1 (forward)"}


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("padding_mode", ["zeros", "reflect"])
def test_forward_fold_into_conv(dims, groups, padding_mode):
    # padding 0 or a padding that copies input values (reflect) keeps the fold exact
    padding = 0 if padding_mode == "zeros" else 1
    conv = CONV[dims](4, 6, 3, stride=2, padding=padding, padding_mode=padding_mode, groups=groups)
    model = randomize_bn(nn.Sequential(nn.ReLU(), BN[dims](4), conv), seed=groups)
    folded, report = checked_fold(model, _x(dims))
    assert applied(report) == {"1": "fold into 2 (forward)"}


def test_backward_and_forward_into_one_linear():
    model = randomize_bn(nn.Sequential(nn.BatchNorm1d(6), nn.Linear(6, 5), nn.BatchNorm1d(5)))
    folded, report = checked_fold(model, torch.randn(4, 6))
    assert applied(report) == {"0": "fold into 1 (forward)", "2": "fold into 1 (backward)"}


# -- functional BN -------------------------------------------------------------------------------------------


class FunctionalBN(nn.Module):
    def __init__(self, stats_as_params: bool):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3)
        make = (lambda t: nn.Parameter(t, requires_grad=False)) if stats_as_params else None
        mean, var = torch.randn(5) * 2, torch.rand(5) * 3 + 0.1
        if make:
            self.mean, self.var = make(mean), make(var)
        else:
            self.register_buffer("mean", mean)
            self.register_buffer("var", var)
        self.w = nn.Parameter(torch.randn(5))
        self.b = nn.Parameter(torch.randn(5))

    def forward(self, x):
        return F.relu(F.batch_norm(self.conv(x), self.mean, self.var, self.w, self.b, False, 0.1, 1e-3))


@pytest.mark.parametrize("stats_as_params", [False, True])
def test_functional_batch_norm(stats_as_params):
    model = FunctionalBN(stats_as_params).eval()
    folded, report = checked_fold(model, torch.randn(2, 3, 8, 8))
    assert applied(report) == {"batch_norm": "fold into conv (backward)"}
    assert isinstance(folded, fx.GraphModule) and "mean" not in dict(folded.named_buffers())
    assert "mean" not in dict(folded.named_parameters())


def test_functional_batch_norm_with_batch_statistics_is_skipped():
    class Train(FunctionalBN):
        def forward(self, x):
            return F.batch_norm(self.conv(x), self.mean, self.var, self.w, self.b, True, 0.0, 1e-3)

    _, report = fold(Train(False).eval(), torch.randn(2, 3, 8, 8))
    assert "batch statistics" in skipped(report)["batch_norm"]


# -- dtypes --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_keeps_dtype(dtype):
    model = randomize_bn(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())).to(dtype)
    folded, report = fold(model, torch.randn(2, 3, 8, 8, dtype=dtype))
    assert report.passed and folded[0].weight.dtype == dtype and folded[0].bias.dtype == dtype
    assert isinstance(folded[1], nn.Identity)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_fold_past_the_half_range_leaves_that_bn(dtype):
    """A half model where one fold would write weights past half the dtype's max (1000 x a scale ~95 in float16; 1e36
    x 1e4 in bfloat16): that BN stays, with its reason, the others fold, and the result equals the original at two
    fresh shapes. Before, the fold wrote inf into the conv and the whole command failed its check."""
    big = 1000.0 if dtype == torch.float16 else 1e36
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4))
    model = randomize_bn(model).eval()
    with torch.no_grad():
        model[0].weight.fill_(big)
        model[0].bias.zero_()
        model[1].running_mean.zero_()
        model[1].running_var.fill_(1e-4 if dtype == torch.float16 else 1e-8)
        model[1].weight.fill_(1.0)
        model[3].weight.mul_(1e-2)  # outputs ~1: the half dtype's element-wise check holds there
    model = model.to(dtype)
    x = (torch.randn(2, 3, 8, 8) * (1e-3 if dtype == torch.float16 else 1e-37)).to(dtype)
    folded, report = fold(model, x)
    codes = {s.target: s.code for s in report.sites}
    assert codes["1"] == "past-half-range" and "past half of" in skipped(report)["1"]
    assert isinstance(folded[1], nn.BatchNorm2d) and isinstance(folded[4], nn.Identity)
    assert torch.isfinite(folded[0].weight).all() and report.passed
    for shape in ((1, 3, 9, 9), (3, 3, 6, 7)):
        y = torch.randn(shape).to(dtype) * (1e-3 if dtype == torch.float16 else 1e-37)
        with torch.no_grad():
            a, b = model(y).float(), folded(y).float()
        assert torch.isfinite(a).all() and (a - b).abs().max() <= 1e-2 * a.abs().max()


# -- guards: each leaves the model exact and says why ----------------------------------------------------------


class ConvUsedTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + y


class ConvCalledTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn1, self.bn2 = nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3), nn.BatchNorm2d(3)

    def forward(self, x):
        return self.bn1(self.conv(x)) + self.bn2(self.conv(x + 1))


class BNCalledTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2, self.bn = nn.Conv2d(3, 3, 1), nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)

    def forward(self, x):
        return self.bn(self.c1(x)) * self.bn(self.c2(x))


class TiedConvs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.bn = nn.Conv2d(3, 3, 1), nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.bn(self.a(x)) + self.b(x)


class LinearOnSequence(nn.Module):
    """Linear on (N, L, C) + BatchNorm1d(L): BN normalizes the sequence dim, not the linear's features."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(6, 6), nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.fc(x))


GUARDS = [
    (ConvUsedTwice(), (2, 3, 6, 6), "bn", "output is also used elsewhere"),
    (ConvCalledTwice(), (2, 3, 6, 6), "bn1", "conv is called at 2 places"),
    (BNCalledTwice(), (2, 3, 6, 6), "bn", "bn is called at 2 places"),
    (TiedConvs(), (2, 3, 6, 6), "bn", "shares its weight with b"),
    (LinearOnSequence(), (3, 4, 6), "bn", "writes features on the last dim"),
    (nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False)), (2, 3, 6, 6), "1",
     "track_running_stats=False"),
    (nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.BatchNorm2d(4)), (2, 3, 6, 6), "2",
     "relu sits between 0 and the BN"),
    (nn.Sequential(nn.ReLU(), nn.BatchNorm2d(3), nn.Conv2d(3, 4, 3, padding=1)), (2, 3, 6, 6), "1",
     "needs padding=0"),
    (nn.Sequential(nn.ReLU(), nn.BatchNorm2d(3), nn.ConvTranspose2d(3, 4, 3)), (2, 3, 6, 6), "1",
     "transposed conv"),
]


@pytest.mark.parametrize("model,shape,target,why", GUARDS, ids=[g[3].split()[-1] for g in GUARDS])
def test_guard(model, shape, target, why):
    model = randomize_bn(model)
    from normconv.graph.capture import capture
    from normconv.graph.detect import find_norms
    from normconv.passes.fold_batchnorm import plan
    from normconv.verify import Inputs

    x = torch.randn(*shape)
    # fold's own guard, in its plan (the command then runs fold-through too: the BN after a relu is folded through it,
    # tests/test_fold_through.py)
    cap = capture(model, Inputs((x,)))
    fold_plan = {s.target: s for s in plan(cap, find_norms(cap))}
    assert why in fold_plan[target].reason and not fold_plan[target].applied, fold_plan[target]
    folded, report = checked_fold(model, x)
    assert target not in {s.target for s in report.sites if s.pass_name == "fold" and s.applied}


def test_linear_on_sequence_is_what_torch_fuse_gets_wrong():
    from torch.fx.experimental.optimization import fuse

    model = randomize_bn(LinearOnSequence())
    x = torch.randn(3, 4, 6)
    try:
        err = float((fuse(model)(x) - model(x)).abs().max())
    except Exception:  # a torch that refuses the pattern is fine too: the claim is only that it is not exact
        err = float("inf")
    assert err > 1e-2
    folded, report = checked_fold(model, x)
    assert not applied(report)


def test_training_mode_is_an_error_unless_eval():
    model = randomize_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))).train()
    x = torch.randn(2, 3, 6, 6)
    with pytest.raises(NormconvError, match="training mode"):
        fold(model, x)
    folded, report = fold(model, x, eval_mode=True)
    assert applied(report) and model.training  # the caller's model is untouched
    assert torch.allclose(folded(x), model.eval()(x), atol=1e-5)


def test_plan_and_pass_agree():
    """inspect's plan and the pass's sites come from one analysis."""
    from normconv.graph.detect import find_norms
    from normconv.graph.capture import capture
    from normconv.verify import Inputs

    z = get("mlp")
    model = z.build().eval()
    cap = capture(model, Inputs(z.example_inputs()))
    planned = FOLD.plan(cap, find_norms(cap))
    _, report = fold(model, z.example_inputs())
    assert planned == report.sites


def test_module_registered_under_two_names_still_folds():
    class Aliased(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
            self.alias = self.conv  # same object, one call: not a tie

        def forward(self, x):
            return self.bn(self.conv(x))

    folded, report = checked_fold(randomize_bn(Aliased()), torch.randn(2, 3, 6, 6))
    assert applied(report) == {"bn": "fold into conv (backward)"}


# -- what verification costs, and that it still happens (issue 13) -------------------------------------------


def _chain(n: int = 4) -> nn.Module:
    return randomize_bn(nn.Sequential(*[nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
                                        for _ in range(n)]))


def _count_forwards(model: nn.Module) -> list[int]:
    """A hook on the first conv (copied into normconv's working copy and its traced graph): one call per forward."""
    calls = [0]
    model[0][0].register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_fold_runs_the_model_five_times():
    # the original at the example and a second shape, the traced graph once (its shapes, and the trust check against
    # the original's output already taken), the result at both shapes; was 7 (the trust check ran eager and graph again)
    model = _chain()
    calls = _count_forwards(model)
    folded, report = fold(model, torch.randn(2, 4, 6, 6))
    assert calls[0] == 5 and len(report.validation) == 2 and report.passed and bn_modules(folded) == 0


def test_the_command_line_reuses_the_load_check_forward(tmp_path):
    # io.load runs the model once to check its inputs: the rewrite compares against that output instead of a rerun
    from normconv.commands.fold import fold
    from normconv.io.load import load
    from normconv.verify import Inputs

    model = _chain()
    torch.save(model, tmp_path / "chain.pt")
    loaded = load(str(tmp_path / "chain.pt"), input_shapes=["input:2,4,6,6"])
    calls = _count_forwards(loaded.model)
    report, folded = fold(loaded)
    assert calls[0] == 4 and report.passed and bn_modules(folded) == 0  # the load's own forward came before the hook
    loaded.inputs = Inputs((torch.randn(2, 4, 6, 6),))  # other inputs: the load's output is not theirs
    fold(loaded)
    assert calls[0] == 4 + 5


def test_a_wrong_fold_is_still_caught(monkeypatch):
    # sabotage: the shift of every BN dropped. Verification runs on the original's outputs computed once, and must
    # still see it, at the example shape, and nothing is returned
    from normconv.errors import VerificationError
    from normconv.passes import fold_batchnorm

    real = fold_batchnorm.fold_backward
    monkeypatch.setattr(fold_batchnorm, "fold_backward", lambda layer, s, t: real(layer, s, torch.zeros_like(t)))
    with pytest.raises(VerificationError, match="fold: outputs differ beyond tolerance \\(torch: max abs error"):
        fold(_chain(), torch.randn(2, 4, 6, 6))


def test_the_trust_check_compares_the_graph_with_the_reference_it_is_given():
    # a reference the traced graph does not reproduce  =>  the trace is not trusted, torch.export captures instead
    from normconv.graph.capture import capture
    from normconv.verify import Inputs, run

    model, inputs = _chain(), Inputs((torch.randn(2, 4, 6, 6),))
    assert capture(model, inputs, reference=run(model, inputs)).method == "symbolic_trace"
    cap = capture(model, inputs, reference=run(model, inputs) + 1)
    assert cap.method == "torch.export" and "traced graph differs from eager" in cap.attempts["symbolic_trace"]


def test_a_layer_under_the_old_weight_norm_hook_is_left_with_its_reason():
    """torch.nn.utils.weight_norm (deprecated, still common in audio models) keeps the weight as a tensor computed
    from weight_g and weight_v by a hook before each forward: copying the model died on it (deepcopy refuses a
    non-leaf, a RuntimeError out of every command), and a fold into it would be undone by the hook. Now the copy
    shares it, the BN after it stays with the reason, the other folds, and the model is unchanged."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.manual_seed(0)
    model = randomize_bn(nn.Sequential(torch.nn.utils.weight_norm(nn.Conv2d(3, 8, 3)), nn.BatchNorm2d(8), nn.ReLU(),
                                       nn.Conv2d(8, 4, 1), nn.BatchNorm2d(4))).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    folded, report = fold(model, torch.randn(2, 3, 8, 8))
    assert "weight_norm" in skipped(report)["1"] and isinstance(folded[4], nn.Identity) and report.passed
    for shape in ((1, 3, 9, 9), (3, 3, 12, 7)):
        y = torch.randn(shape)
        with torch.no_grad():
            assert torch.allclose(model(y), folded(y), atol=1e-5, rtol=1e-5)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_layer_whose_weight_the_forward_also_reads_is_left():
    """bn(c1(x)) + F.conv2d(x, c1.weight): folding into c1 would change the functional conv too. Refused with the
    reason, as two modules sharing a weight are (it was folded, and only the final check caught it: exit 1)."""
    import torch.nn.functional as F

    class FuncW(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.bn = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

        def forward(self, x):
            return self.bn(self.c1(x)) + F.conv2d(x, self.c1.weight, None, padding=1)

    torch.manual_seed(1)
    model = randomize_bn(FuncW()).eval()
    folded, report = fold(model, torch.randn(2, 8, 5, 5))
    assert "also read by the forward" in skipped(report)["bn"] and report.passed
    y = torch.randn(1, 8, 7, 6)
    with torch.no_grad():
        assert torch.allclose(model(y), folded(y), atol=1e-5, rtol=1e-5)


def test_a_pruned_layer_is_left_with_its_reason_and_lazy_modules_are_refused_in_one_line():
    """torch.nn.utils.prune keeps the weight as weight_orig * weight_mask, recomputed by a hook before each forward:
    the fold gave the layer a weight Parameter, and the hook's next assignment died (a raw TypeError out of the API,
    exit 3 on the command line, or "the model rejected its example inputs" from swap --to affine). Any weight or bias
    that is no Parameter of its layer is such a case: the BN after it stays with the reason, the other folds, the
    model is unchanged. An uninitialized lazy module is refused in one line naming it (it was a raw ValueError)."""
    import torch.nn.utils.prune as prune

    torch.manual_seed(0)
    model = randomize_bn(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1),
                                       nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))).eval()
    prune.l1_unstructured(model[0], "weight", amount=0.3)
    prune.random_unstructured(model[6], "bias", amount=0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 8, 8)
    folded, report = fold(model, x)
    reasons = skipped(report)
    assert "prune" in reasons["1"] and "prune" in reasons["7"] and isinstance(folded[4], nn.Identity)
    assert {s.code for s in report.sites if not s.applied} == {"no-foldable-neighbour"} and report.passed
    swapped, swap_report = swap(model, x, to="affine")
    assert swap_report.passed
    for shape in ((1, 3, 9, 9), (3, 3, 12, 7)):
        y = torch.randn(shape)
        with torch.no_grad():
            assert torch.allclose(model(y), folded(y), atol=1e-5, rtol=1e-5)
            assert torch.allclose(model(y), swapped(y), atol=1e-5, rtol=1e-5)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    lazy = nn.Sequential(nn.LazyConv2d(4, 3, bias=False), nn.LazyBatchNorm2d()).eval()
    with pytest.raises(NormconvError, match=r"^0 \(LazyConv2d\) is an uninitialized lazy module"):
        fold(lazy, x)
    assert isinstance(lazy[0], nn.LazyConv2d)  # not initialized behind the user's back


class _Chain(nn.Module):  # conv -> BN -> BN -> BN -> relu -> 1x1 conv
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, bias=False)
        self.bn, self.bnb, self.bnc = nn.BatchNorm2d(4), nn.BatchNorm2d(4), nn.BatchNorm2d(4, affine=False)
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.head(torch.relu(self.bnc(self.bnb(self.bn(self.c(x))))))


def test_a_batchnorm_after_a_batchnorm_folds_with_it():
    """conv -> BN -> BN: the second BN was refused ('norm sits between c and the BN'), though it is one more
    per-channel affine on the conv's output. Its affine now joins the first BN's fold (a third one's too)."""
    model = randomize_bn(_Chain()).eval()
    new, report = checked_fold(model, torch.randn(1, 3, 16, 16))
    codes = {s.target: s.code for s in report.sites}
    assert codes == {"bn": "fold-backward", "bnb": "fold-backward-after-bn", "bnc": "fold-backward-after-bn"}, codes
    assert bn_modules(new) == 0
    for shape in ((1, 3, 16, 16), (3, 3, 21, 13)):  # fresh inputs at two shapes
        y = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(new(y), model(y), atol=1e-5, rtol=1e-4)


def test_a_batchnorm_after_one_that_keeps_its_shift_folds_with_it():
    """ConvTranspose without a bias -> BN -> BN: the first BN's scale goes into the weight and its shift stays as a
    ChannelShift (a bias-free ConvTranspose is kept so); the second BN's affine joins that fold, the shift kept
    being the product's, and no BatchNorm is left."""
    model = randomize_bn(nn.Sequential(nn.ConvTranspose1d(2, 3, 3, bias=False), nn.BatchNorm1d(3),
                                       nn.BatchNorm1d(3, affine=False))).eval()
    new, report = checked_fold(model, torch.randn(2, 2, 6))
    codes = {s.target: s.code for s in report.sites}
    assert codes == {"1": "fold-scale-keep-shift", "2": "fold-backward-after-bn"}, codes
    assert bn_modules(new) == 0
    for shape in ((2, 2, 6), (3, 2, 11)):
        y = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(new(y), model(y), atol=1e-5, rtol=1e-4)
