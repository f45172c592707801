"""Norm detection: every normalization site of a captured graph, whatever way it was written.

Three sources, one record (``NormSite``):
  module       a native torch norm module (BatchNorm*, SyncBatchNorm, LayerNorm, GroupNorm, InstanceNorm*, RMSNorm)
  functional   F.layer_norm / F.batch_norm / F.group_norm / F.instance_norm / F.rms_norm or their aten forms
  handwritten  a subgraph recognized by what it computes, anchored on its (r)sqrt:
                 y = (x - mean_D(x)) * rsqrt(var_D(x) + eps) [* w] [+ b]     -> layernorm (instancenorm on spatial D)
                 y = x * rsqrt(mean_D(x^2) + eps) [* w | * (1 + w)]           -> rmsnorm (Llama, T5, Gemma styles)
                 y = (x - running_mean) / sqrt(running_var + eps) [* w] [+ b] -> batchnorm (inference form)
               with ``/ sqrt`` for ``* rsqrt``, ``var(unbiased=False)`` or ``mean((x - m)^2)`` for the variance,
               and dtype casts anywhere in between.

Placement says what feeds the norm and where it sits in a residual stream:
  pre-norm    x + f(N(x)): the norm's input also feeds a residual add of a sublayer of its output
  post-norm   N(x + f(x)): the norm's input is a residual add and the stream continues through the norm
  final-norm  N(x + f(M(x))): a residual add whose branch was itself pre-normed (last norm of a pre-norm stack)
  after-conv / after-linear / after-embedding / after-add / input / other: the producer of its input
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import operator
from collections import Counter

import torch
import torch.fx as fx

from normconv.graph.capture import Captured
from normconv.graph.match import PARAM_VIEW as _VIEW_METHODS
from normconv.graph.match import TRANSPARENT, arg, batch_norm_args, dims_of, is_native_norm, scalar

KINDS = ("batchnorm", "layernorm", "rmsnorm", "groupnorm", "instancenorm")

# canonical norm op -> kind
_NORM_OPS = {
    "batch_norm": "batchnorm",
    "layer_norm": "layernorm",
    "rms_norm": "rmsnorm",
    "group_norm": "groupnorm",
    "instance_norm": "instancenorm",
}

@dataclass(frozen=True)
class NormSite:
    """One normalization site and everything a pass needs to decide about it."""

    target: str  # module path (module / handwritten module) or node name (functional / inline)
    kind: str  # one of KINDS
    source: str  # module | functional | handwritten
    node: str  # graph node holding the norm's output
    input: str  # graph node holding the norm's input
    owner: str = ""  # module path that computes the site ('' = root)
    module_type: str | None = None  # class name of the norm module (native or hand-written)
    dims: tuple[int, ...] | None = None  # normalized dims, negative (layernorm / rmsnorm)
    normalized_shape: tuple[int, ...] | None = None
    num_features: int | None = None  # channels (batchnorm / groupnorm / instancenorm)
    num_groups: int | None = None
    eps: float | None = None  # effective epsilon (nn.RMSNorm(eps=None) -> finfo(dtype).eps)
    weight: str | None = None  # state_dict name of the scale
    bias: str | None = None
    weight_offset: float = 0.0  # 1.0 for Gemma-style x * (1 + w)
    running_mean: str | None = None
    running_var: str | None = None
    upcast: bool = False  # statistics computed in float32 from a lower-precision input
    producer: str = "other"  # what computes the input: conv, conv_transpose, linear, embedding, add, input, ...
    placement: str = "other"
    calls: int = 1  # how many sites share this target (a module called more than once)
    nodes: tuple[str, ...] = ()  # every node of the site
    self_contained: bool = True  # no intermediate value of the site is used outside it
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "kind": self.kind,
            "source": self.source,
            "module_type": self.module_type,
            "owner": self.owner,
            "eps": self.eps,
            "dims": list(self.dims) if self.dims is not None else None,
            "normalized_shape": list(self.normalized_shape) if self.normalized_shape is not None else None,
            "num_features": self.num_features,
            "num_groups": self.num_groups,
            "affine": {"weight": self.weight, "bias": self.bias, "weight_offset": self.weight_offset},
            "running_stats": ({"mean": self.running_mean, "var": self.running_var}
                              if self.running_mean or self.running_var else None),
            "upcast": self.upcast,
            "producer": self.producer,
            "placement": self.placement,
            "calls": self.calls,
            "nodes": len(self.nodes),
            "node": self.node,
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class WeightStandardization:
    """A norm-shaped computation whose input is a parameter (BiT / timm StdConv: F.batch_norm or a hand-written
    (w - mean) / sqrt(var + eps) on a conv's weight): it standardizes a constant, it is not an activation norm."""

    site: NormSite  # the computation as detection matched it (kind: how it is written)
    param: str  # state_dict name of the standardized tensor
    consumer: str  # what reads the result (a conv / linear module path, or a node name; '' when none)

    def to_json(self) -> dict[str, Any]:
        return {"target": self.site.target, "node": self.site.node, "param": self.param,
                "consumer": self.consumer, "written_as": f"{self.site.source} {self.site.kind}",
                "eps": self.site.eps,
                "reason": (f"weight standardization of {self.param}: the input is a parameter, not an activation; "
                           f"constant at inference (not an activation {self.site.kind}); fold and export compute it "
                           f"once into the conv's weight") if self.consumer else
                          (f"a {self.site.kind} of the parameter {self.param}, not of an activation: constant at "
                           f"inference, recomputed by every forward; left as written (no layer reads it as its "
                           f"weight, so there is no weight to fold it into)")}


def find_norms(cap: Captured) -> list[NormSite]:
    """Every norm site of the captured graph, in graph order, with placement (weight standardizations excluded:
    see ``find_weight_standardizations``)."""
    sites = [s for s in _raw_sites(cap) if _constant_input(cap, s) is None]
    order = cap.order
    outputs = frozenset(s.node for s in sites)
    sites = [_with_placement(cap, s, sites, order, outputs) for s in sites]
    # sites of one module called at several places share its target; a site that is not a module's is its own node
    # (its target, a node name, may equal a module's path: F.layer_norm's node "layer_norm" vs a root layer_norm)
    key = [("module", s.target) if whole_module_call(s) else ("node", s.node) for s in sites]
    counts = Counter(key)
    return [replace(s, calls=counts[k]) for s, k in zip(sites, key)]


def whole_module_call(site: NormSite) -> bool:
    """Whether the site is a whole module's call (a norm module, or a hand-written norm module's forward)."""
    return site.source == "module" or site.source == "handwritten" and site.module_type is not None \
        and site.target == site.owner


def spans_graph(cap: Captured, site: NormSite) -> bool:
    """Whether a hand-written site is its graph's whole computation, input to output: the captured module is
    itself the norm (a hand-written norm module captured alone)."""
    output = next(n for n in cap.gm.graph.nodes if n.op == "output")
    return site.source == "handwritten" and not site.owner and cap.is_input(cap.nodes[site.input]) and \
        output.all_input_nodes == [cap.nodes[site.node]]


def find_weight_standardizations(cap: Captured) -> list[WeightStandardization]:
    """Norm-shaped computations applied to a parameter (weight standardization), with what reads them."""
    found = []
    for s in _raw_sites(cap):
        param = _constant_input(cap, s)
        if param is not None:
            found.append(WeightStandardization(s, param, _weight_consumer(cap, cap.nodes[s.node])))
    return found


def _constant_input(cap: Captured, site: NormSite) -> str | None:
    """The parameter / buffer a site normalizes (through views and casts), or None for an activation."""
    return _param_through_views(cap, cap.nodes[site.input], set())


def _weight_consumer(cap: Captured, node: fx.Node) -> str:
    """The conv / linear that takes ``node`` (through reshapes and casts) as its weight."""
    layer = weight_reader(cap, node)
    return cap.describe(layer) if layer is not None else ""


def weight_reader(cap: Captured, node: fx.Node) -> fx.Node | None:
    """The conv / linear call that takes ``node`` (through reshapes and casts, its only user each) as its weight."""
    for _ in range(16):
        users = cap.users(node)
        if len(users) != 1:
            return None
        u = users[0]
        if cap.op(u) in ("conv", "conv_transpose", "linear"):
            return u if (u.args[1:2] and u.args[1] is node) or u.kwargs.get("weight") is node else None
        name = u.target if u.op == "call_method" else getattr(u.target, "__name__", "").split(".")[0]
        if cap.op(u) != "cast" and name not in ("view", "reshape", "reshape_as", "view_as", "_unsafe_view",
                                                "contiguous", "squeeze", "unsqueeze"):
            return None
        node = u
    return None


def _raw_sites(cap: Captured) -> list[NormSite]:
    sites: list[NormSite] = []
    for node in cap.gm.graph.nodes:
        op = cap.op(node)
        if op in _NORM_OPS:
            site = _native_site(cap, node, _NORM_OPS[op])
        elif _root(cap, node) is not None:
            site = _handwritten_site(cap, node)
        else:
            site = None
        if site is not None:
            sites.append(site)
    return _dedupe(sites)


# ---------------------------------------------------------------------------------------------------------
# native modules and functional calls


def _native_site(cap: Captured, node: fx.Node, kind: str) -> NormSite | None:
    x = node.args[0] if node.args else node.kwargs.get("input")
    if not isinstance(x, fx.Node):
        return None
    owner = cap.owner(node)
    mod = cap.modules.get(owner)
    if node.op == "call_module" or (mod is not None and is_native_norm(mod)):
        return _module_site(cap, node, x, owner, mod, kind)
    return _functional_site(cap, node, x, owner, kind)


def _module_site(cap, node, x, path, mod, kind) -> NormSite:
    dtype = cap.dtype(x) or torch.float32
    eps = getattr(mod, "eps", None)
    if eps is None and kind == "rmsnorm":
        eps = torch.finfo(dtype if dtype.is_floating_point else torch.float32).eps  # nn.RMSNorm(eps=None)
    shape = getattr(mod, "normalized_shape", None)
    weight = f"{path}.weight" if getattr(mod, "weight", None) is not None else None
    bias = f"{path}.bias" if getattr(mod, "bias", None) is not None else None
    rm = f"{path}.running_mean" if getattr(mod, "running_mean", None) is not None else None
    rv = f"{path}.running_var" if getattr(mod, "running_var", None) is not None else None
    return NormSite(
        target=path, kind=kind, source="module", node=node.name, input=x.name, owner=path,
        module_type=type(mod).__name__,
        dims=tuple(range(-len(shape), 0)) if shape is not None else None,
        normalized_shape=tuple(shape) if shape is not None else None,
        num_features=getattr(mod, "num_features", getattr(mod, "num_channels", None)),
        num_groups=getattr(mod, "num_groups", None),
        eps=float(eps) if eps is not None else None, weight=weight, bias=bias, running_mean=rm, running_var=rv,
        nodes=(node.name,),
    )


def _functional_site(cap, node, x, owner, kind) -> NormSite:
    p = cap.param_name
    fields: dict[str, Any] = {}
    if kind == "batchnorm":
        a = batch_norm_args(node)
        fields = dict(eps=scalar(a["eps"]), weight=p(a["weight"]), bias=p(a["bias"]),
                      running_mean=p(a["running_mean"]), running_var=p(a["running_var"]))
        shape = cap.shape(x)
        fields["num_features"] = shape[1] if shape and len(shape) > 1 else None
        if a["training"] is True:
            fields["notes"] = ("training=True: normalizes with batch statistics",)
    elif kind in ("layernorm", "rmsnorm"):
        ns = tuple(arg(node, 1, "normalized_shape") or ())
        shape = cap.shape(x)
        if not all(isinstance(d, int) for d in ns):  # (x.shape[-1],) traced: read the sizes off the input
            ns = tuple(shape[len(shape) - len(ns):]) if shape and len(shape) >= len(ns) else None
        eps_i = 4 if kind == "layernorm" else 3
        eps = scalar(arg(node, eps_i, "eps"))
        if eps is None:  # the functions' defaults: 1e-5 for layer_norm, the dtype's epsilon for rms_norm
            eps = 1e-5 if kind == "layernorm" else torch.finfo(cap.dtype(x) or torch.float32).eps
        n_dims = len(arg(node, 1, "normalized_shape") or ())
        fields = dict(normalized_shape=ns, dims=tuple(range(-n_dims, 0)), eps=eps, weight=p(arg(node, 2, "weight")),
                      bias=p(arg(node, 3, "bias")) if kind == "layernorm" else None)
    elif kind == "groupnorm":
        shape = cap.shape(x)
        fields = dict(num_groups=arg(node, 1, "num_groups"), weight=p(arg(node, 2, "weight")),
                      bias=p(arg(node, 3, "bias")), eps=scalar(arg(node, 4, "eps", 1e-5)),
                      num_features=shape[1] if shape and len(shape) > 1 else None)
    elif kind == "instancenorm":
        shape = cap.shape(x)
        fields = dict(weight=p(arg(node, 3, "weight")), bias=p(arg(node, 4, "bias")),
                      eps=scalar(arg(node, 7, "eps", 1e-5)),
                      num_features=shape[1] if shape and len(shape) > 1 else None)
    mod = cap.modules.get(owner)
    return NormSite(target=node.name, kind=kind, source="functional", node=node.name, input=x.name, owner=owner,
                    module_type=type(mod).__name__ if mod is not None and owner else None, nodes=(node.name,),
                    **fields)


# ---------------------------------------------------------------------------------------------------------
# hand-written subgraphs


class _NoMatch(Exception):
    pass


def _root(cap: Captured, node: fx.Node) -> str | None:
    """rsqrt(v) / v ** -0.5 -> "rsqrt"; sqrt(v) / v ** 0.5 -> "sqrt" (MuseSpark writes torch.pow(v, -0.5))."""
    op = cap.op(node)
    if op in ("rsqrt", "sqrt"):
        return op
    if op == "pow" and isinstance(node.args[0], fx.Node):
        return {-0.5: "rsqrt", 0.5: "sqrt"}.get(scalar(arg(node, 1, "exponent")))
    return None


def _handwritten_site(cap: Captured, r: fx.Node) -> NormSite | None:
    try:
        return _match_handwritten(cap, r)
    except _NoMatch:
        return None


def _strip(cap: Captured, node: Any, acc: set[str]) -> Any:
    """Skip dtype casts (recording them as part of the site)."""
    while isinstance(node, fx.Node) and cap.op(node) == "cast":
        acc.add(node.name)
        node = node.args[0]
    return node


def _other(node: fx.Node, this: Any) -> Any:
    """The operand of a binary node that is not ``this``."""
    a, b = (list(node.args) + [None, None])[:2]
    if a is this:
        return b
    if b is this:
        return a
    raise _NoMatch


def _param_through_views(cap: Captured, value: Any, acc: set[str]) -> str | None:
    """The parameter a value reads, through casts and broadcasting views (w[:, None, None], w.view(1,C,1,1))."""
    seen: set[str] = set()
    while isinstance(value, fx.Node):
        name = cap.param_name(value)
        if name is not None:
            acc |= seen
            return name
        op = cap.op(value)
        is_view = (value.op == "call_method" and value.target in _VIEW_METHODS) or op == "getitem" or \
            (value.op == "call_function" and getattr(value.target, "__name__", "").split(".")[0] in
             ("view", "reshape", "unsqueeze", "expand", "slice", "select"))
        if op != "cast" and not is_view:
            return None
        seen.add(value.name)
        value = value.args[0]
    return None


def square_base(cap: Captured, node: Any, acc: set[str]) -> Any:
    """If node computes v^2 (pow 2, square, v*v), return v."""
    if not isinstance(node, fx.Node):
        return None
    op = cap.op(node)
    if op == "pow" and scalar(arg(node, 1, "exponent")) == 2.0:
        acc.add(node.name)
        return node.args[0]
    if op == "square":
        acc.add(node.name)
        return node.args[0]
    if op == "mul" and len(node.args) == 2 and node.args[0] is node.args[1]:
        acc.add(node.name)
        return node.args[0]
    return None


def _mean_dims(cap: Captured, node: fx.Node) -> tuple[tuple[int, ...] | None, bool]:
    return dims_of(arg(node, 1, "dim")), bool(arg(node, 2, "keepdim", False))


def _negative(dims: tuple[int, ...] | None, rank: int | None) -> tuple[int, ...] | None:
    if dims is None or rank is None:
        return dims
    return tuple(sorted(d - rank if d >= 0 else d for d in dims))


def _match_handwritten(cap: Captured, r: fx.Node) -> NormSite:
    acc: set[str] = {r.name}
    rsqrt = _root(cap, r) == "rsqrt"
    # denominator: (r)sqrt(stat + eps)
    s = _strip(cap, r.args[0], acc)
    eps = 0.0
    if isinstance(s, fx.Node) and cap.op(s) == "add":
        c = [scalar(v) for v in s.args[:2]]
        if c[1] is not None:
            eps, stat = c[1], s.args[0]
        elif c[0] is not None:
            eps, stat = c[0], s.args[1]
        else:
            raise _NoMatch
        acc.add(s.name)
    else:
        stat = s
    stat = _strip(cap, stat, acc)
    if not isinstance(stat, fx.Node):
        raise _NoMatch

    centered: bool
    x_stat: Any = None
    running_var = cap.param_name(stat)
    dims: tuple[int, ...] | None = None
    var_mean = _var_mean_of(stat, 0)
    if running_var is not None:  # (x - running_mean) / sqrt(running_var + eps)
        centered, kind = True, "batchnorm"
    elif var_mean is not None:
        # var, mean = torch.var_mean(x, d, unbiased=False | correction=0)  =>  LayerNorm statistics
        if not _biased_var_mean(var_mean):
            raise _NoMatch  # unbiased variance is not what any native norm computes
        dims = dims_of(var_mean.args[1] if len(var_mean.args) > 1 else var_mean.kwargs.get("dim"))
        acc |= {stat.name, var_mean.name}
        centered, kind, x_stat = True, "layernorm", _strip(cap, var_mean.args[0], acc)
    elif cap.op(stat) == "var":
        # var(x, dim, unbiased=False) / aten.var.dim(x, dim, False) / var(x, dim, correction=0)
        unbiased = arg(stat, 2, "unbiased", None)
        correction = stat.kwargs.get("correction", None)
        biased = unbiased is False or correction in (0, 0.0)
        dims = dims_of(arg(stat, 1, "dim"))
        if not biased:
            raise _NoMatch  # unbiased variance is not what any native norm computes
        acc.add(stat.name)
        centered, kind, x_stat = True, "layernorm", _strip(cap, stat.args[0], acc)
    elif cap.op(stat) == "mean":
        acc.add(stat.name)
        dims, _ = _mean_dims(cap, stat)
        base = square_base(cap, _strip(cap, stat.args[0], acc), acc)
        if base is None:
            raise _NoMatch
        base = _strip(cap, base, acc)
        if isinstance(base, fx.Node) and cap.op(base) == "sub":
            m = _strip(cap, base.args[1], acc)
            if isinstance(m, fx.Node) and cap.op(m) == "mean":
                acc |= {base.name, m.name}
                x_stat, centered, kind = _strip(cap, base.args[0], acc), True, "layernorm"
            else:
                raise _NoMatch
        else:
            x_stat, centered, kind = base, False, "rmsnorm"
    else:
        raise _NoMatch

    # numerator: num * rsqrt(...) or num / sqrt(...), the factor maybe cast first (x * rsqrt(..).to(x.dtype))
    factor = r
    while len(cap.users(factor)) == 1 and cap.op(cap.users(factor)[0]) == "cast":
        factor = cap.users(factor)[0]
        acc.add(factor.name)
    y = None
    for u in cap.users(factor):
        if rsqrt and cap.op(u) == "mul" or not rsqrt and cap.op(u) == "div" and u.args[1] is factor:
            y = u
            break
    if y is None:
        raise _NoMatch
    acc.add(y.name)
    raw = _other(y, factor)
    num = _strip(cap, raw, acc)
    # a scale applied before the factor: (w * x) * rsqrt(ms + eps) is w * (x * rsqrt(ms + eps)), the factor per row;
    # the mul is the factor's own operand (not reached through a cast: that is another module's result)
    pre_weight = None
    if kind != "batchnorm" and raw is num and isinstance(num, fx.Node) and cap.op(num) == "mul" and \
            len(num.args) == 2 and len(cap.users(num)) == 1:
        for w_arg, rest in (num.args, num.args[::-1]):
            views: set[str] = set()
            w = _param_through_views(cap, w_arg, views)
            core = _strip(cap, rest, set())
            if w is not None and (core is x_stat if not centered else
                                  isinstance(core, fx.Node) and cap.op(core) == "sub"):
                pre_weight = w
                acc |= views | {num.name}
                num = _strip(cap, rest, acc)
                break
    running_mean = None
    if kind == "batchnorm":
        if not (isinstance(num, fx.Node) and cap.op(num) == "sub"):
            raise _NoMatch
        running_mean = cap.param_name(_strip(cap, num.args[1], acc))
        if running_mean is None:
            raise _NoMatch
        acc.add(num.name)
        x = _strip(cap, num.args[0], acc)
    elif centered:
        if not (isinstance(num, fx.Node) and cap.op(num) == "sub"):
            raise _NoMatch
        m = _strip(cap, num.args[1], acc)
        x = _strip(cap, num.args[0], acc)
        if var_mean is not None:
            # x - mean, the mean from the same var_mean  =>  same x, same dims
            if _var_mean_of(m, 1) is not var_mean or x is not x_stat:
                raise _NoMatch
        else:
            if not (isinstance(m, fx.Node) and cap.op(m) == "mean"):
                raise _NoMatch
            if x is not x_stat or _strip(cap, m.args[0], acc) is not x:
                raise _NoMatch
            mdims, _ = _mean_dims(cap, m)
            rank = len(cap.shape(x) or ()) or None
            if _negative(mdims, rank) != _negative(dims, rank):
                raise _NoMatch
        acc |= {num.name, m.name}
    else:
        x = num
        if x is not x_stat:
            raise _NoMatch

    # affine tail: [* w | * (1 + w)] [+ b], casts anywhere
    weight, bias = pre_weight, None
    offset = 0.0
    out = y
    upcasts = any(cap.op(cap.nodes[n]) == "cast" for n in acc)
    while len(cap.users(out)) == 1:
        u = cap.users(out)[0]
        op = cap.op(u)
        # a trailing cast is the norm's own cast-back only when it casts internally or an affine op follows
        if op == "cast" and (upcasts or _feeds_affine(cap, u)):
            acc.add(u.name)
            out = u
            continue
        if op == "mul" and weight is None and bias is None:
            other = _other(u, out)
            w = _param_through_views(cap, other, acc)
            if w is None and isinstance(other, fx.Node) and cap.op(other) == "add":  # (1 + w)
                one = [scalar(v) for v in other.args[:2]]
                tail = other.args[1] if one[0] is not None else other.args[0]
                w = _param_through_views(cap, tail, acc)
                if w is not None and (one[0] == 1.0 or one[1] == 1.0):
                    offset = 1.0
                    acc.add(other.name)
                else:
                    w = None
            if w is None:
                break
            weight = w
            acc.add(u.name)
            out = u
            continue
        if op == "add" and bias is None:
            b = _param_through_views(cap, _other(u, out), acc)
            if b is None:
                break
            bias = b
            acc.add(u.name)
            out = u
            continue
        break
    if not isinstance(x, fx.Node):
        raise _NoMatch
    # upcast: statistics computed in a wider float than the input's (Llama-style .to(float32))
    in_dt, y_dt = cap.dtype(x), cap.dtype(y)
    upcast = any(cap.op(cap.nodes[n]) == "cast" for n in acc) and (in_dt != y_dt or in_dt is None)
    return _assemble(cap, kind, x, out, acc, dims, eps, weight, bias, offset, running_mean, running_var,
                     upcast or _casts_to_float32(cap, acc))


def _var_mean_of(node: Any, index: int) -> fx.Node | None:
    """The torch.var_mean call whose output ``index`` (0 var, 1 mean) ``node`` is, either graph dialect."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem
            and node.args[1] == index and isinstance(node.args[0], fx.Node)):
        return None
    vm = node.args[0]
    name = vm.target if vm.op == "call_method" else getattr(vm.target, "__name__", "")
    return vm if name.split(".")[0] == "var_mean" else None


def _biased_var_mean(vm: fx.Node) -> bool:
    """var_mean(x, d, unbiased=False) / var_mean(x, d, correction=0) / aten.var_mean.correction(.., correction=0)."""
    if vm.kwargs.get("correction", None) in (0, 0.0) or vm.kwargs.get("unbiased", None) is False:
        return True
    return len(vm.args) > 2 and vm.args[2] is False


def _feeds_affine(cap: Captured, node: fx.Node) -> bool:
    users = cap.users(node)
    if len(users) != 1 or cap.op(users[0]) not in ("mul", "add"):
        return False
    return any(_param_through_views(cap, a, set()) is not None for a in users[0].args[:2] if a is not node)


def _casts_to_float32(cap: Captured, acc: set[str]) -> bool:
    for name in acc:
        n = cap.nodes[name]
        if cap.op(n) == "cast" and (torch.float32 in n.args[1:] or n.kwargs.get("dtype") is torch.float32
                                   or (n.op == "call_method" and n.target == "float")):
            return True
    return False


def _assemble(cap, kind, x, out, acc, dims, eps, weight, bias, offset, running_mean, running_var, upcast):
    shape = cap.shape(x)
    rank = len(shape) if shape else None
    ndims = _negative(dims, rank)
    normalized_shape = None
    num_features = None
    notes: list[str] = []
    if kind == "layernorm" and ndims is not None and rank is not None:
        trailing = ndims == tuple(range(-len(ndims), 0))
        spatial = tuple(range(2 - rank, 0))
        if rank >= 4 and ndims == spatial:  # all spatial dims of NC(D)HW: per-sample, per-channel
            kind = "instancenorm"
        elif not trailing:
            notes.append(f"normalizes non-trailing dims {list(ndims)} (channels-first layout)")
        if kind == "instancenorm":
            num_features = shape[1]
    if kind in ("layernorm", "rmsnorm") and ndims is not None and shape is not None:
        normalized_shape = tuple(shape[d] for d in ndims)
    if kind == "batchnorm" and shape is not None and len(shape) > 1:
        num_features = shape[1]
    if eps == 0.0:
        notes.append("no epsilon inside the square root")
    if offset:
        notes.append("scale applied as (1 + weight) (Gemma style)")
    acc.discard(x.name)
    x = _foreign_casts_out(cap, x, acc)
    x = _caller_casts_out(cap, x, acc)
    out = _caller_casts_after(cap, out, acc)
    aliases = aliases_of(cap, x)
    owners = {cap.owner(cap.nodes[n]) for n in acc}
    owner = owners.pop() if len(owners) == 1 else _common_prefix(owners | {""})
    self_contained = all(all(u.name in acc for u in cap.users(cap.nodes[n])) for n in acc
                         if n != out.name and n not in aliases)
    target, module_type = out.name, None
    mod = cap.modules.get(owner)
    if owner and mod is not None and self_contained and owns_only(cap, owner, acc):
        target, module_type = owner, type(mod).__name__  # a hand-written norm module
    elif owner and mod is not None:
        module_type = type(mod).__name__
    order = cap.order
    return NormSite(
        target=target, kind=kind, source="handwritten", node=out.name, input=x.name, owner=owner,
        module_type=module_type, dims=ndims, normalized_shape=normalized_shape, num_features=num_features,
        eps=eps, weight=weight, bias=bias, weight_offset=offset, running_mean=running_mean,
        running_var=running_var, upcast=upcast, nodes=tuple(sorted(acc, key=order.__getitem__)),
        self_contained=self_contained, notes=tuple(notes),
    )


def _common_prefix(paths: set[str]) -> str:
    parts = [p.split(".") for p in paths if p]
    if not parts:
        return ""
    prefix = []
    for items in zip(*parts):
        if len(set(items)) != 1:
            break
        prefix.append(items[0])
    return ".".join(prefix)


def _core_owner(cap: Captured, acc: set[str]) -> str:
    """The module computing the site's arithmetic: the common owner of its nodes that are not casts."""
    core = [cap.owner(cap.nodes[n]) for n in acc if cap.op(cap.nodes[n]) != "cast"]
    return _common_prefix(set(core) | {""}) if len(set(core)) > 1 else (core[0] if core else "")


def _foreign_casts_out(cap: Captured, x: fx.Node, acc: set[str]) -> fx.Node:
    """The site's input once the casts another module computed leave the site: Inkling2's layer-0 norm casts the
    embedding norm's result, whose last op is that norm's own cast back, so stripping casts reached into the previous
    site and the two sites claimed one node (the later was dropped). Returns the new input, the last cast computed
    outside the norm's module and its callers, and drops it and the casts before it from ``acc``."""
    inner = _core_owner(cap, acc)
    chain, c = [], x
    while True:
        nxt = [u for u in cap.users(c) if u.name in acc and cap.op(u) == "cast" and u.args[0] is c]
        if len(nxt) != 1:
            break
        c = nxt[0]
        chain.append(c)
    # a cast owned by a module that neither is the norm's nor encloses it  =>  it is that module's
    foreign = [i for i, n in enumerate(chain)
               if (own := cap.owner(n)) and inner != own and not inner.startswith(own + ".")]
    if not foreign:
        return x
    for n in chain[:foreign[-1] + 1]:
        acc.discard(n.name)
    return chain[foreign[-1]]


def _caller_casts_out(cap: Captured, x: fx.Node, acc: set[str]) -> fx.Node:
    """The site's input once the casts its caller applies before calling the norm module leave the site:
    ``self.norm(h.to(w.dtype))`` (Mamba) casts in the block, so counting that cast would make the block the owner and
    the norm module an inline norm. Returns the new input (the last such cast) and drops those casts from ``acc``."""
    inner = _core_owner(cap, acc)
    while inner:
        # x -> cast (in an enclosing module, its only use) -> the norm  =>  the cast is the caller's
        lead = [u for u in cap.users(x) if u.name in acc and cap.op(u) == "cast"]
        if len(lead) != 1:
            break
        c = lead[0]
        if inner in cap.owner_stack(c) or not all(u.name in acc for u in cap.users(c)):
            break
        acc.discard(c.name)
        x = c
    return x


def _caller_casts_after(cap: Captured, out: fx.Node, acc: set[str]) -> fx.Node:
    """The site's output once the casts its caller applies to the norm module's result leave the site:
    ``self.input_layernorm(h[mask]).to(h.device)`` (Higgs Audio) casts in the block, which would make the block
    the owner and the norm module an inline norm. Returns the new output and drops those casts from ``acc``."""
    inner = _core_owner(cap, acc)
    # norm -> cast (in an enclosing module) as the site's last op  =>  the cast is the caller's
    while inner and cap.op(out) == "cast" and inner not in cap.owner_stack(out) and \
            isinstance(out.args[0], fx.Node) and out.args[0].name in acc:
        acc.discard(out.name)
        out = out.args[0]
    return out


def owns_only(cap: Captured, owner: str, acc: set[str]) -> bool:
    """The module at ``owner`` computes nothing but this site in this call (so the whole module is the norm; a
    norm module called twice, MuseGlimmer's qk_norm on q and on k, computes the other site in its other call)."""
    calls = {cap.call_of(cap.nodes[n], owner) for n in acc} - {None}
    for n in cap.gm.graph.nodes:
        if n.name in acc or n.op in ("placeholder", "get_attr", "output"):
            continue
        if cap.is_noise(n):
            continue
        stack = cap.owner_stack(n)
        # a node of another call of the module is that call's
        if owner in stack and not (calls and cap.call_of(n, owner) not in calls):
            return False
    return True


def _dedupe(sites: list[NormSite]) -> list[NormSite]:
    """A sqrt anchor can sit inside a native-op site's nodes only in odd graphs; keep the first claim."""
    claimed: set[str] = set()
    kept = []
    for s in sites:
        if claimed.isdisjoint(s.nodes):
            kept.append(s)
            claimed.update(s.nodes)
    return kept


# ---------------------------------------------------------------------------------------------------------
# placement


def producer_of(cap: Captured, node: Any, norm_outputs: frozenset[str] = frozenset()) -> tuple[str, Any]:
    """What computes ``node`` once casts, dropout and identities are skipped: (kind, node)."""
    while isinstance(node, fx.Node) and cap.op(node) in TRANSPARENT and node.name not in norm_outputs:
        node = node.args[0]
    if isinstance(node, fx.Node) and node.name in norm_outputs:
        return "norm", node
    if not isinstance(node, fx.Node):
        return "constant", node
    if cap.is_input(node):
        return "input", node
    op = cap.op(node)
    if op in _NORM_OPS:
        return "norm", node
    if op in ("conv", "conv_transpose", "linear", "embedding", "add", "matmul", "cat"):
        return op, node
    if node.op == "call_module":
        return type(cap.modules.get(node.target)).__name__.lower(), node
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return str(target).split(".")[0], node


def aliases_of(cap: Captured, x: fx.Node) -> set[str]:
    """Casts of ``x`` to its own dtype: the same value under another node (torch.export shares them)."""
    found: set[str] = set()
    stack = [x]
    while stack:
        n = stack.pop()
        for u in cap.users(n):
            if cap.op(u) == "cast" and u.args[0] is n and cap.dtype(u) is not None and cap.dtype(u) == cap.dtype(x):
                found.add(u.name)
                stack.append(u)
    return found


def _ancestor(cap: Captured, a: fx.Node, b: Any, order: dict[str, int]) -> bool:
    """Is ``a`` an ancestor of (or equal to) ``b``?"""
    if not isinstance(b, fx.Node):
        return False
    stop = order[a.name]
    stack, seen = [b], set()
    while stack:
        n = stack.pop()
        if n is a:
            return True
        if n.name in seen or order[n.name] < stop:
            continue
        seen.add(n.name)
        stack.extend(n.all_input_nodes)
    return False


def _with_placement(cap: Captured, site: NormSite, sites: list[NormSite], order: dict[str, int],
                    norm_outputs: frozenset[str]) -> NormSite:
    x, out = cap.nodes[site.input], cap.nodes[site.node]
    kind, pnode = producer_of(cap, x, norm_outputs)
    placement = f"after-{kind}" if kind in ("conv", "conv_transpose", "linear", "embedding", "add", "norm") else \
        ("input" if kind == "input" else "other")
    if site.kind in ("layernorm", "rmsnorm"):
        inside = set(site.nodes)
        # pre-norm: x also feeds an add whose other operand is computed from this norm's output
        same = [x] + [cap.nodes[n] for n in aliases_of(cap, x)]
        for v, u in [(v, u) for v in same for u in cap.users(v)]:
            if u.name in inside or cap.op(u) != "add":
                continue
            try:
                other = _other(u, v)
            except _NoMatch:
                continue
            if _ancestor(cap, out, other, order):
                return replace(site, producer=kind, placement="pre-norm")
        if kind == "add" and len(pnode.args) >= 2:
            a, b = pnode.args[0], pnode.args[1]
            for res, branch in ((a, b), (b, a)):
                if isinstance(res, fx.Node) and _ancestor(cap, res, branch, order):
                    prenormed = any(res.name in {s.input} | aliases_of(cap, cap.nodes[s.input])
                                    and _ancestor(cap, cap.nodes[s.node], branch, order)
                                    for s in sites if s is not site)
                    placement = "final-norm" if prenormed else "post-norm"
                    break
            else:
                if all(producer_of(cap, v)[0] in ("embedding", "add") for v in (a, b)):
                    placement = "after-embedding"
    return replace(site, producer=kind, placement=placement)
