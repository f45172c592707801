"""Skip-norm fusion for onnxruntime (--target ort): a residual add feeding a norm becomes one contrib op.

  s = a + b;  y = LayerNormalization(s, g, β)       =>  y, _, _, s = com.microsoft.SkipLayerNormalization(a, b, g, β)
  s = a + b;  y = SimplifiedLayerNormalization(s, g) =>  y, _, _, s = com.microsoft.SkipSimplifiedLayerNormalization(a, b, g)

The sum output (index 3) replaces the add's other uses (``expose_sums``), so a residual stream that continues
past the norm (pre-norm blocks) keeps its value. onnxruntime's kernel constraints, checked before fusing: input and
skip of rank 2 or 3 with the same shape and dtype, normalization over the last axis only, gamma (and beta) 1-D of
the hidden size, the norm's mean / inverse-std outputs unused.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter._basics import MatchResult

from normconv.onnx.ops import MS_DOMAIN
from normconv.onnx.rules.base import NormRule, SiteLog
from normconv.report import Why

_SKIP_OF = {"LayerNormalization": "SkipLayerNormalization",
            "SimplifiedLayerNormalization": "SkipSimplifiedLayerNormalization"}


class SkipWhy(Why):
    FUSED = "skip-fused"
    SELF_ADD = "add-of-itself"
    BROADCAST = "broadcast-add"
    RANK = "rank-not-2-or-3"
    DTYPE = "dtypes-differ"
    AXIS = "not-last-axis"
    PARAMS = "params-not-1d"
    STATS_READ = "stats-outputs-read"


def _dims(value: ir.Value) -> tuple | None:
    if value.shape is None:
        return None
    return tuple(d if isinstance(d, int) else str(d) for d in value.shape)


class SkipNormFusion(NormRule):
    """Norm(a + b, g[, β])  =>  Skip*Normalization(a, b, g[, β]), the sum exposed for its other readers."""

    kind = "skip"

    def pattern(self, op, a, b, g):
        s = op.Add(a, b, _outputs=["s"])
        return getattr(op, self.options["norm"])(s, g, _allow_other_inputs=True, _allow_other_attributes=True,
                                                 _outputs=["y"])

    def check(self, context, a, b, g, s, y, **_) -> MatchResult:
        W = SkipWhy
        norm = y.producer()
        self._anchor = norm
        if a is b:
            return self.refuse(context, W.SELF_ADD, "add of a value with itself")
        da, db = _dims(a), _dims(b)
        if da is None or db is None or da != db:
            return self.refuse(context, W.BROADCAST, f"add operands differ in shape ({da} vs {db}): a broadcast add")
        if len(da) not in (2, 3):
            return self.refuse(context, W.RANK, f"rank {len(da)} input (onnxruntime's kernel takes rank 2 or 3)")
        if a.dtype != b.dtype:
            return self.refuse(context, W.DTYPE, "add operands differ in dtype")
        axis = norm.attributes.get("axis")
        axis = axis.value if axis is not None else -1
        if axis not in (-1, len(da) - 1):
            return self.refuse(context, W.AXIS, f"normalizes from axis {axis}, the fused kernel only the last axis")
        for p in norm.inputs[1:3]:
            if p is not None and (p.shape is None or len(p.shape) != 1):
                return self.refuse(context, W.PARAMS, "scale or bias is not 1-D")
        if any(o.uses() for o in norm.outputs[1:]):
            return self.refuse(context, W.STATS_READ, "the norm's mean / inverse-std outputs are used")
        return MatchResult()

    def rewrite(self, op, a, b, g, s, y, **_):
        norm = y.producer()
        eps = norm.attributes.get("epsilon")
        inputs = [a, b, g] + ([norm.inputs[2]] if self.options["norm"] == "LayerNormalization" and
                              len(norm.inputs) > 2 and norm.inputs[2] is not None else [])
        others = [u for u in s.uses() if u.node is not norm] or s.is_graph_output()
        outs = getattr(op, _SKIP_OF[self.options["norm"]])(*inputs, epsilon=float(eps.value) if eps else 1e-5,
                                                           _domain=MS_DOMAIN, _outputs=4 if others else 1)
        out = outs[0] if others else outs
        if others:  # sum used beyond this norm  =>  expose it as output 3
            self.options["exposed"].append((s, outs[3]))
        self.done(norm, SkipWhy.FUSED, f"{s.producer().name or 'Add'} + {norm.op_type} -> {_SKIP_OF[norm.op_type]}"
                  + ("; sum exposed for its other uses" if others else ""))
        return out


def rules(log: SiteLog, exposed: list, pass_name: str) -> list:
    """One rule per norm op; fused adds whose sum is read elsewhere are appended to ``exposed`` (see expose_sums)."""
    return [SkipNormFusion.rule(f"skip-{norm}", log, norm=norm, exposed=exposed, pass_name=pass_name)
            for norm in _SKIP_OF]


def expose_sums(model: ir.Model, exposed: list) -> None:
    """Each fused add's other readers (and a graph output) read the Skip op's sum output instead; then the graph is
    sorted (a reader of the sum may sit between the add and the norm)."""
    for old, new in exposed:
        outputs = model.graph.outputs
        for i, v in enumerate(outputs):
            if v is old:
                new.name, old.name = old.name, None
                outputs[i] = new
        old.replace_all_uses_with(new)
    if exposed:
        ir.passes.common.RemoveUnusedNodesPass()(model)
        model.graph.sort()
    if any(n.domain == MS_DOMAIN for n in model.graph):
        model.opset_imports.setdefault(MS_DOMAIN, 1)
