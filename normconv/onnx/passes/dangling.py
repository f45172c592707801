"""Constants a rewrite made but never registered, registered (an onnx-ir pass).

onnxscript's rewriter (0.7.2) adds a rule's new initializers by name: when the name is taken, the new value replaces
the old one in ``graph.initializers``, and the old value, still read by its nodes, is left out. Its own
``FuseMinMaxToClip`` names the bounds ``{x}_min`` / ``{x}_max`` of the clipped input, so two clips of one tensor
(timm's Gemma-4 ViT clamps the normed input of q, k and v) collide, and ``torch.onnx.export``'s optimizer writes a
file whose nodes read a tensor nothing defines (onnx.checker: "not topologically sorted"; onnxruntime does not load
it). A rule of normconv's own that names an initializer after a weight can meet a file that already holds the name.

The value a node reads still holds its tensor (``const_value``): giving it a free name and registering it in the
main graph (visible to every subgraph) writes the graph the rewrite meant, bit for bit. A read value with no
producer, no tensor and no place as an input is left as it is: nothing can say what it held, and the checker names it.
"""

from __future__ import annotations

import onnx_ir as ir


class RegisterDangling(ir.passes.InPlacePass):
    """After the call, ``made`` names the values registered."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.made: list[str] = []
        graph = model.graph
        taken: set[str] | None = None
        for node in ir.traversal.RecursiveGraphIterator(graph):
            for v in node.inputs:
                # defined: made by a node, an input of its graph, or an initializer
                if v is None or v.producer() is not None or v.is_graph_input() or v.is_initializer():
                    continue
                # unknowable: no tensor to register
                if v.const_value is None:
                    continue
                if taken is None:
                    taken = defined_names(graph)
                # a dangling constant: a free name, registered in the main graph
                v.name = free_name(v.name or "constant", taken)
                taken.add(v.name)
                graph.initializers.add(v)
                self.made.append(v.name)
        return ir.passes.PassResult(model, bool(self.made))


def defined_names(graph: ir.Graph) -> set[str]:
    """Every name a value of the graph or its subgraphs is defined under (not the names of dangling reads)."""
    names = set(graph.initializers) | {v.name for v in graph.inputs if v.name}
    for node in ir.traversal.RecursiveGraphIterator(graph):
        names.update(v.name for v in node.outputs if v.name)
        if node.graph is not None and node.graph is not graph:
            names.update(v.name for v in node.graph.inputs if v.name)
            names.update(node.graph.initializers)
    return names


def free_name(name: str, taken: set[str]) -> str:
    if name not in taken:
        return name
    i = 1
    while f"{name}_{i}" in taken:
        i += 1
    return f"{name}_{i}"
