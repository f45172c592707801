"""Types and shapes inside ONNX functions, from their one call site (onnx-ir pass).

Shape inference stops at a function's boundary: inside its body values have no type, so no rule can read a rank
or a static size there. For a function called once, its formal inputs take the types and shapes of the call's
actual inputs, and each body node's outputs are inferred in order with onnx's per-node inference
(``onnx.shape_inference.infer_node_outputs``; constant inputs such as Reduce axes passed as data). A function
called from several places, whose calls may differ, is left as it is.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir


def _type_proto(v: ir.Value) -> onnx.TypeProto | None:
    if v.type is None:
        return None
    tp = onnx.TypeProto()
    ir.serde.serialize_type_into(tp, v.type)
    if v.shape is not None:
        ir.serde.serialize_shape_into(tp, v.shape)
    return tp


class TypeFunctionBodies(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        calls: dict = {}
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            key = (node.domain, node.op_type, node.overload)
            if key in model.functions:
                calls.setdefault(key, []).append(node)
        modified = False
        for key, fn in model.functions.items():
            if len(calls.get(key, [])) != 1:
                continue
            for formal, actual in zip(fn.inputs, calls[key][0].inputs):
                if actual is not None and formal.type is None:
                    formal.type, formal.shape = actual.type, actual.shape
            for node in fn:
                modified |= _infer(node, fn.opset_imports)
        return ir.passes.PassResult(model, modified)


def _infer(node: ir.Node, imports) -> bool:
    try:
        schema = onnx.defs.get_schema(node.op_type, imports.get(node.domain, 1), node.domain)
    except Exception:  # noqa: BLE001 - an op onnx has no schema for: its outputs stay untyped
        return False
    types, data = {}, {}
    for v in node.inputs:
        if v is None or not v.name:
            continue
        tp = _type_proto(v)
        if tp is not None:
            types[v.name] = tp
        if v.const_value is not None:
            data[v.name] = ir.serde.serialize_tensor(v.const_value)
    try:
        out = onnx.shape_inference.infer_node_outputs(
            schema, ir.serde.serialize_node(node), types, data,
            opset_imports=[onnx.helper.make_opsetid(d, int(v)) for d, v in imports.items()])
    except Exception:  # noqa: BLE001 - inference refuses: leave the outputs untyped
        return False
    done = False
    for v in node.outputs:
        tp = out.get(v.name)
        if tp is not None and v.type is None:
            v.type = ir.serde.deserialize_type_proto_for_type(tp)
            v.shape = ir.serde.deserialize_type_proto_for_shape(tp)
            done = True
    return done
