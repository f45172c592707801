"""What torch's export leaves behind, repaired by the rules of ``rules/repair.py`` (below opset 18, its down-conversion:
Split-13's sizes as an input, Reduce*-13's axes as an attribute without noop_with_empty_axes; at any opset, an
RMSNormalization whose input and scale differ in type; a fused RotaryEmbedding whose caches have batch 1), as an
onnx-ir pass."""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from normconv.onnx.rules import repair


class RepairDownconverted(ir.passes.InPlacePass):
    """After the call, ``fixed`` names the nodes repaired."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.fixed: list[str] = []
        if any(n.op_type == "RMSNormalization" for n in ir.traversal.RecursiveGraphIterator(model.graph)):
            pattern.RewriteRuleSet(repair.typed_rules(self.fixed)).apply_to_model(model)
        if any(n.op_type == "RotaryEmbedding" and n.domain in ("", "ai.onnx")
               for n in ir.traversal.RecursiveGraphIterator(model.graph)):
            pattern.RewriteRuleSet(repair.rotary_rules(self.fixed)).apply_to_model(model)
        if model.opset_imports.get("", 18) < 18:
            pattern.RewriteRuleSet(repair.rules(self.fixed)).apply_to_model(model)
        return ir.passes.PassResult(model, bool(self.fixed))
