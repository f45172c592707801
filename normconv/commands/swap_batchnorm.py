"""``normconv swap --to frozen-batchnorm | batchnorm | affine | groupnorm[:G] | instancenorm``: BatchNorm converted
for training or for the edge (passes/convert_batchnorm.py), verified against the original (exact targets) or its
drift measured (groupnorm, instancenorm), then written. ``--to affine`` first folds every BatchNorm a neighbour can
absorb (fold, then fold-through) and turns only the ones left into a per-channel affine."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from normconv.commands.fold import refuse_program_in_training, refuse_training
from normconv.engine.door import rewrite, write_model
from normconv.errors import Code, NormconvError
from normconv.io.load import Loaded
from normconv.io.write import check_output_path
from normconv.options import Options
from normconv.passes import convert_batchnorm, fold_batchnorm, fold_through
from normconv.report import Report
from normconv.verify import argmax_agreement, output_leaves


def parse_target(to: str) -> tuple[str, int | None] | None:
    """("groupnorm", 8) from "groupnorm:8", (to, None) for another BatchNorm target, None for a target that is not
    one of them. A bad group count is a one-line error."""
    name, colon, groups = to.partition(":")
    if name not in convert_batchnorm.TARGETS:
        return None
    if colon and name != "groupnorm":
        raise NormconvError(f"--to {to}: only groupnorm takes a count (groupnorm:G)")
    if colon and (not groups.isdigit() or int(groups) < 1):  # "groupnorm:" too: a count was meant, none given
        raise NormconvError(f"--to {to}: the group count must be a positive integer (groupnorm:G)")
    return name, int(groups) if groups else None


def swap_batchnorm(loaded: Loaded, opts: Options = Options(), to: str = "frozen-batchnorm", *,
                   as_conv: bool = False) -> tuple[Report, nn.Module]:
    """Every BatchNorm module converted to ``to`` (``groupnorm:G`` names the groups), verified, then written."""
    target = parse_target(to)
    if target is None:
        raise NormconvError(f"unknown BatchNorm target {to!r}: choose {', '.join(convert_batchnorm.TARGETS)}")
    name, groups = target
    if as_conv and name != "affine":
        raise NormconvError("--as-conv writes the per-channel affine as a depthwise 1x1 conv: it goes with --to affine")
    # a program exported in training mode computes batch statistics in its graph: no target's module is called there
    refuse_program_in_training(loaded, f"converting its BatchNorms to {name}")
    if name == "affine":  # x * s + t in place of batch statistics: an inference rewrite, as fold is
        refuse_training(loaded, opts, "a per-channel affine")
    loaded.require_inputs()
    if opts.output is not None:
        check_output_path(loaded, opts.output, opts.in_place)  # fail before the work, not after
    convert = convert_batchnorm.ConvertBatchNorm(name, groups, as_conv)
    # --to affine is for the BatchNorms nothing absorbs: fold first what a neighbour can take exactly
    passes = ([fold_through.FOLD_THROUGH, fold_batchnorm.FOLD] if name == "affine" else []) + [convert]
    seen: dict[str, Any] = {}
    report, done = rewrite(loaded, passes, opts, command="swap", write=False, outputs_seen=seen)
    converted = sum(r.extra.get("converted", 0) for r in done.of(convert))
    folded = sum(s.applied for s in report.sites if s.pass_name != convert_batchnorm.NAME)
    bn_sites = [s for s in report.sites if s.pass_name == convert_batchnorm.NAME]
    if not converted and not folded:
        first = next((s for s in bn_sites if not s.applied), None)
        raise NormconvError(f"swap --to {to}: " + (f"none of {len(bn_sites)} BatchNorm sites can be converted; "
                                                   f"{first.target}: {first.reason}" if first else
                                                   "the model has no BatchNorm module to convert"),
                            Code.REFUSED, pass_name=convert_batchnorm.NAME)
    v = report.validation[0]
    report.extra.update({
        "to": name, "groups": groups, "as_conv": as_conv, "exact": done.exact, "converted": converted,
        "folded": folded, "kept": sum(not s.applied for s in bn_sites),
        "argmax_agreement": argmax_agreement(output_leaves(seen["reference"]), output_leaves(seen["rewritten"])),
        "drift": {"max_abs_error": v.max_abs_error, "max_rel_error": v.max_rel_error, "cosine": v.cosine},
    })
    if not done.exact:
        report.notes.append(f"approximate swap to {name} ({converted} site(s)): output drift max abs "
                            f"{v.max_abs_error:.3g}, max rel {v.max_rel_error:.3g}, cosine {v.cosine:.6f}")
    write_model(loaded, done.model, opts, loaded.require_inputs(), report, done)
    return report, done.model


__all__ = ["swap_batchnorm", "parse_target"]
