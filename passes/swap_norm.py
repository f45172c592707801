"""Swap LayerNorm <-> RMSNorm, exactly where the residual stream allows it.

  LN(x) = LN(x - mean(x));  if every writer of the stream is zero-mean, mean(x) = 0 and
  LN_{g,b,eps}(x) = RMSNorm_{g,eps}(x) + b      (same eps; b folds into the consuming linears: c <- c + W b)
  where b has no linear to fold into (the output feeds a transpose, a cat, an activation, the model's output),
  b stays an add after the RMSNorm (``BiasAfterNorm``): the same sum, still exact.
Pre-LN: center embeddings (row means) and each sublayer's output projection (W <- W - mean_rows W, b <- b - mean b).
  The stream is the sum tree of residual adds read by the norms; its leaves are the writers. Centering a writer
  changes every reader of the stream, so each stream value may be read only by the adds of the tree and by the
  (mean-invariant) LayerNorms being swapped.
  Writers past a multiplication: c * w(x) with c one constant number (embed_scale) keeps a zero mean: passed through;
  lambda * (W x + b) with lambda a constant per-feature Parameter (layer scale)  =>  W <- C diag(lambda) W,
  b <- C(lambda b), lambda <- ones (structure and keys kept); a product with a gate computed from the input has no
  weights-only rewrite (refused, naming it).
  A LayerNorm writing the stream (BLOOM, CLIP, Swin embeddings): mean(g n + b) = mean(g n) + mean(b) is zero for
  every input only if g is constant  =>  then b <- C b; otherwise refused. A norm module whose whole forward is one
  functional norm (OLMo: cast, F.layer_norm, cast back) is made a native module first (canonicalize).
Post-LN: the stream is re-normalized with a bias after every sublayer, so it is not zero-mean: approximate only.
RMSNorm -> LayerNorm: RMSNorm_{g,eps}(x) = LN_{g,0,eps}(x) when mean(x) = 0, i.e. when every writer is already
  zero-mean (a model this pass produced); otherwise approximate only.
Approximate (opt-in): a site that cannot be made exact is replaced as is (RMSNorm(g), b folded where possible);
  the output drift is measured and reported.
Stream only (rotate's swap): a norm inside a sublayer (a per-head q / k LayerNorm) reads the stream only through
  linears (``graph.residual.inner_norms``); centering the writers leaves its input as it is, so it is left unswapped.
The stream analysis (walk, writers, readers, the edits and their arithmetic) is ``normconv.graph.residual``; this
pass decides per site (``SwapWhy``) and replaces the norm modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch
import torch.nn as nn

from normconv.clone import clone_sharing_tensors
from normconv.errors import Code, NormconvError
from normconv.graph.capture import Captured, capture
from normconv.graph.detect import NormSite, find_norms
from normconv.graph.residual import (Consumer, Edits, Refused, Replaced, ResidualWhy, Stream, apply_, bias_consumers,
                                     hidden, inner_norms, kept_norm_module, moved_dims, norm_module, param_readers,
                                     streams, walks)
from normconv.graph.residual import edits as _edits
from normconv.kinds.layernorm import trailing_scale
from normconv.graph.residual import add_, bias_delta, center_  # noqa: F401  (normconv.stream applies them too)
from normconv.report import PassResult, Site, Why

from .base import Check, Pass, replace_module

NAME = "swap"

# --to -> the norm kind it replaces
SOURCE_KIND = {"rmsnorm": "layernorm", "layernorm": "rmsnorm"}
_ONLY_APPROXIMATE = "; only --approximate (drift measured)"


class SwapWhy(Why):
    """One member per rule of the swap's decision at a norm site."""

    EXACT_RMSNORM = "exact-to-rmsnorm"  # every writer of the stream centered, the bias folded: LN = RMSNorm + b
    EXACT_LAYERNORM = "exact-to-layernorm"  # the stream's writers are zero-mean already: RMSNorm = LN(no bias)
    APPROXIMATE = "approximate"  # --approximate: replaced as is, the drift measured
    OVERRIDES_FORWARD = "overrides-forward"  # a norm subclass whose forward computes more than the norm
    INLINE = "inline-norm"  # a norm written inline / functional: swap replaces modules
    MULTI_DIM = "multi-dim"  # normalizes more than one dim
    POST_LN = "post-ln"  # the stream is re-normalized with a bias after every sublayer: never zero-mean
    STREAM = "stream-refused"  # the stream's writers or readers refuse (``SitePlan.detail`` says which rule)
    BIAS_KEPT = "exact-bias-kept"  # exact; the bias has no linear to fold into, so it stays an add after the RMSNorm
    SHARED_MODULE = "module-shared"  # the same module is also called at a site that cannot be swapped
    NOT_ON_STREAM = "not-on-the-stream"  # stream only: inside a sublayer, its input unchanged by the swap: left


@dataclass
class SitePlan:
    site: NormSite
    module: str | None  # the norm module to replace (None: written inline, not swappable)
    exact: bool
    reason: str
    code: SwapWhy | None = None
    stream: int | None = None  # index into Analysis.streams
    consumers: list[Consumer] = field(default_factory=list)  # where b goes (to rmsnorm, b != 0)
    beta_problem: Refused | None = None  # why b cannot fold (then it is kept: ``keep_bias``)
    keep_bias: bool = False  # b stays an add after the RMSNorm (BiasAfterNorm)
    detail: ResidualWhy | None = None  # the residual analysis's own rule behind STREAM / BIAS
    moved: tuple[int, ...] | None = None  # a channels-first norm module: the dim it normalizes (``MovedDimNorm``)
    left: bool = False  # stream only: a norm inside a sublayer, left as it is (neither swapped nor a refusal)


@dataclass
class Analysis:
    to: str
    plans: list[SitePlan]
    streams: list[Stream]

    def sites(self, approximate: bool = False) -> list[Site]:
        out = []
        for p in self.plans:
            if p.left:
                out.append(Site(NAME, p.site.target, False, p.reason, p.code))
            elif p.exact:
                out.append(Site(NAME, p.site.target, True, p.reason, p.code))
            elif approximate and p.module is not None:
                out.append(Site(NAME, p.site.target, True, f"approximate ({p.reason})", SwapWhy.APPROXIMATE))
            else:
                out.append(Site(NAME, p.site.target, False, p.reason, p.code))
        return out


# ---------------------------------------------------------------------------------------------------------
# analysis (what plan shows and what the pass applies)


def analyze(cap: Captured, norms: Sequence[NormSite], to: str = "rmsnorm",
            read: Callable[[str], torch.Tensor] | None = None, add_bias: bool = True, keeps_class: bool = False,
            stream_only: bool = False) -> Analysis:
    """Plan the swap from the graph and shapes. The values it needs (is a norm's bias zero? is a writer already
    zero-mean?) come through ``read(state_dict name)``, by default the captured model's tensors: a plan made on
    the meta device reads them from the checkpoint instead (normconv.stream). ``add_bias`` False: a norm whose bias
    would need a bias added to a linear keeps it as an add after the RMSNorm (an output that keeps the architecture
    config.json describes, which gives that linear none: a Hugging Face folder). ``keeps_class``: the output keeps
    each norm's class (a Hugging Face folder written by normconv.stream), so a hand-written or functional norm that
    is its module's whole forward is that module's (graph.residual.kept_norm_module): only its writers change.
    ``stream_only``: a norm inside a sublayer is left as it is (``inner_norms``), planned as ``left``, and the
    streams are those of the others."""
    read = read or (lambda name: cap.tensor(name))
    if to not in SOURCE_KIND:
        raise ValueError(f"unknown target norm {to!r}")
    kind = SOURCE_KIND[to]
    sites = [s for s in norms if s.kind == kind]
    inner = inner_norms(cap, sites) if stream_only else {}
    left = [_left(sites[i], via) for i, via in sorted(inner.items())]
    sites = [s for i, s in enumerate(sites) if i not in inner]
    readers = param_readers(cap)
    plans = []
    for s in sites:
        # a channels-first norm module (permute, norm, permute back)  =>  replaced by MovedDimNorm(the new norm)
        module, moved = norm_module(cap, s), None
        if module is None and (moved := moved_dims(cap, s)) is not None:
            module = s.owner
        if module is None and keeps_class:  # a folder keeps the class computing it: Cohere's, OLMo's LayerNorm
            module = kept_norm_module(cap, s)
        plans.append(SitePlan(s, module, False, "", moved=moved))
    found = streams(cap, sites, walks(cap, sites), readers, to == "rmsnorm", read)
    for i, p in enumerate(plans):
        p.stream = next((k for k, st in enumerate(found) if i in st.sites), None)
    for p in plans:
        _decide(cap, p, found, readers, to, read, add_bias)
    # a norm module called at several sites is swapped at all of them or none
    by_module: dict[str, list[SitePlan]] = {}
    for p in plans:
        if p.module is not None:
            by_module.setdefault(p.module, []).append(p)
    for group in by_module.values():
        bad = next((p for p in group if not p.exact), None)
        if bad is not None and len(group) > 1:
            for p in group:
                if p.exact:
                    p.exact, p.code = False, SwapWhy.SHARED_MODULE
                    p.reason = f"{_elsewhere(len(group))}: {bad.reason}"
    # ... and with one bias: one call with no linear to take it  =>  an add after the RMSNorm at every call
    for group in by_module.values():
        kept = next((p for p in group if p.keep_bias), None)
        for p in group if kept is not None else ():
            if not p.keep_bias:
                p.keep_bias = True
                p.beta_problem = Refused(kept.beta_problem.code, f"{_elsewhere(len(group))}: "
                                                                 f"{kept.beta_problem}")
                if p.code is SwapWhy.EXACT_RMSNORM:
                    _bias_kept(p, found)
    order = {id(s): k for k, s in enumerate(norms)}
    return Analysis(to, sorted(plans + left, key=lambda p: order[id(p.site)]), found)


def _elsewhere(calls: int) -> str:
    """Where the reason of a module's other call comes from, in words (not a graph node's name)."""
    return f"the same module is called at {calls} places, and at another of them"


def _left(site: NormSite, via: list[str]) -> SitePlan:
    """A norm inside a sublayer: it reads the stream only through ``via``, whose outputs the centering keeps."""
    return SitePlan(site, None, False, f"not on the residual stream: it reads it only through {', '.join(via)}, whose "
                                       f"output the rewrite keeps; left as it is", SwapWhy.NOT_ON_STREAM, left=True)


def _decide(cap: Captured, p: SitePlan, found: list[Stream], readers, to: str, read, add_bias: bool) -> None:
    site = p.site
    mod = cap.modules.get(site.owner)
    # a norm subclass whose forward computes more  =>  not a module swap can replace
    if p.module is None and isinstance(mod, (nn.LayerNorm, nn.RMSNorm)):
        p.code = SwapWhy.OVERRIDES_FORWARD
        p.reason = (f"{site.owner} ({type(mod).__name__}) overrides forward and computes more than the norm there: "
                    f"swap replaces whole norm modules")
        return
    # an inline / functional norm  =>  swap replaces modules (canonicalize makes them modules first)
    if p.module is None:
        p.code = SwapWhy.INLINE
        p.reason = (f"{site.source} norm written inline in {site.owner or 'forward'}: swap replaces norm modules"
                    + (" (canonicalize could not make it one)" if site.source == "handwritten" else ""))
        return
    # normalized_shape of more than one dim  =>  no single hidden axis to center along
    if hidden(site) is None:
        p.code = SwapWhy.MULTI_DIM
        p.reason = f"normalizes {len(site.normalized_shape or ())} dims: only a single hidden dim is supported"
        return
    # post-LN  =>  the stream carries the previous norm's bias: never zero-mean, approximate only
    if site.placement == "post-norm":
        p.code = SwapWhy.POST_LN
        p.reason = ("post-LN: the residual stream is re-normalized (with its bias) after every sublayer, so it is "
                    "not zero-mean" + _ONLY_APPROXIMATE)
        if to == "rmsnorm":
            _bias(cap, p, readers, read, add_bias)
        return
    st = found[p.stream] if p.stream is not None else None
    if to == "rmsnorm":
        _bias(cap, p, readers, read, add_bias)
    # a writer that cannot be centered, or a reader that is not a LayerNorm  =>  approximate only
    if st is not None and st.problem:
        p.code, p.detail, p.reason = SwapWhy.STREAM, st.problem.code, f"{st.problem}{_ONLY_APPROXIMATE}"
        return
    p.exact = True
    if p.keep_bias:
        _bias_kept(p, found)
    elif to == "rmsnorm":
        # LN(x) on a zero-mean stream  =>  RMSNorm(x) * g, b folded into the consumers
        n = len([w for w in st.writers.values()]) if st else 0
        beta = f"; bias folds into {len(p.consumers)} consumer linear(s)" if p.consumers else ""
        p.code, p.reason = SwapWhy.EXACT_RMSNORM, f"to RMSNorm(eps={site.eps:g}), exact: {n} stream writer(s) " \
                                                  f"centered{beta}"
    else:
        # RMSNorm(x) on a zero-mean stream  =>  LN(x) without bias
        p.code = SwapWhy.EXACT_LAYERNORM
        p.reason = f"to LayerNorm(eps={site.eps:g}, no bias), exact: the stream's writers are zero-mean"


def _bias_kept(p: SitePlan, found: list[Stream]) -> None:
    """LN(x) on a zero-mean stream  =>  RMSNorm(x) * g + b, b an add after the norm (no linear takes it)."""
    n = len(found[p.stream].writers) if p.stream is not None else 0
    p.code, p.detail = SwapWhy.BIAS_KEPT, p.beta_problem.code if p.beta_problem else None
    p.reason = (f"to RMSNorm(eps={p.site.eps:g}) + bias, exact: {n} stream writer(s) centered; the bias stays an "
                f"add after the RMSNorm ({p.beta_problem})")


def _bias(cap: Captured, p: SitePlan, readers, read, add_bias: bool) -> None:
    """Where the norm's bias b goes: the linears that absorb it, or (none can) an add kept after the RMSNorm."""
    p.consumers, p.beta_problem = bias_consumers(cap, p.module, p.site.node, readers, read, add_bias)
    if p.moved is not None and p.beta_problem is not None:
        # channels-first: the first reader is the module's own permute back  =>  named for what it is
        p.beta_problem = Refused(ResidualWhy.CHANNELS_FIRST, f"{p.module} puts the normalized dim back in place, "
                                 f"where no linear layer reads it to take the bias")
    # b has no linear to fold into (a transpose, a cat, the output reads the norm)  =>  keep it as an add
    p.keep_bias = p.beta_problem is not None


def edits(cap: Captured, a: Analysis, approximate: bool = False,
          read: Callable[[str], torch.Tensor] | None = None) -> Edits:
    """The weight edits ``a`` plans (exact sites; every swappable site with ``approximate``); norm bias values
    are read through ``read`` (default: the captured model's tensors) to skip zero biases."""
    if a.to != "rmsnorm":
        return Edits()  # RMSNorm -> LayerNorm edits no weight: its writers are zero-mean already
    # a kept bias is neither folded nor dropped: the replacement adds it (BiasAfterNorm)
    replaced = [Replaced(p.module, p.stream, () if p.keep_bias else tuple(p.consumers), None) for p in a.plans
                if p.module is not None and (p.exact or approximate)]
    return _edits(cap, a.streams, replaced, read)


def refusal(a: Analysis) -> str | None:
    """Why the swap cannot be exact (the first refused site, post-LN first), or None."""
    refused = sorted((p for p in a.plans if not p.exact and not p.left), key=lambda p: p.code != SwapWhy.POST_LN)
    if not refused:
        return None
    p = refused[0]
    more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
    total = sum(not p.left for p in a.plans)
    return (f"swap: {len(refused)} of {total} {SOURCE_KIND[a.to]} sites cannot be swapped exactly; "
            f"{_where(p)}: {p.reason.removesuffix(_ONLY_APPROXIMATE)}{more}")


def _where(p: SitePlan) -> str:
    """The site in the model's terms: its module, or the module whose forward computes a functional / hand-written
    norm (its target is then a graph node's name, ``layer_norm_3``)."""
    site = p.site
    if p.module:
        return p.module
    if site.source != "module" and site.owner and site.target != site.owner:
        return f"the {site.kind} in {site.owner}"
    return site.target or "the module itself"


# ---------------------------------------------------------------------------------------------------------
# plan and apply


def plan(cap: Captured, norms: Sequence[NormSite], first: Pass | None = None) -> list[Site]:
    """What ``swap`` would do at each LayerNorm (to rmsnorm) and RMSNorm (to layernorm) site, in graph order.

    ``swap`` first makes hand-written and functional norms modules (``first``: the canonicalize pass the caller
    runs before it); when that changes the model, the plan is made on the model as swap will see it, and reported
    under the original site names."""
    if first is not None and any(s.applied for s in first.plan(cap, norms)):
        model = clone_sharing_tensors(cap.model)  # canonicalize builds new modules, writes no shared tensor
        result = first(model, cap.rebound(model) or capture(model, cap.inputs, cap.method))
        cap2 = capture(result.model, cap.inputs, cap.method)
        back = {new: old for old, new in result.extra["renamed"].items()}  # site -> the module that replaced it
        planned = {back.get(s.target, s.target): s for s in _plan_on(cap2, find_norms(cap2))}
        return [replace(planned[s.target], target=s.target) for s in norms if s.target in planned]
    return _plan_on(cap, norms)


def _plan_on(cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
    by_site: dict[int, Site] = {}
    for to in ("rmsnorm", "layernorm"):
        a = analyze(cap, norms, to)
        for p, s in zip(a.plans, a.sites()):
            # a refusal names the direction it refuses (an applied site already says "to RMSNorm(...)")
            by_site[id(p.site)] = s if s.applied else replace(s, reason=f"--to {to}: {s.reason}")
    return [by_site[id(s)] for s in norms if id(s) in by_site]


class SwapPass(Pass):
    """LayerNorm -> RMSNorm (``to="rmsnorm"``) or back (``to="layernorm"``); see the module docstring."""

    name = NAME
    check = Check.EXACT  # an approximate site applied: the result says exact=False, its drift is measured
    # a stream that enters a submodule's graph as an input has writers the graph does not show: such a site is
    # refused, as at any graph input; the rest is proved within the submodule's graph
    by_parts = True
    trains = True  # an RMSNorm model to fine-tune: dropout on the centered stream makes it differ (engine.training)

    def __init__(self, to: str = "rmsnorm", approximate: bool = False, require: bool = True, partial: bool = False,
                 add_bias: bool = True, stream_only: bool = False):
        if to not in SOURCE_KIND:
            raise NormconvError(f"unknown --to {to!r}: choose rmsnorm or layernorm")
        if partial and approximate:
            raise NormconvError("choose --partial (swap only the exact sites) or --approximate (swap them all)")
        self.to, self.approximate = to, approximate
        self.partial = partial  # swap the exact sites, keep the others as they are: the result stays exact
        self.require = require  # False: a model with no norm to swap passes through unchanged (rotate, fold-scales)
        self.add_bias = add_bias  # False: no bias added to a linear (the output keeps the architecture's parameters)
        self.stream_only = stream_only  # True: norms inside a sublayer are left as they are (rotate's swap)
        self._parts = False  # True while run on parts: a part with nothing to swap is no error (end_parts)

    def begin_parts(self) -> None:
        self._parts = True

    def plan(self, cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
        a = analyze(cap, norms, self.to, add_bias=self.add_bias, stream_only=self.stream_only)
        return a.sites(self.approximate)

    def __call__(self, model: nn.Module, cap: Captured) -> PassResult:
        a = analyze(cap, find_norms(cap), self.to, add_bias=self.add_bias, stream_only=self.stream_only)
        kind = SOURCE_KIND[self.to]
        extra = {"plans": tuple(a.plans), "dropped": []}
        if not a.plans and (not self.require or self._parts):
            return PassResult(model, False, (), extra=extra)
        if not a.plans:
            raise NormconvError(f"swap: {type(model).__name__} has no {kind} to swap to {self.to}", Code.REFUSED,
                                pass_name=NAME)
        why = refusal(a)
        if why and self.partial and not any(p.exact and p.module is not None for p in a.plans):
            if self._parts:  # another part may have exact sites: this one keeps its norms, each row says why
                return PassResult(model, False, tuple(a.sites(False)), extra=extra)
            raise NormconvError(why, Code.REFUSED, pass_name=NAME,
                                hint="--partial: no site can be swapped exactly, so nothing would change")
        if why and not self.approximate and not self.partial:
            raise NormconvError(why, Code.REFUSED, pass_name=NAME,
                                hint="Pass --partial to swap only the exact sites, or --approximate to swap them all "
                                     "and measure the drift (normconv inspect lists every site)")
        notes: list[str] = []
        if why and self.partial:
            # the kept norms read streams whose writers may be centered: a LayerNorm does not see a mean shift
            kept = sum(not p.exact for p in a.plans)
            notes.append(f"--partial: {len(a.plans) - kept} of {len(a.plans)} {kind} sites swapped exactly, "
                         f"{kept} kept as they are (each row says why)")
        plan = edits(cap, a, self.approximate)
        exact = True
        with torch.no_grad():
            apply_(model, cap, plan, notes)  # untie, fold layer scales, center the writers, fold the biases
            replaced: set[str] = set()
            for p in a.plans:
                if p.module is None or not (p.exact or self.approximate):
                    continue
                exact = exact and p.exact
                if p.module not in replaced:
                    replaced.add(p.module)
                    replace_module(model, p.module, self._replacement(cap, p))
        if plan.dropped:
            notes.append(f"bias dropped at {len(plan.dropped)} norm(s), e.g. {plan.dropped[0]}")
        return PassResult(model, bool(replaced), tuple(a.sites(self.approximate)), tuple(notes),
                          {"plans": tuple(a.plans), "dropped": list(plan.dropped)}, exact)

    def end_parts(self, model: nn.Module, results: Sequence[PassResult]) -> None:
        """After a run on parts: the errors a whole graph gives at once (no site to swap, no exact site)."""
        self._parts = False
        if not any(r.sites for r in results) and self.require:
            raise NormconvError(f"swap: {type(model).__name__} has no {SOURCE_KIND[self.to]} to swap to {self.to} "
                                f"in any submodule captured alone", Code.REFUSED, pass_name=NAME)
        if self.partial and not any(r.modified for r in results):
            raise NormconvError("swap: --partial: no site can be swapped exactly in any submodule captured alone, so "
                                "nothing would change (normconv inspect lists every site)", Code.REFUSED,
                                pass_name=NAME)

    def _replacement(self, cap: Captured, p: SitePlan) -> nn.Module:
        from normconv.nn.modules import BiasAfterNorm, MovedDimNorm
        from normconv.nn.rmsnorm import make_rmsnorm

        old = cap.modules[p.module]
        weight = getattr(old, "weight", None)
        dtype = weight.dtype if weight is not None else cap.dtype(cap.nodes[p.site.input])
        if weight is not None and p.site.weight_offset:  # the scale is w + c (LayerNorm1P's weight + 1)
            weight = trailing_scale(p.site, weight, dtype)
        shape = tuple(old.normalized_shape)
        if self.to == "rmsnorm":
            # LN(g, b, eps) on a zero-mean stream  =>  RMSNorm(g, eps)   (b already folded)
            new = make_rmsnorm(shape, float(old.eps), weight.detach() if weight is not None else None, dtype)
            if p.keep_bias:  # b no linear takes  =>  RMSNorm(x) * g + b
                new = BiasAfterNorm(new, old.bias)
        else:
            # RMSNorm(g, eps) on a zero-mean stream  =>  LN(g, no bias, eps)   (eps=None resolved to finfo.eps)
            new = nn.LayerNorm(shape, eps=float(p.site.eps), elementwise_affine=weight is not None, bias=False,
                               dtype=dtype, device=weight.device if weight is not None else None)
            if weight is not None:
                new.weight.data.copy_(weight.detach())
        if p.moved is not None:  # channels-first: the same permutes around the new norm
            new = MovedDimNorm(new, p.moved)
        new.train(old.training)
        return new


__all__ = ["NAME", "SOURCE_KIND", "SwapWhy", "SwapPass", "SitePlan", "Analysis", "analyze", "edits", "refusal",
           "plan", "Edits", "center_", "bias_delta", "add_"]
