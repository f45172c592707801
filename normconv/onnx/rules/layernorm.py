"""LayerNorm written out in primitive ops, fused into one LayerNormalization (opset 17+).

  LN(x) = (x − E[x]) / sqrt(Var[x] + ε) · w + b      over the normalized axes A (the last ones; or one inner axis,
                                                       moved last by a Transpose each side)
  Var[x] = E[(x − E[x])²]                   torch, paddle2onnx, keras (Pow or Mul for the square; torch.var's
                                             x − E[x] may be computed a second time)
         = max(E[x²] − E[x]², 0)            tf2onnx / jax2tf (flax: mean2 − mean², clamped)
  1/sqrt(·) as Div(d, Sqrt(·)), Mul(d, Reciprocal(Sqrt(·))) or Mul(d, Div(1, Sqrt(·))) (ε = 0: the exporter
  drops the + 0, so Sqrt(Var) alone); flax multiplies the
  scale into the inverse first: d · (rsqrt(v + ε) · w). E[·] is read by ``base.mean_of`` (ReduceMean, or ReduceSum
  times 1/n, then put back to rank by Reshape / Unsqueeze / Expand).

Affine tails fold into the fused op (w, b constants that vary only along A):
  LayerNormalization(x, s, c) · w  =>  LayerNormalization(x, s·w, c·w)
  LayerNormalization(x, s, c) + b  =>  LayerNormalization(x, s, c + b)
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter._basics import MatchResult

from normconv.onnx.rules.base import (FLOATS, NormRule, SiteLog, closed, const, constant, default, describe, fed_by, layout,
                                      mean_of, normalize, per_feature, producers, rank, rank_up, restored, scalar,
                                      square_of, untyped)
from normconv.report import Why

OPSET = 17  # LayerNormalization's first opset


class LayerNormWhy(Why):
    FUSED = "fused-layernorm"
    SCALE_FOLDED = "affine-folded"
    NOT_FLOAT = "not-float"
    TYPE_UNKNOWN = "type-unknown"
    EPS_NOT_CONSTANT = "eps-not-constant"
    MEAN_NOT_OF_INPUT = "mean-not-of-input"
    VARIANCE_NOT_OF_INPUT = "variance-not-of-input"
    AXES_DIFFER = "axes-differ"
    AXES_NOT_FUSABLE = "axes-not-fusable"
    DYNAMIC_NORMALIZED = "dynamic-normalized-dims"
    SCALE_NOT_PER_FEATURE = "scale-not-per-feature"
    INNER_VALUE_READ = "inner-value-read"
    RANK_UP = "constant-broadcasts-up-a-rank"
    RANK_UNKNOWN = "rank-unknown"
    OPSET_BELOW = "opset-below-17"


def _mean_of_unranked(v: ir.Value, x: ir.Value) -> bool:
    """``v`` is ReduceMean(x) (put back to rank or not) over an ``x`` whose rank is unknown: ``mean_of`` cannot
    read its axes, so nothing tells a LayerNorm from another mean."""
    inner, _ = restored(v)
    node = inner.producer() if inner is not None else None
    return node is not None and default(node) and node.op_type == "ReduceMean" and node.inputs[0] is x and \
        rank(x) is None


def opset_of(context) -> int:
    imports = context.graph_or_function.opset_imports if hasattr(context.graph_or_function, "opset_imports") else {}
    return int(imports.get("", context.model.opset_imports.get("", 1)))


def _root(op, var, eps, no_eps: bool):
    """sqrt(var + ε); sqrt(var) where the exporter dropped a + 0 (ε = 0)."""
    return op.Sqrt(var) if no_eps else op.Sqrt(op.Add(var, eps))


def _inverse_root(op, var, eps, one, no_eps: bool):
    """1 / sqrt(var + ε), as Reciprocal(Sqrt(·)) or Div(1, Sqrt(·))."""
    root = _root(op, var, eps, no_eps)
    return pattern.OrValue([op.Reciprocal(root), op.Div(one, root)])


def variance_nodes(v: ir.Value, x: ir.Value, mean: ir.Value, axes: tuple[int, ...]) -> list[ir.Node] | None:
    """The nodes computing ``v`` = Var[x] over ``axes`` (module docstring), else None."""
    inner, back = restored(v)
    node = inner.producer() if inner is not None else None
    m = mean_of(v)
    if m is not None and m.axes == axes:  # E[(x − E[x])²]
        d = square_of(m.source)
        sub = d.producer() if d is not None else None
        if sub is not None and sub.op_type == "Sub" and default(sub) and sub.inputs[0] is x:
            m2 = mean_of(sub.inputs[1])
            if sub.inputs[1] is mean or (m2 is not None and m2.source is x and m2.axes == axes):
                extra = list(m2.nodes) if sub.inputs[1] is not mean else []
                return list(m.nodes) + [m.source.producer(), sub] + extra
        return None
    clamp = None
    if node is not None and node.op_type in ("Max", "Relu") and default(node):  # max(·, 0)
        if node.op_type == "Max":
            rest = [i for i in node.inputs if scalar(i) != 0.0]
            if len(rest) != 1:
                return None
            inner = rest[0]
        else:
            inner = node.inputs[0]
        clamp, node = node, inner.producer()
    if node is None or node.op_type != "Sub" or not default(node):
        return None
    ex2, msq = mean_of(node.inputs[0], reduced=True), node.inputs[1]
    m2 = square_of(msq)
    if ex2 is None or ex2.axes != axes or square_of(ex2.source) is not x or m2 is None:
        return None
    mm = mean_of(m2, reduced=True)
    if m2 is not mean and (mm is None or mm.source is not x or mm.axes != axes):
        return None
    nodes = back + ([clamp] if clamp else []) + [node, msq.producer(), ex2.source.producer(), *ex2.nodes]
    return nodes + (list(mm.nodes) if m2 is not mean else [])


class LayerNormFusion(NormRule):
    """d = x − E[x];  y = d / sqrt(Var[x] + ε)  [· w]   =>   LayerNormalization(x, w or 1, 0)."""

    kind = "layernorm"

    def pattern(self, op, x, mean, var, eps, one, w):
        d, no_eps = op.Sub(x, mean), self.options["no_eps"]
        if self.options["form"] == "div":  # d / sqrt(v + ε)
            return op.Div(d, _root(op, var, eps, no_eps))
        if self.options["form"] == "mul":  # d · rsqrt(v + ε)
            return op.Mul(d, _inverse_root(op, var, eps, one, no_eps))
        return op.Mul(d, op.Mul(_inverse_root(op, var, eps, one, no_eps), w))  # d · (rsqrt(v + ε) · w)   (flax)

    def check(self, context, x, mean, var, eps, one=None, w=None, **_) -> MatchResult:
        W = LayerNormWhy
        self._anchor = context.root
        if x.dtype is None:
            return self.refuse(context, W.TYPE_UNKNOWN, untyped(context), x)
        if x.dtype not in FLOATS:
            return self.refuse(context, W.NOT_FLOAT, f"input is {x.dtype or 'of an unknown type'}, not a float type", x)
        m = mean_of(mean)
        if m is None and (one is None or scalar(one) == 1.0) and _mean_of_unranked(mean, x):
            return self.refuse(context, W.RANK_UNKNOWN, "the input's rank is unknown (declared without a shape, as "
                                                        "a Loop body's state input often is): its reduced axes cannot "
                                                        "be placed; declare the shape to fuse it", x)
        if (one is not None and scalar(one) != 1.0) or m is None:
            return MatchResult().fail("not (x − E[·]) / sqrt(·)")  # not LayerNorm-shaped at all: no site
        e = 0.0 if self.options["no_eps"] else scalar(eps)
        if e is None or e < 0:
            return self.refuse(context, W.EPS_NOT_CONSTANT, "epsilon is not a constant scalar >= 0", eps)
        if m.source is not x:
            return self.refuse(context, W.MEAN_NOT_OF_INPUT, "the subtracted value is not the mean of the input", mean)
        var_nodes = variance_nodes(var, x, mean, m.axes)
        if var_nodes is None:
            return self.refuse(context, W.VARIANCE_NOT_OF_INPUT, "what is under the sqrt is not the variance of the "
                                                                 "input over the same axes", var)
        r = rank(x)
        where = layout(m.axes, r)
        if where is None:
            return self.refuse(context, W.AXES_NOT_FUSABLE, f"normalizes axes {list(m.axes)} of a rank-{r} input: "
                                                            f"neither the last axes nor one axis", x)
        sizes = [x.shape[a] for a in m.axes]
        if not all(isinstance(s, int) for s in sizes):
            return self.refuse(context, W.DYNAMIC_NORMALIZED, f"normalized dims {sizes} are not static", x)
        scale = np.ones(int(np.prod(sizes)))
        if w is not None:
            scale = per_feature(const(w), x.shape, m.axes)
            if scale is None:
                return self.refuse(context, W.SCALE_NOT_PER_FEATURE, "the scale is not a constant per normalized "
                                                                     "element", w)
        nodes = list(context.nodes) + list(m.nodes) + var_nodes
        nodes += (producers(eps, {id(x)}) if eps is not None else []) + \
            (producers(w, {id(x)}) if w is not None else [])
        up = rank_up(nodes, r)
        if up is not None:  # the file's result has that constant's rank; LayerNormalization's has x's
            return self.refuse(context, W.RANK_UP, f"a constant of shape {up[1]} broadcasts the rank-{r} input's "
                                                   f"result up to rank {len(up[1])}", up[0])
        if not closed(nodes, context.root):
            return self.refuse(context, W.INNER_VALUE_READ, "a value inside the norm is read outside it", x)
        if opset_of(context) < OPSET:
            return self.refuse(context, W.OPSET_BELOW, f"LayerNormalization needs opset {OPSET}, the graph is at "
                                                       f"{opset_of(context)}")
        moments = not any(n.op_type == "Pow" or n.op_type == "Mul" and n.inputs[0] is n.inputs[1] and
                          n.inputs[0].producer() is not None and n.inputs[0].producer().op_type == "Sub"
                          for n in var_nodes)
        self._fused = (where, sizes, scale, e, moments)
        return MatchResult()

    def rewrite(self, op, x, **_):
        where, sizes, scale, eps, moments = self._fused
        d = int(np.prod(sizes))
        self.done(self._anchor, LayerNormWhy.FUSED, f"one LayerNormalization over {describe(where, rank(x))} "
                                                    f"(eps {eps:g})" + (
            "; the input computed Var as E[x²] − E[x]², which loses digits in float32 where Var ≪ E[x]²: the "
            "fused op computes it centered, so outputs differ by that rounding (--atol accepts it)" if moments else ""),
                  eps=float(eps), shape="x".join(map(str, sizes)), fed_by=fed_by(x))

        def make(v, axis):
            s, b = scale, np.zeros(d)
            if where[0] == "trailing" and len(sizes) > 1:
                s, b = s.reshape(sizes), b.reshape(sizes)
            return op.LayerNormalization(v, constant(op, s, x), constant(op, b, x), axis=axis, epsilon=eps,
                                         stash_type=1)
        return normalize(op, x, where, make)


def _ln_frame(y: ir.Value):
    """(the LayerNormalization, the axes of ``y`` it normalizes, the Transpose in between or None)."""
    node = y.producer()
    t = None
    if node is not None and node.op_type == "Transpose" and default(node):
        t, node = node, node.inputs[0].producer()
    if node is None or node.op_type != "LayerNormalization" or len(node.outputs) != 1 and \
            any(o.uses() for o in node.outputs[1:]):
        return None
    r = rank(y)
    axis = int(node.attributes["axis"].value) % r if "axis" in node.attributes else r - 1
    if t is None:
        return node, tuple(range(axis, r)), None
    if axis != r - 1:
        return None
    perm = list(t.attributes["perm"].value)
    return node, (perm.index(r - 1),), t


class LayerNormAffine(NormRule):
    """LayerNormalization(x, s, c) · w  =>  LayerNormalization(x, s·w, c·w);   … + b  =>  c + b."""

    kind = "layernorm"

    def pattern(self, op, y, w):
        return op.Mul(y, w) if self.options["op"] == "Mul" else op.Add(y, w)

    def check(self, context, y, w, **_) -> MatchResult:
        frame = _ln_frame(y) if y.producer() is not None else None
        if frame is None or len(y.uses()) != 1 or y.is_graph_output():
            return MatchResult().fail("not a LayerNormalization's only reader")
        ln, axes, t = frame
        if t is not None and (len(ln.outputs[0].uses()) != 1 or ln.outputs[0].is_graph_output()):
            return MatchResult().fail("the LayerNormalization has other readers")
        v = per_feature(const(w), y.shape, axes) if y.shape is not None else None
        s, c = const(ln.inputs[1]), const(ln.inputs[2]) if len(ln.inputs) > 2 else None
        if v is None or s is None or (len(ln.inputs) > 2 and ln.inputs[2] is not None and c is None):
            return MatchResult().fail("not a constant per normalized element")
        c = np.zeros(s.shape) if c is None else c
        v = v.reshape(s.shape)
        self._new = (ln, t, s * v, c * v) if self.options["op"] == "Mul" else (ln, t, s, c + v)
        return MatchResult()

    def rewrite(self, op, y, **_):
        ln, t, s, c = self._new
        x = ln.inputs[0]
        attrs = {k: a.value for k, a in ln.attributes.items()}
        out = op.LayerNormalization(x, constant(op, s, x), constant(op, c, x), **attrs)
        return op.Transpose(out, perm=list(t.attributes["perm"].value)) if t is not None else out


def rules(log: SiteLog) -> list:
    """The LayerNorm rules, most specific first."""
    return [LayerNormFusion.rule(f"layernorm-{form}{'-no-eps' if no_eps else ''}", log, form=form, no_eps=no_eps)
            for no_eps in (False, True) for form in ("scaled", "div", "mul")] + \
        [LayerNormAffine.rule(f"layernorm-affine-{o}", log, op=o) for o in ("Mul", "Add")]
