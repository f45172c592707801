"""``normconv inspect``: every norm site with its kind, eps, shape, placement, and what each pass would do or why
not (``engine.plans``); nothing is applied. With a half dtype, each site's headroom in it, measured in float32."""

from __future__ import annotations

import collections
import dataclasses

import torch

from normconv.commands.fold import lift_program, refuse_program_in_training
from normconv.engine.plans import plans, whole_only
from normconv.engine.precision import headroom_extra, upcast
from normconv.errors import Code, NormconvError
from normconv.graph.capture import Captured, capture
from normconv.graph.detect import NormSite, find_norms, find_weight_standardizations
from normconv.graph.near_miss import find_near_misses
from normconv.io.load import Loaded
from normconv.report import Report, Site
from normconv.verify import Inputs


def inspect(loaded: Loaded, method: str = "auto", dtype: torch.dtype | None = None,
            calibration: Inputs | None = None) -> Report:
    """Every norm site and each pass's plan for it; with a half ``dtype``, each site's headroom in it, measured in
    float32 on ``calibration`` (else the example inputs)."""
    inputs = loaded.require_inputs()
    try:
        cap = capture(loaded.model, inputs, method)
    except NormconvError as exc:
        if dtype is not None or exc.code is not Code.CANNOT_CAPTURE:  # headroom runs the whole graph
            raise
        return _inspect_by_parts(loaded, inputs, method, exc)
    norms = find_norms(cap)
    rooms = _headroom(loaded, cap, norms, method, dtype, calibration) if dtype is not None else None
    plan = _refused_whole(loaded, plans(cap, norms, lifted=_lifted(loaded, inputs, method)))
    sites = []
    for n in norms:
        entry = n.to_json()
        entry["plan"] = _distinct(plan.get(n.target, []))
        if rooms is not None:
            entry["headroom"] = rooms[len(sites)].to_json()
        sites.append(entry)
    extra_headroom = {} if rooms is None else {"headroom": headroom_extra(
        rooms, dtype, (calibration or inputs).describe() + (" (calibration)" if calibration else ""))}
    notes = [f"the capture specialized a branch on tensor values as the example inputs take it: {g.describe()}; a "
             f"rewrite is proven for the other branch or refused (--accept-specialized accepts it)" for g in cap.guards]
    return Report(
        command="inspect", model=loaded.spec, sites=sites, notes=notes,
        extra={"capture": cap.method, "capture_failures": cap.attempts, "inputs": inputs.describe(),
               "specialized": [g.to_json() for g in cap.guards],
               "counts": dict(collections.Counter(n.kind for n in norms)),
               "parameters": sum(p.numel() for p in loaded.model.parameters()),
               "near_misses": [m.to_json() for m in find_near_misses(cap, norms)],
               "weight_standardizations": [w.to_json() for w in find_weight_standardizations(cap)], **extra_headroom},
    )


def _lifted(loaded: Loaded, inputs: Inputs, method: str) -> tuple[Captured, list[NormSite]] | None:
    """The capture of an exported program with its functional layers lifted as fold and export lift them, and its
    norms: where those commands plan (None: a module tree, or nothing to lift)."""
    model, sites = lift_program(loaded.model, inputs, method)
    if not sites:
        return None
    cap = capture(model, inputs, method)
    return cap, find_norms(cap)


def _refused_whole(loaded: Loaded, plan: dict[str, list[Site]]) -> dict[str, list[Site]]:
    """``plan`` with export's rows refused where export refuses the whole model before any work (a .pt2 exported in
    training mode: ``commands.fold.refuse_program_in_training``), with its reason."""
    from normconv.onnx.export import IN_EVAL, NAME, ExportWhy

    try:
        refuse_program_in_training(loaded, IN_EVAL)
    except NormconvError as exc:
        return {t: [dataclasses.replace(s, applied=False, code=ExportWhy.TRAINING_PROGRAM, reason=exc.message)
                    if s.pass_name == NAME else s for s in sites] for t, sites in plan.items()}
    return plan


def _distinct(planned: list[Site], target: str | None = None) -> list[dict]:
    """Each distinct plan of a site once (a module called twice plans once per call), as JSON; ``target``: named
    so (a part's site, named as in the whole model)."""
    seen: set[tuple[str, bool, str]] = set()
    out = []
    for p in planned:
        key = (p.pass_name, p.applied, p.reason)
        if key not in seen:
            seen.add(key)
            out.append({**p.to_json(), **({"target": target} if target is not None else {})})
    return out


def _inspect_by_parts(loaded: Loaded, inputs: Inputs, method: str, whole: NormconvError) -> Report:
    """``inspect`` of a model no method captures whole: each submodule's graph alone (``capture_parts``). The passes
    that run by parts plan there; the others say they need the whole graph; what no part's graph holds is named."""
    from normconv.graph.parts import capture_parts, in_whole_model

    parts = capture_parts(loaded.model, inputs, method)
    if not parts.parts:
        raise NormconvError(f"{whole}; no submodule captures alone either", Code.CANNOT_CAPTURE)
    why = "not possible: it needs a graph of the whole model, which cannot be captured (see 'whole model failed')"
    sites, misses, standardized = [], [], []
    for part in parts.parts:
        norms = find_norms(part.cap)
        plan = plans(part.cap, norms, whole=False)  # fold, canonicalize and swap run by parts
        for n in norms:
            entry = in_whole_model(n, part).to_json()
            entry["plan"] = _distinct(plan.get(n.target, []), entry["target"]) + [
                {"pass": p, "target": entry["target"], "applied": False, "code": "needs-whole-graph", "reason": why}
                for p in whole_only()]
            sites.append(entry)
        for m in find_near_misses(part.cap, norms):
            misses.append({**m.to_json(), "target": f"{part.path}.{m.target}" if m.target else part.path})
        for w in find_weight_standardizations(part.cap):
            standardized.append({**w.to_json(), "target": f"{part.path}:{w.site.target}",
                                 "param": f"{part.path}.{w.param}"})
    unseen = [f"{p or 'the model'} (its own code between its submodules)"
              for p in ["", *parts.failed] if p not in parts.leaves_failed]
    unseen += [f"{p} (a leaf: {parts.failed[p]})" for p in parts.leaves_failed]
    guards = [(part.path, g) for part in parts.parts for g in part.cap.guards]
    notes = [f"the capture of {path} specialized a branch on tensor values as the example inputs take it: "
             f"{g.describe()}" for path, g in guards]
    return Report(
        command="inspect", model=loaded.spec, sites=sites, notes=notes,
        extra={"capture": f"parts ({len(parts.parts)} submodules captured alone: the whole model cannot be)",
               "specialized": [{**g.to_json(), "owner": ".".join(p for p in (path, g.owner) if p)}
                               for path, g in guards],
               "capture_failures": {"whole model": str(whole)}, "inputs": inputs.describe(),
               "counts": dict(collections.Counter(s["kind"] for s in sites)),
               "parameters": sum(p.numel() for p in loaded.model.parameters()),
               "near_misses": misses, "weight_standardizations": standardized, "not_inspected": unseen},
    )


def _headroom(loaded: Loaded, cap: Captured, norms: list[NormSite], method: str, dtype: torch.dtype,
              calibration: Inputs | None) -> list:
    """Each site's headroom in ``dtype``, measured in float32: a half model is measured on a float32 copy."""
    from normconv.graph.headroom import measure

    inputs = (calibration or cap.inputs).to(torch.float32)
    half = any(p.is_floating_point() and p.dtype in (torch.float16, torch.bfloat16)
               for p in list(loaded.model.parameters()) + list(loaded.model.buffers()))
    if half:
        wide = upcast(loaded.model)
        wide_cap = capture(wide, cap.inputs.to(torch.float32), method)
        wide_norms = find_norms(wide_cap)
        if [n.target for n in wide_norms] == [n.target for n in norms]:
            cap, norms = wide_cap, wide_norms
    try:
        return measure(cap, norms, dtype, inputs)
    except NormconvError:
        raise
    except Exception as exc:
        raise NormconvError(f"the calibration inputs do not run through the model: {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''}") from None


__all__ = ["inspect"]
