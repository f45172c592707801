"""Running passes: a tensor-sharing copy of the model, captured, handed to each pass in turn.

    run = apply_passes(model, inputs, [CANONICALIZE, FOLD])   # -> Run(model, sites, results, notes, capture)

The user's model is never written: the passes get ``clone_sharing_tensors(model)``, whose tensors are the user's
until a pass takes one through ``clone.owned`` (copy-on-write). One capture serves every pass that leaves the model
unchanged; a pass that modified it makes the next one capture again. A model no method captures whole is run part
by part (``by_parts=True`` and every pass declares ``by_parts``): each submodule captured alone gets the pass,
and the whole result is verified by the caller as always; the parts' captures, too, serve every pass until one
changes the model. The whole is tried once: the passes after the first
rewrite layers, not the control flow that kept it from capturing (a detector's draft_export costs minutes).

A capture that decided a branch on a tensor's value (``Captured.guards``) is remembered in ``Run.guards`` (the door
must prove the rewrite for the branches it did not see, or refuse), and from then on the passes copy what they
write even on a disposable model: the original stays intact for that proof.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch.nn as nn

from normconv.quiet import phase
from normconv.clone import clone_sharing_tensors, copy_on_write, owning_as, release
from normconv.errors import CaptureError, Code, NormconvError, VerificationError, describe
from normconv.graph.capture import Captured, Guard, capture
from normconv.passes.base import Pass, replace_module
from normconv.report import PassResult, Site
from normconv.verify import Inputs


@dataclass
class Run:
    """What ``apply_passes`` made: the rewritten model, every site decided, every pass result in order (a pass run
    by parts has one per part), the engine's own notes, and the capture still valid for ``model`` (or None)."""

    model: nn.Module
    sites: list[Site] = field(default_factory=list)
    results: list[tuple[Pass, PassResult]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    capture: Captured | None = None
    guards: list[Guard] = field(default_factory=list)  # every branch a capture decided on a value (module paths whole)
    # the caller's model still holds its original values (False: a disposable model was written in place before a
    # specialized capture was seen, so the door cannot compare the rewrite with it)
    original_intact: bool = True
    # (inputs, the original's outputs) at the example and the second shape, taken by the door before the passes ran:
    # a disposable original is written in place by them, so no later check may run it again (``door.write_model``)
    expected: list[tuple[Any, Any]] = field(default_factory=list)

    def saw(self, cap: Captured, prefix: str = "") -> Captured:
        """Remember ``cap``'s guards (of a part at ``prefix``: its module paths made whole)."""
        for g in cap.guards:
            owner = ".".join(p for p in (prefix, g.owner) if p)
            g = dataclasses.replace(g, owner=owner)
            if g not in self.guards:
                self.guards.append(g)
        return cap

    def of(self, p: Pass) -> list[PassResult]:
        """The results of one pass (several when it ran by parts)."""
        return [r for q, r in self.results if q is p]

    def extras(self, p: Pass, key: str) -> list[Any]:
        """``key`` of every result of ``p`` that has it, in order."""
        return [r.extra[key] for r in self.of(p) if key in r.extra]

    @property
    def exact(self) -> bool:
        """Every result keeps the outputs (an approximate site makes the whole rewrite a measured drift)."""
        return all(r.exact for _, r in self.results)

    @property
    def all_notes(self) -> list[str]:
        """The engine's notes, then every pass's, each once, in order."""
        return list(dict.fromkeys([*self.notes, *(n for _, r in self.results for n in r.notes)]))


def apply_passes(model: nn.Module, inputs: Inputs, passes: Sequence[Pass], method: str = "auto",
                 eval_mode: bool = False, on_first_capture: Callable[[Captured], None] | None = None,
                 writable: bool = False, reference: Any = None, by_parts: bool = False,
                 whole_export: str | None = None, stack_traces: bool = False) -> Run:
    """Run ``passes`` in order on a tensor-sharing copy of ``model``.

    ``eval_mode`` puts the copy (never the user's model) in eval mode first. ``on_first_capture`` sees the first
    capture, of the unmodified model (export plans from it; it is made even with no pass). ``writable``: passes
    write ``model``'s own tensors (a disposable model only). ``reference``: ``model``'s output on ``inputs`` when
    the caller has it (the unmodified copy's capture reuses it for its trust check). ``by_parts``: a model no
    method captures whole is rewritten part by part when every pass allows it; else its capture error is raised.
    ``whole_export``: an output that is torch.export of the whole rewritten model (a .pt2, named here): refused as
    soon as the capture shows torch.export cannot take the model whole, before any pass runs (the passes change
    layers, not the control flow that stopped it). ``stack_traces``: the captures keep each node's Python stack (an
    ONNX export reusing the last capture carries them into its nodes' metadata; ``graph.capture``)."""
    work = clone_sharing_tensors(model, writable)
    if eval_mode:
        for m in work.modules():
            m.training = False  # the flag itself: an exported program's module refuses .eval()
    out = Run(work)
    cap: Captured | None = None
    parts_allowed = by_parts and all(p.by_parts for p in passes)  # not rotation, DeepNorm, export
    if on_first_capture is not None:
        phase("capture")
        cap = out.saw(capture(work, inputs, method, reference, stack_traces))
        on_first_capture(cap)
    whole: NormconvError | None = None  # why the whole model does not capture, once seen
    failed_parts: dict[str, str] = {}  # the same for submodules captured alone (by parts): path -> why
    parts = None  # the parts' captures while no pass has changed the model since (by parts)
    for p in passes:
        before = {path: (id(m), m.training) for path, m in work.named_modules()}
        if cap is None or cap.model is not work:
            phase("capture", detail=f"for {p.name}")
            try:
                if whole is not None:  # a pass rewrote layers, not the control flow that kept the whole uncaptured
                    raise whole
                cap = out.saw(capture(work, inputs, method, reference, stack_traces))
            except NormconvError as exc:
                if exc.code is Code.CANNOT_CAPTURE:  # a model a pass rewrote that no longer runs: the rewrite's fault
                    _runs_after_rewrite(work, inputs, out, whole)
                if exc.code is Code.CANNOT_CAPTURE and whole_export and method in ("auto", "torch.export"):
                    attempts = exc.attempts if isinstance(exc, CaptureError) else {}
                    why = attempts.get("torch.export", exc.message)  # torch.export's own reason
                    raise _no_whole_export(whole_export, work, why) from None
                if exc.code is not Code.CANNOT_CAPTURE or not parts_allowed or on_first_capture is not None:
                    raise
                whole = exc
                parts = _by_parts(p, work, inputs, method, whole, out, model, failed_parts, parts)
                inherit_training_flags(before, work)
                continue
        if whole_export and cap.method == "torch.export" and cap.specialized:  # a draft: branches on values
            raise _no_whole_export(whole_export, work, "torch.export needs a branch on tensor values decided ("
                                   + (cap.guards[0].describe() if cap.guards else "draft_export") + ")")
        if out.guards:
            copy_on_write(work, model)
        phase("rewrite", detail=p.name)
        try:
            result = p(work, cap)
        except NormconvError:
            raise
        except Exception as exc:  # name the failing pass (onnx-ir's pass manager does the same)
            raise RuntimeError(f"pass {p.name} failed: {type(exc).__name__}: {exc}") from exc
        inherit_training_flags(before, result.model)
        if result.modified and writable and not out.guards:
            out.original_intact = False
        if result.modified or result.model is not work:
            cap = reference = None  # the graph changed: the next pass captures it again (and checks it afresh)
        work = result.model
        out.results.append((p, result))
        out.sites.extend(result.sites)
    out.model = release(work)
    out.capture = cap if cap is not None and cap.model is work else None
    return out


def _runs_after_rewrite(work: nn.Module, inputs: Inputs, out: Run, whole: NormconvError | None) -> None:
    """Where the model captured whole before a pass rewrote it and now fails to capture, its own forward is run:
    one that raises (the model's code reads what the rewrite changed) is the rewrite's failure, a VerificationError
    naming the pass (exit 1), never "cannot capture" (exit 2), which would blame the model."""
    changed = [p.name for p, r in out.results if r.modified]
    if not changed or whole is not None:  # the original's own capture failed, or nothing was rewritten yet
        return
    from normconv.verify import run as forward
    try:
        forward(work, inputs)
    except Exception as exc:  # noqa: BLE001 - whatever the model's code raises on the rewritten model
        raise VerificationError(f"the model as {changed[-1]} rewrote it fails where the original runs ({describe(exc)})"
                                f"; nothing written") from exc


def _no_whole_export(output: str, model: nn.Module, why: str) -> NormconvError:
    """The refusal of a .pt2 that torch.export cannot make, said before the work: which format works instead."""
    first = (why.splitlines() or [""])[0][:300]
    return NormconvError(f"cannot write {output}: a .pt2 is torch.export of the whole model, and torch.export cannot "
                         f"take {type(model).__name__} whole ({first}); write -o {Path(output).with_suffix('.pt').name}"
                         f" (torch.load) instead", Code.REFUSED)


def _by_parts(p: Pass, work: nn.Module, inputs: Inputs, method: str, whole: NormconvError, out: Run,
              original: nn.Module, failed_parts: dict[str, str], parts: Any = None) -> Any:
    """One pass on each submodule of ``work`` captured alone (``capture_parts``), for a model no method captures
    whole (a VLM whose merge of image features is data-dependent). Each part's graph holds everything the pass
    proves about the part: a stream that enters the part as an input has writers the pass cannot see, so a swap
    refuses there, as it refuses at any graph input. The caller verifies the whole rewritten model as always.
    Code between the parts (the failed modules' own forward) is not rewritten, and a note says so. ``failed_parts``:
    the submodules an earlier pass already failed to capture (not tried again; this pass's failures are added).
    ``parts``: the previous pass's captures when it changed nothing (reused, as one whole capture serves every pass
    that leaves the model unchanged). Returns the captures for the next pass, or None when this pass changed the
    model."""
    from normconv.graph.parts import capture_parts

    if parts is None:
        parts = capture_parts(work, inputs, method, failed_parts, [q.name for q, r in out.results if r.modified])
    failed_parts.update(parts.failed)
    if not parts.parts:
        raise NormconvError(f"{whole}; no submodule captures alone either", Code.CANNOT_CAPTURE)
    for part in parts.parts:
        out.saw(part.cap, part.path)
    if out.guards:
        copy_on_write(work, original)
    p.begin_parts()
    results = []
    changed = False
    for part in parts.parts:
        module = work.get_submodule(part.path)
        try:
            with owning_as(module, work):  # what the copy already owns is written in place, not cloned again
                result = p(module, part.cap)
        except NormconvError as exc:  # names in the message are the part's own
            raise NormconvError(f"in {part.path} (captured alone: the whole model cannot be): {exc.message}",
                                exc.code, hint=exc.hint, pass_name=exc.pass_name) from None
        results.append(result)
        whole_part = result.model is not module  # the part itself was replaced (it was the norm)
        changed = changed or result.modified or whole_part
        if whole_part:
            replace_module(work, part.path, result.model)
        owned = dict(module.named_modules())
        sites = tuple(dataclasses.replace(s, target=part.path if whole_part and s.applied or not s.target
                                          else f"{part.path}.{s.target}" if s.target in owned
                                          else f"{part.path}:{s.target}")
                      for s in result.sites)
        out.results.append((p, dataclasses.replace(result, model=work, sites=sites)))
        out.sites.extend(sites)
    p.end_parts(work, results)
    note = (f"the whole model cannot be captured ({(str(whole).splitlines() or [''])[0]}); rewritten by parts: "
            f"{len(parts.parts)} submodules captured alone ({', '.join(pt.path for pt in parts.parts[:6])}"
            f"{', ...' if len(parts.parts) > 6 else ''}); the code of {', '.join(['the model', *parts.failed][:4])} "
            f"between them is not rewritten")
    if note not in out.notes:
        out.notes.append(note)
    return None if changed else parts


def inherit_training_flags(before: dict[str, tuple[int, bool]], model: nn.Module) -> None:
    """A module a pass inserted (nn.Identity, nn.RMSNorm, ...) is born in training mode: give it the mode of
    the module it replaced, or of its parent when it is new."""
    for path, module in model.named_modules():
        old = before.get(path)
        if old is not None and old[0] == id(module):
            continue  # the same module as before: its flag is the user's
        parent = path.rpartition(".")[0]
        mode = old[1] if old is not None else before.get(parent, (0, model.training))[1]
        module.training = mode


__all__ = ["Run", "apply_passes", "inherit_training_flags"]
