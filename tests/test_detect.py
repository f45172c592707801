"""Norm detection: count, kind, source, eps and placement on every zoo model, tiny HF models and odd layouts."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from normconv.graph.detect import find_norms
from normconv.graph.capture import capture
from normconv.models import ZOO
from normconv.verify import Inputs
from tests.hf_tiny import TINY


def _sites(model, inputs, method="auto"):
    cap = capture(model, inputs, method)
    return cap, find_norms(cap)


def _kinds(sites):
    counts: dict[str, int] = {}
    for s in sites:
        counts[s.kind] = counts.get(s.kind, 0) + 1
    return counts


# -- every zoo model: the sites its author declared, both capture methods agree ------------------------------


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_sites_match_declared(name):
    z = ZOO[name]
    inputs = Inputs(tuple(z.example_inputs()))
    model = z.build()
    cap, sites = _sites(model, inputs)
    assert _kinds(sites) == dict(z.norms), [(s.target, s.kind, s.source) for s in sites]
    assert sum(s.source == "handwritten" for s in sites) == z.handwritten
    modules = dict(model.named_modules())
    for s in sites:
        assert s.eps is not None and 0 < s.eps < 1e-1, (s.target, s.eps)
        if s.source == "module":  # a native module's eps is read from the module itself
            assert s.eps == pytest.approx(modules[s.target].eps), s.target


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_both_capture_methods_agree(name):
    z = ZOO[name]
    inputs = Inputs(tuple(z.example_inputs()))
    model = z.build()
    _, traced = _sites(model, inputs, "symbolic_trace")
    _, exported = _sites(model, inputs, "torch.export")
    key = lambda s: (s.kind, s.source, round(s.eps, 12), s.weight, s.bias, s.placement)  # noqa: E731
    assert sorted(map(key, traced)) == sorted(map(key, exported))


# -- tiny Hugging Face models (torch.export) -----------------------------------------------------------------

HF_EXPECTED = {
    # name: (count, kind, source, eps, placements)
    "bert": (5, "layernorm", "module", 1e-12, {"after-embedding": 1, "post-norm": 4}),
    "gpt2": (5, "layernorm", "module", 1e-5, {"pre-norm": 4, "final-norm": 1}),
    "llama": (5, "rmsnorm", "handwritten", 1e-6, {"pre-norm": 4, "final-norm": 1}),
    "t5": (12, "rmsnorm", "handwritten", 1e-6, {"pre-norm": 10, "final-norm": 2}),
    "gemma": (5, "rmsnorm", "handwritten", 1e-6, {"pre-norm": 4, "final-norm": 1}),
}


@pytest.mark.parametrize("name", list(HF_EXPECTED))
def test_hf_models(name):
    model, inputs = TINY[name]()
    cap, sites = _sites(model, inputs)
    count, kind, source, eps, placements = HF_EXPECTED[name]
    assert cap.method == "torch.export"
    assert len(sites) == count
    assert {s.kind for s in sites} == {kind} and {s.source for s in sites} == {source}
    assert all(s.eps == pytest.approx(eps) for s in sites)
    got: dict[str, int] = {}
    for s in sites:
        got[s.placement] = got.get(s.placement, 0) + 1
    assert got == placements
    # every site names a real module of the model, with its weight
    modules = dict(model.named_modules())
    assert all(s.target in modules and s.weight == f"{s.target}.weight" for s in sites)
    if name == "gemma":
        assert all(s.weight_offset == 1.0 for s in sites)  # (1 + w)
    if name in ("llama", "t5", "gemma"):
        assert all(s.upcast for s in sites)  # statistics in float32


def test_deberta_v3_layernorm_of_a_parameter_is_a_site():
    """DeBERTa-v3 runs 6 LayerNorms: the relative embeddings' one normalizes a parameter that no layer takes as its
    weight, so it is a norm site placed on-parameter (not a weight standardization, which BiT's StdConv is)."""
    from normconv.graph.detect import find_weight_standardizations
    from tests.hf_tiny import tiny_deberta_v3

    model, inputs = tiny_deberta_v3()
    cap, sites = _sites(model, inputs)
    assert sum(isinstance(m, nn.LayerNorm) for m in model.modules()) == 6
    assert len(sites) == 6 and {s.kind for s in sites} == {"layernorm"}
    placed = {s.target: s.placement for s in sites}
    assert placed["encoder.LayerNorm"] == "on-parameter"
    assert placed["embeddings.LayerNorm"] == "after-embedding"
    assert sum(p == "post-norm" for p in placed.values()) == 4
    assert find_weight_standardizations(cap) == []


def test_cli_inspect_on_saved_hf_folders(cli, hf_folders):
    for name, folder in hf_folders.items():
        code, out, err = cli("inspect", folder, "--json")
        assert code == 0, err
        assert "Loading weights" not in err and "it/s" not in err  # no transformers progress bar in our output
        report = json.loads(out)
        assert len(report["sites"]) == HF_EXPECTED[name][0]
        for s in report["sites"]:
            assert {"target", "kind", "source", "eps", "placement", "plan"} <= set(s)
            assert {p["pass"] for p in s["plan"]} >= {"export"}


# -- hand-written forms recognized by what they compute ------------------------------------------------------


class _Forms(nn.Module):
    """One of each hand-written spelling, plus things that look close but are not norms."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.rand(8) + 0.5)
        self.b = nn.Parameter(torch.randn(8))
        self.cw = nn.Parameter(torch.rand(4) + 0.5)
        self.cb = nn.Parameter(torch.randn(4))

    def forward(self, x, img):
        # layernorm: squared deviations via (x - m) ** 2, divide by sqrt
        m = x.mean(-1, keepdim=True)
        a = (x - m) / torch.sqrt(((x - m) ** 2).mean(-1, keepdim=True) + 1e-5) * self.w + self.b
        # rmsnorm: x * x instead of pow
        r = a * torch.rsqrt((a * a).mean(-1, keepdim=True) + 1e-6)
        # channels-first layernorm (ConvNeXt): dims (1,) on NCHW, weight broadcast with [:, None, None]
        u = img.mean(1, keepdim=True)
        s = (img - u).pow(2).mean(1, keepdim=True)
        c = self.cw[:, None, None] * ((img - u) / torch.sqrt(s + 1e-6)) + self.cb[:, None, None]
        # instance norm written by hand: spatial dims of NCHW
        mu = img.mean((2, 3), keepdim=True)
        v = img.var((2, 3), keepdim=True, unbiased=False)
        i = (img - mu) * torch.rsqrt(v + 1e-3)
        # not norms: unbiased variance, a plain sqrt of a sum
        nope = (x - m) / torch.sqrt(x.var(-1, keepdim=True) + 1e-5)
        other = torch.sqrt(x.abs().sum(-1, keepdim=True))
        return r, c, i, nope, other


@pytest.mark.parametrize("method", ["symbolic_trace", "torch.export"])
def test_handwritten_spellings(method):
    inputs = Inputs((torch.randn(2, 3, 8), torch.randn(2, 4, 5, 5)))
    _, sites = _sites(_Forms().eval(), inputs, method)
    got = sorted((s.kind, s.eps, s.weight, s.bias) for s in sites)
    assert got == sorted([
        ("layernorm", 1e-5, "w", "b"),
        ("rmsnorm", 1e-6, None, None),
        ("layernorm", 1e-6, "cw", "cb"),
        ("instancenorm", 1e-3, None, None),
    ])
    channels_first = next(s for s in sites if s.weight == "cw")
    assert channels_first.dims == (-3,) and channels_first.notes


def test_functional_and_module_called_twice():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(8)
            self.register_buffer("rm", torch.zeros(3))
            self.register_buffer("rv", torch.ones(3))

        def forward(self, x, y):
            z = F.batch_norm(y, self.rm, self.rv, None, None, False, 0.1, 1e-3)
            return self.ln(self.ln(x)), F.group_norm(z, 1, eps=1e-4)

    _, sites = _sites(M().eval(), Inputs((torch.randn(2, 8), torch.randn(2, 3, 4))))
    by_kind = {s.kind: s for s in sites}
    assert [s.calls for s in sites if s.target == "ln"] == [2, 2]
    assert by_kind["batchnorm"].source == "functional" and by_kind["batchnorm"].running_mean == "rm"
    assert by_kind["batchnorm"].eps == 1e-3 and by_kind["groupnorm"].eps == 1e-4


def test_subclass_with_own_forward_is_not_native():
    class FP32LayerNorm(nn.LayerNorm):  # CLIP-style: computes in fp32, returns the input dtype
        def forward(self, x):
            return F.layer_norm(x.float(), self.normalized_shape, self.weight, self.bias, self.eps).type_as(x)

    _, sites = _sites(FP32LayerNorm(8).eval(), Inputs((torch.randn(2, 8),)))
    assert len(sites) == 1 and sites[0].source == "functional"


def test_rmsnorm_default_eps_is_dtype_epsilon():
    _, sites = _sites(nn.Sequential(nn.RMSNorm(8)).eval(), Inputs((torch.randn(2, 8),)))
    assert sites[0].eps == torch.finfo(torch.float32).eps


def test_every_native_module_kind():
    class AllKinds(nn.Module):
        def __init__(self):
            super().__init__()
            self.sync = nn.SyncBatchNorm(3, eps=1e-3)
            self.in1 = nn.InstanceNorm1d(3, affine=True, eps=1e-4)
            self.bn3 = nn.BatchNorm3d(3, eps=2e-5)
            self.in3 = nn.InstanceNorm3d(3, eps=3e-5)
            self.gn = nn.GroupNorm(1, 3, eps=4e-5)

        def forward(self, x, v):
            return self.in1(self.sync(x)), self.gn(self.in3(self.bn3(v)))

    _, sites = _sites(AllKinds().eval(), Inputs((torch.randn(2, 3, 5), torch.randn(2, 3, 2, 3, 3))))
    got = [(s.target, s.kind, s.module_type, s.eps) for s in sites]
    assert got == [("sync", "batchnorm", "SyncBatchNorm", 1e-3), ("in1", "instancenorm", "InstanceNorm1d", 1e-4),
                   ("bn3", "batchnorm", "BatchNorm3d", 2e-5), ("in3", "instancenorm", "InstanceNorm3d", 3e-5),
                   ("gn", "groupnorm", "GroupNorm", 4e-5)]
