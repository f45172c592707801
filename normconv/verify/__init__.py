"""Run the original and the rewritten model on the same inputs and measure how far apart they are.

Per output leaf ``a`` (rewritten) against ``b`` (reference), computed in float64:
  max_abs_error = max |a - b|
  max_rel_error = max |a - b| / max(|b|, atol)   (relative where the reference is above the noise floor)
  scale         = max |b| over the leaf's finite values (the largest finite |value| of the whole output when the
                  leaf is all zeros)
  scale_error   = max_abs_error / scale;  rms_error = |a - b| / |b|;  cosine = <a, b> / (|a| |b|)

The verdict of an exact rewrite, by default (no atol / rtol given), for float32 and float64 outputs:
  passed = scale_error <= SCALE_ULPS x u(dtype), NaN and infinities in the same places, shapes and dtypes equal
with u the unit roundoff (2^-24 for float32, 2^-53 for float64) and SCALE_ULPS = 2^10, i.e. 6.1e-5 of the output's
scale in float32 (1.1e-13 in float64). Why this bound:

- An exact rewrite computes the same real function with other roundings: a BatchNorm folded into the conv
  (``(W s) x`` instead of ``s (W x)``), a mean subtracted from the weights instead of the activations, a rotation
  and its inverse multiplied into neighbouring weights. Each float32 evaluation errs from the real value, and the
  two differ by at most the sum of both errors (a factor 2).
- A reduction of n terms rounds to within ~sqrt(n) u of the scale of its terms (the probabilistic bound of Higham
  and Mary 2019; the worst case n u is not met by real data). n <= 2^12 covers a 3x3 conv over 512 channels (4608)
  and a 4096-wide Linear: a factor 2^6.
- Layers in sequence add their rounding errors, each carried to the output about in proportion to the output's
  scale (a normalized layer keeps relative errors; an unnormalized one scales errors and values alike: MobileOne's
  outputs of 4e14 carry errors of 11 u of them). Independent errors of L <= 64 such layers add to sqrt(L) <= 2^3.
- 2 x 2^6 x 2^3 = 2^10 units of roundoff. Measured (benchmarks/coverage_vision.py, errors in u = 2^-24 of each
  output's scale): 2 to 25 u over 15 timm / torchvision models: RepVGG-A0 8, MobileOne-S0 6, Inception-v3 10 (55
  with torchvision's own initialization, outputs of 4e8), ResNet-18 12, ViT-tiny's swap 11, Faster R-CNN 25; the
  element-wise check (1e-4) refused the first three, whose outputs reach 7e3 to 4e14. The bound is 40x above the
  largest. A real error is larger: a fold wrong by 1e-3 of the output's scale is 16x over the bound
  (tests/test_proof_scale.py plants one), and a tiny output (scale 1e-6) is held to 6e-11, where atol 1e-4
  passed anything.

The scale is the output's, not each element's: an element near zero of an output with large elements carries the
rounding of the large terms that summed to it, which no element-wise rtol allows for (what refused RepVGG).
The price: an error confined to elements far below the output's largest (one channel of a feature map whose
other channels are 1e4 larger) is judged against the largest; give --atol / --rtol for the element-wise check.

Given tolerances (``atol`` or ``rtol`` not None: ``--atol`` / ``--rtol``, or a caller's own) are honoured as given:
every element within atol + rtol |b|, NaN where the reference is NaN (torch.allclose, equal_nan). Half-precision outputs (float16, bfloat16) keep their
element-wise defaults (DEFAULT_TOLERANCE): their rounding x 2^10 would pass a real error (0.5 in float16), and
the commands judge a half model against its float32 computation with budgets of their own. Integer and bool
outputs must be equal.

Squashed outputs (``Squashed``): an output a squashing op made (a sigmoid's probabilities, a softmax, a tanh)
carries its input's error shrunk by the op's slope, not scaled with its own values: a detector's sigmoid map on
random inputs peaks at 1e-4 while its logits reach 41, and the logits' rounding (7 u of their scale, measured on
PaddleOCR's det model) is 5e5 u of the map's scale. Where the caller knows the op and hands both sides' inputs of
it, the input is judged by its own scale and the output by what it carries: |ds| <= L x bound x scale(input) +
bound x scale(output), L the op's Lipschitz constant in the max norm (sigmoid 1/4, softmax 1/2, tanh 1).

Discrete selections (NMS, top-k, a threshold, argmax; ``normconv.selections``): a rewrite's rounding may flip
them, and the outputs after them then differ by whole elements. A reference taken with ``run(..., trace=True)``
(``with_selections`` does it where the output holds an integer or bool tensor) records each selection; the
rewritten model run with ``run(..., replay=reference)`` takes the original's selections, so its outputs are
compared element by element with the same picks; the selections' own inputs are compared too, and the report names
the selections that flipped.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten_with_path

from normconv.errors import NormconvError
from normconv.verify.guard import forward_guard
from normconv.report import OutputError, Validation
from normconv.selections import Recorder, Trace, selects

# documented defaults: exact passes are float reassociation only, so fp32 stays within these
DEFAULT_TOLERANCE = {torch.float64: (1e-9, 1e-7), torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2),
                     torch.bfloat16: (5e-2, 5e-2)}
SCALE_ULPS = 2.0 ** 10  # units of roundoff an exact rewrite may differ by, relative to each output's scale (above)
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}
_CHUNK = 1 << 16  # elements of a leaf compared at once (512 KB a float64 copy; GPT-2's logits: 25 chunks)


@dataclass
class Squashed:
    """An output made by a squashing op (module docstring): the op, its Lipschitz constant in the max norm, and its
    input in the reference and in the candidate."""

    op: str
    lipschitz: float
    reference: torch.Tensor
    candidate: torch.Tensor


@dataclass
class Inputs:
    """Example inputs of a model: positional and keyword arguments of its forward."""

    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def to(self, *a, **kw) -> "Inputs":
        def move(x):  # only floating tensors change dtype; ids and masks keep theirs
            if not isinstance(x, torch.Tensor):
                return x
            return x.to(*a, **kw) if x.is_floating_point() else x.to(device=kw["device"]) if "device" in kw else x

        return Inputs(tuple(move(x) for x in self.args), {k: move(v) for k, v in self.kwargs.items()})

    def describe(self) -> str:
        def one(x):  # tensors by shape and dtype, inside lists, tuples and dicts too (a detector's list of images)
            if isinstance(x, torch.Tensor):
                return f"{tuple(x.shape)}:{str(x.dtype).removeprefix('torch.')}"
            if isinstance(x, (list, tuple)):
                inner = ", ".join(one(v) for v in x[:4]) + (f", ... {len(x)} in all" if len(x) > 4 else "")
                return f"[{inner}]" if isinstance(x, list) else f"({inner}{',' if len(x) == 1 else ''})"
            if isinstance(x, dict):
                return "{" + ", ".join(f"{k!r}: {one(v)}" for k, v in list(x.items())[:4]) + \
                    (", ..." if len(x) > 4 else "") + "}"
            text = repr(x)
            return text if len(text) <= 60 else text[:57] + "..."

        parts = [one(x) for x in self.args] + [f"{k}={one(v)}" for k, v in self.kwargs.items()]
        return ", ".join(parts)


def positive(inputs: Inputs) -> Inputs:
    """``inputs``, refused (NormconvError, exit 2) where a tensor among them has a dimension of size 0, as
    ``--input-shape`` refuses one: an empty example computes nothing to compare and has no second shape, wherever
    it came from (a factory, a pickle's carried example, the API)."""
    from torch.utils._pytree import tree_leaves

    for x in tree_leaves((tuple(inputs.args), dict(inputs.kwargs))):
        if isinstance(x, torch.Tensor) and 0 in x.shape:
            raise NormconvError(f"bad example inputs ({inputs.describe()}): dimensions must be positive")
    return inputs


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, NaN where NaN, in the same shape and dtype: one computation run twice."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@dataclass
class Traced:
    """A forward's output with the discrete selections it made (``run(..., trace=True)``)."""

    output: Any
    trace: Trace


def untraced(out: Any) -> Any:
    """The output itself, whether or not it was traced."""
    return out.output if isinstance(out, Traced) else out


def run(model: nn.Module, inputs: Inputs, *, trace: bool = False, replay: Any = None, training: bool = False) -> Any:
    """One guarded forward (``forward_guard``) on a copy of the inputs: a model that mutates its inputs or its
    buffers stays comparable and unchanged. A model whose output holds no tensor (it writes into buffers) is
    judged by what it wrote: the changed buffers, by name. Random ops draw the same numbers in every such forward
    (``same_draws``).

    ``trace``: return a ``Traced`` (the output and the forward's discrete selections). ``replay``: a ``Traced``
    reference (anything else is ignored): this forward takes its selections (``normconv.selections``) and returns a
    ``Traced`` saying which of its own would have differed. ``training``: the forward in training mode (dropout on,
    batch statistics), its changes undone as any other's."""
    recorder = Recorder(replay.trace) if isinstance(replay, Traced) else Recorder() if trace else None
    with forward_guard(model, training) as guard, same_draws(model), (recorder or contextlib.nullcontext()):
        out = model(*copy.deepcopy(inputs.args), **copy.deepcopy(inputs.kwargs))
    if not output_leaves(out) and guard.mutated:
        out = {f"buffer {k}": v for k, v in sorted(guard.mutated.items())}
    return Traced(out, recorder.trace) if recorder is not None else out


def with_selections(model: nn.Module, inputs: Inputs, output: Any) -> Any:
    """``output`` (the model's on ``inputs``), traced by one more forward where it holds an integer or bool tensor
    (the mark of a discrete selection: labels, indices, a mask), so that a rewrite is judged with its selections
    replayed; otherwise ``output`` itself."""
    if isinstance(output, Traced) or not selects(output_leaves(output)):
        return output
    return run(model, inputs, trace=True)


def _cuda_devices(model: nn.Module) -> list[int]:
    if not torch.cuda.is_initialized():  # no tensor is on a CUDA device before CUDA is initialized
        return []
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


def _other_side(n: int) -> int:
    """An image side moved by 2^k = the largest power of two dividing n (at most 32): n = 2^k m (m odd) and n + 2^k
    = 2^k (m + 1), n - 2^k = 2^k (m - 1) are multiples of 2^k again, so a model whose strides the example fits
    takes the new side too."""
    step = min(32, n & -n)
    return n - step if n >= 96 else n + step


@dataclass(frozen=True)
class _Try:
    """One candidate of ``other_shape``: the batch, a sequence's length moved by ``seq``, a conv signal's length
    moved by -1 (``signal``), image sides moved (``spatial``)."""

    batch: int
    seq: int = 0
    signal: bool = False
    spatial: bool = False


def other_shape(model: nn.Module, inputs: Inputs) -> tuple[Inputs, Any] | None:
    """The same inputs at a second shape where the model's dimensions are free: batch 1 (2 when the example's is
    1; batch 1 is where batch-dependent code differs most), for sequences ((B, L) ids and masks, (B, L, C)
    activations) length - 1, for a conv's signal ((B, C, L) floats whose dim 1 is fixed) L - 1, and for images
    ((B, C, H, W) floats, sides from 4) H and W each moved by the largest power of two
    that divides it, at most 32 (smaller from 96 up, larger below: 224 -> 192, 32 -> 64, 8 -> 16), so every stride
    the example's size fits, the new size fits too, at the least extra work for a small example, then batch + 1.
    Each candidate is tried on ``model``; the first it accepts with an output that can fail a comparison (not
    every output 0: one sample through a final ReLU can be) is returned with that output (``with_selections``:
    traced where it holds an integer or bool tensor), None when it takes no other shape (fixed sizes). Each candidate runs guarded (``run``): ``model`` is left as it was."""
    tensors = [x for x in list(inputs.args) + list(inputs.kwargs.values()) if isinstance(x, torch.Tensor)]
    if not tensors or any(t.dim() == 0 for t in tensors):
        return None
    batch = tensors[0].shape[0]

    def seq_axis(t: torch.Tensor) -> bool:
        return (t.dim() == 2 and not t.is_floating_point() or t.dim() == 3 and t.is_floating_point()) and \
            t.shape[1] > 2

    def image(t: torch.Tensor) -> bool:
        return t.dim() == 4 and t.is_floating_point() and min(t.shape[2:]) >= 4

    def signal(t: torch.Tensor) -> bool:  # (batch, channels, length): a conv's 1-D input, its length the free axis
        return t.dim() == 3 and t.is_floating_point() and t.shape[2] > 2

    def reshape(t: Any, c: _Try) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != batch:
            return t
        size = list(t.shape)
        size[0] = c.batch
        if c.signal and signal(t):
            size[2] -= 1
        elif c.seq and seq_axis(t):
            size[1] += c.seq
        if c.spatial and image(t):
            size[2:] = [_other_side(n) for n in size[2:]]
        index = [torch.arange(n) % m for n, m in zip(size, t.shape)]  # cycle the example's own values
        return t[torch.meshgrid(*index, indexing="ij")] if t.dim() else t

    has_seq = any(seq_axis(t) for t in tensors)
    other = 1 if batch > 1 else 2
    # (B, C, L) floats: a sequence's length is dim 1, a conv's is dim 2 (signal): each tried before the batch alone
    tries = [_Try(other, seq=-1)] if has_seq else []
    tries += [_Try(other, signal=True)] if any(signal(t) for t in tensors) else []
    tries += [_Try(other)] + ([_Try(batch, seq=-1)] if has_seq else [])
    tries += [_Try(batch + 1)] if other != batch + 1 else []
    if any(image(t) for t in tensors):  # another image size first, then the batch alone (fixed-size models)
        tries = [replace(c, spatial=True) for c in tries] + tries
    for c in tries:
        alt = Inputs(tuple(reshape(x, c) for x in inputs.args), {k: reshape(v, c) for k, v in inputs.kwargs.items()})
        try:
            # guarded (``run``): a forward may rewrite the module's own attributes for the shape it sees (Swin
            # shrinks its window to a smaller image); forward_guard puts them back, as for the example's forward
            out = run(model, alt)
        except Exception:
            continue
        if output_leaves(out) and not all_zero(output_leaves(out)):
            return alt, with_selections(model, alt, out)
    return None


def all_zero(leaves: list[tuple[str, torch.Tensor]]) -> bool:
    """Every leaf a float tensor of zeros: any rewrite would match it, so comparing it tests nothing."""
    return all(t.is_floating_point() for _, t in leaves) and not any(bool(t.detach().count_nonzero())
                                                                    for _, t in leaves)


def none_finite(leaves: list[tuple[str, torch.Tensor]]) -> bool:
    """Every leaf a float tensor with no finite value (a half model that overflows to NaN / inf everywhere): the
    rule NaN-for-NaN would pass any rewrite that also overflows, so comparing it tests nothing."""
    return bool(leaves) and all(t.is_floating_point() and not bool(torch.isfinite(t.detach()).any())
                                for _, t in leaves)


def output_leaves(out: Any) -> list[tuple[str, torch.Tensor]]:
    """Flatten any output (tensor, tuple, dict, Hugging Face ModelOutput, a ``Traced`` one) to named tensor
    leaves."""
    out = untraced(out)
    if hasattr(out, "to_tuple") and hasattr(out, "keys"):  # transformers ModelOutput
        out = {k: out[k] for k in out.keys()}
    leaves, _ = tree_flatten_with_path(out)
    named = []
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            named.append((leaf_name(path), leaf))
    return named


def leaf_name(path: tuple) -> str:
    """A readable name for a pytree path: ``logits``, ``0``, ``hidden_states.3`` (``output`` for the root)."""
    parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
    return ".".join(parts) or "output"


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


def scale_tolerance(dtype: torch.dtype) -> float | None:
    """The default bound on an output's error relative to its scale (module docstring), None where the dtype is
    judged element-wise (half precision)."""
    u = UNIT_ROUNDOFF.get(dtype)
    return None if u is None else SCALE_ULPS * u


def compare(reference: Any, candidate: Any, atol: float | None = None, rtol: float | None = None,
            label: str = "torch", squashed: dict[str, Squashed] | None = None,
            floors: dict[str, float] | None = None) -> Validation:
    """Compare two model outputs leaf by leaf (module docstring): relative to each output's scale unless
    ``atol`` / ``rtol`` are given (then element-wise; a missing one defaults from the reference's dtype). A
    ``Traced`` reference with a candidate that replayed it (``run(..., replay=reference)``) is judged with the
    original's selections, and the selections' inputs are compared too. ``squashed``: outputs (by leaf name) a
    squashing op made, judged through its input where the rule is the scale's. ``floors``: per leaf (and selection
    input) name, an absolute error the original's own float32 rounding allows (``engine.rounding``)."""
    ref, cand = output_leaves(reference), output_leaves(candidate)

    def nothing_compared(why: str) -> Validation:  # a check that compared nothing is not a pass
        return Validation(max_abs_error=float("nan"), max_rel_error=float("nan"), atol=atol or 0.0,
                          rtol=rtol or 0.0, passed=False, cosine=float("nan"), outputs=(),
                          label=f"{label}: nothing compared ({why})")

    if not ref:
        return nothing_compared("the model returned no tensor and changed no buffer")
    if len(ref) != len(cand):
        raise ValueError(f"output structure changed: {len(ref)} tensors before, {len(cand)} after")
    floats = [t.dtype for _, t in ref if t.is_floating_point()]
    if all_zero(ref):  # a zero-initialized head: any rewrite would match
        return nothing_compared("every output is 0 on the example inputs, as with a zero-initialized head: no "
                                "rewrite could fail this check")
    if none_finite(ref):  # NaN for NaN: any rewrite that overflows too would match
        return nothing_compared(f"every output of the reference is NaN or infinite on these inputs: it overflows in "
                                f"{str(floats[0]).removeprefix('torch.')}; run it in float32, or give inputs it "
                                f"computes on")
    by_scale = atol is None and rtol is None
    d_atol, d_rtol = default_tolerance(floats[0] if floats else torch.float32)
    atol = d_atol if atol is None else atol
    rtol = d_rtol if rtol is None else rtol
    scales = [_scale(t) if t.is_floating_point() else float("nan") for _, t in ref]  # one pass over each leaf
    whole = max((s for s in scales if not math.isnan(s)), default=0.0)
    floors = floors or {}
    errs = [_leaf_error(name, r, c, atol, rtol, by_scale, whole, scale, floors.get(name))
            for (name, r), (_, c), scale in zip(ref, cand, scales)]
    if by_scale and squashed:
        errs = [_through(e, squashed[e.name], r.dtype == c.dtype) if e.name in squashed and
                math.isfinite(e.tolerance) else e for e, (_, r), (_, c) in zip(errs, ref, cand)]
    if isinstance(reference, Traced) and isinstance(candidate, Traced):
        errs, label = _with_selections(errs, reference.trace, candidate.trace, atol, rtol, by_scale, label, floors)
    ruled = [e for e in errs if math.isfinite(e.tolerance)]
    return Validation(
        max_abs_error=max((e.max_abs_error for e in errs), default=0.0),
        max_rel_error=max((e.max_rel_error for e in errs), default=0.0),
        atol=atol,
        rtol=rtol,
        passed=all(e.passed for e in errs),
        cosine=min((e.cosine for e in errs), default=1.0),
        outputs=tuple(errs),
        label=label,
        rule="scale" if ruled else "elementwise",
        scale_tolerance=max((e.tolerance for e in ruled if e.name not in (squashed or {})),
                            default=SCALE_ULPS * UNIT_ROUNDOFF[torch.float32] if ruled else float("nan")),
        max_scale_error=max((e.scale_error for e in errs if not math.isnan(e.scale_error)), default=float("nan")),
        rounding=", ".join(sorted({str(r.dtype).removeprefix("torch.") for (n, r), e in zip(ref, errs)
                                   if math.isfinite(e.tolerance) and r.is_floating_point()}) or {"float32"}),
    )


def _scale(t: torch.Tensor) -> float:
    """The largest finite |value| of a floating tensor (0 when it has none)."""
    a = t.detach().abs()
    if a.numel() and not math.isfinite(float(a.max())):  # a NaN or an infinity: only then select the finite (a copy)
        a = a[torch.isfinite(a)]
    return float(a.max()) if a.numel() else 0.0


def _leaf_error(name: str, ref: torch.Tensor, cand: torch.Tensor, atol: float, rtol: float, by_scale: bool = False,
                whole: float = 0.0, scale: float | None = None, floor: float | None = None) -> OutputError:
    """One leaf's errors and verdict: relative to its scale where ``by_scale`` and its dtype has a bound
    (``scale_tolerance``), else element-wise; ``whole``: the scale of an all-zero leaf (the output's largest);
    ``scale``: ``_scale(ref)`` when the caller has it."""
    if ref.shape != cand.shape:
        return OutputError(name, float("inf"), float("inf"), 0.0, False, note=f"shape {tuple(cand.shape)}, "
                                                                                f"expected {tuple(ref.shape)}")
    if ref.numel() == 0:
        return OutputError(name, 0.0, 0.0, 1.0, ref.dtype == cand.dtype, scale=0.0, scale_error=0.0, rms_error=0.0)
    # in float64 a chunk at a time (GPT-2's 2 x 16 x 50257 logits whole: 80 MB of temporaries), in numpy: a small
    # leaf's dozen element-wise steps cost a microsecond each there, ten in torch's dispatcher
    maxima, sums, mismatch, within, equal = [], np.zeros(4), False, True, True
    with np.errstate(all="ignore"):  # inf - inf, 0 / 0: NaN by design, judged below
        for r, c in zip(ref.detach().reshape(-1).split(_CHUNK), cand.detach().reshape(-1).split(_CHUNK)):
            r, c = r.to("cpu", torch.float64).numpy(), c.to("cpu", torch.float64).numpy()
            same = (r == c) | (np.isnan(r) & np.isnan(c))  # equal inf / NaN: no difference
            diff = np.where(same, 0.0, np.abs(r - c))
            finite = np.isfinite(diff)
            mismatch = mismatch or not finite.all()  # a NaN or an infinity on one side only
            ra = np.abs(r)
            maxima.append((diff.max(), (diff / np.maximum(ra, atol if atol > 0 else 1e-30)).max()))
            fr, fc, fd = (np.where(np.isfinite(t), t, 0.0) for t in (r, c, diff))
            # einsum, not BLAS's dot: BLAS's own threads would fight torch's for the cores
            sums += [np.einsum("i,i->", a, b) for a, b in ((fr, fr), (fc, fc), (fr, fc), (fd, fd))]
            within = within and bool(((diff <= atol + rtol * ra) | same).all())  # NaN for NaN: within
            equal = equal and bool((r == c).all())
    max_abs, max_rel = (float(v) for v in np.max(maxima, axis=0))  # a NaN anywhere stays NaN
    rr, cc, rc, dd = (float(v) for v in sums)
    cosine = rc / (math.sqrt(rr) * math.sqrt(cc)) if rr > 0 and cc > 0 else float(equal)
    rms = math.sqrt(dd) / math.sqrt(rr) if rr > 0 else (0.0 if max_abs == 0 else float("inf"))
    scale = (_scale(ref) if scale is None else scale) if ref.is_floating_point() else float("nan")
    scale = whole if scale == 0.0 and ref.is_floating_point() else scale
    scale_error = (max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))) \
        if ref.is_floating_point() else float("nan")
    bound = scale_tolerance(ref.dtype) if by_scale and ref.is_floating_point() else None
    raised = bound is not None and floor is not None and scale > 0 and floor / scale > bound
    bound = floor / scale if raised else bound  # the original's own float32 rounding, where larger (a floor)
    if not ref.is_floating_point() and not ref.is_complex():
        passed = bool(torch.equal(ref, cand))  # labels, indices, masks: equal or not
    elif bound is not None:
        passed = not mismatch and scale_error <= bound
    else:
        passed = not mismatch and within
    passed = passed and ref.dtype == cand.dtype
    return OutputError(name, max_abs, max_rel, cosine, passed, scale=scale, scale_error=scale_error, rms_error=rms,
                       tolerance=float("nan") if bound is None else bound,
                       note="bound: the original's own float32 error (a float64 run)" if raised else "")


def _through(out: OutputError, sq: Squashed, same_dtype: bool) -> OutputError:
    """An output judged through the squashing op that made it (module docstring): its input within the scale
    bound, the output within what that input's error can carry through the op plus its own rounding."""
    pre = _leaf_error(f"{out.name} ({sq.op} input)", sq.reference, sq.candidate, 0.0, 0.0, by_scale=True)
    if not math.isfinite(pre.tolerance) or out.scale <= 0 or not math.isfinite(out.max_abs_error):
        return out
    carried = sq.lipschitz * pre.tolerance * pre.scale + out.tolerance * out.scale  # the bound on |ds|
    return replace(out, passed=same_dtype and pre.passed and out.max_abs_error <= carried, tolerance=carried / out.scale,
                   note=f"judged through its {sq.op}: the input's error is {pre.scale_error:.2g} of its scale "
                        f"{pre.scale:.3g} (bound {pre.tolerance:.2g})")


def _with_selections(errs: list[OutputError], ref: Trace, cand: Trace, atol: float, rtol: float, by_scale: bool,
                     label: str, floors: dict[str, float]) -> tuple[list[OutputError], str]:
    """The outputs of a forward that replayed the original's selections, plus one entry for the selections' own
    floating inputs (each within the same rule as an output): a flip is within rounding only if its inputs are.
    The label names the selections that flipped and where a replay stopped matching the original's ops."""
    said = []
    if cand.flipped:
        said.append(f"{len(cand.flipped)} of {len(cand.picks)} discrete selections differed "
                    f"({', '.join(cand.describe(k) for k in cand.flipped[:3])}{', ...' if len(cand.flipped) > 3 else ''})"
                    f": compared with the original's selections replayed")
    if cand.lost is not None:
        said.append(f"the rewritten forward's ops stopped matching the original's at {cand.describe(cand.lost)}: "
                    f"nothing after it was replayed")
    inputs = []
    for k, a, b in cand.pairs(ref):
        if a.inputs is None or b.inputs is None:
            break
        whole = max((_scale(t) for t in a.inputs), default=0.0)
        inputs += [_leaf_error(f"{ref.describe(k)} input {i}", x, y, atol, rtol, by_scale, whole,
                               floor=floors.get(f"{ref.describe(k)} input {i}"))
                   for i, (x, y) in enumerate(zip(a.inputs, b.inputs))]
    if inputs:
        worst = max(inputs, key=lambda e: (not e.passed, e.scale_error if not math.isnan(e.scale_error) else 0.0))
        name = f"inputs of {min(len(ref.picks), len(cand.picks))} discrete selections"
        errs = errs + [replace(worst, name=name, passed=all(e.passed for e in inputs),
                               note=f"worst: {worst.name}" + ("" if not ref.truncated else
                                                               "; past the memory budget inputs were not kept"))]
    if cand.flipped:
        errs = [replace(e, note=e.note or "with the original's selections") for e in errs]
    return errs, label + (f" ({'; '.join(said)})" if said else "")
