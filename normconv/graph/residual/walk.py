"""The residual stream behind a norm: the sum tree of residual adds, walked back from the norm's input.

  x_L = w_0 + w_1 + ... + w_L          (pre-LN: every sublayer adds its output w_l to the stream)
  mean_D(x_L) = sum_l mean_D(w_l)      so the stream is zero-mean if every leaf (writer) w_l is

The walk goes back from a norm's input through pass-through ops (``axes``: the hidden axis is tracked through
reshapes, transposes, scalar factors), adds (both operands; broadcasting from the right moves the hidden axis), a cat
along another axis and a per-token ``where`` (every part is a sum of its own), and stops at anything else: a leaf.
A leaf broadcast along the hidden axis has axis None (the same value added to every feature). The stream's values
(the adds and views between them) are what a rewrite of the writers changes; who else reads them decides whether it
may (``live_users``, ``stream_end``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch.fx as fx

from normconv.graph.capture import Captured
from normconv.graph.detect import NormSite
from normconv.match import CAT, LIKE, TEMPLATE, call_name

from .axes import last, passes_through, source

Leaf = tuple[Any, list[fx.Node], "int | None"]  # (the leaf, the pass-through nodes between it and the stream, axis)


def walk(cap: Captured, site: NormSite, memo: dict | None = None) -> tuple[set[str], list[Leaf]]:
    """Stream values (adds, cats and pass-through nodes between them) behind a norm, and the leaves of its sum
    tree with the hidden axis at each leaf (None: the leaf is broadcast along the hidden axis). ``memo``: one dict
    shared by the walks of one graph (``walks``), so that each (value, axis) is followed back once however many
    norms read the stream behind it."""
    memo = {} if memo is None else memo
    values: set[str] = set()
    leaves: list[Leaf] = []
    start = cap.nodes[site.input]
    stack: list[tuple[Any, int | None]] = [(start, last(cap, start))]
    seen: set[str] = set()
    while stack:
        v, axis = stack.pop()
        if isinstance(v, fx.Node):
            if v.name in seen:
                continue
            seen.add(v.name)
            step = memo.get((v.name, axis))
            if step is None:
                step = memo[(v.name, axis)] = _step(cap, v, axis)
        else:
            step = _step(cap, v, axis)
        names, parts, leaf = step
        if leaf is not None:
            leaves.append(leaf)
        else:
            values.update(names)
            stack.extend(parts)
    return values, leaves


def walks(cap: Captured, sites: Sequence[NormSite]) -> list[tuple[set[str], list[Leaf]]]:
    """``walk`` of each site, sharing what they follow back: linear in the depth, not quadratic (the stream
    behind the last of a 24-layer model's 49 norms is every earlier one's too)."""
    memo: dict = {}
    return [walk(cap, s, memo) for s in sites]


def _step(cap: Captured, v: Any, axis: int | None) -> tuple[tuple[str, ...], list[tuple[Any, int | None]],
                                                             Leaf | None]:
    """One value of the sum tree: (the stream values it passes, the operands to follow, None), or ((), [], the
    leaf) where the tree stops."""
    src, path, axis = source(cap, v, axis)
    is_add = isinstance(src, fx.Node) and cap.op(src) == "add" and len(src.args) >= 2 and \
        all(isinstance(a, fx.Node) for a in src.args[:2]) and src.kwargs.get("alpha", 1) == 1
    parts = cat_parts(cap, src, axis) if isinstance(src, fx.Node) else None
    if parts is not None:
        parts = [(a, axis) for a in parts]
    elif isinstance(src, fx.Node):
        parts = where_parts(cap, src, axis)
    names = tuple(n.name for n in path) + ((src.name,) if isinstance(src, fx.Node) else ())
    if is_add and axis is not None:
        rank = len(cap.shape(src) or ())
        operands = []
        for a in src.args[:2]:
            # x + y broadcasts from the right: y's hidden axis is rank(y) - rank(x) places lower
            ra = len(cap.shape(a) or ())
            j = axis - (rank - ra)
            ok = j >= 0 and (cap.shape(a) or ())[j:j + 1] == (cap.shape(src) or ())[axis:axis + 1]
            operands.append((a, j if ok else None))
        return names, operands, None
    if parts is not None:
        # cat along another axis, or a per-token choice (where): the mean over the hidden axis is zero iff it is
        # zero in every part
        return names, list(parts), None
    return (), [], (src, path, axis)


def cat_parts(cap: Captured, node: fx.Node, axis: int | None) -> list[fx.Node] | None:
    """The parts of a ``cat`` that joins along an axis other than the hidden one, else None."""
    if axis is None or call_name(node) not in CAT or not node.args:
        return None
    parts = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", node.kwargs.get("axis", 0))
    rank = len(cap.shape(node) or ())
    if not isinstance(parts, (list, tuple)) or not all(isinstance(p, fx.Node) for p in parts) or not rank:
        return None
    if int(dim) % rank == axis or any(len(cap.shape(p) or ()) != rank for p in parts):
        return None
    return list(parts)


def where_parts(cap: Captured, node: fx.Node, axis: int | None) -> list[tuple[fx.Node, int]] | None:
    """The tensors ``where(cond, a, b)`` picks whole hidden vectors from (cond the same along the hidden axis:
    Pocket-TTS puts a BOS vector at masked tokens), each with its hidden axis (operands broadcast from the right), a
    constant 0 left out; else None."""
    if axis is None or call_name(node) != "where" or len(node.args) != 3:
        return None
    out = cap.shape(node)
    if not out or not cap.broadcasts_along(node.args[0], out, axis):
        return None
    parts = []
    for v in node.args[1:]:
        shape = cap.shape(v) if isinstance(v, fx.Node) else None
        j = axis - (len(out) - len(shape)) if shape is not None else -1
        if shape is not None and j >= 0 and shape[j] == out[axis]:
            parts.append((v, j))
        elif not (isinstance(v, (int, float)) and v == 0):
            return None  # broadcast along the hidden axis, or a constant other than 0: not zero-mean vectors
    return parts


def live_users(cap: Captured, node: fx.Node) -> list[fx.Node]:
    """Users whose value is used (``Captured.live``: MBart's ``embeds[:, :, -1]`` read for its shape only is left
    dead by export); a use as a shape template (``bos.expand_as(x)``, ``zeros_like(x)``) reads no value."""
    return [u for u in cap.users(node) if u.name in cap.live and not template_use(u, node)]


def template_use(u: fx.Node, node: fx.Node) -> bool:
    """``u`` takes ``node`` only for its shape or dtype."""
    name = call_name(u)
    if name in LIKE:
        return True
    return name in TEMPLATE and len(u.args) == 2 and u.args[1] is node and u.args[0] is not node


def _onward(cap: Captured, node: fx.Node, users: Callable[[Captured, fx.Node], Sequence[fx.Node]]) -> Iterator[fx.Node]:
    """``node``, then every node its value reaches through adds and pass-through ops, depth first in user order, each
    once: the adds and pass-throughs (followed on to their ``users``) and the first node past them on each path."""
    seen, stack = set(), [node]
    while stack:
        v = stack.pop()
        if v.name in seen:
            continue
        seen.add(v.name)
        yield v
        if v is node or _carries(cap, v):  # the stream goes on through it
            stack.extend(reversed(users(cap, v)))


def _carries(cap: Captured, node: fx.Node) -> bool:
    """An add or a pass-through op: the stream's value goes on through it."""
    return cap.op(node) == "add" or passes_through(cap, node)


def stream_end(cap: Captured, node: fx.Node) -> fx.Node:
    """Past the last norm the stream may go on (adds, views): the first node that really reads it."""
    return next((v for v in _onward(cap, node, live_users) if not _carries(cap, v)), node)


def cat_on_last(cap: Captured, node: fx.Node) -> bool:
    """A cat joining along its last axis (where a stream keeps its hidden features)."""
    rank = len(cap.shape(node) or ())
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return bool(rank) and isinstance(dim, int) and dim % rank == rank - 1


def in_words(cap: Captured, node: fx.Node) -> str:
    """What a node is in the model's terms, never a graph node's name: the model's output, a layer (its module
    path), a parameter or buffer (its state_dict name), the add of a parameter (a norm's bias kept after it), a
    residual add, or the op and the module it runs in (the module path from the node's module stack)."""
    if node.op == "output":
        return "the model's output"
    if node.op == "call_module":
        return str(node.target)  # a layer called as a module: its path (a symbolic trace names the node so too)
    named = cap.describe(node)
    if named != node.name:
        return named  # a layer's own op: its module path
    param = cap.param_name(node)
    if param is not None:
        return param  # a parameter or buffer read as it is: its state_dict name
    where = cap.owner(node) or "the model's forward"
    op = cap.op(node) or call_name(node) or str(node.target)
    if op == "add" and len(node.args) >= 2:
        params = [cap.param_name(a) for a in node.args[:2]]
        param = next((p for p in params if p is not None), None)
        if param is not None:
            return f"the add of {param} in {where}"
        if all(isinstance(a, fx.Node) and cap.shape(a) == cap.shape(node) for a in node.args[:2]):
            return f"a residual add in {where}"
    return f"{op} in {where}"


def returned(cap: Captured, node: fx.Node) -> bool:
    """``node``'s value reaches the model's output through adds and pass-through ops alone."""
    return any(v.op == "output" for v in _onward(cap, node, Captured.users))
