"""The vision sweep's verdicts (benchmarks/coverage_vision.py), computed here and never by normconv.

- ``judge_written``: a written ``.pt`` / ``.pt2`` loaded back with torch alone and run against the original on a new
  input, with the original's discrete selections replayed (``normconv.selections.Recorder``: the mechanism only).
- ``judge_onnx``: onnxruntime's outputs against the original's (no replay there: a detector whose labels differ is
  unjudged).

What is compared (``compared``): every non-empty float output, integer outputs equal, and each selection op's
floating inputs (the tensors before the selection; a detector whose scores all fall below its threshold has empty
outputs, and those inputs are all there is to judge). Each within ``BOUND`` of its largest |value|; past it, within
``OWN_FACTOR`` x the original's own float32 error there, measured by a float64 copy of the original on the same
input (``own_rounding``: a Mask R-CNN mask head's own float32 error is 7e-4 of its scale, which no fold can beat). A
check that compared nothing fails.
"""

from __future__ import annotations

import math
from pathlib import Path

BOUND = 1e-4  # this sweep's own bound: max |a - b| <= BOUND x max |b| per compared tensor
OWN_FACTOR = 4  # past BOUND: within 4x the original's own float32 error against float64 (own_rounding)


def first(e: BaseException | str) -> str:
    text = (str(e) if not isinstance(e, BaseException) else str(e)).strip().splitlines()
    head = f"{type(e).__name__}: " if isinstance(e, BaseException) else ""
    return f"{head}{text[0][:300] if text else ''}"


def leaves(out) -> list:
    """Every tensor of an output, flattened as the transformers sweep flattens them (one judge for both sweeps)."""
    from coverage_transformers import flat_tensors

    return flat_tensors(out)


def mismatch(ref: list, got: list) -> str:
    """Why two output lists cannot be compared element by element (count, shape, integer outputs), or ""."""
    import torch

    if len(ref) != len(got):
        return f"{len(got)} outputs, expected {len(ref)}"
    for i, (a, b) in enumerate(zip(ref, got)):
        b = torch.as_tensor(b)
        if a.shape != b.shape:
            return f"output {i}: shape {tuple(b.shape)}, expected {tuple(a.shape)}"
        if not a.is_floating_point() and not torch.equal(a, b.to(a.dtype)):
            return f"output {i} ({a.dtype}) differs"
    return ""


def compared(ref: list, got: list, ref_trace, got_trace) -> dict[str, list]:
    """What is compared, name -> [(reference, other)]: each non-empty float output, and each selection op's floating
    inputs (the tensors before the selection: a detector whose scores all fall below its threshold has empty
    outputs, and those are all there is to judge), grouped per (op, input position) over all its calls, up to
    where a replay lost the original's op sequence."""
    import torch

    groups = {f"output {i}": [(a, torch.as_tensor(b))] for i, (a, b) in enumerate(zip(ref, got))
              if a.is_floating_point() and a.numel()}
    for _, p, q in got_trace.pairs(ref_trace):
        for j, (a, b) in enumerate(zip(p.inputs or (), q.inputs or ())):
            if a.shape == b.shape and a.numel():
                groups.setdefault(f"selection inputs {p.op} #{j}", []).append((a, b))
    return groups


def relative(pairs: list) -> float:
    """The largest |a - b| over a group, relative to its reference's largest finite |a|."""
    import torch

    err = scale = 0.0
    for a, b in pairs:
        a, b = a.double(), b.double()
        err = max(err, float((a - b).abs().nan_to_num(0.0).max()))
        finite = a[torch.isfinite(a)]
        scale = max(scale, float(finite.abs().max()) if finite.numel() else 0.0)
    return err / scale if scale else (0.0 if err == 0 else math.inf)


def forward(model, inputs, replay=None):
    """The model's output leaves on ``inputs`` (eval, no grad); ``replay``: a trace whose selections it takes.
    Returns (leaves, trace)."""
    import copy

    import torch
    from normconv.selections import Recorder

    rec = Recorder(replay)
    with torch.no_grad(), rec:
        out = model(*copy.deepcopy(inputs))
    return leaves(out), rec.trace


def judge_written(path: Path, model, new) -> tuple[str, str]:
    import torch

    try:
        loaded = torch.export.load(str(path)).module() if path.suffix == ".pt2" else \
            torch.load(str(path), weights_only=False)
        if path.suffix != ".pt2":
            loaded.eval()
    except Exception as e:  # noqa: BLE001
        return "failed", f"written {path.suffix} does not load: {first(e)}"
    ref, trace = forward(model, new)
    got, theirs = forward(loaded, new, trace)
    flips = f", {len(theirs.flipped)} selections replayed" if theirs.flipped else ""
    if why := mismatch(ref, got):
        return "failed", f"{path.suffix}: {why}{flips}"
    groups = compared(ref, got, trace, theirs)
    if not groups:  # every output empty and no selection before them: a check that compared nothing
        return "failed", f"{path.suffix}: nothing to compare (every float output empty){flips}"
    errors = {name: relative(pairs) for name, pairs in groups.items()}
    worst = max(errors.values())
    picked = sum(1 for name in groups if name.startswith("selection"))
    what = f"{len(groups) - picked} outputs" + (f", {picked} selection inputs" if picked else "")
    if worst <= BOUND:
        return "ok", f"{path.suffix} within {worst:.2g} ({what}){flips}"
    ok, why = own_rounding(model, new, trace, errors)
    return ("ok" if ok else "failed"), f"{path.suffix} {why}{flips}"


def own_rounding(model, new, trace, errors: dict[str, float]) -> tuple[bool, str]:
    """The second judge, for a rewrite past BOUND: each compared tensor's error against OWN_FACTOR x the original's
    own float32 error there (the same model run in float64 on the same input, the float32 run's selections
    replayed: what float32 evaluation of the original itself costs). Computed here, by this file, never by
    normconv."""
    import copy

    import torch

    widened = tuple([x.double() for x in a] if isinstance(a, list) else
                    a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in new)
    try:
        ref, _ = forward(model, new)
        exact, wide_trace = forward(copy.deepcopy(model).double(), widened, trace)
    except Exception as e:  # noqa: BLE001 - a model that does not run in float64: the fixed bound's verdict stands
        return False, f"beyond {BOUND:g} of the output's scale; no float64 run ({first(e)})"
    own = {name: relative([(x, a) for a, x in pairs])
           for name, pairs in compared(ref, exact, trace, wide_trace).items()}
    worst = 0.0
    for name, err in errors.items():
        if err <= BOUND:
            continue
        mine = own.get(name, 0.0)
        if err > OWN_FACTOR * mine:
            return False, (f"{name}: error {err:.3g} of its scale, beyond {BOUND:g} and beyond {OWN_FACTOR}x the "
                           f"original's own float32 error ({mine:.3g})")
        worst = max(worst, err / mine)
    return True, f"within {worst:.2g}x the original's own float32 error (a float64 run), past {BOUND:g}"


def judge_onnx(model, new, got: list) -> tuple[str, str]:
    from normconv.selections import Trace

    ref, trace = forward(model, new)
    why = mismatch(ref, got)
    errors = {} if why else {name: relative(pairs) for name, pairs in compared(ref, got, trace, Trace()).items()}
    if not why and not errors:
        return "failed", "onnxruntime: nothing to compare (every float output empty)"
    if not why and max(errors.values()) <= BOUND:
        return "ok", f"onnxruntime within {max(errors.values()):.2g}"
    if any(not t.is_floating_point() for t in ref):
        why = why or f"error {max(errors.values()):.3g} of the output's scale"
        return "unjudged", f"onnxruntime: {why} (outputs after a selection: cannot replay it there)"
    if why:
        return "failed", f"onnxruntime: {why}"
    ok, why = own_rounding(model, new, trace, errors)
    return ("ok" if ok else "failed"), f"onnxruntime {why}"
