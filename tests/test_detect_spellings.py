"""Detection spellings (issue 12): a LayerNorm written with torch.var_mean is found and canonicalized; BiT-style
weight standardization (a norm applied to a conv's weight) is reported as such, not as an activation norm."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from normconv.api import canonicalize, fold, inspect
from normconv.verify import Inputs

METHODS = ["symbolic_trace", "torch.export"]


class VarMeanLN(nn.Module):
    def __init__(self, d, **kw):
        super().__init__()
        self.w, self.b, self.kw = nn.Parameter(torch.randn(d)), nn.Parameter(torch.randn(d)), kw

    def forward(self, x):
        var, mean = torch.var_mean(x, dim=-1, keepdim=True, **self.kw)
        return (x - mean) / torch.sqrt(var + 1e-6) * self.w + self.b


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kw", [{"unbiased": False}, {"correction": 0}])
def test_var_mean_layernorm_is_detected_and_canonicalized(kw, method):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), VarMeanLN(8, **kw)).eval()
    x = torch.randn(2, 3, 8)
    sites = inspect(model, Inputs((x,)), method=method).sites
    assert [(s["kind"], s["source"], s["eps"], s["affine"]["weight"], s["affine"]["bias"]) for s in sites] == \
        [("layernorm", "handwritten", 1e-6, "1.w", "1.b")]
    new, report = canonicalize(model, Inputs((x,)))
    assert report.passed and isinstance(new[1], nn.LayerNorm) and new[1].eps == 1e-6
    x2 = torch.randn(5, 7, 8)
    with torch.no_grad():
        assert torch.allclose(new(x2), model(x2), atol=1e-5)
        assert torch.allclose(new(x2), F.layer_norm(model[0](x2), (8,), model[1].w, model[1].b, 1e-6), atol=1e-5)


def test_unbiased_var_mean_is_not_a_layernorm():
    model = nn.Sequential(nn.Linear(8, 8), VarMeanLN(8))  # default correction=1: divides by n-1
    assert inspect(model, Inputs((torch.randn(2, 3, 8),))).sites == []


class StdConv(nn.Conv2d):
    """timm / BiT StdConv2d: F.batch_norm over the weight's fan-in, batch statistics of the weight itself."""

    def forward(self, x):
        w = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, training=True, momentum=0.,
                         eps=1e-6).reshape_as(self.weight)
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


class HandStdConv(nn.Conv2d):
    """Weight standardization written out: (w - mean) / sqrt(var + eps) over each filter."""

    def forward(self, x):
        w = self.weight
        m = w.mean(dim=(1, 2, 3), keepdim=True)
        v = ((w - m) ** 2).mean(dim=(1, 2, 3), keepdim=True)
        return F.conv2d(x, (w - m) / torch.sqrt(v + 1e-5), self.bias, self.stride, self.padding)


def bit_net():
    torch.manual_seed(0)
    net = nn.Sequential(StdConv(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
                        HandStdConv(8, 8, 3, padding=1), nn.BatchNorm2d(8)).eval()
    with torch.no_grad():
        net[4].running_mean.normal_()
        net[4].running_var.uniform_(0.5, 2)
    return net


@pytest.mark.parametrize("method", METHODS)
def test_weight_standardization_is_reported_as_such(method):
    net = bit_net()
    rep = inspect(net, Inputs((torch.randn(2, 3, 8, 8),)), method=method)
    # the activation norms are the GroupNorm and the BatchNorm2d module, nothing on the weights
    assert [(s["kind"], s["target"]) for s in rep.sites] == [("groupnorm", "1"), ("batchnorm", "4")]
    ws = rep.extra["weight_standardizations"]
    assert [(w["param"], w["consumer"], w["written_as"]) for w in ws] == \
        [("0.weight", "0", "functional batchnorm"), ("3.weight", "3", "handwritten layernorm")]
    assert all("weight standardization" in w["reason"] for w in ws)


@pytest.mark.parametrize("method", METHODS)
def test_fold_computes_weight_standardization_once(method):
    """The standardized weight is a constant at inference: fold makes each StdConv a plain nn.Conv2d holding it
    (bit for bit what the forward computed), then folds the activation BN into the conv as usual."""
    net = bit_net()
    x = torch.randn(2, 3, 8, 8)
    new, report = fold(net, Inputs((x,)), method=method)
    assert [(s.pass_name, s.target, s.applied) for s in report.sites] == [
        ("fold-weight-standardization", "0", True), ("fold-weight-standardization", "3", True), ("fold", "4", True)]
    assert type(new[0]) is nn.Conv2d and type(new[3]) is nn.Conv2d and isinstance(new[4], nn.Identity)
    assert new[0].bias is net[0].bias  # the bias is shared, the standardized weight is new
    with torch.no_grad():
        w = net[0].weight
        ref = F.batch_norm(w.reshape(1, 8, -1), None, None, training=True, momentum=0.0, eps=1e-6).reshape_as(w)
        assert torch.equal(new[0].weight, ref)
        x2 = torch.randn(1, 3, 6, 6)
        torch.testing.assert_close(new(x2), net(x2), atol=1e-5, rtol=1e-5)
    assert isinstance(net[0], StdConv)  # the user's model is untouched


def test_export_has_no_norm_on_weights(tmp_path):
    """Plain torch.onnx.export keeps BiT's weight standardization as BatchNormalization / ReduceMean on every
    weight; normconv's export computes the standardized weights once."""
    import onnx

    from normconv.api import export

    net = bit_net()
    path = tmp_path / "bit.onnx"
    export(net, Inputs((torch.randn(2, 3, 8, 8),)), str(path))
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("BatchNormalization") == 0 and ops.count("ReduceMean") == 0
    # the standard GroupNormalization (the default target, opset 23), the BN folded
    assert ops == ["Conv", "GroupNormalization", "Relu", "Conv"]
    export(net, Inputs((torch.randn(2, 3, 8, 8),)), str(path), target="ort", opset=20)  # below GroupNormalization-21
    assert [n.op_type for n in onnx.load(str(path)).graph.node] == ["Conv", "GroupNorm", "Relu", "Conv"]  # onnxruntime's


class HandRMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)


class CastingBlock(nn.Module):
    """Mamba's block: the caller casts the input to the norm's weight dtype before calling the norm."""

    def __init__(self, d):
        super().__init__()
        self.norm, self.proj = HandRMSNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.proj(self.norm(x.to(dtype=self.norm.weight.dtype)))


@pytest.mark.parametrize("method", METHODS)
def test_callers_cast_does_not_move_the_norm_to_the_caller(method):
    torch.manual_seed(0)
    net = nn.Sequential(CastingBlock(16), CastingBlock(16)).eval()
    inputs = Inputs((torch.randn(2, 5, 16),))
    rep = inspect(net, inputs, method=method)
    assert [(s["target"], s["owner"]) for s in rep.sites] == [("0.norm", "0.norm"), ("1.norm", "1.norm")]
    new, report = canonicalize(net, inputs)
    assert [s.target for s in report.sites if s.applied] == ["0.norm", "1.norm"]
    assert not isinstance(new[0].norm, HandRMSNorm)
    x = torch.randn(1, 3, 16)
    with torch.no_grad():
        torch.testing.assert_close(new(x), net(x), atol=1e-6, rtol=1e-6)


class FactorCastRMSNorm(nn.Module):
    """DeepSeek-V4's weight-free RMSNorm: the rsqrt factor, computed in float32, is cast back and multiplies the
    un-cast input (the cast sits between rsqrt and mul, not after the product)."""

    def forward(self, x):
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6).to(x.dtype)


@pytest.mark.parametrize("method", METHODS)
def test_rmsnorm_with_its_factor_cast_is_detected_and_canonicalized(method):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), FactorCastRMSNorm()).eval()
    x = torch.randn(2, 3, 8)
    sites = inspect(model, Inputs((x,)), method=method).sites
    assert [(s["kind"], s["source"], s["owner"], s["eps"], s["affine"]["weight"]) for s in sites] == \
        [("rmsnorm", "handwritten", "1", 1e-6, None)]
    new, report = canonicalize(model, Inputs((x,)))
    assert report.passed and isinstance(new[1], nn.RMSNorm) and new[1].weight is None
    x2 = torch.randn(5, 7, 8)
    with torch.no_grad():
        assert torch.allclose(new(x2), model(x2), atol=1e-6)


class FunctionalThenRootLayerNorm(nn.Module):
    """An F.layer_norm whose call node is named "layer_norm", and a root module also named layer_norm (DINOv3
    ConvNeXt): two sites, each called once."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.layer_norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.layer_norm(self.proj(F.layer_norm(x, (8,))))


@pytest.mark.parametrize("method", METHODS)
def test_a_functional_node_named_like_a_module_is_its_own_site(method):
    sites = inspect(FunctionalThenRootLayerNorm().eval(), Inputs((torch.randn(2, 8),)), method=method).sites
    assert sorted((s["source"], s["owner"], s["calls"]) for s in sites) == \
        [("functional", "", 1), ("module", "layer_norm", 1)]


class UpcastRMSNorm(nn.Module):
    """Llama's RMSNorm: statistics in float32, cast back to the input dtype inside the module."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x.to(dtype)


class CallerCastsTheResult(nn.Module):
    """Higgs Audio: the block casts the norm module's result (``.to(h.device)``) after calling it."""

    def __init__(self):
        super().__init__()
        self.proj, self.norm = nn.Linear(8, 8), UpcastRMSNorm(8)

    def forward(self, x):
        h = self.proj(x)
        return self.norm(h).to(h.dtype) + h


@pytest.mark.parametrize("method", METHODS)
def test_a_cast_the_caller_applies_to_the_result_stays_the_callers(method):
    model = nn.Sequential(CallerCastsTheResult()).eval()  # the caller a submodule: "0" calls "0.norm"
    sites = inspect(model, Inputs((torch.randn(2, 3, 8),)), method=method).sites
    assert [(s["target"], s["owner"], s["module_type"]) for s in sites] == [("0.norm", "0.norm", "UpcastRMSNorm")]


class CastBackRMSNorm(nn.Module):
    """Inkling2's RMSNorm: float32 statistics, and the result cast back to the input dtype as the module's last op."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (self.weight * h).to(dtype)


class NormOfANormedEmbedding(nn.Module):
    """Inkling2: the embedding is normed, and layer 0's input norm reads that result, casting it first."""

    def __init__(self):
        super().__init__()
        self.embed, self.embed_norm = nn.Embedding(10, 8), CastBackRMSNorm(8)
        self.norm, self.proj = CastBackRMSNorm(8), nn.Linear(8, 8)

    def forward(self, ids):
        h = self.embed_norm(self.embed(ids))
        return h + self.proj(self.norm(h))


@pytest.mark.parametrize("method", METHODS)
def test_a_norm_reading_another_norms_cast_back_is_its_own_site(method):
    # the cast ending embed_norm belongs to embed_norm: claimed by both sites, the later one was dropped
    torch.manual_seed(0)
    model = NormOfANormedEmbedding().eval()
    inputs = Inputs((torch.randint(0, 10, (2, 5)),))
    sites = inspect(model, inputs, method=method).sites
    assert [(s["target"], s["module_type"], s["calls"]) for s in sites] == \
        [("embed_norm", "CastBackRMSNorm", 1), ("norm", "CastBackRMSNorm", 1)]
    new, report = canonicalize(model, inputs)
    assert [s.target for s in report.sites if s.applied] == ["embed_norm", "norm"]
    ids = torch.randint(0, 10, (3, 7))
    with torch.no_grad():
        torch.testing.assert_close(new(ids), model(ids), atol=1e-6, rtol=1e-6)


class PowRMSNorm(nn.Module):
    """MuseSpark's RMSNorm: the factor written torch.pow(ms + eps, -0.5), the result cast back with type_as(x)."""

    def __init__(self, d, with_scale=True):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d)) if with_scale else None

    def forward(self, hidden_states):
        h = hidden_states.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.type_as(hidden_states)


class CastingLinear(nn.Linear):
    """A reader that casts its input first: that cast follows the norm's type_as but is the reader's."""

    def forward(self, x):
        return super().forward(x.to(torch.float32))


class PowNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.embed_norm = nn.Embedding(10, 8), PowRMSNorm(8, with_scale=False)
        self.proj, self.norm = CastingLinear(8, 8), PowRMSNorm(8)

    def forward(self, ids):
        return self.norm(self.proj(self.embed_norm(self.embed(ids))))


@pytest.mark.parametrize("method", METHODS)
def test_pow_minus_half_rmsnorm_with_type_as_is_a_module_site(method):
    torch.manual_seed(0)
    model = PowNormNet().eval()
    inputs = Inputs((torch.randint(0, 10, (2, 5)),))
    sites = inspect(model, inputs, method=method).sites
    assert [(s["target"], s["kind"], s["module_type"], s["eps"]) for s in sites] == \
        [("embed_norm", "rmsnorm", "PowRMSNorm", 1e-6), ("norm", "rmsnorm", "PowRMSNorm", 1e-6)]
    new, report = canonicalize(model, inputs)
    assert [s.target for s in report.sites if s.applied] == ["embed_norm", "norm"]
    ids = torch.randint(0, 10, (3, 7))
    with torch.no_grad():
        torch.testing.assert_close(new(ids), model(ids), atol=1e-6, rtol=1e-6)


class SharedQKNorm(nn.Module):
    """MuseGlimmer: one weight-free hand-written norm module applied to q and to k (two calls of one module)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.qk_norm = nn.Linear(8, 8), nn.Linear(8, 8), PowRMSNorm(8, with_scale=False)

    def forward(self, x):
        return self.qk_norm(self.q(x)) * 2 + self.qk_norm(self.k(x))


@pytest.mark.parametrize("method", METHODS)
def test_a_handwritten_norm_module_called_twice_is_one_module_site(method):
    # each call's nodes made the module look like it computed more than the norm: 2 inline sites, not replaced
    torch.manual_seed(0)
    model = SharedQKNorm().eval()
    inputs = Inputs((torch.randn(2, 5, 8),))
    sites = inspect(model, inputs, method=method).sites
    assert [(s["target"], s["module_type"], s["calls"]) for s in sites] == [("qk_norm", "PowRMSNorm", 2)] * 2
    new, report = canonicalize(model, inputs)
    assert isinstance(new.qk_norm, nn.RMSNorm)
    x = torch.randn(3, 7, 8)
    with torch.no_grad():
        torch.testing.assert_close(new(x), model(x), atol=1e-6, rtol=1e-6)


class ScaleFirstRMS(nn.Module):
    """The scale applied before the factor: (w * x) * rsqrt(ms + eps), a common spelling of RMSNorm."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class ScaleFirstLN(nn.Module):
    """w * (x - mean) / sqrt(var + eps) + b: the scale on the centered input, then the division."""

    def __init__(self, d):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.rand(d) + 0.5), nn.Parameter(torch.randn(d))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return self.weight * (x - mean) / torch.sqrt(var + 1e-5) + self.bias


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("cls,kind,native,eps", [(ScaleFirstRMS, "rmsnorm", nn.RMSNorm, 1e-6),
                                                 (ScaleFirstLN, "layernorm", nn.LayerNorm, 1e-5)])
def test_a_scale_applied_before_the_factor_is_the_norms_weight(cls, kind, native, eps, method):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), cls(8)).eval()
    x = torch.randn(2, 3, 8)
    sites = inspect(model, Inputs((x,)), method=method).sites
    assert [(s["target"], s["kind"], s["eps"], s["affine"]["weight"]) for s in sites] == [("1", kind, eps, "1.weight")]
    new, report = canonicalize(model, Inputs((x,)))
    assert report.passed and isinstance(new[1], native) and torch.equal(new[1].weight, model[1].weight)
    x2 = torch.randn(5, 7, 8)
    with torch.no_grad():
        assert torch.allclose(new(x2), model(x2), atol=1e-5)
