"""The passes' house rules: every decision carries a code of its own pass's ``Why``; a refusal of the whole model is a
``Code.REFUSED`` error naming the pass (its text unchanged); no pass imports another; the residual-stream analysis
(normconv/graph/residual) is the one the passes share, its axis tracking a table."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import normconv
from normconv.errors import Code, NormconvError
from normconv.models import ZOO, get
from normconv.passes.deepnorm import DeepNormWhy
from normconv.passes.fold_batchnorm import FoldWhy
from normconv.passes.fold_scales import FoldScalesWhy
from normconv.passes.fold_through import ThroughWhy
from normconv.passes.convert_batchnorm import ConvertWhy
from normconv.passes.recalibrate import RecalibrateWhy
from normconv.passes.fold_weight_standardization import FoldWSWhy
from normconv.passes.lift_layers import LiftWhy
from normconv.passes.rotate import RotateWhy
from normconv.passes.swap_norm import SwapWhy

ROOT = pathlib.Path(__file__).resolve().parent.parent
WHY = {"fold": FoldWhy, "swap": SwapWhy, "deepnorm": DeepNormWhy, "fold-scales": FoldScalesWhy, "rotate": RotateWhy,
       "fold-weight-standardization": FoldWSWhy, "lift": LiftWhy, "fold-through": ThroughWhy,
       "convert-batchnorm": ConvertWhy, "recalibrate": RecalibrateWhy}


def _codes_of_their_pass(sites) -> list:
    """The sites of the passes above, each checked to carry a member of its pass's Why."""
    ours = [s for s in sites if (s["pass"] if isinstance(s, dict) else s.pass_name) in WHY]
    for s in ours:
        name, code = (s["pass"], s["code"]) if isinstance(s, dict) else (s.pass_name, s.code)
        assert code and str(code) in {m.value for m in WHY[name]}, f"{name} site without its code: {s}"
    return ours


@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_inspected_site_carries_its_pass_code(name):
    z = ZOO[name]
    report = normconv.inspect(z.build().eval(), z.example_inputs())
    planned = _codes_of_their_pass([p for s in report.sites for p in s["plan"]])
    assert {p["pass"] for p in planned} >= {"deepnorm"} and len(planned) >= len(report.sites)


@pytest.mark.parametrize("name, command, expected", [
    ("resnet", "fold", {FoldWhy.BACKWARD}),
    ("llama", "rotate", {RotateWhy.ROTATED, FoldScalesWhy.FOLDED}),
    ("gpt", "rotate", {SwapWhy.EXACT_RMSNORM, FoldScalesWhy.FOLDED, RotateWhy.ROTATED}),
    ("gpt", "swap", {SwapWhy.EXACT_RMSNORM}),
    ("bert", "deepnorm", {DeepNormWhy.APPLIED}),
])
def test_every_applied_site_carries_its_pass_code(name, command, expected):
    z = get(name)
    _, report = getattr(normconv, command)(z.build().eval(), z.example_inputs())
    ours = _codes_of_their_pass(report.sites)
    assert {s.code for s in ours if s.applied} == expected


def test_swap_codes_say_why_each_site_was_refused_or_approximated():
    z = get("bert")  # post-LN: every LayerNorm after a sublayer is refused as such, and approximated when asked
    sites = normconv.inspect(z.build().eval(), z.example_inputs()).sites
    swap = [p for s in sites for p in s["plan"] if p["pass"] == "swap"]
    assert {p["code"] for p in swap if not p["applied"]} >= {SwapWhy.POST_LN.value}
    _, report = normconv.swap(z.build().eval(), z.example_inputs(), approximate=True)
    # the embedding LayerNorm reads centered embedding tables: exact, its bias kept as an add after the RMSNorm
    assert {s.code for s in report.sites if s.pass_name == "swap"} == {SwapWhy.APPROXIMATE, SwapWhy.BIAS_KEPT}


def test_fold_scales_and_weight_standardization_codes():
    z = get("llama")
    _, report = normconv.swap(z.build().eval(), z.example_inputs(), fold_scales=True)
    assert {s.code for s in _codes_of_their_pass(report.sites) if s.pass_name == "fold-scales"} == {FoldScalesWhy.FOLDED}

    class StdConv(nn.Conv2d):
        def forward(self, x):
            w = self.weight
            w = (w - w.mean((1, 2, 3), keepdim=True)) / torch.sqrt(w.var((1, 2, 3), keepdim=True, unbiased=False) + 1e-6)
            return F.conv2d(x, w, self.bias, self.stride, self.padding)

    net = nn.Sequential(StdConv(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()).eval()
    _, report = normconv.fold(net, torch.randn(2, 3, 8, 8))
    ours = _codes_of_their_pass(report.sites)
    assert {(s.pass_name, s.code) for s in ours} == {("fold-weight-standardization", FoldWSWhy.FOLDED),
                                                       ("fold", FoldWhy.BACKWARD)}


def test_lifted_layers_carry_their_code():
    z = get("resnet")
    model, inputs = z.build().eval(), z.example_inputs()
    program = torch.export.export(model, inputs, strict=False).module()
    _, report = normconv.fold(program, inputs, eval_mode=True)
    lifted = [s for s in _codes_of_their_pass(report.sites) if s.pass_name == "lift"]
    assert lifted and {s.code for s in lifted} == {LiftWhy.LIFTED}


def test_fold_guard_codes_name_the_rule():
    """_Skip(code, message): a BatchNorm in training mode, one after an activation, one with nothing around it."""
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.BatchNorm2d(8), nn.Flatten(), nn.BatchNorm1d(8 * 36))
    net.eval()
    _, report = normconv.fold(net, torch.randn(2, 3, 8, 8))
    codes = {s.target: s.code for s in report.sites}
    # the BN after the relu is folded through it (fold-through); the one after flatten has nothing to fold into
    assert codes == {"2": ThroughWhy.FOLDED, "4": FoldWhy.NO_NEIGHBOUR}
    net[2].train()
    from normconv.graph.capture import capture
    from normconv.graph.detect import find_norms
    from normconv.passes.fold_batchnorm import plan

    cap = capture(net, normconv.Inputs((torch.randn(2, 3, 8, 8),)))
    assert {s.target: s.code for s in plan(cap, find_norms(cap))}["2"] == FoldWhy.TRAINING


def test_a_refused_model_is_a_refused_error_naming_its_pass_with_the_same_words():
    z = get("bert")  # post-LN: the exact swap refuses; rotate refuses through it
    with pytest.raises(NormconvError) as info:
        normconv.swap(z.build().eval(), z.example_inputs())
    exc = info.value
    assert exc.code == Code.REFUSED and exc.pass_name == "swap"
    assert exc.message.startswith("swap: 4 of 5 layernorm sites cannot be swapped exactly; ")  # not the embedding's
    assert exc.hint.startswith("Pass --partial to swap only the exact sites, or --approximate")
    assert str(exc) == f"{exc.message}. {exc.hint}"
    z = get("gpt")  # pre-LN: deepnorm refuses the model as a whole
    with pytest.raises(NormconvError) as info:
        normconv.deepnorm(z.build().eval(), z.example_inputs())
    assert info.value.code == Code.REFUSED and info.value.pass_name == "deepnorm"
    assert str(info.value).startswith("pre-LN model (")


def _imports_of(path: pathlib.Path) -> set[str]:
    """Modules a file imports (relative ones resolved within normconv.passes), at any depth (lazy imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = "normconv.passes" if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)  # from normconv.passes import swap_norm
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_no_pass_imports_another_pass():
    passes = {p.stem for p in (ROOT / "passes").glob("*.py")} - {"__init__", "base"}
    wrong = [f"{path.name} imports {m}" for path in (ROOT / "passes").glob("*.py")
             for m in _imports_of(path) if m.startswith("normconv.passes.")
             and m.split(".")[2] in passes - {path.stem}]
    assert not wrong, "\n".join(wrong)


def test_residual_modules_and_their_passes_are_small():
    """(That graph imports no pass is tests/test_layout.py's rule.)"""
    for path in sorted((ROOT / "normconv" / "graph" / "residual").glob("*.py")) + [
            ROOT / "passes" / f"{n}.py" for n in ("swap_norm", "rotate", "fold_scales", "deepnorm")]:
        assert len(path.read_text().splitlines()) <= 600, path


def test_the_hidden_axis_table_moves_the_axis_as_the_op_does():
    """One row per op family: transpose, permute, view, expand, select; a reshape that splits the hidden axis is
    not followed."""
    from normconv.graph.capture import capture
    from normconv.graph.residual import back

    class Net(nn.Module):
        def forward(self, x):  # (2, 3, 8)
            t = x.transpose(1, 2)  # (2, 8, 3)
            p = t.permute(2, 0, 1)  # (3, 2, 8)
            v = p.reshape(6, 8)  # (6, 8)
            e = v.unsqueeze(0).expand(4, 6, 8)  # (4, 6, 8)
            s = e.select(0, 1)  # (6, 8)
            return s.reshape(6, 2, 4)  # splits the 8

    cap = capture(Net(), normconv.Inputs((torch.randn(2, 3, 8),)), "symbolic_trace")
    n = {node.name: node for node in cap.gm.graph.nodes}
    assert back(cap, n["transpose"], 1) == 2 and back(cap, n["transpose"], 2) == 1
    assert back(cap, n["permute"], 2) == 1
    assert back(cap, n["reshape"], 1) == 2
    assert back(cap, n["expand"], 2) == 2 and back(cap, n["unsqueeze"], 2) == 1
    assert back(cap, n["select"], 1) == 2
    assert back(cap, n["reshape_1"], 2) is None


@pytest.mark.parametrize("kw, rule", [(dict(groups=2), "grouped-conv"), (dict(scale="gate"), "gated-writer"),
                                      ({}, None)])
def test_a_refused_stream_keeps_the_residual_rule_behind_it(kw, rule):
    """swap's site code says the stream refused (SwapWhy.STREAM); the plan keeps the residual analysis's own rule."""
    from tests.test_swap_writers import ViT
    from normconv.graph.capture import capture
    from normconv.graph.detect import find_norms
    from normconv.graph.residual import ResidualWhy
    from normconv.passes.swap_norm import analyze

    torch.manual_seed(0)
    cap = capture(ViT(**kw).eval(), normconv.Inputs((torch.randn(2, 4, 32, 32),)))
    plans = analyze(cap, find_norms(cap)).plans
    if rule is None:
        assert all(p.exact and p.code == SwapWhy.EXACT_RMSNORM and p.detail is None for p in plans)
        return
    assert {p.code for p in plans} == {SwapWhy.STREAM} and {p.detail for p in plans} == {ResidualWhy(rule)}


def test_each_sublayer_rule_is_a_deepnorm_decision():
    from normconv.graph.residual.sublayers import SublayerWhy
    from normconv.passes.deepnorm import _SUBLAYER

    assert set(_SUBLAYER) == set(SublayerWhy) and set(_SUBLAYER.values()) <= set(DeepNormWhy)
