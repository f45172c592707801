"""``verify.compare`` takes each leaf's float64 statistics a chunk at a time: the verdict and every statistic are
those of the whole leaf at once (NaN and infinities where they were, a mismatch anywhere, element-wise and by-scale
rules), and comparing GPT-2-sized logits no longer holds 80 MB of float64 temporaries."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from normconv import verify
from normconv.verify import compare


def _cases():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 1000, generator=g)
    yield "close", a, a + 1e-6 * torch.randn(3, 1000, generator=g)
    b = a.clone()
    b[2, 999] += 1.0  # one element far off, in the last chunk
    yield "one off", a, b
    n = a.clone()
    n[0, 5], n[1, 7], n[2, 0] = float("nan"), float("inf"), float("-inf")
    yield "nan and inf in both", n, n.clone()
    m = n.clone()
    m[1, 7] = 3.0  # an infinity on one side only
    yield "inf on one side", n, m
    yield "zeros", torch.zeros(2, 500), torch.zeros(2, 500)
    yield "ints", torch.arange(3000).reshape(3, 1000), torch.arange(3000).reshape(3, 1000)
    yield "non-contiguous", a.t(), (a + 1e-7).t()


@pytest.mark.parametrize("tol", [(None, None), (1e-5, 1e-5)])
def test_a_chunked_comparison_is_the_whole_leaf_s(monkeypatch, tol):
    for name, ref, cand in _cases():
        whole = compare(ref, cand, *tol)
        monkeypatch.setattr(verify, "_CHUNK", 7)  # hundreds of chunks, the last one short
        chunked = compare(ref, cand, *tol)
        monkeypatch.setattr(verify, "_CHUNK", 1 << 20)
        assert chunked.passed == whole.passed, name
        for w, c in zip(whole.outputs, chunked.outputs):
            assert w.passed == c.passed, name
            for field in ("scale", "max_abs_error", "max_rel_error", "scale_error", "cosine", "rms_error"):
                x, y = getattr(w, field), getattr(c, field)
                assert (x != x and y != y) or x == pytest.approx(y, rel=1e-12, abs=0), (name, field, x, y)


_PEAK = """
import torch
from normconv.verify import compare
ref = torch.randn(2, 16, 50257)  # 6.4 MB in float32, 12.9 MB a float64 copy
cand = ref + 1e-7
def kb(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident set starts again from here
before = kb("VmRSS:")
assert compare(ref, cand).passed
print(kb("VmHWM:") - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS reset through /proc/self/clear_refs")
def test_comparing_gpt2_sized_logits_holds_no_whole_float64_copies():
    """In a fresh process (no allocator pages left from an earlier comparison): whole-leaf float64 statistics took
    85 MB above the resident set here, chunked 21 MB."""
    grown_kb = int(subprocess.run([sys.executable, "-c", _PEAK], check=True, capture_output=True, text=True).stdout)
    assert grown_kb < 45 * 1024


def _by_formula(ref: torch.Tensor, cand: torch.Tensor, atol: float, rtol: float) -> dict[str, float]:
    """The module docstring's statistics, written out in torch over the whole leaf in float64."""
    r, c = ref.double().reshape(-1), cand.double().reshape(-1)
    same = (r == c) | (r.isnan() & c.isnan())
    diff = torch.where(same, 0.0, (r - c).abs())
    fr, fc = (torch.where(torch.isfinite(t), t, 0.0) for t in (r, c))
    return {"max_abs_error": float(diff.max()),
            "max_rel_error": float((diff / r.abs().clamp_min(atol if atol > 0 else 1e-30)).max()),
            "cosine": float(fr @ fc / (fr.norm() * fc.norm())) if fr.norm() > 0 and fc.norm() > 0
            else float(torch.equal(r, c)),
            "passed": bool(torch.isfinite(diff).all() and ((diff <= atol + rtol * r.abs()) | same).all())}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_each_statistic_is_its_formula(dtype):
    """The statistics (taken in numpy, chunk by chunk) are the formulas' on the whole leaf, in every float dtype, with
    NaN, infinities on one side or both, signed zeros and exact equality."""
    cases = list(_cases()) + [("signed zero", torch.tensor([-0.0, 1.0]), torch.tensor([0.0, 1.0])),
                              ("equal", torch.ones(9), torch.ones(9))]
    for name, ref, cand in cases:
        if not ref.is_floating_point() or name == "zeros":  # all zeros: nothing compared (tested elsewhere)
            continue
        ref, cand = ref.to(dtype), cand.to(dtype)
        got = compare(ref, cand, 1e-3, 1e-3).outputs[0]
        want = _by_formula(ref, cand, 1e-3, 1e-3)
        assert got.passed == want.pop("passed"), name
        for field, x in want.items():
            y = getattr(got, field)
            assert (x != x and y != y) or y == pytest.approx(x, rel=1e-9, abs=1e-300), (name, dtype, field, x, y)


def test_nan_in_the_same_places_passes_the_element_wise_rule_too():
    """NaN for NaN is no difference under --atol / --rtol as under the scale rule (NaN + rtol * NaN compared false:
    a file whose output is NaN where its input's is, every --dtype float16 run of an ONNX file, failed, max abs 0);
    a NaN on one side only still fails both."""
    a = torch.tensor([1.0, float("nan"), 2.0, float("inf")])
    same = torch.tensor([1.0, float("nan"), 2.0 + 1e-6, float("inf")])
    one_side = torch.tensor([1.0, 0.5, 2.0, float("inf")])
    for tol in ((None, None), (1e-3, 1e-3), (0.0, 0.0)):
        assert compare(a, same, *tol).passed == (tol[0] != 0.0), tol  # 1e-6 off: within 1e-3, not within 0
        assert not compare(a, one_side, *tol).passed and not compare(one_side, a, *tol).passed, tol


def test_a_failure_by_nan_or_infinity_is_named_for_people():
    """'max abs error nan' alone did not say why: a half model overflowing where float32 does not."""
    a = torch.tensor([1.0, 2.0, 3.0])
    for bad in (float("nan"), float("inf")):
        v = compare(a, torch.tensor([1.0, bad, 3.0]))
        assert not v.passed and "on one side only: an overflow" in v.worst, v.worst
    assert "one side" not in compare(a, a + 1).worst
