"""Norm detection: every normalization site of a captured graph, whatever way it was written.

Three sources, one record (``graph.site.NormSite``):
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
  on-parameter a norm of a parameter no layer takes as its weight (DeBERTa-v2's relative embeddings' LayerNorm)
"""

from __future__ import annotations

import sys

from dataclasses import replace
from typing import Any

from collections import Counter

import torch
import torch.fx as fx

from normconv import kinds
from normconv.graph.capture import Captured
from normconv.graph.handwritten import (NoMatch, aliases_of, handwritten_site, other_operand, param_through_views,
                                        root)
from normconv.graph.offset_weight import offset_weight
from normconv.match import TRANSPARENT, arg
from normconv.graph.site import NormSite, WeightStandardization

KINDS = kinds.NAMES



def find_norms(cap: Captured) -> list[NormSite]:
    """Every norm site of the captured graph, in graph order, with placement (weight standardizations excluded:
    see ``find_weight_standardizations``). Found once per capture (``Captured.found``)."""
    found = cap.found.get("norms")
    if found is None:
        found = cap.found["norms"] = tuple(_find_norms(cap))
    return list(found)


def _find_norms(cap: Captured) -> list[NormSite]:
    sites = [s for s in _raw_sites(cap) if _standardized(cap, s) is None]
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
        param = _standardized(cap, s)
        if param is not None:
            found.append(WeightStandardization(s, param, _weight_consumer(cap, cap.nodes[s.node])))
    return found


def _constant_input(cap: Captured, site: NormSite) -> str | None:
    """The parameter / buffer a site normalizes (through views and casts), or None for an activation."""
    return param_through_views(cap, cap.nodes[site.input], set())


def _standardized(cap: Captured, site: NormSite) -> str | None:
    """The parameter a site standardizes for a layer that takes it as its weight (BiT / timm StdConv), or None.
    A norm of a parameter that no layer takes as its weight normalizes a table the forward reads as data (DeBERTa-v2's
    and SEW-D's ``encoder.LayerNorm`` of the relative position embeddings): it is a norm site (placed on-parameter),
    a layer that runs on every forward like any other."""
    param = _constant_input(cap, site)
    return param if param is not None and weight_reader(cap, cap.nodes[site.node]) is not None else None


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


def _raw_sites(cap: Captured) -> tuple[NormSite, ...]:
    """Every norm-shaped computation of the graph, weight standardizations included: scanned once per capture
    (``find_norms`` and ``find_weight_standardizations`` both read it; the fold reads both)."""
    found = cap.found.get("raw sites")
    if found is None:
        found = cap.found["raw sites"] = tuple(_scan(cap))
    return found


def _scan(cap: Captured) -> list[NormSite]:
    sites: list[NormSite] = []
    for node in cap.gm.graph.nodes:
        kind = kinds.for_op(cap.op(node))
        if kind is not None:
            site = _native_site(cap, node, kind)
        elif root(cap, node) is not None:
            site = handwritten_site(cap, node)
        else:
            site = None
        if site is not None:
            sites.append(site)
    return _dedupe(sites)


# ---------------------------------------------------------------------------------------------------------
# native modules and functional calls: what each kind reads off them


def _exported_norm_module(node: fx.Node, kind: kinds.NormKind) -> bool:
    """The call's innermost ``nn_module_stack`` entry is a native norm module of its kind (the module a .pt2 program
    flattened into this call)."""
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    if not stack or not stack[-1][0]:
        return False
    cls = stack[-1][1]
    if isinstance(cls, str):  # a class name as the program recorded it: torch's own norm classes only
        module, _, name = cls.rpartition(".")
        cls = getattr(sys.modules.get(module), name, None) if module.startswith("torch.nn.") else None
    return isinstance(cls, type) and issubclass(cls, kind.modules)


def _native_site(cap: Captured, node: fx.Node, kind: kinds.NormKind) -> NormSite | None:
    x = node.args[0] if node.args else node.kwargs.get("input")
    if not isinstance(x, fx.Node):
        return None
    owner = cap.owner(node)
    mod = cap.modules.get(owner)
    if node.op == "call_module" or (mod is not None and kinds.is_native(mod)):
        # a norm module  =>  its fields read off the module
        return NormSite(target=owner, kind=kind.name, source="module", node=node.name, input=x.name, owner=owner,
                        module_type=type(mod).__name__, nodes=(node.name,),
                        **kind.from_module(mod, owner, cap.dtype(x) or torch.float32))
    # F.layer_norm / aten.native_layer_norm ...  =>  its fields read off the call; a call that was the whole forward
    # of a native norm module in the model that was exported (a .pt2) is named after that module
    fields, nodes = kind.from_call(cap, node, x), (node.name,)
    # a scale computed as a parameter plus a number (LayerNorm1P's weight + 1)  =>  that weight, with its offset
    offset = offset_weight(cap, arg(node, 2, "weight")) if kind.name in ("layernorm", "rmsnorm") and \
        fields.get("weight") is None else None
    if offset is not None:
        fields = dict(fields, weight=offset[0], weight_offset=offset[1])
        nodes = offset[2] + nodes
    return NormSite(target=owner if _exported_norm_module(node, kind) else node.name, kind=kind.name, source="functional", node=node.name, input=x.name, owner=owner,
                    module_type=type(mod).__name__ if mod is not None and owner else None, nodes=nodes, **fields)



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
    if kinds.for_op(op) is not None:
        return "norm", node
    if op in ("conv", "conv_transpose", "linear", "embedding", "add", "matmul", "cat"):
        return op, node
    if node.op == "call_module":
        return type(cap.modules.get(node.target)).__name__.lower(), node
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return str(target).split(".")[0], node



def is_ancestor(cap: Captured, a: fx.Node, b: Any, order: dict[str, int]) -> bool:
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
    if _constant_input(cap, site) is not None:  # a norm of a table the forward reads (no layer's weight)
        return replace(site, producer="parameter", placement="on-parameter")
    if site.kind in ("layernorm", "rmsnorm"):
        inside = set(site.nodes)
        # pre-norm: x also feeds an add whose other operand is computed from this norm's output
        same = [x] + [cap.nodes[n] for n in aliases_of(cap, x)]
        for v, u in [(v, u) for v in same for u in cap.users(v)]:
            if u.name in inside or cap.op(u) != "add":
                continue
            try:
                other = other_operand(u, v)
            except NoMatch:
                continue
            if is_ancestor(cap, out, other, order):
                return replace(site, producer=kind, placement="pre-norm")
        if kind == "add" and len(pnode.args) >= 2:
            a, b = pnode.args[0], pnode.args[1]
            for res, branch in ((a, b), (b, a)):
                if isinstance(res, fx.Node) and is_ancestor(cap, res, branch, order):
                    prenormed = any(res.name in {s.input} | aliases_of(cap, cap.nodes[s.input])
                                    and is_ancestor(cap, cap.nodes[s.node], branch, order)
                                    for s in sites if s is not site)
                    placement = "final-norm" if prenormed else "post-norm"
                    break
            else:
                if all(producer_of(cap, v)[0] in ("embedding", "add") for v in (a, b)):
                    placement = "after-embedding"
    return replace(site, producer=kind, placement=placement)
