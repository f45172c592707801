"""``normconv canonicalize``: hand-written norms replaced by torch's native modules, verified, then written."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from normconv.clone import clone_sharing_tensors
from normconv.engine.door import not_verified, rewrite, write_model
from normconv.engine.precision import (cast_floats, dtype_label, either_holds, half_dtype, run_cast, target_half,
                                       upcast)
from normconv.errors import VerificationError
from normconv.io.load import Loaded
from normconv.io.write import check_output_path
from normconv.options import Options
from normconv.passes import canonicalize as canonicalize_pass
from normconv.report import Report
from normconv.verify import compare, default_tolerance, other_shape, run


def canonicalize(loaded: Loaded, opts: Options = Options()) -> tuple[Report, nn.Module]:
    """Hand-written norms replaced by native modules, verified, then written. A half model (``opts.dtype`` float16 /
    bfloat16, or given in it) is verified against the half model as given and against the float32 model
    (``_canonicalize_half``): both errors are reported, tolerances are the dtype's."""
    half = target_half(opts.dtype, loaded.model)
    if half is not None:
        return _canonicalize_half(loaded, half, opts)
    try:
        report, done = rewrite(loaded, [canonicalize_pass.CANONICALIZE], opts, command=canonicalize_pass.NAME)
    except VerificationError as exc:
        if exc.report is not None:
            exc.report.notes.extend(_notes(exc.report, None, loaded.model))
        raise
    report.notes.extend(_notes(report, done.model, loaded.model))
    return report, done.model


def _canonicalize_half(loaded: Loaded, half: torch.dtype, opts: Options) -> tuple[Report, nn.Module]:
    """canonicalize in ``half``, judged at every shape against the half model as given and the float32 model: a
    check holds when either is within the dtype's tolerance (a hand-written norm without upcast overflows in fp16;
    its native replacement then matches the float32 model, not the overflowing one). Both errors are reported."""
    inputs = loaded.require_inputs()
    if opts.output is not None:
        check_output_path(loaded, opts.output, opts.in_place, opts.overwrite)
    if half_dtype(loaded.model) is None:  # --dtype: the float32 model as given is the reference, its cast is run
        model32, inputs32 = loaded.model, inputs
        cast, inputs = copy.deepcopy(loaded.model).to(half), inputs.to(half)  # its forward: the rewrite's reference
        loaded = dataclasses.replace(loaded, model=cast, inputs=inputs,
                                     checked=(inputs, run_cast(cast, inputs, half, loaded.spec)))
    else:  # given in half: its weights upcast
        model32, inputs32 = upcast(loaded.model), inputs.to(torch.float32)
    ref32, alt32 = run(model32, inputs32), other_shape(model32, inputs32)
    atol = default_tolerance(half)[0] if opts.atol is None else opts.atol
    rtol = default_tolerance(half)[1] if opts.rtol is None else opts.rtol
    seen: dict[str, Any] = {}
    report, done = rewrite(loaded, [canonicalize_pass.CANONICALIZE], dataclasses.replace(opts, atol=atol, rtol=rtol),
                           command=canonicalize_pass.NAME, write=False, judge=False, outputs_seen=seen)
    model = done.model  # judged below, against both references
    label = dtype_label(half)
    vs32 = [compare(ref32, cast_floats(seen["rewritten"], torch.float32), atol, rtol,
                    label=f"torch {label} after canonicalize vs float32 model")]
    if alt32 is not None:
        alt_inputs, alt_ref = alt32
        vs32.append(compare(alt_ref, cast_floats(run(clone_sharing_tensors(model), alt_inputs.to(half)),
                                                 torch.float32), atol, rtol,
                            label=f"torch {label} after canonicalize vs float32 model, second shape"))
    given = compare(ref32, cast_floats(seen["reference"], torch.float32), atol, rtol)
    vs_half = [dataclasses.replace(v, label=v.label.replace("torch", f"torch {label} after canonicalize vs {label} "
                                                                     f"model as given", 1)) for v in report.validation]
    report.validation = either_holds(vs_half, vs32)
    report.extra["half_precision"] = {
        "dtype": label, "error_vs_float32": {"given": given.max_abs_error, "canonicalized": vs32[0].max_abs_error},
        "error_vs_given_half_model": vs_half[0].max_abs_error}
    report.notes.extend(_notes(report, model, model32))
    failed = next((v for v in report.validation if not v.passed and not v.drift), None)
    if failed is not None:
        raise not_verified("canonicalize", failed, report)
    write_model(loaded, model, opts, loaded.require_inputs(), report, done)
    return report, model


def _notes(report: Report, model: nn.Module | None, given: nn.Module) -> list[str]:
    """What a user should know about a canonicalized model beyond the site table (``given``: the model as loaded; a
    .pt2's is a GraphModule already, with no class of its own to keep)."""
    ours = [s for s in report.sites if getattr(s, "pass_name", None) == canonicalize_pass.NAME]
    notes = []
    if not any(s.applied for s in ours):
        notes.append("no hand-written norm was replaced; the model is unchanged")
    elif isinstance(model, fx.GraphModule) and not isinstance(given, fx.GraphModule):
        notes.append("inline norms were rewritten in the traced graph: the result is a torch.fx.GraphModule "
                     "(the model's own class is not kept)")
    if any(s.applied and s.code == canonicalize_pass.CanonWhy.RENAMED_KEYS for s in ours):
        notes.append("replaced modules use the native state_dict names (weight, bias, running_mean, running_var)")
    return notes


__all__ = ["canonicalize"]
