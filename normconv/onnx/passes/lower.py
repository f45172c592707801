"""normconv's norm placeholders lowered to the target's ops (rules/lower.py), as an onnx-ir pass; a placeholder the
target has no op for stays, with its ONNX function body attached (onnx.ops.function_proto: runtimes inline it).

  normconv.RMSNorm    -> SimplifiedLayerNormalization (ort) | RMSNormalization (onnx, opset >= 23)
                         | normconv.RMSNorm with its function body (onnx, below 23)
  normconv.GroupNorm  -> GroupNormalization (opset >= 21) | normconv.GroupNorm with its function body
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from normconv.onnx.ops import DOMAIN, function_proto
from normconv.onnx.rules import lower


class LowerNorms(ir.passes.InPlacePass):
    """After the call, ``made`` counts what each placeholder became ('normconv.RMSNorm' where it stays)."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target
        self.made: dict[str, int] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.made = {}
        if not any(n.domain == DOMAIN for n in ir.traversal.RecursiveGraphIterator(model.graph)):
            model.opset_imports.pop(DOMAIN, None)
            return ir.passes.PassResult(model, False)
        pattern.RewriteRuleSet(lower.rules(self.target, self.made)).apply_to_model(model)
        kept = sorted({n.op_type for n in ir.traversal.RecursiveGraphIterator(model.graph) if n.domain == DOMAIN})
        for n in ir.traversal.RecursiveGraphIterator(model.graph):
            if n.domain == DOMAIN:
                self.made[f"{DOMAIN}.{n.op_type}"] = self.made.get(f"{DOMAIN}.{n.op_type}", 0) + 1
        for op_type in kept:  # no standard op at this opset  =>  keep normconv.<op>, attach its function body
            wide = any(n.domain == DOMAIN and n.op_type == op_type and n.inputs[0].dtype == ir.DataType.DOUBLE
                       for n in ir.traversal.RecursiveGraphIterator(model.graph))  # float64 computed in float64
            fn = ir.serde.deserialize_function(function_proto(op_type, model.opset_imports.get("", 18), wide))
            model.functions[fn.identifier()] = fn
        if kept:
            model.opset_imports[DOMAIN] = 1
        else:
            model.opset_imports.pop(DOMAIN, None)
        return ir.passes.PassResult(model, True)
