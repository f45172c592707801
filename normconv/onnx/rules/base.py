"""What every ONNX rule shares: reading constants and means the way exporters spell them, and the site log.

A rule is an onnxscript ``RewriteRuleClassBase``: ``pattern`` writes the dataflow as the math, ``check`` returns a
``MatchResult`` (``self.refuse(context, code, reason)`` fails it with a code from the rule's ``Why`` and logs the
site), ``rewrite`` builds the fused op and logs the site as applied. Rules keep the matched nodes in place
(``remove_nodes=False``) and check themselves that nothing outside the norm reads a value inside it; the rule set
drops the dead nodes afterwards.

Spellings read here (x a value, A the reduced axes, n = prod(x.shape[A])):
  E[x] over A   = ReduceMean(x, A) | ReduceSum(x, A) * (1/n) | ReduceSum(x, A) / n
                  (axes as an attribute, opset < 18, or an input, opset >= 18), then put back to x's rank when
                  keepdims=0 by Reshape / Unsqueeze / Expand (tf2onnx, torch.var)
  a constant    = an initializer or Constant, seen through Cast / Reshape / Expand / Unsqueeze / Squeeze /
                  Identity and elementwise Add / Sub / Mul / Div of constants (Gemma's 1 + w); ConstantOfShape of a
                  constant shape (the ONNX zoo's light files write every weight so), up to _FILL_LIMIT elements
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter._basics import MatchResult

from normconv.report import Site, Why

FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)
_SEE_THROUGH = ("Cast", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Identity")
_ARITH = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide}
_BROADCASTING = ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min")  # element-wise ops whose operands broadcast
_FILL_LIMIT = 1 << 27  # elements a ConstantOfShape is evaluated up to (512 MB of float32): past it, not read as a constant


def name_of(node: ir.Node) -> str:
    """A node's name for the report: its own, else its first output's."""
    return node.name or (node.outputs[0].name if node.outputs and node.outputs[0].name else node.op_type)


def fed_by(x: ir.Value | None) -> str:
    """What computes ``x``, for a site's report: the op and its name, or the graph input it is."""
    if x is None:
        return "-"
    p = x.producer()
    if p is None:
        return f"input {x.name}" if x.name else "-"
    return f"{p.op_type} {name_of(p)}"


def default(node: ir.Node) -> bool:
    return node.domain in ("", "ai.onnx")


def attr(node: ir.Node, name: str, fallback=None):
    a = node.attributes.get(name)
    return fallback if a is None else a.value


def const(v: ir.Value | None, depth: int = 6) -> np.ndarray | None:
    """The constant ``v`` holds (see the module docstring), else None."""
    if v is None:
        return None
    if v.const_value is not None:
        try:
            return v.const_value.numpy()
        except Exception:  # noqa: BLE001 - an external tensor that is not there
            return None
    node = v.producer()
    if node is None or depth == 0 or not default(node):
        return None
    if node.op_type == "Constant":
        a = node.attributes.get("value") or node.attributes.get("value_float") or node.attributes.get("value_floats")
        if a is None:
            return None
        return a.value.numpy() if hasattr(a.value, "numpy") else np.asarray(a.value)
    if node.op_type == "ConstantOfShape":  # value (one element; float32 0 when absent) at a constant shape
        shape = const(node.inputs[0], depth - 1) if node.inputs else None
        if shape is None or np.prod(shape, dtype=np.int64) > _FILL_LIMIT:
            return None
        a = node.attributes.get("value")
        fill = a.value.numpy().reshape(-1) if a is not None else np.zeros(1, np.float32)
        return np.full([int(s) for s in shape.reshape(-1)], fill[0], dtype=fill.dtype)
    if node.op_type in _SEE_THROUGH:
        first = const(node.inputs[0], depth - 1)
        rest = [const(i, depth - 1) for i in node.inputs[1:] if i is not None]
        if first is None or any(r is None for r in rest):
            return None
        if node.op_type == "Cast":
            return first.astype(ir.DataType(attr(node, "to")).numpy())
        if node.op_type == "Reshape":
            shape = [int(s) for s in rest[0]]
            shape = [first.shape[i] if s == 0 else s for i, s in enumerate(shape)]
            return first.reshape(shape)
        if node.op_type == "Expand":
            return first * np.ones([int(s) for s in rest[0]], dtype=first.dtype)
        if node.op_type in ("Unsqueeze", "Squeeze"):
            axes = [int(a) for a in (rest[0] if rest else attr(node, "axes", []))]
            if node.op_type == "Squeeze":
                return np.squeeze(first, axis=tuple(axes)) if axes else np.squeeze(first)
            out = first
            for a in sorted(a % (first.ndim + len(axes)) for a in axes):
                out = np.expand_dims(out, a)
            return out
        return first
    if node.op_type in _ARITH and len(node.inputs) == 2:
        a, b = const(node.inputs[0], depth - 1), const(node.inputs[1], depth - 1)
        return None if a is None or b is None else _ARITH[node.op_type](a, b)
    return None


def scalar(v: ir.Value | None) -> float | None:
    c = const(v)
    return float(c.reshape(-1)[0]) if c is not None and c.size == 1 else None


def rank(v: ir.Value | None) -> int | None:
    return len(v.shape) if v is not None and v.shape is not None else None


def reduced_axes(node: ir.Node) -> list[int] | None:
    """A Reduce node's axes, as an attribute (opset < 18) or a constant input (>= 18), normalized to >= 0;
    None when they are not known (a dynamic axes input, an unknown rank, or every axis)."""
    r = rank(node.inputs[0])
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        axes = const(node.inputs[1])
    else:
        axes = attr(node, "axes")
    if axes is None or r is None or len(np.asarray(axes).reshape(-1)) == 0:
        return None
    return sorted(int(a) % r for a in np.asarray(axes).reshape(-1))


@dataclass(frozen=True)
class Mean:
    """E[source] over ``axes``: the nodes that compute it (kept rank or put back)."""

    source: ir.Value
    axes: tuple[int, ...]
    nodes: tuple[ir.Node, ...]


def restored(v: ir.Value) -> tuple[ir.Value, list[ir.Node]]:
    """Look back through the Reshape / Unsqueeze / Expand that put a keepdims=0 reduction back to rank."""
    nodes = []
    while v is not None and v.producer() is not None and default(v.producer()) and \
            v.producer().op_type in ("Reshape", "Unsqueeze", "Expand", "Identity"):
        nodes.append(v.producer())
        v = v.producer().inputs[0]
    return v, nodes


def mean_of(v: ir.Value | None, reduced: bool = False) -> Mean | None:
    """``v`` as E[x] over some axes of x (module docstring), else None. The restoring ops are checked by shape
    where shapes are known: the result must have x's rank with size 1 on the reduced axes (``reduced``: or be the
    keepdims=0 reduction itself, as inside E[x²] − E[x]²)."""
    if v is None:
        return None
    inner, back = restored(v)
    node = inner.producer() if inner is not None else None
    if node is None or not default(node):
        return None
    scale = 1.0
    if node.op_type in ("Mul", "Div") and len(node.inputs) == 2:
        for s, c in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
            k = scalar(c)
            red = s.producer() if s is not None else None
            if k is not None and red is not None and red.op_type == "ReduceSum" and default(red) and \
                    (node.op_type == "Mul" or s is node.inputs[0]):
                scale = k if node.op_type == "Mul" else 1.0 / k if k else 0.0
                back.append(node)
                node = red
                break
        else:
            return None
    if node.op_type not in ("ReduceMean", "ReduceSum") or (node.op_type == "ReduceSum" and scale == 1.0):
        return None
    axes = reduced_axes(node)
    x = node.inputs[0]
    if axes is None or x.shape is None:
        return None
    if node.op_type == "ReduceSum":
        sizes = [x.shape[a] for a in axes]
        if not all(isinstance(s, int) for s in sizes) or not np.isclose(scale * float(np.prod(sizes)), 1.0,
                                                                           rtol=1e-6):
            return None
    keep = int(attr(node, "keepdims", 1))
    if reduced and not keep and rank(v) == rank(x) - len(axes):
        return Mean(x, tuple(axes), tuple(back + [node]))
    if not keep and not back and rank(v) != rank(x):
        return None
    if v.shape is not None and rank(v) == rank(x):
        if any(isinstance(v.shape[a], int) and v.shape[a] != 1 for a in axes):
            return None
    elif not keep and rank(v) is not None:
        return None
    return Mean(x, tuple(axes), tuple(back + [node]))


def closed(nodes: list[ir.Node], last: ir.Node) -> bool:
    """No value the nodes compute is read outside them (nor is a graph output), but ``last``'s output."""
    inside = set(map(id, nodes))
    return all(n is last or (not o.is_graph_output() and all(id(u.node) in inside for u in o.uses()))
               for n in nodes for o in n.outputs)


def producers(v: ir.Value | None, stop: set[int], limit: int = 64) -> list[ir.Node]:
    """Nodes between ``stop`` values and ``v`` (all of ``v``'s ancestors that do not lie behind a stop value)."""
    out, seen, todo = [], set(), [v]
    while todo and len(out) < limit:
        cur = todo.pop()
        if cur is None or id(cur) in stop or cur.const_value is not None:
            continue
        node = cur.producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        out.append(node)
        todo.extend(node.inputs)
    return out


def rank_up(nodes: list[ir.Node], r: int) -> tuple[ir.Value, tuple[int, ...]] | None:
    """A constant operand of the element-wise ops among ``nodes`` with more dims than ``r`` (an eps of shape
    (1, 1, 1, 1) on a rank-3 input: it broadcasts the result up a rank, which a fused op would drop), with its
    shape; else None."""
    for node in nodes:
        if default(node) and node.op_type in _BROADCASTING:
            for v in node.inputs:
                c = const(v) if v is not None and (v.const_value is not None or v.producer() is not None) else None
                if c is not None and c.ndim > r:
                    return v, tuple(c.shape)
    return None


@dataclass
class SiteLog:
    """Every site a rule set looked at: one row per norm: applied if any rule fused it, else the first refusal."""

    rows: dict[str, list[tuple[str, Site]]] = field(default_factory=dict)
    facts: dict[str, dict] = field(default_factory=dict)  # what a rule read at a site it fused (eps, shape), by target
    graph_of: dict[str, ir.Graph] = field(default_factory=dict)  # the graph each site lies in (a function's too)

    def add(self, kind: str, site: Site, **facts) -> None:
        self.rows.setdefault(site.target, []).append((kind, site))
        if facts:
            self.facts[site.target] = facts

    def sites(self) -> list[tuple[str, Site]]:
        out = []
        for rows in self.rows.values():  # the first rule to refuse is the most specific one
            out.append(next((r for r in rows if r[1].applied), rows[0]))
        return out


class NormRule(pattern.RewriteRuleClassBase):
    """Base of normconv's ONNX rules: ``kind`` names the norm, ``pass_name`` the report's pass column."""

    kind: ClassVar[str] = ""
    pass_name: ClassVar[str] = "fuse"

    def __init__(self, name: str, log: SiteLog, **options) -> None:
        super().__init__(name, remove_nodes=False)
        self.log = log
        self.pass_name = options.pop("pass_name", type(self).pass_name)
        self.options = options

    def refuse(self, context, code: Why, reason: str, *sources, at: ir.Node | None = None) -> MatchResult:
        """Fail the match with ``reason`` and log the site (``at``, else the match's last node) with ``code``."""
        node = at or context.root
        self.log.add(self.kind, Site(self.pass_name, name_of(node), False, reason, code))
        self.log.graph_of[name_of(node)] = node.graph
        return MatchResult().fail(reason, list(sources))

    def done(self, anchor: ir.Node, code: Why, reason: str, **facts) -> None:
        """Log the site fused at ``anchor``; ``facts``: what the rule read there, for inspect (``onnx.sites``)."""
        self.log.add(self.kind, Site(self.pass_name, name_of(anchor), True, reason, code), **facts)
        self.log.graph_of[name_of(anchor)] = anchor.graph


def untyped(context) -> str:
    """Why a matched input has no type, for its site's reason: inside an ONNX function (whose values ONNX leaves
    untyped; ``passes/function_types`` types a function called once), or where shape inference did not reach."""
    fn = context.graph_or_function
    if not isinstance(fn, ir.Function):
        return "the input's type is unknown (shape inference did not reach it), so nothing shows it is a float"
    calls = sum(1 for n in ir.traversal.RecursiveGraphIterator(context.model.graph)
                if (n.domain, n.op_type, n.overload) == fn.identifier())
    return (f"the input has no type: it is inside the ONNX function {fn.domain}.{fn.name}, whose values ONNX leaves "
            f"untyped, and its {calls} calls may differ (only a function called once is typed from its call)"
            if calls > 1 else f"the input has no type: it is inside the ONNX function {fn.domain}.{fn.name}, whose "
                              f"values ONNX leaves untyped, and its call does not type it")


def square_of(v: ir.Value | None) -> ir.Value | None:
    """x, if ``v`` is x² written Pow(x, 2) or Mul(x, x)."""
    node = v.producer() if v is not None else None
    if node is None or not default(node):
        return None
    if node.op_type == "Pow" and scalar(node.inputs[1]) == 2.0:
        return node.inputs[0]
    if node.op_type == "Mul" and node.inputs[0] is node.inputs[1]:
        return node.inputs[0]
    return None


def layout(axes: tuple[int, ...], r: int) -> tuple[str, int] | None:
    """Where the fused op can normalize ``axes`` of a rank-``r`` input: ("trailing", first axis) for the last
    axes, ("moved", a) for one inner axis a (a Transpose puts it last and back), else None."""
    if list(axes) == list(range(axes[0], r)):
        return "trailing", axes[0]
    if len(axes) == 1:
        return "moved", axes[0]
    return None


def per_feature(w: np.ndarray | None, x_shape, axes: tuple[int, ...]) -> np.ndarray | None:
    """``w`` (broadcast against x) as one value per normalized element, flattened over ``axes`` in order; None if
    it varies along an axis that is not normalized, or does not broadcast."""
    if w is None:
        return None
    r = len(x_shape)
    if w.ndim > r:
        return None
    full = w.reshape((1,) * (r - w.ndim) + w.shape)
    for i, n in enumerate(full.shape):
        if i not in axes and n != 1:
            return None
        if i in axes and n != 1 and isinstance(x_shape[i], int) and n != x_shape[i]:
            return None
    sizes = [x_shape[a] for a in axes]
    if not all(isinstance(s, int) for s in sizes):
        return None
    idx = tuple(slice(None) if i in axes else 0 for i in range(r))
    return np.broadcast_to(full[idx], sizes).reshape(-1).copy()


def describe(where: tuple[str, int], r: int) -> str:
    """"the last axis", "the last 2 axes", "axis 1 (moved last by a Transpose each side)"."""
    how, axis = where
    if how == "moved":
        return f"axis {axis} (moved last by a Transpose each side)"
    return "the last axis" if axis == r - 1 else f"the last {r - axis} axes"


def normalize(op, x: ir.Value, where: tuple[str, int], make):
    """``make(x', axis)`` on x, or on x with the normalized axis moved last and moved back after (a Transpose each
    side, which runtimes cancel or fuse): y = T⁻¹(norm(T(x), axis=-1))."""
    how, axis = where
    if how == "trailing":
        return make(x, axis)
    r = rank(x)
    perm = [i for i in range(r) if i != axis] + [axis]
    back = [perm.index(i) for i in range(r)]
    return op.Transpose(make(op.Transpose(x, perm=perm), -1), perm=back)


def constant(op, array: np.ndarray, like: ir.Value):
    """A Constant node holding ``array`` in ``like``'s dtype (a Constant works in graphs, subgraphs and functions)."""
    dtype = like.dtype.numpy() if like.dtype is not None else np.float32
    return op.Constant(value=ir.tensor(np.ascontiguousarray(array.astype(dtype))))
