"""Skip-norm fusion for onnxruntime (--target ort): a residual add feeding a norm becomes one contrib op.

  s = a + b;  y = LayerNorm(s) * g + beta   =>  y, _, _, s = com.microsoft.SkipLayerNormalization(a, b, g, beta)
  s = a + b;  y = RMSNorm(s) * g            =>  y, _, _, s = com.microsoft.SkipSimplifiedLayerNormalization(a, b, g)

The sum output (index 3) replaces the add's other uses, so a residual stream that continues past the norm
(pre-norm blocks) keeps its value. onnxruntime's kernel constraints, checked before fusing:
input and skip of rank 2 or 3 with the same shape and dtype, normalization over the last axis only,
gamma (and beta) 1-D of the hidden size.
"""

from __future__ import annotations

import onnx_ir as ir

from normconv.onnx.ops import MS_DOMAIN

_SKIP_OF = {"LayerNormalization": "SkipLayerNormalization",
            "SimplifiedLayerNormalization": "SkipSimplifiedLayerNormalization"}


def _dims(value: ir.Value) -> tuple | None:
    if value.shape is None:
        return None
    return tuple(d if isinstance(d, int) else str(d) for d in value.shape)


def _why_not(norm: ir.Node) -> str | None:
    """None when ``norm`` can absorb the add that feeds it, else why not."""
    x = norm.inputs[0]
    add = x.producer() if x is not None else None
    if add is None or add.op_type != "Add" or add.domain != "":
        return "input is not an add"
    a, b = add.inputs[0], add.inputs[1]
    if a is None or b is None or a is b:
        return "add of a value with itself"
    da, db = _dims(a), _dims(b)
    if da is None or db is None or da != db:
        return f"add operands differ in shape ({da} vs {db}): a broadcast add"
    if len(da) not in (2, 3):
        return f"rank {len(da)} input (onnxruntime's kernel takes rank 2 or 3)"
    if a.dtype != b.dtype:
        return "add operands differ in dtype"
    axis = norm.attributes.get("axis")
    axis = axis.value if axis is not None else -1
    if axis not in (-1, len(da) - 1):
        return f"normalizes from axis {axis}, the fused kernel only the last axis"
    for p in norm.inputs[1:3]:
        if p is not None and (p.shape is None or len(p.shape) != 1):
            return "scale or bias is not 1-D"
    if any(o.uses() for o in norm.outputs[1:]):
        return "the norm's mean / inverse-std outputs are used"
    return None


def fuse_skip_norms(model: ir.Model) -> list[tuple[str, bool, str]]:
    """Fuse add -> norm pairs in place; returns (norm node name, fused, reason) for every candidate norm."""
    graph = model.graph
    done: list[tuple[str, bool, str]] = []
    for norm in list(graph):
        if norm.domain != "" or norm.op_type not in _SKIP_OF:
            continue
        why = _why_not(norm)
        if why is not None:
            done.append((norm.name or norm.op_type, False, why))
            continue
        add = norm.inputs[0].producer()
        total = add.outputs[0]
        eps = norm.attributes.get("epsilon")
        attrs = {"epsilon": float(eps.value) if eps is not None else 1e-5}
        inputs = [add.inputs[0], add.inputs[1], norm.inputs[1]]
        if norm.op_type == "LayerNormalization" and len(norm.inputs) > 2 and norm.inputs[2] is not None:
            inputs.append(norm.inputs[2])  # beta
        # sum used beyond this norm  =>  expose it as output 3
        others = [u for u in total.uses() if u.node is not norm] or total.is_graph_output()
        outputs = [ir.Value()]
        if others:
            outputs += [ir.Value(name=""), ir.Value(name=""), ir.Value()]
        fused = ir.Node(MS_DOMAIN, _SKIP_OF[norm.op_type], inputs, ir.convenience.convert_attributes(attrs),
                        outputs=outputs, name=norm.name)
        old_values = [norm.outputs[0]] + ([total] if others else [])
        new_values = [outputs[0]] + ([outputs[3]] if others else [])
        ir.convenience.replace_nodes_and_values(graph, norm, [add, norm], [fused], old_values, new_values)
        done.append((norm.name or norm.op_type, True, f"{add.name or 'Add'} + {norm.op_type} -> {fused.op_type}"
                     + ("; sum exposed for its other uses" if others else "")))
    if any(f for _, f, _ in done):
        model.opset_imports.setdefault(MS_DOMAIN, 1)
        graph.sort()  # a use of the sum may sit between the add and the norm
    return done
