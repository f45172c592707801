"""The one door every rewrite goes through: passes -> verify -> write.

    report, run = rewrite(loaded, [FOLD], Options(output="out.pt"), command="fold")

The user's model is never changed (``engine.run.apply_passes`` works on a tensor-sharing copy). Verification is the
same for every pass, chosen by the passes' ``check`` (``passes.base.Check``), at the example inputs and a second
shape wherever the model's dimensions are free:
  EXACT      the rewritten model's outputs equal the original's within tolerance, else VerificationError
             (nothing written); a result marked ``exact=False`` (an approximate swap) turns every check into
  DRIFT      the distance to the original, measured and reported, never judged;
  REFERENCE  the rewritten model equals ``pass.reference(rewritten)`` (DeepNorm: LN(alpha*x + f(x)) computed
             literally on the same weights) within tolerance.
A capture that decided a branch on a tensor's value must be proven for the other branches, accepted
(``--accept-specialized``) or refused (``engine.branches``). Nothing is written unless it verified; writing goes
through ``io.save`` (atomic) in torch-only form.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any, Sequence

import torch.nn as nn

from normconv.quiet import phase
from normconv.io import outputs, pickled
from normconv.errors import Code, NormconvError, VerificationError, describe
from normconv.verify.guard import one_snapshot
from normconv.io.load import Loaded
from normconv.io.write import check_output_path, output_format, save
from normconv.kinds import KINDS
from normconv.options import Options
from normconv.engine import rounding
from normconv.passes.base import Check, Pass
from normconv.report import OutputError, Report, Validation
from normconv.verify import Inputs, compare, other_shape, run, untraced, with_selections

from normconv.io.dims import bounded

from . import training
from .branches import crossed, judge_specialized
from .run import Run, apply_passes

# module families counted in before/after tables: every norm kind, then the layers norms fold into
_COUNTED: tuple[tuple[str, tuple[type, ...]], ...] = tuple((k.name, k.modules) for k in KINDS) + (
    ("conv", (nn.modules.conv._ConvNd,)),
    ("linear", (nn.Linear,)),
)


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


def rewrite(loaded: Loaded, passes: Sequence[Pass], opts: Options, *, command: str, write: bool = True,
            judge: bool = True, outputs_seen: dict[str, Any] | None = None,
            by_parts: bool = True) -> tuple[Report, Run]:
    """Apply ``passes`` to a loaded model, verify by their ``check``, write ``opts.output`` if it passed.

    ``write=False``: the caller writes, after checks of its own. ``judge=False``: the caller judges the checks against
    references of its own (the half-precision policy's float32 model). ``outputs_seen``, when given, receives the
    original's and the rewritten model's outputs on the example inputs ("reference", "rewritten"), so that a
    caller's further checks reuse them instead of running both models again. ``by_parts``: a model no method
    captures whole is rewritten part by part when every pass allows it."""
    inputs = loaded.require_inputs()
    if opts.output is not None:
        check_output_path(loaded, opts.output, opts.in_place, opts.overwrite)  # fail before the work, not after
    # everything the original has to say is taken before the passes (a disposable model is then written in place)
    with one_snapshot(loaded.model):  # its forwards share one snapshot of its state (``guard``)
        reference = loaded.checked_output()  # the load's own check forward when it ran on these inputs
        reference = with_selections(loaded.model, inputs, reference)  # traced where it selects (labels, indices)
        phase("verify", detail="the original at a second shape")
        alt = other_shape(loaded.model, inputs)
        before = model_stats(loaded.model, inputs if opts.bench else None)
    to_pt2 = opts.output is not None and output_format(loaded, Path(opts.output)) == "pt2"
    pt2 = to_pt2 and write
    # the original in training mode, where the rewrite keeps the model trainable (a program is inference only)
    program = loaded.fmt == "pt2" or to_pt2
    trained = None if program or not any(p.trains for p in passes) else training.reference(loaded.model, inputs)
    # a model small enough for its own rounding to be measured (``engine.rounding``) keeps its original intact
    writable = loaded.disposable and not rounding.measurable(loaded.model)
    done = apply_passes(loaded.model, inputs, passes, opts.method, opts.eval_mode, writable=writable,
                        reference=reference, by_parts=by_parts, whole_export=str(opts.output) if pt2 else None)
    phase("verify", 1, 1 if alt is None else 2, detail="shape")
    referee = next((p for p in passes if p.check is Check.REFERENCE), None)
    # the rewrite's forwards share one snapshot, but where a literal reference is built from it between them
    with one_snapshot(done.model) if referee is None else contextlib.nullcontext():
        try:
            rewritten = run(done.model, inputs, replay=reference)  # with the original's selections, where traced
        except NormconvError:
            raise
        except Exception as exc:  # noqa: BLE001 - the model's own code on what the rewrite changed: not verified
            raise VerificationError(f"{command}: the rewritten model fails where the original runs ({describe(exc)})"
                                    f"; nothing written") from exc
        if referee is not None:  # the rewrite changed the model on purpose: it must equal its literal reference
            literal = referee.reference(done.model)
            label = f"reference {referee.reference_label}"
            expected, rewritten = run(literal, inputs), untraced(rewritten)
            alt = None if alt is None else (alt[0], run(literal, alt[0]))
        else:
            label, expected = "torch", reference
        validations = [compare(expected, rewritten, opts.atol, opts.rtol, label=label)] + \
            second_shape(alt, done.model, opts.atol, opts.rtol, label)
    exact = referee is None and done.exact and not any(p.check is Check.DRIFT for p in passes)  # else: drift
    if exact and opts.atol is None and opts.rtol is None and done.original_intact and \
            any(not v.passed for v in validations):  # over the fixed bound: within the original's own rounding?
        validations = _within_own_rounding(loaded.model, done.model, inputs, reference, rewritten, alt, label,
                                           validations)
    if outputs_seen is not None:
        outputs_seen.update(reference=untraced(reference), rewritten=untraced(rewritten))
    report = Report(command=command, model=loaded.spec, sites=done.sites, validation=validations, before=before,
                    after=model_stats(done.model, inputs if opts.bench else None), notes=done.all_notes)
    drift = referee is None and not exact
    if drift:  # an intended change, measured at every shape: drift, not a failed check
        report.validation = [dataclasses.replace(c, drift=True, label=("drift against the original" if i == 0 else
                                                                       c.label.replace("torch", "drift", 1)))
                             for i, c in enumerate(report.validation)]
    failed = next((v for v in report.validation if not v.passed and not v.drift), None)
    if failed is not None and judge:
        raise not_verified(command, failed, report, ("outputs differ beyond tolerance" if referee is None else
                           f"the rewritten model differs from {referee.reference_label} on the same weights")
                           + crossed(done.guards, loaded.model,
                                     alt[0] if alt and failed is not validations[0] else None))
    # a capture that decided a branch on a value or a size: proven for the other branches, accepted, or refused
    # (exit 2); a .pt2 may instead take the sizes proven only (its range clipped)
    clipped = judge_specialized(loaded.model, done, inputs, opts, report, command, clip=pt2)
    if trained is not None and referee is None:  # the proof in training mode too, or said to hold in eval mode only
        # (an approximate rewrite: its training-mode drift measured)
        training.judge_training(trained, done, inputs, opts, report, in_eval=(reference, rewritten), exact=exact)
    done.expected = [(inputs, reference)] + ([alt] if alt else [])
    if write:
        with bounded(clipped):
            write_model(loaded, done.model, opts, inputs, report, done)
    return report, done


def _within_own_rounding(original: nn.Module, rewritten: nn.Module, inputs: Inputs, reference: Any, candidate: Any,
                         alt: tuple[Inputs, Any] | None, label: str, checks: list[Validation]) -> list[Validation]:
    """The checks again, each leaf's bound raised to a multiple of the original's own float32 error where larger
    (``engine.rounding``: a float64 run of the original); the checks as they were where it cannot be measured."""
    wide = rounding.widened(original)  # one float64 copy for both shapes
    floors = None if wide is None else rounding.floors(wide, inputs, reference)
    if floors is None:
        return checks
    out = [compare(reference, candidate, label=label, floors=floors)]
    if alt is not None:
        alt_floors = rounding.floors(wide, alt[0], alt[1])
        out += second_shape(alt, rewritten, None, None, label, floors=alt_floors) if alt_floors is not None else \
            checks[1:]
    return out


def second_shape(alt: tuple[Inputs, Any] | None, rewritten: nn.Module, atol: float | None,
                 rtol: float | None, label: str = "torch", floors: dict[str, float] | None = None) -> list[Validation]:
    """The rewrite checked at a second input shape too, wherever the model's dimensions are free (a capture sees
    one shape: a branch on the batch size, or a rewrite specialized to it, shows only at another). ``alt``: the
    second inputs and the expected outputs there, taken before the rewrite."""
    if alt is None:
        return []
    alt_inputs, expected = alt
    label = f"{label}, second shape ({alt_inputs.describe()})"
    phase("verify", 2, 2, detail="shape")
    try:
        # normconv's own copy, run guarded (``run``): it keeps no state of this shape (attributes, hook dicts,
        # caches and buffers restored); the original's selections replayed where traced
        candidate = run(rewritten, alt_inputs, replay=expected)
    except Exception as exc:
        return [Validation(float("inf"), float("inf"), atol or 0.0, rtol or 0.0, False, 0.0,
                           (OutputError("output", float("inf"), float("inf"), 0.0, False),),
                           f"{label}: the rewritten model fails where the original runs "
                           f"({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]})")]
    return [compare(expected, candidate, atol, rtol, label=label, floors=floors)]


def write_model(loaded: Loaded, model: nn.Module, opts: Options, inputs: Inputs, report: Report,
                done: Run | None = None, expected: list[tuple[Inputs, Any]] | None = None) -> None:
    """Write ``model`` to ``opts.output`` in a form that loads with torch alone (unless ``opts.keep_normconv``), and
    say in the report what was written and what loading it needs; without an output say that nothing was written.

    A Hugging Face folder out (``io.hf_output``): the rewrite in the architecture config.json describes, loaded back
    with ``from_pretrained`` and compared with the original at ``expected`` ((inputs, original's outputs) at the
    example and the second shape; ``done.expected`` when not given, the door's own, taken before the passes wrote a
    disposable original in place; computed only without either) before it is renamed into place. ``done``: the
    passes' results (which layer each folded BatchNorm went into)."""
    output = opts.output
    if output is None:
        report.notes.append("nothing was written (no -o given)")
        return
    phase("write", detail=output)
    if expected is None and done is not None and done.expected:
        expected = done.expected
    if output_format(loaded, Path(output)) == "hf":
        _write_folder(loaded, model, opts, inputs, report, done, expected)
        return
    parts = outputs.normconv_parts(model)
    if opts.keep_normconv and parts:
        to_write = model
        report.notes.append("kept normconv's modules (" + ", ".join(parts) + "): loading the output needs "
                            "normconv installed")
    else:
        try:
            to_write = outputs.torch_only(model, inputs)
        except Exception as exc:
            raise NormconvError(f"cannot write {output} in torch-only form: {type(exc).__name__}: {exc}",
                                Code.WRITE_FAILED) from None
        if to_write is not model and outputs.graph_modules(to_write) > outputs.graph_modules(model):  # stand-ins made
            _same_as_verified(model, to_write, inputs, output, report)
        pickle = output_format(loaded, Path(output)) == "pickle"
        needs = pickled.load_needs(to_write) if pickle else []  # what torch.load will import besides torch
        if parts:
            report.notes.append(
                "written with torch's own modules (" + ", ".join(p.rpartition(".")[2] for p in parts) + " replaced): "
                + (f"loading it needs torch and {', '.join(needs)} importable (the pickle holds the model's own "
                   f"classes)" if needs else "it loads with torch alone") + (
                    "; the replacements include torch.fx code (GraphModules), so reading it back into normconv needs "
                    "--trust-pickle (--normconv-modules keeps normconv's modules instead)"
                    if outputs.holds_graph_modules(to_write) and pickle else ""))
        elif needs:
            report.notes.append(f"loading it (torch.load) needs {', '.join(needs)} importable: the pickle holds the "
                                f"model's own classes (-o OUT.pt2 loads with torch alone)")
    info: dict[str, Any] = {}
    report.output = str(save(loaded, to_write, output, opts.in_place, inputs, static=opts.static,
                             overwrite=opts.overwrite, info=info))
    if "dynamic_dims" in info:  # a .pt2: the dimensions it keeps free, each checked at a second size
        report.extra["dynamic_dims"] = info["dynamic_dims"]
        report.notes.append(_dims_note(info["dynamic_dims"], opts.static, info.get("pinned_all", False)))
    report.notes.extend(info.get("notes", []))


def _same_as_verified(model: nn.Module, to_write: nn.Module, inputs: Inputs, output: str | Path,
                      report: Report) -> None:
    """The torch-only form (GraphModules standing in for normconv's modules) run as the file will be, against the
    verified rewrite: model code reading an attribute a stand-in lacks, or a traced form that computes otherwise,
    is refused here instead of being written (one forward each, only where a stand-in was made)."""
    try:
        written = run(to_write, inputs)
    except Exception as exc:  # noqa: BLE001 - a form that does not run is not written
        raise NormconvError(f"cannot write {output} in torch-only form: it does not run as written ({describe(exc)})",
                            Code.WRITE_FAILED, hint="--normconv-modules keeps normconv's modules instead") from None
    v = compare(run(model, inputs), written, label="torch-only form (as written) against the verified rewrite")
    report.validation.append(v)
    if not v.passed:
        raise NormconvError(f"cannot write {output} in torch-only form: it computes otherwise than the verified "
                            f"rewrite ({v.max_abs_error:.3g} max abs)", Code.WRITE_FAILED,
                            hint="--normconv-modules keeps normconv's modules instead")


def refuse_folder(loaded: Loaded, opts: Options, why: str, instead: str = ".pt2") -> None:
    """Before any work: a Hugging Face folder out that this rewrite cannot be, refused in one line naming the file
    to ask for instead (``instead``: .pt2, torch alone; .pt, needs the model's own classes)."""
    if opts.output is not None and output_format(loaded, Path(opts.output)) == "hf":
        how = "torch.export.load, torch alone" if instead == ".pt2" else "torch.load, needs transformers"
        raise NormconvError(f"cannot write {opts.output} as a Hugging Face folder: {why}; write -o "
                            f"{Path(opts.output).name}{instead} ({how}) instead", Code.REFUSED)


def _write_folder(loaded: Loaded, model: nn.Module, opts: Options, inputs: Inputs, report: Report, done: Run | None,
                  expected: list[tuple[Inputs, Any]] | None) -> None:
    """The rewrite as a Hugging Face folder (same architecture, rewritten weights), proven by from_pretrained."""
    from normconv.io import hf_folder, hf_output

    folds = {bn: how for _, r in (done.results if done is not None else []) for bn, how in r.extra.get("folds", {}).items()}
    try:
        form, notes = hf_output.folder_form(loaded.model, model, folds)
    except NormconvError as exc:
        raise NormconvError(f"cannot write {opts.output} as a Hugging Face folder: {exc.message}; write -o "
                            f"{Path(opts.output).name}.pt2 (torch.export.load, torch alone) instead",
                            Code.WRITE_FAILED) from None
    if expected is None:
        alt = other_shape(loaded.model, inputs)
        expected = [(inputs, loaded.checked_output())] + ([alt] if alt else [])

    def proven(tmp: str) -> None:  # before the folder is renamed into place (while the disk writes it)
        if loaded.path is not None and Path(loaded.path).is_dir():  # the tokenizer and the rest, as --stream copies
            report.notes.extend(hf_folder.copy_side_files(loaded.path, tmp))
        try:
            checks = hf_output.check(tmp, type(loaded.model), expected, opts.atol, opts.rtol, written=form)
        except NormconvError as exc:  # transformers' own round trip changes this architecture
            raise NormconvError(f"cannot write {opts.output} as a Hugging Face folder: {exc.message}; write -o "
                                f"{Path(opts.output).name}.pt2 (torch.export.load, torch alone) instead",
                                Code.WRITE_FAILED) from None
        except Exception as exc:  # noqa: BLE001 - a folder from_pretrained cannot load or run is not written
            raise NormconvError(f"cannot write {opts.output}: {describe(exc)}", Code.WRITE_FAILED) from None
        report.validation.extend(checks)
        failed = next((v for v in checks if not v.passed), None)
        if failed is not None and not failed.drift:
            raise not_verified(report.command, failed, report, "the written folder differs from the original")

    report.notes.extend(notes)
    report.notes.append("written as a Hugging Face folder (the same architecture, rewritten weights), loaded back "
                        "with from_pretrained and compared with the original before it was put in place")
    with hf_output.users_settings(form, loaded.use_cache):  # config.json keeps the user's use_cache
        report.output = str(save(loaded, form, opts.output, opts.in_place, inputs, overwrite=opts.overwrite,
                                 before_rename=proven))


def _dims_note(dims: list[dict[str, Any]], static: bool, pinned_all: bool = False) -> str:
    """What a written .pt2 takes: its dynamic dimensions with their ranges, or that it is static (and why)."""
    free = [d for d in dims if not d.get("pinned")]
    if not free:
        return "the .pt2 takes the example's shapes only" + (
            " (--static)" if static else " (torch.export could not keep them dynamic, said below)" if pinned_all
            else " (the model lets no input dimension vary)")
    return "the .pt2 keeps dynamic dimensions (--static pins them): " + ", ".join(
        f"{d['name']} ({', '.join(d['inputs'])}: {d['min'] or 1}..{d['max'] or 'inf'}, checked at "
        f"{', '.join(map(str, d['checked']))})" for d in free)


def not_verified(command: str, failed: Validation, report: Report,
                 differs: str = "outputs differ beyond tolerance") -> VerificationError:
    """The error of a failed check: by how much it failed, or that it compared nothing."""
    if not failed.outputs:
        return VerificationError(f"{command}: {failed.label}; nothing written", report)
    return VerificationError(f"{command}: {differs} ({failed.label}: {failed.worst}; {failed.criterion}); "
                             f"nothing written", report)


def looked(passes: Sequence[Pass], sites: Sequence[Any]) -> list[str]:
    """The passes that had a site to decide on (a weight-standardization fold on a model without any is not named),
    all of them when none had."""
    named = {s.pass_name for s in sites}
    return [p.name for p in passes if p.name in named] or [p.name for p in passes]


__all__ = ["rewrite", "second_shape", "write_model", "refuse_folder", "model_stats", "not_verified", "looked"]
