"""Hand-written norms: a subgraph recognized by what it computes, anchored on its (r)sqrt.

  y = (x - mean_D(x)) * rsqrt(var_D(x) + eps) [* w] [+ b]     -> layernorm (instancenorm on every spatial dim)
  y = x * rsqrt(mean_D(x^2) + eps) [* w | * (1 + w)]           -> rmsnorm (Llama, T5, Gemma styles)
  y = (x - running_mean) / sqrt(running_var + eps) [* w] [+ b] -> batchnorm (inference form)
  the layernorm form over x.view(N, G, -1), viewed back         -> groupnorm (instancenorm: G = C) (``graph.grouped``)
  scale = w * rsqrt(running_var + eps); y = x * scale + (b - running_mean * scale)
                                                               -> batchnorm (the frozen form: torchvision's, DETR's,
                                                                  timm's and detectron2's FrozenBatchNorm2d)
with ``/ sqrt`` for ``* rsqrt``, ``v ** -0.5`` for rsqrt, ``var(unbiased=False)``, ``var_mean`` or ``mean((x - m)^2)``
for the variance, a scale applied before the factor (``(w * x) * rsqrt(...)``), dtype casts anywhere in between, statistics
viewed (``rv.view(1, -1, 1, 1)``, ``rv[None, :, None, None]``) and eps a number or an untrained one-element tensor.
The site's nodes, owner and input are then trimmed of casts that belong to the caller or to another module.
"""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx

from normconv.graph.capture import Captured
from normconv.graph.grouped import regrouped
from normconv.match import PARAM_VIEW, arg, dims_of, scalar
from normconv.graph.site import NormSite


class NoMatch(Exception):
    pass


def root(cap: Captured, node: fx.Node) -> str | None:
    """rsqrt(v) / v ** -0.5 -> "rsqrt"; sqrt(v) / v ** 0.5 -> "sqrt" (MuseSpark writes torch.pow(v, -0.5))."""
    op = cap.op(node)
    if op in ("rsqrt", "sqrt"):
        return op
    if op == "pow" and isinstance(node.args[0], fx.Node):
        return {-0.5: "rsqrt", 0.5: "sqrt"}.get(scalar(arg(node, 1, "exponent")))
    return None


def handwritten_site(cap: Captured, r: fx.Node) -> NormSite | None:
    for match in (_match_handwritten, _match_frozen_batchnorm):
        try:
            return match(cap, r)
        except NoMatch:
            continue
    return None


def _down(cap: Captured, node: fx.Node, acc: set[str]) -> list[fx.Node]:
    """``node`` and every value computed from it by views and casts alone (each taken into ``acc``)."""
    found, stack = [node], [node]
    while stack:
        for u in cap.users(stack.pop()):
            is_view = (u.op == "call_method" and u.target in PARAM_VIEW) or cap.op(u) == "cast" or \
                (u.op == "call_function" and getattr(u.target, "__name__", "").split(".")[0] in PARAM_VIEW)
            if is_view and u.args and u.args[0] in found:
                acc.add(u.name)
                found.append(u)
                stack.append(u)
    return found


def _only_user(cap: Captured, values: list[fx.Node], op: str) -> fx.Node:
    """The one ``op`` node that reads any of ``values`` (views and casts of one value)."""
    users = [u for v in values for u in cap.users(v) if u not in values]
    if len(users) != 1 or cap.op(users[0]) != op:
        raise NoMatch
    return users[0]


def _match_frozen_batchnorm(cap: Captured, r: fx.Node) -> NormSite:
    """scale = w * rsqrt(rv + eps); shift = b - rm * scale; y = x * scale + shift (views and casts anywhere)."""
    acc: set[str] = {r.name}
    s = _strip(cap, r.args[0], acc)
    if root(cap, r) != "rsqrt" or not (isinstance(s, fx.Node) and cap.op(s) == "add"):
        raise NoMatch
    c = [_eps(cap, v) for v in s.args[:2]]
    if (c[0] is None) == (c[1] is None):
        raise NoMatch
    eps, var = (c[1], s.args[0]) if c[1] is not None else (c[0], s.args[1])
    acc.add(s.name)
    running_var = param_through_views(cap, var, acc)
    if running_var is None:
        raise NoMatch
    # scale = w * rsqrt(rv + eps): the factor's one multiplication by a parameter (none: no weight)
    factor = _down(cap, r, acc)
    users = [u for v in factor for u in cap.users(v) if u not in factor]
    weighted = [u for u in users if cap.op(u) == "mul" and param_through_views(cap, other_operand(
        u, next(v for v in factor if v in u.args)), set()) is not None]
    weight, scale = None, factor
    if len(users) == 1 and weighted:
        (u,) = weighted
        weight = param_through_views(cap, other_operand(u, next(v for v in factor if v in u.args)), acc)
        acc.add(u.name)
        scale = _down(cap, u, acc)
    # scale is read twice: by rm * scale (rm a parameter) and by x * scale
    reads = [u for v in scale for u in cap.users(v) if u not in scale]
    if len(reads) != 2 or any(cap.op(u) != "mul" for u in reads):
        raise NoMatch
    rm_of = {u: param_through_views(cap, other_operand(u, next(v for v in scale if v in u.args)), set())
             for u in reads}
    rm_mul = next((u for u in reads if rm_of[u] is not None), None)
    x_mul = next((u for u in reads if rm_of[u] is None), None)
    if rm_mul is None or x_mul is None:
        raise NoMatch
    running_mean = param_through_views(cap, other_operand(rm_mul, next(v for v in scale if v in rm_mul.args)), acc)
    x = _strip(cap, other_operand(x_mul, next(v for v in scale if v in x_mul.args)), acc)
    acc |= {rm_mul.name, x_mul.name}
    # shift = b - rm * scale, then y = x * scale + shift
    sub = _only_user(cap, _down(cap, rm_mul, acc), "sub")
    if sub.args[1] not in _down(cap, rm_mul, set()):
        raise NoMatch
    bias = param_through_views(cap, sub.args[0], acc)
    if bias is None:
        raise NoMatch
    acc.add(sub.name)
    y = _only_user(cap, _down(cap, sub, acc), "add")
    if not set(y.args[:2]) & set(_down(cap, x_mul, acc)):  # the sum of x * scale (or its view) and the shift
        raise NoMatch
    acc.add(y.name)
    if not isinstance(x, fx.Node):
        raise NoMatch
    # scale and shift as applied broadcast along dim 1 of x alone, each statistic one value per channel
    rank, shape = len(cap.shape(x) or ()), cap.shape(x)
    applied = [next(v for v in scale if v in x_mul.args),
               next(a for a in y.args[:2] if a in _down(cap, sub, set()))]
    for v in applied:
        vs = cap.shape(v)
        if rank < 2 or vs is None or len(vs) > rank or \
                [d for d in range(len(vs)) if vs[d] != 1] != [len(vs) - rank + 1]:
            raise NoMatch
    names = [n for n in (weight, bias, running_mean, running_var) if n]
    if any(cap.tensor(n) is None or cap.tensor(n).numel() != shape[1] for n in names):
        raise NoMatch
    site = _assemble(cap, "batchnorm", x, y, acc, None, eps, weight, bias, 0.0, running_mean, running_var, False)
    return replace(site, channel_vectors=True)


def _strip(cap: Captured, node: Any, acc: set[str]) -> Any:
    """Skip dtype casts (recording them as part of the site)."""
    while isinstance(node, fx.Node) and cap.op(node) == "cast":
        acc.add(node.name)
        node = node.args[0]
    return node


def other_operand(node: fx.Node, this: Any) -> Any:
    """The operand of a binary node that is not ``this``."""
    a, b = (list(node.args) + [None, None])[:2]
    if a is this:
        return b
    if b is this:
        return a
    raise NoMatch


def _eps(cap: Captured, value: Any) -> float | None:
    """An epsilon: a number, or a one-element float tensor the module holds, not trained (a buffer, an attribute)."""
    if scalar(value) is not None:
        return scalar(value)
    name = param_through_views(cap, value, set())
    t = cap.tensor(name) if name else None
    return float(t) if t is not None and t.numel() == 1 and t.is_floating_point() and not t.requires_grad else None


def param_through_views(cap: Captured, value: Any, acc: set[str]) -> str | None:
    """The parameter a value reads, through casts and broadcasting views (w[:, None, None], w.view(1,C,1,1))."""
    seen: set[str] = set()
    while isinstance(value, fx.Node):
        name = cap.param_name(value)
        if name is not None:
            acc |= seen
            return name
        op = cap.op(value)
        is_view = (value.op == "call_method" and value.target in PARAM_VIEW) or op == "getitem" or \
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
    rsqrt = root(cap, r) == "rsqrt"
    # denominator: (r)sqrt(stat + eps)
    s = _strip(cap, r.args[0], acc)
    eps = 0.0
    if isinstance(s, fx.Node) and cap.op(s) == "add":
        c = [_eps(cap, v) for v in s.args[:2]]
        if c[1] is not None:
            eps, stat = c[1], s.args[0]
        elif c[0] is not None:
            eps, stat = c[0], s.args[1]
        else:
            raise NoMatch
        acc.add(s.name)
    else:
        stat = s
    stat = _strip(cap, stat, acc)
    if not isinstance(stat, fx.Node):
        raise NoMatch

    centered: bool
    x_stat: Any = None
    stats = {"var": stat}  # a running statistic as read, maybe through a view (rv.view(1, -1, 1, 1), rv[None, :])
    running_var = param_through_views(cap, stat, acc)
    dims: tuple[int, ...] | None = None
    var_mean = _var_mean_of(stat, 0)
    if running_var is not None:  # (x - running_mean) / sqrt(running_var + eps)
        centered, kind = True, "batchnorm"
    elif var_mean is not None:
        # var, mean = torch.var_mean(x, d, unbiased=False | correction=0)  =>  LayerNorm statistics
        if not _biased_var_mean(var_mean):
            raise NoMatch  # unbiased variance is not what any native norm computes
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
            raise NoMatch  # unbiased variance is not what any native norm computes
        acc.add(stat.name)
        centered, kind, x_stat = True, "layernorm", _strip(cap, stat.args[0], acc)
    elif cap.op(stat) == "mean":
        acc.add(stat.name)
        dims, _ = _mean_dims(cap, stat)
        base = square_base(cap, _strip(cap, stat.args[0], acc), acc)
        if base is None:
            raise NoMatch
        base = _strip(cap, base, acc)
        if isinstance(base, fx.Node) and cap.op(base) == "sub":
            m = _strip(cap, base.args[1], acc)
            if isinstance(m, fx.Node) and cap.op(m) == "mean":
                acc |= {base.name, m.name}
                x_stat, centered, kind = _strip(cap, base.args[0], acc), True, "layernorm"
            else:
                raise NoMatch
        else:
            x_stat, centered, kind = base, False, "rmsnorm"
    else:
        raise NoMatch

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
        raise NoMatch
    acc.add(y.name)
    raw = other_operand(y, factor)
    num = _strip(cap, raw, acc)
    # a scale applied before the factor: (w * x) * rsqrt(ms + eps) is w * (x * rsqrt(ms + eps)), the factor per row;
    # the mul is the factor's own operand (not reached through a cast: that is another module's result)
    pre_weight = None
    if kind != "batchnorm" and raw is num and isinstance(num, fx.Node) and cap.op(num) == "mul" and \
            len(num.args) == 2 and len(cap.users(num)) == 1:
        for w_arg, rest in (num.args, num.args[::-1]):
            views: set[str] = set()
            w = param_through_views(cap, w_arg, views)
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
            raise NoMatch
        stats["mean"] = _strip(cap, num.args[1], acc)
        running_mean = param_through_views(cap, stats["mean"], acc)
        if running_mean is None:
            raise NoMatch
        acc.add(num.name)
        x = _strip(cap, num.args[0], acc)
        rank = len(cap.shape(x) or ())  # each statistic one value per channel, broadcast along dim 1 of x alone
        if any(rank < 2 or (vs := cap.shape(v)) is None or len(vs) > rank or
               [d for d in range(len(vs)) if vs[d] != 1] != [len(vs) - rank + 1] for v in stats.values()):
            raise NoMatch
    elif centered:
        if not (isinstance(num, fx.Node) and cap.op(num) == "sub"):
            raise NoMatch
        m = _strip(cap, num.args[1], acc)
        x = _strip(cap, num.args[0], acc)
        if var_mean is not None:
            # x - mean, the mean from the same var_mean  =>  same x, same dims
            if _var_mean_of(m, 1) is not var_mean or x is not x_stat:
                raise NoMatch
        else:
            if not (isinstance(m, fx.Node) and cap.op(m) == "mean"):
                raise NoMatch
            if x is not x_stat or _strip(cap, m.args[0], acc) is not x:
                raise NoMatch
            mdims, _ = _mean_dims(cap, m)
            rank = len(cap.shape(x) or ()) or None
            if _negative(mdims, rank) != _negative(dims, rank):
                raise NoMatch
        acc |= {num.name, m.name}
    else:
        x = num
        if x is not x_stat:
            raise NoMatch

    # x.view(N, G, -1) standardized and viewed back  =>  GroupNorm(G, C) of x (``graph.grouped``)
    found = regrouped(cap, x, y) if kind == "layernorm" and pre_weight is None and isinstance(x, fx.Node) and \
        _negative(dims, len(cap.shape(x) or ()) or None) == (-1,) else None
    groups = found[2] if found else None
    if found:
        acc |= {x.name, found[1].name}
        x = found[0]
    # affine tail: [* w | * (1 + w)] [+ b], casts anywhere
    weight, bias = pre_weight, None
    offset = 0.0
    out = found[1] if found else y
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
            other = other_operand(u, out)
            w = param_through_views(cap, other, acc)
            if w is None and isinstance(other, fx.Node) and cap.op(other) == "add":  # (1 + w)
                one = [scalar(v) for v in other.args[:2]]
                tail = other.args[1] if one[0] is not None else other.args[0]
                w = param_through_views(cap, tail, acc)
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
            b = param_through_views(cap, other_operand(u, out), acc)
            if b is None:
                break
            bias = b
            acc.add(u.name)
            out = u
            continue
        break
    if not isinstance(x, fx.Node):
        raise NoMatch
    # upcast: statistics computed in a wider float than the input's (Llama-style .to(float32))
    in_dt, y_dt = cap.dtype(x), cap.dtype(y)
    upcast = any(cap.op(cap.nodes[n]) == "cast" for n in acc) and (in_dt != y_dt or in_dt is None)
    return _assemble(cap, kind, x, out, acc, dims, eps, weight, bias, offset, running_mean, running_var,
                     upcast or _casts_to_float32(cap, acc), groups)


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
    return any(param_through_views(cap, a, set()) is not None for a in users[0].args[:2] if a is not node)


def _casts_to_float32(cap: Captured, acc: set[str]) -> bool:
    for name in acc:
        n = cap.nodes[name]
        if cap.op(n) == "cast" and (torch.float32 in n.args[1:] or n.kwargs.get("dtype") is torch.float32
                                   or (n.op == "call_method" and n.target == "float")):
            return True
    return False


def _assemble(cap, kind, x, out, acc, dims, eps, weight, bias, offset, running_mean, running_var, upcast,
              groups=None):
    shape = cap.shape(x)
    rank = len(shape) if shape else None
    ndims = _negative(dims, rank)
    normalized_shape = None
    num_features = None
    notes: list[str] = []
    # over every dim but the batch of an image or volume, any affine per channel  =>  GroupNorm(1, C) (PoolFormer's
    # GroupNorm1), which takes any size; an affine per element pins the sizes itself: a LayerNorm; a weight
    # standardized per filter (a parameter, not an activation) stays the layernorm its fold pass reads
    if kind == "layernorm" and rank and rank >= 4 and ndims == tuple(range(1 - rank, 0)) and \
            cap.param_name(x) is None and \
            all(p is None or getattr(cap.tensor(p), "numel", lambda: 0)() == shape[1] for p in (weight, bias)):
        groups = 1
    if groups:  # a regrouped view: per-group statistics (one group per channel on an image: the InstanceNorm)
        kind = "instancenorm" if groups == shape[1] and rank in (4, 5) else "groupnorm"
        ndims, num_features = (tuple(range(2 - rank, 0)) if kind == "instancenorm" else None), shape[1]
        notes.append(f"written over a view of {groups} group(s) per sample")
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
        num_groups=groups if kind == "groupnorm" else None,
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
        if cap.is_size(n):  # x.size() and the arithmetic on it that shapes the norm's views
            continue
        stack = cap.owner_stack(n)
        # a node of another call of the module is that call's
        if owner in stack and not (calls and cap.call_of(n, owner) not in calls):
            return False
    return True


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
