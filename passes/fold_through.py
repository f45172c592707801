"""The partial fold: a BatchNorm that ``fold`` leaves (an activation or a pool stands between it and its layer) is
folded through the ops around it, as far as they let its scale and its shift pass (graph.channel_ops).

  BN(y) = s * y + t per channel,  s = gamma / sqrt(var + eps),  t = beta - mean * s
  backward: layer -> ops -> BN  where every op passes a positive scale (relu, leaky_relu, prelu, max / avg pools:
            f(a x) = a f(x) for a > 0):  a = |s| folds into the layer (W' = W a, b' = b a), leaving sign(s) behind;
            a = s itself when every op is linear (avg pools); the shift folds back too when every op passes a
            shift (pools without counted zero padding), else it stays: s y + t = sigma (a y + sigma t) with
            sigma = s / a = +-1, so b' += sigma t (a max pool passes |s| and t, never the sign: the sign
            stays after the pool and multiplies what passed it).
  forward:  what is left, sigma * y + t (sigma = sign(s), or s when nothing went back), passes forward through ops
            that let it (pools, reflect / replicate padding, dropout, then reshapes / permutes followed channel by
            channel) into the next conv / linear (W' = W sigma, b' = b + W t): a conv only when nothing on the way,
            the conv's own padding included, pads with zeros (a zero pad would have to be t).
  left over: the BatchNorm becomes ChannelAffine(sigma, t): a per-channel add (sigma = 1), a sign and an add, or
            nothing (nn.Identity) when all of it was absorbed.
  a module whose forward is the BN and then its own children (timm's BatchNormAct2d: F.batch_norm -> drop -> act):
            the same rules from the BN's input and output (the walk forward meets its drop and act as ops); the module
            becomes what is left of the BN, then those children (graph.norm_module.with_tail).
Exact in eval mode, verified like every fold. Every BatchNorm left, and every shift left behind, says why (code and
text). Arithmetic in float64 (graph.bn_affine); only BatchNorm modules (hand-written ones too) and modules whose
forward is a BN and their own children are rewritten: another functional one is ``fold``'s (it removes them from a
traced graph).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from normconv.graph.bn_affine import (LAYER_OPS, Layers, Refusal, as_module, batchnorm_sites, channel_affine,
                                      fold_backward, fold_forward)
from normconv.graph.capture import Captured
from normconv.graph.channel_ops import channel_op, value_in, value_out
from normconv.graph.detect import NormSite, find_norms
from normconv.graph.norm_module import ModuleForm, not_replaceable, replaceable, with_tail
from normconv.match import COPY, PERMUTE, VIEW, call_name, permutation
from normconv.nn.modules import ChannelAffine
from normconv.report import PassResult, Site, Why

from .base import Check, Pass, apply, replace_module, skip

NAME = "fold-through"


class ThroughWhy(Why):
    """One member per rule: what was folded where, what was left behind and why."""

    FOLDED = "folded-through"  # scale and shift absorbed through the ops around the BN: it is gone
    SHIFT_ZERO_PAD = "shift-left-zero-padding"  # scale folded back; the shift stays: zero padding before the next layer
    SHIFT_OP = "shift-left-op-after"  # ... an op after the BN that the rest does not pass (relu, add, ...)
    SHIFT_NO_LAYER = "shift-left-no-layer"  # ... no conv / linear after it (an output, a cat, a norm ...)
    SHIFT_SHARED = "shift-left-output-shared"  # ... a value after it is read more than once
    SHIFT_LAYOUT = "shift-left-layout"  # ... reshapes after it mix its channels with other axes
    SHIFT_LAYER = "shift-left-layer-guard"  # ... the layer after it cannot take it (functional, shared, tied ...)
    DIRECT = "fold-rule"  # a layer right next to the BN: ``fold``'s own rule, nothing to pass through
    NOTHING = "nothing-through"  # neither direction reaches a layer through ops that pass the BN
    NOT_A_MODULE = "not-a-module"  # a functional or inline BN: fold's (it removes them from a traced graph)
    # the BatchNorm itself and the layers (graph.bn_affine, same values)
    NO_STATS = "no-running-stats"
    TRAINING = "training-mode"
    BATCH_STATS = "batch-statistics"
    BN_SHARED = "bn-called-at-several-places"
    NOT_REMOVABLE = "not-removable"
    INTERMEDIATE = "intermediate-used"
    MODEL_IS_BN = "model-is-bn"
    NO_CHANNEL_DIM = "no-channel-dim"
    STATS_NOT_TENSOR = "stats-not-tensor"
    NOT_PER_CHANNEL = "not-per-channel"


class _Stop(Exception):
    """A direction ends here: its code (the shift-left rule) and why."""

    def __init__(self, code: ThroughWhy, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Back:
    layer: str  # the conv / linear before the BN
    ops: tuple[str, ...]  # the ops between, for people
    scale: torch.Tensor = field(repr=False)  # what folds into the layer's output channels (|s| or s)
    shift: torch.Tensor = field(repr=False)  # what folds into its bias (sign(s) t when every op passes it, else 0)


@dataclass(frozen=True)
class Forward:
    layer: str  # the conv / linear after the BN
    ops: tuple[str, ...]
    channels: torch.Tensor = field(repr=False)  # the BN channel each input feature of the layer reads


@dataclass
class Decision:
    site: NormSite
    applied: bool
    reason: str
    code: ThroughWhy
    s: torch.Tensor | None = field(default=None, repr=False)
    t: torch.Tensor | None = field(default=None, repr=False)
    back: Back | None = None
    forward: Forward | None = None
    form: ModuleForm | None = None  # a module whose forward is the BN and its own children: what replaces it keeps them

    def to_site(self) -> Site:
        return (apply if self.applied else skip)(NAME, self.site, self.reason, self.code)


def plan(cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
    return [d.to_site() for d in analyze(cap, norms)]


def analyze(cap: Captured, norms: Sequence[NormSite]) -> list[Decision]:
    layers = Layers(cap)
    return [_decide(cap, layers, s) for s in batchnorm_sites(norms)]


def _decide(cap: Captured, layers: Layers, site: NormSite) -> Decision:
    # a BN module, or a module whose forward is the BN and its own children (timm's BatchNormAct2d); another
    # functional BN leaves a traced graph through fold's own rewrite
    form = None if as_module(site) else replaceable(cap, site)
    if not as_module(site) and form is None:
        why = not_replaceable(cap, site)
        return Decision(site, False, f"{site.source} batch_norm: fold-through rewrites BatchNorm modules"
                                     + (f" ({why})" if why else ""), ThroughWhy.NOT_A_MODULE)
    d = _decide_affine(cap, layers, site)
    if form is not None and d.applied:
        d.form = form
        if form.tail:
            d.reason += f"; {form.path} keeps its own {', '.join(form.tail)} after it"
    return d


def _decide_affine(cap: Captured, layers: Layers, site: NormSite) -> Decision:
    try:
        s, t = channel_affine(cap, site)
    except Refusal as why:
        return Decision(site, False, str(why), ThroughWhy(why.code.value))
    try:
        back = _backward(cap, layers, site, s, t)
        why_not_back = ""
    except _Stop as stop:
        back, why_not_back = None, f"backward: {stop}"
        if stop.code is ThroughWhy.DIRECT:
            return Decision(site, False, str(stop), ThroughWhy.DIRECT)
    sigma = torch.where(back.scale != 0, s / back.scale, torch.ones_like(s)) if back else s
    # the sign left behind multiplies the shift that went back: sigma (a y + b) + rest = s y + t
    rest_t = t - sigma * back.shift if back else t
    d = Decision(site, True, "", ThroughWhy.FOLDED, sigma, rest_t, back)
    if back is not None and bool((sigma == 1).all()) and not bool(rest_t.any()):
        d.reason = f"folded into {back.layer} through {', '.join(back.ops)} (scale and shift): the BatchNorm is gone"
        return d
    try:
        d.forward = _forward(cap, layers, site, sigma, rest_t, direct_ok=back is not None)
    except _Stop as stop:
        if back is None:  # BN -> nothing it passes -> a layer, and no layer behind either
            return Decision(site, False, f"{why_not_back}; forward: {stop}", ThroughWhy.NOTHING
                            if stop.code is not ThroughWhy.DIRECT else ThroughWhy.DIRECT)
        left = f"a per-channel {_rest(sigma, rest_t).replace('shift', 'add')}"
        d.code, d.reason = stop.code, (f"scale folded into {back.layer} through {', '.join(back.ops)}; the rest "
                                       f"stays as {left} (ChannelAffine): {stop}")
        return d
    f = d.forward
    d.reason = (f"scale folded into {back.layer} through {', '.join(back.ops)}, " if back else "") + \
        f"{_rest(sigma, rest_t) if back else 'scale and shift'} into {f.layer}" + \
        (f" through {', '.join(f.ops)}" if f.ops else "") + ": the BatchNorm is gone"
    return d


def _rest(sigma: torch.Tensor, t: torch.Tensor) -> str:
    """What is left of the BN once its scale went back, for people: its sign, its shift, or both."""
    parts = (["sign"] if bool((sigma != 1).any()) else []) + (["shift"] if bool(t.any()) else [])
    return " and ".join(parts) or "nothing"


def _backward(cap: Captured, layers: Layers, site: NormSite, s: torch.Tensor, t: torch.Tensor) -> Back:
    """layer -> ops -> BN: the layer and what of (s, t) reaches it."""
    node, ops, passes = cap.nodes[site.input], [], []
    while True:
        op_node = value_in(cap, node)
        p = channel_op(cap, op_node) if op_node.args and isinstance(op_node.args[0], fx.Node) else None
        if p is None:
            break
        if len(cap.users(node)) != 1:
            raise _Stop(ThroughWhy.NOTHING, f"{cap.describe(node)} is read by {len(cap.users(node))} ops")
        ops.append(cap.describe(op_node))
        passes.append(p)
        node = op_node.args[0]
    if cap.op(node) not in LAYER_OPS:
        raise _Stop(ThroughWhy.NOTHING, f"{cap.describe(node)} before it is no conv / linear reached through ops "
                                        f"that pass a positive scale")
    if len(cap.users(node)) != 1:  # (a layer feeding the BN directly too: then the forward direction may)
        raise _Stop(ThroughWhy.NOTHING, f"{cap.describe(node)} output is also read elsewhere")
    try:
        path, mod = layers.check(node, cap.describe(node))
    except Refusal as why:
        raise _Stop(ThroughWhy.NOTHING, str(why)) from None
    # a layer that feeds the BN directly and can take it  =>  fold's own rule
    if not ops:
        raise _Stop(ThroughWhy.DIRECT, f"{cap.describe(node)} feeds the BN directly: fold's own rule")
    out = mod.out_features if isinstance(mod, nn.Linear) else mod.out_channels
    rank = len(cap.shape(cap.nodes[site.input]) or ())
    if out != len(s) or (isinstance(mod, nn.Linear) and rank != 2) or \
            (not isinstance(mod, nn.Linear) and rank != mod.weight.dim()):
        raise _Stop(ThroughWhy.NOTHING, f"the BN's channels (dim 1 of a {rank}-d input) are not {path}'s {out} "
                                        f"output channels")
    # every op linear  =>  s itself; every op positively homogeneous  =>  |s|, its sign left behind
    scale = s if all(p.any_scale for p in passes) else s.abs()
    # a shift that passes back goes under the sign left behind: s y + t = sigma (|s| y + sigma t), sigma = +-1
    sigma = torch.where(scale != 0, s / scale, torch.ones_like(s))
    return Back(path, tuple(ops[::-1]), scale, sigma * t if all(p.shift for p in passes) else torch.zeros_like(t))


def _forward(cap: Captured, layers: Layers, site: NormSite, sigma: torch.Tensor, t: torch.Tensor,
             direct_ok: bool) -> Forward:
    """BN -> ops -> layer: the layer that takes sigma * y + t, with the BN channel of each of its input features."""
    c = len(sigma)
    node = cap.nodes[site.node]
    shape = cap.shape(node)
    if shape is None:
        raise _Stop(ThroughWhy.SHIFT_LAYOUT, "no recorded shape after the BN")
    index = torch.arange(c).reshape(1, c, *([1] * (len(shape) - 2))).expand(*shape)  # the BN channel of each value
    ops, on_dim1 = [], True
    positive, shifted = bool((sigma > 0).all()), bool(t.any())
    while True:
        users = cap.users(node)
        if len(users) != 1:
            raise _Stop(ThroughWhy.SHIFT_SHARED, f"{cap.describe(node)} is read by {len(users)} ops" if users else
                        "the BN's output is not read by any op")
        nxt = users[0]
        if cap.op(nxt) in LAYER_OPS:
            break
        name, p = call_name(nxt), channel_op(cap, nxt)
        out = cap.shape(value_out(cap, nxt))
        if p is not None and on_dim1 and out is not None:
            # per-channel op: it must let through what is left (a negative sign does not pass a max or a relu)
            if not (p.any_scale or positive and p.positive_scale):
                raise _Stop(ThroughWhy.SHIFT_OP, f"{cap.describe(nxt)} ({p.what}) does not commute with a negative "
                                                 f"scale")
            if shifted and not p.shift:
                code = ThroughWhy.SHIFT_ZERO_PAD if p.what == "zero pad" else ThroughWhy.SHIFT_OP
                raise _Stop(code, f"{cap.describe(nxt)} ({p.what}) does not pass a shift")
            index = torch.arange(c).reshape(1, c, *([1] * (len(out) - 2))).expand(*out)
        elif name in PERMUTE:
            perm = permutation(nxt, index.dim())
            if perm is None:
                raise _Stop(ThroughWhy.SHIFT_LAYOUT, f"{name} at {nxt.name} has non-constant dims")
            index, on_dim1 = index.permute(perm), False
        elif (name in VIEW or isinstance(cap.modules.get(str(nxt.target)) if nxt.op == "call_module" else None,
                                         (nn.Flatten, nn.Unflatten))) and out is not None:
            index = index.reshape(out) if name not in COPY else index
            on_dim1 = on_dim1 and name in COPY
        elif nxt.op == "output":
            raise _Stop(ThroughWhy.SHIFT_NO_LAYER, "no conv / linear after it: the value is the model's output")
        else:
            raise _Stop(ThroughWhy.SHIFT_OP, f"{cap.describe(nxt)} after it does not pass a per-channel "
                                             f"{'shift' if shifted else 'scale'}")
        ops.append(cap.describe(nxt))
        node = value_out(cap, nxt)
    if not ops and not direct_ok:
        raise _Stop(ThroughWhy.DIRECT, f"{cap.describe(nxt)} reads the BN directly: fold's own rule")
    if cap.op(nxt) == "conv_transpose" or (nxt.args[0] if nxt.args else nxt.kwargs.get("input")) is not node:
        raise _Stop(ThroughWhy.SHIFT_LAYER, f"{cap.describe(nxt)} is a transposed conv or does not read the value "
                                            f"as its input")
    try:
        path, mod = layers.check(nxt, cap.describe(nxt))
    except Refusal as why:
        raise _Stop(ThroughWhy.SHIFT_LAYER, str(why)) from None
    if isinstance(mod, nn.Linear):
        # the features of each row must be the same BN channels in every row
        rows = index.reshape(-1, index.shape[-1])
        if not bool((rows == rows[0]).all()):
            raise _Stop(ThroughWhy.SHIFT_LAYOUT, f"the rows {path} reads mix the BN's channels with other axes")
        return Forward(path, tuple(ops), rows[0].clone())
    if index.dim() != mod.weight.dim() or index.shape[1] != mod.in_channels:
        raise _Stop(ThroughWhy.SHIFT_LAYOUT, f"{path} reads a {index.dim()}-d input whose dim 1 is not the BN's "
                                             f"channels")
    chan = index.movedim(1, 0).reshape(index.shape[1], -1)
    if not bool((chan == chan[:, :1]).all()):
        raise _Stop(ThroughWhy.SHIFT_LAYOUT, f"the channels {path} reads mix the BN's channels with other axes")
    # a zero-padded conv pads sigma * y with zeros: exact for sigma, not for a shift
    if shifted and mod.padding_mode == "zeros" and any(q != 0 for q in mod._reversed_padding_repeated_twice):
        raise _Stop(ThroughWhy.SHIFT_ZERO_PAD, f"{path} pads its input with zeros (padding={mod.padding}), which "
                                               f"would have to be the shift")
    return Forward(path, tuple(ops), chan[:, 0].clone())


class FoldThrough(Pass):
    """Apply what ``analyze`` decided: the scale into the layer before, the rest into the layer after or left as a
    ChannelAffine in the BatchNorm's place."""

    name = NAME
    check = Check.EXACT
    by_parts = True  # a BN and the layers around it: a submodule's graph that holds them proves the fold

    def plan(self, cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
        return plan(cap, norms)

    def __call__(self, model: nn.Module, cap: Captured) -> PassResult:
        decisions = analyze(cap, find_norms(cap))
        done = [d for d in decisions if d.applied]
        for d in done:
            if d.back is not None:
                # layer -> ops -> BN  =>  layer scaled by |s| (or s), shifted by t when it passes back
                fold_backward(cap.modules[d.back.layer], d.back.scale, d.back.shift)
            if d.forward is not None:
                # BN -> ops -> layer  =>  W' = W sigma, b' = b + W t, per input feature's BN channel
                f = d.forward
                fold_forward(cap.modules[f.layer], d.s[f.channels], d.t[f.channels])
                left: nn.Module = nn.Identity()
            else:
                left = _leftover(cap, d)
            if d.form is not None:  # what is left of the BN, then the module's own drop, act
                replace_module(model, d.form.path, with_tail(left, cap.modules[d.form.path], d.form.tail))
            else:
                replace_module(model, d.site.target, left)
        return PassResult(model, bool(done), tuple(d.to_site() for d in decisions))


def _leftover(cap: Captured, d: Decision) -> nn.Module:
    """sigma * y + t in the BN's place: nothing, a shift, or a sign and a shift (in the BN's dtype)."""
    out = cap.nodes[d.site.node]
    dtype, rank = cap.dtype(out) or torch.float32, len(cap.shape(out) or (0, 0))
    device = next(iter(cap.modules[d.form.path if d.form else d.site.target].buffers()), torch.empty(0)).device
    scale = None if bool((d.s == 1).all()) else d.s.to(dtype)
    shift = d.t.to(dtype) if bool(d.t.any()) else None
    if scale is None and shift is None:
        return nn.Identity()
    return ChannelAffine(scale, shift, spatial=rank - 2).to(device)


FOLD_THROUGH = FoldThrough()


__all__ = ["NAME", "FOLD_THROUGH", "FoldThrough", "ThroughWhy", "Decision", "analyze", "plan"]
