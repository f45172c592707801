"""Inline norms fused in the exported ONNX graph: the decomposed form a norm written inside a bigger module leaves
after torch.onnx.export (Mamba2's gated RMSNorm: the module also gates and regroups, so it is not replaced in torch;
xLSTM's per-head LayerNorm), matched op by op; an RMSNorm becomes normconv's RMSNorm placeholder (lowered like the
others, per target/opset):

    y = x / Sqrt(mean(x^2) + eps)   or   x * Reciprocal(Sqrt(mean(x^2) + eps))          (x^2: Pow(x, 2) or Mul(x, x))
        =>  y = normconv.RMSNorm(x, ones(D), axes=[-1], epsilon=eps)           (D = x's last dim)
    d = x - mean(x);  y = d / Sqrt(mean(d'^2) + eps)   or   d * Reciprocal(Sqrt(mean(d'^2) + eps))  [* w] [+ b]
        (d' = d, or x - mean(x) computed a second time: torch.var(x) beside x - x.mean())
        =>  y = LayerNormalization(x, w or ones(D), b or zeros(D), axis=-1, epsilon=eps)   (I-BERT's IntLayerNorm:
            a module returning (y, None), kept as written in torch)

mean(.) is ReduceMean over the last axis with keepdims=1, or with keepdims=0 put back to the kept shape by a Reshape /
Unsqueeze (torch.var's export). Only the exact chain is matched: no value inside it read outside it, eps a constant
scalar, x of a float type and a static last dim; anything else (a cast inside, another reader of the mean) is left
as it is. onnxruntime's validation against torch checks the result.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from normconv.onnx.ops import DOMAIN, _attr


def _const(v: ir.Value | None) -> np.ndarray | None:
    """The constant a value holds (an initializer or a Constant node's output), else None."""
    if v is None:
        return None
    if v.const_value is not None:
        return v.const_value.numpy()
    node = v.producer()
    if node is not None and node.op_type == "Constant" and "value" in node.attributes:
        return node.attributes["value"].value.numpy()
    return None


def _only(v: ir.Value, op: str) -> ir.Node | None:
    """The producer of ``v`` if it is ``op`` (default domain) and ``v`` has no other reader."""
    node = v.producer() if v is not None else None
    if node is None or node.op_type != op or node.domain not in ("", "ai.onnx") or len(v.uses()) != 1:
        return None
    return node


def _square_of(v: ir.Value) -> ir.Value | None:
    """x, if ``v`` is x^2 (Pow(x, 2) or Mul(x, x)) read only once."""
    node = v.producer() if v is not None else None
    if node is None or node.domain not in ("", "ai.onnx") or len(v.uses()) != 1:
        return None
    if node.op_type == "Pow":
        e = _const(node.inputs[1])
        return node.inputs[0] if e is not None and e.size == 1 and float(e.reshape(-1)[0]) == 2.0 else None
    if node.op_type == "Mul" and node.inputs[0] is node.inputs[1]:
        return node.inputs[0]
    return None


_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)


def _normalizable(x: ir.Value | None) -> bool:
    """x can be a fused norm's input: a float type the norm ops take, a known rank, a static last dim."""
    return x is not None and x.dtype in _FLOATS and x.shape is not None and isinstance(x.shape[-1], int)


def _last_axis_mean(v: ir.Value, x: ir.Value | None = None, keepdims: int = 1) -> ir.Node | None:
    """The ReduceMean producing ``v``, over the last axis with this ``keepdims``, of ``x`` when given."""
    node = v.producer() if v is not None else None
    if node is None or node.op_type != "ReduceMean" or node.domain not in ("", "ai.onnx"):
        return None
    src = node.inputs[0]
    axes = _const(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else _attr(node, "axes")
    if axes is None or int(_attr(node, "keepdims", 1)) != keepdims or src is None or src.shape is None:
        return None
    rank = len(src.shape)
    if [int(a) % rank for a in np.asarray(axes).reshape(-1)] != [rank - 1] or (x is not None and src is not x):
        return None
    return node


def _kept_mean(v: ir.Value) -> list[ir.Node] | None:
    """[the ReduceMean, ...] if ``v`` is a last-axis mean with the axis kept: keepdims=1, or keepdims=0 put back
    by a Reshape / Unsqueeze to the input's shape with a last dim of 1 (torch.var's export); the mean first."""
    mean = _last_axis_mean(v)
    if mean is not None:
        return [mean]
    back = v.producer() if v is not None else None
    if back is None or back.op_type not in ("Reshape", "Unsqueeze") or back.domain not in ("", "ai.onnx"):
        return None
    mean = _last_axis_mean(back.inputs[0], keepdims=0)
    src = mean.inputs[0] if mean is not None else None
    # the restored shape must be the input's with the last axis 1 (a symbolic dim compares by name)
    if src is None or v.shape is None or list(v.shape) != list(src.shape)[:-1] + [1]:
        return None
    return [mean, back]


def _closed(chain: list[ir.Node], last: ir.Node) -> bool:
    """No value the chain computes is read outside it (nor is a graph output), but the last node's."""
    inside = set(map(id, chain))
    return all(n is last or (not o.is_graph_output() and all(id(u.node) in inside for u in o.uses()))
               for n in chain for o in n.outputs)


def _inverse_root(out: ir.Node) -> list[tuple[ir.Value, list[ir.Node], ir.Node]]:
    """Each (numerator, [out, ..., Sqrt], Sqrt) reading of ``out`` as n / Sqrt(s) or n * Reciprocal(Sqrt(s))."""
    if out.domain not in ("", "ai.onnx") or len(out.inputs) != 2:
        return []
    found = []
    if out.op_type == "Div":
        sqrt = _only(out.inputs[1], "Sqrt")
        if sqrt is not None:
            found.append((out.inputs[0], [out, sqrt], sqrt))
    elif out.op_type == "Mul":
        for n, r in ((out.inputs[0], out.inputs[1]), (out.inputs[1], out.inputs[0])):
            recip = _only(r, "Reciprocal")
            sqrt = _only(recip.inputs[0], "Sqrt") if recip is not None else None
            if sqrt is not None:
                found.append((n, [out, recip, sqrt], sqrt))
    return found


def _plus_eps(sqrt: ir.Node) -> list[tuple[ir.Value, float, list[ir.Node]]]:
    """Each (s, eps, [the Add]) with Sqrt(s + eps), eps a constant scalar; (s, 0.0, []) where the exporter
    dropped a + 0."""
    add = _only(sqrt.inputs[0], "Add")
    if add is None:
        return [(sqrt.inputs[0], 0.0, [])]
    found = []
    for s, e in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
        eps = _const(e)
        if eps is not None and eps.size == 1:
            found.append((s, float(eps.reshape(-1)[0]), [add]))
    return found


def _match_rms(out: ir.Node) -> tuple[ir.Value, float, list[ir.Node]] | None:
    """(x, eps, the chain's nodes) if ``out`` (a Mul or Div) ends a decomposed RMSNorm:
    x / Sqrt(mean(x^2) + eps) or x * Reciprocal(Sqrt(mean(x^2) + eps))."""
    for x, chain, sqrt in _inverse_root(out):
        for s, eps, add in _plus_eps(sqrt):
            if eps == 0.0 and not add:
                continue  # an RMSNorm without eps is not matched (a plain x / |x| is not a norm op)
            mean = _kept_mean(s)
            square = mean[0].inputs[0] if mean else None
            if mean is None or _square_of(square) is not x or not _normalizable(x):
                continue
            nodes = chain + add + mean[::-1] + [square.producer()]  # out .. x^2
            if _closed(nodes, out):
                return x, eps, nodes
    return None


def _centered(d: ir.Value) -> tuple[ir.Value, list[ir.Node]] | None:
    """(x, [Sub, ReduceMean]) if ``d`` is x - mean(x) over the last axis, the axis kept."""
    sub = d.producer() if d is not None else None
    if sub is None or sub.op_type != "Sub" or sub.domain not in ("", "ai.onnx"):
        return None
    x, m = sub.inputs[0], sub.inputs[1]
    mean = _last_axis_mean(m, x)
    return (x, [sub, mean]) if mean is not None else None


def _match_layernorm(out: ir.Node) -> tuple[ir.Value, float, list[ir.Node]] | None:
    """(x, eps, the chain's nodes) if ``out`` ends a decomposed LayerNorm: d = x - mean(x), then
    d / Sqrt(var + eps) or d * Reciprocal(Sqrt(var + eps)), var = mean(d'^2) (mean kept or put back by a
    reshape) where d' is d itself or x - mean(x) computed again (torch.var(x) beside x - x.mean())."""
    for d, chain, sqrt in _inverse_root(out):
        centered = _centered(d)
        if centered is None or not _normalizable(centered[0]):
            continue
        x = centered[0]
        for s, eps, add in _plus_eps(sqrt):
            var = _kept_mean(s)
            square = var[0].inputs[0] if var else None
            d2 = _square_of(square) if square is not None else None
            again = _centered(d2) if d2 is not None and d2 is not d else None
            if d2 is None or (d2 is not d and (again is None or again[0] is not x)):
                continue
            nodes = chain + add + var[::-1] + [square.producer()] + (again[1] if again else []) + centered[1]
            if _closed(nodes, out):
                return x, eps, nodes
    return None


def _affine_tail(out: ir.Node, d: int) -> tuple[ir.Node, ir.Value | None, ir.Value | None, list[ir.Node]]:
    """``out`` followed by Mul(., w) [Add(., b)] with w, b constant vectors of size ``d``: the last node, w, b."""
    last, w, b, taken = out, None, None, []
    for op in ("Mul", "Add"):
        uses = list(last.outputs[0].uses())
        if len(uses) != 1:
            break
        user = uses[0].node
        if user.op_type != op or user.domain not in ("", "ai.onnx"):
            break
        other = user.inputs[1] if user.inputs[0] is last.outputs[0] else user.inputs[0]
        c = _const(other)
        if c is None or c.shape != (d,):
            break
        if op == "Mul":
            w = other
        else:
            b = other
        last = user
        taken.append(user)
    return last, w, b, taken


def fuse_inline_layernorm(model: ir.Model) -> int:
    """Replace every matched decomposed LayerNorm (and its constant affine tail) by one LayerNormalization;
    returns how many."""

    def layernorm(graph: ir.Graph, node: ir.Node, x: ir.Value, eps: float):
        d = x.shape[-1]
        last, w, b, tail = _affine_tail(node, d)
        name = last.outputs[0].name
        if w is None:
            w = _initializer(graph, f"{name}_ln_scale", np.ones(d, dtype=x.dtype.numpy()), x.dtype)
        if b is None:
            b = _initializer(graph, f"{name}_ln_bias", np.zeros(d, dtype=x.dtype.numpy()), x.dtype)
        new = ir.Node("", "LayerNormalization", [x, w, b],
                      ir.convenience.convert_attributes({"axis": -1, "epsilon": eps}), num_outputs=1)
        return new, last, tail

    return _fuse_each(model.graph, _match_layernorm, layernorm)


def _fuse_each(graph: ir.Graph, match, build) -> int:
    """For every node ``match`` recognizes as the end of a chain (x, eps, nodes): ``build(graph, node, x, eps)``
    gives (the fused node, the chain's last node, more nodes it absorbs), which replaces them. Returns the count."""
    fused = 0
    for node in list(graph):
        if node.graph is None:  # removed as part of an earlier match
            continue
        hit = match(node)
        if hit is None:
            continue
        x, eps, chain = hit
        new, last, more = build(graph, node, x, eps)
        new.outputs[0].shape, new.outputs[0].type = last.outputs[0].shape, last.outputs[0].type
        _swap_in(graph, chain + more, last, new)
        fused += 1
    return fused


def _initializer(graph: ir.Graph, name: str, array: np.ndarray, dtype: ir.DataType) -> ir.Value:
    v = ir.Value(name=name, shape=ir.Shape(list(array.shape)), type=ir.TensorType(dtype),
                 const_value=ir.tensor(array, name=name))
    graph.register_initializer(v)
    return v


def _swap_in(graph: ir.Graph, chain: list[ir.Node], last: ir.Node, new: ir.Node) -> None:
    """The chain's nodes out, ``new`` in at ``last``; readers (and a graph output) rewired; the constants only
    the chain read dropped."""
    consts = {v for n in chain for v in n.inputs if v is not None and v.is_initializer()} - set(new.inputs)
    ir.convenience.replace_nodes_and_values(graph, last, chain, [new], last.outputs[:1], new.outputs[:1])
    for v in consts:  # eps, the exponent, the axes: dropped once nothing else reads them
        if not v.uses() and not v.is_graph_input() and not v.is_graph_output():
            del graph.initializers[v.name]


def fuse_inline_rms(model: ir.Model) -> int:
    """Replace every matched decomposed RMSNorm by a normconv.RMSNorm placeholder (with a scale of ones); returns
    how many were replaced. Call before ``lower_norm_ops``."""

    def rmsnorm(graph: ir.Graph, node: ir.Node, x: ir.Value, eps: float):
        d = x.shape[-1]
        ones = _initializer(graph, f"{node.outputs[0].name}_rms_scale", np.ones(d, dtype=x.dtype.numpy()), x.dtype)
        new = ir.Node(DOMAIN, "RMSNorm", [x, ones],
                      ir.convenience.convert_attributes({"axes": [-1], "epsilon": eps}), num_outputs=1)
        return new, node, []

    fused = _fuse_each(model.graph, _match_rms, rmsnorm)
    if fused:
        model.opset_imports.setdefault(DOMAIN, 1)
    return fused
