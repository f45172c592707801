"""``normconv export``: the exact passes (canonicalize, fold) through the engine, verified against the original in
torch, then ONNX with one fused op per norm, validated in onnxruntime (``normconv.onnx.export``).

A half export (``opts.dtype`` float16 / bfloat16, or a model given in half) follows the precision policy
(``engine.precision``): the passes run on the float32 model and are verified against it; the half model is cast
from the result, each norm site in float32 between Casts where its headroom needs it, and validated against the
float32 model.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Sequence

import torch

from normconv.quiet import phase
from normconv.clone import clone_sharing_tensors, release
from normconv.engine.door import looked, not_verified
from normconv.engine.plans import float32_sites, fold_plan, one_site_per_batchnorm, plan_of
from normconv.engine.precision import (HALF_SLACK, cast_floats, cast_like, check_keep_fp32, dtype_label, half_dtype,
                                       rounding_limited, run_cast, site_precisions, target_half, upcast, downcast)
from normconv.engine.run import apply_passes
from normconv.engine.branches import judge_specialized
from normconv.errors import Code, NormconvError, VerificationError
from normconv.graph.capture import Captured
from normconv.graph.detect import NormSite, find_norms
from normconv.io.inputs import with_attention_mask
from normconv.io.load import Loaded
from normconv.io.write import check_output_path
from normconv.nn.modules import Float32Norm
from normconv.options import Options
from normconv.passes import canonicalize as canonicalize_pass
from normconv.passes.base import replace_module
from normconv.report import Report
from normconv.verify import Inputs, compare, default_tolerance, run, with_selections

from .fold import FOLDS, lift_program, lifted, refuse_program_in_training


def export(loaded: Loaded, opts: Options, target: str | None = None, opset: int | None = None, *,
           fold: bool = True, canonicalize: bool = True, validate: Sequence[str] = ("cpu",), baseline: bool = False,
           repeats: int = 10, skip_fusion: bool | None = None, dim_names: dict[str, str] | None = None,
           keep_fp32: str = "auto", device: str = "cpu") -> Report:
    """Write ``opts.output`` (an .onnx file) with one fused op per norm, validated in onnxruntime. ``keep_fp32``
    (auto | none | all) says which norm sites of a half export run in float32 between Casts (auto: those the
    measured headroom says need it). ``device`` (cpu | cuda) is the onnxruntime provider deployed to; it picks
    ``skip_fusion`` when that is None."""
    from normconv.onnx import export as onnx_export

    check_keep_fp32(keep_fp32, torch.float16)  # the name first; whether a half export asks for it, below
    opset = onnx_export.DEFAULT_OPSET if opset is None else opset  # the defaults live in normconv.onnx.export
    target = onnx_export.DEFAULT_TARGET if target is None else target
    out = onnx_export.check_args(opts.output, target, opset, device, opts.overwrite)
    if skip_fusion is None:  # measured: fused residual add + norm is faster on CUDA, slower on CPU (BENCHMARKS.md)
        skip_fusion = device == "cuda"
    check_output_path(loaded, out, overwrite=opts.overwrite, model=False)
    check_output_path(loaded, out.with_name(out.name + ".data"), model=False)  # the external-data file a large model writes beside
    # a program exported in training mode computes batch statistics, which no .eval() undoes
    refuse_program_in_training(loaded, onnx_export.IN_EVAL)
    report = Report(command=onnx_export.NAME, model=loaded.spec)
    inputs = _with_attention_mask(loaded.model, loaded.require_inputs(), report)
    # the load's check forward when no mask was added (the same inputs), else one forward now
    reference = loaded.checked_output() if inputs is loaded.inputs else run(loaded.model, inputs)
    given_half = half_dtype(loaded.model)
    source, src_inputs, half = loaded.model, inputs, target_half(opts.dtype, loaded.model)
    reference32 = half_torch = None
    if half is not None:
        if given_half is not None:  # given in half: its weights upcast are the float32 reference
            source, src_inputs = upcast(loaded.model), inputs.to(torch.float32)
            reference32, half_torch = run(source, src_inputs), reference
        else:  # given in float32 (--dtype): the model itself is the reference, its half cast is what users run
            reference32, inputs = reference, inputs.to(half)
            half_torch = run_cast(copy.deepcopy(loaded.model).to(half), inputs, half, loaded.spec)
        reference = cast_floats(reference32, half)
    check_keep_fp32(keep_fp32, half)

    # norm sites and the plan (the same analysis inspect shows), from the graph the passes capture first: the
    # eval-mode copy has the original's graph, so one capture serves the plan and the passes
    norms: list[NormSite] = []
    wide: dict[str, str] = {}  # half export: site -> why it runs in float32 between Casts

    def plan_sites(cap: Captured) -> None:
        norms.extend(find_norms(cap))
        canon = plan_of(cap, norms, canonicalize_pass.plan if canonicalize else None)
        folds = plan_of(cap, norms, fold_plan if fold else None)  # fold's own plan: fold-through, then fold
        float32 = float32_sites(cap, norms) if half is None else frozenset()  # a half export keeps its casts
        report.sites.extend(onnx_export.plan(norms, target, opset, canon, folds, skip_fusion, cap.live, float32))
        if half is not None:
            report.sites.extend(site_precisions(cap, norms, half, keep_fp32, canon, folds, report, wide))

    # exact rewrites first, verified against the original model; the copy is in eval mode for the exporter
    passes = ([canonicalize_pass.CANONICALIZE] if canonicalize else []) + (list(FOLDS) if fold else [])  # fold's
    lift_sites: list = []
    try:
        with onnx_export._quiet():
            # a program's functional layers lifted first, as fold lifts them: the plan is made on the graph the
            # folds then rewrite
            lifted_source, lift_sites = lift_program(source, src_inputs, opts.method, eval_mode=True) if fold \
                else (source, [])
            done = apply_passes(lifted_source, src_inputs, passes, opts.method, eval_mode=True,
                                on_first_capture=plan_sites, reference=reference32 if half is not None else reference,
                                stack_traces=True)
        prepared, pass_sites, last = done.model, lift_sites + done.sites, done.capture
        passes = (lifted(source) if lift_sites else []) + passes  # the lift ran: named with the passes
    except NormconvError as exc:
        if norms or exc.code is not Code.CANNOT_CAPTURE:
            raise
        report.notes.append(f"norm detection and the torch passes skipped: {exc}")
        passes, pass_sites, last = [], [], None
        prepared = clone_sharing_tensors(source)
        for m in prepared.modules():
            m.training = False
    report.extra["passes"] = [p.name for p in passes]
    pass_sites = one_site_per_batchnorm(pass_sites)  # one per BatchNorm, as fold reports them
    report.sites.extend(pass_sites)
    if passes:
        phase("verify", detail="torch, after the passes")
        selected = with_selections(source, src_inputs, reference32 if half is not None else reference)
        check = compare(selected, run(prepared, src_inputs, replay=selected),
                        None if half is not None else opts.atol, None if half is not None else opts.rtol,
                        label="torch, after " + " + ".join(looked(passes, pass_sites)) +
                              (" (float32)" if half is not None else ""))
        report.validation.append(check)
        if not check.passed:
            raise not_verified("export", check, report, "the rewritten model differs from the original")
        judge_specialized(source, done, src_inputs, opts, report, "export")  # a value-decided branch: proven or not
    atol, rtol = opts.atol, opts.rtol
    if half is not None:
        prepared, reference, atol, rtol = _half_model(prepared, wide, half, inputs, reference32, half_torch, atol,
                                                      rtol, report, given_half is not None, keep_fp32)
        last = None  # the capture was of the float32 copy: the half model is exported afresh
    original = None
    if baseline:  # opt-in: a second full export (time and peak memory) only for the op-count / latency comparison
        original = clone_sharing_tensors(loaded.model)  # the plain baseline export runs on an eval-mode copy too
        for m in original.modules():
            m.training = False
    return onnx_export.write_onnx(release(prepared), original and release(original), inputs, reference, out, report,
                                  norms, target=target, opset=opset, dynamic=not opts.static, validate=validate, atol=atol,
                                  rtol=rtol, baseline=baseline, repeats=repeats, skip_fusion=skip_fusion,
                                  exported=last.exported if last is not None and not last.specialized else None,
                                  dim_names=dim_names, fuse_inline=canonicalize,
                                  truth=loaded.model if half is None else None)


def _half_model(prepared32: torch.nn.Module, wide: dict[str, str], half: torch.dtype, inputs: Inputs,
                reference32: Any, half_torch: Any, atol: float | None, rtol: float | None, report: Report,
                given_half: bool, keep_fp32: str) -> tuple[torch.nn.Module, Any, float, float]:
    """The half model cast from the verified float32 one (the sites in ``wide`` in float32 between Casts), checked
    against the float32 model beside the half model as given. Returns (model, reference, atol, rtol) for the
    ONNX validation."""
    prepared32 = release(prepared32)
    prepared = downcast(prepared32, half)  # a program's graph says its dtype: half again where it said it
    for path in wide:  # the site's module, float32 between two Casts (its output back in the half dtype)
        try:
            norm32 = copy.deepcopy(prepared32.get_submodule(path))
        except AttributeError:
            report.notes.append(f"{path}: no module left at that path after the passes; it runs in "
                                f"{dtype_label(half)}")
            continue
        replace_module(prepared, path, Float32Norm(norm32, torch.float32))
    prepared.eval()
    rewritten_half = run(prepared, inputs)
    reference = cast_like(reference32, rewritten_half)  # ONNX outputs keep each output's own dtype (Mamba: fp32)
    label = dtype_label(half)
    user_tolerance = atol is not None or rtol is not None
    atol = default_tolerance(half)[0] if atol is None else atol  # tolerances follow the target dtype
    rtol = default_tolerance(half)[1] if rtol is None else rtol
    plain = compare(reference32, cast_floats(half_torch, torch.float32), atol, rtol,
                    label=f"torch {label} model as given vs float32 model")
    ours = compare(reference32, cast_floats(rewritten_half, torch.float32), atol, rtol,
                   label=f"torch {label} after normconv vs float32 model")
    ours_vs_half = compare(half_torch, rewritten_half, atol, rtol,
                           label=f"torch {label} after normconv vs {label} model as given")
    budget = HALF_SLACK * max(ours.max_abs_error, plain.max_abs_error)
    if not user_tolerance and budget > atol and rounding_limited(ours, plain, half):
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
        raise VerificationError(f"export: {ours.label} beyond tolerance (max abs error {ours.max_abs_error:.3g}); "
                                f"nothing written", report)
    return prepared, reference, atol, rtol


def _with_attention_mask(model: torch.nn.Module, inputs: Inputs, report: Report) -> Inputs:
    """Token ids without a mask, for a forward that takes ``attention_mask``: add an all-ones mask so the ONNX has
    the input a deployment feeds for padded batches (GPT-2's export otherwise has input_ids only)."""
    masked = with_attention_mask(model, inputs)
    if masked is None:
        return inputs
    report.notes.append("attention_mask added to the example inputs (all ones) so that the ONNX takes it")
    return masked


__all__ = ["export"]
