"""`normconv inspect`: tables for people, one JSON object for scripts, a plan per site for every pass."""

from __future__ import annotations

import json

import pytest

from normconv.models import ZOO

FACTORY = "tests.fixtures.user_models:small_net_with_inputs"
PASSES = {"fold", "fold-through", "convert-batchnorm", "recalibrate", "canonicalize", "swap", "deepnorm", "export"}


def _json(cli, *args):
    code, out, err = cli("inspect", *args, "--json")
    assert code == 0, err
    return json.loads(out)


def test_json_shape_and_plan(cli):
    report = _json(cli, FACTORY)
    assert report["command"] == "inspect" and report["extra"]["capture"] == "symbolic_trace"
    bn, ln = report["sites"]
    assert (bn["target"], bn["kind"], bn["source"], bn["placement"]) == ("bn", "batchnorm", "module", "after-conv")
    assert (ln["target"], ln["kind"], ln["eps"]) == ("ln", "layernorm", 1e-3)
    assert bn["running_stats"] == {"mean": "bn.running_mean", "var": "bn.running_var"}
    fold = next(p for p in bn["plan"] if p["pass"] == "fold")
    assert fold["applied"] and "conv" in fold["reason"]
    for site in report["sites"]:
        for p in site["plan"]:
            assert p["pass"] in PASSES and p["reason"], p  # every plan says why


def test_table_output_names_every_site(cli):
    code, out, _ = cli("inspect", FACTORY)
    assert code == 0
    assert "norm sites" in out and "plan" in out
    assert "fold into conv" in out and "already native (LayerNorm)" in out
    assert "\x1b[" not in out  # no colour codes when not on a terminal


def test_capture_method_can_be_forced(cli):
    assert _json(cli, FACTORY, "--capture", "torch.export")["extra"]["capture"] == "torch.export"
    code, _, err = cli("inspect", FACTORY, "--capture", "magic")
    assert code == 2 and "unknown --capture" in err


@pytest.mark.parametrize("name", list(ZOO))
def test_every_zoo_model_inspects(cli, name):
    report = _json(cli, f"zoo:{name}")
    assert len(report["sites"]) == sum(ZOO[name].norms.values())
    for site in report["sites"]:
        assert {"target", "kind", "source", "eps", "placement"} <= set(site)
        assert any(p["pass"] == "export" for p in site["plan"])


def test_post_ln_and_pre_ln_plans_differ(cli):
    bert = _json(cli, "zoo:bert")
    gpt = _json(cli, "zoo:gpt")

    def plan(report, pass_name):
        return {p["applied"] for s in report["sites"] for p in s["plan"] if p["pass"] == pass_name
                and s["placement"] in ("post-norm", "pre-norm")}

    assert plan(bert, "deepnorm") == {True} and plan(bert, "swap") == {False}
    assert plan(gpt, "deepnorm") == {False} and plan(gpt, "swap") == {True}


def test_zoo_command_lists_models(cli):
    code, out, _ = cli("zoo", "--json")
    assert code == 0 and set(json.loads(out)) == set(ZOO)


@pytest.mark.parametrize("capture", ["symbolic_trace", "torch.export"])
def test_norm_like_subgraphs_are_listed_with_why(cli, capture):
    """Close-but-not-equal hand-written norms are not sites (no exact rewrite exists) but inspect explains them."""
    report = _json(cli, "tests.fixtures.user_models:near_miss_net", "--capture", capture)
    assert [s["target"] for s in report["sites"]] == ["ln"]
    misses = {m["target"]: m for m in report["extra"]["near_misses"]}
    assert set(misses) == {"annotated", "unbiased", "eps_out", "factor"}
    assert "unbiased" in misses["annotated"]["reason"] and "outside the sqrt" in misses["annotated"]["reason"]
    assert "sqrt((n-1)/n) = 0.96825" in misses["unbiased"]["reason"]  # n = 16
    assert "after the sqrt" in misses["eps_out"]["reason"]
    assert "only the RMSNorm factor" in misses["factor"]["reason"] and "linear" in misses["factor"]["reason"]
    code, out, _ = cli("inspect", "tests.fixtures.user_models:near_miss_net")
    assert code == 0 and "norm-like but not a norm: 4 left as written" in out


def test_no_norm_like_noise_on_the_zoo(cli):
    for name in ZOO:
        assert _json(cli, f"zoo:{name}")["extra"]["near_misses"] == [], name


def test_a_module_called_at_several_places_is_one_row_with_its_count(cli):
    code, out, err = cli("inspect", "tests.fixtures.user_models:shared_post_ln", "-i", "x:2,5,8")
    assert code == 0, err
    rows = [line for line in out.splitlines() if line.startswith("| norm ") and "| layernorm |" in line]
    assert len(rows) == 1 and "norm (x3)" in rows[0] and "post-norm" in rows[0]
    plan = [line for line in out.splitlines() if line.startswith("| norm ") and "| deepnorm " in line]
    assert len(plan) == 1  # the plan of the three calls, once
    code, out, _ = cli("inspect", "tests.fixtures.user_models:shared_post_ln", "-i", "x:2,5,8", "--json")
    assert [(s["target"], s["calls"]) for s in json.loads(out)["sites"]] == [("norm", 3)] * 3  # JSON: per call


@pytest.mark.parametrize("capture", ["symbolic_trace", "torch.export"])
@pytest.mark.parametrize("spelling", ["normalize", "clamped_norm"])
def test_l2_normalization_is_a_near_miss_with_why(capture, spelling):
    # ZAYA's qk norm (x * s / ||x||.clamp_min(eps)) and F.normalize: L2 normalizations, listed apart, not sites
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import normconv
    from normconv.verify import Inputs

    class L2(nn.Module):
        def forward(self, x):
            if spelling == "normalize":
                return F.normalize(x, dim=-1)
            return x * (4.0 / x.norm(p=2, dim=-1, keepdim=True).clamp_min(1e-6))

    model = nn.Sequential(nn.Linear(8, 8), L2())
    report = normconv.inspect(model, Inputs((torch.randn(2, 3, 8),)), method=capture).to_json()
    assert report["sites"] == []
    misses = report["extra"]["near_misses"]
    assert len(misses) == 1 and misses[0]["target"] == "1" and "L2 normalization" in misses[0]["computes"]


def test_inputs_are_described_by_shape_inside_lists_and_dicts():
    """A detector takes a list of images: the header names their shapes, never prints their values."""
    import torch

    from normconv.verify import Inputs

    text = Inputs(([torch.rand(3, 64, 80), torch.rand(3, 32, 32)],), {"targets": {"boxes": torch.rand(5, 4)}}).describe()
    assert text == "[(3, 64, 80):float32, (3, 32, 32):float32], targets={'boxes': (5, 4):float32}"
    assert "tensor(" not in Inputs(([torch.rand(3, 8, 8)] * 9,), {}).describe()


@pytest.mark.parametrize("capture", ["symbolic_trace", "torch.export"])
@pytest.mark.parametrize("spelling", ["convnextv2", "timm"])
def test_global_response_norm_is_listed_with_why(capture, spelling):
    # ConvNeXt V2's GRN (its official channels-last code, and timm's GlobalResponseNorm on NCHW): named by inspect
    # with the reason no command rewrites it, never silently absent from the listing
    import torch
    import torch.nn as nn

    import normconv
    from normconv.verify import Inputs

    class GRN(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.weight, self.bias = nn.Parameter(torch.randn(c)), nn.Parameter(torch.randn(c))

        def forward(self, x):
            if spelling == "convnextv2":  # (N, H, W, C)
                g = torch.norm(x, p=2, dim=(1, 2), keepdim=True)
                n = g / (g.mean(dim=-1, keepdim=True) + 1e-6)
                return self.weight * (x * n) + self.bias + x
            g = x.norm(p=2, dim=(2, 3), keepdim=True)  # (N, C, H, W)
            n = g / (g.mean(dim=1, keepdim=True) + 1e-6)
            shape = (1, -1, 1, 1)
            return x + torch.addcmul(self.bias.view(shape), self.weight.view(shape), x * n)

    timm = spelling == "timm"
    model = nn.Sequential(nn.Conv2d(4, 4, 1) if timm else nn.Linear(4, 4), GRN(4), nn.LayerNorm(5 if timm else 4))
    x = torch.randn(2, 4, 5, 5) if timm else torch.randn(2, 5, 5, 4)
    report = normconv.inspect(model, Inputs((x,)), method=capture).to_json()
    assert [s["kind"] for s in report["sites"]] == ["layernorm"]
    misses = report["extra"]["near_misses"]
    assert [(m["target"], m["rule"]) for m in misses] == [("1", "grn")], misses
    assert "Global Response Normalization" in misses[0]["computes"] and "leave it as written" in misses[0]["reason"]


def test_an_l2_norm_divided_by_something_else_is_no_grn():
    # the grn rule asks for g / mean(g): an L2 norm divided by another tensor's mean is not one
    import torch
    import torch.nn as nn

    import normconv
    from normconv.verify import Inputs

    class NotGRN(nn.Module):
        def forward(self, x):
            g = x.norm(p=2, dim=(1, 2), keepdim=True)
            return x * g / (x.mean(dim=-1, keepdim=True) + 1e-6)

    report = normconv.inspect(nn.Sequential(nn.Linear(4, 4), NotGRN()), Inputs((torch.randn(2, 5, 5, 4),))).to_json()
    assert all(m["rule"] != "grn" for m in report["extra"]["near_misses"])
