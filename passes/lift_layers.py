"""Lift functional convs / linears on constant weights back into native modules (exported programs).

    aten.conv{1,2,3}d(x, W, b, stride, padding, dilation, groups)  =>  nn.Conv{1,2,3}d(...)(x), same W and b
    aten.linear(x, W, b)                                            =>  nn.Linear(...)(x),        same W and b

A ``torch.export`` program (``.pt2``) keeps no layer modules: its graph calls ``aten.conv2d`` on ``get_attr``
weights held by plain containers. nn.ConvNd / nn.Linear compute exactly that call (zero padding mode), so
replacing the container that holds W (and b) by the native module holding the same tensors changes no output,
no tensor and no state_dict key; the folds that need a layer module then apply as on the user's own model.
A call is lifted only when its container holds just those tensors and nothing else reads them.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from normconv.graph.capture import Captured
from normconv.graph.detect import NormSite
from normconv.graph.native import native_layer
from normconv.report import PassResult, Site, Why

from .base import Check, Pass

NAME = "lift"
_aten = torch.ops.aten
# functional call -> the native module that computes it
_LIFTABLE = {_aten.conv1d.default: nn.Conv1d, _aten.conv2d.default: nn.Conv2d, _aten.conv3d.default: nn.Conv3d,
             _aten.linear.default: nn.Linear}


def _attr(gm: nn.Module, target: str) -> torch.Tensor:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _container(gm: fx.GraphModule, node: fx.Node) -> tuple[str, nn.Module] | None:
    """The container path whose only state is this call's weight (and bias), read by this call alone."""
    w = node.args[1] if len(node.args) > 1 else None
    b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    if not (isinstance(w, fx.Node) and w.op == "get_attr" and len(w.users) == 1):
        return None
    if b is not None and not (isinstance(b, fx.Node) and b.op == "get_attr" and len(b.users) == 1):
        return None
    path, _, name = w.target.rpartition(".")
    if name != "weight" or not path or (b is not None and b.target != f"{path}.bias"):
        return None
    holder = gm.get_submodule(path)
    state = set(holder._parameters) | set(holder._buffers)
    if type(holder) is not nn.Module or list(holder.children()) or state != ({"weight", "bias"} if b is not None
                                                                               else {"weight"}):
        return None
    return path, holder


class LiftWhy(Why):
    """The one rule of the lift (a call it cannot lift is left as it is, silently: nothing was asked of it)."""

    LIFTED = "lifted"  # a functional conv / linear on constant weights is now the native module holding them


class LiftLayers(Pass):
    """The pass: returns the model itself when there is nothing to lift (a user's own module tree)."""

    name = NAME
    check = Check.EXACT

    def plan(self, cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
        return []

    def __call__(self, model: nn.Module, cap: Captured) -> PassResult:
        gm = cap.gm
        lifted = []
        for node in list(gm.graph.nodes):
            kind = _LIFTABLE.get(node.target) if node.op == "call_function" else None
            found = _container(gm, node) if kind is not None else None
            if found is None or (kind is not nn.Linear and isinstance(node.args[4] if len(node.args) > 4 else 0,
                                                                        str)):
                continue  # padding="same" / "valid" strings: left functional
            path, holder = found
            bias = holder._parameters.get("bias", holder._buffers.get("bias"))
            weight = holder._parameters.get("weight", holder._buffers.get("weight"))
            # functional conv / linear on constant weights  =>  the native module holding them, called in place
            parent, _, child = path.rpartition(".")
            setattr(gm.get_submodule(parent) if parent else gm, child, native_layer(kind, node, weight, bias))
            attrs = [a for a in node.args[1:3] if isinstance(a, fx.Node)]
            with gm.graph.inserting_before(node):
                call = gm.graph.call_module(path, (node.args[0],))
            call.meta = dict(node.meta)
            node.replace_all_uses_with(call)
            gm.graph.erase_node(node)
            for a in attrs:
                gm.graph.erase_node(a)
            lifted.append(path)
        if not lifted:
            return PassResult(model, False, ())
        gm.recompile()
        gm.training = model.training  # the flag itself: an exported program's module refuses .train()
        return PassResult(gm, True, tuple(Site(NAME, p, True, "functional call on constant weights made a native "
                                                             "module (exported program)", LiftWhy.LIFTED)
                                          for p in lifted))


LIFT = LiftLayers()

__all__ = ["LIFT", "LiftLayers", "LiftWhy", "NAME"]
