"""Model-local ONNX functions (FunctionProto) inlined: every one (before an opset conversion), or the ones whose
norms their boundary hides from the rules.

A function's body is typed by its calls, not by ONNX's shape inference; a body called from several places is typed
by none (its calls may differ), and a constant its caller passes (a BatchNorm's statistics, a conv's weight, an
epsilon) is a formal input there, not a constant. So a norm written inside a function called twice, or one fed
its parameters by the call, cannot be fused or folded where it stands:

  calls of F (and of every function that calls F)  =>  F's body, once per call, in the caller   (onnx.inliner)

onnx.inliner renames the body's values per call and drops the functions no call is left to; the opset imports only
the inlined functions used are dropped too. onnxruntime inlines local functions when it loads a file, so the
inlined file runs as the input does (the flow validates it against the input all the same).
"""

from __future__ import annotations

from collections.abc import Collection

import onnx
import onnx.inliner

from normconv.errors import Code, NormconvError


def function_names(proto: onnx.ModelProto) -> list[str]:
    """The model-local functions, as domain.name."""
    return sorted(f"{f.domain}.{f.name}" if f.domain else f.name for f in proto.functions)


def with_callers(proto: onnx.ModelProto, ids: Collection[tuple[str, str]]) -> set[tuple[str, str]]:
    """``ids`` (domain, name) and every local function whose body calls one of them, through any depth."""
    calls = {(f.domain, f.name): {(n.domain, n.op_type) for n in _body_nodes(f)} for f in proto.functions}
    out = set(ids)
    while True:
        more = {f for f, called in calls.items() if f not in out and called & out}
        if not more:
            return out
        out |= more


def call_counts(proto: onnx.ModelProto) -> dict[tuple[str, str], int]:
    """How many times each local function's body runs once every call is inlined: its calls in the main graph, plus
    its calls in each function's body times that function's own count."""
    calls = {(f.domain, f.name): [(n.domain, n.op_type) for n in _body_nodes(f)] for f in proto.functions}
    direct = [(n.domain, n.op_type) for n in _all_nodes(proto.graph)]
    counts: dict[tuple[str, str], int] = {}

    def count(fn: tuple[str, str], seen: frozenset = frozenset()) -> int:
        if fn not in counts:
            counts[fn] = direct.count(fn) + sum(body.count(fn) * count(g, seen | {fn}) for g, body in calls.items()
                                                if g not in seen | {fn})
        return counts[fn]

    return {fn: count(fn) for fn in calls}


def inline_functions(proto: onnx.ModelProto, only: Collection[tuple[str, str]] | None = None) -> onnx.ModelProto:
    """``proto`` with its local functions inlined (``only``: these (domain, name), none else) and the opset imports
    only they used dropped; or one line naming the functions that cannot be inlined."""
    if not proto.functions:
        return proto
    names = function_names(proto) if only is None else sorted(f"{d}.{n}" if d else n for d, n in only)
    try:
        inlined = onnx.inliner.inline_local_functions(proto, convert_version=True) if only is None else \
            onnx.inliner.inline_selected_functions(proto, sorted(only))
    except Exception as exc:  # noqa: BLE001 - the inliner's message names the op
        why = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise NormconvError(f"its local function(s) {', '.join(names)} cannot be inlined (onnx.inliner: {why})",
                            Code.REFUSED) from None
    used = {n.domain for n in _all_nodes(inlined.graph)} | {n.domain for f in inlined.functions
                                                            for n in _body_nodes(f)}
    kept = [o for o in inlined.opset_import if o.domain in ("", "ai.onnx") or o.domain in used]
    del inlined.opset_import[:]
    inlined.opset_import.extend(kept)
    return inlined


def _body_nodes(fn: onnx.FunctionProto):
    for node in fn.node:
        yield node
        yield from _subgraph_nodes(node)


def _all_nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        yield from _subgraph_nodes(node)


def _subgraph_nodes(node: onnx.NodeProto):
    for attr in node.attribute:
        for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
            yield from _all_nodes(g)
