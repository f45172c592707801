"""A capture that decided a branch on a tensor's value (``Captured.guards``) saw one path through the model; the
rewrite must hold on every path the written model can take, or its exact claim is refused.

    judge_specialized(original, run, inputs, opts, report, command)   # a note, a proof, or NormconvError (exit 2)

The proof, for each guard (a Python branch in the forward of module G, decided on the example inputs):
  1. no module the rewrite changed (its class, its own parameters or buffers, its hooks, its hyper-parameters) is G,
     lies inside G or holds G: the code of the branch not taken reaches G's submodules only, all unchanged;
  2. every module the rewrite did not change computes, on the example inputs, what it computed before (the rewrite is
     local: a fold's conv + identity equals conv + BN, a canonicalized norm equals the norm): so G, and everything
     around it, sees the same values whichever branch G takes, and the changed parts compute the same function of
     what they see (each pass's own proof), on any branch. The rewritten forward takes the original's discrete
     selections (top-k, NMS), as the door's own check does: a flip by rounding is no change of the rewrite.
A swap that centers the residual stream fails 2 (every block's output changes); a rewrite of the graph itself (a
GraphModule of the specialized graph) fails 1 at the model's root. Unproven, the rewrite is refused (exit 2) naming
the guard, unless ``--accept-specialized`` (``Options.accept_specialized``) accepts it for inputs that take the
same branches; either way the report says the capture specialized (``extra.specialized`` and a note).

A branch on input sizes (``Guard.sizes``, ``graph.size_guards``: the example's path holds for low..high of a
dimension) is proven by the check it lacked: the rewrite against the original at low - 1 and high + 1, the other
path. Unproven there, a .pt2 is written taking low..high only (torch.export enforces its range), any other output is
refused naming the branch and the range unless ``--accept-specialized``; each dimension's decision is an entry of
``extra.specialized`` with a ``SizeWhy`` code. A second shape outside the range names the branch (``crossed``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from normconv.errors import Code, NormconvError
from normconv.graph.capture import Guard
from normconv.options import Options
from normconv.report import Report, Why
from normconv.verify import Inputs, compare, run

from .run import Run

_SCALARS = (int, float, bool, str, tuple)


def changed_modules(original: nn.Module, rewritten: nn.Module) -> set[str]:
    """Paths of the modules the rewrite changed: replaced (another class) or removed or new, or holding other own
    parameters / buffers / hooks / hyper-parameters than the original's at the same path."""
    before = dict(original.named_modules())
    after = dict(rewritten.named_modules())
    changed = (set(before) ^ set(after))
    for path, m in after.items():
        o = before.get(path)
        if o is None:
            continue
        if type(o) is not type(m) or _own(o) != _own(m) or _hooks(o) != _hooks(m) or _hyper(o) != _hyper(m):
            changed.add(path)
            continue
        for table in ("_parameters", "_buffers"):
            a, b = getattr(o, table), getattr(m, table)
            if any(not _same(a[k], b[k]) for k in a):
                changed.add(path)
                break
    return changed


def _own(m: nn.Module) -> tuple:
    return tuple(m._parameters), tuple(m._buffers), tuple(m._modules)


def _hooks(m: nn.Module) -> tuple[int, int]:
    return len(m._forward_hooks), len(m._forward_pre_hooks)


def _hyper(m: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(m).items() if not k.startswith("_") and k != "training" and isinstance(v, _SCALARS)}


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is b:
        return True
    if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    return a.device.type == "meta" or bool(torch.equal(a, b))


def _within(path: str, owner: str) -> bool:
    """``path`` is ``owner``, lies inside it, or holds it (the model's root holds everything)."""
    return path == owner or owner == "" or path == "" or path.startswith(owner + ".") or owner.startswith(path + ".")


def module_outputs(model: nn.Module, inputs: Inputs, replay: Any = None) -> tuple[dict[str, list[Any]], Any]:
    """Every module's outputs (one per call, in call order) on ``inputs``, from one guarded forward, and that
    forward's discrete selections (``verify.run(trace=True)``); ``replay``: another forward's selections, taken
    here (a rewritten detector's RPN then keeps the original's top-k and NMS, so that rounding which flips one of
    them is not taken for a change the rewrite made)."""
    seen: dict[str, list[Any]] = {}
    handles = []
    for path, m in model.named_modules():
        handles.append(m.register_forward_hook(
            lambda mod, args, out, path=path: seen.setdefault(path, []).append(_detached(out))))
    try:
        traced = run(model, inputs, trace=True, replay=replay)
    finally:
        for h in handles:
            h.remove()
    return seen, traced


def _detached(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.detach().clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_detached(o) for o in out) if not hasattr(out, "_fields") else tuple(_detached(o) for o in out)
    if isinstance(out, dict):
        return {k: _detached(v) for k, v in out.items()}
    return out


def unproven(original: nn.Module, rewritten: nn.Module, inputs: Inputs, guards: list[Guard],
             atol: float | None = None, rtol: float | None = None) -> str | None:
    """Why the rewrite cannot be shown to hold on the branches the capture did not take (None: it is proven)."""
    changed = changed_modules(original, rewritten)
    for g in guards:
        hit = next((p for p in sorted(changed) if _within(p, g.owner)), None)
        if hit is not None:
            what = "the model itself" if hit == "" else hit
            return (f"the rewrite changes {what}, which the code of the branch not taken "
                    f"({g.owner or 'the model'}'s forward) can reach")
    before, traced = module_outputs(original, inputs)
    after, _ = module_outputs(rewritten, inputs, replay=traced)  # the original's selections
    for path, outs in before.items():
        if path in changed:
            continue
        new = after.get(path, [])
        if len(new) != len(outs):
            return f"{path or 'the model'} is called {len(new)} times after the rewrite, {len(outs)} before"
        for i, (a, b) in enumerate(zip(outs, new)):
            check = compare(a, b, atol, rtol, label=path)
            if check.outputs and not check.passed:
                return (f"{path} computes other values after the rewrite (max abs error {check.max_abs_error:.3g}): "
                        f"the rewrite is not local, so the branches not taken may see what it changed")
    return None


class SizeWhy(Why):
    """What became of a branch on input sizes (``Guard.sizes``), per dimension it narrowed."""

    PROVEN_ACROSS = "proven-across"  # the rewrite equals the original at a size past each end of the range too
    NO_OTHER_SIDE = "no-other-side"  # the original runs at no size past the range: it has no other path
    RANGE_CLIPPED = "range-clipped"  # the written .pt2 takes the proven range only (torch.export enforces it)
    ACCEPTED = "accepted"  # --accept-specialized: verified for sizes in the range only


def judge_specialized(original: nn.Module, done: Run, inputs: Inputs, opts: Options, report: Report,
                      command: str, clip: bool = False) -> list[tuple[tuple[tuple[str, int], ...], int, int | None]]:
    """Say in ``report`` that a capture specialized (each guard), and prove the rewrite for the branches not taken,
    or accept it (``opts.accept_specialized``), or refuse it (NormconvError, exit 2). A branch on input sizes is
    proven at a size past each end of its range (``_judge_sizes``); ``clip``: the output is a .pt2, whose range can
    be the proven one. Returns the dimensions whose written range is to be clipped ((places, low, high) each)."""
    values = [g for g in done.guards if not g.sizes]
    report.extra["specialized"] = [g.to_json() for g in values]
    clipped = _judge_sizes(original, done, inputs, opts, report, command, clip)
    if not values:
        return clipped
    first = values[0]
    more = f" and {len(values) - 1} more" if len(values) > 1 else ""
    said = (f"the capture specialized a branch on tensor values as the example inputs take it: "
            f"{first.describe()}{more}")
    if not changed_modules(original, done.model):
        report.notes.append(f"{said}; the model is unchanged")
        return clipped
    why = ("the original was rewritten in place before the specialized capture was seen" if not done.original_intact
           else unproven(original, done.model, inputs, values, opts.atol, opts.rtol))
    if why is None:
        report.notes.append(f"{said}; proven for the other branches: the code of each such branch reaches no "
                            f"rewritten module, and every module the rewrite did not change computes what it did")
    elif opts.accept_specialized:
        report.notes.append(f"{said}; accepted with --accept-specialized: the rewrite is verified for inputs that "
                            f"take the same branches only ({why})")
    else:
        raise NormconvError(f"{command}: the capture specialized a branch on tensor values at {first.describe()}"
                            f"{more}, and {why}", Code.REFUSED,
                            hint="the rewrite is verified only for inputs that take the same branch; pass "
                                 "--accept-specialized to accept that, or write the branch with torch.where / "
                                 "torch.cond so that both sides are captured")
    return clipped


def _judge_sizes(original: nn.Module, done: Run, inputs: Inputs, opts: Options, report: Report, command: str,
                 clip: bool) -> list[tuple[tuple[tuple[str, int], ...], int, int | None]]:
    """Each dimension a branch on sizes narrowed (``Guard.sizes``: the example's path holds for low..high) checked
    at low - 1 and high + 1, the other path: the rewrite must equal the original there too. Where it does not (or
    cannot be run), a .pt2 (``clip``) is written with the proven range, else the rewrite is accepted
    (``--accept-specialized``) or refused (exit 2). Every decision is an entry of ``extra.specialized`` with its
    ``SizeWhy`` code."""
    from normconv.io import dims as io_dims

    clipped = []
    for g in (g for g in done.guards if g.sizes):
        for places, name, low, high in g.sizes:
            where = f"{name} ({', '.join(f'{i}[{a}]' for i, a in places)})"
            holds = f"{low}..{'inf' if high is None else high}"
            checked, why, ran = [], None, False
            for size in [s for s in (low - 1,) if s >= 1] + ([high + 1] if high is not None else []):
                alt = io_dims.resized(original, inputs, list(places), size)
                try:
                    expected = run(original, alt)
                except Exception:  # noqa: BLE001 - the original takes no such size: no other path there
                    continue
                ran = True
                if not done.original_intact:
                    why = "the original was rewritten in place before the branch was seen"
                    break
                label = f"torch, across a branch on sizes ({name} = {size})"
                try:
                    check = compare(expected, run(done.model, alt), opts.atol, opts.rtol, label=label)
                except Exception as exc:  # noqa: BLE001 - the rewrite fails where the original runs
                    why = f"the rewritten model fails at {name} = {size} ({type(exc).__name__})"
                    break
                checked.append(size)
                report.validation.append(check)
                if not check.passed:
                    report.validation.pop()  # a failed check here narrows the claim; it is not the rewrite's failure
                    why = (f"at {name} = {size} the rewrite differs from the original (max abs error "
                           f"{check.max_abs_error:.3g})")
                    break
            entry = {**g.to_json(), "dimension": name, "inputs": [f"{i}[{a}]" for i, a in places], "min": low,
                     "max": high, "checked": checked}
            said = f"the capture took a branch on input sizes ({g.where}) as the example does: its path holds for " \
                   f"{where} {holds}"
            if why is None:
                entry["code"] = str(SizeWhy.PROVEN_ACROSS if ran else SizeWhy.NO_OTHER_SIDE)
                report.notes.append(f"{said}; " + (f"proven on the other path too: the rewrite equals the original at "
                                                   f"{name} = {', '.join(map(str, checked))}" if ran else
                                                   "the original runs at no size outside it"))
            elif clip:
                entry["code"] = str(SizeWhy.RANGE_CLIPPED)
                clipped.append((places, low, high))
                report.notes.append(f"{said}; {why}, so the .pt2's {name} takes {holds} only, the sizes proven")
            elif opts.accept_specialized:
                entry["code"] = str(SizeWhy.ACCEPTED)
                report.notes.append(f"{said}; accepted with --accept-specialized: the rewrite is verified for "
                                    f"{where} {holds} only ({why})")
            else:
                report.extra["specialized"].append(entry)
                raise NormconvError(f"{command}: the capture took a branch on input sizes at {g.where} in "
                                    f"{g.owner or 'the model'}'s forward as the example does (its path holds for "
                                    f"{where} {holds}), and {why}", Code.REFUSED,
                                    hint=f"the rewrite is verified for {where} {holds} only; write -o OUT.pt2, "
                                         f"whose range is then {holds}, or pass --accept-specialized to accept it")
            report.extra["specialized"].append(entry)
    return clipped


def crossed(guards: list[Guard], original: nn.Module, alt: Inputs | None) -> str:
    """Where the second shape ``alt`` lies outside a range a branch on sizes holds for (the check at it compared
    another path than the example's): a clause naming the branch, '' when it lies inside every range."""
    from normconv.io import dims as io_dims

    names = io_dims.input_names(original, alt) if alt is not None else None
    if not names:
        return ""
    given = dict(zip(names, list(alt.args) + list(alt.kwargs.values())))
    for g in (g for g in guards if g.sizes):
        for places, name, low, high in g.sizes:
            x = given.get(places[0][0])
            size = x.shape[places[0][1]] if isinstance(x, torch.Tensor) and x.dim() > places[0][1] else None
            if size is not None and (size < low or (high is not None and size > high)):
                return (f"; the second shape's {name} = {size} takes another branch than the example's: the capture "
                        f"took a branch on input sizes at {g.where} in {g.owner or 'the model'}'s forward, whose "
                        f"path holds for {name} {low}..{'inf' if high is None else high}")
    return ""


__all__ = ["judge_specialized", "unproven", "changed_modules", "module_outputs", "crossed", "SizeWhy"]
