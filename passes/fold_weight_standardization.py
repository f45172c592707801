"""Weight standardization folded into its conv for inference (BiT, timm / HF StdConv).

    conv(x, (W - mean(W)) / sqrt(var(W) + eps), b)   =>   conv(x, W', b),   W' = that standardized W, computed once

The standardization reads parameters only, so at inference W' is a constant. The pass evaluates the very graph
nodes that compute it (same ops, same dtype, so W' is bit for bit what the forward computes) and replaces the module
that owns the conv by the native ``nn.ConvNd`` holding W' (a new tensor) and the same bias (shared). Applied only
when that module computes nothing but the standardization and the one conv (``WeightStandardizedConv2d``); a
standardization inside a larger module, read by anything else, or of a weight other layers share is left as it is,
with the reason. The module is in eval semantics afterwards: training it again would train W' without the
standardization, which is why ``fold`` (an inference rewrite) is the command that runs it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from normconv.graph.capture import Captured
from normconv.graph.detect import NormSite, WeightStandardization, find_weight_standardizations, weight_reader
from normconv.graph.native import native_layer
from normconv.report import PassResult, Site, Why

from .base import Check, Pass, replace_module

NAME = "fold-weight-standardization"
_CONVS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


class FoldWSWhy(Why):
    """One member per rule of the weight-standardization fold."""

    FOLDED = "folded"  # W' computed once; the module is a native conv holding it
    NOT_ONE_CONV = "not-one-conv"  # the standardized weight feeds something other than one conv
    GENERIC_CONV = "generic-convolution"  # an aten.convolution call (transposed, output_padding): left as written
    INPUT_DEPENDENT = "input-dependent"  # the standardized weight also depends on a model input
    INLINE = "inline"  # the standardization is not in a conv module of its own
    COMPUTES_MORE = "computes-more"  # the module computes more than the standardization and the conv
    STRING_PADDING = "string-padding"  # padding="same" / "valid"
    SHARED_WEIGHT = "shared-weight"  # another module holds the weight


def _conv_node(cap: Captured, ws: WeightStandardization) -> fx.Node | None:
    """The conv whose weight argument the standardization computes (through views and casts)."""
    layer = weight_reader(cap, cap.nodes[ws.site.node])
    return layer if layer is not None and cap.op(layer) == "conv" and len(layer.args) > 1 else None


def _weight_nodes(conv: fx.Node) -> list[fx.Node]:
    """Every node the conv's weight argument is computed from (the standardization and its views)."""
    seen: dict[str, fx.Node] = {}
    stack = [conv.args[1]]
    while stack:
        n = stack.pop()
        if isinstance(n, fx.Node) and n.name not in seen:
            seen[n.name] = n
            stack.extend(n.all_input_nodes)
    return list(seen.values())


def _decide(cap: Captured, ws: WeightStandardization) -> tuple[fx.Node | None, FoldWSWhy, str]:
    """(the conv to fold into, code, why) or (None, code, why not)."""
    conv = _conv_node(cap, ws)
    # the standardized weight must feed exactly one conv (a linear / transposed conv reader is left)
    if conv is None:
        return None, FoldWSWhy.NOT_ONE_CONV, (f"{ws.param} is standardized for something other than one conv "
                                              f"({ws.consumer or 'no reader'})")
    # aten.convolution spells its arguments differently (transposed, output_padding): left as written
    if conv.target is torch.ops.aten.convolution.default:
        return None, FoldWSWhy.GENERIC_CONV, f"{conv.name} is a generic aten.convolution call"
    nodes = _weight_nodes(conv)
    if any(cap.is_input(n) for n in nodes):
        return None, FoldWSWhy.INPUT_DEPENDENT, "the standardized weight also depends on a model input"
    owner = ws.consumer
    mod = cap.modules.get(owner)
    # the module must be a conv whose forward is the standardization and this conv, nothing else
    if not isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) or list(mod.children()):
        return None, FoldWSWhy.INLINE, (f"{owner or conv.name} is not a conv module of its own (the standardization "
                                        f"is inline)")
    own = {n.name for n in nodes} | {conv.name}
    for n in cap.gm.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output") or n.name in own or cap.is_noise(n):
            continue
        if owner in cap.owner_stack(n):
            return None, FoldWSWhy.COMPUTES_MORE, (f"{owner} also computes {n.name} ({cap.op(n) or n.target}): not "
                                                   f"only standardization + conv")
    if isinstance(conv.args[4] if len(conv.args) > 4 else 0, str):
        return None, FoldWSWhy.STRING_PADDING, f"{owner} pads with a string mode ({conv.args[4]!r})"
    params = [cap.param_name(n) for n in nodes if cap.param_name(n) is not None]
    # a weight other modules read would change under them
    for name in params:
        if sum(1 for p, m in cap.modules.items() for t in m.parameters(recurse=False)
               if t is cap.tensor(name)) > 1:
            return None, FoldWSWhy.SHARED_WEIGHT, f"{name} is shared with another module"
    native = _CONVS[len(cap.shape(conv.args[1]) or (0, 0, 0, 0)) - 2].__name__
    return conv, FoldWSWhy.FOLDED, (f"weight standardization (eps {ws.site.eps:g}) computed once: "
                                    f"{type(mod).__name__} -> nn.{native} holding the standardized {ws.param}")


def _evaluate(cap: Captured, node: fx.Node) -> torch.Tensor:
    """The value of a node computed from parameters only: the graph's own ops, run on the model's tensors."""
    env: dict[str, Any] = {}

    def value(n: Any) -> Any:
        if not isinstance(n, fx.Node):
            return n
        if n.name not in env:
            name = cap.param_name(n)
            if name is not None:
                env[n.name] = cap.tensor(name)
            else:
                args = fx.node.map_arg(n.args, value)
                kwargs = fx.node.map_arg(n.kwargs, value)
                if n.op == "call_function":
                    env[n.name] = n.target(*args, **kwargs)
                elif n.op == "call_method":
                    env[n.name] = getattr(args[0], n.target)(*args[1:], **kwargs)
                else:
                    raise ValueError(f"cannot evaluate {n.op} {n.target}")
        return env[n.name]

    with torch.no_grad():
        return value(node).detach().clone()


class FoldWeightStandardization(Pass):
    """The pass: standardized conv weights computed once, the conv module made native."""

    name = NAME
    check = Check.EXACT
    by_parts = True  # the conv weight alone: a submodule's graph proves it

    def plan(self, cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
        return [Site(NAME, ws.consumer or ws.site.target, conv is not None, why, code)
                for ws in find_weight_standardizations(cap) for conv, code, why in [_decide(cap, ws)]]

    def __call__(self, model: nn.Module, cap: Captured) -> PassResult:
        sites, done = [], []
        for ws in find_weight_standardizations(cap):
            conv, code, why = _decide(cap, ws)
            sites.append(Site(NAME, ws.consumer or ws.site.target, conv is not None, why, code))
            if conv is None:
                continue
            old = cap.modules[ws.consumer]
            weight = _evaluate(cap, conv.args[1]).to(old.weight.dtype)
            # the native conv holds W' and the very bias tensor the user's module has
            new = native_layer(_CONVS[weight.dim() - 2], conv, nn.Parameter(weight, requires_grad=False), old.bias)
            replace_module(model, ws.consumer, new)
            done.append(ws.consumer)
        return PassResult(model, bool(done), tuple(sites))


FOLD_WS = FoldWeightStandardization()

__all__ = ["NAME", "FOLD_WS", "FoldWeightStandardization", "FoldWSWhy"]
