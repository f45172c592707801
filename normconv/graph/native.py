"""The native torch layer that computes a functional conv / linear call, holding the very tensors it reads.

    aten.conv{1,2,3}d(x, W, b, stride, padding, dilation, groups)  =  nn.Conv{1,2,3}d(...)(x)   (zero padding mode)
    aten.linear(x, W, b)                                            =  nn.Linear(...)(x)

Built on the meta device and given W and b themselves (no copy), so replacing a container by it changes no output,
no tensor and no state_dict key (passes/lift_layers, passes/fold_weight_standardization).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn


def native_layer(kind: type, node: fx.Node, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """The native module of class ``kind`` computing ``node`` (its stride, padding, dilation, groups), holding the
    very same tensors."""
    if kind is nn.Linear:
        mod = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    else:
        rank = weight.dim() - 2
        stride, padding, dilation, groups = (list(node.args[3:7]) + [1, 0, 1, 1][len(node.args[3:7]):])
        mod = kind(weight.shape[1] * groups, weight.shape[0], tuple(weight.shape[2:]), stride=_tuple(stride, rank),
                   padding=_tuple(padding, rank), dilation=_tuple(dilation, rank), groups=groups,
                   bias=bias is not None, device="meta")
    mod.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        mod.bias = bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)
    return mod


def _tuple(v, rank: int) -> tuple[int, ...]:
    return tuple(v) if isinstance(v, (list, tuple)) else (int(v),) * rank
