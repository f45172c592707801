"""``fold --stream``: a Hugging Face checkpoint's BatchNorms folded into the layer before each, never holding the model.

  plan     the model built from config.json with its parameters on the meta device; only the BatchNorm tensors
           (four per-channel vectors each) are read from the shards; captured with torch.export and planned by
           fold_batchnorm.analyze, with the guards of the in-memory fold
  rewrite  in one pass in block order with the verification (stream.onepass). A layer L (conv / linear) followed by
           BN(y) = s y + t, s = gamma / sqrt(var + eps), t = beta - mean s, becomes, in float64:
             BN'  weight 1, running_mean 0, running_var v = (1 - eps rounded to the stored dtype), so BN'(y) = f y + c
                  with f = 1 / sqrt(v + eps) (1 up to that rounding) and c = its bias
             L    W' = W s / f along L's output channels; with a bias b' = (b s + t) / f and c = 0, without one c = t
           so BN'(L'(x)) = s W x + s b + t = BN(L(x)): f cancels whatever 1 - eps rounded to
  verify   each block's tensors read once, rewritten in memory, run through the original and the rewritten block
           at two input shapes (stream.onepass.write_verified): every block output and the final outputs equal;
           the written shards checked by checksum when read back; nothing is written otherwise

The output is the same architecture with rewritten weights: each folded BatchNorm is now the identity (or a
per-channel shift where its layer has no bias), so ``from_pretrained`` loads it and its outputs are the original's;
``normconv fold OUT`` or ``normconv export OUT`` in memory then removes those BatchNorms. Only folds into the layer
before the BN are streamed (a fold into the layer after it changes that layer's bias by W t: not done here).
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from normconv.errors import Code, NormconvError
from normconv.quiet import phase
from normconv.graph.capture import capture
from normconv.graph.detect import find_norms
from normconv.io.hf_inputs import hf_example_inputs
from normconv.passes import fold_batchnorm
from normconv.passes.base import skip
from normconv.report import Report
from normconv.stream.blocks import build_on_meta, fill, tensor_slots
from normconv.stream.checkpoint import Checkpoint, holds, open_folder, tied_names
from normconv.stream.onepass import write_verified

_BN = nn.modules.batchnorm._BatchNorm


def _frozen(m: nn.Module | None) -> bool:
    """A frozen BatchNorm not of torch's classes: a module holding weight, bias, running_mean and running_var
    of one length (torchvision's / DETR's FrozenBatchNorm2d, whose eps is in its forward: the site's eps)."""
    if m is None or isinstance(m, _BN):
        return False
    ts = [getattr(m, k, None) for k in ("weight", "bias", "running_mean", "running_var")]
    return all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in ts) and len({t.shape for t in ts}) == 1


def _identity(block_output: torch.Tensor) -> torch.Tensor:
    return block_output  # a fold changes no block's output


def _plan(src: Path, ckpt: Checkpoint, cls, config, dtype: torch.dtype):
    """(decisions to stream, report sites, meta model, aliases); no decision and no site for a model without
    BatchNorm (nothing to plan: the in-memory fold leaves it unchanged, and so does this one)."""
    meta = build_on_meta(cls, config, dtype)
    ckpt.rename_for(meta)
    aliases = tied_names(meta)
    inputs = hf_example_inputs(meta)
    if inputs is None:
        raise NormconvError(f"{src}: no example inputs from its config (--stream needs a model taking input_ids "
                            f"or pixel_values)")
    bns = [(path, m) for path, m in meta.named_modules() if isinstance(m, _BN) or _frozen(m)]
    if not bns:
        return [], [], meta, aliases
    # shapes only: every tensor on meta, inputs too (a meta weight meeting a real buffer fails in torch.export)
    phase("capture", detail="on the meta device")
    cap = capture(meta.to("meta"), inputs.to("meta"), "torch.export")
    if cap.specialized:  # one branch of a forward that branches on values: the stream cannot prove the others
        raise NormconvError(f"{src}: the capture specialized a branch on tensor values at "
                            f"{cap.guards[0].describe()}; --stream rewrites models whose graph holds every branch "
                            f"(run without --stream, where the rewrite is proven for the other branch or refused)",
                            Code.REFUSED, pass_name=fold_batchnorm.NAME)  # the code the in-memory refusal has
    # then the BN tensors are read for real: the plan computes each BN's (s, t) from them
    bn_slots = [slot for path, m in bns for slot in tensor_slots(m, path)]
    fill(bn_slots, ckpt, aliases, src)
    missing = [name for m, k, name in bn_slots if getattr(m, k).is_meta]  # a running statistic not stored
    if missing:
        raise NormconvError(f"{src}: the checkpoint has no tensor {missing[0]}")
    streamed, sites = [], []
    for d in fold_batchnorm.analyze(cap, find_norms(cap), chain=False):  # each BN's tensors rewritten apart
        # a BatchNorm module, or a frozen one found by what it computes (DETR's DetrFrozenBatchNorm2d: its four
        # tensors are the module's own, written as the identity like a BatchNorm's)
        own = d.site.source == "module" or _frozen(cap.modules.get(d.site.target))
        ok = d.applied and d.direction == "backward" and own and \
            not getattr(cap.modules[d.layer], "parametrizations", None)
        # the shift t goes to the layer's bias, or stays in the BN's: with neither it has nowhere to go
        homeless = ok and cap.modules[d.layer].bias is None and cap.modules[d.site.target].bias is None
        if ok and not homeless:
            streamed.append(d)
            sites.append(d.to_site())
        elif homeless:
            sites.append(skip(fold_batchnorm.NAME, d.site, f"{d.reason}: neither {d.layer} nor the BatchNorm has a "
                                                           f"bias to keep its shift in the same architecture"))
        elif d.applied:
            sites.append(skip(fold_batchnorm.NAME, d.site, f"{d.reason}: --stream folds a BatchNorm module into the "
                                                           f"layer before it only"))
        else:
            sites.append(d.to_site())
    return streamed, sites, meta, aliases


def _edits(decisions, meta: nn.Module) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """state_dict name -> how its tensor is rewritten."""
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for d in decisions:
        s, t = d.affine
        bn, layer = meta.get_submodule(d.site.target), meta.get_submodule(d.layer)
        eps = float(getattr(bn, "eps", d.site.eps))  # a frozen BatchNorm's eps is in its forward: the site's
        v = torch.tensor(1.0 - eps, dtype=bn.running_var.dtype)  # the statistic as loaded by the plan
        f = 1.0 / math.sqrt(float(v) + eps)  # BN' multiplies by f: 1 up to the rounding of 1 - eps
        has_bias = layer.bias is not None
        c = torch.zeros_like(t) if has_bias else t
        out[f"{d.site.target}.weight"] = lambda x: torch.ones_like(x)
        out[f"{d.site.target}.bias"] = lambda x, c=c: c.to(x.dtype)
        out[f"{d.site.target}.running_mean"] = lambda x: torch.zeros_like(x)
        out[f"{d.site.target}.running_var"] = lambda x, v=v: torch.full_like(x, float(v))
        out[f"{d.layer}.weight"] = lambda w, layer=layer, s=s, f=f: _scaled_weight(layer, w.clone(), s / f)
        if has_bias:
            out[f"{d.layer}.bias"] = lambda b, s=s, t=t, f=f: ((b.double() * s + t) / f).to(b.dtype)
    return out


def _scaled_weight(layer: nn.Module, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``w`` scaled along ``layer``'s output channels (fold_batchnorm.fold_backward's arithmetic, bias left out)."""
    stand_in = copy.deepcopy(layer)  # meta: no tensor is copied
    stand_in.weight = nn.Parameter(w, requires_grad=False)
    fold_batchnorm.fold_backward(stand_in, scale, torch.zeros_like(scale))
    return stand_in.weight.detach()


def fold(folder: str | os.PathLike, output: str | os.PathLike, *, atol: float | None = None,
         rtol: float | None = None, keep_temp_on_failure: bool = False,
         after_rewrite: Callable[[Path], None] | None = None, overwrite: bool = False) -> Report:
    """``normconv fold FOLDER --stream -o OUT``: see the module docstring."""
    src, out, ckpt, cls, config, dtype = open_folder(folder, output, overwrite)
    decisions, sites, meta, aliases = _plan(src, ckpt, cls, config, dtype)
    if sites and not decisions:
        # BatchNorms the stream cannot fold (the in-memory fold may fold them otherwise, or through other ops): an
        # unchanged copy would pass for a fold, so the stream refuses, as a pass refusing the model as a whole
        raise NormconvError(f"fold --stream: no BatchNorm of {src} can be folded into the layer before it "
                            f"(normconv inspect lists every site and why)", Code.REFUSED, pass_name=fold_batchnorm.NAME)
    report = Report(command="fold", model=str(src), sites=sites)
    report.extra.update({"streamed": True, "folded": len(decisions)})
    edits = _edits(decisions, meta)

    # an edited tensor stored in a dtype that cannot hold the fold (a float16 conv in a float32 checkpoint) is
    # written in the model's dtype, as from_pretrained loads it
    widen = {k: dtype for k in ckpt.weight_map if not holds(ckpt.dtype(k), dtype) and
             any(a in edits for a in aliases.get(ckpt.name[k], [ckpt.name[k]]))}

    def produce(name: str, t: torch.Tensor, source) -> torch.Tensor:
        for alias in aliases.get(name, [name]):
            if alias in edits:  # a new tensor: ``t`` stays the original (the original model runs on it)
                return edits[alias](t.to(widen.get(ckpt.key.get(name, ""), t.dtype)))
        return t

    write_verified(src, out, ckpt, cls, config, dtype, report, produce, {}, False, _identity, atol, rtol,
                   keep_temp_on_failure, after_rewrite, dtypes=widen)
    if not sites:  # as the in-memory fold: the model written unchanged (and verified), exit 0
        report.notes.append("the model has no BatchNorm; it is unchanged")
        return report
    report.notes.append("the output is the same architecture with rewritten weights: each folded BatchNorm is the "
                        "identity (or a per-channel shift where its layer has no bias); normconv fold OUT in memory "
                        "removes them")
    return report
