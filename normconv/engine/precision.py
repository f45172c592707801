"""The half-precision policy, in one place: what a float16 / bfloat16 rewrite is measured against and when it passes.

- The reference is always the float32 model (a model given in half: its weights upcast); the half model as given
  is measured beside it, as information.
- A check in half precision uses the dtype's tolerances (``verify.default_tolerance``) unless the user set them.
- A half export may miss the element-wise default only as the plain cast of the model does (``rounding_limited``):
  finite, no more than HALF_SLACK x the cast's error, every output aligned with float32's (cosine); the budget then
  becomes HALF_SLACK x that error. An overflowing model (cosine far from 1) is refused.
- A half fold missing the element-wise check against the half model as given is judged the same way against the
  float32 model (``against_float32``).
- Each norm site of a half export runs in the half dtype or in float32 between Casts, by its measured headroom
  (``graph.headroom.precision``, ``--keep-fp32 auto | none | all``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import torch

from normconv.errors import NormconvError
from normconv.graph.capture import Captured
from normconv.graph.detect import NormSite
from normconv.report import Report, Site, Validation

KEEP_FP32 = ("auto", "none", "all")
HALF = (torch.float16, torch.bfloat16)
HALF_SLACK = 1.5  # a half export may be this much further from float32 than the plain cast of the model
HALF_MIN_COSINE = {torch.float16: 0.999, torch.bfloat16: 0.99}  # ~4.5% / 14% relative RMS error; below: not rounding


def half_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """float16 / bfloat16 when the model computes in it (its floating parameters are that dtype), else None."""
    dts = {p.dtype for p in list(model.parameters()) + list(model.buffers()) if p.is_floating_point()}
    return next(iter(dts)) if len(dts) == 1 and dts <= set(HALF) else None


def upcast(model: torch.nn.Module) -> torch.nn.Module:
    """The float32 model of a half one: a copy with its floating weights upcast. A graph (an exported program's
    module, a traced GraphModule) has its half dtype written into its nodes (``_assert_tensor_metadata(x,
    dtype=float16)``, ``aten.to(x, float16)``): the copy's nodes say float32 there, as the eager model's
    ``x.to(h.dtype)`` reads float32 once upcast, so it takes float32 inputs and computes in float32 throughout."""
    import copy

    half = half_dtype(model)
    wide = copy.deepcopy(model).float()
    if half is not None:
        _retype(wide, half, torch.float32, lambda node: True, mark=half)
    return wide


def downcast(model32: torch.nn.Module, half: torch.dtype) -> torch.nn.Module:
    """A copy of a float32 model (``upcast``'s, rewritten) in ``half``: the graph nodes ``upcast`` wrote float32 into
    say ``half`` again; a float32 the half model itself wrote (an upcast around a softmax, a norm) stays."""
    import copy

    narrow = copy.deepcopy(model32).to(half)
    _retype(narrow, torch.float32, half, lambda node: node.meta.get(_UPCAST) is half)
    return narrow


_UPCAST = "normconv_upcast_from"  # node.meta: the half dtype ``upcast`` replaced in this node's arguments


def _retype(model: torch.nn.Module, old: torch.dtype, new: torch.dtype, which: Any,
            mark: torch.dtype | None = None) -> None:
    """In every graph of ``model``, the dtype constant ``old`` in the arguments of the nodes ``which`` accepts made
    ``new`` (the nodes changed get ``mark`` in their meta when given)."""
    import torch.fx as fx

    hits: list[bool] = []

    def swap(a: Any) -> Any:
        if a is old:
            hits.append(True)
            return new
        return a

    for gm in model.modules():
        if not isinstance(gm, fx.GraphModule):
            continue
        changed = False
        for node in gm.graph.nodes:
            if not which(node):
                continue
            hits.clear()
            args, kwargs = fx.node.map_aggregate(node.args, swap), fx.node.map_aggregate(node.kwargs, swap)
            if hits:
                node.args, node.kwargs, changed = args, kwargs, True
                if mark is not None:
                    node.meta[_UPCAST] = mark
        if changed:
            gm.recompile()


def target_half(dtype: torch.dtype | None, model: torch.nn.Module) -> torch.dtype | None:
    """The half dtype a command works in: the one asked for (``--dtype``), else the model's own, else None."""
    return dtype if dtype in HALF else half_dtype(model)


def dtype_label(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def run_cast(model: torch.nn.Module, inputs: Any, half: torch.dtype, what: str) -> Any:
    """The output of ``model``, cast to ``half`` by ``--dtype``, on ``inputs`` (cast too). A forward that fails there
    is the user's model failing under the cast, said in one line (exit 2), naming the floating tensors its modules keep
    as plain attributes (d2l's hand-written BatchNorm keeps its running statistics so): ``.to(half)`` casts parameters
    and buffers only, so those stay float32 and meet half tensors in the forward."""
    from normconv.errors import describe
    from normconv.verify import run

    try:
        return run(model, inputs)
    except NormconvError:  # normconv's own refusal before the forward: as it is
        raise
    except Exception as exc:  # noqa: BLE001 - the model's own forward (a dtype mismatch, a kernel missing in half)
        stray = uncast_attributes(model, half)
        why = (f"; {', '.join(stray[:3])}{' ...' if len(stray) > 3 else ''} "
               f"{'is a floating tensor' if len(stray) == 1 else 'are floating tensors'} kept as plain attributes, "
               f"which the cast does not reach (register_buffer makes them buffers)") if stray else ""
        raise NormconvError(f"{what} fails when cast to {dtype_label(half)} (--dtype): {describe(exc)}{why}") from None


def uncast_attributes(model: torch.nn.Module, half: torch.dtype) -> list[str]:
    """The floating tensors ``model``'s modules hold as plain attributes (no parameter, no buffer) in another dtype
    than ``half``: what ``model.to(half)`` leaves as it was. Their dotted names and dtypes."""
    return [f"{prefix + '.' if prefix else ''}{name} ({dtype_label(v.dtype)})" for prefix, m in model.named_modules()
            for name, v in vars(m).items()
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != half]


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """Every floating tensor in a nested output cast to ``dtype``."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, value)


def cast_like(value: Any, like: Any) -> Any:
    """Each floating tensor of ``value`` in the dtype of the matching tensor of ``like`` (same structure)."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten(value)
    others, _ = tree_flatten(like)
    if len(others) != len(leaves):
        return value
    return tree_unflatten([a.to(b.dtype) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                           and a.is_floating_point() and b.is_floating_point() else a
                           for a, b in zip(leaves, others)], spec)


def rounding_limited(ours: Validation, plain: Validation, half: torch.dtype) -> bool:
    """normconv's half model misses the elementwise tolerance only as the plain cast does: finite, its error no
    larger than HALF_SLACK x the cast's, and every output still aligned with float32's (cosine). An overflowing
    model (zoo:fp16_overflow without its float32 norms: cosine -0.17) is refused."""
    finite = all(math.isfinite(o.max_abs_error) for o in ours.outputs) and math.isfinite(ours.max_abs_error)
    return (finite and ours.max_abs_error <= HALF_SLACK * plain.max_abs_error
            and ours.cosine >= HALF_MIN_COSINE.get(half, 0.999))


def against_float32(checks: Sequence[Validation], model32: torch.nn.Module, half_model: torch.nn.Module,
                    expected: Sequence[tuple[Any, Any]], half: torch.dtype, notes: list[str]) -> list[Validation]:
    """A half rewrite's checks (element-wise against the half model as given, at each shape of ``expected``: (inputs,
    the half original's outputs)) where one misses, judged as the README says: against the float32 model, which it
    may miss only as the plain cast of the model does (``rounding_limited``). A check the cast's own rounding
    explains passes, with its budget (HALF_SLACK x that error) and a note; any other stays as it was."""
    from normconv.verify import compare, run

    out = []
    for v, (inputs, given) in zip(checks, expected):
        if v.passed or v.drift:
            out.append(v)
            continue
        ref = run(model32, inputs.to(torch.float32))
        ours = compare(ref, cast_floats(run(half_model, inputs), torch.float32), v.atol, v.rtol,
                       label=f"{v.label}, against the float32 model")
        plain = compare(ref, cast_floats(given, torch.float32), v.atol, v.rtol)
        if not rounding_limited(ours, plain, half):
            out.append(v)
            continue
        budget = HALF_SLACK * plain.max_abs_error
        notes.append(f"{dtype_label(half)}: the model cast to {dtype_label(half)} is itself {plain.max_abs_error:.3g} "
                     f"from float32 ({inputs.describe()}); the rewrite's {ours.max_abs_error:.3g} is no worse "
                     f"(budget {HALF_SLACK:g}x the cast's error; --atol/--rtol set the element-wise check yourself)")
        out.append(dataclasses.replace(ours, passed=True, atol=budget))
    return out + list(checks[len(expected):])


def either_holds(vs_half: Sequence[Validation], vs32: Sequence[Validation]) -> list[Validation]:
    """Each shape holds when within tolerance of the half model as given or of the float32 model; the other
    comparison is then information (drift): e.g. the half original overflows where a native norm does not."""
    judged = []
    for v, w in zip(vs_half, vs32):
        judged.append(v if v.passed or not w.passed else _as_drift(v))
        judged.append(w if w.passed or not v.passed else _as_drift(w))
    return judged + list(vs_half[len(vs32):]) + list(vs32[len(vs_half):])


def _as_drift(v: Validation) -> Validation:
    return dataclasses.replace(v, drift=True)


def site_precisions(cap: Captured, norms: list[NormSite], half: torch.dtype, mode: str,
                    canon: dict[str, tuple[bool, str]] | None, folds: dict[str, tuple[bool, str]] | None,
                    report: Report, wide: dict[str, str]) -> list[Site]:
    """Per norm site of a half export: float32 between Casts or the half dtype, and why (``--keep-fp32``), from the
    headroom measured on the float32 copy ``cap``; fills ``wide`` (module path -> why) and the report's headroom."""
    from normconv.graph.headroom import measure, precision

    rooms = measure(cap, norms, half)
    report.extra["headroom"] = headroom_extra(rooms, half, cap.inputs.describe())
    out = []
    for s, h in zip(norms, rooms):
        if s.kind == "batchnorm" and (folds or {}).get(s.target, (False, ""))[0]:
            out.append(Site("export:precision", s.target, False, "folded into its neighbour: no norm op left",
                            "folded"))
            continue
        decomposed = s.source == "handwritten" and not (canon or {}).get(s.target, (False, ""))[0]
        keep, why = precision(h, decomposed, mode)
        module = s.target in cap.modules and s.target != "" and (s.source != "handwritten" or s.target == s.owner)
        code = "float32" if keep else dtype_label(half)
        if keep and not module:  # an inline / functional site has no module to run in float32
            keep, why = False, (f"{dtype_label(half)}: written inline (node {s.node}), no module to "
                                f"run in float32 (wanted: {why})")
            code = "inline-no-module"
        if keep:
            wide[s.target] = why
        out.append(Site("export:precision", s.target, keep, why, code))
    return out


def headroom_extra(rooms: list, dtype: torch.dtype, inputs: str) -> dict[str, Any]:
    """The headroom block of a report's extra (inspect, export, fold)."""
    return {"dtype": dtype_label(dtype), "inputs": inputs, "sites": [h.to_json() for h in rooms],
            "without_headroom": [h.target for h in rooms if not h.ok]}


def check_keep_fp32(keep_fp32: str, half: torch.dtype | None) -> None:
    if keep_fp32 not in KEEP_FP32:
        raise NormconvError(f"unknown --keep-fp32 {keep_fp32!r}; choose {', '.join(KEEP_FP32)}")
    if half is None and keep_fp32 != "auto":
        raise NormconvError("--keep-fp32 chooses norm precisions in a half export: give --dtype float16 or bfloat16")


__all__ = ["KEEP_FP32", "HALF", "HALF_SLACK", "HALF_MIN_COSINE", "half_dtype", "upcast", "downcast", "target_half",
           "cast_floats",
           "cast_like", "rounding_limited", "against_float32", "either_holds", "site_precisions", "headroom_extra", "check_keep_fp32",
           "dtype_label"]
