"""``normconv fold``: BatchNorm folded into its neighbouring conv / linear (inference), then through the activations and
pools around the ones left (fold-through: scale backward, shift forward, the rest a per-channel add), verified, then
written."""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.fx as fx
import torch.nn as nn

from normconv.engine import training
from normconv.engine.door import not_verified, rewrite, write_model
from normconv.engine.plans import one_site_per_batchnorm
from normconv.engine.run import apply_passes
from normconv.engine.precision import against_float32, half_dtype, headroom_extra, run_cast, target_half, upcast
from normconv.errors import NormconvError, VerificationError
from normconv.graph.capture import capture
from normconv.graph.detect import find_norms
from normconv.io.load import Loaded
from normconv.options import Options
from normconv.passes import fold_batchnorm, fold_through, lift_layers
from normconv.passes import fold_weight_standardization as fold_ws
from normconv.passes.base import Pass
from normconv.report import Report, Site
from normconv.verify import Inputs


# what fold runs, in order, and export with it (after canonicalize): fold-through first, as it takes only BNs with ops
# between them and their layer; a BN it leaves, fold takes from the next capture
FOLDS: tuple[Pass, ...] = (fold_ws.FOLD_WS, fold_through.FOLD_THROUGH, fold_batchnorm.FOLD)


def refuse_training(loaded: Loaded, opts: Options, doing: str,
                    how: str = "call .eval() first or pass --eval") -> list[str]:
    """A model with a module in training mode whose flag changes what it computes (``engine.training.flag_reader``:
    a BatchNorm on batch statistics, live dropout, a forward that reads self.training), unless ``opts.eval_mode``:
    refused in one line naming it (an inference rewrite, ``doing``, proves the eval-mode model; ``how``: the way out
    the command has). Returns the paths of the modules in training mode whose flag changes nothing (a Conv2d left so
    by timm's reparameterize_model)."""
    live, idle = training.live_in_training(loaded.model)
    # a module whose training flag changes what it computes, in training mode  =>  the rewrite would change the model
    if live and not opts.eval_mode:
        path, module, reader = live[0]
        where = "the model" if path == "" else path
        why = ("BatchNorm uses batch statistics there" if isinstance(module, nn.modules.batchnorm._BatchNorm) else
               "dropout is live there" if isinstance(module, nn.modules.dropout._DropoutNd) else
               reader)
        more = f", {len(live) - 1} more such" if len(live) > 1 else ""
        raise NormconvError(f"{loaded.spec} is in training mode ({where}, {type(module).__name__}{more}): {why}, "
                            f"so {doing} would change it; {how}")
    return idle


def refuse_program_in_training(loaded: Loaded, doing: str) -> None:
    """A .pt2 exported in training mode (its graph computes batch statistics, live dropout), refused for an inference
    rewrite (``doing``: fold, export; inspect plans their refusal): no module flag, --eval included, undoes what a
    program's graph computes."""
    if loaded.fmt == "pt2":
        refuse_training(loaded, Options(), doing, "export the program again from the model after .eval() (--eval "
                                                  "cannot change what a program's graph computes)")


def fold(loaded: Loaded, opts: Options = Options()) -> tuple[Report, nn.Module]:
    """BatchNorm folded into its neighbouring conv / linear, verified, then written. ``opts.dtype`` (float16 /
    bfloat16): the model is folded in it; a half fold (that, or a half model) reports each site's headroom measured
    in float32 and the folded weights' largest value in the dtype."""
    refuse_program_in_training(loaded, "folding")
    idle = [] if opts.eval_mode else refuse_training(loaded, opts, "folding")
    half = target_half(opts.dtype, loaded.model)
    rooms, layers = _fold_headroom(loaded, half, opts.method) if half is not None and not opts.eval_mode else ([], {})
    if idle:  # modules in training mode whose flag changes nothing: written as proven, eval
        opts = dataclasses.replace(opts, eval_mode=True)
    measured_on = loaded.require_inputs().to(torch.float32).describe() + " (float32)"
    # a half fold is judged as the README says: a check it misses against the half model as given passes where the
    # float32 model (kept beside it) shows the plain cast's own rounding explains it (precision.against_float32)
    model32 = None if half is None or opts.atol is not None or opts.rtol is not None else loaded.model
    if half is not None and half_dtype(loaded.model) is None:  # measured in float32, folded in the dtype
        cast = (loaded.model if loaded.disposable and model32 is None else copy.deepcopy(loaded.model)).to(half)
        inputs = loaded.require_inputs().to(half)  # the cast's own forward is the rewrite's reference
        loaded = dataclasses.replace(loaded, model=cast, inputs=inputs,
                                     checked=(inputs, run_cast(cast, inputs, half, loaded.spec)))
    elif model32 is not None:  # given in half: its weights upcast
        model32 = upcast(loaded.model)
    try:
        # fold-through first: it takes only BNs with ops between them and their layer, so a model where it has
        # nothing to do is folded from the same capture (one capture, five forwards in all)
        report, done = rewrite(loaded, lifted(loaded.model) + list(FOLDS), opts,
                               command=fold_batchnorm.NAME, judge=model32 is None, write=model32 is None)
        if model32 is not None:
            report.validation = against_float32(report.validation, model32, done.model, done.expected, half,
                                                report.notes)
            failed = next((v for v in report.validation if not v.passed and not v.drift), None)
            if failed is not None:
                raise not_verified(fold_batchnorm.NAME, failed, report)
            write_model(loaded, done.model, opts, loaded.require_inputs(), report, done)
    except VerificationError as exc:
        if rooms and exc.report is not None:
            exc.report.extra["headroom"] = headroom_extra(rooms, half, measured_on)
        raise
    model = done.model
    report.sites = one_site_per_batchnorm(report.sites)
    if rooms:
        from normconv.graph.headroom import check_folded_weight

        applied = {s.target for s in report.sites if s.applied}
        for h in rooms:  # the folded layer's weight, as written in the dtype
            layer = layers.get(h.target)
            if h.target in applied and layer is not None and isinstance(getattr(model.get_submodule(layer), "weight",
                                                                                None), torch.Tensor):
                check_folded_weight(h, layer, model.get_submodule(layer).weight)
        report.extra["headroom"] = headroom_extra(rooms, half, measured_on)
    if idle:
        report.notes.append(f"{len(idle)} module(s) in training mode whose flag changes nothing they compute "
                            f"({', '.join(p or 'the model' for p in idle[:3])}{', ...' if len(idle) > 3 else ''}): "
                            f"the result is written in eval mode, the mode the check covers")
    if not any(s.applied for s in report.sites):
        report.notes.append("no BatchNorm was folded; the model is unchanged" if report.sites
                            else "the model has no BatchNorm; it is unchanged")
    return report, model


def _fold_headroom(loaded: Loaded, half: torch.dtype, method: str) -> tuple[list, dict[str, str]]:
    """Each site's headroom in ``half``, measured on the float32 model, and BatchNorm -> the layer it folds into."""
    from normconv.graph.headroom import measure

    wide = loaded.model if half_dtype(loaded.model) is None else upcast(loaded.model)
    cap = capture(wide, loaded.require_inputs().to(torch.float32), method)
    norms = find_norms(cap)
    layers = {d.site.target: d.layer for d in fold_batchnorm.analyze(cap, norms) if d.applied and d.layer}
    return measure(cap, norms, half), layers


def lifted(model: nn.Module) -> list[Pass]:
    """An exported program (a GraphModule) calls aten.conv / linear on constant weights: lift those into native
    modules first, so the folds apply as on a module tree (passes/lift_layers.py). A user's module tree needs none."""
    return [lift_layers.LIFT] if isinstance(model, fx.GraphModule) else []


def lift_program(model: nn.Module, inputs: Inputs, method: str = "auto",
                 eval_mode: bool = False) -> tuple[nn.Module, list[Site]]:
    """``model`` as fold rewrites it: an exported program's functional layers lifted (``lifted``), on a
    tensor-sharing copy (the model itself is never written), with the lift's sites; ``model`` itself and no site
    when there is nothing to lift. A plan made on its capture (inspect's, export's) is the one fold's passes follow."""
    passes = lifted(model)
    if not passes:
        return model, []
    done = apply_passes(model, inputs, passes, method, eval_mode=eval_mode)
    return (done.model, done.sites) if done.sites else (model, [])


__all__ = ["FOLDS", "refuse_training", "refuse_program_in_training", "fold", "lifted", "lift_program",
           "one_site_per_batchnorm"]
