"""The RMSNorm module normconv inserts (canonicalize, swap): ``make_rmsnorm`` is the one place that builds it.

  RMSNorm(x) = x / sqrt(mean(x^2 over normalized dims) + eps) * w        (eps=None: finfo(dtype).eps)

``RMSNorm`` is an ``nn.RMSNorm`` subclass (same parameters, state_dict keys, repr). Only its eager CPU path
differs: torch's CPU ``rms_norm`` is a composite (pow, mean, add, rsqrt, mul, mul: five passes over memory),
2.5-2.8x slower than ``nn.LayerNorm``'s fused kernel. Here the sum of squares is one fused reduction
(``torch.linalg.vector_norm``), and the scale is applied in two in-place multiplies (three passes), which
measures as fast as ``nn.LayerNorm`` up to (32, 512, 768) and 8-12% behind it on (4, 2048, 4096)
(benchmarks/results/swap.md; row-chunking to keep passes 2-3 in cache measured no better:
benchmarks/results/rmsnorm_chunking.md). With autograd on, the same math runs out of place. Under torch.export,
torch.compile, FX or jit tracing, on CUDA, in half precision or with a dispatch mode active it calls
``F.rms_norm``, so graphs see one ``aten.rms_norm``.

``ScaleFreeRMSNorm`` is the weight-free RMSNorm left where a scale was folded away (``swap --fold-scales``,
``rotate``): it computes without a weight (``elementwise_affine=False``, no parameter, nothing in the state_dict),
yet its ``weight`` still reads as ones in the original weight's dtype and device (a non-persistent buffer), because
a model's own code may read its norm's weight as it read the original (Mamba2Block:
``self.norm(x.to(self.norm.weight.dtype))``). ``has_scale`` says whether a norm module has a scale to fold.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

_FAST_DTYPES = (torch.float32, torch.float64)


def _fast_path_ok(x, weight) -> bool:
    """A plain eager CPU float tensor, no tracer or dispatch mode watching: the hand-fused path is safe."""
    return (type(x) is torch.Tensor and x.device.type == "cpu" and x.dtype in _FAST_DTYPES
            and (weight is None or (type(weight) in (torch.Tensor, nn.Parameter) and weight.dtype == x.dtype))
            and torch._C._len_torch_dispatch_stack() == 0
            and not torch.jit.is_tracing() and not torch.compiler.is_compiling())


def rms_norm_cpu(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None, eps: float | None) -> torch.Tensor:
    """RMSNorm as one fused reduction plus scaling; in place on its own temporaries when no gradient is needed."""
    dims = tuple(range(-len(normalized_shape), 0))
    n = math.prod(normalized_shape)
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    norm = torch.linalg.vector_norm(x, 2, dims, keepdim=True)  # sqrt(sum x^2): one pass, vectorized
    grad = torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad))
    if grad:  # out-of-place: autograd keeps every saved tensor intact
        y = x * (norm.square() / n + eps).rsqrt()
        return y * weight if weight is not None else y
    inv = norm.square_().div_(n).add_(eps).rsqrt_()  # (..., 1): negligible
    y = x * inv
    return y.mul_(weight) if weight is not None else y


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` with a fast eager CPU path; exports as ``aten.rms_norm`` like its parent."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fast_path_ok(x, self.weight):
            return rms_norm_cpu(x, self.normalized_shape, self.weight, self.eps)
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)


class ScaleFreeRMSNorm(RMSNorm):
    """A weight-free RMSNorm whose ``weight`` reads as ones (never multiplied, never saved); see the docstring."""

    def __init__(self, normalized_shape, eps: float | None, like: torch.Tensor):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=False, dtype=like.dtype, device=like.device)
        del self._parameters["weight"]  # x / rms(x) * 1 == x / rms(x): the unit weight is only there to be read
        self.register_buffer("weight", torch.ones(self.normalized_shape, dtype=like.dtype, device=like.device),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fast_path_ok(x, None):
            return rms_norm_cpu(x, self.normalized_shape, None, self.eps)
        return F.rms_norm(x, self.normalized_shape, None, self.eps)


def has_scale(module: nn.Module) -> bool:
    """Whether a norm module computes with a weight (a parameter): False for a weight-free or scale-free one."""
    return module._parameters.get("weight") is not None


def make_rmsnorm(normalized_shape, eps: float | None, weight: torch.Tensor | None = None,
                 dtype: torch.dtype | None = None) -> nn.Module:
    """An RMSNorm over ``normalized_shape`` with ``eps`` and (optionally) the given weight."""
    if dtype is None and weight is not None:
        dtype = weight.dtype
    device = weight.device if weight is not None else None
    module = RMSNorm(normalized_shape, eps=eps, elementwise_affine=weight is not None, dtype=dtype, device=device)
    if weight is not None:
        with torch.no_grad():
            module.weight.copy_(weight.reshape(module.weight.shape))
    return module
