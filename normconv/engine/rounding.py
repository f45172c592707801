"""The original model's own float32 rounding, measured: its float32 outputs against the same model evaluated in
float64 on the same inputs, the float32 run's discrete selections replayed (``normconv.selections``).

The check by the output's scale (``verify``) holds an exact rewrite to 2^10 units of roundoff of each output's
scale, derived for well-conditioned computations. A model whose outputs amplify rounding errs by more than that in
float32 whatever is done to it: a detector's box decoding (exp of regressions), RoIAlign sampled at box
coordinates, masks pasted at them, a level chosen by log2 of a box's size. torchvision's Faster R-CNN R50-FPN errs
against float64 by 4.9e-5 of its scores' scale (820 u) and by 8.4e-4 of its RoI level's input
(benchmarks/results/detector_rounding.md). An exact rewrite is another float32 evaluation of the same real
function, so it differs from the original by about the sum of the two evaluations' errors, the rewrite's own up to
about three times the original's (its folded or centered weights add a rounding to every product they change;
measured: 2.2x on Faster R-CNN's RPN scores, 85,050 of them):

  floor(output leaf) = OWN_FACTOR x max |original_float32 - original_float64|          OWN_FACTOR = 4
  floor(an input of a selection call) = OWN_FACTOR x r(op, input) x the call's scale, where r is the largest
      max |float32 - float64| / scale over every call of that op at that input (an NMS of one box says little alone)

The door measures it only for a check the fixed bound failed (one float64 copy of the original, a forward per shape) and
judges each leaf by max(the fixed bound, its floor); the report says so. A real error stays refused: it is a change
of the real function, which the float64 run does not make (a fold wrong by 1e-3 of the output's scale is still 16x
over the fixed bound on a well-conditioned model, whose own error is 1e-6 of its scale; tests/test_rounding.py
plants one on an ill-conditioned model too). Not measured (None, the fixed bound stands): a model with any
non-float32 floating parameter or buffer, one over ``BUDGET_BYTES`` (the float64 copy is twice its size), or one
that does not run in float64.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from normconv.verify import Inputs, Traced, output_leaves, run

OWN_FACTOR = 4.0  # both evaluations err; the rewrite's up to about 3x the original's (the docstring)
BUDGET_BYTES = 2 ** 28  # the largest float32 model measured (its float64 copy takes twice that; the door keeps
# such a model's original intact through the passes, copy-on-write, so that it can be measured after them)


def measurable(model: nn.Module) -> bool:
    """Its own rounding can be measured: every floating tensor float32, BUDGET_BYTES in all at most."""
    tensors = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
    return all(t.dtype == torch.float32 for t in tensors) and \
        sum(t.numel() * t.element_size() for t in tensors) <= BUDGET_BYTES


def widened(model: nn.Module) -> nn.Module | None:
    """A float64 copy of ``model`` (the user's model untouched), or None where it cannot be measured."""
    if not measurable(model):
        return None
    try:
        return copy.deepcopy(model).double()
    except Exception:  # noqa: BLE001 - a model that does not copy: not measured, the fixed bound stands
        return None


def own_rounding(model: nn.Module, inputs: Inputs, reference: Any) -> dict[str, float] | None:
    """``floors`` of ``model`` itself (its float64 copy made here); None where it cannot be measured."""
    wide = widened(model)
    return None if wide is None else floors(wide, inputs, reference)


def floors(wide: nn.Module, inputs: Inputs, reference: Any) -> dict[str, float] | None:
    """Per output leaf of ``reference`` (the original's float32 output on ``inputs``, ``Traced`` where it selects)
    and per floating input of each selection: the floor OWN_FACTOR x max |float32 - float64| of the original, by the
    names ``verify.compare`` gives them (its ``floors``), ``wide`` being its float64 copy (``widened``); None where
    it does not run in float64 (module docstring)."""
    wide_inputs = Inputs(*tree_map(_wide, (tuple(inputs.args), dict(inputs.kwargs))))
    try:
        out = run(wide, wide_inputs, replay=reference)
    except Exception:  # noqa: BLE001 - an op with no float64 kernel: not measured, the fixed bound stands
        return None
    found = {name: OWN_FACTOR * _worst(r, c) for (name, r), (_, c) in
             zip(output_leaves(reference), output_leaves(out)) if r.is_floating_point() and r.shape == c.shape}
    if isinstance(reference, Traced) and isinstance(out, Traced):
        picked: list[tuple[str, str, float]] = []  # (name, the op and input it is one call of, its scale)
        relative: dict[str, float] = {}  # per op and input: the largest own error relative to the call's scale
        for k, a, b in out.trace.pairs(reference.trace):
            if a.inputs is None or b.inputs is None:
                break
            for i, (x, y) in enumerate(zip(a.inputs, b.inputs)):
                if x.is_floating_point() and x.shape == y.shape and x.numel():
                    group, scale = f"{a.op} input {i}", float(x.detach().abs().nan_to_num(0, 0, 0).max())
                    picked.append((f"{reference.trace.describe(k)} input {i}", group, scale))
                    if scale > 0:
                        relative[group] = max(relative.get(group, 0.0), _worst(x, y) / scale)
        # one call's few elements (an NMS of one box) say little: each call gets its op's rate, at its own scale
        found.update({name: OWN_FACTOR * relative.get(group, 0.0) * scale for name, group, scale in picked})
    return found


def _wide(x: Any) -> Any:
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _worst(a: torch.Tensor, b: torch.Tensor) -> float:
    if not a.numel():
        return 0.0
    d = (a.detach().double() - b.detach().double()).abs()
    return float(torch.where(torch.isfinite(d), d, torch.zeros_like(d)).max())


__all__ = ["own_rounding", "widened", "floors", "measurable", "OWN_FACTOR", "BUDGET_BYTES"]
