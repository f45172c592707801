"""The RMSNorm module normconv inserts (canonicalize, swap): ``make_rmsnorm`` is the one place that builds it.

  RMSNorm(x) = x / sqrt(mean(x^2 over normalized dims) + eps) * w
"""

from __future__ import annotations

import torch
import torch.nn as nn


def make_rmsnorm(normalized_shape, eps: float | None, weight: torch.Tensor | None = None,
                 dtype: torch.dtype | None = None) -> nn.Module:
    """An RMSNorm over ``normalized_shape`` with ``eps`` and (optionally) the given weight."""
    module = nn.RMSNorm(normalized_shape, eps=eps, elementwise_affine=weight is not None, dtype=dtype)
    if weight is not None:
        with torch.no_grad():
            module.weight.copy_(weight)
    return module
