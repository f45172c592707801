"""normconv's norm placeholders lowered to the target's op (no site of their own: the site is the norm's).

  normconv.RMSNorm(x, s; axes, ε),   --target ort              =>  SimplifiedLayerNormalization(x, s; axis, ε)
  normconv.RMSNorm(x, s; axes, ε),   --target onnx, opset ≥ 23  =>  RMSNormalization(x, s; axis, ε)
  normconv.GroupNorm(x, s, b; G, ε), opset ≥ 21                =>  GroupNormalization(x, s, b; G, ε)
  otherwise the placeholder stays and its ONNX function body is attached (passes/lower.py)
All with stash_type = 1: the statistics in float32 whatever the input's precision. An RMSNormalization whose input
and scale differ in type (float16 into a float32 norm) reads its input cast to the scale's type.
"""

from __future__ import annotations

from onnxscript.rewriter import pattern
from onnxscript.rewriter._basics import MatchResult

from normconv.onnx.ops import DOMAIN


class _Lower(pattern.RewriteRuleClassBase):
    def __init__(self, name: str, target: str, made: dict) -> None:
        super().__init__(name)
        self.target, self.made = target, made

    def opset(self, context) -> int:
        return int(context.model.opset_imports.get("", 1))


class LowerRms(_Lower):
    """normconv.RMSNorm  =>  SimplifiedLayerNormalization (ort) | RMSNormalization (onnx, opset ≥ 23)."""

    def pattern(self, op, x, s):
        return op.RMSNorm(x, s, _domain=DOMAIN, _allow_other_attributes=True, _outputs=["y"])

    def check(self, context, x, s, y, **_) -> MatchResult:
        if self.target != "ort" and self.opset(context) < 23:
            return MatchResult().fail("no standard RMSNormalization below opset 23: the function op stays")
        return MatchResult()

    def rewrite(self, op, x, s, y, **_):
        node = y.producer()
        attrs = dict(axis=int(node.attributes["axes"].value[0]), epsilon=float(node.attributes["epsilon"].value),
                     stash_type=1)
        made = "SimplifiedLayerNormalization" if self.target == "ort" else "RMSNormalization"
        self.made[made] = self.made.get(made, 0) + 1
        if made == "RMSNormalization" and x.dtype is not None and s.dtype is not None and x.dtype != s.dtype:
            # a float16 input to a float32 norm (--keep-fp32): the input cast to the scale's type, as torch computes
            # it (onnx's shape inference types Y like X, its schema like the scale: one type leaves no doubt)
            x = op.Cast(x, to=s.dtype)
        return getattr(op, made)(x, s, **attrs)


class LowerGroupNorm(_Lower):
    """normconv.GroupNorm  =>  GroupNormalization (opset ≥ 21, per-channel scale and bias)."""

    def pattern(self, op, x, s, b):
        return op.GroupNorm(x, s, b, _domain=DOMAIN, _allow_other_attributes=True, _outputs=["y"])

    def check(self, context, x, s, b, y, **_) -> MatchResult:
        if self.opset(context) < 21:
            return MatchResult().fail("no per-channel GroupNormalization below opset 21: the function op stays")
        return MatchResult()

    def rewrite(self, op, x, s, b, y, **_):
        node = y.producer()
        self.made["GroupNormalization"] = self.made.get("GroupNormalization", 0) + 1
        return op.GroupNormalization(x, s, b, num_groups=int(node.attributes["num_groups"].value),
                                     epsilon=float(node.attributes["epsilon"].value), stash_type=1)


def rules(target: str, made: dict) -> list:
    return [LowerRms.rule("lower-rmsnorm", target, made), LowerGroupNorm.rule("lower-groupnorm", target, made)]
