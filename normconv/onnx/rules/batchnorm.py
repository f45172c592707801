"""BatchNormalization folded into the op next to it, in float64 (eval-mode BN is an affine map per channel).

  s = γ / sqrt(σ² + ε),  t = β − μ·s                    BN(z) = s·z + t   (per channel, axis 1)
  after  Conv:          W' = W·s (output channels, axis 0),              b' = b·s + t
  after  ConvTranspose: W (Cin, Cout/g, k…): W'[g, ·, o] = W[g, ·, o]·s[g·Cout/g + o],  b' = b·s + t
  after  Gemm:          B' = B·s along N (axis 0 if transB), C' = β_gemm·C·s + t, β_gemm = 1
  after  MatMul (+ c):  W' = W·s[None, :], c' = c·s + t           (only a rank-2 output: BN's axis 1 is then N)
  after  Conv + c:      a bias added after the conv (paddle2onnx: Add of a [1, C, 1, 1] constant) folds the same way
  before Conv:          W'[o, j] = W[o, j]·s[c],  b'[o] = b[o] + Σ_{j,k} W[o, j, k]·t[c]   (c = g(o)·Cin/g + j)
                        exact only when the conv pads nothing: padding pads BN's output with 0, not with t

Guards (as the torch fold's): the BN in inference mode with constant statistics, one value per channel (opset 7's
spatial=0 writes them per element, (C, H, W): they fold only where they are equal along H, W); the conv's output
read by the BN alone (and the BN's by the conv alone, before it); weights and bias constants read by nothing else
(an initializer, a Constant, or a constant computed from them: rules/base.const), or a weight read by twins alone
(the same op and attributes, each followed by a BN of the same scale s: one W·s made for all of them). Inside an
ONNX function the folded weights are Constant nodes (a function holds no initializers). An initializer the file also lists
as a graph input (IR version >= 4) is a default a caller may override: never baked into a fold. A BN with no
foldable neighbour stays one BatchNormalization, listed with why.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter._basics import MatchResult

from normconv.onnx.rules.base import NormRule, SiteLog, attr, const, name_of, per_feature, rank
from normconv.report import Site, Why


class FoldWhy(Why):
    FOLDED = "folded"
    FOLDED_INTO_NEXT = "folded-into-next"
    TRAINING_MODE = "training-mode"
    STATS_NOT_CONSTANT = "stats-not-constant"
    OVERRIDABLE = "overridable-initializer"
    WEIGHT_NOT_CONSTANT = "weight-not-constant"
    SHARED_OUTPUT = "shared-output"
    SHARED_WEIGHT = "shared-weight"
    PER_ELEMENT = "per-element-statistics"  # spatial=0 statistics (C, H, W) that vary along H, W: no conv folds them
    AXIS_NOT_FEATURES = "axis-not-features"
    PADDED_CONV = "padded-conv"
    HALF_RANGE = "past-half-range"  # a float16 / bfloat16 file's folded weight or bias past half its dtype's max
    NOT_FINITE = "not-finite"  # a folded weight or bias not finite in the file's dtype (σ² + ε = 0, past its max)
    BAD_GROUPS = "bad-groups"
    STANDALONE = "no-foldable-neighbour"


def _stats(bn: ir.Node) -> list[np.ndarray] | None:
    """γ, β, μ, σ² of an inference BN, else None (a statistic that is not a constant, or a graph input: a default a
    caller may override, which a fold would bake in)."""
    if any(v is None or v.is_graph_input() for v in bn.inputs[1:5]):
        return None
    stats = [const(v) for v in bn.inputs[1:5]]
    return None if any(p is None for p in stats) else stats


def _affine(bn: ir.Node, stats: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray] | None:
    """(s, t) per channel in float64; None when the statistics are not one value per channel: spatial=0 (opset 7)
    writes them per element, (C, D1, ...), which a fold takes only where they are equal along D1, ..."""
    per = []
    for p in stats:
        flat = p.astype(np.float64).reshape(len(p), -1) if p.ndim else None
        if flat is None or not flat.size or not (flat == flat[:, :1]).all():
            return None
        per.append(flat[:, 0])
    if len({len(p) for p in per}) != 1:
        return None
    g, b, mu, var = per
    with np.errstate(all="ignore"):  # σ² + ε = 0: not finite, refused by _range with its code
        s = g / np.sqrt(var + float(attr(bn, "epsilon", 1e-5)))
        return s, b - mu * s


def _not_per_channel(bn: ir.Node, stats: list[np.ndarray]) -> str:
    return (f"its statistics are per element (shape {tuple(stats[0].shape)}, spatial="
            f"{attr(bn, 'spatial', 1)}), not one value per channel: a fold scales whole channels")


def _range(like: np.ndarray, *folded: np.ndarray) -> tuple[FoldWhy, str] | None:
    """Why the folded (weight, bias), computed in float64, do not fit ``like``'s dtype, else None: a 16-bit float's
    past half its max (its products would overflow: the torch fold's past-half-range), any dtype's not finite."""
    import ml_dtypes

    kind, limit = like.dtype.name, float(ml_dtypes.finfo(like.dtype).max)
    if not all(np.isfinite(a).all() for a in folded):
        return FoldWhy.NOT_FINITE, "the folded weights would not be finite (a zero σ² + ε?)"
    big = max(float(np.abs(a).max(initial=0.0)) for a in folded)
    if like.dtype.itemsize <= 2 and big > limit / 2:
        return FoldWhy.HALF_RANGE, (f"the folded weights would reach {big:.3g}, past half of {kind}'s max "
                                    f"{limit:.6g} (its products would overflow)")
    if big > limit:
        return FoldWhy.NOT_FINITE, f"the folded weights would reach {big:.3g}, past {kind}'s max {limit:.6g}"
    return None


def _scaled(p: str, inner: ir.Node, weight: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The weight of ``inner`` (a ``p``: Conv, ConvTranspose, Gemm or MatMul, + Add) times s along its outputs."""
    if p.startswith("ConvTranspose"):
        g = int(attr(inner, "group", 1))
        shape = weight.shape
        return (weight.reshape(g, shape[0] // g, shape[1], *shape[2:])
                * s.reshape((g, 1, shape[1]) + (1,) * (len(shape) - 2))).reshape(shape)
    if p.startswith("Conv"):
        return weight * s.reshape((-1,) + (1,) * (weight.ndim - 1))
    if p == "Gemm":
        return weight * (s[:, None] if attr(inner, "transB", 0) else s[None, :])
    return weight * s[None, :]


def _scaled_input(conv: ir.Node, weight: np.ndarray, b_c: np.ndarray | None, s: np.ndarray,
                  t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A conv's (weight, bias) with s·x + t folded into its input channels (the module docstring's before Conv)."""
    g = int(attr(conv, "group", 1))
    cout, cin_g = weight.shape[:2]
    # channel of input j in the group of output o
    chan = (np.arange(cout)[:, None] // (cout // g)) * cin_g + np.arange(cin_g)[None, :]
    extra = (1,) * (weight.ndim - 2)
    b = b_c.astype(np.float64) if b_c is not None else np.zeros(cout)
    b = b + (weight * t[chan].reshape(chan.shape + extra)).reshape(cout, -1).sum(axis=1)
    return weight * s[chan].reshape(chan.shape + extra), b


def _own(v: ir.Value | None, node: ir.Node) -> np.ndarray | None:
    """The constant ``v`` holds (``const``: an initializer, a Constant, a constant computed by constants) when only
    ``node`` reads it and no caller can feed it (not a graph input), else None."""
    if v is None or v.is_graph_input() or any(u.node is not node for u in v.uses()):
        return None
    return const(v)


def _overridable(*values: ir.Value | None) -> ir.Value | None:
    """The first of ``values`` that is an initializer the file also lists as a graph input (IR version >= 4: a
    default a caller may feed another value for; below 4, passes/ir3.py has made them constants)."""
    return next((v for v in values if v is not None and v.is_graph_input() and v.is_initializer()), None)


OVERRIDABLE = "{name} is an initializer the file also lists as a graph input: a default a caller may override, " \
              "which a fold would bake in (--constant-initializers reads them as constants)"


def _init(op, array: np.ndarray, like: np.ndarray, name: str, in_function: bool = False):
    """A new initializer holding ``array`` in ``like``'s dtype (the constant it replaces); inside an ONNX function,
    which holds no initializers (onnxscript drops a rewrite that adds one there), a Constant node."""
    tensor = ir.tensor(np.ascontiguousarray(array.astype(like.dtype)), name=name)
    return op.Constant(value=tensor) if in_function else op.initializer(tensor, name=name)


def _twins(w: ir.Value, inner: ir.Node, s: np.ndarray) -> bool:
    """Every node reading the weight ``w`` is an ``inner`` (its op, its attributes) reading it as its weight, whose
    output only a BN reads, that BN's scale ``s``: each fold of ``w`` is the same W·s, one tensor for all (a module
    called twice, an inlined function's calls), and ``w`` itself is read by none once they fold."""
    for use in w.uses():
        n = use.node
        if n.op_type != inner.op_type or n.domain != inner.domain or use.idx != 1 or \
                {k: a.value for k, a in n.attributes.items()} != {k: a.value for k, a in inner.attributes.items()}:
            return False
        out = n.outputs[0]
        readers = out.uses()
        if out.is_graph_output() or len(readers) != 1 or readers[0].node.op_type != "BatchNormalization" or \
                readers[0].idx != 0 or attr(readers[0].node, "training_mode", 0):
            return False
        bn = readers[0].node
        stats = _stats(bn)
        st = _affine(bn, stats) if stats is not None else None
        if st is None or not np.array_equal(st[0], s):
            return False
    return True


class FoldForward(NormRule):
    """z = P(x, W, b);  BN(z)  =>  P(x, W', b')   for P in Conv, ConvTranspose, Gemm, MatMul (+ Add)."""

    kind = "batchnorm"
    pass_name = "fold"

    def pattern(self, op, x, w, gamma, beta, mu, var, c):
        p = self.options["producer"]
        if p.endswith("Add"):  # BN(x @ W + c), BN(conv(x, W) + c): a bias added after the op (paddle2onnx)
            inner = op.Add(getattr(op, p[:-3])(x, w, _allow_other_inputs=p != "MatMulAdd", _outputs=["mm"]), c,
                           _outputs=["z"])
        else:
            inner = getattr(op, p)(x, w, _allow_other_inputs=True, _outputs=["z"])
        return op.BatchNormalization(inner, gamma, beta, mu, var, _allow_other_attributes=True, _outputs=["y"])

    def check(self, context, x, w, z, y, mm=None, **_) -> MatchResult:
        W = FoldWhy
        bn, prod = y.producer(), z.producer()
        self._bn = bn
        p = self.options["producer"]
        if attr(bn, "training_mode", 0):
            return self.refuse(context, W.TRAINING_MODE, "BatchNormalization in training mode", bn)
        stats = _stats(bn)
        if stats is None:
            fed = _overridable(*bn.inputs[1:5])
            if fed is not None:
                return self.refuse(context, W.OVERRIDABLE, f"its statistic {OVERRIDABLE.format(name=fed.name)}", bn)
            return self.refuse(context, W.STATS_NOT_CONSTANT, "its statistics are not constants", bn)
        st = _affine(bn, stats)
        if st is None:
            return self.refuse(context, W.PER_ELEMENT, _not_per_channel(bn, stats), bn)
        if len(z.uses()) != 1 or z.is_graph_output() or (mm is not None and (len(mm.uses()) != 1 or
                                                                             mm.is_graph_output())):
            return self.refuse(context, W.SHARED_OUTPUT, f"the {p} output is read by more than the BN", z)
        inner = mm.producer() if mm is not None else prod
        own = inner.inputs[2] if len(inner.inputs) > 2 and inner.op_type != "MatMul" else None
        added = (prod.inputs[1] if prod.inputs[0] is mm else prod.inputs[0]) if mm is not None else None
        w_c, own_c, added_c = _own(w, inner), _own(own, inner), _own(added, prod)
        # W read by its twins alone (same op, same BN scale)  =>  one folded W·s for all of them
        self._shared = w_c is None and mm is None and not w.is_graph_input() and const(w) is not None and \
            _twins(w, inner, st[0])
        w_c = const(w) if self._shared else w_c
        if w_c is None or any(v is not None and c is None for v, c in ((own, own_c), (added, added_c))):
            fed = _overridable(w, own, added)
            if fed is not None:
                return self.refuse(context, W.OVERRIDABLE, f"the {p} weight {OVERRIDABLE.format(name=fed.name)}", w)
            return self.refuse(context, W.SHARED_WEIGHT if const(w) is not None else W.WEIGHT_NOT_CONSTANT,
                               f"the {p} weight or bias is not a constant it alone reads", w)
        weight = w_c.astype(np.float64)
        s, t = st
        b = own_c.astype(np.float64) if own is not None else np.zeros(len(s))
        if added is not None:  # the bias added after the op: one value per output channel (axis 1)
            per = per_feature(added_c, z.shape, (1,)) if z.shape is not None else None
            if per is None or per.size != len(s):
                return self.refuse(context, W.AXIS_NOT_FEATURES, "the added bias is not one value per channel", added)
            b = b + per
        if p in ("MatMul", "MatMulAdd") and (rank(z) != 2 or weight.ndim != 2):
            return self.refuse(context, W.AXIS_NOT_FEATURES, f"the MatMul output is rank {rank(z)}: BN's channel "
                                                             f"axis 1 is not its feature axis", z)
        if p.startswith("ConvTranspose") and weight.shape[0] % int(attr(inner, "group", 1)):
            return self.refuse(context, W.BAD_GROUPS, "in_channels not divisible by group", w)
        if p == "Gemm":
            b = b * float(attr(inner, "beta", 1.0))
            if own is not None and b.size not in (1, len(s)):
                return self.refuse(context, W.AXIS_NOT_FEATURES, "the Gemm bias is not per output feature", own)
        with np.errstate(all="ignore"):  # past the range: refused below, no numpy warning printed
            weight, b = _scaled(p, inner, weight, s), np.broadcast_to(b.reshape(-1), s.shape) * s + t
        past = _range(w_c, weight, b)
        if past is not None:
            return self.refuse(context, past[0], past[1], w, at=bn)
        self._new = (inner, weight, b, w_c)  # the fold's values: the ones the range check read
        self._in_function = isinstance(context.graph_or_function, ir.Function)
        return MatchResult()

    def rewrite(self, op, x, w, z, **_):
        inner, weight, b, like = self._new
        p = self.options["producer"].removesuffix("Add") if self.options["producer"] != "MatMulAdd" else "MatMulAdd"
        shared = self._shared and not self._in_function
        self.done(self._bn, FoldWhy.FOLDED, f"folded into {inner.op_type} {name_of(inner)} (float64)"
                  + (f"; its weight {w.name}, which its twins read, folded once for all" if shared else ""))
        wname, bname = f"{w.name}_bnfold", f"{w.name}_bnfold_bias"
        made = getattr(self, "_made", {}) if shared else {}  # the twins' one folded weight, by the weight it replaces
        new_w = made[w] if w in made else _init(op, weight, like, wname, self._in_function)
        if shared:
            self._made = {**made, w: new_w}
        new_b = _init(op, b, like, bname, self._in_function)
        attrs = {k: a.value for k, a in inner.attributes.items() if k != "beta"}
        if p in ("MatMul", "MatMulAdd"):
            return op.Add(op.MatMul(x, new_w), new_b)
        return op.op(p, x, new_w, new_b, **attrs)


class FoldBackward(NormRule):
    """y = BN(x);  Conv(y, W, b)  =>  Conv(x, W', b')   when the conv pads nothing."""

    kind = "batchnorm"
    pass_name = "fold"

    def pattern(self, op, x, gamma, beta, mu, var, w):
        y = op.BatchNormalization(x, gamma, beta, mu, var, _allow_other_attributes=True, _outputs=["y"])
        return op.Conv(y, w, _allow_other_inputs=True, _outputs=["z"])

    def check(self, context, x, y, w, z, **_) -> MatchResult:
        W = FoldWhy
        bn, conv = y.producer(), z.producer()
        self._bn = bn
        stats = None if attr(bn, "training_mode", 0) else _stats(bn)
        if stats is None:
            return MatchResult().fail("not an inference BN with constant statistics")
        st = _affine(bn, stats)
        if st is None:
            return self.refuse(context, W.PER_ELEMENT, _not_per_channel(bn, stats), at=bn)
        if len(y.uses()) != 1 or y.is_graph_output():
            return self.refuse(context, W.SHARED_OUTPUT, "the BN output is read by more than the conv", y, at=bn)
        bias = conv.inputs[2] if len(conv.inputs) > 2 else None
        w_c, b_c = _own(w, conv), _own(bias, conv)
        if w_c is None or (bias is not None and b_c is None):
            fed = _overridable(w, bias)
            if fed is not None:
                return self.refuse(context, W.OVERRIDABLE, f"the conv weight {OVERRIDABLE.format(name=fed.name)}",
                                   w, at=bn)
            return self.refuse(context, W.SHARED_WEIGHT, "the conv weight or bias is not a constant initializer it "
                                                         "alone reads", w, at=bn)
        pads = attr(conv, "pads", []) or []
        auto = attr(conv, "auto_pad", "NOTSET")
        auto = auto.decode() if isinstance(auto, bytes) else auto
        if any(int(p) for p in pads) or auto not in ("NOTSET", "VALID"):
            return self.refuse(context, W.PADDED_CONV, "the conv after it pads its input: padding pads the BN "
                                                       "output with 0, not with its shift (not exact)", at=bn)
        with np.errstate(all="ignore"):  # past the range: refused below, no numpy warning printed
            weight, b = _scaled_input(conv, w_c.astype(np.float64), b_c, *st)
        past = _range(w_c, weight, b)
        if past is not None:
            return self.refuse(context, past[0], past[1], w, at=bn)
        self._conv, self._consts = conv, (w_c, weight, b)  # the fold's values: the ones the range check read
        self._in_function = isinstance(context.graph_or_function, ir.Function)
        return MatchResult()

    def rewrite(self, op, x, w, **_):
        conv, bn = self._conv, self._bn
        like, weight, b = self._consts
        self.done(bn, FoldWhy.FOLDED_INTO_NEXT, f"folded into the next Conv {name_of(conv)} (no padding; float64)")
        attrs = {k: a.value for k, a in conv.attributes.items()}
        return op.Conv(x, _init(op, weight, like, f"{w.name}_bnfold", self._in_function),
                       _init(op, b, like, f"{w.name}_bnfold_bias", self._in_function), **attrs)


def rules(log: SiteLog) -> list:
    return [FoldForward.rule(f"fold-after-{p}", log, producer=p)
            for p in ("ConvAdd", "ConvTransposeAdd", "Conv", "ConvTranspose", "Gemm", "MatMulAdd", "MatMul")] + [FoldBackward.rule("fold-before-conv", log)]


def standalone(model: ir.Model, log: SiteLog) -> None:
    """Every BatchNormalization left that no rule looked at: kept as one op, listed with why."""
    for node in all_nodes(model):
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx") and name_of(node) not in log.rows:
            prod = node.inputs[0].producer() if node.inputs[0] is not None else None
            log.add("batchnorm", Site("fold", name_of(node), False,
                                      f"kept as one BatchNormalization: its input comes from "
                                      f"{prod.op_type if prod else 'a graph input'}, and no Conv without padding "
                                      f"reads it alone", FoldWhy.STANDALONE))


def all_nodes(model: ir.Model):
    """Every node of the model: main graph, subgraphs, functions."""
    yield from ir.traversal.RecursiveGraphIterator(model.graph)
    for f in model.functions.values():
        yield from ir.traversal.RecursiveGraphIterator(f)
