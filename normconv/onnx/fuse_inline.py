"""Inline RMSNorms fused in the exported ONNX graph: the decomposed form an RMSNorm written inside a bigger module
leaves after torch.onnx.export (Mamba2's gated norm: the module also gates and regroups, so it is not replaced in
torch), matched op by op and replaced by normconv's RMSNorm placeholder (lowered like the others, per target/opset):

    y = x * Reciprocal(Sqrt(ReduceMean(x^2, axes=[-1], keepdims=1) + eps))      (x^2: Pow(x, 2) or Mul(x, x))
    y = x / Sqrt(ReduceMean(x^2, axes=[-1], keepdims=1) + eps)
        =>  y = normconv.RMSNorm(x, ones(D), axes=[-1], epsilon=eps)           (D = x's last dim)

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


def _match(out: ir.Node) -> tuple[ir.Value, float, list[ir.Node]] | None:
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
        eps = None
        for m, e in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
            value = _const(e)
            mean = _only(m, "ReduceMean")
            if value is not None and value.size == 1 and mean is not None:
                eps = float(value.reshape(-1)[0])
                break
        if eps is None:
            continue
        axes = _const(mean.inputs[1]) if len(mean.inputs) > 1 and mean.inputs[1] is not None else _attr(mean, "axes")
        if axes is None or int(_attr(mean, "keepdims", 1)) != 1:
            continue
        if _square_of(mean.inputs[0]) is not x or x.shape is None or x.dtype is None:
            continue
        rank, last = len(x.shape), x.shape[-1]
        if [int(a) % rank for a in np.asarray(axes).reshape(-1)] != [rank - 1] or not isinstance(last, int):
            continue
        if x.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE):
            continue
        return x, eps, chain + [add, mean, mean.inputs[0].producer()]  # out .. x^2
    return None


def fuse_inline_rms(model: ir.Model) -> int:
    """Replace every matched decomposed RMSNorm by a normconv.RMSNorm placeholder (with a scale of ones); returns
    how many were replaced. Call before ``lower_norm_ops``."""
    graph = model.graph
    fused = 0
    for node in list(graph):
        if node.graph is None:  # removed as part of an earlier match
            continue
        hit = _match(node)
        if hit is None:
            continue
        x, eps, chain = hit
        d = x.shape[-1]
        ones = ir.Value(name=f"{node.outputs[0].name}_rms_scale", shape=ir.Shape([d]),
                        type=ir.TensorType(x.dtype),
                        const_value=ir.tensor(np.ones(d, dtype=x.dtype.numpy()), name=f"{node.outputs[0].name}_rms_scale"))
        graph.register_initializer(ones)
        new = ir.Node(DOMAIN, "RMSNorm", [x, ones],
                      ir.convenience.convert_attributes({"axes": [-1], "epsilon": eps}), num_outputs=1)
        new.outputs[0].shape, new.outputs[0].type = node.outputs[0].shape, node.outputs[0].type
        consts = {v for n in chain for v in n.inputs if v is not None and v.is_initializer()}
        # the chain's nodes out, the placeholder in at the chain's end; readers (and a graph output) rewired
        ir.convenience.replace_nodes_and_values(graph, node, chain, [new], node.outputs[:1], new.outputs[:1])
        for v in consts:  # eps, the exponent, the axes: dropped once nothing else reads them
            if not v.uses() and not v.is_graph_input() and not v.is_graph_output():
                del graph.initializers[v.name]
        fused += 1
    if fused:
        model.opset_imports.setdefault(DOMAIN, 1)
    return fused
