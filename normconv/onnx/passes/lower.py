"""normconv's norm placeholders lowered to the target's ops (``onnx.ops.lower_norm_ops``), as an onnx-ir pass.

  normconv.RMSNorm    -> SimplifiedLayerNormalization (ort) | RMSNormalization (onnx, opset >= 23)
                         | normconv.RMSNorm with its function body (onnx, below 23)
  normconv.GroupNorm  -> GroupNormalization (opset >= 21) | normconv.GroupNorm with its function body
"""

from __future__ import annotations

import onnx_ir as ir

from normconv.onnx.ops import lower_norm_ops


class LowerNorms(ir.passes.InPlacePass):
    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target
        self.made: dict[str, int] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.made = lower_norm_ops(model, self.target, model.opset_imports.get("", 1))
        return ir.passes.PassResult(model, bool(self.made))
