"""normconv's RMSNorm: same math as nn.RMSNorm (values, gradients, eps=None), one aten.rms_norm when exported."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn

from normconv.nn.rmsnorm import RMSNorm, make_rmsnorm


def _pair(shape, eps, affine=True, dtype=torch.float32):
    torch.manual_seed(0)
    ref = nn.RMSNorm(shape, eps=eps, elementwise_affine=affine, dtype=dtype)
    if affine:
        with torch.no_grad():
            ref.weight.copy_(torch.randn(ref.weight.shape, dtype=dtype))
    ours = make_rmsnorm(shape, eps, ref.weight.detach() if affine else None, dtype)
    return ref, ours


@pytest.mark.parametrize("x_shape,shape,eps,affine", [
    ((4, 7, 64), (64,), 1e-5, True),
    ((2, 3, 4, 5), (4, 5), None, True),
    ((3, 8), (8,), 1e-2, False),
    ((2, 16, 768), (768,), 1e-6, True),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_nn_rmsnorm(x_shape, shape, eps, affine, dtype):
    ref, ours = _pair(shape, eps, affine, dtype)
    x = torch.randn(x_shape, dtype=dtype) * 3 + 0.5
    with torch.no_grad():
        a, b = ref(x), ours(x)
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    assert a.dtype == b.dtype == dtype
    torch.testing.assert_close(b, a, atol=tol * 4, rtol=tol * 4)


def test_eps_none_is_dtype_epsilon_and_tiny_inputs_match():
    ref, ours = _pair((16,), None)
    x = torch.full((2, 16), 1e-5)  # eps dominates: finfo(float32).eps vs 1e-5 would differ by 100x here
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), atol=1e-6, rtol=1e-5)
    assert ours.eps is None


def test_gradients_match():
    ref, ours = _pair((32,), 1e-5)
    x = torch.randn(4, 5, 32)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(4, 5, 32)
    (ref(xa) * g).sum().backward()
    (ours(xb) * g).sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, atol=1e-5, rtol=1e-5)


def test_half_precision_falls_back_to_torch_exactly():
    ref, ours = _pair((32,), 1e-5, dtype=torch.bfloat16)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))


def test_exports_as_one_rms_norm_op_and_traces_as_f_rms_norm():
    _, ours = _pair((32,), 1e-5)
    ep = torch.export.export(ours, (torch.randn(2, 32),))
    ops = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert ops == [torch.ops.aten.rms_norm.default]
    gm = torch.fx.symbolic_trace(ours)
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [torch.nn.functional.rms_norm]


def test_is_an_nn_rmsnorm_with_the_same_state_dict_and_pickles():
    ref, ours = _pair((32,), 1e-5)
    assert isinstance(ours, nn.RMSNorm) and type(ours) is RMSNorm
    assert ours.state_dict().keys() == ref.state_dict().keys()
    buf = io.BytesIO()
    torch.save(ours, buf)
    buf.seek(0)
    with torch.serialization.safe_globals([RMSNorm]):
        back = torch.load(buf, weights_only=True)
    x = torch.randn(3, 32)
    with torch.no_grad():
        assert torch.equal(back(x), ours(x))
