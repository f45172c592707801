"""Inline norms fused in the exported ONNX graph: the decomposed form a norm written inside a bigger module leaves
after torch.onnx.export (Mamba2's gated RMSNorm: the module also gates and regroups, so it is not replaced in torch),
matched op by op; an RMSNorm becomes normconv's RMSNorm placeholder (lowered like the others, per target/opset):

    y = x * Reciprocal(Sqrt(ReduceMean(x^2, axes=[-1], keepdims=1) + eps))      (x^2: Pow(x, 2) or Mul(x, x))
    y = x / Sqrt(ReduceMean(x^2, axes=[-1], keepdims=1) + eps)
        =>  y = normconv.RMSNorm(x, ones(D), axes=[-1], epsilon=eps)           (D = x's last dim)
    d = x - ReduceMean(x, axes=[-1]);  y = d / Sqrt(ReduceMean(d^2, axes=[-1]) + eps)  [* w] [+ b]
        =>  y = LayerNormalization(x, w or ones(D), b or zeros(D), axis=-1, epsilon=eps)   (I-BERT's IntLayerNorm:
            a module returning (y, None), kept as written in torch)

Only the exact chain is matched: every intermediate value read once (by the next op of the chain), the reduction
over the last axis only, eps a constant scalar, x of a float type and a static last dim; anything else (a cast
inside, another reader of the mean) is left as it is. onnxruntime's validation against torch checks the result.
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


def _last_axis_mean(v: ir.Value, x: ir.Value | None = None) -> ir.Node | None:
    """The ReduceMean producing ``v``, over the last axis with keepdims=1, of ``x`` when given."""
    node = v.producer() if v is not None else None
    if node is None or node.op_type != "ReduceMean" or node.domain not in ("", "ai.onnx"):
        return None
    src = node.inputs[0]
    axes = _const(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else _attr(node, "axes")
    if axes is None or int(_attr(node, "keepdims", 1)) != 1 or src is None or src.shape is None:
        return None
    rank = len(src.shape)
    if [int(a) % rank for a in np.asarray(axes).reshape(-1)] != [rank - 1] or (x is not None and src is not x):
        return None
    return node


def _match_rms(out: ir.Node) -> tuple[ir.Value, float, list[ir.Node]] | None:
    """(x, eps, the chain's nodes) if ``out`` (a Mul or Div) ends a decomposed RMSNorm."""
    if out.domain not in ("", "ai.onnx") or out.op_type not in ("Mul", "Div") or len(out.inputs) != 2:
        return None
    candidates = ([(out.inputs[0], out.inputs[1]), (out.inputs[1], out.inputs[0])] if out.op_type == "Mul"
                  else [(out.inputs[0], out.inputs[1])])
    for x, r in candidates:
        chain = [out]
        if out.op_type == "Mul":
            recip = _only(r, "Reciprocal")
            sqrt = _only(recip.inputs[0], "Sqrt") if recip is not None else None
            chain += [recip, sqrt]
        else:
            sqrt = _only(r, "Sqrt")
            chain += [sqrt]
        add = _only(sqrt.inputs[0], "Add") if sqrt is not None else None
        if add is None:
            continue
        eps = mean = None
        for m, e in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
            value = _const(e)
            mean = _last_axis_mean(m) if len(m.uses()) == 1 else None
            if value is not None and value.size == 1 and mean is not None:
                eps = float(value.reshape(-1)[0])
                break
        if eps is None or _square_of(mean.inputs[0]) is not x or not _normalizable(x):
            continue
        return x, eps, chain + [add, mean, mean.inputs[0].producer()]  # out .. x^2
    return None


def _match_layernorm(out: ir.Node) -> tuple[ir.Value, float, list[ir.Node]] | None:
    """(x, eps, the chain's nodes) if ``out`` (a Div) is (x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps)."""
    if out.domain not in ("", "ai.onnx") or out.op_type != "Div":
        return None
    d, r = out.inputs[0], out.inputs[1]
    sub = d.producer() if d is not None else None
    if sub is None or sub.op_type != "Sub" or sub.domain not in ("", "ai.onnx") or len(d.uses()) != 2:
        return None  # d is read by the square and by this division, nothing else
    x, m = sub.inputs[0], sub.inputs[1]
    mean = _last_axis_mean(m, x)
    sqrt = _only(r, "Sqrt")
    if mean is None or len(m.uses()) != 1 or sqrt is None or not _normalizable(x):
        return None
    add = _only(sqrt.inputs[0], "Add")
    # sqrt(var + eps), or sqrt(var) where eps is 0 (the exporter drops the + 0)
    pairs = [(add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])] if add is not None else \
        [(sqrt.inputs[0], None)]
    for v, e in pairs:
        eps = _const(e) if e is not None else np.zeros(1)
        var = _last_axis_mean(v) if len(v.uses()) == 1 else None
        if eps is not None and eps.size == 1 and var is not None and _square_of(var.inputs[0]) is d:
            chain = [out, sqrt] + ([add] if add is not None else []) + [var, var.inputs[0].producer(), sub, mean]
            return x, float(eps.reshape(-1)[0]), chain
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
