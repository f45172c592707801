"""A BatchNorm as a per-channel affine, and the conv / linear layers it may be folded into: the analysis the
BatchNorm passes share (fold, fold-through, convert-batchnorm), below them.

  BN(y) = s * y + t per channel (dim 1):   s = gamma / sqrt(var + eps),   t = beta - mean * s
  backward (layer -> bn):  W' = W * s along the output-channel axis,  b' = b * s + t
  forward  (bn -> layer):  W' = W * s along the input-channel axis,   b' = b + W t
  ConvTranspose weight is (in, out/groups, k...): output channel o of group g is W[g*ipg:(g+1)*ipg, o - g*opg].

All arithmetic in float64, cast back to the weight dtype; a layer gets new Parameters (its old tensors are shared with
the user's model). A guard that fails raises ``Refusal(code, message)`` with a ``BNWhy`` code; a pass reports its own
code for the site (the same value in its own ``Why``) and keeps the message as the reason.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.nn.utils import parametrize, prune
from torch.nn.utils.weight_norm import WeightNorm

from normconv.graph.capture import Captured
from normconv.graph.norm_module import not_replaceable, replaceable
from normconv.match import arg, batch_norm_args
from normconv.graph.site import NormSite
from normconv.report import Why

# layer classes a BN can fold into, with the forward that must be theirs (a subclass overriding it is user code)
LAYERS: tuple[type, ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                            nn.ConvTranspose3d, nn.Linear)
LAYER_OPS = ("conv", "conv_transpose", "linear")
# values that pass through unchanged in eval mode (casts are not: they change the dtype the BN sees)
_PASS_THROUGH_OPS = ("identity", "dropout")


class BNWhy(Why):
    """One member per guard of this analysis (the passes that use it carry the same values in their own ``Why``)."""

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
    # a layer that would absorb it
    FUNCTIONAL_LAYER = "functional-layer"  # a functional conv / linear, or a custom layer class: no module weight
    LAYER_SHARED = "layer-called-at-several-places"  # one weight cannot carry two folds
    TIED_WEIGHT = "tied-weight"  # the layer shares its weight with another module
    PARAMETRIZED = "parametrized-weight"  # torch.nn.utils.parametrize on the weight
    NON_FLOAT = "non-float-weight"  # an integer (quantized) weight


class Refusal(Exception):
    """A guard failed: its code, and the message reported for the site."""

    def __init__(self, code: Why, message: str):
        super().__init__(message)
        self.code = code


class Layers:
    """Per-capture facts the layer guards need, computed once (graph size linear): how often each conv / linear
    module is called, and which modules hold each weight (tied weights)."""

    def __init__(self, cap: Captured):
        self.cap = cap
        self.calls: dict[str, int] = {}
        # a weight the forward also reads itself (F.conv2d(x, self.conv.weight)): a graph node besides its layer's call
        self.read: dict[str, str] = {}
        for n in cap.gm.graph.nodes:
            if cap.op(n) in LAYER_OPS:
                path = layer_path(cap, n)
                if path is not None:
                    self.calls[path] = self.calls.get(path, 0) + 1
            elif n.op == "get_attr" and cap.modules.get(n.target.rpartition(".")[0]) is not None and \
                    not _own_read(cap, n):
                self.read.setdefault(n.target.rpartition(".")[0], n.target)
        # parameter object -> module paths holding it (tied weights cannot carry a fold for one module)
        self.holders: dict[int, list[str]] = {}
        for path, mod in cap.model.named_modules():  # each module object once, under its first path
            for pname in ("weight", "bias"):
                p = mod._parameters.get(pname)
                if p is not None:
                    self.holders.setdefault(id(p), []).append(path)

    def check(self, node: fx.Node, what: str) -> tuple[str, nn.Module]:
        """(path, module) of the conv / linear computing ``node``, if its weight can carry a fold; else Refusal."""
        cap = self.cap
        path = layer_path(cap, node)
        # a functional conv / linear  =>  no module owns the weight we would change
        if path is None:
            raise Refusal(BNWhy.FUNCTIONAL_LAYER, f"{what} is a functional {cap.op(node)} or a custom layer class, "
                                                  f"not a torch conv / linear module")
        mod = cap.modules[path]
        # the same layer called at several places  =>  one weight cannot carry two folds
        if self.calls.get(path, 1) > 1:
            raise Refusal(BNWhy.LAYER_SHARED, f"{path} is called at {self.calls[path]} places")
        # tied weights  =>  folding would change the other module too
        others = [(role, p) for role, t in (("weight", mod.weight), ("bias", mod.bias)) if t is not None
                  for p in self.holders.get(id(t), [path]) if p != path]
        if others:
            raise Refusal(BNWhy.TIED_WEIGHT, f"{path} shares its {others[0][0]} with {others[0][1]}")
        if path in self.read:
            raise Refusal(BNWhy.TIED_WEIGHT, f"{self.read[path]} is also read by the forward itself")
        if parametrize.is_parametrized(mod):
            raise Refusal(BNWhy.PARAMETRIZED, f"{path} has a parametrized weight")
        # a weight / bias that is no Parameter of the layer  =>  a hook recomputes it before each forward (torch.nn.
        # utils.prune: orig * mask; the deprecated weight_norm: g, v), and would undo a fold (or refuse its Parameter)
        computed = [n for n in ("weight", "bias") if getattr(mod, n, None) is not None and n not in mod._parameters]
        if computed:
            raise Refusal(BNWhy.PARAMETRIZED, f"{path}'s {computed[0]} is recomputed before each forward "
                                              f"({_recomputed_by(mod, computed[0])})")
        if not mod.weight.is_floating_point():
            raise Refusal(BNWhy.NON_FLOAT, f"{path} has a {mod.weight.dtype} weight")
        return path, mod


def _own_read(cap: Captured, node: fx.Node) -> bool:
    """A get_attr of a layer's tensor read only by that layer's own call: symbolic_trace traces through a conv /
    linear subclass that keeps torch's forward (torchvision's Conv3DSimple), and its call reads the weight so."""
    path = node.target.rpartition(".")[0]
    return bool(node.users) and all(cap.op(u) in LAYER_OPS and layer_path(cap, u) == path for u in node.users)


def _recomputed_by(mod: nn.Module, name: str) -> str:
    """Which hook recomputes ``mod.<name>``, and how its user makes it a Parameter again."""
    for hook in mod._forward_pre_hooks.values():
        # torch.nn.utils.prune (one method, or a PruningContainer of several) on this tensor
        if isinstance(hook, prune.BasePruningMethod) and getattr(hook, "_tensor_name", None) == name:
            return f"torch.nn.utils.prune's mask; torch.nn.utils.prune.remove(module, {name!r}) first"
        if isinstance(hook, WeightNorm) and hook.name == name:
            return "torch.nn.utils.weight_norm's hook; torch.nn.utils.remove_weight_norm first"
    return f"it is a {type(getattr(mod, name)).__name__} attribute, not a Parameter of the layer"


def layer_path(cap: Captured, node: fx.Node) -> str | None:
    """Module path of the native conv / linear module that computes ``node`` (either graph dialect)."""
    if node.op == "call_module":
        path = node.target
    else:
        path = cap.owner(node)
        weight = arg(node, 1, "weight")
        if not path or cap.param_name(weight) != f"{path}.weight":
            return None  # a functional conv / linear on some tensor, not a module's forward
    mod = cap.modules.get(path)
    if not isinstance(mod, LAYERS):
        return None
    if type(mod).forward is not next(c for c in LAYERS if isinstance(mod, c)).forward:
        return None  # a subclass with its own forward
    return path


def is_pass_through(cap: Captured, node: fx.Node) -> bool:
    """An op that hands its input on unchanged in eval mode (identity, dropout off)."""
    op = cap.op(node)
    if op not in _PASS_THROUGH_OPS:
        return False
    if op == "dropout" and node.op == "call_function":
        return arg(node, 2, "training", True) is False
    return True


# ---------------------------------------------------------------------------------------------------------
# the BatchNorm's own guards and its (s, t)


def as_module(site: NormSite) -> bool:
    """The site is a whole module's forward (a BN module, or a hand-written BN module): replaceable as a module."""
    return site.source == "module" or (site.source == "handwritten" and site.target == site.owner)


def channel_affine(cap: Captured, site: NormSite, removable: bool = True,
                   training: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Guards on the BN itself; returns its per-channel (s, t) in float64. ``removable``: also require that the BN
    can leave the model (a module, a module whose forward is the BN and its own children, or a self-contained site of
    a traced graph that can be handed back).
    ``training``: a module in training mode is taken too (its eval-mode self is what is rewritten). Decided once
    per capture (``Captured.found``): each pass that reads the same capture gets the same (s, t) or refusal."""
    key = ("channel_affine", site, removable, training)
    found = cap.found.get(key)
    if found is None:
        try:
            found = cap.found[key] = _channel_affine(cap, site, removable, training)
        except Refusal as why:
            found = cap.found[key] = why
    if isinstance(found, Refusal):
        raise Refusal(found.code, str(found))
    return found


def _channel_affine(cap: Captured, site: NormSite, removable: bool,
                    training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    mod = cap.modules.get(site.target) if site.source == "module" else None
    # no running statistics  =>  BN normalizes with batch statistics, nothing to fold
    if site.running_mean is None or site.running_var is None:
        raise Refusal(BNWhy.NO_STATS, "no running statistics (track_running_stats=False): it normalizes with batch "
                                      "statistics")
    # training mode  =>  BN uses batch statistics, folding would change the model
    if mod is not None and mod.training and not training:
        raise Refusal(BNWhy.TRAINING, "module is in training mode: call .eval() first (or pass --eval)")
    if site.source == "functional" and batch_norm_args(cap.nodes[site.node])["training"] is not False:
        raise Refusal(BNWhy.BATCH_STATS, "F.batch_norm with training=True normalizes with batch statistics")
    # one BN module at several call sites  =>  removing it would remove every call
    if site.calls > 1 or (mod is not None and cap.module_calls.get(site.target, 1) > 1):
        calls = max(site.calls, cap.module_calls.get(site.target, 1))
        raise Refusal(BNWhy.BN_SHARED, f"{site.target} is called at {calls} places")
    if removable and not as_module(site):
        # a BN that is not a module can only leave a graph that we can hand back (a traced GraphModule), or a module
        # whose forward is the BN and its own children alone (timm's BatchNormAct2d: those children replace it)
        if cap.method != "symbolic_trace" and replaceable(cap, site) is None:
            # inside a module that cannot be replaced by its own children  =>  say which and why
            why = not_replaceable(cap, site)
            inside = f" inside {site.owner} ({site.module_type}), which is no module to replace ({why})" if why else ""
            raise Refusal(BNWhy.NOT_REMOVABLE, f"{site.source} batch_norm{inside} in a graph captured by "
                                               f"{cap.method}: only a symbolically traceable model can have it removed")
        if not site.self_contained:
            raise Refusal(BNWhy.INTERMEDIATE, "an intermediate value of the BN is used outside it")
    if removable and as_module(site) and not site.target:
        raise Refusal(BNWhy.MODEL_IS_BN, "the model itself is the BatchNorm: nothing to fold it into")
    x = cap.nodes[site.input]
    shape = cap.shape(x)
    channels = site.num_features or (shape[1] if shape and len(shape) > 1 else None)
    if shape is None or len(shape) < 2 or channels is None or shape[1] != channels:
        raise Refusal(BNWhy.NO_CHANNEL_DIM, f"input shape {shape} has no channel dim 1 of size {channels}")
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
                raise Refusal(BNWhy.STATS_NOT_TENSOR, f"running statistic {name} is not a tensor of the model")
    # native / functional BN reads (C,) vectors on dim 1; a hand-written one broadcasts its own shapes
    rank = rank if site.source == "handwritten" and not site.channel_vectors else 2
    vecs = [channel_vector(v, channels, rank, name) for v, name in zip(tensors, ("mean", "var", "weight", "bias"))]
    mean, var, gamma, beta = vecs
    gamma = (torch.ones(channels, dtype=torch.float64) if gamma is None else gamma) + site.weight_offset
    beta = torch.zeros(channels, dtype=torch.float64) if beta is None else beta
    s = gamma / torch.sqrt(var + eps)
    return s, beta - mean * s


def channel_vector(v: torch.Tensor | None, channels: int, rank: int, name: str) -> torch.Tensor | None:
    """A parameter broadcast against a rank-``rank`` input as a (channels,) float64 vector, if it is per dim 1."""
    if v is None:
        return None
    v = v.detach().to("cpu", torch.float64)
    if v.numel() == 1:
        return v.reshape(1).expand(channels).clone()
    dims = [i for i, d in enumerate(v.shape) if d != 1]
    # the one non-broadcast dim must line up with dim 1 of the input
    if len(dims) != 1 or v.shape[dims[0]] != channels or rank - v.dim() + dims[0] != 1:
        raise Refusal(BNWhy.NOT_PER_CHANNEL, f"BN {name} of shape {tuple(v.shape)} does not scale dim 1 of a "
                                             f"{rank}-d input")
    return v.reshape(channels)


def statistics(cap: Captured, site: NormSite) -> dict[str, torch.Tensor | None]:
    """The site's weight, bias, running_mean and running_var tensors (None where absent), as the model holds them."""
    mod = cap.modules.get(site.target) if site.source == "module" else None
    if mod is not None:
        return {k: getattr(mod, k, None) for k in ("weight", "bias", "running_mean", "running_var")}
    return {k: cap.tensor(getattr(site, k)) if getattr(site, k) else None
            for k in ("weight", "bias", "running_mean", "running_var")}


# ---------------------------------------------------------------------------------------------------------
# the arithmetic


def fold_backward(layer: nn.Module, s: torch.Tensor, t: torch.Tensor) -> None:
    """layer -> (s y + t)  =>  layer' (W scaled per output channel, b' = b s + t); in place, float64 math."""
    store(layer, *folded_backward(layer, s, t))


def folded_backward(layer: nn.Module, s: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fold_backward``'s new (weight, bias) in float64, the layer untouched."""
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
    return w, b * s + t


def fold_forward(layer: nn.Module, s: torch.Tensor, t: torch.Tensor) -> None:
    """(s x + t) -> layer  =>  layer' (W scaled per input channel, b' = b + W t); in place, float64 math."""
    store(layer, *folded_forward(layer, s, t))


def folded_forward(layer: nn.Module, s: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fold_forward``'s new (weight, bias) in float64, the layer untouched."""
    w = layer.weight.detach().to(torch.float64)
    b = layer.bias.detach().to(torch.float64) if layer.bias is not None else torch.zeros(w.shape[0], dtype=w.dtype)
    if isinstance(layer, nn.Linear):
        # bn -> linear  =>  W' = W diag(s),  b' = b + W t
        return w * s.reshape(1, -1), b + w @ t
    # bn -> conv (no zero padding)  =>  input channel of W[o, j] is (o // (out/groups)) * (in/groups) + j
    g, out, ipg = layer.groups, w.shape[0], w.shape[1]
    sg = s.reshape(g, ipg).repeat_interleave(out // g, dim=0)  # (out, in/groups)
    tg = t.reshape(g, ipg).repeat_interleave(out // g, dim=0)
    delta = (w.reshape(out, ipg, -1).sum(-1) * tg).sum(1)
    return w * sg.reshape(out, ipg, *([1] * (w.dim() - 2))), b + delta


def store(layer: nn.Module, w: torch.Tensor, b: torch.Tensor) -> None:
    """Give the layer new weight and bias Parameters from the float64 results, in the layer's dtype.

    New tensors, never writes into the old ones: those are shared with the user's model, and a weight tied to
    another layer keeps its value there (only this layer is followed by the BatchNorm)."""
    old = layer.weight
    dtype = (layer.bias if layer.bias is not None else old).dtype
    layer.weight = nn.Parameter(w.to(old.dtype).to(old.device), requires_grad=old.requires_grad)
    layer.bias = nn.Parameter(b.to(dtype).to(old.device), requires_grad=old.requires_grad)


def batchnorm_sites(norms: Sequence[NormSite]) -> list[NormSite]:
    return [s for s in norms if s.kind == "batchnorm"]


__all__ = ["BNWhy", "Refusal", "Layers", "LAYERS", "LAYER_OPS", "layer_path", "is_pass_through", "as_module",
           "channel_affine", "channel_vector", "statistics", "fold_backward", "fold_forward", "folded_backward",
           "folded_forward", "store",
           "batchnorm_sites"]
