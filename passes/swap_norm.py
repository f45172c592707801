"""Swap LayerNorm <-> RMSNorm, exactly where the residual stream allows it.

  LN(x) = LN(x - mean(x));  if every writer of the stream is zero-mean, mean(x) = 0 and
  LN_{g,b,eps}(x) = RMSNorm_{g,eps}(x) + b      (same eps; b folds into the consuming linears: c <- c + W b)
Pre-LN: center embeddings (row means) and each sublayer's output projection (W <- W - mean_rows W, b <- b - mean b).
  The stream is the sum tree of residual adds read by the norms; its leaves are the writers. Centering a writer
  changes every reader of the stream, so each stream value may be read only by the adds of the tree and by the
  (mean-invariant) LayerNorms being swapped.
  Writers past a multiplication: c * w(x) with c one constant number (embed_scale) keeps a zero mean: passed through;
  lambda * (W x + b) with lambda a constant per-feature Parameter (layer scale)  =>  W <- C diag(lambda) W,
  b <- C(lambda b), lambda <- ones (structure and keys kept); a product with a gate computed from the input has no
  weights-only rewrite (refused, naming it).
  A LayerNorm writing the stream (BLOOM, CLIP, Swin embeddings): mean(g n + b) = mean(g n) + mean(b) is zero for
  every input only if g is constant  =>  then b <- C b; otherwise refused. A norm module whose whole forward is one
  functional norm (OLMo: cast, F.layer_norm, cast back) is made a native module first (canonicalize).
Post-LN: the stream is re-normalized with a bias after every sublayer, so it is not zero-mean: approximate only.
RMSNorm -> LayerNorm: RMSNorm_{g,eps}(x) = LN_{g,0,eps}(x) when mean(x) = 0, i.e. when every writer is already
  zero-mean (a model this pass produced); otherwise approximate only.
Approximate (opt-in): a site that cannot be made exact is replaced as is (RMSNorm(g), b folded where possible);
  the output drift is measured and reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from normconv.clone import adopt, owned
from normconv.graph.detect import NormSite, find_norms
from normconv.graph.handwritten import owns_only
from normconv.graph.capture import Captured
from normconv.graph.match import TRANSPARENT, call_name as _fn_name
from normconv.nn.rmsnorm import RMSNorm
from normconv.report import PassResult, Site
from .base import replace_module

NAME = "swap"
_NORM_FORWARDS = (nn.LayerNorm.forward, nn.RMSNorm.forward, RMSNorm.forward)  # forwards that are the norm alone

# --to -> the norm kind it replaces
SOURCE_KIND = {"rmsnorm": "layernorm", "layernorm": "rmsnorm"}

# ops that forward their first input unchanged, as long as the hidden axis survives whole (shapes decide)
_VIEWS = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unflatten", "contiguous", "alias", "clone",
                    "squeeze", "unsqueeze", "view_as", "reshape_as"})
_EXPANDS = frozenset({"expand", "expand_as", "broadcast_to", "repeat", "tile"})  # copies along other axes
_SWAPS = frozenset({"transpose", "swapaxes", "swapdims", "t"})
_CATS = frozenset({"cat", "concat", "concatenate"})
# resampling over the spatial axes with weights summing to one (each channel alone): a per-position shift along the
# channels stays one, and a zero mean over the channels stays zero
_RESAMPLES = frozenset({"upsample_bilinear2d", "upsample_nearest2d", "upsample_bicubic2d", "interpolate"})

# Swin's patch merging: centering each part shifts the joined row by a vector that is not constant along it
_HIDDEN_CAT = ("the stream is joined along its hidden axis by {where} (patch merging): centering each part shifts "
               "the joined row unevenly, so no weights-only rewrite keeps the norm after it")

# a writer counts as zero-mean when |mean over the hidden dim| <= this * max |weight|
_ZERO_MEAN_RTOL = 1e-5


# ---------------------------------------------------------------------------------------------------------
# what the analysis finds


@dataclass(frozen=True)
class Writer:
    """A leaf of the stream's sum tree: an embedding lookup or a linear layer writing hidden-size rows."""

    node: str
    kind: str  # embedding | linear
    weight: str  # state_dict name the node reads
    bias: str | None
    layout: str  # rows: (V, D) embedding | out_in: (D, in) nn.Linear, conv | in_out: (in, D) addmm / HF Conv1D
    module: str  # owner module path
    dim: int = -1  # the weight's axis that indexes the hidden dim (centered along it); -1: from layout
    # kind param: the tensor itself is added (position embedding, class token); conv: output channels are hidden
    # kind norm: a LayerNorm with a constant scale; ``weight`` is its bias (None: none), the only tensor centered
    scale: str | None = None  # a per-feature scale multiplied after the writer (layer scale): folded in, then ones
    # nodes between the writer and the stream (the scaling mul and views before it), or that read its weights for
    # it (the nn.MultiheadAttention call whose attn_output is the writer)
    via: tuple[str, ...] = ()

    @property
    def axis(self) -> int:
        return self.dim if self.dim >= 0 else _dim(self.layout)


@dataclass(frozen=True)
class Consumer:
    """A linear that reads a norm's output and can absorb its bias b (c <- c + W b)."""

    node: str
    weight: str
    bias: str | None  # None: a bias parameter is added to ``module``
    layout: str
    module: str


@dataclass
class SitePlan:
    site: NormSite
    module: str | None  # the norm module to replace (None: written inline, not swappable)
    exact: bool
    reason: str
    stream: int | None = None  # index into Analysis.streams
    consumers: list[Consumer] = field(default_factory=list)  # where b goes (to rmsnorm, b != 0)
    beta_problem: str | None = None


@dataclass
class Stream:
    sites: list[int]
    values: set[str]
    writers: dict[str, Writer]
    problem: str | None = None
    unties: list[str] = field(default_factory=list)  # embedding modules whose tied weight is cloned first


@dataclass
class Analysis:
    to: str
    plans: list[SitePlan]
    streams: list[Stream]

    def sites(self, approximate: bool = False) -> list[Site]:
        out = []
        for p in self.plans:
            if p.exact:
                out.append(Site(NAME, p.site.target, True, p.reason))
            elif approximate and p.module is not None:
                out.append(Site(NAME, p.site.target, True, f"approximate ({p.reason})"))
            else:
                out.append(Site(NAME, p.site.target, False, p.reason))
        return out


# ---------------------------------------------------------------------------------------------------------
# graph helpers


def _last(cap: Captured, v: Any) -> int | None:
    shape = cap.shape(v)
    return len(shape) - 1 if shape else None


def _back(cap: Captured, node: fx.Node, axis: int | None) -> int | None:
    """The axis of ``node``'s first input that becomes ``node``'s hidden ``axis``; None: not a pass-through op."""
    if axis is None or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if cap.op(node) in TRANSPARENT:  # cast / dropout / identity
        return axis
    name, a, b = _fn_name(node), cap.shape(node.args[0]), cap.shape(node)
    if not a or not b:
        return None
    if name in _SWAPS:  # transpose(d0, d1)  =>  the hidden axis moves with the swap
        d0, d1 = (node.args[1], node.args[2]) if len(node.args) >= 3 else (0, 1)
        d0, d1 = d0 % len(b), d1 % len(b)
        return d1 if axis == d0 else d0 if axis == d1 else axis
    if name == "permute":  # permute(dims): output axis i is input axis dims[i]
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        return int(dims[axis]) % len(a)
    if name in _EXPANDS:  # broadcast / repeat: axes align from the right; copying along the hidden axis is no pass
        j = axis - (len(b) - len(a))
        return j if j >= 0 and a[j] == b[axis] else None
    if name in _RESAMPLES and (name != "interpolate" or
                               node.kwargs.get("mode", "nearest") in ("nearest", "bilinear", "bicubic")):
        return axis if axis == 1 and len(a) == len(b) > 2 and a[1] == b[1] else None
    if name == "mean" and len(node.args) > 1:  # a mean over tokens keeps every token's zero mean (and a bias)
        return _mean_back(node, axis, len(a))
    if name in ("add", "sub") and len(node.args) == 2 and isinstance(node.args[1], (int, float)) \
            and node.args[1] == 0 and a == b:  # x + 0 (CTRL adds a token-type term of 0)
        return axis
    if name == "index" and len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) \
            and len(node.args[1]) == 1 and isinstance(node.args[1][0], fx.Node):
        # table[idx] (aten.index with one tensor on axis 0): out = idx's axes then the table's other axes
        return _tensor_index_back(cap, node.args[1][0], axis, a, b)
    if name == "gather":  # whole hidden vectors picked along another axis (ViT-MAE's masking keeps some patches)
        return _gather_back(cap, node, axis, a, b)
    if name in ("pad", "constant_pad_nd"):  # rows added along other axes: zeros or copies of rows, zero-mean too
        return _pad_back(node, name, axis, a, b)
    if name in ("select", "slice", "narrow", "index_select", "getitem"):  # picking rows on other axes keeps every
        # hidden vector
        if name == "getitem" and len(node.args) > 1 and isinstance(node.args[1], fx.Node):
            return _tensor_index_back(cap, node.args[1], axis, a, b)  # table[positions]: one tensor index, axis 0
        return _index_back(node, name, axis, len(a), b)
    if name in _VIEWS:  # reshape keeps the hidden axis whole iff it has the same size and the same prefix product
        prefix = _prod(b[:axis])
        for j in range(len(a)):
            if a[j] == b[axis] and _prod(a[:j]) == prefix:
                return j
    return None


def _mean_back(node: fx.Node, axis: int, rank: int) -> int | None:
    """mean(x, dims, keepdim): the input axis behind output ``axis`` if the hidden axis is not reduced."""
    dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
    if not all(isinstance(d, int) for d in dims):
        return None
    dims = {d % rank for d in dims}
    keep = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    kept = [i for i in range(rank) if keep or i not in dims]
    j = kept[axis] if axis < len(kept) else None
    return j if j is not None and j not in dims else None


def _passes_through(cap: Captured, node: fx.Node) -> bool:
    """cast / dropout / identity, or a view whose last (hidden) axis is its input's last axis."""
    j = _back(cap, node, _last(cap, node))
    return j is not None and j == _last(cap, node.args[0])


def _index_back(node: fx.Node, name: str, axis: int, rank: int, out: tuple[int, ...]) -> int | None:
    """x[idx] / select / slice / narrow / index_select: the input axis behind output ``axis`` if the hidden axis is
    not indexed."""
    if name in ("select", "slice", "narrow", "index_select"):  # aten.select(x, dim, i), slice / narrow /
        # index_select(x, dim, ...)
        dim = int(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % rank
        src = axis + 1 if name == "select" and axis >= dim else axis
        return src if src != dim and src < rank else None
    idx = node.args[1] if len(node.args) > 1 else None
    idx = idx if isinstance(idx, tuple) else (idx,)
    if not all(isinstance(i, (int, slice)) for i in idx) or len(idx) >= rank:
        return None  # tensors, None, Ellipsis: not followed; the hidden (last) axis must stay whole
    kept = [j for j, i in enumerate(idx) if not isinstance(i, int)] + list(range(len(idx), rank))
    return kept[axis] if axis < len(kept) else None


def _gather_back(cap: Captured, node: fx.Node, axis: int, a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
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
        if not (_fn_name(v) in _EXPANDS or cap.op(v) in TRANSPARENT) or not v.args:
            return None
        v = v.args[0]
    return None


def _pad_back(node: fx.Node, name: str, axis: int, a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
    """F.pad / constant_pad_nd: ``axis`` if the hidden axis is not padded and the new rows are zeros (value 0) or
    copies of rows (reflect / replicate / circular): either way zero-mean."""
    pad = node.args[1] if len(node.args) > 1 else node.kwargs.get("pad")
    if name == "constant_pad_nd":
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


def _tensor_index_back(cap: Captured, idx: fx.Node, axis: int, a: tuple[int, ...], out: tuple[int, ...]) -> int | None:
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


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def _source(cap: Captured, v: Any, axis: int | None = None) -> tuple[Any, list[fx.Node], int | None]:
    """Walk back through pass-through ops: (the node computing the value, the pass-through nodes on the way,
    the hidden axis there)."""
    path = []
    axis = _last(cap, v) if axis is None else axis
    while isinstance(v, fx.Node):
        j = _back(cap, v, axis)
        scaled = _scalar_operand(cap, v, axis) if j is None else None
        unfolded = _unfold_back(cap, v, axis) if j is None and scaled is None else None
        if unfolded is not None:  # a chain of views that merges the hidden axis with others and splits it back
            path.extend(unfolded[1])
            v, axis = unfolded[0], unfolded[2]
            continue
        if j is None and scaled is None:
            break
        path.append(v)
        v, axis = (v.args[0], j) if j is not None else (scaled, axis)
    return v, path, axis


def _unfold_back(cap: Captured, v: fx.Node, axis: int | None) -> tuple[fx.Node, list[fx.Node], int] | None:
    """MobileViT's patch unfolding, (B, C, H, W) -> (B*C*h, p, w, p) -> ... -> (B*p*p, N, C): walking back through
    reshapes and transposes, the hidden axis may sit inside a merged dim as a block of D features with ``inner``
    elements after it there; the walk succeeds where it is a whole axis again: (that node, the views, its axis)."""
    shape = cap.shape(v)
    if axis is None or not shape:
        return None
    d, dim, inner, path = shape[axis], axis, 1, []
    while isinstance(v, fx.Node) and v.args and isinstance(v.args[0], fx.Node):
        a, b, name = cap.shape(v.args[0]), cap.shape(v), _fn_name(v)
        if not a or not b:
            return None
        if name in _VIEWS:  # row-major: the block is the same run of flat positions before and after a reshape
            after = inner * _prod(b[dim + 1:])  # elements after the block in the flat layout
            j = next((j for j in range(len(a)) if _prod(a[j + 1:]) <= after < _prod(a[j:])), None)
            if j is None or after % _prod(a[j + 1:]) or a[j] % (after // _prod(a[j + 1:]) * d):
                return None
            dim, inner = j, after // _prod(a[j + 1:])
        elif name in _SWAPS or name == "permute" or cap.op(v) in TRANSPARENT:  # whole dims move, the block with them
            dim = _back(cap, v, dim)
            if dim is None:
                return None
        else:
            return None
        path.append(v)
        v = v.args[0]
        if inner == 1 and a[dim] == d:
            return v, path, dim
    return None


def _scalar_operand(cap: Captured, node: fx.Node, axis: int | None) -> fx.Node | None:
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
                (_constant_scalar(cap, c) or cap.per_token_factor(c, cap.shape(node), axis)):
            return x
    return None


def _constant_scalar(cap: Captured, v: Any) -> bool:
    """A Python number, or a parameter / buffer / lifted constant of one element (not computed from the input)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return True
    if not isinstance(v, fx.Node) or not (v.op == "get_attr" or (v.op == "placeholder" and not cap.is_input(v))):
        return False
    shape = cap.shape(v)
    return shape is not None and _prod(shape) == 1


# ops whose second operand serves only as a shape / dtype template
_TEMPLATE_OF = frozenset({"expand_as", "view_as", "reshape_as", "type_as"})
_LIKE = frozenset({"zeros_like", "ones_like", "empty_like", "full_like"})


def _live_users(cap: Captured, node: fx.Node) -> list[fx.Node]:
    """Users whose value is used (``Captured.live``: MBart's ``embeds[:, :, -1]`` read for its shape only is left
    dead by export); a use as a shape template (``bos.expand_as(x)``, ``zeros_like(x)``) reads no value."""
    return [u for u in cap.users(node) if u.name in cap.live and not _template_use(u, node)]


def _template_use(u: fx.Node, node: fx.Node) -> bool:
    """``u`` takes ``node`` only for its shape or dtype."""
    name = _fn_name(u)
    if name in _LIKE:
        return True
    return name in _TEMPLATE_OF and len(u.args) == 2 and u.args[1] is node and u.args[0] is not node


def _param_readers(cap: Captured) -> dict[int, list[str]]:
    """id(tensor) -> the nodes that read it, ties included (torch.export names a tied tensor by one name)."""
    readers: dict[int, list[str]] = {}
    for n in cap.gm.graph.nodes:
        if n.op == "call_module":
            for _, p in cap.modules[n.target].named_parameters(remove_duplicate=False):
                readers.setdefault(id(p), []).append(n.name)
            continue
        name = cap.param_name(n)
        t = cap.tensor(name) if name is not None else None
        if t is not None:
            # W.T read by a matmul (FalconLinear): the matmul is the reader
            users = [v for u in cap.users(n) for v in (cap.users(u) if _param_transpose(cap, u) else [u])]
            readers.setdefault(id(t), []).extend(u.name for u in users)
    return readers


def _param_transpose(cap: Captured, node: Any) -> str | None:
    """The name of the 2-d parameter ``node`` transposes (W.T, W.t(), W.transpose(0, 1)), else None."""
    if not isinstance(node, fx.Node) or not node.args or _fn_name(node) not in ("numpy_T", "t", "transpose"):
        return None
    name, shape = cap.param_name(node.args[0]), cap.shape(node.args[0])
    if name is None or shape is None or len(shape) != 2:
        return None
    if _fn_name(node) == "transpose" and {int(d) % 2 for d in node.args[1:3]} != {0, 1}:
        return None
    return name


def _own_name(cap: Captured, module: str, name: str | None) -> str | None:
    """The name ``module`` holds a tensor by directly (``lm_head.weight``), else the name the graph used."""
    t = cap.tensor(name) if name else None
    mod = cap.modules.get(module)
    if t is None or mod is None:
        return name
    for attr, p in mod._parameters.items():
        if p is t:
            return f"{module}.{attr}" if module else attr
    return name


def _owns(cap: Captured, node: str, t: torch.Tensor) -> str | None:
    """The module computing ``node`` if it holds ``t`` as its own parameter (reads it by its own attribute)."""
    n = cap.nodes[node]
    path = n.target if n.op == "call_module" else cap.owner(n)
    mod = cap.modules.get(path)
    return path if mod is not None and any(p is t for p in mod._parameters.values()) else None


def _linear_of(cap: Captured, node: fx.Node) -> tuple[Any, str | None, str | None, str, str] | None:
    """(input, weight name, bias name, layout, module) of a linear node, or None."""
    if node.op == "call_module":
        mod = cap.modules.get(node.target)
        if isinstance(mod, nn.Linear) and node.args:
            bias = f"{node.target}.bias" if mod.bias is not None else None
            return node.args[0], f"{node.target}.weight", bias, "out_in", node.target
        return None
    name = _fn_name(node)
    if name == "addmm":  # HF Conv1D: addmm(bias, x, W) with W (in, out)
        if any(node.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")) or len(node.args) < 3:
            return None
        return node.args[1], cap.param_name(node.args[2]), cap.param_name(node.args[0]), "in_out", cap.owner(node)
    if name == "linear":
        w = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        x = node.args[0] if node.args else node.kwargs.get("input")
        if b is not None and cap.param_name(b) is None:
            return None
        return x, cap.param_name(w), cap.param_name(b), "out_in", cap.owner(node)
    if name == "matmul" and len(node.args) == 2:  # x @ W.T in an nn.Linear subclass (FalconLinear); its bias is
        w, owner = _param_transpose(cap, node.args[1]), cap.owner(node)  # added by a separate add, if any
        mod = cap.modules.get(owner)
        if w is not None and isinstance(mod, nn.Linear) and mod.weight is cap.tensor(w):
            return node.args[0], w, None, "out_in", owner
    return None


def _writer(cap: Captured, leaf: Any, axis: int | None = None, read=None) -> Writer | str:
    """The writer at a leaf of the stream's sum tree, or why it cannot be made zero-mean."""
    if not isinstance(leaf, fx.Node):
        return f"a constant ({leaf!r}) is added to the stream"
    if cap.is_input(leaf):
        return f"the stream starts at the model input {leaf.name!r}, which cannot be centered"
    if axis is None:  # x + c with c the same for every hidden feature: its mean is c, no weight to center
        return f"{cap.describe(leaf)} is broadcast along the hidden axis (the same value added to every feature)"
    pname = cap.param_name(leaf)
    if pname is not None and _unsaved(cap, _own_name(cap, cap.owner(leaf), pname)):
        # a non-persistent buffer (a sinusoidal table built in __init__) is not in the state_dict: a centered copy
        # would be lost by every state_dict save and rebuilt uncentered on load
        return (f"stream writer {cap.describe(leaf)} is the buffer {_own_name(cap, cap.owner(leaf), pname)}, which "
                f"the model does not save (persistent=False: rebuilt when it is constructed), so centering it would "
                f"not survive saving")
    if pname is not None:
        # a parameter / buffer added as is (position embedding, class token)  =>  center it along the hidden axis
        return Writer(leaf.name, "param", _own_name(cap, cap.owner(leaf), pname), None, "rows", cap.owner(leaf), axis)
    op = cap.op(leaf)
    if op == "conv":
        return _conv_writer(cap, leaf, axis)
    if op in ("embedding", "linear") and axis != _last(cap, leaf):
        return f"stream writer {cap.describe(leaf)} ({op}) reaches the stream with its features off the hidden axis"
    if op == "embedding":
        if leaf.op == "call_module":
            return Writer(leaf.name, "embedding", f"{leaf.target}.weight", None, "rows", leaf.target)
        w = leaf.args[0] if _fn_name(leaf) == "embedding" and leaf.op == "call_function" and \
            getattr(leaf.target, "overloadpacket", None) is not None else (leaf.args[1] if len(leaf.args) > 1 else None)
        name = cap.param_name(w)
        if name is not None:
            return Writer(leaf.name, "embedding", _own_name(cap, cap.owner(leaf), name), None, "rows", cap.owner(leaf))
    lin = _linear_of(cap, leaf) if op in ("linear", "matmul") else None
    if lin is not None and lin[1] is not None:
        return Writer(leaf.name, "linear", _own_name(cap, lin[4], lin[1]), _own_name(cap, lin[4], lin[2]), lin[3],
                      lin[4])
    mha = _mha_call(cap, leaf)
    if mha is not None:
        # attn_output of an nn.MultiheadAttention kept whole by the trace  =>  its out_proj writes the stream
        if axis != _last(cap, leaf):
            return f"stream writer {cap.describe(leaf)} (attention) reaches the stream with its features off the hidden axis"
        proj = cap.modules[mha].out_proj
        return Writer(leaf.name, "linear", f"{mha}.out_proj.weight", f"{mha}.out_proj.bias" if proj.bias is not None
                      else None, "out_in", f"{mha}.out_proj", via=(leaf.args[0].name,))  # the call reads out_proj
    if op == "mul":
        return _scaled_writer(cap, leaf, axis, read)
    if op == "layer_norm":
        return _norm_writer(cap, leaf, axis, read)
    name = _fn_name(leaf)
    if name in _CATS:
        return _HIDDEN_CAT.format(where=cap.describe(leaf))
    if name in _VIEWS | _SWAPS | {"permute"} and isinstance(leaf.args[0], fx.Node):
        # MobileViT's patch unfolding: (B, C, H, W) -> (B*C*h, p, w, p): the hidden axis is merged with others
        return (f"the stream comes from {cap.describe(leaf)}, a {name} {tuple(cap.shape(leaf.args[0]) or ())} -> "
                f"{tuple(cap.shape(leaf) or ())} whose input holds the hidden axis merged with other axes (patch "
                f"unfolding): swap follows only views that keep the hidden axis whole, so it cannot reach the writers")
    what = op or name or leaf.op
    if name in ("getitem", "getattr") and len(leaf.args) == 2 and isinstance(leaf.args[0], fx.Node) \
            and isinstance(leaf.args[1], (int, str)):
        # one output of a multi-output op: name that op (Hiera's max pooling, max(...).values)
        inner = leaf.args[0]
        what = f"output {leaf.args[1]} of {cap.op(inner) or _fn_name(inner) or inner.op} ({inner.name})"
    return (f"stream writer {cap.describe(leaf)} is {what}, not a linear layer or an embedding (nor a conv or a "
            f"parameter): it has no weights that center its output")


def _unsaved(cap: Captured, name: str | None) -> bool:
    """``name`` is a buffer its module registered with persistent=False (not in the state_dict)."""
    if not name:
        return False
    path, _, attr = name.rpartition(".")
    module = cap.modules.get(path)
    return module is not None and attr in getattr(module, "_non_persistent_buffers_set", ())


def _mha_call(cap: Captured, leaf: fx.Node) -> str | None:
    """The path of the nn.MultiheadAttention whose attn_output ``leaf`` is (``mha(q, k, v)[0]`` on a leaf call)."""
    if cap.op(leaf) != "getitem" or len(leaf.args) < 2 or leaf.args[1] != 0:
        return None
    call = leaf.args[0]
    if isinstance(call, fx.Node) and call.op == "call_module" and \
            isinstance(cap.modules.get(call.target), nn.MultiheadAttention):
        return call.target
    return None


def _scaled_writer(cap: Captured, leaf: fx.Node, axis: int, read=None) -> Writer | str:
    """y = lambda * w(x), lambda a constant per-feature scale (layer scale)  =>  the writer w with lambda folded in:
    C (diag(lambda) W) centers the product; lambda becomes ones (the model keeps its structure)."""
    out = cap.shape(leaf) or ()
    for x, lam in (leaf.args[:2], leaf.args[1::-1]) if len(leaf.args) == 2 else ():
        pname = cap.param_name(lam)
        shape = cap.shape(lam)
        if pname is None or shape is None or not isinstance(x, fx.Node) or cap.shape(x) != out:
            continue
        j = axis - (len(out) - len(shape))  # broadcast from the right: lambda's axis under the hidden one
        if j < 0 or shape[j] != out[axis] or _prod(shape) != out[axis]:
            continue
        src, path, inner_axis = _source(cap, x, axis)
        inner = _writer(cap, src, inner_axis, read)
        if isinstance(inner, str):
            return inner
        if inner.scale is not None or inner.kind == "norm":
            return f"stream writer {cap.describe(leaf)} scales {cap.describe(src)}, which is not a linear layer, " \
                   f"conv, embedding or parameter"
        chain = [src] + list(reversed(path)) + [leaf]
        for a, b in zip(chain, chain[1:]):
            if [u.name for u in _live_users(cap, a)] != [b.name]:
                other = next(u for u in _live_users(cap, a) if u is not b)
                return f"the output of stream writer {cap.describe(src)} is also read by {cap.describe(other)}"
        return replace(inner, scale=_own_name(cap, cap.owner(leaf), pname),
                       via=tuple(n.name for n in path) + (leaf.name,))
    a, b = (list(leaf.args) + [None, None])[:2]
    row = [v for v in (a, b) if cap.broadcasts_along(v, out, axis)]
    if row:  # a per-token factor (size 1 on the hidden axis) that weights compute: it may depend on the stream
        return (f"stream writer {cap.describe(leaf)} multiplies {_what(cap, a)} by {_what(cap, b)}, a per-token "
                f"factor that parameters compute (it may read the stream, which the swap changes): no weights-only "
                f"rewrite keeps it")
    return (f"stream writer {cap.describe(leaf)} multiplies {_what(cap, a)} by {_what(cap, b)}, computed from the "
            f"input and varying along the hidden axis (a gate): no weights-only rewrite makes it zero-mean")


def _what(cap: Captured, v: Any) -> str:
    return cap.describe(v) if isinstance(v, fx.Node) else repr(v)


def _norm_writer(cap: Captured, leaf: fx.Node, axis: int, read=None) -> Writer | str:
    """LayerNorm y = g * n + b writing the stream: mean(y) = mean(g * n) + mean(b), and mean(g * n) depends on the
    input unless g is constant; then centering b is the whole rewrite. ``read``: where g's values come from
    (default the captured model; a meta-device plan reads the checkpoint)."""
    read = read or cap.tensor
    where = cap.describe(leaf)
    if leaf.op == "call_module":
        mod, path = cap.modules[leaf.target], leaf.target
        shape = tuple(mod.normalized_shape)
        g = read(f"{path}.weight") if mod.elementwise_affine and mod.weight is not None else None
        b = f"{path}.bias" if getattr(mod, "bias", None) is not None else None
    else:
        args, path = list(leaf.args) + [None] * 4, cap.owner(leaf)
        shape = tuple(args[1] or ())
        g = read(cap.param_name(args[2])) if cap.param_name(args[2]) else None
        b = _own_name(cap, path, cap.param_name(args[3])) if args[3] is not None else None
        if (args[2] is not None and g is None) or (args[3] is not None and b is None):
            return f"stream writer {where} (layer_norm) computes its weight or bias instead of reading a parameter"
    if len(shape) != 1 or axis != _last(cap, leaf):
        return f"stream writer {where} (layer_norm) normalizes other dims than the stream's hidden axis"
    if g is not None and not bool((g.detach() == g.detach().flatten()[0]).all()):
        lo, hi = float(g.detach().min()), float(g.detach().max())
        return (f"stream writer {where} is a LayerNorm whose scale g varies ({lo:.3g}..{hi:.3g}): mean(g * n) "
                f"depends on the input unless g is constant, so no weights-only rewrite makes it zero-mean")
    return Writer(leaf.name, "norm", b, None, "rows", path, 0)


def _conv_writer(cap: Captured, leaf: fx.Node, axis: int) -> Writer | str:
    """conv y[:, o] = W[o] * x + b[o]  =>  zero mean over o iff W and b are centered over output channels."""
    where = cap.describe(leaf)
    if axis != 1:
        return f"stream writer {where} (conv) reaches the stream with axis {axis}, not its channels, as hidden axis"
    if leaf.op == "call_module":
        mod = cap.modules[leaf.target]
        w, b, path = f"{leaf.target}.weight", (f"{leaf.target}.bias" if mod.bias is not None else None), leaf.target
        groups, transposed = mod.groups, getattr(mod, "transposed", False)
    else:
        args = list(leaf.args) + [None] * 9
        if _fn_name(leaf) == "convolution":  # aten.convolution(x, w, b, stride, pad, dil, transposed, out_pad, groups)
            transposed, groups = bool(args[6]), int(args[8] or 1)
        else:  # conv2d(x, w, b, stride, padding, dilation, groups)
            transposed, groups = False, int(args[6] if args[6] is not None else leaf.kwargs.get("groups", 1))
        path = cap.owner(leaf)
        w = _own_name(cap, path, cap.param_name(args[1]))
        b = _own_name(cap, path, cap.param_name(args[2])) if args[2] is not None else None
        if w is None or (args[2] is not None and b is None):
            return f"stream writer {where} (conv) computes its weight or bias instead of reading a parameter"
    # groups: output channel o sees only its group's inputs, so centering W over o does not center y
    if groups != 1 or transposed:
        return f"stream writer {where} is a {'transposed' if transposed else 'grouped'} conv: no weight centering " \
               f"makes its output zero-mean over channels"
    return Writer(leaf.name, "conv", w, b, "out_in", path, 0)


def _norm_module(cap: Captured, site: NormSite) -> str | None:
    """Path of the norm module computing the site (module sites; our own RMSNorm traced as F.rms_norm)."""
    if site.source == "module":
        return site.target
    mod = cap.modules.get(site.owner)
    if not (site.source == "functional" and site.owner and isinstance(mod, (nn.LayerNorm, nn.RMSNorm))
            and not list(mod.children())):
        return None
    # a norm subclass whose own forward does more (DINOv3 ConvNeXt channels_first: permute, LayerNorm, permute
    # back) is replaceable only where that forward computed the norm call alone (ESM-C's cast back to the input's
    # dtype included: the replacement returns that dtype too)
    if type(mod).forward in _NORM_FORWARDS or owns_only(cap, site.owner, set(site.nodes) | _casts_back(cap, site)):
        return site.owner
    return None


def _casts_back(cap: Captured, site: NormSite) -> set[str]:
    """Pass-through ops right after the site (casts, identities) that give back the site input's dtype."""
    out, node = set(), cap.nodes[site.node]
    while len(cap.users(node)) == 1 and cap.op(cap.users(node)[0]) in TRANSPARENT and \
            cap.dtype(cap.users(node)[0]) == cap.dtype(cap.nodes[site.input]):
        node = cap.users(node)[0]
        out.add(node.name)
    return out


def _hidden(site: NormSite) -> int | None:
    shape = site.normalized_shape
    return shape[0] if shape is not None and len(shape) == 1 else None


# ---------------------------------------------------------------------------------------------------------
# analysis (what plan shows and what the pass applies)


def analyze(cap: Captured, norms: Sequence[NormSite], to: str = "rmsnorm",
            read: Callable[[str], torch.Tensor] | None = None) -> Analysis:
    """Plan the swap from the graph and shapes. The values it needs (is a norm's bias zero? is a writer already
    zero-mean?) come through ``read(state_dict name)``, by default the captured model's tensors: a plan made on
    the meta device reads them from the checkpoint instead (normconv.stream)."""
    read = read or (lambda name: cap.tensor(name))
    if to not in SOURCE_KIND:
        raise ValueError(f"unknown target norm {to!r}")
    kind = SOURCE_KIND[to]
    sites = [s for s in norms if s.kind == kind]
    readers = _param_readers(cap)
    plans = [SitePlan(s, _norm_module(cap, s), False, "") for s in sites]
    walks = [_walk(cap, s) for s in sites]
    streams = _streams(cap, sites, walks, readers, to, read)
    for i, p in enumerate(plans):
        p.stream = next((k for k, st in enumerate(streams) if i in st.sites), None)
    for p in plans:
        _decide(cap, p, streams, readers, to, read)
    # a norm module called at several sites is swapped at all of them or none
    by_module: dict[str, list[SitePlan]] = {}
    for p in plans:
        if p.module is not None:
            by_module.setdefault(p.module, []).append(p)
    for group in by_module.values():
        bad = next((p for p in group if not p.exact), None)
        if bad is not None and len(group) > 1:
            for p in group:
                if p.exact:
                    p.exact, p.reason = False, f"the same module is also called at {bad.site.node}: {bad.reason}"
    return Analysis(to, plans, streams)


def _walk(cap: Captured, site: NormSite) -> tuple[set[str], list[tuple[Any, list[fx.Node], int | None]]]:
    """Stream values (adds, cats and pass-through nodes between them) behind a norm, and the leaves of its sum
    tree with the hidden axis at each leaf (None: the leaf is broadcast along the hidden axis)."""
    values: set[str] = set()
    leaves: list[tuple[Any, list[fx.Node], int | None]] = []
    start = cap.nodes[site.input]
    stack: list[tuple[Any, int | None]] = [(start, _last(cap, start))]
    seen: set[str] = set()
    while stack:
        v, axis = stack.pop()
        if isinstance(v, fx.Node):
            if v.name in seen:
                continue
            seen.add(v.name)
        src, path, axis = _source(cap, v, axis)
        is_add = isinstance(src, fx.Node) and cap.op(src) == "add" and len(src.args) >= 2 and \
            all(isinstance(a, fx.Node) for a in src.args[:2]) and src.kwargs.get("alpha", 1) == 1
        parts = _cat_parts(cap, src, axis) if isinstance(src, fx.Node) else None
        if parts is not None:
            parts = [(a, axis) for a in parts]
        elif isinstance(src, fx.Node):
            parts = _where_parts(cap, src, axis)
        if is_add and axis is not None:
            values.update(n.name for n in path)
            values.add(src.name)
            rank = len(cap.shape(src) or ())
            for a in src.args[:2]:
                # x + y broadcasts from the right: y's hidden axis is rank(y) - rank(x) places lower
                ra = len(cap.shape(a) or ())
                j = axis - (rank - ra)
                ok = j >= 0 and (cap.shape(a) or ())[j:j + 1] == (cap.shape(src) or ())[axis:axis + 1]
                stack.append((a, j if ok else None))
        elif parts is not None:
            # cat along another axis, or a per-token choice (where): the mean over the hidden axis is zero iff it
            # is zero in every part
            values.update(n.name for n in path)
            values.add(src.name)
            stack.extend(parts)
        else:
            leaves.append((src, path, axis))
    return values, leaves


def _cat_parts(cap: Captured, node: fx.Node, axis: int | None) -> list[fx.Node] | None:
    """The parts of a ``cat`` that joins along an axis other than the hidden one, else None."""
    if axis is None or _fn_name(node) not in _CATS or not node.args:
        return None
    parts = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", node.kwargs.get("axis", 0))
    rank = len(cap.shape(node) or ())
    if not isinstance(parts, (list, tuple)) or not all(isinstance(p, fx.Node) for p in parts) or not rank:
        return None
    if int(dim) % rank == axis or any(len(cap.shape(p) or ()) != rank for p in parts):
        return None
    return list(parts)


def _where_parts(cap: Captured, node: fx.Node, axis: int | None) -> list[tuple[fx.Node, int]] | None:
    """The tensors ``where(cond, a, b)`` picks whole hidden vectors from (cond the same along the hidden axis:
    Pocket-TTS puts a BOS vector at masked tokens), each with its hidden axis (operands broadcast from the right), a
    constant 0 left out; else None."""
    if axis is None or _fn_name(node) != "where" or len(node.args) != 3:
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


def _streams(cap, sites, walks, readers, to, read) -> list[Stream]:
    """Group sites whose sum trees share a value or a writer parameter; check each group once."""
    parent = list(range(len(sites)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner_of: dict[Any, int] = {}
    leaf_writers: list[list[Writer | str]] = []
    for i, (values, leaves) in enumerate(walks):
        ws = [_writer(cap, leaf, axis, read) for leaf, _, axis in leaves]
        leaf_writers.append(ws)
        keys: list[Any] = list(values) + [id(cap.tensor(w.weight)) for w in ws if isinstance(w, Writer) and w.weight]
        for key in keys:
            if key in owner_of:
                parent[find(i)] = find(owner_of[key])
            else:
                owner_of[key] = i
    groups: dict[int, list[int]] = {}
    for i in range(len(sites)):
        groups.setdefault(find(i), []).append(i)
    streams = []
    for members in groups.values():
        st = Stream(members, set(), {})
        problems: list[str] = []
        chains: list[tuple[Any, list[fx.Node]]] = []
        for i in members:
            st.values |= walks[i][0]
            for (leaf, path, _), w in zip(walks[i][1], leaf_writers[i]):
                if isinstance(w, str):
                    problems.append(w)
                else:
                    st.writers[w.node] = w
                    chains.append((leaf, path))
        if not problems:
            problems += _check_writers(cap, st, chains, readers, sites, to, read)
        if not problems and to == "rmsnorm":
            problems += _check_readers(cap, st, sites)
        st.problem = problems[0] if problems else None
        streams.append(st)
    return streams


def _check_writers(cap, st: Stream, chains, readers, sites, to, read) -> list[str]:
    hidden = {_hidden(sites[i]) for i in st.sites}
    if len(hidden) != 1 or None in hidden:
        return ["the norm normalizes more than one dim (or streams of different widths meet)"]
    d = hidden.pop()
    problems = []
    for w in st.writers.values():
        if w.kind == "norm" and w.weight is None:  # a constant-scale LayerNorm without bias: zero-mean as it is
            continue
        t = cap.tensor(w.weight)
        dim = w.axis
        if t is None or t.dim() <= dim or (t.dim() != 2 and w.kind in ("linear", "embedding")) or t.shape[dim] != d:
            problems.append(f"stream writer {w.module or w.node} does not write {d}-wide rows")
    if problems or to == "layernorm":
        # RMSNorm -> LayerNorm edits no writer: it is exact only if they are zero-mean already
        for w in st.writers.values():
            if not problems:
                m = _writer_mean(w, read)
                if m is not None:
                    problems.append(f"stream writer {w.module or w.node} is not zero-mean (|mean| up to {m:.2g}), "
                                    f"so RMSNorm and LayerNorm differ on this stream")
        return problems
    # each writer's output flows only into the stream (its adds, or straight into the first norm)
    allowed = set(st.values).union(*(sites[i].nodes for i in st.sites))
    # a node on the way may feed several ways into the stream (a position table sliced into its class and patch
    # parts, both joined into the stream by cat): its users are the next nodes of every way
    nexts: dict[str, set[str]] = {}
    for leaf, path in chains:
        chain = [leaf] + list(reversed(path))
        for a, b in zip(chain, chain[1:]):
            nexts.setdefault(a.name, set()).add(b.name)
    for leaf, path in chains:
        chain = [leaf] + list(reversed(path))
        for a in chain[:-1]:
            other = next((u for u in _live_users(cap, a) if u.name not in nexts[a.name]), None)
            if other is not None:
                problems.append(f"the output of stream writer {cap.describe(leaf)} is also read by "
                                f"{cap.describe(other)}")
        for u in _live_users(cap, chain[-1]):
            if u.name not in allowed:
                # a residual add past the last norm carries the writer on: name where it ends up (SigLIP's head)
                end = _stream_end(cap, u)
                onward = (f", which carries it on to {_reader(cap, end)}, not a LayerNorm (centering the writer "
                          f"would change it)" if end is not u else "")
                problems.append(f"the output of stream writer {cap.describe(leaf)} is also read by "
                                f"{cap.describe(u)}{onward}")
    # each writer's parameters are read by the writers only (or by another name: a tie we can clone away)
    # a parameter writer is read by the pass-through ops that carry it into the stream (class_token.expand)
    writer_nodes = set(st.writers).union(st.values, *({n.name for n in path} for _, path in chains),
                                         *(w.via for w in st.writers.values()))
    scales = [id(cap.tensor(w.scale)) for w in st.writers.values() if w.scale]
    if len(scales) != len(set(scales)):  # folded into two writers, it could not become ones for both
        problems.append("one layer-scale parameter scales two stream writers")
    for w in st.writers.values():
        for pname in (w.weight, w.bias, w.scale):
            t = cap.tensor(pname) if pname else None
            if t is None:
                continue
            foreign = [n for n in readers.get(id(t), []) if n not in writer_nodes]
            if not foreign:
                continue
            mod = cap.modules.get(w.module)
            # a tied embedding (lm_head.weight is wte.weight)  =>  clone it, center the clone
            if w.kind == "embedding" and isinstance(mod, nn.Embedding) and mod.weight is t \
                    and all(_owns(cap, n, t) not in (None, w.module) for n in foreign):
                if w.module not in st.unties:
                    st.unties.append(w.module)
                continue
            n = foreign[0]
            problems.append(f"{pname} is also read by {cap.describe(cap.nodes[n])}: centering it would change that use")
    return problems


def _writer_mean(w: Writer, read) -> float | None:
    """Largest |mean over the hidden dim| of a writer's weight / bias, or None when it is zero-mean."""
    if w.weight is None:  # a constant-scale LayerNorm without bias
        return None
    t = read(w.weight).detach()
    dim = w.axis
    if w.scale:  # lambda * (W x + b): the product's mean
        t = t.double() * _along(read(w.scale).detach().double(), t.dim(), dim)
    # float64 one slice at a time (each slice holds whole reductions: the same means, not 2x the weight in float64)
    worst = max(float(s.double().mean(dim).abs().max()) for s in _slices(t, dim))
    scale = float(t.abs().max())
    if w.bias:
        b = read(w.bias).detach().double() * (read(w.scale).detach().double().reshape(-1) if w.scale else 1)
        worst = max(worst, abs(float(b.mean())))
        scale = max(scale, float(b.abs().max()))
    return worst if worst > _ZERO_MEAN_RTOL * max(scale, 1e-30) else None


def _check_readers(cap: Captured, st: Stream, sites) -> list[str]:
    """Centering the writers is invisible only to mean-invariant readers: the swapped LayerNorms."""
    allowed = set(st.values)
    for i in st.sites:
        allowed.update(sites[i].nodes)
    for name in sorted(st.values):
        for u in _live_users(cap, cap.nodes[name]):
            if u.name not in allowed:
                end = _stream_end(cap, u)
                if _fn_name(end) in _CATS and _cat_on_last(cap, end):  # Swin's patch merging, named as such
                    return [_HIDDEN_CAT.format(where=cap.describe(end))]
                past = f" (the stream flows on through {u.name})" if end is not u else ""
                return [f"stream value {name} is also read by {_reader(cap, end)}{past}, which is not a LayerNorm "
                        f"(centering the stream would change it)"]
    return []


def _stream_end(cap: Captured, node: fx.Node) -> fx.Node:
    """Past the last swapped norm the stream may go on (adds, views): the first node that really reads it."""
    seen, stack = set(), [node]
    while stack:
        v = stack.pop()
        if v.name in seen:
            continue
        seen.add(v.name)
        if not (cap.op(v) == "add" or _passes_through(cap, v)):
            return v
        stack.extend(reversed(_live_users(cap, v)))
    return node


def _cat_on_last(cap: Captured, node: fx.Node) -> bool:
    """A cat joining along its last axis (where a stream keeps its hidden features)."""
    rank = len(cap.shape(node) or ())
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return bool(rank) and isinstance(dim, int) and dim % rank == rank - 1


def _reader(cap: Captured, node: fx.Node) -> str:
    return "the model's output" if node.op == "output" else cap.describe(node)


def _decide(cap: Captured, p: SitePlan, streams: list[Stream], readers, to: str, read) -> None:
    site = p.site
    mod = cap.modules.get(site.owner)
    if p.module is None and isinstance(mod, (nn.LayerNorm, nn.RMSNorm)):  # a norm subclass, forward overridden
        p.reason = (f"{site.owner} ({type(mod).__name__}) overrides forward and computes more than the norm there: "
                    f"swap replaces whole norm modules")
        return
    if p.module is None:
        p.reason = (f"{site.source} norm written inline in {site.owner or 'forward'}: swap replaces norm modules"
                    + (" (canonicalize could not make it one)" if site.source == "handwritten" else ""))
        return
    if _hidden(site) is None:
        p.reason = f"normalizes {len(site.normalized_shape or ())} dims: only a single hidden dim is supported"
        return
    if site.placement == "post-norm":
        p.reason = ("post-LN: the residual stream is re-normalized (with its bias) after every sublayer, so it is "
                    "not zero-mean; only --approximate (drift measured)")
        if to == "rmsnorm":
            p.consumers, p.beta_problem = _beta_consumers(cap, p, readers, read)
        return
    st = streams[p.stream] if p.stream is not None else None
    if to == "rmsnorm":
        p.consumers, p.beta_problem = _beta_consumers(cap, p, readers, read)
    if st is not None and st.problem:
        p.reason = st.problem + "; only --approximate (drift measured)"
        return
    if p.beta_problem:
        p.reason = p.beta_problem + "; only --approximate (drift measured)"
        return
    p.exact = True
    if to == "rmsnorm":
        n = len([w for w in st.writers.values()]) if st else 0
        beta = f"; bias folds into {len(p.consumers)} consumer linear(s)" if p.consumers else ""
        p.reason = f"to RMSNorm(eps={site.eps:g}), exact: {n} stream writer(s) centered{beta}"
    else:
        p.reason = f"to LayerNorm(eps={site.eps:g}, no bias), exact: the stream's writers are zero-mean"


def _self_attention_in_proj(cap: Captured, u: fx.Node, v: fx.Node) -> Consumer | None:
    """``u`` calls an nn.MultiheadAttention with ``v`` as query, key and value and nothing else: its packed
    in_proj (q | k | v rows of one weight, one bias) reads v as one linear, so it absorbs the norm's bias."""
    mod = cap.modules.get(u.target) if u.op == "call_module" else None
    if not isinstance(mod, nn.MultiheadAttention) or not mod._qkv_same_embed_dim or mod.in_proj_bias is None:
        return None
    qkv = (list(u.args) + [u.kwargs.get(k) for k in ("query", "key", "value")][len(u.args):])[:3]
    others = list(u.args[3:]) + [a for k, a in u.kwargs.items() if k not in ("query", "key", "value")]
    if qkv != [v, v, v] or any(a is v for a in others):
        return None
    return Consumer(u.name, f"{u.target}.in_proj_weight", f"{u.target}.in_proj_bias", "out_in", u.target)


def _beta_consumers(cap: Captured, p: SitePlan, readers, read) -> tuple[list[Consumer], str | None]:
    """The linears a LayerNorm's bias b folds into, or why it cannot fold (b == 0 needs none)."""
    mod = cap.modules.get(p.module) if p.module else None
    beta = read(f"{p.module}.bias") if getattr(mod, "bias", None) is not None else None
    if beta is None or not bool(torch.count_nonzero(beta.detach())):
        return [], None
    consumers: list[Consumer] = []
    stack = [cap.nodes[p.site.node]]
    seen: set[str] = set()
    while stack:
        v = stack.pop()
        for u in cap.users(v):
            if u.name in seen:
                continue
            seen.add(u.name)
            if _passes_through(cap, u) and u.args[0] is v:
                stack.append(u)
                continue
            mha = _self_attention_in_proj(cap, u, v)
            if mha is not None:  # mha(x, x, x) kept whole by the trace  =>  its in_proj absorbs b
                consumers.append(mha)
                continue
            lin = _linear_of(cap, u) if cap.op(u) in ("linear", "matmul") else None
            if lin is None or lin[0] is not v or lin[1] is None:
                if cap.op(u) in ("add", "layer_norm", "rms_norm"):  # BLOOM's embedding LayerNorm
                    return [], (f"the norm writes the residual stream (read by {cap.describe(u)}), so its bias has "
                                f"no linear layer to fold into")
                return [], f"{_reader(cap, u)} reads the norm's output and cannot absorb its bias"
            consumers.append(Consumer(u.name, _own_name(cap, lin[4], lin[1]), _own_name(cap, lin[4], lin[2]),
                                      lin[3], lin[4]))
    mine = {c.node for c in consumers}
    for c in consumers:
        if c.bias is not None:
            # the bias is edited: nothing else may read it (the weight is only read, ties are harmless)
            t = cap.tensor(c.bias)
            foreign = [n for n in readers.get(id(t), []) if n not in mine] if t is not None else []
        else:
            # a bias is added to the module: every call of it must read this norm's output
            lin_mod = cap.modules.get(c.module)
            if not (isinstance(lin_mod, nn.Linear) and c.weight == f"{c.module}.weight"):
                return [], f"{c.node} has no bias parameter to absorb the norm's bias"
            if lin_mod.bias is not None:  # x @ W.T + b written out: b is not read by the matmul
                return [], f"{c.module} adds its bias outside its matmul, so the norm's bias cannot be folded into it"
            foreign = [n for n in readers.get(id(lin_mod.weight), []) if n not in mine
                       and _owns(cap, n, lin_mod.weight) == c.module]
        if foreign:
            return [], (f"{c.bias or c.module} is also used by {cap.describe(cap.nodes[foreign[0]])}, so the norm's "
                        f"bias cannot be folded into it")
    return consumers, None


# ---------------------------------------------------------------------------------------------------------
# the edits as data: what the in-memory pass and the streaming writer (normconv.stream) both apply


@dataclass(frozen=True)
class Fold:
    """A norm's bias b folded into a consumer linear: bias <- bias + W b (bias None: one is added)."""

    beta: str  # the norm's bias (state_dict name)
    norm: str  # the norm module
    weight: str
    bias: str | None
    layout: str
    module: str


@dataclass(frozen=True)
class Scale:
    """A layer scale lambda folded into its writer before centering: W <- diag(lambda) W, b <- lambda b, lambda <- 1."""

    scale: str
    weight: str | None
    axis: int
    bias: str | None


@dataclass
class Edits:
    """The swap's weight edits, by state_dict name, in the order they apply: untie, scale, center, fold."""

    untie: dict[str, str] = field(default_factory=dict)  # centered embedding module -> its weight's name
    scales: list[Scale] = field(default_factory=list)
    center: dict[str, int] = field(default_factory=dict)  # writer weight / bias -> the axis centered along
    folds: list[Fold] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # approximate: "norm (why its bias could not fold)"

    def fold_into(self) -> dict[str, list[Fold]]:
        """consumer bias name -> the folds that add to it."""
        out: dict[str, list[Fold]] = {}
        for f in self.folds:
            if f.bias is not None:
                out.setdefault(f.bias, []).append(f)
        return out


def edits(cap: Captured, a: Analysis, approximate: bool = False,
          read: Callable[[str], torch.Tensor] | None = None) -> Edits:
    """The weight edits ``a`` plans (exact sites; every swappable site with ``approximate``); norm bias values
    are read through ``read`` (default: the captured model's tensors) to skip zero biases."""
    read = read or (lambda name: cap.tensor(name))
    out = Edits()
    if a.to != "rmsnorm":
        return out  # RMSNorm -> LayerNorm edits no weight: its writers are zero-mean already
    done: set[int] = set()
    for st in a.streams:
        if st.problem is not None:
            continue
        if not any(a.plans[i].module is not None and (a.plans[i].exact or approximate) for i in st.sites):
            continue  # no norm of this stream is replaced: its writers stay as they are
        for path in st.unties:
            out.untie[path] = f"{path}.weight"
        for w in st.writers.values():
            if w.scale:  # layer scale: folded into the writer first, so the product is what gets centered
                out.scales.append(Scale(w.scale, w.weight, w.axis, w.bias))
            # embedding (V, D)  =>  each row minus its mean;  linear  =>  W - mean over output rows, b - mean(b)
            for pname, dim in ((w.weight, w.axis), (w.bias, 0)):
                t = cap.tensor(pname) if pname else None
                if t is not None and id(t) not in done:
                    done.add(id(t))
                    out.center[pname] = dim
    folded: set[int] = set()
    for p in a.plans:
        if p.module is None or not (p.exact or approximate):
            continue
        if getattr(cap.modules[p.module], "bias", None) is None:
            continue
        beta = f"{p.module}.bias"
        if not bool(torch.count_nonzero(read(beta).detach())):
            continue  # b = 0: nothing to fold
        if p.beta_problem:
            out.dropped.append(f"{p.module} ({p.beta_problem})")
            continue
        for c in p.consumers:
            w = cap.tensor(c.weight)
            if id(w) not in folded:  # a consumer shared by two norms reads the same b once
                folded.add(id(w))
                out.folds.append(Fold(beta, p.module, c.weight, c.bias, c.layout, c.module))
    return out


def refusal(a: Analysis) -> str | None:
    """Why the swap cannot be exact (the first refused site, post-LN first), or None."""
    refused = sorted((p for p in a.plans if not p.exact), key=lambda p: not p.reason.startswith("post-LN"))
    if not refused:
        return None
    p = refused[0]
    more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
    return (f"swap: {len(refused)} of {len(a.plans)} {SOURCE_KIND[a.to]} sites cannot be swapped exactly; "
            f"{p.site.target or 'the module itself'}: {p.reason.removesuffix('; only --approximate (drift measured)')}"
            f"{more}")


# ---------------------------------------------------------------------------------------------------------
# plan and apply


def plan(cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
    """What ``swap`` would do at each LayerNorm (to rmsnorm) and RMSNorm (to layernorm) site, in graph order.

    ``swap`` first makes hand-written and functional norms modules (canonicalize); when that changes the model,
    the plan is made on the model as swap will see it, and reported under the original site names."""
    canonical = _as_swap_sees_it(cap, norms)
    if canonical is not None:
        cap2, renamed = canonical
        back = {new: old for old, new in renamed.items()}
        planned = {back.get(s.target, s.target): s for s in _plan_on(cap2, find_norms(cap2))}
        return [replace(planned[s.target], target=s.target) for s in norms if s.target in planned]
    return _plan_on(cap, norms)


def _plan_on(cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
    by_site: dict[int, Site] = {}
    for to in ("rmsnorm", "layernorm"):
        a = analyze(cap, norms, to)
        for p, s in zip(a.plans, a.sites()):
            # a refusal names the direction it refuses (an applied site already says "to RMSNorm(...)")
            by_site[id(p.site)] = s if s.applied else replace(s, reason=f"--to {to}: {s.reason}")
    return [by_site[id(s)] for s in norms if id(s) in by_site]


def _as_swap_sees_it(cap: Captured, norms: Sequence[NormSite]) -> tuple[Captured, dict[str, str]] | None:
    """(capture of the canonicalized copy, site target -> new module path), or None when canonicalize would
    change nothing that swap reads (no site moves from inline / functional to a module)."""
    from normconv.clone import clone_sharing_tensors
    from normconv.graph.capture import capture
    from normconv.passes.canonicalize import Canonicalize

    canon = Canonicalize(functional=True)
    if not any(s.applied for s in canon.plan(cap, norms)):
        return None
    model = clone_sharing_tensors(cap.model)  # canonicalize builds new modules, writes no shared tensor
    result = canon(model, capture(model, cap.inputs, cap.method))
    return capture(result.model, cap.inputs, cap.method), result.extra["renamed"]


def _dim(layout: str) -> int:
    """The axis of a writer's weight that indexes the hidden (stream) dim."""
    return {"rows": 1, "out_in": 0, "in_out": 1}[layout]


def center_(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t <- t - mean(t, dim) in place, computed in float64 one slice at a time (peak: a slice, not the weight)."""
    for s in _slices(t.detach(), dim):
        s64 = s.double()
        s.copy_(s64.sub_(s64.mean(dim, keepdim=True)))  # in place: one float64 slice alive, rounded by copy_
    return t


def bias_delta(w: torch.Tensor, beta: torch.Tensor, layout: str) -> torch.Tensor:
    """W b in float64, a slice of output features at a time (each output is one whole dot product):
    W (out, D) [out_in]: W @ b;  HF Conv1D W (D, out) [in_out]: b @ W."""
    b64 = beta.detach().double()
    if layout == "out_in":
        return torch.cat([s.double() @ b64 for s in _slices(w.detach(), 1)])
    return torch.cat([b64 @ s.double() for s in _slices(w.detach(), 0)])


def add_(b: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """b <- b + delta in place, summed in float64."""
    b.data.copy_((b.detach().double() + delta).to(b.dtype))
    return b


_SLICE_ELEMENTS = 1 << 22  # float64 working set per slice: 32 MB


def _slices(t: torch.Tensor, dim: int):
    """Views of ``t`` along an axis other than ``dim``, each holding whole reductions over ``dim``: a mean over
    ``dim`` computed slice by slice is the mean computed at once, at the memory of one slice."""
    if t.dim() < 2 or t.numel() <= _SLICE_ELEMENTS:
        yield t
        return
    axis = 0 if dim % t.dim() != 0 else 1
    step = max(1, _SLICE_ELEMENTS * t.shape[axis] // t.numel())
    for i in range(0, t.shape[axis], step):
        yield t.narrow(axis, i, min(step, t.shape[axis] - i))


class SwapPass:
    """LayerNorm -> RMSNorm (``to="rmsnorm"``) or back (``to="layernorm"``); see the module docstring."""

    name = NAME
    # a stream that enters a submodule's graph as an input has writers the graph does not show: such a site is
    # refused, as at any graph input; the rest is proved within the submodule's graph
    by_parts = True

    def __init__(self, to: str = "rmsnorm", approximate: bool = False, require: bool = True, partial: bool = False):
        from normconv.errors import NormconvError

        if to not in SOURCE_KIND:
            raise NormconvError(f"unknown --to {to!r}: choose rmsnorm or layernorm")
        if partial and approximate:
            raise NormconvError("choose --partial (swap only the exact sites) or --approximate (swap them all)")
        self.to, self.approximate = to, approximate
        self.partial = partial  # swap the exact sites, keep the others as they are: the result stays exact
        self.require = require  # False: a model with no norm to swap passes through unchanged (rotate, fold-scales)
        self.exact = True  # False once an approximate site was applied
        self.notes: list[str] = []
        self.dropped: list[str] = []  # approximate: norms whose bias could not be folded
        self.plans: list[SitePlan] = []  # every site planned, over all the graphs it ran on (parts: one each)
        self.in_parts = False  # True while run on parts: a part with nothing to swap is no error (end_parts)

    def plan(self, cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
        return analyze(cap, norms, self.to).sites(self.approximate)

    def __call__(self, model: nn.Module, cap: Captured) -> PassResult:
        from normconv.errors import NormconvError

        a = analyze(cap, find_norms(cap), self.to)
        self.plans.extend(a.plans)
        kind = SOURCE_KIND[self.to]
        if not a.plans and (not self.require or self.in_parts):
            return PassResult(model, False, ())
        if not a.plans:
            raise NormconvError(f"swap: {type(model).__name__} has no {kind} to swap to {self.to}")
        why = refusal(a)
        if why and self.partial and not any(p.exact and p.module is not None for p in a.plans):
            if self.in_parts:  # another part may have exact sites: this one keeps its norms, each row says why
                return PassResult(model, False, tuple(a.sites(False)))
            raise NormconvError(f"{why}. --partial: no site can be swapped exactly, so nothing would change")
        if why and not self.approximate and not self.partial:
            raise NormconvError(f"{why}. Pass --partial to swap only the exact sites, or --approximate to swap "
                                f"them all and measure the drift (normconv inspect lists every site)")
        if why and self.partial:
            # the kept norms read streams whose writers may be centered: a LayerNorm does not see a mean shift
            kept = sum(not p.exact for p in a.plans)
            self.notes.append(f"--partial: {len(a.plans) - kept} of {len(a.plans)} {kind} sites swapped exactly, "
                              f"{kept} kept as they are (each row says why)")
        plan = edits(cap, a, self.approximate)
        with torch.no_grad():
            self._untie(model, cap, plan)
            for sc in plan.scales:
                _fold_scale(model, cap, sc)
            for name, dim in plan.center.items():
                center_(owned(model, cap.tensor(name)), dim)
            for f in plan.folds:
                # linear after the norm: c <- c + W b
                delta = bias_delta(cap.tensor(f.weight), getattr(cap.modules[f.norm], "bias"), f.layout)
                if f.bias is None:
                    w = cap.tensor(f.weight)
                    cap.modules[f.module].bias = nn.Parameter(delta.to(w.dtype), requires_grad=w.requires_grad)
                    self.notes.append(f"added a bias to {f.module} to carry the bias of {f.norm}")
                else:
                    add_(owned(model, cap.tensor(f.bias)), delta)
            replaced: set[str] = set()
            for p in a.plans:
                if p.module is None or not (p.exact or self.approximate):
                    continue
                self.exact = self.exact and p.exact
                if p.module not in replaced:
                    replaced.add(p.module)
                    replace_module(model, p.module, self._replacement(cap, p))
        self.dropped = plan.dropped
        if self.dropped:
            self.notes.append(f"bias dropped at {len(self.dropped)} norm(s), e.g. {self.dropped[0]}")
        return PassResult(model, bool(replaced), tuple(a.sites(self.approximate)))

    def end_parts(self, model: nn.Module, results: Sequence[PassResult]) -> None:
        """After a run on parts: the errors a whole graph gives at once (no site to swap, no exact site)."""
        from normconv.errors import NormconvError

        self.in_parts = False
        if not any(r.sites for r in results) and self.require:
            raise NormconvError(f"swap: {type(model).__name__} has no {SOURCE_KIND[self.to]} to swap to {self.to} "
                                f"in any submodule captured alone")
        if self.partial and not any(r.modified for r in results):
            raise NormconvError("swap: --partial: no site can be swapped exactly in any submodule captured alone, so "
                                "nothing would change (normconv inspect lists every site)")

    # -- edits ---------------------------------------------------------------------------------------------
    def _untie(self, model: nn.Module, cap: Captured, plan: Edits) -> None:
        # tied embedding -> clone it first  =>  the other user keeps the original rows
        for path in plan.untie:
            emb = cap.modules[path]
            old = emb.weight
            others = [n for n, t in model.named_parameters(remove_duplicate=False) if t is old and n != f"{path}.weight"]
            emb.weight = nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad)
            adopt(model, emb.weight)  # already this rewrite's own copy: centering it must not clone it again
            self.notes.append(f"untied {path}.weight from {', '.join(others)}: the embedding is centered, "
                              f"{', '.join(others)} keeps the original values")
            _untie_config(model, self.notes)

    def _replacement(self, cap: Captured, p: SitePlan) -> nn.Module:
        from normconv.nn.rmsnorm import make_rmsnorm

        old = cap.modules[p.module]
        weight = getattr(old, "weight", None)
        dtype = weight.dtype if weight is not None else cap.dtype(cap.nodes[p.site.input])
        shape = tuple(old.normalized_shape)
        if self.to == "rmsnorm":
            # LN(g, b, eps) on a zero-mean stream  =>  RMSNorm(g, eps)   (b already folded)
            new = make_rmsnorm(shape, float(old.eps), weight.detach() if weight is not None else None, dtype)
        else:
            # RMSNorm(g, eps) on a zero-mean stream  =>  LN(g, no bias, eps)   (eps=None resolved to finfo.eps)
            new = nn.LayerNorm(shape, eps=float(p.site.eps), elementwise_affine=weight is not None, bias=False,
                               dtype=dtype, device=weight.device if weight is not None else None)
            if weight is not None:
                new.weight.data.copy_(weight.detach())
        new.train(old.training)
        return new


def _along(v: torch.Tensor, rank: int, dim: int) -> torch.Tensor:
    """A vector shaped to broadcast along axis ``dim`` of a rank-``rank`` tensor."""
    shape = [1] * rank
    shape[dim] = -1
    return v.reshape(shape)


def _fold_scale(model: nn.Module, cap: Captured, w: Scale) -> None:
    """lambda * (W x + b)  =>  (diag(lambda) W) x + lambda b, lambda <- ones: the same output, centered next."""
    lam = owned(model, cap.tensor(w.scale))
    vec = lam.detach().double().reshape(-1)
    for pname, dim in ((w.weight, w.axis), (w.bias, 0)):
        if pname:
            t = owned(model, cap.tensor(pname))
            t.data.copy_((t.detach().double() * _along(vec, t.dim(), dim)).to(t.dtype))
    lam.data.fill_(1)


def _untie_config(model: nn.Module, notes: list[str]) -> None:
    """A Hugging Face model re-ties its embeddings on tie_weights()/from_pretrained unless told not to."""
    config = getattr(model, "config", None)
    for cfg in {id(c): c for c in (config, getattr(config, "get_text_config", lambda: None)()) if c is not None}.values():
        if getattr(cfg, "tie_word_embeddings", False):
            cfg.tie_word_embeddings = False
            notes.append("set config.tie_word_embeddings = False so Hugging Face does not re-tie the weights")
