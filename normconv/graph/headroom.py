"""Half-precision headroom of each norm site, measured in float32 on example (or calibration) inputs.

Per site, from the norm's own input x recorded in float32:
  max_abs      max |x|
  max_square   the largest element the norm squares: x^2 (rmsnorm) or (x - mean)^2 (layer/group/instance norm)
  max_stat     the largest statistic it computes: mean(x^2) (rmsnorm) or the variance (batchnorm: its running var)
  max_out      max |y| of the site's output (module sites), max_param the largest |weight| / |bias|
  folded_weight  fold: max |W'| of the layer the BatchNorm folded into (W * gamma / sqrt(var + eps)), in the dtype
  margin_log2  log2(finfo(dtype).max / max(max_square, max_abs, max_stat)): powers of two left before overflow
               (computing the statistics in float32 removes max_square from the bound, not max_abs)
  eps_in_dtype eps rounded to the dtype (BERT's 1e-12 is 0 in float16: a constant row then divides by 0)
  folded_scale batchnorm: max |gamma / sqrt(var + eps)|, the factor a fold multiplies the conv weight by
  error      module sites: max |norm_dtype(x) - norm_fp32(x)| of the site's module run in the dtype
A site has headroom when margin_log2 >= 1 (a factor of 2 to spare), eps does not round to 0 and the folded
scale fits; otherwise ``reasons`` say why.

Which precision a site gets in a half export (``precision``): a fused norm op keeps its statistics and eps in
float32 (stash_type 1, a float attribute), so what it still computes in the dtype is its input, its parameters
and buffers (a BatchNorm's running var) and its output. The site runs in float32 between two Casts when
  (a) it stays decomposed ops (not canonicalized) and its squares overflow or its eps rounds to 0, or
  (b) a parameter or buffer it reads (running var, weight, bias) lies beyond the dtype's range;
an input or output beyond the range is flagged but not fixed by Casts around the norm (the value is produced,
or consumed, in the dtype).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from normconv import kinds
from normconv.graph.capture import Captured
from normconv.graph.detect import NormSite
from normconv.verify import forward_guard, run

HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
MIN_MARGIN_LOG2 = 1.0  # a site needs a factor of 2 below the dtype's max


def parse_dtype(name: str) -> torch.dtype:
    """'float16' / 'fp16' / 'half' / 'bfloat16' / 'bf16' -> the torch dtype; ValueError otherwise."""
    key = {"fp16": "float16", "half": "float16", "bf16": "bfloat16"}.get(name, name)
    if key not in HALF_DTYPES:
        raise ValueError(f"unknown half-precision dtype {name!r}; choose float16 or bfloat16")
    return HALF_DTYPES[key]


@dataclass
class Headroom:
    """What one norm site computes on the inputs, against a half dtype's range."""

    target: str
    kind: str
    dtype: str
    measured: bool = False
    max_abs: float | None = None
    max_square: float | None = None
    max_stat: float | None = None
    margin_log2: float | None = None
    eps: float | None = None
    eps_in_dtype: float | None = None
    folded_scale: float | None = None
    max_out: float | None = None
    max_param: float | None = None
    folded_into: str | None = None  # fold: the layer the BatchNorm folded into
    folded_weight: float | None = None  # fold: max |weight| of that layer after the fold, in the dtype
    error: float | None = None  # the site's module run in the dtype vs float32, on the same input
    ok: bool = True
    reasons: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


def _stats(site: NormSite, x: torch.Tensor) -> tuple[float, float]:
    """(largest squared element, largest statistic) the norm forms on x, in float64 (its kind knows which)."""
    return kinds.by_name(site.kind).statistics(site, x)


def _record(cap: Captured, norms: Sequence[NormSite], inputs) -> dict[str, list[tuple[torch.Tensor, Any]]]:
    """target -> [(input, output)] of each site on ``inputs``: hooks on module sites, an fx.Interpreter for
    inline sites of a symbolic_trace graph (inline sites of a torch.export graph are not measured)."""
    found: dict[str, list] = {}
    modules = {s.target for s in norms if s.target in cap.modules and (s.source != "handwritten"
                                                                       or s.target == s.owner)}
    inline = [s for s in norms if s.target not in modules]
    handles = []

    def hook(path):
        def fn(module, args, output):
            if args and isinstance(args[0], torch.Tensor) and len(found.setdefault(path, [])) < 8:
                found[path].append((args[0].detach().clone(), output))
        return fn

    for path in modules:
        handles.append(cap.modules[path].register_forward_hook(hook(path)))
    try:
        run(cap.model, inputs)
    finally:
        for h in handles:
            h.remove()
    if inline and cap.method == "symbolic_trace":
        want = {s.input: s.target for s in inline}
        values: dict[str, list] = {}

        class Recorder(fx.Interpreter):
            def run_node(self, n):
                v = super().run_node(n)
                if n.name in want and isinstance(v, torch.Tensor):
                    values.setdefault(want[n.name], []).append((v.detach().clone(), None))
                return v

        with forward_guard(cap.gm):
            Recorder(cap.gm).run(*copy.deepcopy(inputs.args))
        found.update(values)
    return found


def _site_error(module: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> float | None:
    """max |module_dtype(x) - module_fp32(x)| (inf when the dtype run is not finite)."""
    try:
        half = copy.deepcopy(module).to(dtype)
        with torch.no_grad():
            ref = module(x)
            got = half(x.to(dtype))
    except Exception:  # a module that does not run in the dtype on its own (mixed inputs): not measured
        return None
    if not isinstance(ref, torch.Tensor) or not isinstance(got, torch.Tensor) or got.shape != ref.shape:
        return None
    if not torch.isfinite(got).all():
        return math.inf
    return float((got.double() - ref.double()).abs().max())


def measure(cap: Captured, norms: Sequence[NormSite], dtype: torch.dtype, inputs=None) -> list[Headroom]:
    """Headroom of every site in ``dtype`` on ``inputs`` (default: the capture's example inputs), in float32.

    ``cap.model`` must compute in float32 (or wider); the model is run guarded and left unchanged."""
    inputs = cap.inputs if inputs is None else inputs
    finfo = torch.finfo(dtype)
    dt = str(dtype).removeprefix("torch.")
    recorded = _record(cap, norms, inputs)
    out = []
    for s in norms:
        h = Headroom(s.target, s.kind, dt, eps=s.eps)
        if s.eps is not None:
            h.eps_in_dtype = float(torch.tensor(s.eps, dtype=torch.float32).to(dtype).float())
            if s.eps > 0 and h.eps_in_dtype == 0.0:
                h.ok = False
                h.reasons.append(f"eps {s.eps:g} rounds to 0 in {dt} (a constant row divides by 0)")
        if s.kind == "batchnorm" and s.running_var:
            var, w = cap.tensor(s.running_var), cap.tensor(s.weight) if s.weight else None
            if var is not None:
                scale = (w.detach().double().reshape(-1) if w is not None else 1.0) / \
                    (var.detach().double().reshape(-1) + (s.eps or 0.0)).sqrt()
                h.folded_scale = float(scale.abs().max())
                if h.folded_scale > finfo.max / 2:
                    h.ok = False
                    h.reasons.append(f"folded scale gamma/sqrt(var+eps) {h.folded_scale:.3g} beyond {dt}'s range")
        params = [cap.tensor(n) for n in (s.weight, s.bias) if n]
        if any(p is not None for p in params):
            h.max_param = max(float(p.detach().abs().max()) for p in params if p is not None and p.numel())
            if h.max_param > finfo.max:
                h.ok = False
                h.reasons.append(f"a weight or bias reaches {h.max_param:.3g}, beyond {dt}'s max {finfo.max:.6g}")
        calls = recorded.get(s.target, [])
        if calls:
            h.measured = True
            h.max_abs = max(float(x.detach().abs().max()) for x, _ in calls)
            sq_stat = [_stats(s, x) for x, _ in calls]
            h.max_square = max(a for a, _ in sq_stat)
            h.max_stat = max(b for _, b in sq_stat)
            if s.kind == "batchnorm" and s.running_var and cap.tensor(s.running_var) is not None:
                h.max_stat = float(cap.tensor(s.running_var).detach().abs().max())  # eval BN reads its running var
            outs = [float(y.detach().abs().max()) for _, y in calls if isinstance(y, torch.Tensor) and y.numel()]
            h.max_out = max(outs) if outs else None
            peak = max(h.max_square, h.max_abs, h.max_stat)
            h.margin_log2 = math.log2(finfo.max / peak) if peak > 0 else math.inf
            if h.max_abs > finfo.max:
                h.ok = False
                h.reasons.append(f"input max |x| {h.max_abs:.3g} beyond {dt}'s max {finfo.max:.6g}")
            elif s.kind == "batchnorm" and h.max_stat > finfo.max / 2:
                h.ok = False
                h.reasons.append(f"running var reaches {h.max_stat:.3g}, beyond {dt}'s max {finfo.max:.6g}")
            elif h.margin_log2 < MIN_MARGIN_LOG2:
                what = "x^2" if s.kind == "rmsnorm" else "(x - mean)^2"
                h.ok = False
                h.reasons.append(f"{what} reaches {h.max_square:.3g} (max |x| {h.max_abs:.3g}), "
                                 f"{dt} max is {finfo.max:.6g}: statistics overflow unless computed in float32")
            if h.max_out is not None and h.max_out > finfo.max / 2:
                h.ok = False
                h.reasons.append(f"output max |y| {h.max_out:.3g} (scale * normalized) near or beyond {dt}'s max "
                                 f"{finfo.max:.6g}")
            module = cap.modules.get(s.target)
            if module is not None and s.target in cap.modules and s.target != "":
                h.error = max((e for e in (_site_error(module, x, dtype) for x, _ in calls[:2]) if e is not None),
                              default=None)
        else:
            h.reasons.append("not measured: the site did not run on the inputs, or is inline in a torch.export graph")
        out.append(h)
    return out


def check_folded_weight(h: Headroom, layer: str, weight: torch.Tensor) -> None:
    """Record the folded layer's largest |weight| in the dtype on ``h``; flag it when it is not finite or within a
    factor of 2 of the dtype's max (the conv's products then overflow)."""
    limit = float(torch.finfo(HALF_DTYPES[h.dtype]).max)
    h.folded_into, h.folded_weight = layer, float(weight.detach().float().abs().max())
    if not math.isfinite(h.folded_weight) or h.folded_weight > limit / 2:
        h.ok = False
        h.reasons.append(f"folded weight of {layer} reaches {h.folded_weight:.3g} in {h.dtype} (max {limit:.6g})")


def precision(h: Headroom, decomposed: bool, mode: str = "auto") -> tuple[bool, str]:
    """(run the site in float32 between Casts?, why) for a half export under ``--keep-fp32 mode``."""
    dt = h.dtype
    limit = float(torch.finfo(HALF_DTYPES[dt]).max)
    fixes = []
    if decomposed and h.max_square is not None and h.max_square > limit / 2:
        # decomposed ops square in the dtype  =>  float32 around them
        fixes.append(f"stays decomposed ops and {'x^2' if h.kind == 'rmsnorm' else '(x - mean)^2'} reaches "
                     f"{h.max_square:.3g}")
    if decomposed and h.eps and h.eps_in_dtype == 0.0:
        # eps added in the dtype rounds to 0  =>  float32 around the decomposed ops
        fixes.append(f"stays decomposed ops and eps {h.eps:g} rounds to 0 in {dt}")
    if h.kind == "batchnorm" and h.max_stat is not None and h.max_stat > limit / 2:
        # running var beyond the range is inf in the dtype  =>  the BatchNorm reads it in float32
        fixes.append(f"running var reaches {h.max_stat:.3g}")
    if h.max_param is not None and h.max_param > limit:
        # a weight / bias beyond the range is inf in the dtype  =>  kept in float32
        fixes.append(f"a weight or bias reaches {h.max_param:.3g}")
    unfixable = [r for r in h.reasons if r.startswith(("input max", "output max"))]
    after = ("; not fixed by Casts around the norm: " + "; ".join(unfixable)) if unfixable else ""
    if mode == "all":
        return True, f"float32 between Casts (--keep-fp32 all)" + after
    if mode == "none":
        return False, (f"{dt} (--keep-fp32 none) although " + "; ".join(fixes) if fixes else
                       f"{dt} (--keep-fp32 none)") + after
    if fixes:
        return True, f"float32 between Casts: " + "; ".join(fixes) + f" (beyond {dt}'s max {limit:.6g})" + after
    if not h.measured:
        return False, f"{dt}: headroom not measured (the site did not run as a module on the example inputs)"
    if decomposed:
        return False, f"{dt} (decomposed ops): margin 2^{h.margin_log2:.1f} below {dt}'s max" + after
    # statistics in float32 inside the fused op: what runs in the dtype is its input, output and buffers
    peak = max(v for v in (h.max_abs, h.max_out, h.max_stat if h.kind == "batchnorm" else 0.0) if v is not None)
    room = math.log2(limit / peak) if peak > 0 else math.inf
    return False, f"{dt} (statistics and eps in float32 inside the fused op): margin 2^{room:.1f}" + after


__all__ = ["Headroom", "measure", "precision", "check_folded_weight", "parse_dtype", "HALF_DTYPES", "MIN_MARGIN_LOG2"]
