"""Fold BatchNorm into the neighbouring conv / linear for inference (eval mode, running statistics).

  s = gamma / sqrt(var + eps),  t = beta - mean * s            (BN(y) = s * y + t per channel)
  backward (layer -> bn):  W' = W * s along the output-channel axis,  b' = b * s + t  (= (b - mean) s + beta)
  forward  (bn -> layer):  y = W (s x + t) + b = (W s) x + (b + W t)   Linear; conv only when nothing pads the
                           BN output with zeros (zero padding would have to be t)
  layer -> reshapes / permutes -> bn: exact when the layer's channel axis lands on the BN's dim 1, followed op by
                           op: a permutation moves it, a row-major reshape keeps axis a of size C iff the sizes
                           before it multiply to the same number (LeViT: (N, L, C) -flatten(0, 1)-> (N*L, C))
  layer -> bn1 -> bn2:     bn2 (s2, t2) joins bn1's backward fold: (s1 s2, t1 s2 + t2) into the layer, both removed
  ConvTranspose weight is (in, out/groups, k...): output channel o of group g is W[g*ipg:(g+1)*ipg, o - g*opg].
All arithmetic in float64, cast back to the weight dtype; in float16 / bfloat16 a fold whose weights or bias would pass
half the dtype's max (its products would overflow) is not made, and that BN stays. BN modules become nn.Identity (the
user's class and state_dict keys stay); a module whose forward is F.batch_norm and then its own children (timm's
BatchNormAct2d: drop, act) becomes those children alone (nn.Sequential under the same names; graph.norm_module),
whatever captured the model; any other functional / inline BN is removed from the traced graph (a GraphModule comes
back, and a note says so).
A BN with no foldable neighbour is left as it is: its eval kernel is one fused per-channel pass already
(measured against a scale-and-shift in benchmarks/results/fold.md).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from normconv.graph.bn_affine import (LAYER_OPS, Layers, Refusal, as_module, batchnorm_sites, channel_affine,
                                      fold_backward, fold_forward, folded_backward, folded_forward, is_pass_through,
                                      store)
from normconv.graph.detect import NormSite, find_norms, producer_of
from normconv.graph.capture import Captured
from normconv.graph.norm_module import ModuleForm, replaceable, with_tail
from normconv.match import PERMUTE, VIEW, call_name, permutation
from normconv.report import PassResult, Site, Why
from normconv.nn.modules import ChannelShift

from .base import Check, Pass, apply, replace_module, skip

NAME = "fold"


class FoldWhy(Why):
    """One member per rule of the fold at a BatchNorm site (the guards of ``graph.bn_affine.channel_affine`` and
    ``Layers.check`` under the same values, and the neighbours')."""

    BACKWARD = "fold-backward"  # layer -> bn: W' = W s, b' = b s + t
    CHAINED = "fold-backward-after-bn"  # layer -> bn1 -> bn2: bn2's affine joins bn1's backward fold
    FORWARD = "fold-forward"  # bn -> layer: W' = W s, b' = b + W t
    KEEPS_SHIFT = "fold-scale-keep-shift"  # bias-free ConvTranspose -> bn: s into W, t as a ChannelShift
    NO_NEIGHBOUR = "no-foldable-neighbour"  # neither neighbour takes the fold (each direction's guard says why)
    # the BatchNorm itself
    NO_STATS = "no-running-stats"  # track_running_stats=False: batch statistics
    TRAINING = "training-mode"  # the module is in training mode
    BATCH_STATS = "batch-statistics"  # F.batch_norm(training=True)
    BN_SHARED = "bn-called-at-several-places"  # removing it would remove every call
    NOT_REMOVABLE = "not-removable"  # a functional BN in a graph that cannot be handed back (not symbolic_trace)
    INTERMEDIATE = "intermediate-used"  # a value inside the hand-written BN is used outside it
    MODEL_IS_BN = "model-is-bn"  # the model itself is the BatchNorm
    NO_CHANNEL_DIM = "no-channel-dim"  # the input has no dim 1 of the BN's size
    STATS_NOT_TENSOR = "stats-not-tensor"  # a running statistic is not a tensor of the model
    NOT_PER_CHANNEL = "not-per-channel"  # a statistic or affine does not scale dim 1
    # its neighbours
    FUNCTIONAL_LAYER = "functional-layer"  # a functional conv / linear, or a custom layer class: no module weight
    LAYER_SHARED = "layer-called-at-several-places"  # one weight cannot carry two folds
    TIED_WEIGHT = "tied-weight"  # the layer shares its weight with another module
    PARAMETRIZED = "parametrized-weight"  # torch.nn.utils.parametrize on the weight
    NON_FLOAT = "non-float-weight"  # an integer (quantized) weight
    OP_BETWEEN = "op-between"  # an activation (or other op) sits between the layer and the BN
    NOT_A_LAYER = "not-a-layer"  # the neighbour is no conv / linear
    OUTPUT_SHARED = "output-shared"  # a value on the way is used elsewhere (or not used)
    CHANNELS = "channel-mismatch"  # channel counts or ranks do not line up with dim 1
    LAYOUT = "layout-moves-channels"  # reshapes / permutes on the way move or mix the channel axis
    NO_SHAPE = "no-shape"  # no recorded shape to follow the channel axis
    TRANSPOSED_READER = "transposed-conv-reader"  # bn -> ConvTranspose: its edge outputs see fewer inputs
    ZERO_PADDING = "zero-padding"  # bn -> conv padding zeros, which would have to be t
    HALF_RANGE = "past-half-range"  # the folded weight or bias would pass half of float16's / bfloat16's max


@dataclass(frozen=True)
class Decision:
    """What the pass does at one BN site: fold it backward / forward into ``layer``, or skip it and why."""

    site: NormSite
    applied: bool
    reason: str
    direction: str | None = None  # "backward" | "forward"
    layer: str | None = None  # module path of the conv / linear that absorbs the BN
    affine: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)  # (s, t)
    code: FoldWhy | None = None
    # a half layer's folded (weight, bias) in float64, computed once by the range check and stored by the pass
    folded: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)
    # a BN computed inside a module whose forward is the BN and its own children: that module, replaced by them
    form: ModuleForm | None = field(default=None, repr=False, compare=False)
    layer_of: str | None = None  # CHAINED: the BN before it, whose fold into ``layer`` carries its affine too

    def to_site(self) -> Site:
        return (apply if self.applied else skip)(NAME, self.site, self.reason, self.code)


class _Skip(Exception):
    """A guard failed: its code, and the message reported for the site."""

    def __init__(self, code: FoldWhy, message: str):
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------------------------------------------------
# analysis: one function decides, plan() shows it, the pass applies it


def plan(cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
    """What folding would do at each batchnorm site, or why it cannot."""
    return [d.to_site() for d in analyze(cap, norms)]


def analyze(cap: Captured, norms: Sequence[NormSite], chain: bool = True) -> list[Decision]:
    """Each BatchNorm site's decision; ``chain=False``: a BN after a BN is left (``_after_batchnorm``), each fold
    carries its own BN's affine alone (``--stream`` rewrites each BN's tensors apart)."""
    ctx = Layers(cap)
    out: list[Decision] = []
    for site in batchnorm_sites(norms):  # in graph order: a chain's first BN is decided before the next
        d = _decide(ctx, site)
        out.append(d if d.applied or not chain else _after_batchnorm(ctx, site, out) or d)
    return out


def _after_batchnorm(ctx: Layers, site: NormSite, decided: list[Decision]) -> Decision | None:
    """layer -> bn1 -> bn2, bn1 folding backward and read by bn2 alone (through pass-through ops): bn2's affine
    joins bn1's fold, s2 (s1 y + t1) + t2 = (s1 s2) y + (t1 s2 + t2) (bn1's decision in ``decided`` takes the
    product; where bn1 keeps its shift as a ChannelShift, the shift kept is the product's); bn2's own decision, or
    None where the chain does not hold."""
    cap = ctx.cap
    node = cap.nodes[site.input]
    while is_pass_through(cap, node) and isinstance(node.args[0], fx.Node) and len(cap.users(node)) == 1:
        node = node.args[0]
    i = next((i for i, d in enumerate(decided) if d.site.node == node.name), None)
    if i is None or decided[i].code not in (FoldWhy.BACKWARD, FoldWhy.KEEPS_SHIFT, FoldWhy.CHAINED) or \
            len(cap.users(node)) != 1:
        return None
    while decided[i].code is FoldWhy.CHAINED:  # the chain's first BN holds the product
        i = next(j for j, d in enumerate(decided) if d.site.target == decided[i].layer_of)
    first = decided[i]
    try:
        s2, t2 = channel_affine(cap, site)
        (s1, t1), path = first.affine, first.layer
        s, t = s1 * s2, t1 * s2 + t2
        folded = _in_range(cap.modules.get(path), path, s, t, "backward")
    except (Refusal, _Skip):
        return None
    decided[i] = dataclasses.replace(first, affine=(s, t), folded=folded)
    return Decision(site, True, f"fold into {path} (backward) with {first.site.target} before it: "
                                f"s2 (s1 y + t1) + t2", "backward", path, None, FoldWhy.CHAINED,
                    form=replaceable(cap, site), layer_of=first.site.target)


def _decide(ctx: Layers, site: NormSite) -> Decision:
    try:
        s, t = channel_affine(ctx.cap, site)
    except Refusal as why:
        return Decision(site, False, str(why), code=FoldWhy(why.code.value))
    except _Skip as why:
        return Decision(site, False, str(why), code=why.code)
    reasons, codes = [], set()
    for direction, finder in (("backward", _backward_layer), ("forward", _forward_layer)):
        try:
            path = finder(ctx, site, len(s))
            folded = _in_range(ctx.cap.modules.get(path), path, s, t, direction)
            if _keeps_shift(ctx.cap.modules.get(path), site, direction):
                return Decision(site, True, f"fold the scale into {path} ({direction}); the shift stays as a "
                                            f"ChannelShift: torch's CPU ConvTranspose is 3-12x slower with a bias",
                                direction, path, (s, t), FoldWhy.KEEPS_SHIFT)
            form = replaceable(ctx.cap, site)
            rest = f"; {form.path} becomes its own {', '.join(form.tail)}" if form and form.tail else ""
            return Decision(site, True, f"fold into {path} ({direction}){rest}", direction, path, (s, t),
                            FoldWhy.BACKWARD if direction == "backward" else FoldWhy.FORWARD, folded, form)
        except _Skip as why:
            reasons.append(f"{direction}: {why}")
            codes.add(why.code)
    # no foldable neighbour  =>  BN stays: its eval kernel is one per-channel pass already (measured)
    return Decision(site, False, f"no foldable neighbour ({'; '.join(reasons)}); left as is",
                    code=FoldWhy.HALF_RANGE if FoldWhy.HALF_RANGE in codes else FoldWhy.NO_NEIGHBOUR)


def _in_range(layer: nn.Module | None, path: str, s: torch.Tensor, t: torch.Tensor,
              direction: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A half layer's folded weight and bias (computed in float64, as the fold will) within half its dtype's max:
    past it the products overflow (``graph.headroom``'s rule), so the BN stays where it was. Returns them (the fold
    stores them as they are), None for a layer that is not half precision."""
    w = getattr(layer, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dtype not in (torch.float16, torch.bfloat16) or w.is_meta:
        return None  # a meta weight (--stream's analysis): no values yet; its blocks are checked as they are written
    limit = torch.finfo(w.dtype).max
    folded = (folded_backward if direction == "backward" else folded_forward)(layer, s, t)
    big = max(float(v.abs().max()) for v in folded)
    if not big <= limit / 2:  # NaN too
        raise _Skip(FoldWhy.HALF_RANGE, f"the folded weights of {path} would reach {big:.3g}, past half of "
                                        f"{str(w.dtype).removeprefix('torch.')}'s max {limit:.6g} (its products "
                                        f"would overflow)")
    return folded


# -- neighbours ---------------------------------------------------------------------------------------------


def _layer(ctx: Layers, node: fx.Node) -> tuple[str, nn.Module]:
    """The layer guards of ``graph.bn_affine``, as this pass's own skip."""
    try:
        return ctx.check(node, ctx.cap.describe(node))
    except Refusal as why:
        raise _Skip(FoldWhy(why.code.value), str(why)) from None


def _backward_layer(ctx: Layers, site: NormSite, channels: int) -> str:
    """The conv / linear whose output channels the BN normalizes, if folding into it is exact."""
    cap = ctx.cap
    node = cap.nodes[site.input]
    chain = []
    while (is_pass_through(cap, node) or _layout(cap, node) is not None) and isinstance(node.args[0], fx.Node):
        chain.append(node)
        node = node.args[0]
    kind = cap.op(node)
    if kind not in LAYER_OPS:
        what, prev = producer_of(cap, node)
        before = prev.args[0] if isinstance(prev, fx.Node) and prev.args else None
        # conv -> activation -> bn  =>  the activation does not commute with the scale
        if isinstance(before, fx.Node) and cap.op(before) in LAYER_OPS and what not in ("cat", "add", "matmul"):
            raise _Skip(FoldWhy.OP_BETWEEN, f"{what} sits between {cap.describe(before)} and the BN")
        raise _Skip(FoldWhy.NOT_A_LAYER, f"input comes from {what}, not a conv or linear")
    path, mod = _layer(ctx, node)
    # conv output used elsewhere  =>  folding would change the other user (x.reshape_as(y) reads y's shape only)
    for n in [node, *chain]:
        if len([u for u in cap.users(n) if not _shape_only_use(cap, u, n)]) > 1:
            raise _Skip(FoldWhy.OUTPUT_SHARED, f"{path} output is also used elsewhere")
    layouts = [n for n in chain if _layout(cap, n) is not None]
    if layouts:
        # layer -> reshapes / permutes -> bn  =>  exact iff the layer's channel axis lands on the BN's dim 1
        _channel_axis_kept(cap, node, mod, layouts[::-1], path)
        out = mod.out_features if isinstance(mod, nn.Linear) else mod.out_channels
        if out != channels:
            raise _Skip(FoldWhy.CHANNELS, f"BN has {channels} channels, {path} writes {out}")
        return path
    rank = len(cap.shape(cap.nodes[site.input]) or ())
    # BN normalizes dim 1; Linear writes features on the last dim  =>  only (N, C) matches
    if isinstance(mod, nn.Linear) and rank != 2:
        raise _Skip(FoldWhy.CHANNELS, f"BN normalizes dim 1 of a {rank}-d output, but {path} writes features on "
                                      f"the last dim")
    if not isinstance(mod, nn.Linear) and rank != mod.weight.dim():
        raise _Skip(FoldWhy.CHANNELS, f"{path} output is {rank}-d (unbatched?): dim 1 is not its channel dim")
    out = mod.out_features if isinstance(mod, nn.Linear) else mod.out_channels
    if out != channels:
        raise _Skip(FoldWhy.CHANNELS, f"BN has {channels} channels, {path} writes {out}")
    return path


# layout ops (normconv.match): PERMUTE (the axis moves with the permutation) and VIEW (row-major reshapes, judged on
# shapes; copies keep the shape and the axis)


def _layout(cap: Captured, node: fx.Node) -> str | None:
    """'permute' / 'reshape' for an op that only moves or regroups the elements of its first argument."""
    name = call_name(node)
    if name not in PERMUTE and name not in VIEW:
        return None
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    return "permute" if name in PERMUTE else "reshape"


def _shape_only_use(cap: Captured, user: fx.Node, n: fx.Node) -> bool:
    """``y.reshape_as(n)`` / ``y.view_as(n)``: ``n`` supplies a shape, not values."""
    return call_name(user) in ("reshape_as", "view_as", "expand_as") and user.args[0] is not n


def _channel_axis_kept(cap: Captured, layer: fx.Node, mod: nn.Module, layouts, path: str) -> None:
    """Follow the layer's channel axis through ``layouts`` (graph order); it must end on dim 1."""
    shape = cap.shape(layer)
    if shape is None:
        raise _Skip(FoldWhy.NO_SHAPE, f"no recorded shape for the output of {path}")
    axis = len(shape) - 1 if isinstance(mod, nn.Linear) else 1  # Linear writes the last dim, conv dim 1
    if not isinstance(mod, nn.Linear) and len(shape) != mod.weight.dim():
        raise _Skip(FoldWhy.CHANNELS, f"{path} output is {len(shape)}-d (unbatched?): dim 1 is not its channel dim")
    c = shape[axis]
    for n in layouts:
        src, out = cap.shape(n.args[0]), cap.shape(n)
        if src is None or out is None:
            raise _Skip(FoldWhy.NO_SHAPE, f"no recorded shape at {cap.describe(n)}")
        if _layout(cap, n) == "permute":
            perm = permutation(n, len(src))
            if perm is None:
                raise _Skip(FoldWhy.LAYOUT, f"{call_name(n)} at {n.name} has non-constant dims")
            # out[i] = in[perm[i]]  =>  the channel axis moves to perm.index(axis)
            axis = perm.index(axis)
            continue
        # row-major reshape keeps axis a of size C iff the sizes before it multiply to the same number
        before = math.prod(src[:axis])
        hits = [i for i in range(len(out)) if out[i] == c and math.prod(out[:i]) == before]
        if not hits:
            raise _Skip(FoldWhy.LAYOUT, f"{call_name(n)} at {n.name} {tuple(src)} -> {tuple(out)} mixes the channel "
                                        f"axis of {path} with others")
        axis = hits[0]
    if axis != 1:
        raise _Skip(FoldWhy.LAYOUT, f"BN normalizes dim 1, but the channels of {path} arrive on dim {axis} after "
                    f"{', '.join(call_name(n) for n in layouts)}")


def _forward_layer(ctx: Layers, site: NormSite, channels: int) -> str:
    """The conv / linear that reads the BN's output channels, if folding into it is exact."""
    cap = ctx.cap
    node = cap.nodes[site.node]
    while True:
        users = cap.users(node)
        if len(users) != 1:
            raise _Skip(FoldWhy.OUTPUT_SHARED, f"output feeds {len(users)} users" if users else "output is unused")
        nxt = users[0]
        if not is_pass_through(cap, nxt):
            break
        node = nxt
    kind = cap.op(nxt)
    if kind not in ("conv", "linear"):
        what = producer_of(cap, nxt)[0] if kind != "conv_transpose" else "conv_transpose"
        if kind == "conv_transpose":
            raise _Skip(FoldWhy.TRANSPOSED_READER, f"{cap.describe(nxt)} is a transposed conv: its edge outputs see "
                                                   f"fewer inputs, not exact")
        raise _Skip(FoldWhy.NOT_A_LAYER, f"output feeds {what}, not a conv or linear")
    if (nxt.args[0] if nxt.args else nxt.kwargs.get("input")) is not node:
        raise _Skip(FoldWhy.OUTPUT_SHARED, f"output is not the input of {cap.describe(nxt)}")
    path, mod = _layer(ctx, nxt)
    rank = len(cap.shape(cap.nodes[site.node]) or ())
    if isinstance(mod, nn.Linear):
        # BN scales dim 1; Linear mixes the last dim  =>  only (N, C) matches
        if rank != 2:
            raise _Skip(FoldWhy.CHANNELS, f"BN scales dim 1 of a {rank}-d tensor, but {path} reads the last dim")
        return path
    if rank != mod.weight.dim():
        raise _Skip(FoldWhy.CHANNELS, f"{path} input is {rank}-d (unbatched?): dim 1 is not its channel dim")
    # bn -> conv with zero padding  =>  the padded zeros would have to be t (reflect / replicate / circular copy s x + t)
    if mod.padding_mode == "zeros" and any(p != 0 for p in mod._reversed_padding_repeated_twice):
        raise _Skip(FoldWhy.ZERO_PADDING, f"forward fold into {path} needs padding=0 (it pads the BN output with "
                                          f"zeros, padding={mod.padding})")
    return path


# ---------------------------------------------------------------------------------------------------------
# the rewrite


class FoldBatchNorm(Pass):
    """The fold pass: apply what ``analyze`` decided, remove folded BNs, hand back the model."""

    name = NAME
    check = Check.EXACT
    by_parts = True  # a BN and its conv / linear neighbour: a submodule's graph that holds both proves the fold

    def plan(self, cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
        return plan(cap, norms)

    def __call__(self, model: nn.Module, cap: Captured) -> PassResult:
        decisions = analyze(cap, find_norms(cap))
        done = [d for d in decisions if d.applied]
        shifts: dict[str, nn.Module] = {}
        for d in done:
            if d.code is FoldWhy.CHAINED:  # its affine is in the fold of the BN before it: only removed
                continue
            s, t = d.affine  # computed once, by the analysis that decided the fold
            layer = cap.modules[d.layer]
            if _keeps_shift(layer, d.site, d.direction):
                fold_backward(layer, s, torch.zeros_like(t))
                layer.bias = None  # convT -> bn  =>  convT(W s) -> ChannelShift(t)
                shifts[d.site.target] = ChannelShift(t.to(layer.weight.dtype))
                continue
            if d.folded is not None:  # a half layer: the float64 values its range check computed
                store(layer, *d.folded)
            else:
                (fold_backward if d.direction == "backward" else fold_forward)(layer, s, t)
        # a BN neither a module nor inside one that its own children can replace  =>  only the traced graph loses it
        graph_only = [d for d in done if not as_module(d.site) and d.form is None]
        notes: tuple[str, ...] = ()
        if graph_only:
            model = _remove_from_graph(cap, done)
            if not isinstance(cap.model, fx.GraphModule):  # the user's class is lost: say so
                notes = (f"a torch.fx.GraphModule comes back, not {type(cap.model).__name__}: {len(graph_only)} "
                         f"BatchNorm (e.g. {graph_only[0].site.target} in "
                         f"{graph_only[0].site.owner or 'the root forward'}) is computed functionally in a forward "
                         f"that does more, and only the traced graph can lose it; the model's own methods besides "
                         f"forward are not on it",)
        else:
            for d in done:
                if d.form is not None:
                    # module = bn -> its children  =>  its children alone, under their names (keys unchanged)
                    replace_module(model, d.form.path,
                                   with_tail(nn.Identity(), cap.modules[d.form.path], d.form.tail))
                    continue
                # bn  =>  identity (keys of the rest unchanged), or the shift a bias-free ConvTranspose keeps out
                replace_module(model, d.site.target, shifts.get(d.site.target) or nn.Identity())
        # which layer each folded BN went into, and its eps: a Hugging Face folder keeps the BN as the identity, or
        # as the shift a bias-free layer cannot carry (io.hf_output)
        return PassResult(model, bool(done), tuple(d.to_site() for d in decisions), notes,
                          extra={"folds": {d.site.target: (d.layer, d.direction, d.site.eps)
                                          for d in done}})


def _keeps_shift(layer: nn.Module | None, site: NormSite, direction: str) -> bool:
    """bias-free ConvTranspose -> BN module  =>  scale into W, shift as ChannelShift (a bias there is slow)."""
    return (direction == "backward" and isinstance(layer, nn.modules.conv._ConvTransposeNd) and layer.bias is None
            and site.source != "functional" and site.target == site.owner)


def _remove_from_graph(cap: Captured, done: list[Decision]) -> fx.GraphModule:
    """Functional / inline BN: route each folded BN's input to its users, drop the dead nodes (traced graph)."""
    gm = cap.gm
    before = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for d in done:
        cap.nodes[d.site.node].replace_all_uses_with(cap.nodes[d.site.input])  # bn(y)  =>  y
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for target in before - used:  # the folded BNs' statistics and affine no longer belong to the model
        parent, _, name = target.rpartition(".")
        try:
            owner = gm.get_submodule(parent) if parent else gm
        except AttributeError:  # its container went with delete_all_unused_submodules
            continue
        if name in owner._parameters or name in owner._buffers:
            delattr(owner, name)
    gm.recompile()
    return gm


FOLD = FoldBatchNorm()


__all__ = ["NAME", "FOLD", "FoldBatchNorm", "Decision", "analyze", "plan", "fold_backward", "fold_forward"]
