"""``swap --stream``: a Hugging Face checkpoint through the exact LayerNorm -> RMSNorm swap, never holding the model.

  plan     the model built from config.json on the meta device, captured with torch.export (shapes only) and planned
           by swap_norm.analyze / swap_norm.edits, which read the few values they need (the norms' biases) from the
           shards: the writers to center (name, axis), the norm biases to fold into which consumer biases, the ties
  rewrite  tensor by tensor, shard by shard, with the swap's own functions (center_, bias_delta, add_: float64 a
           slice at a time); each output shard is written a tensor at a time behind a header computed up front
  verify   the original and the rewritten folder run on the example inputs (and a second shape) in models whose
           parameters live on the meta device: each block of the longest ModuleList is loaded from the shards just
           before it runs and dropped after it, the rest (embeddings, final norm, head) for the forward; every
           block's output and the final outputs are compared
  write    everything under a temp folder next to OUT, renamed into place only after every check passed

The reading and writing (stream.checkpoint) and the block-by-block verification (stream.blocks) are shared with
``fold --stream`` (stream.fold).

Peak memory: the largest tensor (twice, in float64 slices at most 32 MB) while rewriting; one block plus the
embeddings and head while verifying. The output is the same architecture with rewritten weights: every LayerNorm
now reads a zero-mean stream, so it equals RMSNorm(weight, eps) (+ its bias where that could not be folded).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch

from normconv.errors import NormconvError
from normconv.quiet import phase
from normconv.graph.capture import capture
from normconv.graph.detect import find_norms
from normconv.io.hf_inputs import hf_example_inputs
from normconv.passes import swap_norm
from normconv.report import Report
from normconv.stream.blocks import build_on_meta, write_verified
from normconv.stream.checkpoint import Checkpoint, open_folder, stored_key, tied_names, write_shards

# ---------------------------------------------------------------------------------------------------------
# plan


def _plan(folder: Path, ckpt: Checkpoint, cls, config, dtype: torch.dtype):
    """(analysis, edits, tied names), or NormconvError with the reason the swap cannot be exact."""
    meta = build_on_meta(cls, config, dtype)
    ckpt.rename_for(meta)
    inputs = hf_example_inputs(meta)
    if inputs is None:
        raise NormconvError(f"{folder}: no example inputs from its config (--stream needs a model taking input_ids)")
    phase("capture", detail="on the meta device")
    cap = capture(meta, inputs, "torch.export")  # the graph needs shapes only: parameters stay on meta
    if cap.specialized:  # one branch of a forward that branches on values: the stream cannot prove the others
        raise NormconvError(f"{folder}: the capture specialized a branch on tensor values at "
                            f"{cap.guards[0].describe()}; --stream rewrites models whose graph holds every branch "
                            f"(run without --stream, where the rewrite is proven for the other branch or refused)")
    aliases = tied_names(meta)

    def read(name: str) -> torch.Tensor:
        stored = stored_key(ckpt, aliases, name)
        if stored is None:
            raise NormconvError(f"{folder}: the checkpoint has no tensor {name}")
        return ckpt.get(stored)

    a = swap_norm.analyze(cap, find_norms(cap), "rmsnorm", read=read)
    if not a.plans:
        raise NormconvError(f"swap: {type(meta).__name__} has no layernorm to swap to rmsnorm")
    why = swap_norm.refusal(a)
    if why:
        raise NormconvError(f"{why} (--stream rewrites exact swaps only; normconv inspect lists every site)")
    plan = swap_norm.edits(cap, a, read=read)
    # a layer scale folded into its writer edits two tensors at once: not streamed yet (the in-memory swap does it)
    if plan.scales:
        raise NormconvError(f"{folder}: the stream has layer scales ({plan.scales[0].scale}, ...): --stream does not "
                            f"fold them yet; run normconv swap without --stream")
    return a, plan, aliases


# ---------------------------------------------------------------------------------------------------------
# rewrite


def _rewrite(ckpt: Checkpoint, plan: swap_norm.Edits, aliases: dict[str, list[str]], tmp: Path,
             notes: list[str]) -> tuple[dict[str, str], bool, int]:
    """Write every shard of ``ckpt`` into ``tmp`` with the edits applied; returns the new weight map, whether a
    tied tensor was written under a second name (untied), and how many norm biases were folded."""
    fold_into = plan.fold_into()
    # a norm whose bias would need a new bias parameter (a consumer without one) keeps its bias: the architecture
    # is not changed, and LN(x) = RMSNorm(x) * g + b on the zero-mean stream all the same
    kept = {f.norm for f in plan.folds if f.bias is None}
    for norm in sorted(kept):
        notes.append(f"{norm}.bias kept (a linear reading {norm} has no bias parameter to absorb it): that norm is "
                     f"RMSNorm(x) * weight + bias")
    fold_into = {b: [f for f in fs if f.norm not in kept] for b, fs in fold_into.items()}
    zeroed = {f.beta for f in plan.folds if f.norm not in kept}
    # untie: the centered embedding keeps its name; each name tied to it is written with the original values
    copies: dict[str, list[str]] = {}
    for path, weight in plan.untie.items():
        stored = stored_key(ckpt, aliases, weight)
        others = [a for a in aliases.get(weight, []) if a != ckpt.name[stored] and a not in ckpt.key]
        copies[stored] = others
        if others:
            notes.append(f"untied {weight} from {', '.join(others)}: the embedding is centered, {', '.join(others)} "
                         f"keeps the original values (config.json: tie_word_embeddings = false)")

    def edited(name: str, t: torch.Tensor) -> torch.Tensor:
        for alias in aliases.get(name, [name]):
            if alias in plan.center:
                return swap_norm.center_(t, plan.center[alias])  # writer: minus its mean along the hidden axis
        return t

    def produce(name: str, t: torch.Tensor) -> torch.Tensor:
        t = edited(name, t)
        for f in fold_into.get(name, []):
            # consumer bias <- bias + W b  (W as rewritten: centered first if it is also a writer)
            t = swap_norm.add_(t, swap_norm.bias_delta(edited(f.weight, ckpt.get(stored_key(ckpt, aliases, f.weight))),
                                                       ckpt.get(stored_key(ckpt, aliases, f.beta)), f.layout))
        return t.zero_() if name in zeroed else t  # a zeroed norm bias now lives in its consumers

    weight_map = write_shards(ckpt, tmp, produce, copies)
    return weight_map, any(copies.values()), len({f.norm for f in plan.folds} - kept)


# ---------------------------------------------------------------------------------------------------------
# the command


def _centered(block_output: torch.Tensor) -> torch.Tensor:
    """What a swapped block must output: the residual stream, which the rewrite makes zero-mean, equals the
    original stream minus its mean over the hidden axis (what every LayerNorm reads)."""
    return block_output - block_output.mean(-1, keepdim=True)


def swap(folder: str | os.PathLike, output: str | os.PathLike, *, atol: float | None = None,
         rtol: float | None = None, keep_temp_on_failure: bool = False,
         after_rewrite: Callable[[Path], None] | None = None, overwrite: bool = False) -> Report:
    """``normconv swap FOLDER --to rmsnorm --stream -o OUT``: see the module docstring. ``after_rewrite`` sees the
    temp folder before verification (tests use it to corrupt the output)."""
    src, out, ckpt, cls, config, dtype = open_folder(folder, output, overwrite)
    analysis, plan, aliases = _plan(src, ckpt, cls, config, dtype)
    report = Report(command="swap", model=str(src), sites=analysis.sites())
    report.extra.update({"to": "rmsnorm", "exact": True, "streamed": True, "swapped": len(analysis.plans),
                         "centered": len(plan.center)})

    def write(tmp: Path) -> tuple[dict[str, str], bool]:
        weight_map, untied, report.extra["folded"] = _rewrite(ckpt, plan, aliases, tmp, report.notes)
        return weight_map, untied

    write_verified(src, out, ckpt, cls, config, dtype, report, write, _centered, atol, rtol, keep_temp_on_failure,
                   after_rewrite)
    report.notes.append("the output is the same architecture with rewritten weights: every LayerNorm reads a "
                        "zero-mean stream, so it equals RMSNorm(weight, eps) + bias (bias 0 where it was folded); "
                        "normconv swap OUT --to rmsnorm in memory makes the module swap")
    return report
