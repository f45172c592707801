"""Matching helpers: one vocabulary of ops over both graph dialects.

A symbolic_trace graph says ``operator.add`` / ``torch.rsqrt`` / ``x.mean(...)`` / ``call_module``; a
torch.export graph says ``aten.add.Tensor`` / ``aten.rsqrt.default`` / ``aten.mean.dim``. ``op_of(node)``
maps both to one name (``"add"``, ``"rsqrt"``, ``"mean"``, ...) so every pattern is written once.
``arg(node, i, name)`` reads an argument by position or keyword in either dialect.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

aten = torch.ops.aten

# canonical name -> callables / method names / aten overload packets that mean it
_OPS: dict[str, tuple[list[Callable], list[str], list[Any]]] = {
    "add": ([operator.add, operator.iadd, torch.add], ["add", "add_"], [aten.add, aten.add_]),
    "sub": ([operator.sub, operator.isub, torch.sub], ["sub", "sub_"], [aten.sub]),
    "mul": ([operator.mul, operator.imul, torch.mul], ["mul", "mul_"], [aten.mul, aten.mul_]),
    "div": ([operator.truediv, operator.itruediv, torch.div, torch.true_divide], ["div", "div_"], [aten.div]),
    "pow": ([operator.pow, torch.pow], ["pow"], [aten.pow]),
    "square": ([torch.square], ["square"], [aten.square]),
    "sqrt": ([torch.sqrt], ["sqrt"], [aten.sqrt]),
    "rsqrt": ([torch.rsqrt], ["rsqrt"], [aten.rsqrt]),
    "mean": ([torch.mean], ["mean"], [aten.mean]),
    "var": ([torch.var], ["var"], [aten.var]),
    "std": ([torch.std], ["std"], [aten.std]),
    "cast": ([], ["to", "float", "half", "bfloat16", "double", "type", "type_as"],
             [aten.to, aten._to_copy, aten.type_as]),
    "neg": ([operator.neg, torch.neg], ["neg"], [aten.neg]),
    "layer_norm": ([F.layer_norm, torch.layer_norm], [], [aten.layer_norm, aten.native_layer_norm]),
    "batch_norm": ([F.batch_norm, torch.batch_norm], [],
                   [aten.batch_norm, aten._native_batch_norm_legit_no_training, aten.native_batch_norm,
                    aten._native_batch_norm_legit]),
    "group_norm": ([F.group_norm, torch.group_norm], [], [aten.group_norm, aten.native_group_norm]),
    "instance_norm": ([F.instance_norm, torch.instance_norm], [], [aten.instance_norm]),
    "rms_norm": ([F.rms_norm, torch.rms_norm], [], [aten.rms_norm]),
    "conv": ([F.conv1d, F.conv2d, F.conv3d], [], [aten.conv1d, aten.conv2d, aten.conv3d, aten.convolution]),
    "conv_transpose": ([F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d], [],
                       [aten.conv_transpose1d, aten.conv_transpose2d, aten.conv_transpose3d]),
    "linear": ([F.linear], [], [aten.linear, aten.addmm]),
    "matmul": ([torch.matmul, operator.matmul, torch.bmm], ["matmul"], [aten.matmul, aten.bmm, aten.mm]),
    "embedding": ([F.embedding], [], [aten.embedding]),
    "getitem": ([operator.getitem], [], []),
    "dropout": ([F.dropout], [], [aten.dropout]),
    "identity": ([], ["contiguous", "clone", "detach"], [aten.clone, aten.detach, aten.alias]),
    "cat": ([torch.cat], [], [aten.cat]),
}

_BY_FUNCTION: dict[Any, str] = {}
_BY_METHOD: dict[str, str] = {}
_BY_PACKET: dict[Any, str] = {}
for _name, (_fns, _methods, _packets) in _OPS.items():
    _BY_FUNCTION.update({f: _name for f in _fns})
    _BY_METHOD.update({m: _name for m in _methods})
    _BY_PACKET.update({p: _name for p in _packets})

# module class -> canonical op (the module types a norm's neighbour can be; norm modules are the kinds':
# ``Captured.op`` asks ``normconv.kinds``, which sits above this vocabulary)
_MODULE_OPS: tuple[tuple[type, str], ...] = (
    (nn.modules.conv._ConvTransposeNd, "conv_transpose"),
    (nn.modules.conv._ConvNd, "conv"),
    (nn.Linear, "linear"),
    (nn.Embedding, "embedding"),
    (nn.Dropout, "dropout"),
    (nn.Identity, "identity"),
)

# ops that pass a value through unchanged for placement purposes
TRANSPARENT = frozenset({"cast", "dropout", "identity"})
# torchvision.ops.stochastic_depth(input, p, mode, training): torch.fx.wrap'ed by torchvision, so symbolic_trace keeps
# the call (MViT, MaxViT, Swin's residual branches); named by where it lives, never imported here
_STOCHASTIC_DEPTH = ("torchvision.ops.stochastic_depth", "stochastic_depth")

# Op families by call name (``call_name(node)``: x.view, torch.reshape and aten.view.default alike), declared once:
# what an op does to the elements of its first input. Passes and graph analyses compose them; none re-types them.
RESHAPE = frozenset({"view", "reshape", "_unsafe_view"})  # the same values, row-major, in another shape
REGROUP = RESHAPE | {"flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as"}  # row-major regroupings
COPY = frozenset({"contiguous", "clone", "alias"})  # the same values in the same shape
VIEW = REGROUP | COPY  # every op that keeps the row-major order of the elements
SWAP = frozenset({"transpose", "swapaxes", "swapdims", "t"})  # two axes trade places
PERMUTE = SWAP | {"permute", "movedim"}  # whole axes move
EXPAND = frozenset({"expand", "expand_as", "broadcast_to", "repeat", "tile"})  # copies along (new) axes
PARAM_VIEW = RESHAPE | {"unsqueeze", "expand", "expand_as"}  # a parameter shaped for broadcasting (w.view(1, C, 1, 1))
PICK = frozenset({"select", "slice", "narrow", "index_select", "getitem"})  # some rows along an axis
PAD = frozenset({"pad", "constant_pad_nd"})  # rows added along an axis
CAT = frozenset({"cat", "concat", "concatenate"})  # tensors joined along an axis
SPLIT = frozenset({"split", "chunk", "split_with_sizes", "tensor_split"})  # one tensor cut along an axis
# spatial resampling, channels first: the same linear map (weights summing to one) for every channel; torch's and
# aten's names (F.interpolate lowers to one of the aten ops, antialiased ones to the ``_aa`` forms)
RESAMPLE = frozenset({"interpolate", "upsample", "upsample_linear1d", "upsample_bilinear2d", "upsample_bicubic2d",
                      "upsample_trilinear3d", "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
                      "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d",
                      "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa"})
# F.interpolate's modes whose weights over one channel's inputs sum to one: a per-channel s * x + t passes through
RESAMPLE_MODES = ("nearest", "nearest-exact", "linear", "bilinear", "bicubic", "trilinear", "area")
TEMPLATE = frozenset({"expand_as", "view_as", "reshape_as", "type_as"})  # the second operand gives a shape / dtype only
LIKE = frozenset({"zeros_like", "ones_like", "empty_like", "full_like"})  # the operand gives a shape / dtype only

def module_op(module: nn.Module) -> str | None:
    for cls, name in _MODULE_OPS:
        if isinstance(module, cls):
            return name
    return None


def op_of(node: fx.Node, modules: dict[str, nn.Module] | None = None) -> str | None:
    """Canonical op name of a node, or None when it is none of the ops normconv reasons about."""
    if node.op == "call_function":
        t = node.target
        if t in _BY_FUNCTION:
            return _BY_FUNCTION[t]
        if (getattr(t, "__module__", None), getattr(t, "__name__", None)) == _STOCHASTIC_DEPTH:
            off = arg(node, 3, "training", True) is False or arg(node, 1, "p") == 0
            return "identity" if off else None  # eval (or p 0): its input itself, as dropout off
        packet = getattr(t, "overloadpacket", None)
        if packet is not None and packet in _BY_PACKET:
            return _BY_PACKET[packet]
        return None
    if node.op == "call_method":
        return _BY_METHOD.get(node.target)
    if node.op == "call_module" and modules is not None:
        m = modules.get(node.target)
        return module_op(m) if m is not None else None
    return None


# argument names of the functional / aten forms, by canonical op, for keyword lookups
_ARG_NAMES = {
    "mean": ("input", "dim", "keepdim"),
    "var": ("input", "dim", "unbiased", "keepdim"),
    "std": ("input", "dim", "unbiased", "keepdim"),
    "layer_norm": ("input", "normalized_shape", "weight", "bias", "eps"),
    "rms_norm": ("input", "normalized_shape", "weight", "eps"),
    "group_norm": ("input", "num_groups", "weight", "bias", "eps"),
    "instance_norm": ("input", "running_mean", "running_var", "weight", "bias", "use_input_stats", "momentum", "eps"),
}


def arg(node: fx.Node, index: int, name: str | None = None, default: Any = None) -> Any:
    """Argument ``index`` (or keyword ``name``) of a node, whichever is present."""
    if index < len(node.args):
        return node.args[index]
    if name is not None and name in node.kwargs:
        return node.kwargs[name]
    return default


def batch_norm_args(node: fx.Node) -> dict[str, Any]:
    """Normalize the batch-norm call forms to one dict (input, running_mean/var, weight, bias, training, eps)."""
    t = node.target
    packet = getattr(t, "overloadpacket", None)
    a = lambda i, n, d=None: arg(node, i, n, d)  # noqa: E731
    if packet is aten._native_batch_norm_legit_no_training:
        # (input, weight, bias, running_mean, running_var, momentum, eps)
        return dict(input=a(0, "input"), weight=a(1, "weight"), bias=a(2, "bias"), running_mean=a(3, "running_mean"),
                    running_var=a(4, "running_var"), training=False, eps=a(6, "eps", 1e-5))
    if packet in (aten.batch_norm, aten.native_batch_norm, aten._native_batch_norm_legit):
        # (input, weight, bias, running_mean, running_var, training, momentum, eps, ...)
        return dict(input=a(0, "input"), weight=a(1, "weight"), bias=a(2, "bias"), running_mean=a(3, "running_mean"),
                    running_var=a(4, "running_var"), training=a(5, "training", False), eps=a(7, "eps", 1e-5))
    # F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
    return dict(input=a(0, "input"), running_mean=a(1, "running_mean"), running_var=a(2, "running_var"),
                weight=a(3, "weight"), bias=a(4, "bias"), training=a(5, "training", False), eps=a(7, "eps", 1e-5))


def scalar(value: Any) -> float | None:
    """A python number argument as float (None for nodes and tensors)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return None


def dims_of(value: Any) -> tuple[int, ...] | None:
    """A dim argument (int, list, tuple) as a tuple; None when absent (all dims)."""
    if value is None:
        return None
    if isinstance(value, int):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(d, int) for d in value):
        return tuple(value)
    return None


def permute_dims(node: fx.Node) -> tuple:
    """The dims of a permute call as written: ``permute(x, dims)`` (torch, aten) or ``x.permute(*dims)``."""
    args = node.args
    return tuple(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else tuple(args[1:])


def call_name(node: fx.Node) -> str:
    """The function / method name of a call node ("view" for x.view, torch.view and aten.view.default alike); ''
    for placeholders, attributes, modules and the output."""
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        t = getattr(node.target, "overloadpacket", node.target)
        return getattr(t, "__name__", str(t)).split(".")[0]
    return ""


def permutation(node: fx.Node, rank: int) -> list[int] | None:
    """out[i] = in[perm[i]] for a permutation op, or None when its dims are not constants."""
    name, args = call_name(node), list(node.args[1:])
    if name == "t":
        return [1, 0] if rank == 2 else list(range(rank))
    if name in ("transpose", "swapaxes", "swapdims"):
        d = [node.kwargs.get(k, a) for k, a in zip(("dim0", "dim1"), args)] if len(args) >= 2 else \
            [node.kwargs.get("dim0"), node.kwargs.get("dim1")]
        if not all(isinstance(x, int) for x in d):
            return None
        perm = list(range(rank))
        a, b = d[0] % rank, d[1] % rank
        perm[a], perm[b] = perm[b], perm[a]
        return perm
    if name == "permute":
        dims = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args or node.kwargs.get("dims")
        if not dims or not all(isinstance(x, int) for x in dims):
            return None
        return [x % rank for x in dims]
    return None  # movedim: not needed so far
