"""How the hidden axis of a residual stream moves back through an op: one table row per op family.

A stream value v of shape (..., D, ...) has one hidden axis (the features a norm normalizes). Walking back from a
norm's input to the writers, each pass-through op y = op(x) maps y's hidden axis to x's:

  cast / dropout / identity          j = i                       (the value itself)
  transpose(d0, d1)                  j = d1 if i = d0, d0 if i = d1, else i
  permute(dims)                      j = dims[i]
  expand / repeat / broadcast_to     j = i - (rank y - rank x)   if x has the full width there (no copy along D)
  resample (upsample, interpolate)   j = i = 1                   channels first, weights summing to one per channel
  mean(dims, keepdim)                j = the kept input axis     if D is not reduced
  x + 0                              j = i
  table[idx], gather, select, slice, narrow, pad    j = the input axis behind i, if D is not indexed (or padded)
  view / reshape / flatten / ...     j with x.shape[j] = D and prod(x.shape[:j]) = prod(y.shape[:i])  (row-major)

A row of the table is (family, rule); ``back(cap, node, axis)`` is the lookup. Every rule keeps each hidden vector
whole (or copies whole vectors), so a zero mean over D before the op is a zero mean after it, and a rotation of D
commutes with it. ``source`` follows them, and scalar factors c * x (the same c for every feature), back to the op
that computes a value; ``unfold_back`` follows a hidden axis merged into a bigger one and split out again (MobileViT).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from normconv.graph.capture import Captured
from normconv.match import EXPAND, PAD, PICK, RESAMPLE, RESAMPLE_MODES, SWAP, TRANSPARENT, VIEW, call_name, permute_dims

Shape = tuple[int, ...]
# (cap, node, output hidden axis, input shape, output shape) -> the input's hidden axis, or None: not followed
Rule = Callable[[Captured, fx.Node, int, Shape, Shape], "int | None"]


def last(cap: Captured, v: Any) -> int | None:
    """The last axis of a value (where a stream keeps its hidden features), None without a shape."""
    shape = cap.shape(v)
    return len(shape) - 1 if shape else None


def prod(xs) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


# -- the rules ----------------------------------------------------------------------------------------------


def _swap(cap: Captured, node: fx.Node, axis: int, a: Shape, b: Shape) -> int | None:
    d0, d1 = (node.args[1], node.args[2]) if len(node.args) >= 3 else (0, 1)
    d0, d1 = d0 % len(b), d1 % len(b)
    return d1 if axis == d0 else d0 if axis == d1 else axis


def _permute(cap: Captured, node: fx.Node, axis: int, a: Shape, b: Shape) -> int | None:
    return int(permute_dims(node)[axis]) % len(a)


def _expand(cap: Captured, node: fx.Node, axis: int, a: Shape, b: Shape) -> int | None:
    j = axis - (len(b) - len(a))
    return j if j >= 0 and a[j] == b[axis] else None


_MODES = RESAMPLE_MODES


def _resample(cap: Captured, node: fx.Node, axis: int, a: Shape, b: Shape) -> int | None:
    if call_name(node) in ("interpolate", "upsample") and node.kwargs.get("mode", "nearest") not in _MODES:
        return None  # a mode whose weights do not sum to one (or an unknown one): not followed
    return axis if axis == 1 and len(a) == len(b) > 2 and a[1] == b[1] else None


def _mean(cap: Captured, node: fx.Node, axis: int, a: Shape, b: Shape) -> int | None:
    """mean(x, dims, keepdim): the input axis behind output ``axis`` if the hidden axis is not reduced."""
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")  # x.mean(dim=1): a keyword in a trace
    if dims is None:
        return None  # a mean over every axis reduces the hidden one
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    if not all(isinstance(d, int) for d in dims):
        return None
    rank = len(a)
    dims = {d % rank for d in dims}
    keep = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    kept = [i for i in range(rank) if keep or i not in dims]
    j = kept[axis] if axis < len(kept) else None
    return j if j is not None and j not in dims else None


def _plus_zero(cap: Captured, node: fx.Node, axis: int, a: Shape, b: Shape) -> int | None:
    ok = len(node.args) == 2 and isinstance(node.args[1], (int, float)) and node.args[1] == 0 and a == b
    return axis if ok else None


def _aten_index(cap: Captured, node: fx.Node, axis: int, a: Shape, b: Shape) -> int | None:
    """aten.index(table, [idx]): one tensor on axis 0."""
    if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) and len(node.args[1]) == 1 \
            and isinstance(node.args[1][0], fx.Node):
        return _tensor_index(cap, node.args[1][0], axis, a, b)
    return None


def _tensor_index(cap: Captured, idx: fx.Node, axis: int, a: Shape, out: Shape) -> int | None:
    """table[idx], one integer tensor indexing axis 0: the output's axes are idx's, then the table's axes 1.. (a
    boolean mask, which flattens the axes it covers, is not followed)."""
    shape, dtype = cap.shape(idx), cap.dtype(idx)
    if shape is None or dtype is None or dtype.is_floating_point or dtype == torch.bool:
        return None
    lead = len(shape)
    if tuple(out[lead:]) != tuple(a[1:]):
        return None
    j = axis - lead + 1
    return j if 1 <= j < len(a) else None


def _gather(cap: Captured, node: fx.Node, axis: int, a: Shape, b: Shape) -> int | None:
    """gather(x, dim, idx) along another axis: ``axis`` if idx is the same for every feature of a row, i.e. copied
    from a tensor with size 1 there (ids.unsqueeze(-1).repeat(1, 1, D) / .expand): each output row is a row of x."""
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    idx = node.args[2] if len(node.args) > 2 else node.kwargs.get("index")
    if not isinstance(dim, int) or not isinstance(idx, fx.Node) or len(a) != len(b) or dim % len(a) == axis \
            or a[axis] != b[axis]:
        return None
    from_end = len(b) - axis  # axes align from the right through broadcasting copies
    v = idx
    while isinstance(v, fx.Node):
        shape = cap.shape(v)
        if shape is None:
            return None
        j = len(shape) - from_end
        if j < 0 or shape[j] == 1:
            return axis  # size 1 on the hidden axis: one index per row, copied to every feature
        if not (call_name(v) in EXPAND or cap.op(v) in TRANSPARENT) or not v.args:
            return None
        v = v.args[0]
    return None


def _pad(cap: Captured, node: fx.Node, axis: int, a: Shape, b: Shape) -> int | None:
    """F.pad / constant_pad_nd: ``axis`` if the hidden axis is not padded and the new rows are zeros (value 0) or
    copies of rows (reflect / replicate / circular): either way zero-mean."""
    pad = node.args[1] if len(node.args) > 1 else node.kwargs.get("pad")
    if call_name(node) == "constant_pad_nd":
        mode, value = "constant", node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    else:
        mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
        value = node.args[3] if len(node.args) > 3 else node.kwargs.get("value")
    if not isinstance(pad, (list, tuple)) or not all(isinstance(p, int) for p in pad) or len(a) != len(b) \
            or a[axis] != b[axis]:
        return None
    k = len(a) - 1 - axis  # pad pairs run from the last axis backwards
    if 2 * k + 1 < len(pad) and (pad[2 * k] or pad[2 * k + 1]):
        return None
    if mode not in ("constant", "reflect", "replicate", "circular") or (mode == "constant" and value not in (None, 0)):
        return None
    return axis


def _pick(cap: Captured, node: fx.Node, axis: int, a: Shape, b: Shape) -> int | None:
    """x[idx] / select / slice / narrow / index_select: the input axis behind output ``axis`` if the hidden axis is
    not indexed (picking rows on other axes keeps every hidden vector)."""
    name, rank = call_name(node), len(a)
    if name == "getitem" and len(node.args) > 1 and isinstance(node.args[1], fx.Node):
        return _tensor_index(cap, node.args[1], axis, a, b)  # table[positions]: one tensor index, axis 0
    if name != "getitem":  # aten.select(x, dim, i), slice / narrow / index_select(x, dim, ...)
        dim = int(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % rank
        src = axis + 1 if name == "select" and axis >= dim else axis
        return src if src != dim and src < rank else None
    idx = node.args[1] if len(node.args) > 1 else None
    idx = idx if isinstance(idx, tuple) else (idx,)
    if not all(isinstance(i, (int, slice)) for i in idx) or len(idx) >= rank:
        return None  # tensors, None, Ellipsis: not followed; the hidden (last) axis must stay whole
    kept = [j for j, i in enumerate(idx) if not isinstance(i, int)] + list(range(len(idx), rank))
    return kept[axis] if axis < len(kept) else None


def _view(cap: Captured, node: fx.Node, axis: int, a: Shape, b: Shape) -> int | None:
    prefix = prod(b[:axis])
    return next((j for j in range(len(a)) if a[j] == b[axis] and prod(a[:j]) == prefix), None)


# the table: call-name family -> how the hidden axis moves back through it (families are disjoint)
ROWS: tuple[tuple[frozenset[str], Rule], ...] = (
    (SWAP, _swap),  # transpose(d0, d1): the hidden axis moves with the swap
    (frozenset({"permute"}), _permute),  # permute(dims): output axis i is input axis dims[i]
    (EXPAND, _expand),  # broadcast / repeat: axes align from the right; copying along the hidden axis is no pass
    (RESAMPLE, _resample),  # spatial resampling, channels first: a per-channel shift or zero mean stays one
    (frozenset({"mean"}), _mean),  # a mean over tokens keeps every token's zero mean (and a bias)
    (frozenset({"add", "sub"}), _plus_zero),  # x + 0 (CTRL adds a token-type term of 0)
    (frozenset({"index"}), _aten_index),  # table[idx]: idx's axes, then the table's other axes
    (frozenset({"gather"}), _gather),  # whole hidden vectors picked along another axis (ViT-MAE's masking)
    (PAD, _pad),  # rows added along other axes: zeros or copies of rows, zero-mean too
    (PICK, _pick),  # picking rows on other axes keeps every hidden vector
    (VIEW, _view),  # a reshape keeps the hidden axis whole iff same size and same prefix product
)
_RULE: dict[str, Rule] = {name: rule for names, rule in ROWS for name in names}


def back(cap: Captured, node: fx.Node, axis: int | None) -> int | None:
    """The axis of ``node``'s first input that becomes ``node``'s hidden ``axis``; None: not a pass-through op."""
    if axis is None or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if cap.op(node) in TRANSPARENT:  # cast / dropout / identity
        return axis
    a, b, rule = cap.shape(node.args[0]), cap.shape(node), _RULE.get(call_name(node))
    return rule(cap, node, axis, a, b) if a and b and rule is not None else None


def passes_through(cap: Captured, node: fx.Node) -> bool:
    """cast / dropout / identity, or a view whose last (hidden) axis is its input's last axis."""
    j = back(cap, node, last(cap, node))
    return j is not None and j == last(cap, node.args[0])


# -- following a value back to the op that computes it ------------------------------------------------------


def source(cap: Captured, v: Any, axis: int | None = None) -> tuple[Any, list[fx.Node], int | None]:
    """Walk back through pass-through ops: (the node computing the value, the pass-through nodes on the way,
    the hidden axis there)."""
    path = []
    axis = last(cap, v) if axis is None else axis
    while isinstance(v, fx.Node):
        j = back(cap, v, axis)
        scaled = scalar_operand(cap, v, axis) if j is None else None
        unfolded = unfold_back(cap, v, axis) if j is None and scaled is None else None
        if unfolded is not None:  # a chain of views that merges the hidden axis with others and splits it back
            path.extend(unfolded[1])
            v, axis = unfolded[0], unfolded[2]
            continue
        if j is None and scaled is None:
            break
        path.append(v)
        v, axis = (v.args[0], j) if j is not None else (scaled, axis)
    return v, path, axis


def unfold_back(cap: Captured, v: fx.Node, axis: int | None) -> tuple[fx.Node, list[fx.Node], int] | None:
    """MobileViT's patch unfolding, (B, C, H, W) -> (B*C*h, p, w, p) -> ... -> (B*p*p, N, C): walking back through
    reshapes and transposes, the hidden axis may sit inside a merged dim as a block of D features with ``inner``
    elements after it there; the walk succeeds where it is a whole axis again: (that node, the views, its axis)."""
    shape = cap.shape(v)
    if axis is None or not shape:
        return None
    d, dim, inner, path = shape[axis], axis, 1, []
    while isinstance(v, fx.Node) and v.args and isinstance(v.args[0], fx.Node):
        a, b, name = cap.shape(v.args[0]), cap.shape(v), call_name(v)
        if not a or not b:
            return None
        if name in VIEW:  # row-major: the block is the same run of flat positions before and after a reshape
            after = inner * prod(b[dim + 1:])  # elements after the block in the flat layout
            j = next((j for j in range(len(a)) if prod(a[j + 1:]) <= after < prod(a[j:])), None)
            if j is None or after % prod(a[j + 1:]) or a[j] % (after // prod(a[j + 1:]) * d):
                return None
            dim, inner = j, after // prod(a[j + 1:])
        elif name in SWAP or name == "permute" or cap.op(v) in TRANSPARENT:  # whole dims move, the block with them
            dim = back(cap, v, dim)
            if dim is None:
                return None
        else:
            return None
        path.append(v)
        v = v.args[0]
        if inner == 1 and a[dim] == d:
            return v, path, dim
    return None


def scalar_operand(cap: Captured, node: fx.Node, axis: int | None) -> fx.Node | None:
    """x * c, c * x, x / c with c the same for every feature of a hidden vector and unchanged when the stream is
    centered: x, else None. Either one constant number (embed_scale, a one-element buffer), or a factor of size 1
    along the hidden axis computed from the inputs alone (an attention mask, (B, S, 1)).
    mean_d(c * x) = c * mean_d(x), so a zero-mean stream stays zero-mean."""
    if cap.op(node) not in ("mul", "div") or len(node.args) != 2:
        return None
    a, b = node.args
    pairs = [(a, b), (b, a)] if cap.op(node) == "mul" else [(a, b)]
    for x, c in pairs:
        if isinstance(x, fx.Node) and cap.shape(x) == cap.shape(node) and \
                (constant_scalar(cap, c) or cap.per_token_factor(c, cap.shape(node), axis)):
            return x
    return None


def constant_scalar(cap: Captured, v: Any) -> bool:
    """A Python number, or a parameter / buffer / lifted constant of one element (not computed from the input)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return True
    if not isinstance(v, fx.Node) or not (v.op == "get_attr" or (v.op == "placeholder" and not cap.is_input(v))):
        return False
    shape = cap.shape(v)
    return shape is not None and prod(shape) == 1
