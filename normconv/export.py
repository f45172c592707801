"""ONNX export with one fused op per norm (plan only in this module so far; the exporter builds on it).

  layernorm     -> LayerNormalization (opset >= 17)
  rmsnorm       -> RMSNormalization (opset >= 23) | SimplifiedLayerNormalization (--target ort)
                   | normconv.RMSNorm with an ONNX function body (opsets without a standard RMS op)
  groupnorm     -> GroupNormalization (opset >= 21)
  instancenorm  -> InstanceNormalization
  batchnorm     -> folded into its conv / linear, else BatchNormalization
  residual add feeding a norm (--target ort) -> SkipLayerNormalization / SkipSimplifiedLayerNormalization
"""

from __future__ import annotations

from typing import Sequence

from normconv.detect import NormSite
from normconv.graph import Captured
from normconv.report import Site

NAME = "export"

_OPS = {
    "layernorm": "LayerNormalization",
    "rmsnorm": "RMSNormalization (opset 23) / SimplifiedLayerNormalization (ort)",
    "groupnorm": "GroupNormalization",
    "instancenorm": "InstanceNormalization",
    "batchnorm": "BatchNormalization",
}


def plan(cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
    out = []
    for s in norms:
        op = _OPS[s.kind]
        if s.kind == "batchnorm":
            reason = "folded into its neighbour when fold applies, else one BatchNormalization"
        elif s.source == "handwritten":
            reason = f"one {op} after canonicalize (hand-written: {len(s.nodes)} ops otherwise)"
        else:
            reason = f"one {op}"
        if s.kind in ("layernorm", "rmsnorm") and s.placement in ("post-norm", "final-norm"):
            reason += "; residual add fuses into Skip" + ("Simplified" if s.kind == "rmsnorm" else "") + \
                      "LayerNormalization (--target ort)"
        out.append(Site(NAME, s.target, True, reason))
    return out
