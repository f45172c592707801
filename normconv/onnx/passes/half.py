"""Half precision for an ONNX file (``--dtype float16``): weights and activations in float16, the graph's inputs and
outputs as the file declares them (a Cast at each boundary), norm statistics in float32.

  x_16 = Cast(x);  every op in float16 (onnxruntime's float16 converter), but:
  fused norms       compute their statistics in float32 whatever --keep-fp32 says (stash_type = 1; the function
                    ops cast to float32 inside), as the torch path's half export does
  --keep-fp32 auto  also keeps in float32 (between Casts) every node whose constant weights are beyond float16's
                    range (|w| > 65504, e.g. a folded γ/sqrt(σ² + ε) of a tiny running variance) and the decomposed
                    statistics no rule fused (ReduceMean, ReduceSum, Pow, Mul(x, x), Sqrt, Reciprocal: x² overflows
                    float16 past |x| = 256)
  --keep-fp32 all   every norm op too (LayerNormalization, BatchNormalization, ...) in float32 between Casts
  --keep-fp32 none  nothing beyond the fused ops' own float32 statistics

A graph output no node makes keeps its name and its type: an initializer (a returned parameter) is renamed and read
by an Identity that makes the output (the converter's output Cast then takes the Identity's output); a graph input
returned as it is stays out of the conversion and is returned as it was.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from normconv.onnx.passes.dangling import defined_names, free_name

FP16_MAX = 65504.0
KEEP = ("auto", "none", "all")
_STATISTICS = ("ReduceMean", "ReduceSum", "ReduceSumSquare", "Pow", "Sqrt", "Reciprocal")
_NORMS = ("LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization", "GroupNormalization",
          "InstanceNormalization", "BatchNormalization", "RMSNorm", "GroupNorm", "SkipLayerNormalization",
          "SkipSimplifiedLayerNormalization")


def _beyond_fp16(node: ir.Node) -> bool:
    for v in node.inputs:
        if v is not None and v.const_value is not None and v.dtype == ir.DataType.FLOAT:
            a = v.const_value.numpy()
            if a.size and float(np.abs(a).max()) > FP16_MAX:
                return True
    return False


class HalfPrecision(ir.passes.FunctionalPass):
    """Return the model in float16 (module docstring); ``kept`` names the nodes left in float32."""

    def __init__(self, keep: str = "auto") -> None:
        super().__init__()
        self.keep, self.kept = keep, []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

        for i, node in enumerate(ir.traversal.RecursiveGraphIterator(model.graph)):
            node.name = node.name or f"normconv_node_{i}"  # the converter keeps nodes by name
        kept = []
        for node in model.graph:
            if self.keep == "all" and node.op_type in _NORMS:
                kept.append(node.name)
            elif self.keep in ("auto", "all") and (_beyond_fp16(node) or node.op_type in _STATISTICS or (
                    node.op_type == "Mul" and len(node.inputs) == 2 and node.inputs[0] is node.inputs[1])):
                kept.append(node.name)
        self.kept = kept
        passed = _made_by_nodes(model.graph)
        proto = ir.serde.serialize_model(model)
        half = convert_float_to_float16(proto, keep_io_types=True, disable_shape_infer=True,
                                        op_block_list=list(DEFAULT_OP_BLOCK_LIST), node_block_list=kept)
        out = ir.serde.deserialize_model(half)
        inputs = {v.name: v for v in out.graph.inputs}
        for i, name in passed:  # a graph input returned as it is: the input again, in its own type
            out.graph.outputs.insert(i, inputs[name])
        out.graph.sort()  # the converter appends the boundary Casts last
        return ir.passes.PassResult(out, True)


def _made_by_nodes(graph: ir.Graph) -> list[tuple[int, str]]:
    """Every graph output made by a node, for the converter, whose output Cast takes the output's name: an
    initializer renamed and read by an Identity that makes the output; a graph input taken out of the outputs.
    Returns the (position, name) of the inputs taken out, for the caller to put back."""
    taken, passed = None, []
    for i, v in reversed(list(enumerate(graph.outputs))):
        if v.producer() is not None:
            continue
        if v.is_graph_input():  # a pass-through: no Cast can take its name, which the input holds
            passed.append((i, v.name))
            graph.outputs.pop(i)
            continue
        taken = defined_names(graph) if taken is None else taken
        name, v.name = v.name, free_name(f"{v.name}_initializer", taken)
        taken.add(v.name)
        node = ir.node("Identity", [v], name=free_name(f"{name}_identity", taken),
                       outputs=[ir.Value(name=name, type=v.type, shape=v.shape)])  # typed: the converter casts it
        graph.append(node)
        graph.outputs[i] = node.outputs[0]
    return sorted(passed)
