"""The proof judged by each output's scale (normconv.verify's docstring): both sides of it.

An exact fold of a model whose outputs reach 1e5..1e12 (RepVGG, MobileOne, Inception written after their papers in
scale_models.py) passes, where the element-wise check refused it for float32 rounding alone; a wrong fold planted
at 1e-3 of the output's scale is refused (exit 1, nothing written), on those models and on one whose outputs are
1e-6, where atol 1e-4 let any error through. Given tolerances are honoured element-wise.
"""

from __future__ import annotations

import json

import pytest
import torch

import normconv
import scale_models
from normconv.passes import fold_batchnorm
from normconv.verify import SCALE_ULPS, compare, scale_tolerance

MODELS = ("repvgg", "mobileone", "inception")
PLANTED = 1e-3  # relative change of the head's BatchNorm scale: an error of about 1e-3 of the output's scale


def build(name: str):
    return getattr(scale_models, name)()


def plant(monkeypatch, relative: float = PLANTED, rows: int = 100) -> None:
    """A wrong fold: the head's BatchNorm scale (the layer with ``rows`` outputs) folded as s (1 + relative)."""
    real = fold_batchnorm.fold_backward

    def wrong(layer, s, t):
        real(layer, s * (1 + relative) if layer.weight.shape[0] == rows else s, t)

    monkeypatch.setattr(fold_batchnorm, "fold_backward", wrong)


@pytest.fixture
def one_thread():
    """The element-wise verdicts below are about these inputs' rounding, which torch's thread count changes (a conv's
    reduction order): pinned to one thread, as the suite's workers run, so a run with -n0 (two threads) sees them
    too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", MODELS)
def test_an_exact_fold_of_large_outputs_passes(name, one_thread):
    model, x = build(name)
    folded, report = normconv.fold(model, x)
    assert report.passed and all(v.rule == "scale" for v in report.validation)
    first = report.validation[0]
    assert first.outputs[0].scale > 1e5, "the case at stake: outputs far above 1"
    assert first.max_scale_error < 1e-5, "float32 rounding: a few units of 2^-24 of the scale, not more"
    assert first.scale_tolerance == scale_tolerance(torch.float32) == SCALE_ULPS * 2.0 ** -24
    with torch.no_grad():
        ref, got = model(*x), folded(*x)
    assert compare(ref, got).passed
    # what float32 rounding may leave at this scale (2^6 units of 2^-24 of it, below the bound's 2^10): the scale rule
    # takes it, the element-wise one refuses it near the output's zeros (whether this CPU's kernels round the fold
    # that far is theirs to decide: on some the fold itself is refused element-wise, on others not)
    rounded = ref.clone()
    rounded.view(-1)[ref.abs().argmin()] += ref.abs().max() * 2.0 ** -18  # at the element nearest 0
    assert compare(ref, rounded).passed
    assert not compare(ref, rounded, atol=1e-4, rtol=1e-4).passed, "the element-wise check refuses float32 rounding"


@pytest.mark.parametrize("name", MODELS + ("tiny",))
def test_a_wrong_fold_of_a_thousandth_of_the_scale_is_refused(cli, tmp_path, monkeypatch, name):
    plant(monkeypatch)
    model, x = build(name)
    # the planted error, measured with a tolerance that passes anything (given tolerances are honoured as given)
    folded, report = normconv.fold(model, x, atol=1e30, rtol=0.0)
    with torch.no_grad():
        ref, got = model(*x), folded(*x)
    planted = compare(ref, got)
    assert 3e-4 < planted.max_scale_error < 3e-3 and not planted.passed
    if name == "tiny":  # outputs of 1e-6: the element-wise default passed this wrong fold
        assert planted.outputs[0].scale < 2e-6 and compare(ref, got, atol=1e-4, rtol=1e-4).passed
    out = tmp_path / "folded.pt"
    code, stdout, stderr = cli("fold", f"scale_models:{name}", "-o", out)
    assert code == 1, stdout
    assert "beyond tolerance" in stderr and "of the output's scale" in stderr and "nothing written" in stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_tiny_output_model_folds_exactly_and_is_judged_at_its_scale():
    model, x = build("tiny")
    _, report = normconv.fold(model, x)
    v = report.validation[0]
    assert report.passed and v.outputs[0].scale < 2e-6
    assert v.max_abs_error < 1e-6 * v.scale_tolerance, "held to its own scale, not to atol"


def test_the_cli_writes_the_fold_and_reports_errors_relative_to_scale(cli, tmp_path):
    out = tmp_path / "repvgg.pt"
    code, stdout, stderr = cli("fold", "scale_models:repvgg", "-o", out, "--json")
    assert code == 0, stderr
    report = json.loads(stdout)
    v = report["validation"][0]
    assert v["rule"] == "scale" and v["scale_tolerance"] == pytest.approx(2.0 ** -14)
    o = v["outputs"][0]
    assert o["scale"] > 1e5 and o["scale_error"] == pytest.approx(o["max_abs_error"] / o["scale"])
    assert 0 <= o["rms_error"] < 1e-5 and o["tolerance"] == pytest.approx(2.0 ** -14)
    assert out.exists()
    code, stdout, _ = cli("fold", "scale_models:repvgg")
    assert code == 0 and "of each output's scale" in stdout and "err / scale" in stdout


def test_given_tolerances_are_element_wise(cli, tmp_path, one_thread, monkeypatch):
    real = fold_batchnorm.fold_backward

    def shifted(layer, s, t):  # the head's outputs 3e5 off: 1.4e-6 of their scale (2.1e11), 1e-3 of the smallest
        real(layer, s, t + 3e5 if layer.weight.shape[0] == 100 else t)

    monkeypatch.setattr(fold_batchnorm, "fold_backward", shifted)
    out = tmp_path / "x.pt"
    code, _, stderr = cli("fold", "scale_models:repvgg", "-o", out, "--atol", "1e-4", "--rtol", "1e-4")
    assert code == 1 and "atol 0.0001, rtol 0.0001" in stderr and not out.exists()
    code, _, _ = cli("fold", "scale_models:repvgg", "-o", out)  # the same fold, judged by the output's scale
    assert code == 0 and out.exists()
    _, report = normconv.fold(*build("repvgg"), atol=1e6, rtol=1e-4)  # errors of 1e5 at a scale of 2e11
    assert report.passed and report.validation[0].rule == "elementwise"


def test_the_rule_per_dtype():
    a = torch.randn(64, dtype=torch.float64) * 1e9
    assert compare(a, a * (1 + 1e-14)).passed and not compare(a, a * (1 + 1e-9)).passed  # float64: 2^10 x 2^-53
    h = torch.randn(64).half()
    v = compare(h, h + 1e-3)
    assert v.rule == "elementwise" and v.passed  # half: its element-wise defaults (1e-2)
    ints = torch.arange(5)
    assert compare(ints, ints).passed and not compare(ints, ints + 1).passed


def test_an_all_zero_output_is_judged_at_the_outputs_scale():
    ref = (torch.zeros(4), torch.full((4,), 1e6))
    assert compare(ref, (torch.full((4,), 1e-3), ref[1])).passed  # 1e-9 of the output's scale
    assert not compare(ref, (torch.full((4,), 1e3), ref[1])).passed


def test_nan_and_infinities_must_match():
    a = torch.tensor([1.0, float("inf"), float("nan"), -float("inf")])
    assert compare(a, a.clone()).passed
    assert not compare(a, torch.tensor([1.0, 1e30, float("nan"), -float("inf")])).passed
    assert not compare(a, torch.tensor([1.0, float("inf"), 0.0, -float("inf")])).passed


def test_a_reference_with_no_finite_value_compares_nothing():
    """A half model that overflows everywhere (Swinv2 in float16 with trained-looking norms: NaN logits) gives
    NaN for NaN: the NaN-for-NaN rule would pass any rewrite that overflows too. Not a pass, and said as such (it
    was 'outputs differ beyond tolerance' with an error of 0)."""
    from normconv.verify import compare

    nan = torch.full((2, 3), float("nan"), dtype=torch.float16)
    v = compare({"logits": nan}, {"logits": nan.clone()})
    assert not v.passed and "nothing compared" in v.label and "overflows in float16" in v.label
    inf = torch.full((4,), float("inf"))
    assert not compare(inf, inf.clone()).passed
    some = torch.tensor([1.0, float("nan")])  # a finite value left: compared as before
    assert compare(some, some.clone()).passed
