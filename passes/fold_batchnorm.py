"""Fold BatchNorm into the neighbouring conv / linear for inference (eval mode, running statistics).

  s = gamma / sqrt(var + eps),  t = beta - mean * s            (BN(y) = s * y + t per channel)
  backward (layer -> bn):  W' = W * s along the output-channel axis,  b' = b * s + t  (= (b - mean) s + beta)
  forward  (bn -> layer):  y = W (s x + t) + b = (W s) x + (b + W t)   Linear; conv only when nothing pads the
                           BN output with zeros (zero padding would have to be t)
  layer -> reshapes / permutes -> bn: exact when the layer's channel axis lands on the BN's dim 1, followed op by
                           op: a permutation moves it, a row-major reshape keeps axis a of size C iff the sizes
                           before it multiply to the same number (LeViT: (N, L, C) -flatten(0, 1)-> (N*L, C))
  ConvTranspose weight is (in, out/groups, k...): output channel o of group g is W[g*ipg:(g+1)*ipg, o - g*opg].
All arithmetic in float64, cast back to the weight dtype. BN modules become nn.Identity (the user's class and
state_dict keys stay); a functional / inline BN is removed from the traced graph (a GraphModule comes back).
A BN with no foldable neighbour is left as it is: its eval kernel is one fused per-channel pass already
(measured against a scale-and-shift in benchmarks/results/fold.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.nn.utils import parametrize

from normconv.graph.detect import NormSite, find_norms, producer_of
from normconv.graph.capture import Captured
from normconv.match import PERMUTE, VIEW, arg, batch_norm_args, call_name
from normconv.report import PassResult, Site, Why
from normconv.nn.modules import ChannelShift

from .base import Check, Pass, apply, replace_module, skip

NAME = "fold"

# layer classes a BN can fold into, with the forward that must be theirs (a subclass overriding it is user code)
_LAYERS: tuple[type, ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                             nn.ConvTranspose3d, nn.Linear)
_LAYER_OPS = ("conv", "conv_transpose", "linear")
# values that pass through unchanged in eval mode (casts are not: they change the dtype the BN sees)
_PASS_THROUGH_OPS = ("identity", "dropout")


class FoldWhy(Why):
    """One member per rule of the fold at a BatchNorm site (the guards of ``_removable`` and of the neighbours)."""

    BACKWARD = "fold-backward"  # layer -> bn: W' = W s, b' = b s + t
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


def analyze(cap: Captured, norms: Sequence[NormSite]) -> list[Decision]:
    ctx = _Context(cap)
    return [_decide(ctx, s) for s in norms if s.kind == "batchnorm"]


class _Context:
    """Per-capture facts the guards need, computed once (graph size linear)."""

    def __init__(self, cap: Captured):
        self.cap = cap
        self.layer_calls: dict[str, int] = {}
        for n in cap.gm.graph.nodes:
            if cap.op(n) in _LAYER_OPS:
                path = _layer_path(cap, n)
                if path is not None:
                    self.layer_calls[path] = self.layer_calls.get(path, 0) + 1
        # parameter object -> module paths holding it (tied weights cannot carry a fold for one module)
        self.holders: dict[int, list[str]] = {}
        for path, mod in cap.model.named_modules():  # each module object once, under its first path
            for pname in ("weight", "bias"):
                p = mod._parameters.get(pname)
                if p is not None:
                    self.holders.setdefault(id(p), []).append(path)


def _decide(ctx: _Context, site: NormSite) -> Decision:
    try:
        s, t = _removable(ctx, site)
    except _Skip as why:
        return Decision(site, False, str(why), code=why.code)
    reasons = []
    for direction, finder in (("backward", _backward_layer), ("forward", _forward_layer)):
        try:
            path = finder(ctx, site, len(s))
            if _keeps_shift(ctx.cap.modules.get(path), site, direction):
                return Decision(site, True, f"fold the scale into {path} ({direction}); the shift stays as a "
                                            f"ChannelShift: torch's CPU ConvTranspose is 3-12x slower with a bias",
                                direction, path, (s, t), FoldWhy.KEEPS_SHIFT)
            return Decision(site, True, f"fold into {path} ({direction})", direction, path, (s, t),
                            FoldWhy.BACKWARD if direction == "backward" else FoldWhy.FORWARD)
        except _Skip as why:
            reasons.append(f"{direction}: {why}")
    # no foldable neighbour  =>  BN stays: its eval kernel is one per-channel pass already (measured)
    return Decision(site, False, f"no foldable neighbour ({'; '.join(reasons)}); left as is",
                    code=FoldWhy.NO_NEIGHBOUR)


def _removable(ctx: _Context, site: NormSite) -> tuple[torch.Tensor, torch.Tensor]:
    """Guards on the BN itself; returns its per-channel (s, t) in float64."""
    cap = ctx.cap
    mod = cap.modules.get(site.target) if site.source == "module" else None
    # no running statistics  =>  BN normalizes with batch statistics, nothing to fold
    if site.running_mean is None or site.running_var is None:
        raise _Skip(FoldWhy.NO_STATS, "no running statistics (track_running_stats=False): it normalizes with batch "
                                      "statistics")
    # training mode  =>  BN uses batch statistics, folding would change the model
    if mod is not None and mod.training:
        raise _Skip(FoldWhy.TRAINING, "module is in training mode: call .eval() first (or pass --eval)")
    if site.source == "functional" and batch_norm_args(cap.nodes[site.node])["training"] is not False:
        raise _Skip(FoldWhy.BATCH_STATS, "F.batch_norm with training=True normalizes with batch statistics")
    # one BN module at several call sites  =>  removing it would remove every call
    if site.calls > 1 or (mod is not None and cap.module_calls.get(site.target, 1) > 1):
        calls = max(site.calls, cap.module_calls.get(site.target, 1))
        raise _Skip(FoldWhy.BN_SHARED, f"{site.target} is called at {calls} places")
    as_module = site.source == "module" or (site.source == "handwritten" and site.target == site.owner)
    if not as_module:
        # a BN that is not a module can only leave a graph that we can hand back (a traced GraphModule)
        if cap.method != "symbolic_trace":
            raise _Skip(FoldWhy.NOT_REMOVABLE, f"{site.source} batch_norm in a graph captured by {cap.method}: only "
                                               f"a symbolically traceable model can have it removed")
        if not site.self_contained:
            raise _Skip(FoldWhy.INTERMEDIATE, "an intermediate value of the BN is used outside it")
    if as_module and not site.target:
        raise _Skip(FoldWhy.MODEL_IS_BN, "the model itself is the BatchNorm: nothing to fold it into")
    x = cap.nodes[site.input]
    shape = cap.shape(x)
    channels = site.num_features or (shape[1] if shape and len(shape) > 1 else None)
    if shape is None or len(shape) < 2 or channels is None or shape[1] != channels:
        raise _Skip(FoldWhy.NO_CHANNEL_DIM, f"input shape {shape} has no channel dim 1 of size {channels}")
    return _affine(cap, site, mod, channels, len(shape))


def _affine(cap: Captured, site: NormSite, mod: nn.Module | None, channels: int,
            rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BN(y) = s * y + t per channel, in float64."""
    if mod is not None:
        tensors = [mod.running_mean, mod.running_var, mod.weight, mod.bias]
        eps = float(mod.eps)
    else:
        tensors = [cap.tensor(n) if n else None for n in (site.running_mean, site.running_var, site.weight, site.bias)]
        eps = float(site.eps or 0.0)
        for name, ten in zip((site.running_mean, site.running_var), tensors[:2]):
            if ten is None:
                raise _Skip(FoldWhy.STATS_NOT_TENSOR, f"running statistic {name} is not a tensor of the model")
    # native / functional BN reads (C,) vectors on dim 1; a hand-written one broadcasts its own shapes
    rank = rank if site.source == "handwritten" else 2
    vecs = [_channel_vector(v, channels, rank, name) for v, name in zip(tensors, ("mean", "var", "weight", "bias"))]
    mean, var, gamma, beta = vecs
    gamma = (torch.ones(channels, dtype=torch.float64) if gamma is None else gamma) + site.weight_offset
    beta = torch.zeros(channels, dtype=torch.float64) if beta is None else beta
    s = gamma / torch.sqrt(var + eps)
    return s, beta - mean * s


def _channel_vector(v: torch.Tensor | None, channels: int, rank: int, name: str) -> torch.Tensor | None:
    """A parameter broadcast against a rank-``rank`` input as a (channels,) float64 vector, if it is per dim 1."""
    if v is None:
        return None
    v = v.detach().to("cpu", torch.float64)
    if v.numel() == 1:
        return v.reshape(1).expand(channels).clone()
    dims = [i for i, d in enumerate(v.shape) if d != 1]
    # the one non-broadcast dim must line up with dim 1 of the input
    if len(dims) != 1 or v.shape[dims[0]] != channels or rank - v.dim() + dims[0] != 1:
        raise _Skip(FoldWhy.NOT_PER_CHANNEL, f"BN {name} of shape {tuple(v.shape)} does not scale dim 1 of a "
                                             f"{rank}-d input")
    return v.reshape(channels)


# -- neighbours ---------------------------------------------------------------------------------------------


def _layer_path(cap: Captured, node: fx.Node) -> str | None:
    """Module path of the native conv / linear module that computes ``node`` (either graph dialect)."""
    if node.op == "call_module":
        path = node.target
    else:
        path = cap.owner(node)
        weight = arg(node, 1, "weight")
        if not path or cap.param_name(weight) != f"{path}.weight":
            return None  # a functional conv / linear on some tensor, not a module's forward
    mod = cap.modules.get(path)
    if not isinstance(mod, _LAYERS):
        return None
    if type(mod).forward is not next(c for c in _LAYERS if isinstance(mod, c)).forward:
        return None  # a subclass with its own forward
    return path


def _is_pass_through(cap: Captured, node: fx.Node) -> bool:
    op = cap.op(node)
    if op not in _PASS_THROUGH_OPS:
        return False
    if op == "dropout" and node.op == "call_function":
        return arg(node, 2, "training", True) is False
    return True


def _check_layer(ctx: _Context, node: fx.Node, path: str | None, what: str) -> tuple[str, nn.Module]:
    cap = ctx.cap
    kind = cap.op(node)
    # a functional conv / linear  =>  no module owns the weight we would change
    if path is None:
        raise _Skip(FoldWhy.FUNCTIONAL_LAYER, f"{what} is a functional {kind} or a custom layer class, not a torch "
                                              f"conv / linear module")
    mod = cap.modules[path]
    # the same layer called at several places  =>  one weight cannot carry two folds
    if ctx.layer_calls.get(path, 1) > 1:
        raise _Skip(FoldWhy.LAYER_SHARED, f"{path} is called at {ctx.layer_calls[path]} places")
    # tied weights  =>  folding would change the other module too
    others = [p for t in (mod.weight, mod.bias) if t is not None for p in ctx.holders.get(id(t), [path]) if p != path]
    if others:
        raise _Skip(FoldWhy.TIED_WEIGHT, f"{path} shares its weight with {others[0]}")
    if parametrize.is_parametrized(mod):
        raise _Skip(FoldWhy.PARAMETRIZED, f"{path} has a parametrized weight")
    if not mod.weight.is_floating_point():
        raise _Skip(FoldWhy.NON_FLOAT, f"{path} has a {mod.weight.dtype} weight")
    return path, mod


def _backward_layer(ctx: _Context, site: NormSite, channels: int) -> str:
    """The conv / linear whose output channels the BN normalizes, if folding into it is exact."""
    cap = ctx.cap
    node = cap.nodes[site.input]
    chain = []
    while (_is_pass_through(cap, node) or _layout(cap, node) is not None) and isinstance(node.args[0], fx.Node):
        chain.append(node)
        node = node.args[0]
    kind = cap.op(node)
    if kind not in _LAYER_OPS:
        what, prev = producer_of(cap, node)
        before = prev.args[0] if isinstance(prev, fx.Node) and prev.args else None
        # conv -> activation -> bn  =>  the activation does not commute with the scale
        if isinstance(before, fx.Node) and cap.op(before) in _LAYER_OPS and what not in ("cat", "add", "matmul"):
            raise _Skip(FoldWhy.OP_BETWEEN, f"{what} sits between {cap.describe(before)} and the BN")
        raise _Skip(FoldWhy.NOT_A_LAYER, f"input comes from {what}, not a conv or linear")
    path, mod = _check_layer(ctx, node, _layer_path(cap, node), cap.describe(node))
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


def _perm(cap: Captured, node: fx.Node, rank: int) -> list[int] | None:
    """out[i] = in[perm[i]] for a permutation op, or None when its dims are not constants."""
    name, args = call_name(node), list(node.args[1:])
    if name == "t":
        return [1, 0] if rank == 2 else list(range(rank))
    if name in ("transpose", "swapaxes", "swapdims"):
        d = [node.kwargs.get(k, a) for k, a in zip(("dim0", "dim1"), args)] if len(args) >= 2 else \
            [node.kwargs.get("dim0"), node.kwargs.get("dim1")]
        if not all(isinstance(x, int) for x in d):
            return None
        perm = list(range(rank))
        a, b = d[0] % rank, d[1] % rank
        perm[a], perm[b] = perm[b], perm[a]
        return perm
    if name == "permute":
        dims = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args or node.kwargs.get("dims")
        if not dims or not all(isinstance(x, int) for x in dims):
            return None
        return [x % rank for x in dims]
    return None  # movedim: not needed so far


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
            perm = _perm(cap, n, len(src))
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


def _forward_layer(ctx: _Context, site: NormSite, channels: int) -> str:
    """The conv / linear that reads the BN's output channels, if folding into it is exact."""
    cap = ctx.cap
    node = cap.nodes[site.node]
    while True:
        users = cap.users(node)
        if len(users) != 1:
            raise _Skip(FoldWhy.OUTPUT_SHARED, f"output feeds {len(users)} users" if users else "output is unused")
        nxt = users[0]
        if not _is_pass_through(cap, nxt):
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
    path, mod = _check_layer(ctx, nxt, _layer_path(cap, nxt), cap.describe(nxt))
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


def fold_backward(layer: nn.Module, s: torch.Tensor, t: torch.Tensor) -> None:
    """layer -> (s y + t)  =>  layer' (W scaled per output channel, b' = b s + t); in place, float64 math."""
    w = layer.weight.detach().to(torch.float64)
    ones = [1] * (w.dim() - 2)
    # conv / linear -> bn  =>  W'[o] = W[o] s[o]
    if isinstance(layer, nn.modules.conv._ConvTransposeNd):
        # conv_transpose -> bn  =>  W viewed (groups, in/groups, out/groups, k...) scaled on dim 2
        g = layer.groups
        w = (w.reshape(g, w.shape[0] // g, w.shape[1], *w.shape[2:])
             * s.reshape(g, 1, w.shape[1], *ones)).reshape(w.shape)
    else:
        w = w * s.reshape(-1, *([1] * (w.dim() - 1)))
    b = layer.bias.detach().to(torch.float64) if layer.bias is not None else torch.zeros_like(s)
    _store(layer, w, b * s + t)


def fold_forward(layer: nn.Module, s: torch.Tensor, t: torch.Tensor) -> None:
    """(s x + t) -> layer  =>  layer' (W scaled per input channel, b' = b + W t); in place, float64 math."""
    w = layer.weight.detach().to(torch.float64)
    b = layer.bias.detach().to(torch.float64) if layer.bias is not None else torch.zeros(w.shape[0], dtype=w.dtype)
    if isinstance(layer, nn.Linear):
        # bn -> linear  =>  W' = W diag(s),  b' = b + W t
        _store(layer, w * s.reshape(1, -1), b + w @ t)
        return
    # bn -> conv (no zero padding)  =>  input channel of W[o, j] is (o // (out/groups)) * (in/groups) + j
    g, out, ipg = layer.groups, w.shape[0], w.shape[1]
    sg = s.reshape(g, ipg).repeat_interleave(out // g, dim=0)  # (out, in/groups)
    tg = t.reshape(g, ipg).repeat_interleave(out // g, dim=0)
    delta = (w.reshape(out, ipg, -1).sum(-1) * tg).sum(1)
    _store(layer, w * sg.reshape(out, ipg, *([1] * (w.dim() - 2))), b + delta)


def _store(layer: nn.Module, w: torch.Tensor, b: torch.Tensor) -> None:
    """Give the layer new weight and bias Parameters from the float64 results, in the layer's dtype.

    New tensors, never writes into the old ones: those are shared with the user's model, and a weight tied to
    another layer keeps its value there (only this layer is followed by the BatchNorm)."""
    old = layer.weight
    dtype = (layer.bias if layer.bias is not None else old).dtype
    layer.weight = nn.Parameter(w.to(old.dtype).to(old.device), requires_grad=old.requires_grad)
    layer.bias = nn.Parameter(b.to(dtype).to(old.device), requires_grad=old.requires_grad)


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
            s, t = d.affine  # computed once, by the analysis that decided the fold
            layer = cap.modules[d.layer]
            if _keeps_shift(layer, d.site, d.direction):
                fold_backward(layer, s, torch.zeros_like(t))
                layer.bias = None  # convT -> bn  =>  convT(W s) -> ChannelShift(t)
                shifts[d.site.target] = ChannelShift(t.to(layer.weight.dtype))
                continue
            (fold_backward if d.direction == "backward" else fold_forward)(layer, s, t)
        as_graph = any(d.site.source == "functional" or d.site.target != d.site.owner and d.site.source != "module"
                       for d in done)
        if as_graph:
            model = _remove_from_graph(cap, done)
        else:
            for d in done:
                # bn  =>  identity (keys of the rest unchanged), or the shift a bias-free ConvTranspose keeps out
                replace_module(model, d.site.target, shifts.get(d.site.target) or nn.Identity())
        # which layer each folded BN went into: a Hugging Face folder keeps the BN as the shift a bias-free layer
        # cannot carry (io.hf_output)
        return PassResult(model, bool(done), tuple(d.to_site() for d in decisions),
                          extra={"folds": {d.site.target: (d.layer, d.direction) for d in done}})


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
