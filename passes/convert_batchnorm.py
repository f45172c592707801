"""Convert BatchNorm to what training and the edge need (``normconv swap --to ...``), one module at a time.

Eval-mode BatchNorm is y = x * s + t per channel (dim 1):  s = w * rsqrt(rv + eps),  t = b - rm * s.

  frozen-batchnorm  -> FrozenBatchNorm(C, eps): the same w, b, rm, rv as buffers, torchvision's FrozenBatchNorm2d
                       forward (x * s + t), the model's own eps. Exact (eval); nothing trains or updates after.
  batchnorm         SyncBatchNorm, a frozen BatchNorm, mmcv's / detectron2's modules -> nn.BatchNorm{1,2,3}d by the
                       input's rank, the same tensors, eps and momentum. Exact (eval); runs on CPU and exports.
  affine            -> ChannelAffine(s, t): one Mul and one Add that every runtime lowers; ``as_conv``: a depthwise
                       1x1 conv, Conv(C, C, 1, groups=C) with W[c, 0, 1...] = s_c and bias t. Exact (eval).
  groupnorm[:G]     -> GroupNorm(G, C, eps) with w and b: statistics of each sample's group of C/G channels replace
                       the running ones. Approximate (drift reported). Refused where a group holds one value per
                       sample (C/G * prod(spatial) = 1): GroupNorm(C, C) on (N, C) maps every value to 0, i.e. to b.
  instancenorm      -> InstanceNorm{1,2,3}d(C, eps, affine) with w and b: per-sample, per-channel statistics.
                       Approximate; refused on (N, C) and on one value per channel (the same erasure).

A module whose forward is the BatchNorm and then its own children (timm's BatchNormAct2d / SyncBatchNormAct /
FrozenBatchNormAct2d: drop, act) keeps them: nn.Sequential(norm=<new>, drop=..., act=...) (graph.norm_module).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Sequence

import torch
import torch.nn as nn

from normconv.graph.bn_affine import Refusal, batchnorm_sites, channel_affine, channel_vector, statistics
from normconv.graph.capture import Captured
from normconv.graph.detect import NormSite, find_norms
from normconv.graph.norm_module import ModuleForm, NotAModule, module_form, replace_in_graph, with_tail
from normconv.nn.modules import ChannelAffine, FrozenBatchNorm
from normconv.report import PassResult, Site, Why

from .base import Check, Pass, apply, replace_module, skip

NAME = "convert-batchnorm"
TARGETS = ("frozen-batchnorm", "batchnorm", "affine", "groupnorm", "instancenorm")
APPROXIMATE = ("groupnorm", "instancenorm")
MAX_GROUPS = 32  # GroupNorm's usual count (Wu & He 2018), the default's ceiling
FEW_VALUES = 8  # a default group holds at least this many values per sample where the shapes allow it


class ConvertWhy(Why):
    """One member per rule."""

    FROZEN = "to-frozen-batchnorm"  # w, b, rm, rv become a FrozenBatchNorm's buffers
    BATCHNORM = "to-batchnorm"  # the same tensors in torch's nn.BatchNormNd
    AFFINE = "to-affine"  # x * s + t as a ChannelAffine
    AS_CONV = "to-depthwise-conv"  # x * s + t as a depthwise 1x1 conv
    GROUPNORM = "to-groupnorm"  # approximate: group statistics per sample
    INSTANCENORM = "to-instancenorm"  # approximate: channel statistics per sample
    ALREADY = "already-target"  # the module already is what was asked for
    GROUPS = "groups-do-not-divide"  # G does not divide the channels
    ERASES = "erases-the-signal"  # a group / instance holds one value per sample: the output would be constant
    NO_SPATIAL = "no-spatial-dims"  # the input has no spatial dims the target needs
    # the module to replace (graph.norm_module)
    INLINE = "inline"  # computed inside a larger forward: no module to replace
    MORE_CODE = "forward-computes-more"  # its module computes more than the BatchNorm and its children
    CALLED_TWICE = "module-called-several-times"  # replacing it would replace every call
    READ_BY_GRAPH = "tensors-read-by-graph"  # never called: the model's graph reads its tensors in more than one op
    # the BatchNorm itself (graph.bn_affine)
    NO_STATS = "no-running-stats"  # track_running_stats=False: nothing to freeze or to fold into an affine
    BATCH_STATS = "batch-statistics"  # F.batch_norm(training=True)
    BN_SHARED = "bn-called-at-several-places"
    NO_CHANNEL_DIM = "no-channel-dim"
    STATS_NOT_TENSOR = "stats-not-tensor"
    NOT_PER_CHANNEL = "not-per-channel"


class InTraining(str, Enum):
    """How a converted model computes otherwise in training mode (``model.train()``) than the original: the cause
    the door's training check (engine.training) names where it measures a difference."""

    FROZEN = "frozen-statistics"  # the new module keeps the running statistics; a BatchNorm trains on batch ones
    LIVE = "batch-statistics"  # a live BatchNorm where a frozen one was: batch statistics, running ones updated
    FIXED_AFFINE = "fixed-affine"  # x * s + t (or folded away): the eval-mode BatchNorm, in training mode too
    SAMPLE = "sample-statistics"  # each sample's own statistics, in both modes


_LIVE = ("normalizes by the batch's statistics and updates its running statistics (momentum) at every forward")
_IN_TRAINING = {
    "frozen-batchnorm": (InTraining.FROZEN, "a FrozenBatchNorm normalizes by its running statistics in training mode "
                                            f"too and never updates them, where the BatchNorm it replaces {_LIVE}"),
    "affine": (InTraining.FIXED_AFFINE, "x * s + t (and a BatchNorm folded into its neighbour) is the eval-mode "
                                        f"BatchNorm in training mode too, where the BatchNorm it replaces {_LIVE}"),
    "groupnorm": (InTraining.SAMPLE, "GroupNorm normalizes by each sample's group statistics in both modes, where "
                                     f"the BatchNorm it replaces {_LIVE}"),
    "instancenorm": (InTraining.SAMPLE, "InstanceNorm normalizes by each sample's channel statistics in both modes, "
                                        f"where the BatchNorm it replaces {_LIVE}"),
}


_APPLIED = {"frozen-batchnorm": ConvertWhy.FROZEN, "batchnorm": ConvertWhy.BATCHNORM, "affine": ConvertWhy.AFFINE,
            "groupnorm": ConvertWhy.GROUPNORM, "instancenorm": ConvertWhy.INSTANCENORM}


@dataclass
class Decision:
    site: NormSite
    applied: bool
    reason: str
    code: ConvertWhy
    path: str = ""
    module: nn.Module | None = field(default=None, repr=False)  # the replacement (with the kept children)
    held: bool = False  # the model's graph reads the module's tensors: the replacement takes its op's place there

    def to_site(self) -> Site:
        return (apply if self.applied else skip)(NAME, self.site, self.reason, self.code)


class _No(Exception):
    def __init__(self, code: ConvertWhy, message: str):
        super().__init__(message)
        self.code = code


def default_groups(channels: int, per_channel: int) -> int:
    """The largest divisor of ``channels`` up to MAX_GROUPS that leaves two channels or more in a group (G = C would be
    InstanceNorm: ask for it by name) whose groups hold FEW_VALUES values per sample (each channel brings
    ``per_channel``), else the largest whose groups hold two; 0 when even one group holds one."""
    divisors = [g for g in range(min(channels, MAX_GROUPS), 0, -1)
                if channels % g == 0 and (channels // g >= 2 or channels == 1)]
    for least in (FEW_VALUES, 2):
        for g in divisors:
            if channels // g * per_channel >= least:
                return g
    return 0


def analyze(cap: Captured, norms: Sequence[NormSite], to: str, groups: int | None = None,
            as_conv: bool = False, forms: dict[str, ModuleForm | NotAModule] | None = None) -> list[Decision]:
    """Each BatchNorm site's decision; ``forms``: the sites' module forms by node, when already found."""
    forms = forms if forms is not None else _forms(cap, norms)
    return [_decide(cap, s, to, groups, as_conv, forms[s.node]) for s in batchnorm_sites(norms)]


def _forms(cap: Captured, norms: Sequence[NormSite]) -> dict[str, ModuleForm | NotAModule]:
    """Where each BatchNorm site's replacement would go (graph.norm_module), or why it has no module."""
    out: dict[str, ModuleForm | NotAModule] = {}
    for s in batchnorm_sites(norms):
        try:
            out[s.node] = module_form(cap, s)
        except NotAModule as why:
            out[s.node] = why
    return out


def plan(cap: Captured, norms: Sequence[NormSite], to: str = "frozen-batchnorm", groups: int | None = None,
         as_conv: bool = False) -> list[Site]:
    return [d.to_site() for d in analyze(cap, norms, to, groups, as_conv)]


def plan_every_target(cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
    """What each target would do at each BatchNorm site (inspect): one Site per target, its reason led by it."""
    out, forms = [], _forms(cap, norms)
    for to in TARGETS:
        for d in analyze(cap, norms, to, forms=forms):
            out.append(Site(NAME, d.site.target, d.applied, f"--to {to}: {d.reason}", d.code))
    return out


def _decide(cap: Captured, site: NormSite, to: str, groups: int | None, as_conv: bool,
            form: ModuleForm | NotAModule) -> Decision:
    if isinstance(form, NotAModule):
        return Decision(site, False, str(form), ConvertWhy(form.code.value))
    module = cap.model if form.path == "" else cap.modules[form.path]
    shape = cap.shape(cap.nodes[site.input])
    try:
        if to in APPROXIMATE:
            new, what = _approximate(cap, site, module, to, groups, shape)
        else:
            channel_affine(cap, site, removable=False, training=True)  # the BatchNorm's own guards
            new, what = _exact(cap, site, module, to, as_conv, shape)
    except Refusal as why:
        return Decision(site, False, str(why), ConvertWhy(why.code.value))
    except _No as why:
        return Decision(site, False, str(why), why.code)
    new, kept = _with_tail(new, module, form)
    code = ConvertWhy.AS_CONV if to == "affine" and as_conv else _APPLIED[to]
    where = f"{form.path or 'the model'} ({type(module).__name__})"
    return Decision(site, True, f"{where} -> {what}{kept}", code, form.path, new, form.held)


def _tensors(cap: Captured, site: NormSite, channels: int, rank: int) -> dict[str, torch.Tensor | None]:
    """weight, bias, running_mean, running_var as (C,) tensors of the model's (views, same dtype and storage)."""
    out = {}
    for role, t in statistics(cap, site).items():
        # a (C,) vector along dim 1 (checked: Refusal otherwise), in the model's own dtype
        channel_vector(t, channels, rank if site.source == "handwritten" and not site.channel_vectors else 2, role)
        out[role] = t.detach().reshape(channels) if t is not None else None
    return out


def _eps(cap: Captured, site: NormSite) -> float:
    mod = cap.modules.get(site.target) if site.source == "module" else None
    return float(mod.eps) if mod is not None else float(site.eps if site.eps is not None else 1e-5)


def _exact(cap: Captured, site: NormSite, module: nn.Module, to: str, as_conv: bool,
           shape: tuple[int, ...]) -> tuple[nn.Module, str]:
    c, rank, eps = shape[1], len(shape), _eps(cap, site)
    t = _tensors(cap, site, c, rank)
    w, b, rm, rv = t["weight"], t["bias"], t["running_mean"], t["running_var"]
    params = [isinstance(getattr(module, k, None), nn.Parameter) for k in ("weight", "bias")]
    if to == "frozen-batchnorm":
        # already buffers only (torchvision's / detectron2's / timm's frozen modules)  =>  nothing to do
        if not isinstance(module, nn.modules.batchnorm._BatchNorm) and not any(params):
            raise _No(ConvertWhy.ALREADY, f"already frozen: {type(module).__name__} holds its statistics and affine "
                                          f"as buffers")
        # w, b, rm, rv  =>  FrozenBatchNorm buffers (ones / zeros for a missing affine)
        new = FrozenBatchNorm(c, eps, spatial=rank - 2).to(device=rm.device, dtype=rm.dtype)
        new.weight = w if w is not None else torch.ones_like(rm)
        new.bias = b if b is not None else torch.zeros_like(rm)
        new.running_mean, new.running_var = rm, rv
        return new, f"FrozenBatchNorm({c}, eps={eps:g})"
    if to == "batchnorm":
        if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
            raise _No(ConvertWhy.ALREADY, f"already a torch BatchNorm ({type(module).__name__})")
        return _batchnorm(module, c, rank, eps, t)
    # x * s + t per channel  =>  ChannelAffine(s, t), or the depthwise 1x1 conv computing it
    s, shift = channel_affine(cap, site, removable=False, training=True)
    dtype = (w if w is not None else rm).dtype
    if not as_conv:
        return (ChannelAffine(s.to(dtype), shift.to(dtype), spatial=rank - 2).to(rm.device),
                f"ChannelAffine({c}): x * s + t")
    if rank not in (3, 4, 5):
        raise _No(ConvertWhy.NO_SPATIAL, f"a {rank}-d input has no 1 to 3 spatial dims for a 1x1 conv: use --to affine "
                                         f"without --as-conv")
    conv = {3: nn.Conv1d, 4: nn.Conv2d, 5: nn.Conv3d}[rank](c, c, 1, groups=c, bias=True, device=rm.device,
                                                            dtype=dtype)
    with torch.no_grad():
        conv.weight.copy_(s.to(dtype).reshape(c, 1, *([1] * (rank - 2))))
        conv.bias.copy_(shift.to(dtype))
    return conv, f"nn.{type(conv).__name__}({c}, {c}, 1, groups={c}): x * s + t"


def _batchnorm(module: nn.Module, c: int, rank: int, eps: float,
               t: dict[str, torch.Tensor | None]) -> tuple[nn.Module, str]:
    """torch's nn.BatchNormNd holding the site's tensors (its Parameters as they are; buffers made frozen
    Parameters), momentum and step count."""
    cls = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}.get(rank)
    if cls is None:
        raise _No(ConvertWhy.NO_SPATIAL, f"no torch BatchNorm takes a {rank}-d input")
    w, b, rm, rv = t["weight"], t["bias"], t["running_mean"], t["running_var"]
    momentum = getattr(module, "momentum", 0.1)
    momentum = momentum if isinstance(momentum, (float, type(None))) else 0.1
    new = cls(c, eps=eps, momentum=momentum, affine=w is not None or b is not None, device=rm.device, dtype=rm.dtype)
    frozen = []
    for role, value in (("weight", w), ("bias", b)):
        if value is None or not new.affine:
            continue
        held = getattr(module, role, None)
        if isinstance(held, nn.Parameter) and held.shape == (c,):
            setattr(new, role, held)  # the same Parameter: shared, trained as before
        else:
            setattr(new, role, nn.Parameter(value, requires_grad=False))
            frozen.append(role)
    new.running_mean, new.running_var = rm, rv
    steps = getattr(module, "num_batches_tracked", None)
    if isinstance(steps, torch.Tensor):
        new.num_batches_tracked = steps
    note = f"; {' and '.join(frozen)} were buffers: Parameters with requires_grad=False now" if frozen else ""
    return new, f"nn.{cls.__name__}({c}, eps={eps:g}, momentum={momentum}){note}"


def _approximate(cap: Captured, site: NormSite, module: nn.Module, to: str, groups: int | None,
                 shape: tuple[int, ...] | None) -> tuple[nn.Module, str]:
    if shape is None or len(shape) < 2 or (site.num_features and shape[1] != site.num_features):
        raise _No(ConvertWhy.NO_CHANNEL_DIM, f"input shape {shape} has no channel dim 1")
    c, rank, eps = shape[1], len(shape), _eps(cap, site)
    t = _tensors(cap, site, c, rank)
    w, b = t["weight"], t["bias"]
    per_channel = math.prod(shape[2:])  # values each channel brings to a group, per sample
    if to == "instancenorm":
        # InstanceNormNd normalizes each channel of each sample over its spatial dims alone
        if rank not in (3, 4, 5):
            raise _No(ConvertWhy.NO_SPATIAL, f"a {rank}-d input (N, C) has no spatial dims: InstanceNorm would "
                                             f"normalize single values (every output 0, then its bias)")
        if per_channel == 1:
            raise _No(ConvertWhy.ERASES, f"each channel holds one value per sample on {tuple(shape)}: InstanceNorm "
                                         f"would map every value to 0 (then to its bias)")
        new = {3: nn.InstanceNorm1d, 4: nn.InstanceNorm2d, 5: nn.InstanceNorm3d}[rank](
            c, eps=eps, affine=w is not None or b is not None, track_running_stats=False)
        what = f"nn.{type(new).__name__}({c}, eps={eps:g})"
    else:
        g = groups if groups is not None else default_groups(c, per_channel)
        if g <= 0 or c % g:
            raise _No(ConvertWhy.GROUPS, f"{g} groups do not divide {c} channels" if g > 0 else
                      f"no group count leaves two values per group on {tuple(shape)}")
        # a group of one value per sample  =>  (x - mean) is 0 everywhere: the signal is erased
        if c // g * per_channel < 2:
            raise _No(ConvertWhy.ERASES, f"GroupNorm({g}, {c}) on {tuple(shape)} normalizes groups of one value: every "
                                         f"output would be 0 (then its bias); use fewer groups")
        new = nn.GroupNorm(g, c, eps=eps, affine=w is not None or b is not None)
        what = f"nn.GroupNorm({g}, {c}, eps={eps:g}) ({c // g * per_channel} values per group and sample" + \
            (", few: each output is close to its sign)" if c // g * per_channel < FEW_VALUES else ")")
    ref = next(v for v in t.values() if v is not None)
    new = new.to(device=ref.device, dtype=ref.dtype)
    for role in ("weight", "bias"):
        held = getattr(module, role, None)
        if getattr(new, role, None) is None:
            continue
        if isinstance(held, nn.Parameter) and held.shape == (c,):
            setattr(new, role, held)
        elif t[role] is not None:
            setattr(new, role, nn.Parameter(t[role].clone()))
    return new, what


def _with_tail(new: nn.Module, module: nn.Module, form: ModuleForm) -> tuple[nn.Module, str]:
    """The replacement and the module's own children after it, in order (timm's drop and act)."""
    if not form.tail:
        return new, ""
    return with_tail(new, module, form.tail), (f", then its own {', '.join(form.tail)} (nn.Sequential: the norm's "
                                               f"state_dict keys move under {form.path + '.' if form.path else ''}"
                                               f"norm.)")


class ConvertBatchNorm(Pass):
    """Replace each BatchNorm module by ``to``; exact targets are verified, approximate ones measured as drift."""

    name = NAME
    check = Check.EXACT
    by_parts = True  # a module replaced where it is: its part's graph holds the whole decision
    # a model converted for training: the door runs it in training mode too (engine.training), where every target
    # but SyncBatchNorm -> BatchNorm computes otherwise; ``extra["training_differs"]`` names how
    trains = True

    def __init__(self, to: str, groups: int | None = None, as_conv: bool = False):
        if to not in TARGETS:
            raise ValueError(f"unknown BatchNorm target {to!r}")
        self.to, self.groups, self.as_conv = to, groups, as_conv

    def plan(self, cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
        return plan(cap, norms, self.to, self.groups, self.as_conv)

    def __call__(self, model: nn.Module, cap: Captured) -> PassResult:
        decisions = analyze(cap, find_norms(cap), self.to, self.groups, self.as_conv)
        done = [d for d in decisions if d.applied]
        in_training = _in_training(cap, done, self.to)
        for d in done:
            # the BatchNorm module  =>  its replacement (with the module's own children after it)
            if d.path == "":
                model = d.module
                model.train(cap.model.training)
            elif d.held:  # a holder module the graph reads (a .pt2's)  =>  the graph calls the replacement instead
                replace_in_graph(model, d.path, d.module)
            else:
                replace_module(model, d.path, d.module)
        approximate = self.to in APPROXIMATE and bool(done)
        notes = (f"--to {self.to} is approximate: each sample's own statistics replace the running ones; the "
                 f"drift is measured, fine-tune (or recalibrate what stays a BatchNorm) if it matters",) \
            if approximate else ()
        return PassResult(model, bool(done), tuple(d.to_site() for d in decisions), notes,
                          {"to": self.to, "converted": len(done),
                           **({"training_differs": in_training} if in_training else {})}, exact=not approximate)


def _in_training(cap: Captured, done: Sequence[Decision], to: str) -> dict[str, str] | None:
    """How the converted sites compute otherwise in training mode ({"code", "why"}), None where they do not:
    torch's BatchNorm from SyncBatchNorm / mmcv's modules trains as before."""
    if to == "affine":  # swap --to affine folds first what a neighbour absorbs: those too keep the running ones
        return {"code": _IN_TRAINING[to][0].value, "why": _IN_TRAINING[to][1]}
    if not done:
        return None
    if to != "batchnorm":
        code, why = _IN_TRAINING[to]
        return {"code": code.value, "why": why}
    # a live nn.BatchNormNd where the original module was a frozen one (its forward never takes batch statistics)
    frozen = [d for d in done if not isinstance(cap.model if d.path == "" else cap.modules.get(d.path),
                                                nn.modules.batchnorm._BatchNorm)]
    if not frozen:
        return None
    named = ", ".join(f"{d.path or 'the model'} ({type(cap.model if d.path == '' else cap.modules[d.path]).__name__})"
                      for d in frozen[:3]) + (f" and {len(frozen) - 3} more" if len(frozen) > 3 else "")
    return {"code": InTraining.LIVE.value,
            "why": f"nn.BatchNorm in training mode {_LIVE}, where the frozen BatchNorm it replaces ({named}) "
                   f"never does"}


__all__ = ["NAME", "TARGETS", "APPROXIMATE", "ConvertWhy", "InTraining", "ConvertBatchNorm", "analyze", "plan",
           "plan_every_target", "default_groups"]
