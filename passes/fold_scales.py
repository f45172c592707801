"""Fold each RMSNorm's scale into the linears that read its output; the norm becomes weight-free.

  RMSNorm_g(x) W^T = (RMSNorm_1(x) * g) W^T = RMSNorm_1(x) (W diag(g))^T      =>  W <- W diag(g)  (scale input columns)
  (HF Conv1D, W of shape (in, out):  RMSNorm_1(x) (diag(g) W)                 =>  W <- diag(g) W)
Gemma's x * (1 + w) arrives here as a native RMSNorm with weight 1 + w (canonicalize made it one).
Every reader of the norm's output must be a linear taking it as input (q/k/v, gate/up, lm_head all take the fold);
any other reader, or a norm output the model returns, keeps the scale (skip, with the reason). A reader weight also
read elsewhere (a tied lm_head, a linear called on two different norms) is untied first when only the reader's own
module holds it that way; otherwise the site is skipped. Math in float64, cast back to the weight dtype.
This is FlashNorm / the first step of SliceGPT / QuaRot's computational invariance (``passes/rotate.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from normconv.graph.capture import Captured
from normconv.graph.detect import NormSite, find_norms
from normconv.report import PassResult, Site
from .base import replace_module
from .swap_norm import _linear_of, _norm_module, _own_name, _owns, _param_readers, _passes_through

NAME = "fold-scales"


@dataclass(frozen=True)
class Reader:
    """A linear that reads a norm's output: its weight's input axis is the norm's hidden dim."""

    node: str
    weight: str  # state_dict name
    bias: str | None
    layout: str  # out_in: nn.Linear / F.linear (out, D) | in_out: addmm / HF Conv1D (D, out)
    module: str


@dataclass
class ScalePlan:
    site: NormSite
    module: str | None
    readers: list[Reader] = field(default_factory=list)
    problem: str | None = None
    unties: list[Reader] = field(default_factory=list)  # readers whose tied weight is cloned first

    @property
    def ok(self) -> bool:
        return self.problem is None and self.module is not None


def norm_readers(cap: Captured, node: fx.Node) -> tuple[list[Reader], str | None]:
    """The linears reading ``node`` (through casts / dropout / views), or why some reader is not one."""
    readers: list[Reader] = []
    stack, seen = [node], set()
    while stack:
        v = stack.pop()
        users = cap.users(v)
        if not users:
            return [], f"the norm output {v.name} is not read by any layer"
        for u in users:
            if u.name in seen:
                continue
            seen.add(u.name)
            if u.op == "output":
                return [], f"the norm output {v.name} is returned by the model"
            if _passes_through(cap, u) and u.args[0] is v:
                stack.append(u)
                continue
            lin = _linear_of(cap, u) if cap.op(u) == "linear" else None
            if lin is None or lin[0] is not v or lin[1] is None:
                return [], f"{cap.describe(u)} reads the norm output and is not a linear layer"
            readers.append(Reader(u.name, _own_name(cap, lin[4], lin[1]), _own_name(cap, lin[4], lin[2]), lin[3],
                                  lin[4]))
    return readers, None


def _own_module_attr(cap: Captured, r: Reader) -> tuple[nn.Module, str] | None:
    """(module, attribute) when the reader's module holds its weight as its own parameter (it can be re-bound)."""
    mod = cap.modules.get(r.module)
    if mod is None:
        return None
    t = cap.tensor(r.weight)
    for attr, p in mod._parameters.items():
        if p is t:
            return mod, attr
    return None


def check_weights(cap: Captured, readers: Sequence[Reader], param_readers: dict[int, list[str]],
                  allowed: set[str]) -> tuple[list[Reader], str | None]:
    """Readers whose weight is also read by nodes outside ``allowed``: untie them (a module's own parameter
    read by another module under a tie) or give the reason it cannot be edited."""
    unties = []
    for r in readers:
        t = cap.tensor(r.weight)
        if t is None:
            return [], f"{r.weight} (read by {r.node}) is not a parameter of the model"
        foreign = [n for n in param_readers.get(id(t), []) if n not in allowed]
        if not foreign:
            continue
        # foreign readers of another module (lm_head.weight is wte.weight)  =>  clone the reader's own copy
        own = _own_module_attr(cap, r)
        if own is not None and all(_owns(cap, n, t) != r.module for n in foreign):
            unties.append(r)
            continue
        return [], f"{r.weight} is also read by {cap.describe(cap.nodes[foreign[0]])}, so it cannot take the scale"
    return unties, None


def analyze(cap: Captured, norms: Sequence[NormSite]) -> list[ScalePlan]:
    """One plan per RMSNorm site: its readers, what to untie, or why the scale stays."""
    param_readers = _param_readers(cap)
    plans = []
    for s in norms:
        if s.kind != "rmsnorm":
            continue
        p = ScalePlan(s, _norm_module(cap, s))
        plans.append(p)
        mod = cap.modules.get(p.module) if p.module else None
        if p.module is None or not isinstance(mod, nn.RMSNorm):
            p.problem = f"{s.source} norm written inline in {s.owner or 'forward'}: canonicalize could not make it " \
                        f"a module"
            continue
        if mod.weight is None:
            p.problem = "already weight-free"
            continue
        if len(tuple(mod.normalized_shape)) != 1:
            p.problem = "normalizes more than one dim"
            continue
        p.readers, p.problem = norm_readers(cap, cap.nodes[s.node])
        if p.problem is None:
            p.unties, p.problem = check_weights(cap, p.readers, param_readers, {r.node for r in p.readers})
    # a norm module called at several sites folds at all of them or none (one weight, one set of readers)
    by_module: dict[str, list[ScalePlan]] = {}
    for p in plans:
        if p.module is not None:
            by_module.setdefault(p.module, []).append(p)
    for group in by_module.values():
        if len(group) > 1:
            for p in group:
                p.problem = p.problem or f"the norm module is called at {len(group)} sites"
    return plans


def sites(plans: Sequence[ScalePlan]) -> list[Site]:
    out = []
    for p in plans:
        if p.ok:
            untie = f"; untied {', '.join(r.weight for r in p.unties)}" if p.unties else ""
            out.append(Site(NAME, p.site.target, True,
                            f"scale folded into {len(p.readers)} linear(s): {', '.join(r.module for r in p.readers)}"
                            f"{untie}"))
        else:
            out.append(Site(NAME, p.site.target, False, p.problem or ""))
    return out


def plan(cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
    return sites(analyze(cap, norms))


def untie(model: nn.Module, cap: Captured, r: Reader, notes: list[str]) -> None:
    """Give the reader's module its own copy of a tied weight (the other holder keeps the original)."""
    from .swap_norm import _untie_config

    found = _own_module_attr(cap, r)
    assert found is not None
    mod, attr = found
    old = getattr(mod, attr)
    setattr(mod, attr, nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad))
    notes.append(f"untied {r.module}.{attr}: it takes a norm scale (or rotation) its tied twin does not")
    _untie_config(model, notes)


class FoldScales:
    """RMSNorm(g) -> weight-free RMSNorm, g folded into the reading linears; see the module docstring."""

    name = NAME
    exact = True

    def __init__(self, strict: bool = False):
        self.strict = strict  # raise on the first site that cannot fold (rotate needs every scale gone)
        self.notes: list[str] = []
        self.plans: list[ScalePlan] = []

    def plan(self, cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
        return plan(cap, norms)

    def __call__(self, model: nn.Module, cap: Captured) -> PassResult:
        from normconv.errors import NormconvError
        from normconv.nn.rmsnorm import make_rmsnorm

        self.plans = analyze(cap, find_norms(cap))
        if self.strict:
            bad = next((p for p in self.plans if not p.ok and p.problem != "already weight-free"), None)
            if bad is not None:
                raise NormconvError(f"fold-scales: {bad.site.target}: {bad.problem}")
        modified = False
        with torch.no_grad():
            for p in self.plans:
                if not p.ok:
                    continue
                norm = cap.modules[p.module]
                g = norm.weight.detach().double().reshape(-1)
                for r in p.unties:
                    untie(model, cap, r, self.notes)
                done: set[int] = set()
                for r in p.readers:
                    own = _own_module_attr(cap, r)
                    t = getattr(*own) if own is not None else cap.tensor(r.weight)
                    if id(t) in done:
                        continue
                    done.add(id(t))
                    w64 = t.detach().double()
                    # nn.Linear W (out, D)  =>  W diag(g);   HF Conv1D W (D, out)  =>  diag(g) W
                    new = w64 * g[None, :] if r.layout == "out_in" else w64 * g[:, None]
                    _assign(model, cap, r, t, new.to(t.dtype))
                # the norm keeps eps and shape, loses its weight
                replace_module(model, p.module, make_rmsnorm(tuple(norm.normalized_shape), norm.eps, None,
                                                             norm.weight.dtype))
                modified = True
        return PassResult(model, modified, tuple(sites(self.plans)))


def _assign(model: nn.Module, cap: Captured, r: Reader, t: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``value`` into the rewrite's own copy of ``t`` (ties kept)."""
    from normconv.clone import owned

    mine = owned(model, t)
    mine.data.copy_(value)


__all__ = ["FoldScales", "Reader", "ScalePlan", "analyze", "norm_readers", "check_weights", "plan", "untie", "NAME"]
