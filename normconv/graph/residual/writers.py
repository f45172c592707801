"""The writers of a residual stream (the leaves of its sum tree) and the linears of a graph, by weight.

A writer is a leaf whose output is an affine function of its weights, so rewriting the weights rewrites the output:
  embedding E (V, D)           row lookup E[i]                      rows: D on axis 1
  linear W (D, in), b (D)      x W^T + b     (nn.Linear, F.linear)  out_in: D on axis 0
  HF Conv1D W (in, D), b (D)   b + x W       (addmm)                in_out: D on axis 1
  conv W (D, in/g, k..), b     channels first, D on axis 0 of W     (groups = 1, not transposed)
  parameter P                  added as is (position embedding, class token): D on its hidden axis
  LayerNorm g n + b            mean_D(g n + b) = g mean_D(n) + mean_D(b) = mean_D(b) when g is constant: only b
  lambda * w(x)                a per-feature constant scale (layer scale) after a writer w: folded into w
A product with a factor computed from the input (a gate), a constant, a model input, a value broadcast along the
hidden axis or any other op is no writer: ``writer`` returns a ``Refused`` saying which rule it broke.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from normconv.graph.capture import Captured
from normconv.match import CAT, SWAP, VIEW, call_name

from .axes import last, prod, source
from .walk import in_words, live_users
from .why import Refused, ResidualWhy as W

# Swin's patch merging: centering each part shifts the joined row by a vector that is not constant along it
HIDDEN_CAT = ("the stream is joined along its hidden axis by {where} (patch merging): centering each part shifts "
              "the joined row unevenly, so no weights-only rewrite keeps the norm after it")


@dataclass(frozen=True)
class Writer:
    """A leaf of the stream's sum tree: an embedding lookup or a linear layer writing hidden-size rows."""

    node: str
    kind: str  # embedding | linear | conv | param | norm
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
        return self.dim if self.dim >= 0 else layout_axis(self.layout)


def layout_axis(layout: str) -> int:
    """The axis of a writer's weight that indexes the hidden (stream) dim."""
    return {"rows": 1, "out_in": 0, "in_out": 1}[layout]


def writer(cap: Captured, leaf: Any, axis: int | None = None, read=None) -> Writer | Refused:
    """The writer at a leaf of the stream's sum tree, or why it cannot be made zero-mean."""
    if not isinstance(leaf, fx.Node):
        return Refused(W.CONSTANT, f"a constant ({leaf!r}) is added to the stream")
    if cap.is_input(leaf):
        return Refused(W.MODEL_INPUT, f"the stream starts at the model input {leaf.name!r}, which cannot be centered")
    if axis is None:  # x + c with c the same for every hidden feature: its mean is c, no weight to center
        return Refused(W.BROADCAST, f"{cap.describe(leaf)} is broadcast along the hidden axis (the same value added "
                                    f"to every feature)")
    pname = cap.param_name(leaf)
    if pname is not None and _unsaved(cap, own_name(cap, cap.owner(leaf), pname)):
        # a non-persistent buffer (a sinusoidal table built in __init__) is not in the state_dict: a centered copy
        # would be lost by every state_dict save and rebuilt uncentered on load
        return Refused(W.UNSAVED, f"stream writer {cap.describe(leaf)} is the buffer "
                                  f"{own_name(cap, cap.owner(leaf), pname)}, which the model does not save "
                                  f"(persistent=False: rebuilt when it is constructed), so centering it would not "
                                  f"survive saving")
    if pname is not None:
        # a parameter / buffer added as is (position embedding, class token)  =>  center it along the hidden axis
        return Writer(leaf.name, "param", own_name(cap, cap.owner(leaf), pname), None, "rows", cap.owner(leaf), axis)
    op = cap.op(leaf)
    if op == "conv":
        return _conv_writer(cap, leaf, axis)
    if op in ("embedding", "linear") and axis != last(cap, leaf):
        return Refused(W.OFF_AXIS, f"stream writer {cap.describe(leaf)} ({op}) reaches the stream with its features "
                                   f"off the hidden axis")
    if op == "embedding":
        if leaf.op == "call_module":
            return Writer(leaf.name, "embedding", f"{leaf.target}.weight", None, "rows", leaf.target)
        w = leaf.args[0] if call_name(leaf) == "embedding" and leaf.op == "call_function" and \
            getattr(leaf.target, "overloadpacket", None) is not None else (leaf.args[1] if len(leaf.args) > 1 else None)
        name = cap.param_name(w)
        if name is not None:
            return Writer(leaf.name, "embedding", own_name(cap, cap.owner(leaf), name), None, "rows", cap.owner(leaf))
    lin = linear_of(cap, leaf) if op in ("linear", "matmul") else None
    if lin is not None and lin[1] is not None:
        return Writer(leaf.name, "linear", own_name(cap, lin[4], lin[1]), own_name(cap, lin[4], lin[2]), lin[3],
                      lin[4])
    mha = _mha_call(cap, leaf)
    if mha is not None:
        # attn_output of an nn.MultiheadAttention kept whole by the trace  =>  its out_proj writes the stream
        if axis != last(cap, leaf):
            return Refused(W.OFF_AXIS, f"stream writer {cap.describe(leaf)} (attention) reaches the stream with its "
                                       f"features off the hidden axis")
        proj = cap.modules[mha].out_proj
        return Writer(leaf.name, "linear", f"{mha}.out_proj.weight", f"{mha}.out_proj.bias" if proj.bias is not None
                      else None, "out_in", f"{mha}.out_proj", via=(leaf.args[0].name,))  # the call reads out_proj
    if op == "mul":
        return _scaled_writer(cap, leaf, axis, read)
    if op == "layer_norm":
        return _norm_writer(cap, leaf, axis, read)
    name = call_name(leaf)
    if name in CAT:
        return Refused(W.HIDDEN_CAT, HIDDEN_CAT.format(where=cap.describe(leaf)))
    if name in VIEW | SWAP | {"permute"} and isinstance(leaf.args[0], fx.Node):
        # MobileViT's patch unfolding: (B, C, H, W) -> (B*C*h, p, w, p): the hidden axis is merged with others;
        # a split into heads (B, S, H*d) -> (B, S, H, d): a per-head norm's input is no stream of hidden features
        before, after = tuple(cap.shape(leaf.args[0]) or ()), tuple(cap.shape(leaf) or ())
        heads = len(after) == len(before) + 1 and len(before) >= 1 and before[:-1] == after[:-2] and \
            before[-1] == after[-2] * after[-1]
        how = "splits the hidden axis into heads" if heads else \
            "reads the hidden axis merged with other axes (patch unfolding)"
        return Refused(W.MERGED, f"the stream comes from {in_words(cap, leaf)}, a {name} {before} -> {after} that "
                                 f"{how}: swap follows only views that keep the hidden axis whole, so it cannot "
                                 f"reach the writers")
    what = op or name or leaf.op
    if name in ("getitem", "getattr") and len(leaf.args) == 2 and isinstance(leaf.args[0], fx.Node) \
            and isinstance(leaf.args[1], (int, str)):
        # one output of a multi-output op: name that op (Hiera's max pooling, max(...).values)
        inner = leaf.args[0]
        what = f"output {leaf.args[1]} of {cap.op(inner) or call_name(inner) or inner.op} ({inner.name})"
    return Refused(W.NOT_A_LAYER, f"stream writer {cap.describe(leaf)} is {what}, not a linear layer or an embedding "
                                  f"(nor a conv or a parameter): it has no weights that center its output")


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


def _scaled_writer(cap: Captured, leaf: fx.Node, axis: int, read=None) -> Writer | Refused:
    """y = lambda * w(x), lambda a constant per-feature scale (layer scale)  =>  the writer w with lambda folded in:
    C (diag(lambda) W) centers the product; lambda becomes ones (the model keeps its structure)."""
    out = cap.shape(leaf) or ()
    for x, lam in (leaf.args[:2], leaf.args[1::-1]) if len(leaf.args) == 2 else ():
        pname = cap.param_name(lam)
        shape = cap.shape(lam)
        if pname is None or shape is None or not isinstance(x, fx.Node) or cap.shape(x) != out:
            continue
        j = axis - (len(out) - len(shape))  # broadcast from the right: lambda's axis under the hidden one
        if j < 0 or shape[j] != out[axis] or prod(shape) != out[axis]:
            continue
        src, path, inner_axis = source(cap, x, axis)
        inner = writer(cap, src, inner_axis, read)
        if isinstance(inner, Refused):
            return inner
        if inner.scale is not None or inner.kind == "norm":
            return Refused(W.NOT_A_LAYER, f"stream writer {cap.describe(leaf)} scales {cap.describe(src)}, which is "
                                          f"not a linear layer, conv, embedding or parameter")
        chain = [src] + list(reversed(path)) + [leaf]
        for a, b in zip(chain, chain[1:]):
            if [u.name for u in live_users(cap, a)] != [b.name]:
                other = next(u for u in live_users(cap, a) if u is not b)
                return Refused(W.SHARED_OUTPUT, f"the output of stream writer {cap.describe(src)} is also read by "
                                                f"{cap.describe(other)}")
        return replace(inner, scale=own_name(cap, cap.owner(leaf), pname),
                       via=tuple(n.name for n in path) + (leaf.name,))
    a, b = (list(leaf.args) + [None, None])[:2]
    row = [v for v in (a, b) if cap.broadcasts_along(v, out, axis)]
    if row:  # a per-token factor (size 1 on the hidden axis) that weights compute: it may depend on the stream
        return Refused(W.GATED, f"stream writer {cap.describe(leaf)} multiplies {_what(cap, a)} by {_what(cap, b)}, "
                                f"a per-token factor that parameters compute (it may read the stream, which the swap "
                                f"changes): no weights-only rewrite keeps it")
    return Refused(W.GATED, f"stream writer {cap.describe(leaf)} multiplies {_what(cap, a)} by {_what(cap, b)}, "
                            f"computed from the input and varying along the hidden axis (a gate): no weights-only "
                            f"rewrite makes it zero-mean")


def _what(cap: Captured, v: Any) -> str:
    return cap.describe(v) if isinstance(v, fx.Node) else repr(v)


def _norm_writer(cap: Captured, leaf: fx.Node, axis: int, read=None) -> Writer | Refused:
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
        b = own_name(cap, path, cap.param_name(args[3])) if args[3] is not None else None
        if (args[2] is not None and g is None) or (args[3] is not None and b is None):
            return Refused(W.COMPUTED, f"stream writer {where} (layer_norm) computes its weight or bias instead of "
                                       f"reading a parameter")
    if len(shape) != 1 or axis != last(cap, leaf):
        return Refused(W.OFF_AXIS, f"stream writer {where} (layer_norm) normalizes other dims than the stream's "
                                   f"hidden axis")
    if g is not None and not bool((g.detach() == g.detach().flatten()[0]).all()):
        lo, hi = float(g.detach().min()), float(g.detach().max())
        return Refused(W.NORM_SCALE, f"stream writer {where} is a LayerNorm whose scale g varies ({lo:.3g}..{hi:.3g}): "
                                     f"mean(g * n) depends on the input unless g is constant, so no weights-only "
                                     f"rewrite makes it zero-mean")
    return Writer(leaf.name, "norm", b, None, "rows", path, 0)


def _conv_writer(cap: Captured, leaf: fx.Node, axis: int) -> Writer | Refused:
    """conv y[:, o] = W[o] * x + b[o]  =>  zero mean over o iff W and b are centered over output channels."""
    where = cap.describe(leaf)
    if axis != 1:
        return Refused(W.OFF_AXIS, f"stream writer {where} (conv) reaches the stream with axis {axis}, not its "
                                   f"channels, as hidden axis")
    if leaf.op == "call_module":
        mod = cap.modules[leaf.target]
        w, b, path = f"{leaf.target}.weight", (f"{leaf.target}.bias" if mod.bias is not None else None), leaf.target
        groups, transposed = mod.groups, getattr(mod, "transposed", False)
    else:
        args = list(leaf.args) + [None] * 9
        if call_name(leaf) == "convolution":  # aten.convolution(x, w, b, stride, pad, dil, transposed, out_pad, groups)
            transposed, groups = bool(args[6]), int(args[8] or 1)
        else:  # conv2d(x, w, b, stride, padding, dilation, groups)
            transposed, groups = False, int(args[6] if args[6] is not None else leaf.kwargs.get("groups", 1))
        path = cap.owner(leaf)
        w = own_name(cap, path, cap.param_name(args[1]))
        b = own_name(cap, path, cap.param_name(args[2])) if args[2] is not None else None
        if w is None or (args[2] is not None and b is None):
            return Refused(W.COMPUTED, f"stream writer {where} (conv) computes its weight or bias instead of reading "
                                       f"a parameter")
    # groups: output channel o sees only its group's inputs, so centering W over o does not center y
    if groups != 1 or transposed:
        return Refused(W.GROUPED, f"stream writer {where} is a {'transposed' if transposed else 'grouped'} conv: no "
                                  f"weight centering makes its output zero-mean over channels")
    return Writer(leaf.name, "conv", w, b, "out_in", path, 0)


# -- linears and parameters, by name --------------------------------------------------------------------------


def linear_of(cap: Captured, node: fx.Node) -> tuple[Any, str | None, str | None, str, str] | None:
    """(input, weight name, bias name, layout, module) of a linear node, or None."""
    if node.op == "call_module":
        mod = cap.modules.get(node.target)
        if isinstance(mod, nn.Linear) and node.args:
            bias = f"{node.target}.bias" if mod.bias is not None else None
            return node.args[0], f"{node.target}.weight", bias, "out_in", node.target
        return None
    name = call_name(node)
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
        w, owner = param_transpose(cap, node.args[1]), cap.owner(node)  # added by a separate add, if any
        mod = cap.modules.get(owner)
        if w is not None and isinstance(mod, nn.Linear) and mod.weight is cap.tensor(w):
            return node.args[0], w, None, "out_in", owner
    return None


def param_readers(cap: Captured) -> dict[int, list[str]]:
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
            users = [v for u in cap.users(n) for v in (cap.users(u) if param_transpose(cap, u) else [u])]
            readers.setdefault(id(t), []).extend(u.name for u in users)
    return readers


def param_transpose(cap: Captured, node: Any) -> str | None:
    """The name of the 2-d parameter ``node`` transposes (W.T, W.t(), W.transpose(0, 1)), else None."""
    if not isinstance(node, fx.Node) or not node.args or call_name(node) not in ("numpy_T", "t", "transpose"):
        return None
    name, shape = cap.param_name(node.args[0]), cap.shape(node.args[0])
    if name is None or shape is None or len(shape) != 2:
        return None
    if call_name(node) == "transpose" and {int(d) % 2 for d in node.args[1:3]} != {0, 1}:
        return None
    return name


def own_name(cap: Captured, module: str, name: str | None) -> str | None:
    """The name ``module`` holds a tensor by directly (``lm_head.weight``), else the name the graph used."""
    t = cap.tensor(name) if name else None
    mod = cap.modules.get(module)
    if t is None or mod is None:
        return name
    for attr, p in mod._parameters.items():
        if p is t:
            return f"{module}.{attr}" if module else attr
    return name


def owns(cap: Captured, node: str, t: torch.Tensor) -> str | None:
    """The module computing ``node`` if it holds ``t`` as its own parameter (reads it by its own attribute)."""
    n = cap.nodes[node]
    path = n.target if n.op == "call_module" else cap.owner(n)
    mod = cap.modules.get(path)
    return path if mod is not None and any(p is t for p in mod._parameters.values()) else None
