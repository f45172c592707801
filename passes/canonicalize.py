"""Canonicalize hand-written norms into torch's native modules, carrying weights, bias, eps and dtype behaviour.

  (x - mean(x)) * rsqrt(var(x) + eps) * w + b          ->  nn.LayerNorm(shape, eps)
  x * rsqrt(mean(x^2) + eps) * w      (fp32 compute)    ->  nn.RMSNorm(shape, eps)
  x * rsqrt(mean(x^2) + eps) * (1 + w)  (Gemma)         ->  nn.RMSNorm with weight 1 + w
  (x - running_mean) / sqrt(running_var + eps) * w + b  ->  nn.BatchNormNd (eval)
"""

from __future__ import annotations

from typing import Sequence

from normconv.detect import NormSite
from normconv.graph import Captured
from normconv.report import Site

from .base import apply, skip

NAME = "canonicalize"

_NATIVE = {"layernorm": "nn.LayerNorm", "rmsnorm": "nn.RMSNorm", "batchnorm": "nn.BatchNorm{d}d",
           "instancenorm": "nn.InstanceNorm{d}d", "groupnorm": "nn.GroupNorm"}


def plan(cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
    return [_plan_one(cap, s) for s in norms]


def _plan_one(cap: Captured, site: NormSite) -> Site:
    # already one native op  =>  nothing to do
    if site.source != "handwritten":
        return skip(NAME, site, f"already native ({site.module_type or 'functional ' + site.kind})")
    # an intermediate (mean, rsqrt, ...) feeds other code  =>  replacing the subgraph would change that code
    if not site.self_contained:
        return skip(NAME, site, "an intermediate value of the norm is used outside it")
    # non-trailing normalized dims  =>  no native module normalizes them
    if site.kind == "layernorm" and site.dims is not None and site.dims != tuple(range(-len(site.dims), 0)):
        return skip(NAME, site, f"normalizes non-trailing dims {list(site.dims)}: no native equivalent")
    if site.eps == 0.0:
        return skip(NAME, site, "no epsilon inside the square root: native norms always add one")
    rank = len(cap.shape(cap.nodes[site.input]) or ()) or 4
    native = _NATIVE[site.kind].format(d=max(rank - 2, 1))
    extra = " with weight 1 + w" if site.weight_offset else ""
    where = f"module {site.target}" if site.target == site.owner else f"inline subgraph ({len(site.nodes)} ops)"
    return apply(NAME, site, f"replace {where} by {native}(eps={site.eps:g}){extra}")
