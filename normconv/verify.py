"""Run the original and the rewritten model on the same inputs and measure how far apart they are.

Per output leaf ``a`` (rewritten) against ``b`` (reference), computed in float64:
  max_abs_error = max |a - b|
  max_rel_error = max |a - b| / max(|b|, atol)   (relative where the reference is above the noise floor)
  passed        = all |a - b| <= atol + rtol * |b|   (torch.allclose semantics), shapes and dtypes equal
  cosine        = <a, b> / (|a| |b|) over the flattened output
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten_with_path, keystr

from normconv.clone import clone_sharing_tensors
from normconv.report import OutputError, Validation

# documented defaults: exact passes are float reassociation only, so fp32 stays within these
DEFAULT_TOLERANCE = {
    torch.float64: (1e-9, 1e-7),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 5e-2),
}


@dataclass
class Inputs:
    """Example inputs of a model: positional and keyword arguments of its forward."""

    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def to(self, *a, **kw) -> "Inputs":
        def move(x):
            # only floating tensors change dtype; ids and masks keep theirs
            if isinstance(x, torch.Tensor):
                if x.is_floating_point():
                    return x.to(*a, **kw)
                return x.to(device=kw.get("device")) if "device" in kw else x
            return x

        return Inputs(tuple(move(x) for x in self.args), {k: move(v) for k, v in self.kwargs.items()})

    def describe(self) -> str:
        def one(x):
            return f"{tuple(x.shape)}:{str(x.dtype).removeprefix('torch.')}" if isinstance(x, torch.Tensor) else repr(x)

        parts = [one(x) for x in self.args] + [f"{k}={one(v)}" for k, v in self.kwargs.items()]
        return ", ".join(parts)


class _Guard:
    """What a guarded forward saw: the buffers the forward changed (compared when the output holds no tensor)."""

    def __init__(self) -> None:
        self.mutated: dict[str, torch.Tensor] = {}


@contextlib.contextmanager
def forward_guard(model: nn.Module):
    """normconv's own forwards change nothing: eval mode and no autograd inside; on exit every module's training
    flag and every buffer (BatchNorm statistics, counters, caches) is back bit for bit.

    Flags are set on each module directly, never through ``.eval()``: an exported program's module refuses
    ``.eval()``, and a user's override of ``train()`` is not ours to call."""
    modules = list(model.modules())
    flags = [m.training for m in modules]
    buffers = [(m, name, b, b.detach().clone()) for m in modules for name, b in m._buffers.items()
               if isinstance(b, torch.Tensor) and not b.is_meta]  # a meta buffer holds no values to guard
    names = {id(b): n for n, b in model.named_buffers(remove_duplicate=False)}
    guard = _Guard()
    try:
        for m in modules:
            m.training = False
        with torch.no_grad():
            yield guard
    finally:
        for m, flag in zip(modules, flags):
            m.training = flag
        for m, name, b, saved in buffers:
            now = m._buffers.get(name)
            if now is not None and (now is not b or now.shape != saved.shape or not torch.equal(now, saved)):
                guard.mutated[names.get(id(b), name)] = now.detach().clone()
            m._buffers[name] = b  # a forward that re-bound the buffer gets the original object back
            if b.shape != saved.shape or not torch.equal(b, saved):
                with torch.no_grad():
                    b.set_(saved) if b.shape != saved.shape else b.copy_(saved)


def run(model: nn.Module, inputs: Inputs) -> Any:
    """One guarded forward (``forward_guard``) on a copy of the inputs: a model that mutates its inputs or its
    buffers stays comparable and unchanged. A model whose output holds no tensor (it writes into buffers) is
    judged by what it wrote: the changed buffers, by name. Random ops draw the same numbers in every such forward
    (``same_draws``)."""
    with forward_guard(model) as guard, same_draws(model):
        out = model(*copy.deepcopy(inputs.args), **copy.deepcopy(inputs.kwargs))
    if not output_leaves(out) and guard.mutated:
        return {f"buffer {k}": v for k, v in sorted(guard.mutated.items())}
    return out


def _cuda_devices(model: nn.Module) -> list[int]:
    return sorted({t.device.index or 0 for t in list(model.parameters()) + list(model.buffers()) if t.is_cuda})


@contextlib.contextmanager
def rng_kept(model: nn.Module):
    """The caller's random number state (CPU, and the model's CUDA devices) as it was after the block: normconv's
    own draws (a pass building a layer initializes it randomly) do not move the user's random stream."""
    with torch.random.fork_rng(devices=_cuda_devices(model)):
        yield


@contextlib.contextmanager
def same_draws(model: nn.Module):
    """Random ops in the forward (MAE's random masking, VITS's noise) draw the same numbers in every checked
    forward: the original and a rewrite are compared on the same draws. The caller's RNG state is restored."""
    with rng_kept(model):
        torch.default_generator.manual_seed(0)
        for d in _cuda_devices(model):
            with torch.cuda.device(d):
                torch.cuda.manual_seed(0)
        yield


def other_shape(model: nn.Module, inputs: Inputs) -> tuple[Inputs, Any] | None:
    """The same inputs at a second shape where the model's dimensions are free: batch 1 (2 when the example's is
    1; batch 1 is where batch-dependent code differs most), for sequences ((B, L) ids and masks, (B, L, C)
    activations) length - 1, and for images ((B, C, H, W) floats) H and W 32 smaller (32 larger below 96: a
    multiple of every usual stride), then batch + 1. Each candidate is tried on ``model``; the first it accepts
    with an output that can fail a comparison (not every output 0: one sample through a final ReLU can be) is
    returned with that output, None when it takes no other shape (fixed sizes). ``model`` itself never runs: each
    candidate runs on a copy sharing its tensors."""
    tensors = [x for x in list(inputs.args) + list(inputs.kwargs.values()) if isinstance(x, torch.Tensor)]
    if not tensors or any(t.dim() == 0 for t in tensors):
        return None
    batch = tensors[0].shape[0]

    def seq_axis(t: torch.Tensor) -> bool:
        return (t.dim() == 2 and not t.is_floating_point() or t.dim() == 3 and t.is_floating_point()) and \
            t.shape[1] > 2

    def image(t: torch.Tensor) -> bool:
        return t.dim() == 4 and t.is_floating_point() and min(t.shape[2:]) >= 8

    def reshape(t: Any, new_batch: int, dl: int, spatial: bool) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != batch:
            return t
        size = list(t.shape)
        size[0] = new_batch
        if dl and seq_axis(t):
            size[1] += dl
        if spatial and image(t):
            size[2:] = [n - 32 if n >= 96 else n + 32 for n in size[2:]]
        index = [torch.arange(n) % m for n, m in zip(size, t.shape)]  # cycle the example's own values
        return t[torch.meshgrid(*index, indexing="ij")] if t.dim() else t

    has_seq = any(seq_axis(t) for t in tensors)
    other = 1 if batch > 1 else 2
    tries = ((other, -1), (other, 0), (batch, -1)) if has_seq else ((other, 0),)
    tries += ((batch + 1, 0),) if other != batch + 1 else ()
    if any(image(t) for t in tensors):  # another image size first, then the batch alone (fixed-size models)
        tries = tuple((b, dl, True) for b, dl in tries) + tuple((b, dl, False) for b, dl in tries)
    else:
        tries = tuple((b, dl, False) for b, dl in tries)
    for new_batch, dl, spatial in tries:
        alt = Inputs(tuple(reshape(x, new_batch, dl, spatial) for x in inputs.args),
                     {k: reshape(v, new_batch, dl, spatial) for k, v in inputs.kwargs.items()})
        try:
            # on a copy sharing the tensors: a forward may rewrite the module's own attributes for the shape it
            # sees (Swin shrinks its window to a smaller image), and the user's model must stay as it was
            out = run(clone_sharing_tensors(model), alt)
        except Exception:
            continue
        if output_leaves(out) and not all_zero(output_leaves(out)):
            return alt, out
    return None


def all_zero(leaves: list[tuple[str, torch.Tensor]]) -> bool:
    """Every leaf a float tensor of zeros: any rewrite would match it, so comparing it tests nothing."""
    return all(t.is_floating_point() for _, t in leaves) and not any(bool(t.detach().count_nonzero())
                                                                    for _, t in leaves)


def output_leaves(out: Any) -> list[tuple[str, torch.Tensor]]:
    """Flatten any output (tensor, tuple, dict, Hugging Face ModelOutput) to named tensor leaves."""
    if hasattr(out, "to_tuple") and hasattr(out, "keys"):  # transformers ModelOutput
        out = {k: out[k] for k in out.keys()}
    leaves, _ = tree_flatten_with_path(out)
    named = []
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            named.append((keystr(path).lstrip(".") or "output", leaf))
    return named


def argmax_agreement(ref: list, new: list) -> float | None:
    """Fraction of positions where argmax over the last dim agrees (float outputs with a last dim > 1)."""
    same = total = 0
    for (_, a), (_, b) in zip(ref, new):
        if a.is_floating_point() and a.dim() >= 1 and a.shape[-1] > 1 and a.shape == b.shape:
            same += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += a[..., 0].numel()
    return same / total if total else None


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return DEFAULT_TOLERANCE.get(dtype, DEFAULT_TOLERANCE[torch.float32])


def compare(reference: Any, candidate: Any, atol: float | None = None, rtol: float | None = None,
            label: str = "torch") -> Validation:
    """Compare two model outputs leaf by leaf; tolerances default from the reference's dtype."""
    ref, cand = output_leaves(reference), output_leaves(candidate)
    if not ref:  # a check that compared nothing is not a pass
        return Validation(max_abs_error=float("nan"), max_rel_error=float("nan"), atol=atol or 0.0,
                          rtol=rtol or 0.0, passed=False, cosine=float("nan"), outputs=(),
                          label=f"{label}: nothing compared (the model returned no tensor and changed no buffer)")
    if len(ref) != len(cand):
        raise ValueError(f"output structure changed: {len(ref)} tensors before, {len(cand)} after")
    floats = [t.dtype for _, t in ref if t.is_floating_point()]
    if all_zero(ref):
        # every output is 0 (a zero-initialized head): any rewrite would match, so nothing was compared
        return Validation(max_abs_error=float("nan"), max_rel_error=float("nan"), atol=atol or 0.0,
                          rtol=rtol or 0.0, passed=False, cosine=float("nan"), outputs=(),
                          label=f"{label}: nothing compared (every output is 0 on the example inputs, as with a "
                                f"zero-initialized head: no rewrite could fail this check)")
    d_atol, d_rtol = default_tolerance(floats[0] if floats else torch.float32)
    atol = d_atol if atol is None else atol
    rtol = d_rtol if rtol is None else rtol
    errs = [_leaf_error(name, r, c, atol, rtol) for (name, r), (_, c) in zip(ref, cand)]
    return Validation(
        max_abs_error=max((e.max_abs_error for e in errs), default=0.0),
        max_rel_error=max((e.max_rel_error for e in errs), default=0.0),
        atol=atol,
        rtol=rtol,
        passed=all(e.passed for e in errs),
        cosine=min((e.cosine for e in errs), default=1.0),
        outputs=tuple(errs),
        label=label,
    )


def _leaf_error(name: str, ref: torch.Tensor, cand: torch.Tensor, atol: float, rtol: float) -> OutputError:
    if ref.shape != cand.shape:
        return OutputError(name, float("inf"), float("inf"), 0.0, False)
    r = ref.detach().to("cpu", torch.float64)
    c = cand.detach().to("cpu", torch.float64)
    if r.numel() == 0:
        return OutputError(name, 0.0, 0.0, 1.0, True)
    diff = (r - c).abs()
    nan_mismatch = bool((r.isnan() != c.isnan()).any())
    diff = torch.where(r.isnan() & c.isnan(), torch.zeros_like(diff), diff)
    max_abs = float(diff.max())
    max_rel = float((diff / r.abs().clamp_min(atol if atol > 0 else 1e-30)).max())
    passed = (not nan_mismatch) and bool((diff <= atol + rtol * r.abs()).all()) and ref.dtype == cand.dtype
    denom = float(r.norm() * c.norm())
    cosine = float((r.flatten() @ c.flatten()) / denom) if denom > 0 else float(torch.equal(r, c))
    return OutputError(name, max_abs, max_rel, cosine, passed)


def verify(original: nn.Module, rewritten: nn.Module, inputs: Inputs, atol: float | None = None,
           rtol: float | None = None, reference_output: Any = None) -> Validation:
    """Run both models on ``inputs`` and compare; pass ``reference_output`` to reuse a computed one."""
    ref = run(original, inputs) if reference_output is None else reference_output
    return compare(ref, run(rewritten, inputs), atol, rtol)
