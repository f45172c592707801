"""A rule set applied to a model, every site it looked at recorded (onnx-ir pass).

The rule set is onnxscript's ``RewriteRuleSet``: it walks the main graph, every If / Loop / Scan subgraph and
every ONNX function, tries the rules on each node in order, rewrites at the first match and drops the nodes the
rewrites left dead. Each rule logs the sites it fused or refused (``rules.base.SiteLog``); the result's
``sites`` are those rows, ``counts`` how many of each kind were applied.
"""

from __future__ import annotations

import collections

import onnx_ir as ir
from onnxscript.rewriter import pattern

from normconv.onnx.rules import base


class RulesPass(ir.passes.InPlacePass):
    """Apply ``rules`` (built with ``log``) in place; ``self.log`` holds every site afterwards."""

    def __init__(self, rules: list, log: base.SiteLog, name: str) -> None:
        super().__init__()
        self.rules, self.log, self.name = rules, log, name

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        count = pattern.RewriteRuleSet(self.rules, commute=True).apply_to_model(model) if self.rules else 0
        return ir.passes.PassResult(model, bool(count))

    def counts(self) -> dict[str, int]:
        return dict(collections.Counter(kind for kind, s in self.log.sites() if s.applied))
