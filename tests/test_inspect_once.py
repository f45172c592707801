"""inspect plans canonicalize, swap (whose first step is canonicalize) and export on one capture: each hand-written
norm's replacement is checked on the example run once, not once per plan (gemma4-ViT's inspect: 40 s -> 22 s), and
the plans are the same as when every plan checks for itself."""

from __future__ import annotations

import pytest
import torch

import normconv
from normconv.graph import capture as capture_mod
from normconv.io.load import load
from normconv.verify import Inputs, _scale
from normconv.passes import canonicalize


class _Forgetful(dict):
    """A ``checked`` memo that keeps nothing: every analysis records and checks for itself (the old way)."""

    def __setitem__(self, key, value):
        pass


def _sites(report) -> list:
    return [(s["target"], [(p["pass"], p["applied"], p.get("code"), p["reason"]) for p in s["plan"]])
            for s in report.to_json()["sites"]]


@pytest.mark.parametrize("method, recordings", [("torch.export", 1), ("symbolic_trace", 2)])
def test_each_replacement_is_checked_once_per_capture(monkeypatch, method, recordings):
    loaded = load("zoo:tutorial_ln")
    x = Inputs((torch.randn(2, 10, 32),))
    made = []
    real = canonicalize._record

    def counted(cap, candidates):
        made.append(len(candidates))
        return real(cap, candidates)

    monkeypatch.setattr(canonicalize, "_record", counted)
    once = normconv.inspect(loaded.model, x, method=method)
    # torch.export: the plans' analyses all share one; a symbolic trace's graph holds the model's own modules, so
    # swap's canonicalized copy is traced and checked anew
    assert len(made) == recordings and made[0] == 3
    made.clear()
    post_init = capture_mod.Captured.__post_init__

    def forgetful(self):
        post_init(self)
        self.checked = _Forgetful()

    monkeypatch.setattr(capture_mod.Captured, "__post_init__", forgetful)
    monkeypatch.setattr(capture_mod.Captured, "rebound", lambda self, model: None)
    each = normconv.inspect(loaded.model, x, method=method)
    assert len(made) == 4  # canonicalize's plan, swap's plan and its canonicalized copy, export's plan
    assert _sites(once) == _sites(each)
    assert any(p[0] == "canonicalize" and p[1] for _, plan in _sites(once) for p in plan)


def test_a_rebound_capture_reads_the_copy():
    from normconv.clone import clone_sharing_tensors
    from normconv.graph.capture import capture

    loaded = load("zoo:gpt")
    cap = capture(loaded.model, loaded.inputs, "torch.export")
    copy = clone_sharing_tensors(cap.model)
    twin = cap.rebound(copy)
    assert twin.model is copy and twin.gm is cap.gm and twin.checked is cap.checked
    assert all(twin.modules[p] is m for p, m in copy.named_modules())
    assert not any(twin.modules[p] is m for p, m in cap.model.named_modules() if p)
    name = next(iter(cap._params.values()))  # a state_dict name the graph reads
    assert twin.tensor(name) is cap.tensor(name) is not None  # the same shared parameter, read through the copy
    assert twin._params == cap._params
    symbolic = capture(loaded.model, loaded.inputs, "symbolic_trace")
    assert symbolic.rebound(clone_sharing_tensors(loaded.model)) is None


def test_the_quick_check_never_passes_what_compare_refuses():
    from normconv.verify import compare

    torch.manual_seed(0)
    atol, rtol = 1e-5, 1.3e-6
    y = torch.randn(4, 64)
    for scale in (1e-7, 1e-6, 4e-6, 1e-5, 3e-5, 1e-3):
        for _ in range(20):
            got = y + scale * torch.randn_like(y)
            if canonicalize._surely_within(y, got, atol, rtol):
                assert compare(y, got, atol, rtol).passed
    assert canonicalize._surely_within(y, y.clone(), atol, rtol)
    assert not canonicalize._surely_within(y, y[None], atol, rtol)  # broadcasts, but another shape
    assert not canonicalize._surely_within(torch.zeros(3), torch.zeros(3), atol, rtol)  # compare: nothing compared
    nan = y.clone()
    nan[0, 0] = float("nan")
    assert not canonicalize._surely_within(nan, nan.clone(), atol, rtol)  # a NaN is left to compare
    inf = y.clone()
    inf[0, 0] = float("inf")
    assert not canonicalize._surely_within(inf, inf.clone(), atol, rtol)


def test_scale_is_the_largest_finite_value():
    assert _scale(torch.tensor([1.0, -3.0, 2.0])) == 3.0
    assert _scale(torch.tensor([1.0, float("inf"), -2.0, float("nan")])) == 2.0
    assert _scale(torch.tensor([float("nan")])) == 0.0 and _scale(torch.tensor([])) == 0.0
