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
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from normconv.errors import Code, NormconvError
from normconv.graph.capture import Guard
from normconv.options import Options
from normconv.report import Report
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


def judge_specialized(original: nn.Module, done: Run, inputs: Inputs, opts: Options, report: Report,
                      command: str) -> None:
    """Say in ``report`` that a capture specialized (each guard), and prove the rewrite for the branches not taken,
    or accept it (``opts.accept_specialized``), or refuse it (NormconvError, exit 2)."""
    if not done.guards:
        return
    report.extra["specialized"] = [g.to_json() for g in done.guards]
    first = done.guards[0]
    more = f" and {len(done.guards) - 1} more" if len(done.guards) > 1 else ""
    said = (f"the capture specialized a branch on tensor values as the example inputs take it: "
            f"{first.describe()}{more}")
    if not changed_modules(original, done.model):
        report.notes.append(f"{said}; the model is unchanged")
        return
    why = ("the original was rewritten in place before the specialized capture was seen" if not done.original_intact
           else unproven(original, done.model, inputs, done.guards, opts.atol, opts.rtol))
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


__all__ = ["judge_specialized", "unproven", "changed_modules", "module_outputs"]
