"""GroupNorm written as Reshape + InstanceNormalization + Reshape (torch's legacy export, most converters), fused
into normconv's GroupNorm placeholder (GroupNormalization at opset 21, a function op below it).

  g = Reshape(x, [N, G, -1]);  y = Reshape(InstanceNorm(g, 1, 0, ε), shape(x))
      =>  y = normconv.GroupNorm(x, 1, 0; num_groups=G, epsilon=ε)
  GroupNorm(x, s, c) · w + b  =>  GroupNorm(x, s·w, c·w + b)      (w, b constant per channel: shape [C, 1, …])
"""

from __future__ import annotations

import numpy as np
from onnxscript.rewriter._basics import MatchResult

from normconv.onnx.ops import DOMAIN
from normconv.onnx.rules.base import NormRule, SiteLog, attr, closed, const, constant, fed_by, name_of, per_feature, rank
from normconv.report import Why


class GroupNormWhy(Why):
    FUSED = "fused-groupnorm"
    NOT_GROUPED = "not-grouped"
    AFFINE_NOT_IDENTITY = "instance-affine-not-identity"
    DYNAMIC_CHANNELS = "dynamic-channels"
    INNER_VALUE_READ = "inner-value-read"


class GroupNormFusion(NormRule):
    """Reshape(InstanceNormalization(Reshape(x, [N, G, -1]), 1, 0), shape of x)  =>  normconv.GroupNorm(x)."""

    kind = "groupnorm"

    def pattern(self, op, x, s1, gamma, beta, s2):
        return op.Reshape(op.InstanceNormalization(op.Reshape(x, s1, _allow_other_attributes=True), gamma, beta,
                                                   _allow_other_attributes=True, _outputs=["inorm"]), s2,
                          _allow_other_attributes=True)

    def check(self, context, x, s1, gamma, beta, s2, inorm, **_) -> MatchResult:
        W = GroupNormWhy
        self._anchor = context.root
        shape, g, b = const(s1), const(gamma), const(beta)
        r = rank(x)
        if shape is None or len(shape) != 3 or r is None or r < 3 or x.shape is None:
            return self.refuse(context, W.NOT_GROUPED, "the first Reshape is not [N, G, -1] of a rank >= 3 input", s1)
        if g is None or b is None or not np.all(g == 1) or not np.all(b == 0):
            return self.refuse(context, W.AFFINE_NOT_IDENTITY, "the InstanceNormalization has its own scale/shift "
                                                               "(a per-group affine)", gamma)
        channels = x.shape[1]
        groups = int(shape[1]) if shape[1] > 0 else None
        if not isinstance(channels, int) or groups is None or channels % groups:
            return self.refuse(context, W.DYNAMIC_CHANNELS, f"channels {channels} not a static multiple of the "
                                                            f"groups {shape[1]}", x)
        out = context.root.outputs[0]
        if out.shape is not None and x.shape is not None and list(out.shape) != list(x.shape) and \
                const(s2) is None:
            return self.refuse(context, W.NOT_GROUPED, "the second Reshape does not restore the input's shape", s2)
        if not closed(list(context.nodes), context.root):
            return self.refuse(context, W.INNER_VALUE_READ, "a value inside the norm is read outside it", x)
        self._fused = (channels, groups, float(attr(inorm.producer(), "epsilon", 1e-5)), name_of(inorm.producer()))
        return MatchResult()

    def rewrite(self, op, x, **_):
        c, g, eps, inner = self._fused
        self.done(self._anchor, GroupNormWhy.FUSED, f"one GroupNorm, {g} groups of {c} channels (eps {eps:g})",
                  eps=eps, shape=f"C={c} G={g}", fed_by=fed_by(x), inner=inner)
        return op.GroupNorm(x, constant(op, np.ones(c), x), constant(op, np.zeros(c), x), num_groups=g, epsilon=eps,
                            _domain=DOMAIN)


class GroupNormAffine(NormRule):
    """GroupNorm(x, s, c) · w  =>  GroupNorm(x, s·w, c·w);   … + b  =>  GroupNorm(x, s, c + b)."""

    kind = "groupnorm"

    def pattern(self, op, y, w):
        return op.Mul(y, w) if self.options["op"] == "Mul" else op.Add(y, w)

    def check(self, context, y, w, **_) -> MatchResult:
        node = y.producer()
        if node is None or node.op_type != "GroupNorm" or node.domain != DOMAIN or len(y.uses()) != 1 \
                or y.is_graph_output() or y.shape is None:
            return MatchResult().fail("not a GroupNorm's only reader")
        v, s, c = per_feature(const(w), y.shape, (1,)), const(node.inputs[1]), const(node.inputs[2])
        if v is None or s is None or c is None:
            return MatchResult().fail("not a constant per channel")
        self._new = (node, s * v, c * v) if self.options["op"] == "Mul" else (node, s, c + v)
        return MatchResult()

    def rewrite(self, op, y, **_):
        node, s, c = self._new
        x = node.inputs[0]
        return op.GroupNorm(x, constant(op, s, x), constant(op, c, x), _domain=DOMAIN,
                            **{k: a.value for k, a in node.attributes.items()})


def rules(log: SiteLog) -> list:
    return [GroupNormFusion.rule("groupnorm", log)] + [GroupNormAffine.rule(f"groupnorm-affine-{o}", log, op=o)
                                                       for o in ("Mul", "Add")]
