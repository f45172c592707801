"""Fold each RMSNorm's scale into the linears that read its output; the norm becomes weight-free.
(``nn.rmsnorm.ScaleFreeRMSNorm``: no weight to compute with, yet a ``weight`` of ones the model's own code can read.)

  RMSNorm_g(x) W^T = (RMSNorm_1(x) * g) W^T = RMSNorm_1(x) (W diag(g))^T      =>  W <- W diag(g)  (scale input columns)
  (HF Conv1D, W of shape (in, out):  RMSNorm_1(x) (diag(g) W)                 =>  W <- diag(g) W)
Gemma's x * (1 + w) arrives here as a native RMSNorm with weight 1 + w (canonicalize made it one).
Every reader of the norm's output must be a linear taking it as input (q/k/v, gate/up, lm_head all take the fold);
any other reader, or a norm output the model returns, keeps the scale (skip, with the reason). A reader weight also
read elsewhere (a tied lm_head, a linear called on two different norms) is untied first when only the reader's own
module holds it that way; otherwise the site is skipped. Math in float64, cast back to the weight dtype.
This is FlashNorm / the first step of SliceGPT / QuaRot's computational invariance (``passes/rotate.py``).
Stream only (rotate's fold): a norm inside a sublayer (a per-head q / k norm: RMSNorm(x W_q^T) g, read by the rotary
embedding) reads the stream only through linears, whose outputs a rotation keeps (``graph.residual.inner_norms``):
its scale need not go, so it is left as it is (NOT_ON_STREAM), never a refusal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn as nn

from normconv.clone import owned
from normconv.errors import Code, NormconvError
from normconv.graph.capture import Captured
from normconv.graph.detect import NormSite, find_norms
from normconv.graph.residual import (Reader, Refused, ResidualWhy, check_weights, inner_norms, norm_module,
                                     norm_readers, own_module_attr, param_readers, untie)
from normconv.nn.modules import NormWrapper
from normconv.nn.rmsnorm import ScaleFreeRMSNorm, has_scale
from normconv.report import PassResult, Site, Why

from .base import Check, Pass, replace_module

NAME = "fold-scales"


class FoldScalesWhy(Why):
    """One member per rule of the scale fold at an RMSNorm site."""

    FOLDED = "folded"  # g folded into every linear reading the norm; the norm is weight-free now
    INLINE = "inline-norm"  # the norm is not a module (canonicalize could not make it one)
    WEIGHT_FREE = "already-weight-free"  # nothing to fold
    MULTI_DIM = "multi-dim"  # normalizes more than one dim
    READERS = "readers-refuse"  # a reader of the norm's output is not a linear taking it (``ScalePlan.detail``)
    WEIGHT_SHARED = "weight-shared"  # a reader's weight is read elsewhere and cannot be untied
    SHARED_MODULE = "module-shared"  # the norm module is called at several sites
    NOT_ON_STREAM = "not-on-the-stream"  # stream only: inside a sublayer, read through linears; left as it is


@dataclass
class ScalePlan:
    site: NormSite
    module: str | None
    readers: list[Reader] = field(default_factory=list)
    problem: str | None = None
    unties: list[Reader] = field(default_factory=list)  # readers whose tied weight is cloned first
    code: FoldScalesWhy = FoldScalesWhy.FOLDED
    detail: ResidualWhy | None = None  # the residual analysis's own rule behind READERS / WEIGHT_SHARED

    @property
    def ok(self) -> bool:
        return self.problem is None and self.module is not None

    def refuse(self, code: FoldScalesWhy, why: str | Refused) -> None:
        self.code, self.problem = code, str(why)
        self.detail = why.code if isinstance(why, Refused) else None


def analyze(cap: Captured, norms: Sequence[NormSite], stream_only: bool = False) -> list[ScalePlan]:
    """One plan per RMSNorm site: its readers, what to untie, or why the scale stays. ``stream_only``: a norm
    inside a sublayer is left as it is (NOT_ON_STREAM)."""
    readers_of = param_readers(cap)
    plans = []
    # inner_norms over every kind: a per-head LayerNorm reads the stream the way a per-head RMSNorm does
    inner = inner_norms(cap, norms) if stream_only else {}
    for i, s in enumerate(norms):
        if s.kind != "rmsnorm":
            continue
        p = ScalePlan(s, norm_module(cap, s))
        plans.append(p)
        # read through linears only (q_proj -> q_norm)  =>  a rotation of the stream keeps its input: left
        if i in inner:
            p.refuse(FoldScalesWhy.NOT_ON_STREAM, f"not on the residual stream: it reads it only through "
                                                  f"{', '.join(inner[i])}, whose output a rotation keeps; left as "
                                                  f"it is")
            continue
        mod = cap.modules.get(p.module) if p.module else None
        # an inline norm  =>  no module whose weight could go
        if p.module is None or not isinstance(mod, nn.RMSNorm):
            p.refuse(FoldScalesWhy.INLINE, f"{s.source} norm written inline in {s.owner or 'forward'}: canonicalize "
                                           f"could not make it a module")
            continue
        if not has_scale(mod):
            p.refuse(FoldScalesWhy.WEIGHT_FREE, "already weight-free")
            continue
        if len(tuple(mod.normalized_shape)) != 1:
            p.refuse(FoldScalesWhy.MULTI_DIM, "normalizes more than one dim")
            continue
        # every reader a linear taking the norm's output  =>  W <- W diag(g)
        p.readers, why = norm_readers(cap, cap.nodes[s.node])
        if why is not None:
            p.refuse(FoldScalesWhy.READERS, why)
            continue
        # a reader weight read elsewhere  =>  untie the reader's own copy, else the scale stays
        p.unties, why = check_weights(cap, p.readers, readers_of, {r.node for r in p.readers})
        if why is not None:
            p.refuse(FoldScalesWhy.WEIGHT_SHARED, why)
    # a norm module called at several sites folds at all of them or none (one weight, one set of readers)
    by_module: dict[str, list[ScalePlan]] = {}
    for p in plans:
        if p.module is not None:
            by_module.setdefault(p.module, []).append(p)
    for group in by_module.values():
        if len(group) > 1:
            for p in group:
                if p.problem is None:
                    p.refuse(FoldScalesWhy.SHARED_MODULE, f"the norm module is called at {len(group)} sites")
    return plans


def sites(plans: Sequence[ScalePlan]) -> list[Site]:
    out = []
    for p in plans:
        if p.ok:
            untied = f"; untied {', '.join(r.weight for r in p.unties)}" if p.unties else ""
            out.append(Site(NAME, p.site.target, True,
                            f"scale folded into {len(p.readers)} linear(s): {', '.join(r.module for r in p.readers)}"
                            f"{untied}", p.code))
        else:
            out.append(Site(NAME, p.site.target, False, p.problem or "", p.code))
    return out


def plan(cap: Captured, norms: Sequence[NormSite], stream_only: bool = False) -> list[Site]:
    return sites(analyze(cap, norms, stream_only))


class FoldScales(Pass):
    """RMSNorm(g) -> weight-free RMSNorm, g folded into the reading linears; see the module docstring."""

    name = NAME
    check = Check.EXACT

    def __init__(self, strict: bool = False, stream_only: bool = False):
        self.strict = strict  # raise on the first site that cannot fold (rotate needs every scale gone)
        self.stream_only = stream_only  # leave the norms inside a sublayer (rotate: only the stream's scales go)

    def plan(self, cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
        return plan(cap, norms, self.stream_only)

    def __call__(self, model: nn.Module, cap: Captured) -> PassResult:
        plans = analyze(cap, find_norms(cap), self.stream_only)
        if self.strict:
            kept = (FoldScalesWhy.WEIGHT_FREE, FoldScalesWhy.NOT_ON_STREAM)
            bad = next((p for p in plans if not p.ok and p.code not in kept), None)
            if bad is not None:
                raise NormconvError(f"fold-scales: {_named(cap, bad.site.target)}: {bad.problem}", Code.REFUSED,
                                    pass_name=NAME)
        modified = False
        notes: list[str] = []
        with torch.no_grad():
            for p in plans:
                if not p.ok:
                    continue
                norm = cap.modules[p.module]
                g = norm.weight.detach().double().reshape(-1)
                for r in p.unties:
                    untie(model, cap, r, notes)
                done: set[int] = set()
                for r in p.readers:
                    own = own_module_attr(cap, r)
                    t = getattr(*own) if own is not None else cap.tensor(r.weight)
                    if id(t) in done:
                        continue
                    done.add(id(t))
                    w64 = t.detach().double()
                    # nn.Linear W (out, D)  =>  W diag(g);   HF Conv1D W (D, out)  =>  diag(g) W
                    new = w64 * g[None, :] if r.layout == "out_in" else w64 * g[:, None]
                    owned(model, t).data.copy_(new.to(t.dtype))  # the rewrite's own copy of t (ties kept)
                # the norm keeps eps and shape, loses its weight (which still reads as ones, as the model may read it)
                replace_module(model, p.module, ScaleFreeRMSNorm(tuple(norm.normalized_shape), norm.eps, norm.weight))
                modified = True
        return PassResult(model, modified, tuple(sites(plans)), tuple(notes), {"plans": tuple(plans)})



def _named(cap: Captured, target: str) -> str:
    """The model's module a site is: a norm inside one of normconv's wrappers (the RMSNorm a swap put in place of a
    LayerNorm whose bias stays after it, ``BiasAfterNorm``) is named by the wrapper, the model's own path."""
    parent, _, child = target.rpartition(".")
    return parent if child == "norm" and isinstance(cap.modules.get(parent), NormWrapper) else target


__all__ = ["FoldScales", "FoldScalesWhy", "ScalePlan", "analyze", "plan", "sites", "NAME"]
