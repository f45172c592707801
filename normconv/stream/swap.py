"""``swap --stream``: a Hugging Face checkpoint through the exact LayerNorm -> RMSNorm swap, never holding the model.

  plan     the model built from config.json on the meta device, captured with torch.export (shapes only) and planned
           by swap_norm.analyze / swap_norm.edits, which read the few values they need (the norms' biases) from the
           shards: the writers to center (name, axis), the norm biases to fold into which consumer biases, the ties
  rewrite  in one pass in block order (stream.onepass): the rest (embeddings, final norm, head) first, then each
  verify   block's tensors read once from the shards and rewritten in memory with the swap's own functions
  write    (center_, bias_delta, add_: float64 a slice at a time); the original and the rewritten model run that
           block on the example inputs and a second shape (parameters on the meta device, only that block loaded),
           the rewritten block output compared with the original's minus its mean over the hidden axis, the
           rewritten tensors written at their offsets in shards whose headers were computed up front; the final
           outputs compared too. The written shards are read back by checksum (CRC-32 per tensor), and the temp
           folder next to OUT renamed into place only after every check passed

The reading (stream.checkpoint), the lockstep forwards (stream.blocks), the one pass (stream.onepass) and the
positioned writer (stream.writer) are shared with ``fold --stream`` (stream.fold).

Peak memory: one block (original and rewritten; for a half-precision checkpoint its linear weights as stored, run
a slice of rows at a time in float32, its other tensors in float32; the edits in float64 slices of at most 32 MB)
plus the embeddings and head (as stored). The output is the same architecture with rewritten
weights: every LayerNorm now reads a zero-mean stream, so it equals RMSNorm(weight, eps) (+ its bias where that
could not be folded).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from normconv.errors import CaptureError, Code, NormconvError
from normconv.quiet import phase
from normconv.graph.capture import capture
from normconv.graph.detect import find_norms
from normconv.io.archive import memory_bytes
from normconv.io.hf_inputs import hf_example_inputs
from normconv.io.hf_output import embedding_a_head_would_tie, headless_untie_note
from normconv.passes import swap_norm
from normconv.report import Report
from normconv.stream.blocks import build_on_meta
from normconv.stream.checkpoint import Checkpoint, holds, open_folder, stored_key, tied_names
from normconv.stream.onepass import Produce, write_verified

# ---------------------------------------------------------------------------------------------------------
# plan


def _plan(folder: Path, ckpt: Checkpoint, cls, config, dtype: torch.dtype):
    """(analysis, edits, tied names, headless: a base model's tied input embedding and its note, or None), or
    NormconvError with the reason the swap cannot be exact."""
    meta = build_on_meta(cls, config, dtype)
    ckpt.rename_for(meta)
    inputs = hf_example_inputs(meta)
    if inputs is None:
        raise NormconvError(f"{folder}: no example inputs from its config (--stream needs a model taking input_ids)")
    phase("capture", detail="on the meta device")
    try:
        cap = capture(meta, inputs, "torch.export")  # the graph needs shapes only: parameters stay on meta
    except CaptureError as first:
        # buffers computed on the CPU (GPT-J's sin/cos table, GPT-Neo's causal mask) meeting meta weights fail in
        # torch.export: then every tensor on meta, as fold --stream captures (what reads a buffer's values fails)
        try:
            cap = capture(meta.to("meta"), inputs.to("meta"), "torch.export")
        except CaptureError:
            fresh = build_on_meta(cls, config, dtype)  # the buffers of ``meta`` are on meta now
            _refused_as_in_memory(fresh, inputs, _reader(folder, ckpt, tied_names(fresh)))
            raise first from None
    if cap.specialized:  # one branch of a forward that branches on values: the stream cannot prove the others
        raise NormconvError(f"{folder}: the capture specialized a branch on tensor values at "
                            f"{cap.guards[0].describe()}; --stream rewrites models whose graph holds every branch "
                            f"(run without --stream, where the rewrite is proven for the other branch or refused)",
                            Code.REFUSED, pass_name=swap_norm.NAME)  # the code the in-memory refusal has
    aliases = tied_names(meta)
    # a base model whose config ties word embeddings: a head class built from the written folder would tie its head
    # to the centered embedding (io.hf_output: the folder is written untied where the embedding is centered)
    headless = embedding_a_head_would_tie(meta)
    headless = (headless, headless_untie_note(meta, headless)) if headless is not None else None
    read = _reader(folder, ckpt, aliases)
    a = _analyzed(cap, meta, read)
    plan = swap_norm.edits(cap, a, read=read)
    # a layer scale folded into its writer edits two tensors at once: not streamed yet (the in-memory swap does it)
    if plan.scales:
        raise NormconvError(f"{folder}: the stream has layer scales ({plan.scales[0].scale}, ...): --stream does not "
                            f"fold them yet; run normconv swap without --stream", Code.REFUSED,
                            pass_name=swap_norm.NAME)
    return a, plan, aliases, headless


def _reader(folder: Path, ckpt: Checkpoint, aliases: dict[str, list[str]]) -> Callable[[str], torch.Tensor]:
    """The checkpoint's tensor of a model name, each read once (analyze and edits read the same few vectors, the
    norms' biases)."""
    seen: dict[str, torch.Tensor] = {}

    def read(name: str) -> torch.Tensor:
        stored = stored_key(ckpt, aliases, name)
        if stored is None:
            raise NormconvError(f"{folder}: the checkpoint has no tensor {name}")
        if stored not in seen:
            seen[stored] = ckpt.get(stored)
        return seen[stored].clone()

    return read


def _analyzed(cap, model: nn.Module, read: Callable[[str], torch.Tensor]) -> swap_norm.Analysis:
    """The swap's analysis of the capture, or its refusal (Code.REFUSED, as the in-memory swap refuses)."""
    # the folder keeps the architecture: a norm's bias that would need a bias added to a linear stays on the norm
    # and each norm's class (a hand-written norm that is its module's forward: that module, only its writers change)
    a = swap_norm.analyze(cap, find_norms(cap), "rmsnorm", read=read, add_bias=False, keeps_class=True)
    if not a.plans:
        raise NormconvError(f"swap: {type(model).__name__} has no layernorm to swap to rmsnorm", Code.REFUSED,
                            pass_name=swap_norm.NAME)
    why = swap_norm.refusal(a)
    if why:
        raise NormconvError(f"{why} (--stream rewrites exact swaps only; normconv inspect lists every site)",
                            Code.REFUSED, pass_name=swap_norm.NAME)
    return a


def _refused_as_in_memory(meta: nn.Module, inputs, read: Callable[[str], torch.Tensor]) -> None:
    """A model the meta device cannot capture (a forward that branches on values, LED's global attention) is
    captured as the in-memory swap captures it, where its parameters fit in half this machine's memory: built with
    small random parameters (no weight is read; the analysis reads the norms' biases from the checkpoint) and
    planned by the same analysis, so a swap that cannot be exact is refused as in memory (post-LN, ...), not as a
    failed capture. Returns when it is not refused there (the caller raises the meta capture's error)."""
    size = sum(p.numel() * p.element_size() for p in meta.parameters())
    memory = memory_bytes()
    if not memory or size > memory // 2:
        return
    made: dict[int, nn.Parameter] = {}  # a tied parameter stays one tensor
    g = torch.Generator().manual_seed(0)
    for mod in meta.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and p.is_meta and id(p) not in made:
                made[id(p)] = nn.Parameter((torch.randn(p.shape, generator=g) * 0.02).to(p.dtype),
                                           requires_grad=False)
            if p is not None and id(p) in made:
                mod._parameters[name] = made[id(p)]
    try:
        cap = capture(meta, inputs)
    except CaptureError:
        return
    _analyzed(cap, meta, read)


# ---------------------------------------------------------------------------------------------------------
# rewrite


def _rewrite(ckpt: Checkpoint, plan: swap_norm.Edits, aliases: dict[str, list[str]], dtype: torch.dtype,
             notes: list[str], headless: tuple[str, str] | None = None
             ) -> tuple[Produce, dict[str, list[str]], dict[str, torch.dtype], bool, int]:
    """How each tensor is rewritten (``produce``, by the model's name: a tied tensor's names may differ), the untied
    copies to write (stored key -> the other names of its tensor, each written as ``produce`` gives it for that
    name), the rewritten tensors written in the model's dtype ``dtype`` (output key -> dtype: those stored in a dtype
    that cannot hold the rewrite, ``holds``), whether config.json unties the embeddings, and how many norm biases
    are folded."""
    # a norm whose bias would need a new bias parameter (a consumer without one) kept it (analyze, add_bias=False):
    # no fold names it, and LN(x) = RMSNorm(x) * g + b on the zero-mean stream all the same
    fold_into = plan.fold_into()
    zeroed = {f.beta for f in plan.folds}
    untied_names = set(plan.untie.values())

    def centers(name: str) -> int | None:
        """The axis ``name`` is centered along, as the in-memory swap leaves it: an untied embedding's own copy is
        centered; the names still tied together share one tensor, centered where one of them is a writer."""
        if name in untied_names:
            return plan.center.get(name)
        return next((plan.center[a] for a in aliases.get(name, [name]) if a not in untied_names and a in plan.center),
                    None)

    # untie: each centered embedding is written under its own name with the centered values, every other name of
    # its tensor with the original ones (as copies, or as its own stored tensor where the checkpoint stores it)
    copies: dict[str, list[str]] = {}
    untied = False
    done: set[str] = set()
    for weight in plan.untie.values():
        stored = stored_key(ckpt, aliases, weight)
        copies[stored] = [a for a in aliases.get(weight, [weight]) if a != ckpt.name[stored] and a not in ckpt.key]
        others = [a for a in aliases.get(weight, [weight]) if a != weight and a not in done]
        done.add(weight)
        if others:
            untied = True
            kept = [a for a in aliases.get(weight, [weight]) if centers(a) is None]
            notes.append(f"untied {weight} from {', '.join(others)}: the embedding is centered"
                         + (f", {', '.join(kept)} {'keeps' if len(kept) == 1 else 'keep'} the original values"
                            if kept else "") + " (config.json: tie_word_embeddings = false)")
    if headless is not None and not untied and centers(headless[0]) is not None:
        untied = True  # config.json: tie_word_embeddings = false, as the in-memory folder writer leaves it
        notes.append(headless[1])
    written = {ckpt.name[k]: k for k in ckpt.name} | {c: c for cs in copies.values() for c in cs}
    # a rewritten tensor stored in a dtype that cannot hold it is written in the model's dtype (from_pretrained
    # loads it in that dtype either way): rounded back into float16 / float8 it is no longer zero-mean
    widen = {key: dtype for name, key in written.items()
             if (centers(name) is not None or name in fold_into) and
             not holds(ckpt.dtype(stored_key(ckpt, aliases, name)), dtype)}

    def wide(name: str, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` in the dtype ``name`` is written in."""
        return t.to(widen.get(written.get(name, ""), t.dtype), copy=True)

    def edited(name: str, t: torch.Tensor) -> torch.Tensor:
        axis = centers(name)
        return t if axis is None else swap_norm.center_(wide(name, t), axis)  # writer: minus its mean (hidden axis)

    def produce(name: str, t: torch.Tensor, source: Callable[[str], torch.Tensor]) -> torch.Tensor:
        new = edited(name, t)  # a copy where it changes: ``t`` stays the original (the original model runs on it)
        for f in fold_into.get(name, []):
            # consumer bias <- bias + W b  (W as rewritten: centered first if it is also a writer)
            w = edited(f.weight, source(f.weight))
            new = swap_norm.add_(wide(name, new) if new is t else new, swap_norm.bias_delta(
                w if w.is_floating_point() else w.to(dtype), source(f.beta), f.layout))
        return torch.zeros_like(new) if name in zeroed else new  # a zeroed norm bias now lives in its consumers

    return produce, copies, widen, untied, len({f.norm for f in plan.folds})


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
    temp folder once it is written, before its checksums are read back (tests use it to corrupt the output)."""
    src, out, ckpt, cls, config, dtype = open_folder(folder, output, overwrite)
    analysis, plan, aliases, headless = _plan(src, ckpt, cls, config, dtype)
    report = Report(command="swap", model=str(src), sites=analysis.sites())
    report.extra.update({"to": "rmsnorm", "exact": True, "streamed": True, "swapped": len(analysis.plans),
                         "centered": len(plan.center)})

    produce, copies, widen, untied, report.extra["folded"] = _rewrite(ckpt, plan, aliases, dtype, report.notes,
                                                                      headless)
    write_verified(src, out, ckpt, cls, config, dtype, report, produce, copies, untied, _centered,
                   atol, rtol, keep_temp_on_failure, after_rewrite, dtypes=widen)
    report.notes.append("the output is the same architecture with rewritten weights: every LayerNorm reads a "
                        "zero-mean stream, so it equals RMSNorm(weight, eps) + bias (bias 0 where it was folded); "
                        "normconv swap OUT --to rmsnorm in memory makes the module swap")
    return report
