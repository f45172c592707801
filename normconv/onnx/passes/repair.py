"""What torch's down-conversion to opset 17 leaves behind, repaired (``onnx.ops.repair_downconverted``), as an
onnx-ir pass: Split-13's sizes as an input, Reduce*-13's axes as an attribute without noop_with_empty_axes."""

from __future__ import annotations

import onnx_ir as ir

from normconv.onnx.ops import repair_downconverted


class RepairDownconverted(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return ir.passes.PassResult(model, bool(repair_downconverted(model)))
