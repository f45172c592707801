"""The one flow every command runs: (loaded model) -> capture -> passes -> verify -> save.

    report, model = fold(loaded, output="out.pt")          # what `normconv fold` runs
    report, model = rewrite(loaded, [FOLD], command="fold", exact=True)

Every rewriting command goes through ``rewrite`` (export through ``apply_passes`` then ONNX): the user's model is
never changed (the passes work on a copy of the module tree that shares every tensor a pass does not write,
``normconv.clone``), an exact rewrite that misses its tolerance raises VerificationError carrying the report,
and nothing is written unless it verified. This is the only module that calls ``io.save``.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from normconv.clone import clone_sharing_tensors, owning_as, release
from normconv.errors import NormconvError, VerificationError
from normconv.graph.capture import Captured, capture
from normconv.graph.detect import NormSite, find_norms, find_weight_standardizations
from normconv.graph.near_miss import find_near_misses
from normconv import outputs
from normconv.io import Loaded, check_output_path, save, with_attention_mask
from normconv.passes import canonicalize as canonicalize_pass
from normconv.passes import deepnorm as deepnorm_pass
from normconv.passes import fold_batchnorm, fold_scales, lift_layers, rotate as rotate_pass, swap_norm
from normconv.passes import fold_weight_standardization as fold_ws
from normconv.nn.modules import Float32Norm
from normconv.passes.base import replace_module
from normconv.report import OutputError, PassResult, Report, Site, Validation
from normconv.verify import (Inputs, argmax_agreement, compare, default_tolerance, other_shape, output_leaves, run,
                             untraced, with_selections)

PassFn = Callable[[nn.Module, Captured], PassResult]

# module families counted in before/after tables
_COUNTED: tuple[tuple[str, tuple[type, ...]], ...] = (
    ("batchnorm", (nn.modules.batchnorm._BatchNorm,)),
    ("layernorm", (nn.LayerNorm,)),
    ("rmsnorm", (nn.RMSNorm,)),
    ("groupnorm", (nn.GroupNorm,)),
    ("instancenorm", (nn.modules.instancenorm._InstanceNorm,)),
    ("conv", (nn.modules.conv._ConvNd,)),
    ("linear", (nn.Linear,)),
)


# ---------------------------------------------------------------------------------------------------------
# the door every rewrite goes through


def model_stats(model: nn.Module, inputs: Inputs | None = None, repeats: int = 5) -> dict[str, Any]:
    """Parameter count and module counts by family; with ``inputs``, the median latency (ms) of one eager forward
    (opt-in, ``--bench``: it costs 2 x (repeats + 1) extra forwards)."""
    stats: dict[str, Any] = {"parameters": sum(p.numel() for p in model.parameters())}
    classes = collections.Counter(type(m) for m in model.modules())  # one walk; families judged per class
    for name, types in _COUNTED:
        stats[f"{name} modules"] = sum(k for cls, k in classes.items() if issubclass(cls, types))
    if inputs is not None:
        times = []
        run(model, inputs)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            run(model, inputs)
            times.append(time.perf_counter() - t0)
        stats["latency ms"] = round(sorted(times)[len(times) // 2] * 1e3, 3)
    return stats


def apply_passes(model: nn.Module, inputs: Inputs, passes: Sequence[PassFn], method: str = "auto",
                 eval_mode: bool = False,
                 on_first_capture: Callable[[Captured], None] | None = None,
                 last_capture: list[Captured] | None = None, writable: bool = False,
                 reference: Any = None, notes: list[str] | None = None) -> tuple[nn.Module, list[Site]]:
    """Run passes in order on a tensor-sharing copy of ``model``, capturing the graph before the first and again
    after each pass that modified the model (a pass that changed nothing leaves the last capture valid).

    ``eval_mode`` puts the copy (never the user's model) in eval mode first. ``on_first_capture`` sees the first
    capture (the unmodified model's graph: export plans from it instead of capturing once more; it is made even
    with no pass). ``last_capture`` receives the capture still valid for the returned model, if there is one
    (export hands its ExportedProgram to the ONNX exporter). ``writable``: passes write ``model``'s own tensors
    (``clone_sharing_tensors``; a disposable model only). ``reference``: ``model``'s output on ``inputs`` when the
    caller has it: captures of the still unmodified copy reuse it for their trust check. ``notes``: where given,
    a model no method captures whole is rewritten by parts (``_pass_by_parts``) and the notes say so; else its
    capture error is raised. Returns (rewritten model, sites)."""
    work = clone_sharing_tensors(model, writable)
    if eval_mode:
        for m in work.modules():
            m.training = False  # the flag itself: an exported program's module refuses .eval()
    sites: list[Site] = []
    cap: Captured | None = None
    # by parts only when every pass proves its rewrite within a submodule's graph (not rotation, DeepNorm)
    by_parts = all(getattr(p, "by_parts", False) for p in passes)
    if on_first_capture is not None:
        cap = capture(work, inputs, method, reference)
        on_first_capture(cap)
    for p in passes:
        before = {path: (id(m), m.training) for path, m in work.named_modules()}
        if cap is None or cap.model is not work:
            try:
                cap = capture(work, inputs, method, reference)
            except NormconvError as whole:
                if on_first_capture is not None or notes is None or not by_parts:
                    raise  # the caller needs the whole graph (export) or takes no parts, or a pass needs it
                sites.extend(_pass_by_parts(p, work, inputs, method, whole, notes))
                _inherit_training_flags(before, work)
                continue
        try:
            result = p(work, cap)
        except NormconvError:
            raise
        except Exception as exc:  # name the failing pass (onnx-ir's pass manager does the same)
            name = getattr(p, "name", getattr(p, "__name__", type(p).__name__))
            raise RuntimeError(f"pass {name} failed: {type(exc).__name__}: {exc}") from exc
        _inherit_training_flags(before, result.model)
        if result.modified or result.model is not work:
            cap = reference = None  # the graph changed: the next pass captures it again (and checks it afresh)
        work = result.model
        sites.extend(result.sites)
    if last_capture is not None and cap is not None and cap.model is work:
        last_capture.append(cap)
    return release(work), sites


def _pass_by_parts(p: PassFn, work: nn.Module, inputs: Inputs, method: str, whole: NormconvError,
                   notes: list[str]) -> list[Site]:
    """One pass on each submodule of ``work`` captured alone (``capture_parts``), for a model no method captures
    whole (a VLM whose merge of image features is data-dependent). Each part's graph holds everything the pass
    proves about the part: a stream that enters the part as an input has writers the pass cannot see, so a swap
    refuses there, as it refuses at any graph input. The caller verifies the whole rewritten model as always.
    Code between the parts (the failed modules' own forward) is not rewritten, and the notes say so."""
    from normconv.graph.parts import capture_parts

    parts = capture_parts(work, inputs, method)
    if not parts.parts:
        raise NormconvError(f"{whole}; no submodule captures alone either")
    if hasattr(p, "in_parts"):
        p.in_parts = True
    sites, results = [], []
    for part in parts.parts:
        module = work.get_submodule(part.path)
        try:
            with owning_as(module, work):  # what the copy already owns is written in place, not cloned again
                result = p(module, part.cap)
        except NormconvError as exc:  # names in the message are the part's own
            raise NormconvError(f"in {part.path} (captured alone: the whole model cannot be): {exc}") from None
        results.append(result)
        whole_part = result.model is not module  # the part itself was replaced (it was the norm)
        if whole_part:
            replace_module(work, part.path, result.model)
        owned = dict(module.named_modules())
        sites.extend(dataclasses.replace(s, target=part.path if whole_part and s.applied or not s.target
                                         else f"{part.path}.{s.target}" if s.target in owned
                                         else f"{part.path}:{s.target}")
                     for s in result.sites)
    if hasattr(p, "end_parts"):
        p.end_parts(work, results)
    note = (f"the whole model cannot be captured ({(str(whole).splitlines() or [''])[0]}); rewritten by parts: "
            f"{len(parts.parts)} submodules captured alone ({', '.join(pt.path for pt in parts.parts[:6])}"
            f"{', ...' if len(parts.parts) > 6 else ''}); the code of {', '.join(['the model', *parts.failed][:4])} "
            f"between them is not rewritten")
    if note not in notes:
        notes.append(note)
    return sites


def _inherit_training_flags(before: dict[str, tuple[int, bool]], model: nn.Module) -> None:
    """A module a pass inserted (nn.Identity, nn.RMSNorm, ...) is born in training mode: give it the mode of
    the module it replaced, or of its parent when it is new."""
    for path, module in model.named_modules():
        old = before.get(path)
        if old is not None and old[0] == id(module):
            continue  # the same module as before: its flag is the user's
        parent = path.rpartition(".")[0]
        mode = old[1] if old is not None else before.get(parent, (0, model.training))[1]
        module.training = mode


def rewrite(loaded: Loaded, passes: Sequence[PassFn], *, command: str, exact: bool,
            atol: float | None = None, rtol: float | None = None, output: str | None = None,
            in_place: bool = False, method: str = "auto", eval_mode: bool = False,
            bench: bool = False, keep_normconv: bool = False, write: bool = True,
            outputs_seen: dict[str, Any] | None = None) -> tuple[Report, nn.Module]:
    """Apply ``passes`` to a loaded model, verify against the original, write ``output`` if it passed
    (``write=False``: the caller writes, after checks of its own). ``outputs_seen``, when given, receives the
    original's and the rewritten model's outputs on the example inputs ("reference", "rewritten"), so that a
    caller's further checks reuse them instead of running both models again."""
    inputs = loaded.require_inputs()
    if output is not None:
        check_output_path(loaded, output, in_place)  # fail before the work, not after
    # everything the original has to say is taken before the passes (a disposable model is then written in place)
    reference = loaded.checked_output()  # the load's own check forward when it ran on these inputs
    reference = with_selections(loaded.model, inputs, reference)  # traced where it selects (labels, indices)
    alt = other_shape(loaded.model, inputs)
    before = model_stats(loaded.model, inputs if bench else None)
    notes: list[str] = []
    model, sites = apply_passes(loaded.model, inputs, passes, method, eval_mode, writable=loaded.disposable,
                                reference=reference, notes=notes)
    rewritten = run(model, inputs, replay=reference)  # with the original's discrete selections, where traced
    validations = [compare(reference, rewritten, atol, rtol)] + _second_shape(alt, model, atol, rtol)
    if outputs_seen is not None:
        outputs_seen.update(reference=untraced(reference), rewritten=untraced(rewritten))
    report = Report(command=command, model=loaded.spec, sites=sites, validation=validations, before=before,
                    after=model_stats(model, inputs if bench else None), notes=notes)
    failed = next((v for v in validations if not v.passed), None)
    if exact and failed is not None:
        raise _not_verified(command, failed, report)
    if write:
        _write(loaded, model, output, in_place, inputs, report, keep_normconv)
    return report, model


def _second_shape(alt: tuple[Inputs, Any] | None, rewritten: nn.Module, atol: float | None,
                  rtol: float | None) -> list[Validation]:
    """The rewrite checked at a second input shape too, wherever the model's dimensions are free (a capture sees
    one shape: a branch on the batch size, or a rewrite specialized to it, shows only at another). ``alt``: the
    original's ``other_shape`` (inputs, outputs), taken before the rewrite."""
    if alt is None:
        return []
    alt_inputs, reference = alt
    label = f"torch, second shape ({alt_inputs.describe()})"
    try:
        # the result keeps no state of this shape; the original's selections replayed where traced
        candidate = run(clone_sharing_tensors(rewritten), alt_inputs, replay=reference)
    except Exception as exc:
        return [Validation(float("inf"), float("inf"), atol or 0.0, rtol or 0.0, False, 0.0,
                           (OutputError("output", float("inf"), float("inf"), 0.0, False),),
                           f"{label}: the rewritten model fails where the original runs ({type(exc).__name__})")]
    return [compare(reference, candidate, atol, rtol, label=label)]


def _write(loaded: Loaded, model: nn.Module, output: str | None, in_place: bool, inputs: Inputs, report: Report,
           keep_normconv: bool = False) -> None:
    """Write ``model`` to ``output`` in a form that loads with torch alone (unless ``keep_normconv``), and say in
    the report what was written and what loading it needs; without ``output`` say that nothing was written."""
    if output is None:
        report.notes.append("nothing was written (no -o given)")
        return
    parts = outputs.normconv_parts(model)
    if keep_normconv and parts:
        to_write = model
        report.notes.append("kept normconv's modules (" + ", ".join(parts) + "): loading the output needs "
                            "normconv installed")
    else:
        try:
            to_write = outputs.torch_only(model, inputs)
        except Exception as exc:
            raise NormconvError(f"cannot write {output} in torch-only form: {type(exc).__name__}: {exc}") from None
        if parts:
            report.notes.append(
                "written with torch's own modules (" + ", ".join(p.rpartition(".")[2] for p in parts) + " replaced): "
                "it loads with torch alone" + (
                    "; the replacements include torch.fx code (GraphModules), so reading it back into normconv needs "
                    "--trust-pickle (--normconv-modules keeps normconv's modules instead)"
                    if outputs.holds_graph_modules(to_write) and not Path(output).suffix in (".pt2", ".safetensors")
                    else ""))
    report.output = str(save(loaded, to_write, output, in_place, inputs))


# ---------------------------------------------------------------------------------------------------------
# the commands


def fold(loaded: Loaded, *, eval_mode: bool = False, atol: float | None = None, rtol: float | None = None,
         output: str | None = None, in_place: bool = False, method: str = "auto",
         bench: bool = False, keep_normconv: bool = False,
         dtype: torch.dtype | None = None) -> tuple[Report, nn.Module]:
    """``normconv fold``: BatchNorm folded into its neighbouring conv / linear, verified, then written.
    ``dtype`` (float16 / bfloat16): the model is folded in it; a half fold (that, or a half model) reports each
    site's headroom measured in float32 and the folded weights' largest value in the dtype."""
    training = [p for p, m in loaded.model.named_modules() if m.training]
    if training and not eval_mode:
        where = "the model" if training[0] == "" else training[0]
        raise NormconvError(f"{loaded.spec} is in training mode ({where}): BatchNorm uses batch statistics there, "
                            f"so folding would change it; call .eval() first or pass --eval")
    half = dtype if dtype in (torch.float16, torch.bfloat16) else _half_dtype(loaded.model)
    rooms, layers = _fold_headroom(loaded, half, method) if half is not None and not eval_mode else ([], {})
    measured_on = loaded.require_inputs().to(torch.float32).describe() + " (float32)"
    if half is not None and _half_dtype(loaded.model) is None:  # measured in float32, folded in the dtype
        cast = loaded.model if loaded.disposable else copy.deepcopy(loaded.model)
        loaded = dataclasses.replace(loaded, model=cast.to(half), inputs=loaded.require_inputs().to(half))
    try:
        report, model = rewrite(loaded, _lifted(loaded.model) + [fold_ws.FOLD_WS, fold_batchnorm.FOLD],
                                command=fold_batchnorm.NAME, exact=True, atol=atol,
                                rtol=rtol, output=output, in_place=in_place, method=method, eval_mode=eval_mode,
                                bench=bench, keep_normconv=keep_normconv)
    except VerificationError as exc:
        if rooms and exc.report is not None:
            exc.report.extra["headroom"] = _headroom_extra(rooms, half, measured_on)
        raise
    if rooms:
        from normconv.graph.headroom import check_folded_weight

        done = {s.target for s in report.sites if s.applied}
        for h in rooms:  # the folded layer's weight, as written in the dtype
            layer = layers.get(h.target)
            if h.target in done and layer is not None and isinstance(getattr(model.get_submodule(layer), "weight",
                                                                             None), torch.Tensor):
                check_folded_weight(h, layer, model.get_submodule(layer).weight)
        report.extra["headroom"] = _headroom_extra(rooms, half, measured_on)
    if not any(s.applied for s in report.sites):
        report.notes.append("no BatchNorm was folded; the model is unchanged" if report.sites
                            else "the model has no BatchNorm; it is unchanged")
    return report, model


def _looked(passes: Sequence[PassFn], sites: Sequence[Site]) -> list[str]:
    """The passes that had a site to decide on (a weight-standardization fold on a model without any is not named),
    all of them when none had."""
    named = {s.pass_name for s in sites}
    return [p.name for p in passes if p.name in named] or [p.name for p in passes]


def _fold_headroom(loaded: Loaded, half: torch.dtype, method: str) -> tuple[list, dict[str, str]]:
    """Each site's headroom in ``half``, measured on the float32 model, and BatchNorm -> the layer it folds into."""
    from normconv.graph.headroom import measure

    wide = loaded.model if _half_dtype(loaded.model) is None else copy.deepcopy(loaded.model).float()
    cap = capture(wide, loaded.require_inputs().to(torch.float32), method)
    norms = find_norms(cap)
    layers = {d.site.target: d.layer for d in fold_batchnorm.analyze(cap, norms) if d.applied and d.layer}
    return measure(cap, norms, half), layers


def _lifted(model: nn.Module) -> list[PassFn]:
    """An exported program (a GraphModule) calls aten.conv / linear on constant weights: lift those into native
    modules first, so the folds apply as on a module tree (passes/lift_layers.py). A user's module tree needs none."""
    return [lift_layers.LIFT] if isinstance(model, fx.GraphModule) else []


def canonicalize(loaded: Loaded, *, atol: float | None = None, rtol: float | None = None, output: str | None = None,
                 in_place: bool = False, method: str = "auto", bench: bool = False,
                 keep_normconv: bool = False, dtype: torch.dtype | None = None) -> tuple[Report, nn.Module]:
    """``normconv canonicalize``: hand-written norms replaced by native modules, verified, then written.
    A half model (``dtype`` float16 / bfloat16, or given in it) is verified against the half model as given and
    against the float32 model (``_canonicalize_half``): both errors are reported, tolerances are the dtype's."""
    half = dtype if dtype in (torch.float16, torch.bfloat16) else _half_dtype(loaded.model)
    if half is not None:
        return _canonicalize_half(loaded, half, atol=atol, rtol=rtol, output=output, in_place=in_place,
                                  method=method, bench=bench, keep_normconv=keep_normconv)
    try:
        report, model = rewrite(loaded, [canonicalize_pass.CANONICALIZE], command=canonicalize_pass.NAME,
                                exact=True, atol=atol, rtol=rtol, output=output, in_place=in_place, method=method,
                                bench=bench, keep_normconv=keep_normconv)
    except VerificationError as exc:
        if exc.report is not None:
            exc.report.notes.extend(_canonicalize_notes(exc.report, None))
        raise
    report.notes.extend(_canonicalize_notes(report, model))
    return report, model


def _canonicalize_half(loaded: Loaded, half: torch.dtype, *, atol: float | None, rtol: float | None,
                       output: str | None, in_place: bool, method: str, bench: bool,
                       keep_normconv: bool) -> tuple[Report, nn.Module]:
    """canonicalize in ``half``, judged at every shape against the half model as given and the float32 model: a
    check holds when either is within the dtype's tolerance (a hand-written norm without upcast overflows in fp16;
    its native replacement then matches the float32 model, not the overflowing one). Both errors are reported."""
    inputs = loaded.require_inputs()
    if output is not None:
        check_output_path(loaded, output, in_place)
    if _half_dtype(loaded.model) is None:  # --dtype: the float32 model as given is the reference, its cast is run
        model32, inputs32 = loaded.model, inputs
        loaded = dataclasses.replace(loaded, model=copy.deepcopy(loaded.model).to(half), inputs=inputs.to(half))
    else:  # given in half: its weights upcast
        model32, inputs32 = copy.deepcopy(loaded.model).float(), inputs.to(torch.float32)
    ref32, alt32 = run(model32, inputs32), other_shape(model32, inputs32)
    atol, rtol = (default_tolerance(half)[0] if atol is None else atol), (default_tolerance(half)[1] if rtol is None
                                                                         else rtol)
    seen: dict[str, Any] = {}
    report, model = rewrite(loaded, [canonicalize_pass.CANONICALIZE], command=canonicalize_pass.NAME, exact=False,
                            atol=atol, rtol=rtol, method=method, bench=bench, write=False, outputs_seen=seen)
    label = str(half).removeprefix("torch.")
    vs32 = [compare(ref32, _cast_floats(seen["rewritten"], torch.float32), atol, rtol,
                    label=f"torch {label} after canonicalize vs float32 model")]
    if alt32 is not None:
        alt_inputs, alt_ref = alt32
        vs32.append(compare(alt_ref, _cast_floats(run(clone_sharing_tensors(model), alt_inputs.to(half)),
                                                  torch.float32), atol, rtol,
                            label=f"torch {label} after canonicalize vs float32 model, second shape"))
    given = compare(ref32, _cast_floats(seen["reference"], torch.float32), atol, rtol)
    vs_half = report.validation
    # each shape holds when within tolerance of the half model as given or of the float32 model; the other
    # comparison is then information (drift), e.g. the half original overflows where the native norm does not
    vs_half = [dataclasses.replace(v, label=v.label.replace("torch", f"torch {label} after canonicalize vs {label} "
                                                                  f"model as given", 1)) for v in vs_half]
    judged = []
    for v, w in zip(vs_half, vs32):
        judged.append(v if v.passed or not w.passed else dataclasses.replace(v, drift=True))
        judged.append(w if w.passed or not v.passed else dataclasses.replace(w, drift=True))
    report.validation = judged + vs_half[len(vs32):] + vs32[len(vs_half):]
    report.extra["half_precision"] = {
        "dtype": label, "error_vs_float32": {"given": given.max_abs_error, "canonicalized": vs32[0].max_abs_error},
        "error_vs_given_half_model": vs_half[0].max_abs_error}
    report.notes.extend(_canonicalize_notes(report, model))
    failed = next((v for v in report.validation if not v.passed and not v.drift), None)
    if failed is not None:
        raise _not_verified("canonicalize", failed, report)
    _write(loaded, model, output, in_place, loaded.require_inputs(), report, keep_normconv)
    return report, model


def _canonicalize_notes(report: Report, model: nn.Module | None) -> list[str]:
    """What a user should know about a canonicalized model beyond the site table."""
    ours = [s for s in report.sites if getattr(s, "pass_name", None) == canonicalize_pass.NAME]
    notes = []
    if not any(s.applied for s in ours):
        notes.append("no hand-written norm was replaced; the model is unchanged")
    if isinstance(model, fx.GraphModule):
        notes.append("inline norms were rewritten in the traced graph: the result is a torch.fx.GraphModule "
                     "(the model's own class is not kept)")
    if any(s.applied and "state_dict keys" in s.reason for s in ours):
        notes.append("replaced modules use the native state_dict names (weight, bias, running_mean, running_var)")
    return notes


def swap(loaded: Loaded, to: str = "rmsnorm", approximate: bool = False, *, atol: float | None = None,
         rtol: float | None = None, output: str | None = None, in_place: bool = False, method: str = "auto",
         canonicalize: bool = True, bench: bool = False, fold_scales_: bool = False,
         keep_normconv: bool = False, partial: bool = False) -> tuple[Report, nn.Module]:
    """``normconv swap``: canonicalize, swap, verify against the original, then write (exact: only if verified).
    ``fold_scales_``: then fold every RMSNorm scale into the linears reading it (weight-free norms; a model with
    no LayerNorm to swap is then only folded). ``partial``: only the exact sites, the others kept (still exact)."""
    inputs = loaded.require_inputs()
    if output is not None:
        check_output_path(loaded, output, in_place)  # fail before the work, not after
    if fold_scales_ and to != "rmsnorm":
        raise NormconvError("--fold-scales folds RMSNorm scales: it goes with --to rmsnorm")
    swap_pass = swap_norm.SwapPass(to, approximate, require=not fold_scales_, partial=partial)
    fold_pass = fold_scales.FoldScales()
    # hand-written and functional norms -> native modules first: swap replaces modules
    passes = ([canonicalize_pass.Canonicalize(functional=True)] if canonicalize else []) + [swap_pass] + \
        ([fold_pass] if fold_scales_ else [])
    seen: dict[str, Any] = {}
    report, model = rewrite(loaded, passes, command="swap", exact=False, atol=atol, rtol=rtol, method=method,
                            bench=bench, write=False, outputs_seen=seen)
    report.notes.extend(swap_pass.notes + fold_pass.notes)
    if fold_scales_:
        report.extra["scales_folded"] = sum(p.ok for p in fold_pass.plans)
    # canonicalize is swap's first step: a norm that is already native is no news (and no skip of the swap)
    report.sites = [s for s in report.sites if not (s.pass_name == canonicalize_pass.NAME and not s.applied
                                                    and s.reason.startswith("already native"))]
    if isinstance(model, fx.GraphModule) and not isinstance(loaded.model, fx.GraphModule):
        report.notes.append("functional / inline norms became modules in the traced graph: the result is a "
                            "torch.fx.GraphModule (your class is not kept; loading it back needs --trust-pickle)")
    v = report.validation[0]
    agree = argmax_agreement(output_leaves(seen["reference"]), output_leaves(seen["rewritten"]))
    plans = swap_pass.plans
    report.extra.update({
        "to": to, "approximate": approximate, "partial": partial, "exact": swap_pass.exact,
        "swapped": sum(p.module is not None and (p.exact or approximate) for p in plans),
        "exact_sites": sum(p.exact for p in plans), "refused": sum(not p.exact for p in plans),
        "argmax_agreement": agree,
        "drift": {"max_abs_error": v.max_abs_error, "max_rel_error": v.max_rel_error, "cosine": v.cosine},
    })
    failed = next((c for c in report.validation if not c.passed), None)
    if swap_pass.exact and failed is not None:  # every check: the example inputs and the second shape
        raise _not_verified("swap", failed, report)
    if not swap_pass.exact:  # an intended change, measured at every shape: drift, not a failed check
        report.validation = [dataclasses.replace(c, drift=True, label=("drift against the original" if i == 0 else
                                                                       c.label.replace("torch", "drift", 1)))
                             for i, c in enumerate(report.validation)]
        report.notes.append(
            f"approximate swap ({report.extra['refused']} site(s) not exact): output drift max abs "
            f"{v.max_abs_error:.3g}, max rel {v.max_rel_error:.3g}, cosine {v.cosine:.6f}; fine-tune if it matters")
    _write(loaded, model, output, in_place, inputs, report, keep_normconv)
    return report, model


def rotate(loaded: Loaded, rotation: str = "hadamard", seed: int = 0, *, atol: float | None = None,
           rtol: float | None = None, output: str | None = None, in_place: bool = False, method: str = "auto",
           bench: bool = False) -> tuple[Report, nn.Module]:
    """``normconv rotate``: canonicalize -> exact LayerNorm -> RMSNorm swap (pre-LN) -> scale fold -> rotation of
    the residual stream (SliceGPT / QuaRot computational invariance), verified against the original, then written."""
    if rotation not in rotate_pass.ROTATIONS:
        raise NormconvError(f"unknown --rotation {rotation!r}: choose {', '.join(rotate_pass.ROTATIONS)}")
    loaded.require_inputs()
    if output is not None:
        check_output_path(loaded, output, in_place)  # fail before the work, not after
    swap_pass = swap_norm.SwapPass("rmsnorm", require=False)
    fold_pass = fold_scales.FoldScales(strict=True)
    rot = rotate_pass.Rotate(rotation, seed)
    passes = [canonicalize_pass.Canonicalize(functional=True), swap_pass, fold_pass] + \
        ([rot] if rotation != "none" else [])
    try:
        report, model = rewrite(loaded, passes, command="rotate", exact=True, atol=atol, rtol=rtol, output=output,
                                in_place=in_place, method=method, bench=bench)
    except NormconvError as exc:
        # rotate's own errors, and a model no method captures: not a refusal of the swap
        if isinstance(exc, VerificationError) or str(exc).startswith(("rotate", "fold-scales", "cannot capture")):
            raise
        why = str(exc).split(". Pass --partial")[0]  # rotate has no partial or approximate mode
        raise NormconvError(f"rotate needs the exact LayerNorm -> RMSNorm swap first, and it refused: {why}") from exc
    report.notes.extend(swap_pass.notes + fold_pass.notes + rot.notes)
    plan = rot.plan_
    report.extra.update({
        "rotation": rotation, "seed": seed, "matrix": rot.how or "identity (no rotation)",
        "width": plan.d if plan else None, "writers": len(plan.writers) if plan else 0,
        "reader_linears": len(plan.readers) if plan else 0,
        "swapped": sum(p.exact for p in swap_pass.plans),
        "scales_folded": sum(p.ok for p in fold_pass.plans),
    })
    return report, model


def deepnorm(loaded: Loaded, *, arch: str | None = None, alpha: float | None = None, beta: float | None = None,
             beta_mode: str = "init", n_layers: int | None = None, m_layers: int | None = None,
             seed: int | None = 0, atol: float | None = None, rtol: float | None = None, output: str | None = None,
             in_place: bool = False, method: str = "auto", keep_normconv: bool = False,
             value_proj: Sequence[str] = (), out_proj: Sequence[str] = ()) -> tuple[Report, nn.Module]:
    """``normconv deepnorm``: LN(alpha*x + f(x)) at every post-LN sublayer and beta on FFN/v/out, checked against
    that formula computed literally on the same weights, then written. Raises NormconvError on refusal."""
    inputs = loaded.require_inputs()
    if output is not None:
        check_output_path(loaded, output, in_place)
        if Path(output).suffix == ".safetensors":
            raise NormconvError(f"{output}: a .safetensors file holds weights only and would drop the residual "
                                f"scaling; write a .pt (the module) instead")
    why = deepnorm_pass.already_applied(loaded.model)
    if why:
        raise NormconvError(why)
    p = deepnorm_pass.DeepNormPass(arch, alpha, beta, beta_mode, n_layers, m_layers, seed, value_proj=value_proj,
                                   out_proj=out_proj)
    new, sites = apply_passes(loaded.model, inputs, [p], method)
    validation = deepnorm_pass.check_against_reference(new, inputs, atol, rtol)
    an = p.analysis
    report = Report(command=deepnorm_pass.NAME, model=loaded.spec, sites=sites, validation=[validation],
                    extra={"arch": an.arch, "beta_mode": beta_mode, "stacks": p.stacks,
                           "capture": p.capture_method, "marker": deepnorm_pass.MARKER, "sublayers": p.records})
    report.notes.append(
        "DeepNorm changes what the model computes (it is for (re)training); validation compares it with "
        "LN(alpha*x + f(x)) computed literally on the same weights. Save the module itself (torch.save(model)): "
        "a state_dict alone does not carry the residual scaling.")
    if not validation.passed:
        raise _not_verified("deepnorm", validation, report,
                            "the rewritten model differs from LN(alpha*x + f(x)) on the same weights")
    _write(loaded, new, output, in_place, inputs, report, keep_normconv)
    return report, new


def export(loaded: Loaded, output: str, target: str = "ort", opset: int | None = None, *, dynamic: bool = False,
           fold: bool = True, canonicalize: bool = True, validate: Sequence[str] = ("cpu",),
           atol: float | None = None, rtol: float | None = None, baseline: bool = False, repeats: int = 10,
           skip_fusion: bool | None = None, method: str = "auto", dim_names: dict[str, str] | None = None,
           keep_fp32: str = "auto", dtype: torch.dtype | None = None, device: str = "cpu") -> Report:
    """``normconv export``: the exact passes (canonicalize, fold) through ``apply_passes``, verified against the
    original in torch, then ONNX with one fused op per norm, validated in onnxruntime (normconv.onnx.export).
    ``dtype`` (float16 / bfloat16) exports a float32 model in that dtype, validated against the model as given; a
    model given in half is validated against its float32 upcast. ``keep_fp32`` (auto | none | all) says which norm
    sites run in float32 between Casts (auto: those the measured headroom says need it, ``headroom.precision``).
    ``device`` (cpu | cuda) is the onnxruntime provider deployed to; it picks ``skip_fusion`` when that is None."""
    from normconv.onnx import export as onnx_export

    if keep_fp32 not in KEEP_FP32:
        raise NormconvError(f"unknown --keep-fp32 {keep_fp32!r}; choose {', '.join(KEEP_FP32)}")

    opset = onnx_export.DEFAULT_OPSET if opset is None else opset
    out = onnx_export.check_args(output, target, opset, device)
    if skip_fusion is None:  # measured: fused residual add + norm is faster on CUDA, slower on CPU (BENCHMARKS.md)
        skip_fusion = device == "cuda"
    check_output_path(loaded, out)
    inputs = loaded.require_inputs()
    report = Report(command=onnx_export.NAME, model=loaded.spec)
    inputs = _with_attention_mask(loaded.model, inputs, report)
    # the load's check forward when no mask was added (the same inputs), else one forward now
    reference = loaded.checked_output() if inputs is loaded.inputs else run(loaded.model, inputs)
    given_half = _half_dtype(loaded.model)
    source, src_inputs, half = loaded.model, inputs, dtype if dtype in (torch.float16, torch.bfloat16) else given_half
    if half is not None:
        # half precision: the passes run on the float32 model and are verified against it; the half model is cast
        # from the result (native norms keep float32 statistics) and validated against the float32 model
        if given_half is not None:  # given in half: its weights upcast are the float32 reference
            source, src_inputs = copy.deepcopy(loaded.model).float(), inputs.to(torch.float32)
            reference32, half_torch = run(source, src_inputs), reference
        else:  # given in float32 (--dtype): the model itself is the reference, its half cast is what users run
            reference32, inputs = reference, inputs.to(half)
            half_torch = run(copy.deepcopy(loaded.model).to(half), inputs)
        reference = _cast_floats(reference32, half)
    elif keep_fp32 != "auto":
        raise NormconvError("--keep-fp32 chooses norm precisions in a half export: give --dtype float16 or bfloat16")

    # norm sites and the plan (the same analysis inspect shows), from the graph the passes capture first: the
    # eval-mode copy has the original's graph, so one capture serves the plan and the passes
    norms: list[NormSite] = []
    wide: dict[str, str] = {}  # half export: site -> why it runs in float32 between Casts

    def plan_sites(cap: Captured) -> None:
        norms.extend(find_norms(cap))
        canon, folds = _plan_of(cap, norms, "canonicalize", canonicalize), _plan_of(cap, norms, "fold", fold)
        float32 = _float32_sites(cap, norms) if half is None else frozenset()  # a half export keeps its casts
        report.sites.extend(onnx_export.plan(norms, target, opset, canon, folds, skip_fusion, cap.live, float32))
        if half is not None:
            report.sites.extend(_precisions(cap, norms, half, keep_fp32, canon, folds, report, wide))

    # exact rewrites first, verified against the original model; the copy is in eval mode for the exporter
    passes = [p for p, on in ((canonicalize_pass.CANONICALIZE, canonicalize), (fold_ws.FOLD_WS, fold),
                              (fold_batchnorm.FOLD, fold)) if on]
    if fold:
        passes = _lifted(loaded.model) + passes
    last: list[Captured] = []
    try:
        with onnx_export._quiet():
            prepared, pass_sites = apply_passes(source, src_inputs, passes, method, eval_mode=True,
                                                on_first_capture=plan_sites, last_capture=last,
                                                reference=reference32 if half is not None else reference)
    except NormconvError as exc:
        if norms or "cannot capture" not in str(exc):
            raise
        report.notes.append(f"norm detection and the torch passes skipped: {exc}")
        passes, pass_sites = [], []
        prepared = clone_sharing_tensors(source)
        for m in prepared.modules():
            m.training = False
    report.extra["passes"] = [p.name for p in passes]
    report.sites.extend(pass_sites)
    if passes:
        selected = with_selections(source, src_inputs, reference32 if half is not None else reference)
        check = compare(selected, run(prepared, src_inputs, replay=selected),
                        None if half is not None else atol, None if half is not None else rtol,
                        label="torch, after " + " + ".join(_looked(passes, pass_sites)) +
                              (" (float32)" if half is not None else ""))
        report.validation.append(check)
        if not check.passed:
            raise _not_verified("export", check, report, "the rewritten model differs from the original")
    if half is not None:
        prepared32 = release(prepared)
        prepared = copy.deepcopy(prepared32).to(half)
        for path in wide:  # the site's module, float32 between two Casts (its output back in the half dtype)
            try:
                norm32 = copy.deepcopy(prepared32.get_submodule(path))
            except AttributeError:
                report.notes.append(f"{path}: no module left at that path after the passes; it runs in "
                                    f"{str(half).removeprefix('torch.')}")
                continue
            replace_module(prepared, path, Float32Norm(norm32, torch.float32))
        prepared.eval()
        last = []  # the capture was of the float32 copy: the half model is exported afresh
        rewritten_half = run(prepared, inputs)
        reference = _cast_like(reference32, rewritten_half)  # ONNX outputs keep each output's own dtype (Mamba: fp32)
        label = str(half).removeprefix("torch.")
        user_tolerance = atol is not None or rtol is not None
        atol = default_tolerance(half)[0] if atol is None else atol  # tolerances follow the target dtype
        rtol = default_tolerance(half)[1] if rtol is None else rtol
        plain = compare(reference32, _cast_floats(half_torch, torch.float32), atol, rtol,
                        label=f"torch {label} model as given vs float32 model")
        ours = compare(reference32, _cast_floats(rewritten_half, torch.float32), atol, rtol,
                       label=f"torch {label} after normconv vs float32 model")
        ours_vs_half = compare(half_torch, rewritten_half, atol, rtol,
                               label=f"torch {label} after normconv vs {label} model as given")
        budget = HALF_SLACK * max(ours.max_abs_error, plain.max_abs_error)
        if not user_tolerance and budget > atol and _rounding_limited(ours, plain, half):
            # half-precision rounding alone exceeds the elementwise default (a deep model, or a GPU's half kernels):
            # the budget becomes what the cast itself costs, for torch's half model and the ONNX file alike
            report.notes.append(
                f"{label}: the model cast to {label} is itself {plain.max_abs_error:.3g} from float32 (cosine "
                f"{plain.cosine:.6f}); normconv's is {ours.max_abs_error:.3g} (cosine {ours.cosine:.6f}), no worse, "
                f"so the checks use atol {budget:.3g} ({HALF_SLACK:g}x that error) instead of "
                f"{default_tolerance(half)[0]:g}; --atol/--rtol set them yourself")
            atol = budget
            ours = dataclasses.replace(ours, passed=True, atol=atol)
        report.validation.append(ours)  # the given half model's own error is information (extra), not a check
        report.extra["half_precision"] = {
            "dtype": label, "reference": ("float32 model (the given half weights, upcast)" if given_half else
                                          "float32 model as given") + "; ONNX validated against it",
            "error_vs_float32": {"given": plain.max_abs_error, "normconv": ours.max_abs_error},
            "error_vs_given_half_model": ours_vs_half.max_abs_error,
            "keep_fp32": keep_fp32, "float32_sites": sorted(wide)}
        if not ours.passed:
            raise VerificationError(f"export: {ours.label} beyond tolerance (max abs error "
                                    f"{ours.max_abs_error:.3g}); nothing written", report)
    original = None
    if baseline:  # opt-in: a second full export (time and peak memory) only for the op-count / latency comparison
        original = clone_sharing_tensors(loaded.model)  # the plain baseline export runs on an eval-mode copy too
        for m in original.modules():
            m.training = False
    return onnx_export.write_onnx(release(prepared), original and release(original), inputs, reference, out, report,
                                  norms, target=target, opset=opset, dynamic=dynamic, validate=validate, atol=atol,
                                  rtol=rtol, baseline=baseline, repeats=repeats, skip_fusion=skip_fusion,
                                  exported=last[0].exported if last and not last[0].specialized else None,
                                  dim_names=dim_names, fuse_inline=canonicalize)


KEEP_FP32 = ("auto", "none", "all")
HALF_SLACK = 1.5  # a half export may be this much further from float32 than the plain cast of the model
HALF_MIN_COSINE = {torch.float16: 0.999, torch.bfloat16: 0.99}  # ~4.5% / 14% relative RMS error; below: not rounding


def _rounding_limited(ours: Validation, plain: Validation, half: torch.dtype) -> bool:
    """normconv's half model misses the elementwise tolerance only as the plain cast does: finite, its error no
    larger than HALF_SLACK x the cast's, and every output still aligned with float32's (cosine). An overflowing
    model (zoo:fp16_overflow without its float32 norms: cosine -0.17) is refused."""
    finite = all(math.isfinite(o.max_abs_error) for o in ours.outputs) and math.isfinite(ours.max_abs_error)
    return (finite and ours.max_abs_error <= HALF_SLACK * plain.max_abs_error
            and ours.cosine >= HALF_MIN_COSINE.get(half, 0.999))


def _precisions(cap: Captured, norms: list[NormSite], half: torch.dtype, mode: str,
                canon: dict[str, tuple[bool, str]] | None, folds: dict[str, tuple[bool, str]] | None,
                report: Report, wide: dict[str, str]) -> list[Site]:
    """Per norm site of a half export: float32 between Casts or the half dtype, and why (``--keep-fp32``), from the
    headroom measured on the float32 copy ``cap``; fills ``wide`` (module path -> why) and the report's headroom."""
    from normconv.graph.headroom import measure, precision

    rooms = measure(cap, norms, half)
    report.extra["headroom"] = _headroom_extra(rooms, half, cap.inputs.describe())
    out = []
    for s, h in zip(norms, rooms):
        if s.kind == "batchnorm" and (folds or {}).get(s.target, (False, ""))[0]:
            out.append(Site("export:precision", s.target, False, "folded into its neighbour: no norm op left"))
            continue
        decomposed = s.source == "handwritten" and not (canon or {}).get(s.target, (False, ""))[0]
        keep, why = precision(h, decomposed, mode)
        module = s.target in cap.modules and s.target != "" and (s.source != "handwritten" or s.target == s.owner)
        if keep and not module:  # an inline / functional site has no module to run in float32
            keep, why = False, (f"{str(half).removeprefix('torch.')}: written inline (node {s.node}), no module to "
                                f"run in float32 (wanted: {why})")
        if keep:
            wide[s.target] = why
        out.append(Site("export:precision", s.target, keep, why))
    return out


def _headroom_extra(rooms: list, dtype: torch.dtype, inputs: str) -> dict[str, Any]:
    """The headroom block of a report's extra (inspect, export, fold)."""
    return {"dtype": str(dtype).removeprefix("torch."), "inputs": inputs, "sites": [h.to_json() for h in rooms],
            "without_headroom": [h.target for h in rooms if not h.ok]}


def _half_dtype(model: nn.Module) -> torch.dtype | None:
    """float16 / bfloat16 when the model computes in it (its floating parameters are that dtype), else None."""
    dts = {p.dtype for p in list(model.parameters()) + list(model.buffers()) if p.is_floating_point()}
    return next(iter(dts)) if len(dts) == 1 and dts <= {torch.float16, torch.bfloat16} else None


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """Every floating tensor in a nested output cast to ``dtype``."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, value)


def _cast_like(value: Any, like: Any) -> Any:
    """Each floating tensor of ``value`` in the dtype of the matching tensor of ``like`` (same structure)."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten(value)
    others, _ = tree_flatten(like)
    if len(others) != len(leaves):
        return value
    return tree_unflatten([a.to(b.dtype) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                           and a.is_floating_point() and b.is_floating_point() else a
                           for a, b in zip(leaves, others)], spec)


def _not_verified(command: str, failed: Validation, report: Report,
                  differs: str = "outputs differ beyond tolerance") -> VerificationError:
    """The error of a failed check: by how much it failed, or that it compared nothing."""
    if not failed.outputs:
        return VerificationError(f"{command}: {failed.label}; nothing written", report)
    return VerificationError(f"{command}: {differs} ({failed.label}: {failed.worst}; {failed.criterion}); "
                             f"nothing written", report)


def _with_attention_mask(model: nn.Module, inputs: Inputs, report: Report) -> Inputs:
    """Token ids without a mask, for a forward that takes ``attention_mask``: add an all-ones mask so the ONNX has
    the input a deployment feeds for padded batches (GPT-2's export otherwise has input_ids only)."""
    masked = with_attention_mask(model, inputs)
    if masked is None:
        return inputs
    report.notes.append("attention_mask added to the example inputs (all ones) so that the ONNX takes it")
    return masked


def _plan_of(cap: Captured, norms: Sequence[NormSite], which: str, on: bool) -> dict[str, tuple[bool, str]] | None:
    """target -> (applied, reason) from the fold / canonicalize plan; None when that pass is switched off."""
    if not on:
        return None
    mod = fold_batchnorm if which == "fold" else canonicalize_pass
    return {p.target: (p.applied, p.reason) for p in mod.plan(cap, norms)}


def _float32_sites(cap: Captured, norms: Sequence[NormSite]) -> frozenset[str]:
    """The sites whose input and output are float32 in this graph (their upcasts are no-op casts)."""
    def dtype(name: str):
        node = cap.nodes.get(name)
        return cap.dtype(node) if node is not None else None

    return frozenset(s.target for s in norms if dtype(s.input) == dtype(s.node) == torch.float32)


# ---------------------------------------------------------------------------------------------------------
# inspect: every pass's plan, nothing applied


def plans(cap: Captured, norms: list[NormSite], whole: bool = True) -> dict[str, list[Site]]:
    """target -> the sites each pass planned for it, in the order a user would run the passes; ``whole=False``
    (a part captured alone): only the passes that run by parts (fold, canonicalize, swap)."""
    from normconv.onnx import export as onnx_export

    planners = (fold_batchnorm.plan, canonicalize_pass.plan, swap_norm.plan) + ((
        deepnorm_pass.plan, lambda c, n: onnx_export.plan(n, canon=_plan_of(c, n, "canonicalize", True),
                                                          folds=_plan_of(c, n, "fold", True), live=c.live,
                                                          float32=_float32_sites(c, n))) if whole else ())
    by_target: dict[str, list[Site]] = {}
    for planner in planners:
        for site in planner(cap, norms):
            by_target.setdefault(site.target, []).append(site)
    return by_target


def inspect(loaded: Loaded, method: str = "auto", dtype: torch.dtype | None = None,
            calibration: Inputs | None = None) -> Report:
    """``normconv inspect``: every norm site with its kind, eps, placement, and what each pass would do or why not;
    with a half ``dtype``, each site's headroom in it, measured in float32 on ``calibration`` (else the example
    inputs)."""
    inputs = loaded.require_inputs()
    try:
        cap = capture(loaded.model, inputs, method)
    except NormconvError as exc:
        if dtype is not None:  # headroom runs the whole graph
            raise
        return _inspect_by_parts(loaded, inputs, method, exc)
    norms = find_norms(cap)
    rooms = _headroom(loaded, cap, norms, method, dtype, calibration) if dtype is not None else None
    plan = plans(cap, norms)
    sites = []
    for n in norms:
        entry = n.to_json()
        entry["plan"] = _distinct(plan.get(n.target, []))
        if rooms is not None:
            entry["headroom"] = rooms[len(sites)].to_json()
        sites.append(entry)
    extra_headroom = {} if rooms is None else {"headroom": _headroom_extra(
        rooms, dtype, (calibration or inputs).describe() + (" (calibration)" if calibration else ""))}
    return Report(
        command="inspect", model=loaded.spec, sites=sites,
        extra={"capture": cap.method, "capture_failures": cap.attempts, "inputs": inputs.describe(),
               "counts": dict(collections.Counter(n.kind for n in norms)),
               "parameters": sum(p.numel() for p in loaded.model.parameters()),
               "near_misses": [m.to_json() for m in find_near_misses(cap, norms)],
               "weight_standardizations": [w.to_json() for w in find_weight_standardizations(cap)], **extra_headroom},
    )


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
    """``inspect`` of a model no method captures whole: each submodule's graph alone (``capture_parts``). The sites
    are listed with no plan to apply (every pass needs the whole graph); what no part's graph holds is named."""
    from normconv.graph.parts import capture_parts, in_whole_model

    parts = capture_parts(loaded.model, inputs, method)
    if not parts.parts:
        raise NormconvError(f"{whole}; no submodule captures alone either")
    why = "not possible: it needs a graph of the whole model, which cannot be captured (see 'whole model failed')"
    sites, misses, standardized = [], [], []
    for part in parts.parts:
        norms = find_norms(part.cap)
        plan = plans(part.cap, norms, whole=False)  # fold, canonicalize and swap run by parts
        for n in norms:
            entry = in_whole_model(n, part).to_json()
            entry["plan"] = _distinct(plan.get(n.target, []), entry["target"]) + [
                {"pass": p, "target": entry["target"], "applied": False, "reason": why} for p in ("deepnorm", "export")]
            sites.append(entry)
        for m in find_near_misses(part.cap, norms):
            misses.append({**m.to_json(), "target": f"{part.path}.{m.target}" if m.target else part.path})
        for w in find_weight_standardizations(part.cap):
            standardized.append({**w.to_json(), "target": f"{part.path}:{w.site.target}",
                                 "param": f"{part.path}.{w.param}"})
    unseen = [f"{p or 'the model'} (its own code between its submodules)"
              for p in ["", *parts.failed] if p not in parts.leaves_failed]
    unseen += [f"{p} (a leaf: {parts.failed[p]})" for p in parts.leaves_failed]
    return Report(
        command="inspect", model=loaded.spec, sites=sites,
        extra={"capture": f"parts ({len(parts.parts)} submodules captured alone: the whole model cannot be)",
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
        wide = copy.deepcopy(loaded.model).float()
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


__all__ = ["rewrite", "apply_passes", "model_stats", "fold", "canonicalize", "swap", "rotate", "deepnorm", "export",
           "inspect",
           "plans", "PassFn"]
