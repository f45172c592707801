"""``normconv deepnorm``: DeepNorm residual rescaling LN(alpha*x + f(x)) at every post-LN sublayer and beta on the
FFN / v / out projections, for (re)training deep post-LN transformers. It changes what the model computes: the
engine checks it against that formula computed literally on the same weights (``Check.REFERENCE``)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch.nn as nn

from normconv.engine.door import refuse_folder, rewrite, write_model
from normconv.errors import Code, NormconvError
from normconv.graph.capture import capture
from normconv.graph.detect import find_norms
from normconv.io.load import Loaded
from normconv.io.write import check_output_path, output_format
from normconv.options import Options
from normconv.passes import deepnorm as deepnorm_pass
from normconv.report import Report


def deepnorm(loaded: Loaded, opts: Options = Options(), *, arch: str | None = None, alpha: float | None = None,
             beta: float | None = None, beta_mode: str = "init", n_layers: int | None = None,
             m_layers: int | None = None, seed: int | None = 0, value_proj: Sequence[str] = (),
             out_proj: Sequence[str] = ()) -> tuple[Report, nn.Module]:
    """LN(alpha*x + f(x)) at every post-LN sublayer and beta on FFN/v/out, checked against that formula computed
    literally on the same weights, then written. Raises NormconvError on refusal."""
    loaded.require_inputs()
    if opts.output is not None:
        check_output_path(loaded, opts.output, opts.in_place, opts.overwrite)
        if Path(opts.output).suffix == ".safetensors":
            raise NormconvError(f"{opts.output}: a .safetensors file holds weights only and would drop the residual "
                                f"scaling; write a .pt (the module) instead")
    p = deepnorm_pass.DeepNormPass(arch, alpha, beta, beta_mode, n_layers, m_layers, seed, value_proj=value_proj,
                                   out_proj=out_proj)
    if opts.output is not None and output_format(loaded, Path(opts.output)) == "hf":
        _refuse_if_not_post_ln(loaded, opts, p)  # whether DeepNorm applies at all, before the folder's refusal
    refuse_folder(loaded, opts, "DeepNorm's residual scaling (hooks, eps / alpha^2 on each norm) is no weight a "
                                "config.json can carry", ".pt")
    why = deepnorm_pass.already_applied(loaded.model)
    if why:
        raise NormconvError(why)
    report, done = rewrite(loaded, [p], opts, command=deepnorm_pass.NAME, write=False)
    (result,) = done.of(p)
    an = result.extra["analysis"]
    report.extra.update({"arch": an.arch, "beta_mode": beta_mode, "stacks": result.extra["stacks"],
                         "capture": result.extra["capture_method"], "marker": deepnorm_pass.MARKER,
                         "sublayers": result.extra["records"]})
    report.notes.append(
        "DeepNorm changes what the model computes (it is for (re)training); validation compares it with "
        "LN(alpha*x + f(x)) computed literally on the same weights. Save the module itself (torch.save(model)): "
        "a state_dict alone does not carry the residual scaling.")
    write_model(loaded, done.model, opts, loaded.require_inputs(), report, done)
    return report, done.model


def _refuse_if_not_post_ln(loaded: Loaded, opts: Options, p: deepnorm_pass.DeepNormPass) -> None:
    """The refusal the pass would give a model DeepNorm does not apply to (pre-LN, no post-LN residual), raised now:
    a folder out is refused too, and that refusal would send the user to a .pt that is refused for this. A model
    that cannot be captured is left to the folder's refusal (the rewrite would fail on it as well)."""
    try:
        cap = capture(loaded.model, loaded.require_inputs(), opts.method)
    except NormconvError:
        return
    why = deepnorm_pass.already_applied(loaded.model) or p.refusal(cap, find_norms(cap))
    if why:
        raise NormconvError(why, Code.REFUSED, pass_name=deepnorm_pass.NAME)


__all__ = ["deepnorm"]
