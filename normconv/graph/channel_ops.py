"""What an op does to a per-channel affine ``s * x + t`` (channels on dim 1) that meets it: whether
op(s * x + t) = s * op(x) + t, for the scale and the shift apart. Both graph dialects, modules and calls alike.

  relu, leaky_relu, prelu                    s > 0 passes (positively homogeneous: f(s x) = s f(x)); t does not
  max pools (adaptive too)                   s > 0 passes; t passes (max(x + t) = max(x) + t; padding is -inf)
  avg pools, adaptive avg, a spatial mean    any s passes (linear); t passes unless zero padding is counted in
                                             the average (count_include_pad with padding) or a divisor is forced
  zero padding (F.pad constant 0, ZeroPad)   any s passes (s * 0 = 0); t does not (the pad would have to be t)
  reflect / replicate / circular padding     both pass (they copy values)
  dropout in eval, identity, copies          both pass
  interpolate / upsample (nearest, linear,   both pass: each output is a combination of one channel's inputs whose
  bilinear, bicubic, trilinear, area)        weights sum to one, align_corners either way (a constant stays itself)
An op that pads or pools the channel dim, returns indices, or pads with another constant is none of these (None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.fx as fx
import torch.nn as nn

from normconv.graph.capture import Captured
from normconv.match import COPY, RESAMPLE, RESAMPLE_MODES, arg, call_name, dims_of, scalar


@dataclass(frozen=True)
class Passes:
    """Which parts of a per-channel affine pass through one op unchanged."""

    what: str  # the op, for people
    any_scale: bool  # a scale of either sign
    positive_scale: bool  # a positive scale
    shift: bool  # a per-channel shift


_HOMOGENEOUS = Passes("activation", False, True, False)
_RESAMPLED = Passes("interpolation", True, True, True)
_BOTH = Passes("pass-through", True, True, True)
_ACTIVATIONS = ("relu", "relu_", "leaky_relu", "leaky_relu_", "prelu", "_prelu_kernel")
_MAX = ("max_pool1d", "max_pool2d", "max_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
        "max_pool2d_with_indices", "max_pool3d_with_indices")
_AVG = ("avg_pool1d", "avg_pool2d", "avg_pool3d")
_ADAPTIVE_AVG = ("adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "_adaptive_avg_pool2d",
                 "_adaptive_avg_pool3d")
_COPY_PADS = ("reflection_pad1d", "reflection_pad2d", "reflection_pad3d", "replication_pad1d", "replication_pad2d",
              "replication_pad3d", "_pad_circular")


def channel_op(cap: Captured, node: fx.Node) -> Passes | None:
    """What ``node`` lets through of a per-channel affine on its first input, or None."""
    if node.op == "call_module":
        return _module(cap.modules.get(node.target), len(cap.shape(node) or ()))
    name = call_name(node)
    if cap.op(node) in ("identity", "dropout") or name in COPY:
        return _BOTH if cap.op(node) != "dropout" or arg(node, 2, "training", True) is False else None
    if name in _ACTIVATIONS:
        return _HOMOGENEOUS
    if name in _MAX:
        return None if arg(node, 6, "return_indices", False) is True else Passes("max pool", False, True, True)
    if name in _ADAPTIVE_AVG:
        return Passes("average pool", True, True, True)
    if name in _AVG:
        padded = _nonzero(arg(node, 3, "padding", 0)) and arg(node, 5, "count_include_pad", True) is not False
        forced = arg(node, 6, "divisor_override", None) is not None
        return Passes("average pool", True, True, not padded and not forced)
    if name == "mean":  # a mean over spatial dims only is a global average pool
        rank = len(cap.shape(node.args[0]) or ())
        dims = dims_of(arg(node, 1, "dim"))
        if not rank or dims is None or any(d % rank in (0, 1) for d in dims):
            return None
        return Passes("spatial mean", True, True, True)
    if name in _COPY_PADS:
        return Passes("copying pad", True, True, True)
    if name in RESAMPLE:  # aten's upsample ops name their mode; F.interpolate takes it as an argument
        mode = arg(node, 3, "mode", "nearest") if name in ("interpolate", "upsample") else "named"
        return _RESAMPLED if mode == "named" or mode in RESAMPLE_MODES else None
    if name in ("pad", "constant_pad_nd"):
        rank, pad = len(cap.shape(node.args[0]) or ()), arg(node, 1, "pad")
        if not isinstance(pad, (list, tuple)) or not rank or len(pad) // 2 > rank - 2:
            return None  # pads the channel (or batch) dim
        mode = arg(node, 2, "mode", "constant") if name == "pad" else "constant"
        value = arg(node, 3 if name == "pad" else 2, "value", None)
        if mode in ("reflect", "replicate", "circular"):
            return Passes(f"{mode} pad", True, True, True)
        if mode == "constant" and (value is None or scalar(value) == 0.0):
            return Passes("zero pad", True, True, False)
    return None


def _nonzero(padding: Any) -> bool:
    return any(p != 0 for p in padding) if isinstance(padding, (list, tuple)) else padding != 0


def _module(m: nn.Module | None, rank: int) -> Passes | None:
    if isinstance(m, (nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)):
        return _BOTH if not m.training or isinstance(m, nn.Identity) else None
    if isinstance(m, (nn.ReLU, nn.LeakyReLU, nn.PReLU)):
        return _HOMOGENEOUS
    if isinstance(m, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)):
        return None if m.return_indices else Passes("max pool", False, True, True)
    if isinstance(m, (nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)):
        return None if m.return_indices else Passes("max pool", False, True, True)
    if isinstance(m, (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)):
        return Passes("average pool", True, True, True)
    if isinstance(m, (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)):
        padded = _nonzero(m.padding) and m.count_include_pad
        return Passes("average pool", True, True, not padded and getattr(m, "divisor_override", None) is None)
    if isinstance(m, (nn.ReflectionPad1d, nn.ReflectionPad2d, nn.ReflectionPad3d, nn.ReplicationPad1d,
                      nn.ReplicationPad2d, nn.ReplicationPad3d, nn.CircularPad1d, nn.CircularPad2d,
                      nn.CircularPad3d)):
        return Passes("copying pad", True, True, True)
    if isinstance(m, nn.Upsample):  # UpsamplingNearest2d / UpsamplingBilinear2d too
        return _RESAMPLED if m.mode in RESAMPLE_MODES else None
    if isinstance(m, (nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d)):  # ZeroPad*d are ConstantPad(0)
        return Passes("zero pad", True, True, False) if m.value == 0 else None
    return None


def value_out(cap: Captured, node: fx.Node) -> fx.Node:
    """The node holding an op's tensor: for an aten ``max_pool*_with_indices``, its ``[0]`` (when nothing reads the
    indices), else the node itself."""
    if call_name(node).endswith("_with_indices"):
        users = cap.users(node)
        if len(users) == 1 and call_name(users[0]) == "getitem" and users[0].args[1] == 0:
            return users[0]
    return node


def value_in(cap: Captured, node: fx.Node) -> fx.Node:
    """The op behind a value: for ``getitem(max_pool*_with_indices(x), 0)``, the pool, else the node itself."""
    if call_name(node) == "getitem" and isinstance(node.args[0], fx.Node) and node.args[1] == 0 and \
            call_name(node.args[0]).endswith("_with_indices"):
        return node.args[0]
    return node


__all__ = ["Passes", "channel_op", "value_out", "value_in"]
