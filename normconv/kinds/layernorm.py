"""LayerNorm: y = (x - mean_D(x)) / sqrt(var_D(x) + eps) * w + b over the trailing dims D (biased variance).

torch: nn.LayerNorm, F.layer_norm / aten.layer_norm / aten.native_layer_norm (eps default 1e-5).
ONNX: LayerNormalization (opset 17; stash_type 1 keeps the statistics in float32), com.microsoft
SkipLayerNormalization when a residual add is fused in.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from normconv.errors import NormconvError

from normconv.match import arg, scalar
from normconv.kinds.base import NormKind, shape_text


def trailing_call_fields(cap: Any, node: Any, x: Any, eps_index: int) -> dict[str, Any]:
    """normalized_shape, dims and eps of F.layer_norm / F.rms_norm (sizes read off the input when traced as
    ``(x.shape[-1],)``); eps None when the call leaves it to the default."""
    given = arg(node, 1, "normalized_shape") or ()
    shape = cap.shape(x)
    if isinstance(given, fx.Node):  # x.shape[-1:], x.size()[1:] in a symbolic trace: a slice of the input's sizes
        given = _sliced_sizes(given, len(shape) if shape else None)
    given = tuple(given)
    ns = given
    if not all(isinstance(d, int) for d in ns):
        ns = tuple(shape[len(shape) - len(ns):]) if shape and len(shape) >= len(ns) else None
    return dict(normalized_shape=ns, dims=tuple(range(-len(given), 0)), eps=scalar(arg(node, eps_index, "eps")))


def _sliced_sizes(node: fx.Node, rank: int | None) -> tuple[None, ...]:
    """As many unknown sizes as ``x.shape[a:b]`` takes from a rank-``rank`` input (their values are read off the
    input's recorded shape); another computed shape is refused in words."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], slice) and \
            rank is not None:
        return (None,) * len(range(rank)[node.args[1]])
    raise NormconvError(f"the normalized_shape of {node.name}'s norm is computed ({node.format_node()[:120]}): normconv "
                        f"reads a literal shape or a slice of the input's shape (x.shape[-1:])")


def trailing_scale(site: Any, w: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The site's scale as a native module's weight: x * (1 + w)  =>  weight 1 + w (added in float32)."""
    if w is None:
        return None
    return (w.detach().to(torch.float32) + site.weight_offset).reshape(tuple(site.normalized_shape)).to(dtype)


class LayerNormKind(NormKind):
    name = "layernorm"
    modules = (nn.LayerNorm,)
    functional = "layer_norm"
    onnx_ops = (("", "LayerNormalization"), ("com.microsoft", "SkipLayerNormalization"))

    def from_call(self, cap: Any, node: Any, x: Any) -> dict[str, Any]:
        fields = trailing_call_fields(cap, node, x, 4)
        if fields["eps"] is None:  # F.layer_norm's default
            fields["eps"] = 1e-5
        return dict(fields, weight=cap.param_name(arg(node, 2, "weight")), bias=cap.param_name(arg(node, 3, "bias")))

    def native(self, site: Any, tensors: dict[str, torch.Tensor | None], shape: tuple[int, ...],
               dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, str, list[str]]:
        # (x - mean) / sqrt(var + eps) * w + b  =>  nn.LayerNorm(ns, eps)  (a missing w is ones, a missing b none)
        w, b = tensors["weight"], tensors["bias"]
        ns, eps = tuple(site.normalized_shape), float(site.eps)
        scale = trailing_scale(site, w, dtype)
        affine = w is not None or b is not None
        mod = nn.LayerNorm(ns, eps=eps, elementwise_affine=affine, bias=b is not None, device=device, dtype=dtype)
        notes = []
        with torch.no_grad():
            if affine:
                mod.weight.copy_(scale if scale is not None else torch.ones(ns))
            if b is not None:
                mod.bias.copy_(b.detach().reshape(ns))
        if b is not None and w is None:
            notes.append("weight of ones added")
        if w is not None and b is None:
            notes.append("no bias")
        if site.weight_offset:
            notes.append(f"weight stored as {site.weight_offset:g} + w")
        return mod, f"nn.LayerNorm({shape_text(ns)}, eps={eps:g})", notes

    def reduce_dims(self, site: Any, x: torch.Tensor) -> tuple[int, ...]:
        return tuple(site.dims) if site.dims else (-1,)

    def onnx_op(self, target: str, opset: int) -> str:
        return "LayerNormalization"


LAYERNORM = LayerNormKind()
