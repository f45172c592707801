"""Re-estimate BatchNorm running statistics from a few calibration batches (after pruning, a rewrite, quantization):
NNCF's BN adaptation, once-for-all's ``reset_running_statistics``.

  each BatchNorm module with running statistics:  reset (mean 0, var 1, count 0), momentum = None
      => after K batches  running_mean = (1/K) sum_k mean_k(x),  running_var = (1/K) sum_k var_k(x)   (cumulative
         average; torch's unbiased batch variance), per channel over the batch and spatial dims of each batch
  the BatchNorm modules alone in training mode (dropout and every other module in eval), no gradients; then each
  module's momentum and mode as they were.
Nothing else changes: the statistics are new tensors (``clone.owned``), every other tensor is the user's own object;
the command checks both (bit-identical tensors, and the model equal to the original given the new statistics).
A timm-style module whose forward calls F.batch_norm on its own statistics by torch's convention (BatchNormAct2d) is
a BatchNorm module here; a frozen BatchNorm (buffers only) and a forward that never uses batch statistics are not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

from normconv.clone import owned
from normconv.errors import NormconvError
from normconv.graph.bn_affine import batchnorm_sites
from normconv.graph.capture import Captured
from normconv.graph.detect import NormSite, find_norms
from normconv.report import PassResult, Site
from normconv.report import Why
from normconv.verify import Inputs

from .base import Check, Pass, apply, skip

NAME = "recalibrate"
STATS = ("running_mean", "running_var", "num_batches_tracked")


class RecalibrateWhy(Why):
    """One member per rule."""

    RECALIBRATED = "recalibrated"  # new running statistics, a cumulative average over the batches
    NO_STATS = "no-running-stats"  # track_running_stats=False: it has none
    FROZEN = "frozen"  # statistics and affine are fixed by design (buffers only)
    FIXED_FORWARD = "forward-never-trains"  # its forward uses the running statistics whatever its mode
    NOT_A_MODULE = "not-a-module"  # a BatchNorm written in another module's forward: no module of its own to update


@dataclass(frozen=True)
class Decision:
    site: NormSite
    applied: bool
    reason: str
    code: RecalibrateWhy
    path: str = ""

    def to_site(self) -> Site:
        return (apply if self.applied else skip)(NAME, self.site, self.reason, self.code)


def analyze(cap: Captured, norms: Sequence[NormSite]) -> list[Decision]:
    return [_decide(cap, s) for s in batchnorm_sites(norms)]


def plan(cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
    return [d.to_site() for d in analyze(cap, norms)]


def _decide(cap: Captured, site: NormSite) -> Decision:
    path = site.target if site.source == "module" else site.owner
    mod = cap.modules.get(path) if path or site.source == "module" else None
    if mod is None and path == "":
        mod = cap.model
    # a torch BatchNorm module, or a subclass whose forward follows torch's (timm's BatchNormAct2d)  =>  update it
    if isinstance(mod, nn.modules.batchnorm._BatchNorm):
        if not mod.track_running_stats or mod.running_mean is None:
            return Decision(site, False, "track_running_stats=False: it normalizes with batch statistics and has no "
                                         "running ones", RecalibrateWhy.NO_STATS)
        return Decision(site, True, f"{path or 'the model'} ({type(mod).__name__}): statistics re-estimated",
                        RecalibrateWhy.RECALIBRATED, path)
    if site.source == "handwritten" and site.target == site.owner:
        return Decision(site, False, f"{type(mod).__name__} is frozen (statistics and affine are buffers): its "
                                     f"statistics are fixed by design; swap --to batchnorm first to re-estimate them",
                        RecalibrateWhy.FROZEN)
    if mod is not None and site.owner:
        return Decision(site, False, f"{site.owner} ({type(mod).__name__}) is no torch BatchNorm: its forward "
                                     f"decides which statistics it uses", RecalibrateWhy.FIXED_FORWARD)
    return Decision(site, False, f"{site.source} batch_norm in {site.owner or 'the root forward'}: no module of its "
                                 f"own whose statistics could be updated", RecalibrateWhy.NOT_A_MODULE)


class Recalibrate(Pass):
    """New running statistics for every BatchNorm module, from ``batches`` (each one forward's inputs)."""

    name = NAME
    check = Check.DRIFT  # the outputs change on purpose: measured; the command checks that nothing else changed

    def __init__(self, batches: Sequence[Inputs]):
        self.batches = list(batches)

    def plan(self, cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
        return plan(cap, norms)

    def __call__(self, model: nn.Module, cap: Captured) -> PassResult:
        decisions = analyze(cap, find_norms(cap))
        modules = {d.path: (model if d.path == "" else model.get_submodule(d.path)) for d in decisions if d.applied}
        before = {p: (m.running_mean.detach().clone(), m.running_var.detach().clone()) for p, m in modules.items()}
        flags = [(m, m.training) for m in model.modules()]
        saved = {p: m.momentum for p, m in modules.items()}
        try:
            for m, _ in flags:
                m.training = False  # dropout and the rest in eval: only the BatchNorms see batches
            for p, m in modules.items():
                for name in STATS:  # new tensors: the user's statistics are never written
                    if getattr(m, name, None) is not None:
                        owned(model, getattr(m, name))
                # reset + momentum None  =>  running = cumulative average of the batch statistics
                m.reset_running_stats()
                m.momentum = None
                m.training = True
            with torch.no_grad():
                for i, batch in enumerate(self.batches):
                    try:
                        model(*batch.args, **batch.kwargs)
                    except Exception as exc:  # the user's data does not fit the model: say so in one line
                        raise NormconvError(f"calibration batch {i} ({batch.describe()}) does not run through the "
                                            f"model: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                                            pass_name=NAME) from None
        finally:
            for p, m in modules.items():
                m.momentum = saved[p]
            for m, flag in flags:
                m.training = flag
        changes = {p: _change(before[p], m) for p, m in modules.items()}
        sites = []
        for d in decisions:
            if d.applied:
                c = changes[d.path]
                d = Decision(d.site, True, f"{d.reason} from {len(self.batches)} batches: mean moved by up to "
                                           f"{c['max_mean_shift']:.3g} (in old standard deviations), variance "
                                           f"scaled by {c['min_var_ratio']:.3g} to {c['max_var_ratio']:.3g}",
                             d.code, d.path)
            sites.append(d.to_site())
        return PassResult(model, bool(modules), tuple(sites), (), {
            "batches": len(self.batches), "changes": changes,
            "statistics": sorted(f"{p}.{n}" if p else n for p in modules for n in STATS)})


def _change(before: tuple[torch.Tensor, torch.Tensor], m: nn.Module) -> dict[str, float]:
    """How far one module's statistics moved: the mean in units of the old standard deviation, the variance ratio."""
    mean, var = (t.double() for t in before)
    new_mean, new_var = m.running_mean.detach().double(), m.running_var.detach().double()
    ratio = new_var / var.clamp_min(1e-12)
    return {"max_mean_shift": float(((new_mean - mean).abs() / var.clamp_min(1e-12).sqrt()).max()),
            "min_var_ratio": float(ratio.min()), "max_var_ratio": float(ratio.max()),
            "batches_tracked": int(m.num_batches_tracked) if m.num_batches_tracked is not None else 0}


__all__ = ["NAME", "STATS", "RecalibrateWhy", "Recalibrate", "analyze", "plan"]
