"""What torch's down-conversion to opset 17 leaves behind (no site of their own: a repair, not a decision).

  Split-13 takes the sizes as an input; with a static axis length L they are known:
    Split(x; num_outputs=n)                       =>  Split(x, [ceil(L/n)] * (n-1) + [rest])
  Reduce*-13 (but ReduceSum) take ``axes`` as an attribute and have no ``noop_with_empty_axes`` (T5's fp16
  ``isinf(x).any()`` came down as ReduceMax with it):
    ReduceX(x, [axes]; noop_with_empty_axes=0)    =>  ReduceX(x; axes=axes)      (no axes: every axis, as before)
Dynamic axes, a no-op reduction and a Split of a dynamic length stay as they are (the checker reports them).

At any opset, torch's exporter fuses a float32 RMSNorm that reads a float16 cast (--keep-fp32) into one
RMSNormalization-23 of the float16 input and the float32 scale: its schema types Y like the scale, onnx's shape
inference like X, so onnx.checker (full_check) rejects the file:
    RMSNormalization(x: T, s: V), T != V          =>  RMSNormalization(Cast(x, to=V), s)   (what torch computes)

At opset 23 torch's exporter fuses a Hugging Face rotary embedding (``q * cos + rotate_half(q) * sin``) into one
RotaryEmbedding-23 whose caches are computed from position_ids of batch 1, ``(1, S, D/2)``, which the pattern
broadcast over the batch. Without position_ids the op takes caches of X's batch, ``(B, S, D/2)``, and onnxruntime
refuses any other (a dynamic-batch Llama, Mistral, Qwen or Gemma file ran at batch 1 only). The caches are
broadcast to X's batch, the same values:
    RotaryEmbedding(x, cos, sin)                  =>  RotaryEmbedding(x, Expand(cos, [B] + shape(cos)[1:]), ...)
                                                      (B = shape(x)[0]; not where x's batch is 1 or the caches'
                                                      is known to be B)
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter._basics import MatchResult

from normconv.onnx.rules.base import const

# reductions that took ``axes`` as an input (and gained ``noop_with_empty_axes``) at opset 18
REDUCE_18 = ("ReduceMax", "ReduceMin", "ReduceMean", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
             "ReduceLogSumExp", "ReduceSumSquare")
MAX_SPLIT = 64  # a pattern has a fixed output count: one rule per count up to this


class _Repair(pattern.RewriteRuleClassBase):
    def __init__(self, name: str, fixed: list, **options) -> None:
        super().__init__(name)
        self.fixed, self.options = fixed, options

    def below_18(self, context) -> bool:
        return int(context.model.opset_imports.get("", 18)) < 18


class ReduceAxesAttribute(_Repair):
    """ReduceX(x, axes; noop_with_empty_axes)  =>  ReduceX(x; axes=[…])   (below opset 18)."""

    def pattern(self, op, x, axes):
        reduce = getattr(op, self.options["op_type"])
        if self.options["with_axes"]:
            return reduce(x, axes, _allow_other_attributes=True, _outputs=["y"])
        return reduce(x, _allow_other_attributes=True, _outputs=["y"])

    def check(self, context, x, y, axes=None, **_) -> MatchResult:
        node = y.producer()
        noop = int(node.attributes["noop_with_empty_axes"].value) if "noop_with_empty_axes" in node.attributes else 0
        if not self.below_18(context) or (axes is None and "noop_with_empty_axes" not in node.attributes):
            return MatchResult().fail("already the opset's form")
        if axes is not None and const(axes) is None:
            return MatchResult().fail("dynamic axes have no opset-13 form")
        if noop and axes is None:
            return MatchResult().fail("an identity by definition")
        return MatchResult()

    def rewrite(self, op, x, y, axes=None, **_):
        node = y.producer()
        self.fixed.append(node.name)
        attrs = {k: a.value for k, a in node.attributes.items() if k != "noop_with_empty_axes"}
        if axes is not None:
            attrs["axes"] = [int(a) for a in const(axes).reshape(-1)]
        return getattr(op, self.options["op_type"])(x, **attrs)


class SplitSizes(_Repair):
    """Split(x; num_outputs=n)  =>  Split(x, sizes)   (below opset 18, a static length along the axis)."""

    def pattern(self, op, x):
        return op.Split(x, _allow_other_attributes=True, _outputs=self.options["n"])

    def check(self, context, x, **_) -> MatchResult:
        node = context.root
        n = self.options["n"]
        if not self.below_18(context) or "num_outputs" not in node.attributes:
            return MatchResult().fail("already the opset's form")
        axis = int(node.attributes["axis"].value) if "axis" in node.attributes else 0
        length = x.shape[axis] if x.shape is not None else None
        if not isinstance(length, int):
            return MatchResult().fail("a dynamic length")
        chunk = -(-length // n)
        sizes = [chunk] * (length // chunk) + ([length % chunk] if length % chunk else [])
        if len(sizes) != n:
            return MatchResult().fail("sizes do not come out as n parts")
        self._new = (node, axis, sizes)
        return MatchResult()

    def rewrite(self, op, x, **_):
        node, axis, sizes = self._new
        self.fixed.append(node.name)
        attrs = {k: a.value for k, a in node.attributes.items() if k != "num_outputs"}
        sizes_value = op.Constant(value=ir.tensor(np.array(sizes, dtype=np.int64)))
        return op.Split(x, sizes_value, _outputs=len(sizes), **attrs)


class RmsInputType(_Repair):
    """RMSNormalization(x: T, s: V), T != V  =>  RMSNormalization(Cast(x, to=V), s)."""

    def pattern(self, op, x, s):
        return op.RMSNormalization(x, s, _allow_other_attributes=True, _outputs=["y"])

    def check(self, context, x, s, y, **_) -> MatchResult:
        if x.dtype is None or s.dtype is None or x.dtype == s.dtype:
            return MatchResult().fail("input and scale of one type")
        return MatchResult()

    def rewrite(self, op, x, s, y, **_):
        node = y.producer()
        self.fixed.append(node.name)
        return op.RMSNormalization(op.Cast(x, to=s.dtype), s, **{k: a.value for k, a in node.attributes.items()})


class RotaryCacheBatch(_Repair):
    """RotaryEmbedding(x, cos, sin)  =>  RotaryEmbedding(x, Expand(cos, [B, S, D/2]), Expand(sin, [B, S, D/2]))."""

    def pattern(self, op, x, cos, sin):  # three inputs: no position_ids, so the caches are (batch, seq, dim / 2)
        return op.RotaryEmbedding(x, cos, sin, _allow_other_attributes=True, _outputs=["y"])

    def check(self, context, x, cos, sin, y, **_) -> MatchResult:
        batch = x.shape[0] if x.shape is not None and len(x.shape) else None
        if batch == 1:
            return MatchResult().fail("x's batch is 1")
        if all(c.shape is not None and len(c.shape) == 3 and c.shape[0] == batch and batch is not None
               for c in (cos, sin)):
            return MatchResult().fail("the caches have x's batch")
        if all(c.producer() is not None and c.producer().op_type == "Expand" for c in (cos, sin)):
            return MatchResult().fail("the caches are broadcast already")
        return MatchResult()

    def rewrite(self, op, x, cos, sin, y, **_):
        node = y.producer()
        self.fixed.append(node.name)
        batch = op.Shape(x, start=0, end=1)
        cos_b = op.Expand(cos, op.Concat(batch, op.Shape(cos, start=1), axis=0))
        sin_b = op.Expand(sin, op.Concat(batch, op.Shape(sin, start=1), axis=0))
        return op.RotaryEmbedding(x, cos_b, sin_b, **{k: a.value for k, a in node.attributes.items()})


def typed_rules(fixed: list) -> list:
    """The repairs any opset may need (the type of a fused op's input)."""
    return [RmsInputType.rule("repair-rms-input-type", fixed)]


def rotary_rules(fixed: list) -> list:
    """The repair of a fused RotaryEmbedding's caches (opset 23)."""
    return [RotaryCacheBatch.rule("repair-rotary-cache-batch", fixed)]


def rules(fixed: list) -> list:
    return [ReduceAxesAttribute.rule(f"repair-{r}-{w}", fixed, op_type=r, with_axes=w)
            for r in REDUCE_18 for w in (True, False)] + \
        [SplitSizes.rule(f"repair-split-{n}", fixed, n=n) for n in range(2, MAX_SPLIT + 1)]
