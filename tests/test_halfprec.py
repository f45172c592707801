"""Half precision that does not overflow (issue 15): the zoo case that fails without it, the headroom report,
the fp16 export with fp32 statistics, validation against the fp32 model."""

from __future__ import annotations

import copy

import pytest
import torch

import normconv
from normconv.models import get
from normconv.verify import default_tolerance


def _fp32_and_inputs(name="fp16_overflow"):
    z = get(name)
    return z.build(), z.example_inputs()


def _half_run(model, inputs, dtype=torch.float16):
    m = copy.deepcopy(model).to(dtype)  # a copy: .to() would convert the user's (shared) parameters in place
    with torch.no_grad():
        return m(*[x.to(dtype) for x in inputs]).float()


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def test_fp16_eager_overflows_but_canonicalized_fp16_stays_within_tolerance_of_fp32():
    model, inputs = _fp32_and_inputs()
    with torch.no_grad():
        ref = model(*inputs)
    scale = ref.abs().max().item()
    plain = _half_run(model, inputs)
    # x^2 > 65504 in the hand-written norms: rows come out as zeros, the error is the size of the output
    assert _max_err(plain, ref) > 0.5 * scale
    canon, report = normconv.canonicalize(model, inputs)
    assert sum(s.applied for s in report.sites) == 3
    atol, rtol = default_tolerance(torch.float16)
    fixed = _half_run(canon, inputs)
    assert torch.isfinite(fixed).all()
    assert torch.allclose(fixed, ref, atol=atol, rtol=rtol), _max_err(fixed, ref)
    # the user's model is still float32 and unchanged
    assert all(p.dtype == torch.float32 for p in model.parameters())
