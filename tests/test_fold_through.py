"""fold-through, the partial fold: a BatchNorm behind an activation or a pool (conv -> relu -> BN -> max pool, as in
CREPE) gets its scale folded backward and its shift forward, exactly, and every shift left behind says why."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import bn_styles as B
import normconv
from normconv.nn.modules import ChannelAffine
from normconv.passes.fold_through import ThroughWhy


def _through(report) -> dict[str, tuple[bool, str]]:
    return {s.target: (s.applied, s.code) for s in report.sites if s.pass_name == "fold-through"}


def _no_bn(model: nn.Module) -> bool:
    return not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


@pytest.fixture(scope="module")
def toy():
    return B.toy_pitch(256, seed=1)


@pytest.mark.parametrize("pad_mode", ["constant", "reflect"])
def test_trained_crepe_is_folded_through_relu_and_max_pool(pad_mode, toy):
    """A model with trained weights and running statistics: fold alone folds none of its BNs (a relu before each,
    a max pool after); fold-through folds every scale into its conv and every shift as far as it goes."""
    model = B.trained_crepe(pad_mode)
    x, y = toy
    assert all(bool((bn.weight > 0).all()) for bn in model.bns)  # so the max pool passes the rest
    new, report = normconv.fold(model, x[:8])
    assert report.passed and _no_bn(new)
    codes = _through(report)
    if pad_mode == "reflect":  # reflect padding copies the shift: it reaches the next conv, every BN is gone
        assert codes == {f"bns.{i}": (True, ThroughWhy.FOLDED) for i in range(3)}
        assert all(isinstance(m, nn.Identity) for m in new.bns)
    else:  # zero padding before the next conv keeps the shift (an add); the last one reaches the classifier
        assert codes == {"bns.0": (True, ThroughWhy.SHIFT_ZERO_PAD), "bns.1": (True, ThroughWhy.SHIFT_ZERO_PAD),
                         "bns.2": (True, ThroughWhy.FOLDED)}
        assert [type(m) for m in new.bns] == [ChannelAffine, ChannelAffine, nn.Identity]
        assert all(m.weight is None for m in new.bns[:2])  # a shift alone: the scale went into the conv
    with torch.no_grad():
        torch.testing.assert_close(new(x), model(x), atol=1e-5, rtol=1e-4)
    assert B.accuracy(new, x, y) == B.accuracy(model, x, y)


def test_negative_gamma_keeps_its_sign_and_max_pool_keeps_the_rest():
    model = B.randomize(B.Crepe()).eval()
    model.bns[0].weight.data[0] = -abs(model.bns[0].weight.data[0])
    x = torch.randn(4, 64)
    new, report = normconv.fold(model, x)
    assert report.passed and _through(report)["bns.0"] == (True, ThroughWhy.SHIFT_OP)
    assert "negative scale" in next(s.reason for s in report.sites if s.target == "bns.0")
    left = new.bns[0]
    assert isinstance(left, ChannelAffine) and set(left.weight.tolist()) <= {-1.0, 1.0} and left.weight[0] == -1
    torch.testing.assert_close(new(x), model(x), atol=1e-5, rtol=1e-4)


class _Block(nn.Module):
    def __init__(self, act, pool, pad_after=0, bias=True):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, bias=bias)
        self.act, self.pool = act, pool
        self.bn = nn.BatchNorm2d(6)
        self.next = nn.Conv2d(6, 4, 3, padding=pad_after)

    def forward(self, x):
        return self.next(self.pool(self.bn(self.act(self.conv(x)))))


@pytest.mark.parametrize("act, pool, pad, code", [
    (nn.ReLU(), nn.MaxPool2d(2), 0, ThroughWhy.FOLDED),
    (nn.LeakyReLU(0.2), nn.MaxPool2d(2, padding=1), 0, ThroughWhy.FOLDED),  # -inf padding passes a shift
    (nn.PReLU(6), nn.AvgPool2d(2), 0, ThroughWhy.FOLDED),
    (nn.ReLU(), nn.AvgPool2d(3, 1, padding=1), 0, ThroughWhy.SHIFT_OP),  # counted zero padding: not a shift
    (nn.ReLU(), nn.AvgPool2d(3, 1, padding=1, count_include_pad=False), 0, ThroughWhy.FOLDED),
    (nn.ReLU(), nn.Identity(), 1, ThroughWhy.SHIFT_ZERO_PAD),  # the next conv pads with zeros
    (nn.Identity(), nn.MaxPool2d(2), 0, ThroughWhy.FOLDED),  # pools only: scale and shift both fold back
    (nn.Identity(), nn.AvgPool2d(2), 1, ThroughWhy.FOLDED),
])
def test_ops_between(act, pool, pad, code):
    model = B.randomize(_Block(act, pool, pad)).eval()
    with torch.no_grad():
        model.bn.weight.abs_()
    x = torch.randn(2, 3, 12, 12)
    new, report = normconv.fold(model, x)
    assert report.passed and _through(report) == {"bn": (True, code)}, report.sites
    assert _no_bn(new)
    torch.testing.assert_close(new(x), model(x), atol=1e-5, rtol=1e-4)


def test_linear_relu_batchnorm1d_and_a_flatten_head():
    model = B.randomize(nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.BatchNorm1d(8), nn.Linear(8, 3))).eval()
    x = torch.randn(6, 5)
    new, report = normconv.fold(model, x)
    assert report.passed and _no_bn(new)
    torch.testing.assert_close(new(x), model(x), atol=1e-5, rtol=1e-4)
    vgg = B.randomize(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.BatchNorm2d(4), nn.MaxPool2d(2), nn.Flatten(),
                                    nn.Linear(4 * 3 * 3, 2))).eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        vgg[2].weight.abs_()
    new, report = normconv.fold(vgg, x)
    assert _through(report) == {"2": (True, ThroughWhy.FOLDED)} and report.passed
    torch.testing.assert_close(new(x), vgg(x), atol=1e-5, rtol=1e-4)


def test_what_stays_says_why():
    class Shared(nn.Module):  # the conv's output also feeds a skip: its scale cannot change
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)

        def forward(self, x):
            y = self.conv(x)
            return self.bn(F.relu(y)) + y

    model = B.randomize(Shared()).eval()
    new, report = normconv.fold(model, torch.randn(2, 3, 6, 6))
    site = next(s for s in report.sites if s.target == "bn")
    assert not site.applied and "fold-through" in site.reason and isinstance(new.bn, nn.BatchNorm2d)


def test_inspect_plans_the_partial_fold():
    model = B.randomize(B.Crepe(pad_mode="reflect")).eval()
    with torch.no_grad():
        for bn in model.bns:
            bn.weight.abs_()
    report = normconv.inspect(model, torch.randn(2, 64))
    plans = {s["target"]: {p["pass"]: p for p in s["plan"]} for s in report.sites}
    assert all(plans[f"bns.{i}"]["fold-through"]["applied"] for i in range(3))
    assert all(not plans[f"bns.{i}"]["fold"]["applied"] for i in range(3))


def test_fold_through_exports_without_batchnorm(tmp_path):
    model = B.trained_crepe("constant")
    new, _ = normconv.fold(model, torch.randn(2, 64))
    report = normconv.export(new, torch.randn(2, 64), tmp_path / "m.onnx", baseline=False, repeats=0)
    import onnx

    assert report.passed and "BatchNormalization" not in {n.op_type for n in onnx.load(str(tmp_path / "m.onnx"))
                                                          .graph.node}


class _ReluBN(nn.Module):  # conv -> relu -> BN -> max pool; conv (reflect) -> relu -> BN -> mean -> linear
    def __init__(self):
        super().__init__()
        self.c1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.bn2 = nn.Conv2d(8, 16, 3, padding=1, padding_mode="reflect"), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = F.max_pool2d(self.bn1(F.relu(self.c1(x))), 2)
        return self.fc(self.bn2(F.leaky_relu(self.c2(x), 0.1)).mean((2, 3)))


def test_export_folds_through_what_fold_folds_through(tmp_path):
    """export ran fold alone, not fold-through: the BNs fold removes stayed as BatchNormalization in the ONNX, with
    a reason ('no foldable neighbour') fold contradicts. export now runs fold's passes: the same sites, the same
    codes, and no BatchNormalization left."""
    import onnx
    import onnxruntime as ort

    torch.manual_seed(0)
    model = B.randomize(_ReluBN()).eval()
    with torch.no_grad():
        for bn in (model.bn1, model.bn2):
            bn.weight.abs_()  # positive scales pass the relu and the max pool
    x = torch.randn(1, 3, 32, 32)
    folded, fold_report = normconv.fold(model, x)
    assert _no_bn(folded)
    report = normconv.export(model, x, tmp_path / "m.onnx", baseline=False, repeats=0)
    assert report.passed
    assert _through(report) == _through(fold_report) == {"bn1": (True, ThroughWhy.FOLDED),
                                                          "bn2": (True, ThroughWhy.FOLDED)}
    plan = {s.target: s.code for s in report.sites if s.pass_name == "export"}
    assert plan == {"bn1": "folded", "bn2": "folded"}, plan
    ops = [n.op_type for n in onnx.load(str(tmp_path / "m.onnx")).graph.node]
    assert ops.count("BatchNormalization") == 0 and ops.count("Conv") == 2, ops
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    for shape in ((1, 3, 32, 32), (3, 3, 48, 40)):  # fresh inputs at two shapes
        y = torch.randn(shape)
        got = session.run(None, {session.get_inputs()[0].name: y.numpy()})[0]
        with torch.no_grad():
            torch.testing.assert_close(torch.from_numpy(got), model(y), atol=1e-5, rtol=1e-4)


class _Resampled(nn.Module):  # conv -> relu -> BN -> interpolate -> 1x1 conv
    def __init__(self, mode, align_corners):
        super().__init__()
        self.c0, self.bn, self.c2 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 1)
        self.mode, self.align = mode, align_corners

    def forward(self, x):
        return self.c2(F.interpolate(self.bn(torch.relu(self.c0(x))), scale_factor=2, mode=self.mode,
                                     align_corners=self.align))


@pytest.mark.parametrize("mode, align", [("bilinear", False), ("bilinear", True), ("nearest", None)])
def test_a_shift_passes_an_interpolation(mode, align):
    """The shift left behind the scale stayed in front of an interpolate ('does not pass a per-channel shift'),
    though each output of a bilinear / nearest interpolation is a combination of one channel's inputs with weights
    summing to one: it passes, into the 1x1 conv's bias, and the BN is gone."""
    torch.manual_seed(0)
    model = B.randomize(_Resampled(mode, align)).eval()
    with torch.no_grad():
        model.bn.weight.abs_()
    new, report = normconv.fold(model, torch.randn(1, 3, 8, 8))
    assert _through(report) == {"bn": (True, ThroughWhy.FOLDED)}, report.sites
    assert isinstance(new.bn, nn.Identity) and not any(isinstance(m, ChannelAffine) for m in new.modules())
    for shape in ((1, 3, 8, 8), (3, 3, 12, 10)):  # fresh inputs at two shapes
        y = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(new(y), model(y), atol=1e-5, rtol=1e-4)


def _mixed_sign(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random statistics, and gammas of both signs (every third one negative, the others positive)."""
    B.randomize(model, seed).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.abs_().add_(0.1)
                m.weight[::3] *= -1
                m.bias.mul_(5)  # a shift well above the conv's output: a wrong sign on it shows
    return model


@pytest.mark.parametrize("pool, onnx", [
    (nn.MaxPool2d(3, 2, 1), True), (nn.MaxPool2d(2), True), (nn.MaxPool2d(2, ceil_mode=True), True),
    (nn.AdaptiveMaxPool2d(1), True),
    (nn.AdaptiveMaxPool2d((5, 7)), False),  # torch.onnx exports a global adaptive max pool only
], ids=lambda p: repr(p).replace(" ", ""))
def test_negative_gamma_behind_a_max_pool_folds_exactly(pool, onnx, tmp_path):
    """conv -> max pool -> BN (gammas of both signs) -> conv. A max pool passes |s| and the shift back, never the
    sign: s y + t = sign(s) (|s| y + sign(s) t). The shift went back unsigned, so every negative channel came out
    with the wrong sign on its shift and verification refused the fold (exit 1). Now |s| and sign(s) t go into the
    conv before, the sign into the conv after, the BN is gone, fold and export equal the original at fresh shapes."""
    import onnxruntime as ort

    torch.manual_seed(0)
    model = _mixed_sign(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), pool, nn.BatchNorm2d(8),
                                      nn.Conv2d(8, 4, 3, padding=1)))
    assert bool((model[2].weight < 0).any()) and bool((model[2].weight > 0).any())
    x = torch.randn(1, 3, 32, 32)
    new, report = normconv.fold(model, x)
    assert report.passed and _through(report) == {"2": (True, ThroughWhy.FOLDED)}, report.sites
    assert _no_bn(new) and isinstance(new[2], nn.Identity)
    shapes = ((1, 3, 32, 32), (3, 3, 24, 40), (2, 3, 17, 29))  # fresh inputs, odd sizes too
    with torch.no_grad():
        for shape in shapes:
            y = torch.randn(shape)
            torch.testing.assert_close(new(y), model(y), atol=1e-5, rtol=1e-4)
    if not onnx:
        return
    exported = normconv.export(model, x, tmp_path / "m.onnx", baseline=False, repeats=0)
    assert exported.passed and _through(exported) == {"2": (True, ThroughWhy.FOLDED)}
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    for shape in shapes[:2]:
        y = torch.randn(shape)
        got = session.run(None, {session.get_inputs()[0].name: y.numpy()})[0]
        with torch.no_grad():
            torch.testing.assert_close(torch.from_numpy(got), model(y), atol=1e-5, rtol=1e-4)


class _PoolBNOut(nn.Module):  # conv -> F.max_pool -> BN (-> relu -> conv): the sign stays where nothing takes it
    def __init__(self, tail: bool):
        super().__init__()
        self.c1, self.bn = nn.Conv1d(3, 6, 3), nn.BatchNorm1d(6)
        self.tail = nn.Sequential(nn.ReLU(), nn.Conv1d(6, 2, 1)) if tail else nn.Identity()

    def forward(self, x):
        return self.tail(self.bn(F.max_pool1d(self.c1(x), 3, 2, 1)))


@pytest.mark.parametrize("tail, code", [(False, ThroughWhy.SHIFT_NO_LAYER), (True, ThroughWhy.SHIFT_OP)])
def test_negative_gamma_behind_a_max_pool_leaves_its_sign(tail, code):
    """The same through a functional max pool, where the sign cannot go forward (the model's output; a relu): the
    scale and the signed shift fold back, the BN becomes a per-channel sign (ChannelAffine, no add), exact."""
    torch.manual_seed(0)
    model = _mixed_sign(_PoolBNOut(tail))
    new, report = normconv.fold(model, torch.randn(2, 3, 20))
    assert report.passed and _through(report) == {"bn": (True, code)}, report.sites
    left = new.bn
    assert isinstance(left, ChannelAffine) and left.bias is None
    assert left.weight.tolist() == [-1.0 if i % 3 == 0 else 1.0 for i in range(6)]
    with torch.no_grad():
        for shape in ((2, 3, 20), (5, 3, 33)):
            y = torch.randn(shape)
            torch.testing.assert_close(new(y), model(y), atol=1e-5, rtol=1e-4)


class _SharedConvPool(nn.Module):  # conv (also read by a skip) -> BN -> pool -> 1x1 conv, as timm coatnet's pre_norm
    def __init__(self, pool):
        super().__init__()
        self.c0, self.bn, self.pool, self.c1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), pool, nn.Conv2d(8, 8, 1)

    def forward(self, x):
        y = self.c0(x)
        return self.c1(self.pool(self.bn(y))) + self.pool(y)


@pytest.mark.parametrize("pool, folded", [(nn.AvgPool2d(2, 2), True), (nn.AvgPool2d(3, 1, padding=1), False)])
def test_a_bn_whose_conv_is_shared_folds_forward_through_a_pool(pool, folded, tmp_path):
    """The conv before the BN also feeds a skip, so nothing folds backward; fold-through stopped there ('feeds the
    BN directly: fold's own rule') though fold's rule could not take it either, and never tried forward. A pool
    without counted padding is linear and passes scale and shift: now both go into the 1x1 conv after it, the BN is
    gone. Counted zero padding does not pass the shift: the BN stays, said."""
    import onnxruntime as ort

    torch.manual_seed(0)
    model = _mixed_sign(_SharedConvPool(pool))
    x = torch.randn(1, 3, 16, 16)
    new, report = normconv.fold(model, x)
    assert report.passed
    if not folded:
        assert isinstance(new.bn, nn.BatchNorm2d) and not any(s.applied for s in report.sites)
        return
    assert _through(report) == {"bn": (True, ThroughWhy.FOLDED)} and isinstance(new.bn, nn.Identity), report.sites
    shapes = ((1, 3, 16, 16), (3, 3, 22, 13))  # fresh inputs at two shapes
    with torch.no_grad():
        for shape in shapes:
            y = torch.randn(shape)
            torch.testing.assert_close(new(y), model(y), atol=1e-5, rtol=1e-4)
    assert normconv.export(model, x, tmp_path / "m.onnx", baseline=False, repeats=0).passed
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    for shape in shapes:
        y = torch.randn(shape)
        got = session.run(None, {session.get_inputs()[0].name: y.numpy()})[0]
        with torch.no_grad():
            torch.testing.assert_close(torch.from_numpy(got), model(y), atol=1e-5, rtol=1e-4)
