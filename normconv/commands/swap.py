"""``normconv swap``: LayerNorm -> RMSNorm (exact on pre-LN models) or back; ``rotate``: then the norm scales folded
into the linears and the residual stream rotated (SliceGPT / QuaRot computational invariance)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.fx as fx
import torch.nn as nn

from normconv.engine.door import refuse_folder, rewrite, write_model
from normconv.errors import Code, NormconvError
from normconv.io.load import Loaded
from normconv.io.write import check_output_path, output_format
from normconv.options import Options
from normconv.passes import canonicalize as canonicalize_pass
from normconv.passes import fold_scales, rotate as rotate_pass, swap_norm
from normconv.report import Report
from normconv.verify import argmax_agreement, output_leaves


def swap(loaded: Loaded, opts: Options = Options(), to: str = "rmsnorm", approximate: bool = False, *,
         canonicalize: bool = True, fold_scales_: bool = False, partial: bool = False) -> tuple[Report, nn.Module]:
    """canonicalize, swap, verify against the original, then write (exact: only if verified; approximate: the
    drift is measured at every shape). ``fold_scales_``: then fold every RMSNorm scale into the linears reading it
    (weight-free norms; a model with no LayerNorm to swap is then only folded). ``partial``: only the exact sites,
    the others kept (still exact)."""
    loaded.require_inputs()
    if opts.output is not None:
        check_output_path(loaded, opts.output, opts.in_place, opts.overwrite)  # fail before the work, not after
    if approximate:
        refuse_folder(loaded, opts, "the approximate swap changes what the norms compute, and config.json still says "
                                    "LayerNorm")
    if fold_scales_ and to != "rmsnorm":
        raise NormconvError("--fold-scales folds RMSNorm scales: it goes with --to rmsnorm")
    # a Hugging Face folder keeps the architecture: a norm's bias no linear has a parameter for stays on the norm
    folder = opts.output is not None and output_format(loaded, Path(opts.output)) == "hf"
    swap_pass = swap_norm.SwapPass(to, approximate, require=not fold_scales_, partial=partial, add_bias=not folder)
    fold_pass = fold_scales.FoldScales()
    # hand-written and functional norms -> native modules first: swap replaces modules
    passes = ([canonicalize_pass.Canonicalize(functional=True)] if canonicalize else []) + [swap_pass] + \
        ([fold_pass] if fold_scales_ else [])
    seen: dict[str, Any] = {}
    report, done = rewrite(loaded, passes, opts, command="swap", write=False, outputs_seen=seen)
    model = done.model
    if fold_scales_:
        report.extra["scales_folded"] = sum(p.ok for plans in done.extras(fold_pass, "plans") for p in plans)
    # canonicalize is swap's first step: a norm that is already native is no news (and no skip of the swap)
    report.sites = [s for s in report.sites if not (s.pass_name == canonicalize_pass.NAME and not s.applied
                                                    and s.code == canonicalize_pass.CanonWhy.ALREADY_NATIVE)]
    if isinstance(model, fx.GraphModule) and not isinstance(loaded.model, fx.GraphModule):
        report.notes.append("functional / inline norms became modules in the traced graph: the result is a "
                            "torch.fx.GraphModule (your class is not kept; loading it back needs --trust-pickle)")
    v = report.validation[0]
    agree = argmax_agreement(output_leaves(seen["reference"]), output_leaves(seen["rewritten"]))
    plans = [p for ps in done.extras(swap_pass, "plans") for p in ps]
    report.extra.update({
        "to": to, "approximate": approximate, "partial": partial, "exact": done.exact,
        "swapped": sum(p.module is not None and (p.exact or approximate) for p in plans),
        "exact_sites": sum(p.exact for p in plans), "refused": sum(not p.exact for p in plans),
        "argmax_agreement": agree,
        "drift": {"max_abs_error": v.max_abs_error, "max_rel_error": v.max_rel_error, "cosine": v.cosine},
    })
    if not done.exact:
        report.notes.append(
            f"approximate swap ({report.extra['refused']} site(s) not exact): output drift max abs "
            f"{v.max_abs_error:.3g}, max rel {v.max_rel_error:.3g}, cosine {v.cosine:.6f}; fine-tune if it matters")
    write_model(loaded, model, opts, loaded.require_inputs(), report, done)
    return report, model


def rotate(loaded: Loaded, opts: Options = Options(), rotation: str = "hadamard",
           seed: int = 0) -> tuple[Report, nn.Module]:
    """canonicalize -> exact LayerNorm -> RMSNorm swap (pre-LN) -> scale fold -> rotation of the residual stream,
    verified against the original, then written."""
    if rotation not in rotate_pass.ROTATIONS:
        raise NormconvError(f"unknown --rotation {rotation!r}: choose {', '.join(rotate_pass.ROTATIONS)}")
    loaded.require_inputs()
    if opts.output is not None:
        check_output_path(loaded, opts.output, opts.in_place, opts.overwrite)  # fail before the work, not after
    if any(isinstance(m, nn.LayerNorm) for m in loaded.model.modules()):
        refuse_folder(loaded, opts, "rotate makes each LayerNorm an RMSNorm of a rotated stream, whose mean is no "
                                    "longer 0, so the LayerNorm config.json names would compute something else")
    swap_pass = swap_norm.SwapPass("rmsnorm", require=False, stream_only=True)
    fold_pass = fold_scales.FoldScales(strict=True, stream_only=True)
    rot = rotate_pass.Rotate(rotation, seed)
    passes = [canonicalize_pass.Canonicalize(functional=True), swap_pass, fold_pass] + \
        ([rot] if rotation != "none" else [])
    try:
        report, done = rewrite(loaded, passes, opts, command="rotate")
    except NormconvError as exc:
        # the swap's refusal is rotate's: it needs the exact swap (rotate has no partial or approximate mode)
        if exc.code is Code.REFUSED and exc.pass_name == swap_norm.NAME:
            raise NormconvError(f"rotate needs the exact LayerNorm -> RMSNorm swap first, and it refused: "
                                f"{exc.message}", Code.REFUSED, pass_name="rotate") from exc
        raise
    plan = next(iter(done.extras(rot, "plan")), None)
    report.extra.update({
        "rotation": rotation, "seed": seed, "matrix": next(iter(done.extras(rot, "how")), None) or
        "identity (no rotation)",
        "width": plan.d if plan else None, "writers": len(plan.writers) if plan else 0,
        "reader_linears": len(plan.readers) if plan else 0,
        "swapped": sum(p.exact for ps in done.extras(swap_pass, "plans") for p in ps),
        "scales_folded": sum(p.ok for ps in done.extras(fold_pass, "plans") for p in ps),
    })
    return report, done.model


__all__ = ["swap", "rotate"]
