"""Plans as data: what each pass would do at each norm site, nothing applied (``normconv inspect``, export's plan).

``PLANNERS`` is the table inspect walks, in the order a user would run the passes: (pass name, planner, whether it
runs on a part captured alone, whether its command lifts an exported program's functional layers first). A new pass
that plans per norm site adds one row.

An exported program (``.pt2``) calls ``aten.conv2d`` / ``aten.linear`` on constant weights; ``fold`` and ``export``
lift those into native modules before they fold (``commands.fold.lift_program``), so their plans are made on the
program as lifted (``lifted``), the graph their rewrite sees; the other commands rewrite the program as it is.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

from normconv.graph.capture import Captured
from normconv.graph.detect import NormSite
from normconv.passes import canonicalize, convert_batchnorm, deepnorm, fold_batchnorm, fold_through, recalibrate
from normconv.passes import swap_norm
from normconv.report import Site

Planner = Callable[[Captured, Sequence[NormSite]], list[Site]]


def plan_of(cap: Captured, norms: Sequence[NormSite], planner: Planner | None) -> dict[str, tuple[bool, str]] | None:
    """target -> (applied, reason) from one pass's plan; None when that pass is switched off (``planner`` None)."""
    if planner is None:
        return None
    return {p.target: (p.applied, p.reason) for p in planner(cap, norms)}


def one_site_per_batchnorm(sites: list[Site]) -> list[Site]:
    """One site per BatchNorm: fold-through's where it folded one (fold then never sees it), else fold's; where both
    left it, fold's reason says why fold-through could not pass the ops around it either."""
    through = {s.target: s for s in sites if s.pass_name == fold_through.NAME}
    out = []
    for s in sites:
        if s.pass_name == fold_through.NAME:
            if s.applied:
                out.append(s)
            continue
        t = through.get(s.target)
        if s.pass_name == fold_batchnorm.NAME and t is not None and t.applied:
            continue  # planned on one capture: the BN fold-through takes is gone before fold runs
        if s.pass_name == fold_batchnorm.NAME and not s.applied and t is not None and \
                t.code == fold_through.ThroughWhy.NOTHING:
            s = dataclasses.replace(s, reason=f"{s.reason}; fold-through: {t.reason}")
        out.append(s)
    return out


def fold_plan(cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
    """What ``fold`` (fold-through, then fold) does at each BatchNorm, one site each, planned on one capture: the
    plan export's sites say, as fold's report does."""
    return one_site_per_batchnorm(fold_through.plan(cap, norms) + fold_batchnorm.plan(cap, norms))


def float32_sites(cap: Captured, norms: Sequence[NormSite]) -> frozenset[str]:
    """The sites whose input and output are float32 in this graph (their upcasts are no-op casts)."""
    def dtype(name: str):
        node = cap.nodes.get(name)
        return cap.dtype(node) if node is not None else None

    return frozenset(s.target for s in norms if dtype(s.input) == dtype(s.node) == torch.float32)


def _export_plan(cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
    from normconv.onnx import export as onnx_export

    return onnx_export.plan(norms, canon=plan_of(cap, norms, canonicalize.plan),
                            folds=plan_of(cap, norms, fold_plan), live=cap.live,
                            float32=float32_sites(cap, norms))


def _swap_plan(cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
    # swap plans on the model as canonicalize leaves it: swap's first step makes hand-written norms modules
    return swap_norm.plan(cap, norms, first=canonicalize.Canonicalize(functional=True))


# (pass, planner, plans a part captured alone, its command lifts a program's layers first): the order a user would
# run them
PLANNERS: tuple[tuple[str, Planner, bool, bool], ...] = (
    (fold_batchnorm.NAME, fold_batchnorm.plan, True, True),
    (fold_through.NAME, fold_through.plan, True, True),
    (convert_batchnorm.NAME, convert_batchnorm.plan_every_target, True, False),
    (recalibrate.NAME, recalibrate.plan, True, False),
    (canonicalize.NAME, canonicalize.plan, True, False),
    (swap_norm.NAME, _swap_plan, True, False),
    (deepnorm.NAME, deepnorm.plan, False, False),
    ("export", _export_plan, False, True),
)


def plans(cap: Captured, norms: list[NormSite], whole: bool = True,
          lifted: tuple[Captured, list[NormSite]] | None = None) -> dict[str, list[Site]]:
    """target -> the sites each pass planned for it; ``whole=False`` (a part captured alone): only the passes that
    run by parts. ``lifted``: the capture of the program with its layers lifted, and its norms (None: nothing to
    lift), where the passes whose command lifts them first plan."""
    by_target: dict[str, list[Site]] = {}
    for _, planner, parts, lifts in PLANNERS:
        if whole or parts:
            for site in planner(*(lifted if lifts and lifted is not None else (cap, norms))):
                by_target.setdefault(site.target, []).append(site)
    return by_target


def whole_only() -> list[str]:
    """The passes that need a graph of the whole model."""
    return [name for name, _, parts, _ in PLANNERS if not parts]


__all__ = ["PLANNERS", "plans", "plan_of", "fold_plan", "one_site_per_batchnorm", "float32_sites", "whole_only"]
