"""Norm-like code that is not a norm, listed with why and left as written (no false site).

  sqrt(a² + b²)              elementwise magnitude (an STFT's): no reduction over features
  sqrt(Σ x²), ReduceL2, LpNormalization   an L2 norm / L2 normalization: no mean, no ε, not a LayerNorm or RMSNorm
  sqrt(E[·]) elsewhere       a root of a reduction no norm rule reads (a standard deviation used otherwise)
A Sqrt inside a norm a rule already listed (fused or refused with its reason) is not listed again.
"""

from __future__ import annotations

from normconv.onnx.rules.base import SiteLog, default, mean_of, name_of, square_of
from normconv.report import Site, Why

PASS = "norm-like"


class NearMissWhy(Why):
    MAGNITUDE = "elementwise-magnitude"
    L2_NORM = "l2-norm"
    ROOT_OF_REDUCTION = "root-of-reduction"


def _is_square(v) -> bool:
    return square_of(v) is not None


def _reason(node) -> tuple[NearMissWhy, str] | None:
    if node.op_type in ("ReduceL2", "LpNormalization"):
        return NearMissWhy.L2_NORM, f"{node.op_type}: an L2 norm, no mean and no eps; left as written"
    if node.op_type != "Sqrt":
        return None
    src = node.inputs[0].producer() if node.inputs[0] is not None else None
    while src is not None and default(src) and src.op_type in ("Add", "Max", "Clip") and any(
            i is not None and i.const_value is not None for i in src.inputs):
        src = next(i for i in src.inputs if i is not None and i.const_value is None).producer()
    if src is None or not default(src):
        return None
    if src.op_type == "Add" and all(_is_square(i) for i in src.inputs):
        return NearMissWhy.MAGNITUDE, "sqrt(a² + b²): an elementwise magnitude (an STFT's), no reduction; not a norm"
    if src.op_type in ("ReduceSum", "ReduceSumSquare"):
        return NearMissWhy.L2_NORM, "sqrt of a sum of squares: an L2 norm, no mean; left as written"
    if mean_of(src.outputs[0]) is not None or src.op_type == "ReduceMean":
        return NearMissWhy.ROOT_OF_REDUCTION, ("sqrt of a mean that no norm rule reads as LayerNorm or RMSNorm "
                                               "(its result is not the input divided by it); left as written")
    return None


def list_near_misses(nodes, log: SiteLog) -> None:
    """Add a norm-like row for each Sqrt / L2 op in ``nodes`` that no rule listed (its reader not a logged site)."""
    for node in nodes:
        if not default(node):
            continue
        why = _reason(node)
        if why is None:
            continue
        readers = [u.node for o in node.outputs for u in o.uses()]
        near = readers + [u.node for r in readers for o in r.outputs for u in o.uses()]
        # a site is logged by its node's name, or by its output's where the node had none yet (named since)
        if any(name_of(r) in log.rows or r.outputs and r.outputs[0].name in log.rows for r in near):
            continue
        log.add("norm-like", Site(PASS, name_of(node), False, why[1], why[0]))
