"""Norm-like subgraphs that are not a norm: what ``inspect`` lists so a hand-written norm never goes unexplained.

Detection (detect.py) accepts only subgraphs that compute exactly what a native norm computes. Code copied from
tutorials often computes something close but different, and no exact rewrite exists for it:

  std rule        (x - mean) / (x.std(d) + eps)        torch.std is unbiased: sqrt(sum (x-m)^2 / (n-1)), and eps
                                                       sits outside the sqrt (The Annotated Transformer's LayerNorm)
  unbiased rule   (x - mean) / sqrt(x.var(d) + eps)    var defaults to unbiased (n-1); LayerNorm divides by n
  eps-outside     x / (sqrt(mean(x^2)) + eps)          eps added after the sqrt, not under it
  factor-only     rsqrt(mean(x^2) + eps)                only the factor 1/rms(x), which the caller multiplies into
                                                       something other than x (HY-V4: F.linear(x, W) * factor,
                                                       = F.linear(rmsnorm(x), W) for a bias-free linear)
  l2              x / max(||x||_2, eps)                 an L2 normalization (F.normalize, a clamped x.norm())
  grn             g / (mean_c(g) + eps), g = ||x||_2    Global Response Normalization (ConvNeXt V2, timm's
                  over the spatial dims                 GlobalResponseNorm): each channel's response over its
                                                       share of the mean response; no native module or single
                                                       ONNX op computes it

For n normalized elements the unbiased forms scale the output by sqrt((n-1)/n) relative to LayerNorm (and eps
acts differently), so canonicalize, swap and export leave them as written. Each becomes a ``NearMiss`` with
the module that computes it and the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch.fx as fx

from normconv.graph.detect import NormSite
from normconv.graph.handwritten import square_base
from normconv.graph.capture import Captured
from normconv.match import arg, call_name as _fn, dims_of, scalar


@dataclass(frozen=True)
class NearMiss:
    """A subgraph that normalizes like a norm but is not exactly one: where, what it computes, and why it stays."""

    target: str
    node: str
    computes: str
    reason: str
    rule: str = ""  # the rule that found it (the module docstring's first column): for scripts, not for people

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target, "node": self.node, "computes": self.computes, "reason": self.reason,
                "rule": self.rule}


def find_near_misses(cap: Captured, sites: Sequence[NormSite]) -> list[NearMiss]:
    """Every std / unbiased-var / eps-outside-sqrt denominator not already part of a detected norm site."""
    claimed = {n for s in sites for n in s.nodes}
    found = []
    for node in cap.gm.graph.nodes:
        if node.name in claimed:
            continue
        op = cap.op(node)
        miss = None
        if op == "std" and _divides(cap, node):
            miss = _std(cap, node)  # std rule
        elif op == "var" and not _biased(node) and _divides(cap, node):
            miss = _unbiased_var(cap, node)  # unbiased rule
        elif op == "sqrt" and _is_statistic(cap, node.args[0]) and _eps_added(cap, node) is not None \
                and _divides(cap, node):
            miss = _eps_outside(cap, node)  # eps-outside rule
        elif op == "rsqrt" and (x := _mean_square_base(cap, node)) is not None and not _multiplies(cap, node, x):
            miss = _factor_only(cap, node, x)  # factor-only rule
        elif _fn(node) in _L2_NORMS and _l2(node) and _over_own_mean(cap, node):
            miss = _grn(cap, node)  # grn rule
        elif _fn(node) == "normalize" or _fn(node) in _L2_NORMS and _l2(node) and _divides(cap, node, through=_CLAMPS):
            miss = _l2_normalization(cap, node)  # l2 rule
        if miss is not None:
            found.append(miss)
    return found


def _is_statistic(cap: Captured, node: Any) -> bool:
    """A mean / var reduction (through casts): what a norm takes the sqrt of."""
    node = cap.source(node)
    return isinstance(node, fx.Node) and cap.op(node) in ("mean", "var")


def _biased(node: fx.Node) -> bool:
    """var / std with unbiased=False or correction=0 (the default of both is unbiased)."""
    unbiased = arg(node, 2, "unbiased", None)
    return unbiased is False or node.kwargs.get("correction", None) in (0, 0.0)


def _eps_added(cap: Captured, node: fx.Node) -> float | None:
    """The scalar added to ``node`` by its (only) add user, if any."""
    for u in cap.users_through(node):
        if cap.op(u) == "add":
            for v in u.args[:2]:
                if scalar(v) is not None:
                    return scalar(v)
    return None


def _divides(cap: Captured, node: fx.Node, depth: int = 3, through: frozenset[str] = frozenset()) -> bool:
    """``node`` (or node + eps, node ** 0.5, ...; ``through``: more op names to follow) ends up as a divisor
    within a few steps."""
    frontier = [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for u in cap.users_through(n):
                if cap.op(u) == "div" and len(u.args) > 1 and u.args[1] is n or _fn(u) == "reciprocal":
                    return True  # s / n, or 1 / n (torch.export writes s / n as reciprocal(n) * s)
                if cap.op(u) in ("add", "sqrt", "rsqrt", "pow") or _fn(u) in through:
                    nxt.append(u)
        frontier = nxt
    return False


_L2_NORMS = frozenset({"norm", "linalg_vector_norm", "vector_norm"})
_CLAMPS = frozenset({"clamp_min", "clamp", "clip", "maximum", "max", "expand_as"})


def _over_own_mean(cap: Captured, node: fx.Node) -> bool:
    """``node`` divided by its own mean over some dim, eps added or not: g / (g.mean(c) + eps), GRN's N(x)
    (torch.export writes the division as g * reciprocal(...))."""
    frontier = [u for u in cap.users_through(node) if cap.op(u) == "mean"]
    for _ in range(2):  # the mean, then + eps
        nxt = []
        for n in frontier:
            for u in cap.users_through(n):
                if cap.op(u) == "div" and len(u.args) > 1 and cap.source(u.args[1]) is n \
                        and cap.source(u.args[0]) is node:
                    return True
                if _fn(u) == "reciprocal" and any(cap.op(w) == "mul" and any(cap.source(a) is node for a in w.args[:2])
                                                  for w in cap.users_through(u)):
                    return True
                if cap.op(u) == "add":
                    nxt.append(u)
        frontier = nxt
    return False


def _l2(node: fx.Node) -> bool:
    """A 2-norm: x.norm(p=2) / torch.norm(x) (its default on vectors) / linalg.vector_norm(x, ord=2)."""
    p = arg(node, 1, "p", None) if _fn(node) == "norm" else arg(node, 1, "ord", 2)
    return p in (None, 2, 2.0, "fro")


def _mean_square_base(cap: Captured, node: fx.Node) -> fx.Node | None:
    """x when ``node`` is rsqrt(mean(x^2) [+ eps]), casts skipped anywhere."""
    s = cap.source(node.args[0])
    if isinstance(s, fx.Node) and cap.op(s) == "add":
        if scalar(s.args[1]) is not None:
            s = cap.source(s.args[0])
        elif scalar(s.args[0]) is not None:
            s = cap.source(s.args[1])
    if not (isinstance(s, fx.Node) and cap.op(s) == "mean"):
        return None
    x = cap.source(square_base(cap, cap.source(s.args[0]), set()))
    return x if isinstance(x, fx.Node) else None


def _multiplies(cap: Captured, node: fx.Node, x: fx.Node) -> bool:
    """The factor multiplies x itself somewhere (a norm detection did not accept for another reason)."""
    return any(cap.op(u) == "mul" and any(cap.source(a) is x for a in u.args[:2]) for u in cap.users_through(node))


def _n(cap: Captured, node: fx.Node) -> int | None:
    """How many elements the statistic reduces over, when shapes are known."""
    x = node.args[0] if node.args else None
    shape = cap.shape(x) if isinstance(x, fx.Node) else None
    dims = dims_of(arg(node, 1, "dim"))
    if shape is None:
        return None
    dims = dims if dims is not None else tuple(range(len(shape)))
    return math.prod(shape[d] for d in dims)


def _scale_note(n: int | None) -> str:
    if not n or n < 2:
        return ""
    return f"; for n={n} its output is sqrt((n-1)/n) = {math.sqrt((n - 1) / n):.5f} x a LayerNorm's"


def _where(cap: Captured, node: fx.Node) -> str:
    return cap.owner(node) or node.name


def _std(cap: Captured, node: fx.Node) -> NearMiss:
    eps = _eps_added(cap, node)
    biased = _biased(node)
    what = f"(x - mean) / ({'biased ' if biased else ''}std(x){f' + {eps:g}' if eps is not None else ''})"
    parts = [] if biased else ["torch.std is unbiased (divides by n-1)"]
    if eps is not None:
        parts.append("eps is added outside the sqrt")
    reason = ("not a LayerNorm: " + " and ".join(parts) + (_scale_note(_n(cap, node)) if not biased else "")
              + "; no exact native replacement, left as written")
    return NearMiss(_where(cap, node), node.name, what, reason, "std")


def _unbiased_var(cap: Captured, node: fx.Node) -> NearMiss:
    return NearMiss(_where(cap, node), node.name, "(x - mean) / sqrt(var(x) + eps), var unbiased",
                    "not a LayerNorm: torch.var is unbiased by default (divides by n-1); pass unbiased=False "
                    f"(correction=0) to make it one{_scale_note(_n(cap, node))}; left as written", "unbiased")


def _eps_outside(cap: Captured, node: fx.Node) -> NearMiss:
    eps = _eps_added(cap, node)
    return NearMiss(_where(cap, node), node.name, f"x / (sqrt(stat) + {eps:g})",
                    "not a native norm: eps is added after the sqrt, a native norm adds it under the sqrt "
                    "(outputs differ where the statistic is small); left as written", "eps-outside")


def _factor_only(cap: Captured, node: fx.Node, x: fx.Node) -> NearMiss:
    # what the factor scales: the other operand of each product it enters
    into = sorted({f"{cap.op(o) or o.name}({o.name})" for u in cap.users_through(node) if cap.op(u) == "mul"
                   for o in map(cap.source, u.args[:2]) if isinstance(o, fx.Node) and o is not node})
    return NearMiss(_where(cap, node), node.name, "rsqrt(mean(x^2) + eps), the factor 1/rms(x) alone",
                    f"not a norm: it returns only the RMSNorm factor, which its caller multiplies into "
                    f"{', '.join(into) or 'no product'} rather than into x (F.linear(x, W) * 1/rms(x) equals "
                    f"F.linear(rmsnorm(x), W) only for a bias-free linear); no native norm computes the factor "
                    f"alone, so it is left as written", "factor-only")


def _l2_normalization(cap: Captured, node: fx.Node) -> NearMiss:
    return NearMiss(_where(cap, node), node.name, "x / max(||x||_2, eps) (L2 normalization, F.normalize)",
                    "not a norm layer: the L2 norm is clamped below by eps where RMSNorm adds eps under the root, "
                    "and it is not divided by sqrt(n) (x / ||x|| = RMSNorm(x) / sqrt(n) only away from 0); no "
                    "native norm computes it exactly, so it is left as written", "l2")


def _grn(cap: Captured, node: fx.Node) -> NearMiss:
    return NearMiss(_where(cap, node), node.name, "x * (gamma * N(x) + 1) + beta, N(x) = ||x||_2 over space / (its "
                    "mean over channels + eps) (Global Response Normalization, ConvNeXt V2)",
                    "not an activation norm normconv rewrites: GRN rescales each channel by its share of the mean "
                    "response (statistics over space, then across channels); no native torch module or single "
                    "ONNX op computes it, so fold, canonicalize and swap leave it as written and export writes its "
                    "own ops", "grn")


__all__ = ["NearMiss", "find_near_misses"]
