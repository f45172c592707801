"""Property tests: random stacks of conv / conv-transpose / linear / BN / activation / residual adds.

For every generated model: the folded model matches (float64, default tolerance), exactly the BNs an
independent oracle calls foldable are gone, and every skipped site carries a reason. The oracle reads the
stack as written: a BN folds backward when the element right before it (same list) is a conv / linear,
forward when the element right after it is a Linear or a conv that pads nothing with zeros.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings, strategies as st

from fold_helpers import bn_modules, randomize_bn
from normconv.api import fold
from normconv.errors import VerificationError

CONV = {1: nn.Conv1d, 2: nn.Conv2d}
CONVT = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d}
BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d}
ACTS = (nn.ReLU, nn.Tanh, nn.SiLU)


class Stack(nn.Module):
    """Applies its layers in order; a layer flagged residual computes x + f(x)."""

    def __init__(self, layers: list[nn.Module], residual: list[bool]):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.residual = residual

    def forward(self, x):
        for layer, res in zip(self.layers, self.residual):
            x = x + layer(x) if res else layer(x)
        return x


def _kind(m: nn.Module) -> str:
    if isinstance(m, nn.modules.batchnorm._BatchNorm):
        return "bn"
    if isinstance(m, nn.modules.conv._ConvTransposeNd):
        return "convT"
    if isinstance(m, (nn.modules.conv._ConvNd, nn.Linear)):
        return "layer"
    return "other"


def _forward_ok(m: nn.Module) -> bool:
    if isinstance(m, nn.Linear):
        return True
    if isinstance(m, nn.modules.conv._ConvNd) and _kind(m) == "layer":
        return m.padding_mode != "zeros" or all(p == 0 for p in m._reversed_padding_repeated_twice)
    return False


def expected_folds(stack: Stack) -> int:
    """The oracle: how many BNs of a stack fold, from the list structure alone: a BN right after a layer (or after
    BNs right after one) folds backward; else one right before a layer that takes a fold forward."""
    items = list(zip(stack.layers, stack.residual))
    count = 0
    for i, (m, res) in enumerate(items):
        if res:
            count += expected_folds(m)
            continue
        if _kind(m) != "bn":
            continue
        j = i - 1
        while j >= 0 and not items[j][1] and _kind(items[j][0]) == "bn":  # a BN after BNs joins their backward fold
            j -= 1
        before = items[j] if j >= 0 else None
        after = items[i + 1] if i + 1 < len(items) else None
        if before is not None and not before[1] and _kind(before[0]) in ("layer", "convT"):
            count += 1
        elif after is not None and not after[1] and _forward_ok(after[0]):
            count += 1
    return count


@st.composite
def conv_stacks(draw, max_len: int = 6, depth: int = 0):
    """(Stack, channels in, dims, spatial size) built layer by layer so every shape is valid."""
    dims = draw(st.sampled_from([1, 2]))
    cin = draw(st.sampled_from([2, 4, 6]))
    size = draw(st.integers(6, 10))
    stack, _, _ = _conv_body(draw, dims, cin, size, max_len)
    return stack, cin, dims, size


def _conv_body(draw, dims, c, size, max_len, same_shape=False):
    layers, residual = [], []
    for _ in range(draw(st.integers(1, max_len))):
        kind = draw(st.sampled_from(["conv", "conv", "convT", "bn", "bn", "bn", "act", "res"] if not same_shape
                                    else ["conv", "bn", "bn", "act"]))
        if kind == "bn":
            layers.append(BN[dims](c, affine=draw(st.booleans()), eps=draw(st.sampled_from([1e-5, 1e-3]))))
        elif kind == "act":
            layers.append(draw(st.sampled_from(ACTS))())
        elif kind == "res":
            inner, _, _ = _conv_body(draw, dims, c, size, 3, same_shape=True)
            layers.append(inner)
            residual.append(True)
            continue
        elif kind == "conv" and same_shape:  # a shape-preserving conv for a residual branch
            k = draw(st.sampled_from([1, 3]))
            mode = draw(st.sampled_from(["zeros", "reflect"]))
            groups = draw(st.sampled_from([g for g in (1, 2) if c % g == 0]))
            layers.append(CONV[dims](c, c, k, padding=k // 2, groups=groups, padding_mode=mode,
                                     bias=draw(st.booleans())))
        elif kind == "conv":
            k, stride, dil = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
            pad = draw(st.integers(0, 1))
            groups = draw(st.sampled_from([g for g in (1, 2, c) if c % g == 0]))
            cout = groups * draw(st.integers(1, 3))
            out = (size + 2 * pad - dil * (k - 1) - 1) // stride + 1
            if out < 2:
                stride, dil, pad = 1, 1, 0
                k = 1
                out = size
            mode = draw(st.sampled_from(["zeros", "zeros", "reflect"])) if pad else "zeros"
            layers.append(CONV[dims](c, cout, k, stride, pad, dil, groups, bias=draw(st.booleans()), padding_mode=mode))
            c, size = cout, out
        else:  # transposed conv; weight (in, out/groups, k...)
            k, stride = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([1, 2]))
            if size > 12:
                stride = 1
            pad = draw(st.integers(0, min(1, k - 1)))
            opad = draw(st.integers(0, stride - 1))
            groups = draw(st.sampled_from([g for g in (1, 2) if c % g == 0]))
            cout = groups * draw(st.integers(1, 3))
            layers.append(CONVT[dims](c, cout, k, stride, pad, opad, groups, bias=draw(st.booleans())))
            c, size = cout, (size - 1) * stride - 2 * pad + (k - 1) + opad + 1
        residual.append(False)
    return Stack(layers, residual), c, size


@st.composite
def mlp_stacks(draw, max_len: int = 7):
    c0 = draw(st.sampled_from([3, 5, 8]))
    c = c0
    layers, residual = [], []
    for _ in range(draw(st.integers(1, max_len))):
        kind = draw(st.sampled_from(["linear", "linear", "bn", "bn", "act", "res"]))
        if kind == "linear":
            cout = draw(st.integers(2, 9))
            layers.append(nn.Linear(c, cout, bias=draw(st.booleans())))
            c = cout
        elif kind == "bn":
            layers.append(nn.BatchNorm1d(c, affine=draw(st.booleans())))
        elif kind == "act":
            layers.append(draw(st.sampled_from(ACTS))())
        else:
            inner = [draw(st.sampled_from(["linear", "bn", "act"])) for _ in range(draw(st.integers(1, 3)))]
            mods = [nn.Linear(c, c) if k == "linear" else nn.BatchNorm1d(c) if k == "bn" else nn.ReLU() for k in inner]
            layers.append(Stack(mods, [False] * len(mods)))
            residual.append(True)
            continue
        residual.append(False)
    return Stack(layers, residual), c0


def _check(stack: Stack, x: torch.Tensor) -> None:
    model = randomize_bn(stack, seed=int(x.numel())).double()
    total = bn_modules(model)
    with torch.no_grad():
        if not torch.count_nonzero(model(x)):  # a final ReLU can zero every output: no check can compare that
            with pytest.raises(VerificationError, match="nothing compared"):
                fold(model, x)
            return
    folded, report = fold(model, x)  # raises VerificationError if the outputs moved beyond fp64 tolerance
    assert report.passed
    with torch.no_grad():
        assert torch.allclose(folded(x), model(x), atol=1e-9, rtol=1e-7)
    want = expected_folds(stack)  # fold's own rule; fold-through then folds BNs behind an activation or a pool too
    done = sum(s.applied for s in report.sites)
    assert done >= want and sum(s.applied for s in report.sites if s.pass_name == "fold") <= want, \
        [(s.target, s.reason) for s in report.sites]
    assert bn_modules(folded) == total - done
    assert len(report.sites) == total
    assert all(s.reason.strip() for s in report.sites)


def _conv_input(cin, dims, size):
    return torch.randn(2, cin, *([size] * dims), dtype=torch.float64)


COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=300, **COMMON)
@given(conv_stacks())
def test_random_conv_stacks(spec):
    stack, cin, dims, size = spec
    _check(stack, _conv_input(cin, dims, size))


@settings(max_examples=200, **COMMON)
@given(mlp_stacks())
def test_random_mlp_stacks(spec):
    stack, c0 = spec
    _check(stack, torch.randn(4, c0, dtype=torch.float64))


@pytest.mark.slow
@settings(max_examples=2000, **COMMON)
@given(conv_stacks(max_len=10))
def test_random_conv_stacks_slow(spec):
    stack, cin, dims, size = spec
    _check(stack, _conv_input(cin, dims, size))


@pytest.mark.slow
@settings(max_examples=1000, **COMMON)
@given(mlp_stacks(max_len=12))
def test_random_mlp_stacks_slow(spec):
    stack, c0 = spec
    _check(stack, torch.randn(4, c0, dtype=torch.float64))
