"""The exported graph named like the model: outputs after dict keys / ModelOutput fields (``logits``,
``last_hidden_state``, ``pooler_output``), dynamic dimensions ``batch`` / ``sequence`` / ``height`` / ``width``
(``io.dims.dim_name``; ``decoder_sequence`` for a decoder's inputs) instead of the exporter's ``s72``. Inputs already
carry the forward's argument names."""

from __future__ import annotations

import re
from typing import Any

import torch


def output_names(reference: Any, prefix: str = "") -> list[str]:
    """One name per tensor leaf, in the exporter's flattening order (dicts / ModelOutputs by key, tuples by index)."""
    if isinstance(reference, torch.Tensor):
        return [prefix or "output"]
    if isinstance(reference, dict):  # ModelOutput is an OrderedDict of its non-None fields
        return [n for k, v in reference.items() if v is not None
                for n in output_names(v, f"{prefix}_{k}" if prefix else str(k))]
    if isinstance(reference, (tuple, list)):
        return [n for i, v in enumerate(reference)
                for n in output_names(v, f"{prefix}_{i}" if prefix else f"output_{i}")]
    return []


def _rename(graph, value, name: str, taken: dict[str, Any]) -> None:
    other = taken.get(name)
    if other is not None and other is not value:
        other.name = f"{name}__{id(other) % 10000}"  # an intermediate that happened to carry the name
        taken[other.name] = other
    taken.pop(value.name, None)
    value.name = name
    taken[name] = value


def _all_values(graph):
    seen = {}
    for v in list(graph.inputs) + list(graph.initializers.values()):
        seen[id(v)] = v
    for node in graph:
        for v in node.outputs:
            seen[id(v)] = v
    for v in graph.outputs:
        seen[id(v)] = v
    return list(seen.values())


def _dim_names(graph, chosen: dict[str, str] | None = None) -> dict[str, str]:
    """exporter symbol -> batch / sequence / height / width ... read off the inputs (``io.dims.dim_name``); a name
    two symbols would share is prefixed with the input's name. ``chosen`` renames those (the user's --dim-name)."""
    import onnx_ir as ir

    from normconv.io.dims import dim_name

    names: dict[str, str] = {}
    for v in graph.inputs:
        if v.shape is None:
            continue
        floating = v.dtype is not None and v.dtype.is_floating_point()
        for axis, d in enumerate(v.shape):
            if not isinstance(d, ir.SymbolicDim) or d.value is None or d.value in names:
                continue
            want = dim_name(v.name, len(v.shape), axis, floating)
            name = (chosen or {}).get(want, want)
            names[d.value] = f"{v.name}_{want}" if name in names.values() else name
    return names


def name_graph(model, reference: Any, dim_names: dict[str, str] | None = None,
               dims: dict[str, str | int] | None = None) -> dict[str, Any]:
    """Rename the outputs and the dynamic dimensions of an onnx_ir model in place; returns what was renamed.
    ``dim_names``: the user's names for batch / sequence / height ...; ``dims``: exporter symbol -> name already
    chosen (``io.dims.name_dims``), else they are read off the graph's inputs."""
    import onnx_ir as ir

    graph = model.graph
    taken = {v.name: v for v in _all_values(graph) if v.name}
    done: dict[str, Any] = {"outputs": {}, "dims": {}}
    wanted = output_names(reference)
    distinct = len({id(v) for v in graph.outputs}) == len(graph.outputs)
    if distinct and len(wanted) == len(graph.outputs) and len(set(wanted)) == len(wanted):
        for v, name in zip(list(graph.outputs), wanted):
            if v.name != name and v not in list(graph.inputs):
                done["outputs"][v.name] = name
                _rename(graph, v, name, taken)
    dims = dims or _dim_names(graph, dim_names)
    fixed = {k: v for k, v in dims.items() if isinstance(v, int)}  # symbols held to one value: that number
    dims = {k: v for k, v in dims.items() if not isinstance(v, int)}
    if fixed:
        for v in _all_values(graph):
            if v.shape is not None and any(isinstance(d, ir.SymbolicDim) and d.value in fixed for d in v.shape):
                v.shape = ir.Shape([fixed[d.value] if isinstance(d, ir.SymbolicDim) and d.value in fixed else d
                                    for d in v.shape])
    if dims:
        pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(dims, key=len, reverse=True))) + r")\b")
        for v in _all_values(graph):
            if v.shape is None:
                continue
            new = [ir.SymbolicDim(pattern.sub(lambda m: dims[m.group(1)], d.value))
                   if isinstance(d, ir.SymbolicDim) and d.value is not None else d for d in v.shape]
            if any(isinstance(d, ir.SymbolicDim) and d.value is not None and pattern.search(d.value) for d in v.shape):
                v.shape = ir.Shape(new)
        done["dims"] = dims
    return done


__all__ = ["name_graph", "output_names"]
