"""RMSNorm written out in primitive ops, fused into normconv's RMSNorm placeholder (lowered per target afterwards:
RMSNormalization at opset 23, SimplifiedLayerNormalization for onnxruntime, a function op below 23).

  RMS(x) = x / sqrt(E[x²] + ε) · w         over the normalized axes A (the last ones, or one inner axis)
  x² as Pow(x, 2) or Mul(x, x); 1/sqrt(·) as Div(x, Sqrt(·)), Mul(x, Reciprocal(Sqrt(·))) or Mul(x, Div(1, Sqrt(·)));
  E[·] as ``base.mean_of`` reads it. Casts around it (x upcast to float32, the result cast back) stay where they
  are: the fused op runs on the float32 value, so its statistics stay float32.

Scale tails fold in (w constant per normalized element; Gemma's 1 + w is a constant too):
  RMSNorm(x, s) · w  =>  RMSNorm(x, s·w)
"""

from __future__ import annotations

import numpy as np
from onnxscript.rewriter import pattern
from onnxscript.rewriter._basics import MatchResult

from normconv.onnx.ops import DOMAIN
from normconv.onnx.rules.base import (FLOATS, NormRule, SiteLog, closed, const, constant, describe, fed_by, layout,
                                      mean_of, normalize, per_feature, producers, rank, rank_up, scalar, square_of,
                                      untyped)
from normconv.report import Why


class RmsNormWhy(Why):
    FUSED = "fused-rmsnorm"
    NOT_FLOAT = "not-float"
    TYPE_UNKNOWN = "type-unknown"
    EPS_NOT_CONSTANT = "eps-not-constant"
    NOT_MEAN_SQUARE = "not-mean-square-of-input"
    AXES_NOT_FUSABLE = "axes-not-fusable"
    DYNAMIC_NORMALIZED = "dynamic-normalized-dims"
    INNER_VALUE_READ = "inner-value-read"
    RANK_UP = "constant-broadcasts-up-a-rank"


class RmsNormFusion(NormRule):
    """y = x / sqrt(E[x²] + ε)   =>   normconv.RMSNorm(x, 1; axes=A, epsilon=ε)."""

    kind = "rmsnorm"

    def pattern(self, op, x, ms, eps, one):
        root = op.Sqrt(op.Add(ms, eps))
        if self.options["form"] == "div":  # x / sqrt(E[x²] + ε)
            return op.Div(x, root)
        return op.Mul(x, pattern.OrValue([op.Reciprocal(root), op.Div(one, root)]))  # x · rsqrt(E[x²] + ε)

    def check(self, context, x, ms, eps, one=None, **_) -> MatchResult:
        W = RmsNormWhy
        self._anchor = context.root
        if x.dtype is None:
            return self.refuse(context, W.TYPE_UNKNOWN, untyped(context), x)
        if x.dtype not in FLOATS:
            return self.refuse(context, W.NOT_FLOAT, f"input is {x.dtype or 'of an unknown type'}, not a float type", x)
        m = mean_of(ms)
        if (one is not None and scalar(one) != 1.0) or m is None or square_of(m.source) is None:
            return MatchResult().fail("not x / sqrt(E[·²] + ε)")  # not RMS-shaped at all: no site
        e = scalar(eps)
        if e is None or e < 0:
            return self.refuse(context, W.EPS_NOT_CONSTANT, "epsilon is not a constant scalar >= 0", eps)
        if square_of(m.source) is not x:
            return self.refuse(context, W.NOT_MEAN_SQUARE, "what is under the sqrt is not the mean square of the "
                                                           "input", ms)
        where = layout(m.axes, rank(x))
        if where is None:
            return self.refuse(context, W.AXES_NOT_FUSABLE, f"normalizes axes {list(m.axes)} of a rank-{rank(x)} "
                                                            f"input: neither the last axes nor one axis", x)
        sizes = [x.shape[a] for a in m.axes]
        if not all(isinstance(s, int) for s in sizes):
            return self.refuse(context, W.DYNAMIC_NORMALIZED, f"normalized dims {sizes} are not static", x)
        nodes = list(context.nodes) + list(m.nodes) + [m.source.producer()] + producers(eps, {id(x)})
        up = rank_up(nodes, rank(x))
        if up is not None:  # the file's result has that constant's rank; the fused op's has x's
            return self.refuse(context, W.RANK_UP, f"a constant of shape {up[1]} broadcasts the rank-{rank(x)} "
                                                   f"input's result up to rank {len(up[1])}", up[0])
        if not closed(nodes, context.root):
            return self.refuse(context, W.INNER_VALUE_READ, "a value inside the norm is read outside it", x)
        self._fused = (where, sizes, e)
        return MatchResult()

    def rewrite(self, op, x, **_):
        where, sizes, eps = self._fused
        self.done(self._anchor, RmsNormWhy.FUSED, f"one RMSNorm over {describe(where, rank(x))} (eps {eps:g})",
                  eps=float(eps), shape="x".join(map(str, sizes)), fed_by=fed_by(x))
        n = len(sizes) if where[0] == "trailing" else 1

        def make(v, axis):
            return op.RMSNorm(v, constant(op, np.ones(sizes if where[0] == "trailing" else sizes[-1:]), x),
                              axes=list(range(-n, 0)), epsilon=eps, _domain=DOMAIN)
        return normalize(op, x, where, make)


class RmsNormScale(NormRule):
    """normconv.RMSNorm(x, s) · w  =>  normconv.RMSNorm(x, s·w)   (w constant per normalized element)."""

    kind = "rmsnorm"

    def pattern(self, op, y, w):
        return op.Mul(y, w)

    def check(self, context, y, w, **_) -> MatchResult:
        node = y.producer()
        if node is None or node.op_type != "RMSNorm" or node.domain != DOMAIN or len(y.uses()) != 1 \
                or y.is_graph_output():
            return MatchResult().fail("not an RMSNorm's only reader")
        axes = tuple(a % rank(y) for a in node.attributes["axes"].value)
        v, s = per_feature(const(w), y.shape, axes), const(node.inputs[1])
        if v is None or s is None or (w.dtype is not None and w.dtype != y.dtype):
            return MatchResult().fail("not a constant per normalized element")
        self._new = (node, s * v.reshape(s.shape))
        return MatchResult()

    def rewrite(self, op, y, **_):
        node, s = self._new
        x = node.inputs[0]
        return op.RMSNorm(x, constant(op, s, x), axes=list(node.attributes["axes"].value),
                          epsilon=node.attributes["epsilon"].value, _domain=DOMAIN)


def rules(log: SiteLog) -> list:
    return [RmsNormFusion.rule(f"rmsnorm-{f}", log, form=f) for f in ("div", "mul")] + \
        [RmsNormScale.rule("rmsnorm-scale", log)]
