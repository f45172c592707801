"""RMSNorm: y = x / sqrt(mean_D(x^2) + eps) * w over the trailing dims D (Llama, T5; Gemma stores w as 1 + w).

torch: nn.RMSNorm (eps None: finfo(dtype).eps), F.rms_norm / aten.rms_norm; normconv's exact fast subclass
(normconv.nn.rmsnorm.RMSNorm), written out as nn.RMSNorm (same parameter, same key).
ONNX: RMSNormalization (opset 23), SimplifiedLayerNormalization (onnxruntime, any opset), below 23 for the
standard target the normconv.RMSNorm function op with its body attached; com.microsoft
SkipSimplifiedLayerNormalization when a residual add is fused in.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from normconv.match import arg
from normconv.kinds.base import NormKind, shape_text
from normconv.kinds.layernorm import trailing_call_fields, trailing_scale
from normconv.nn.rmsnorm import RMSNorm as FastRMSNorm, make_rmsnorm


class RMSNormKind(NormKind):
    name = "rmsnorm"
    modules = (nn.RMSNorm,)
    functional = "rms_norm"
    onnx_ops = (("", "RMSNormalization"), ("", "SimplifiedLayerNormalization"), ("normconv", "RMSNorm"),
                ("com.microsoft", "SkipSimplifiedLayerNormalization"))

    def from_module(self, module: nn.Module, path: str, dtype: torch.dtype) -> dict[str, Any]:
        fields = super().from_module(module, path, dtype)
        if fields["eps"] is None:  # nn.RMSNorm(eps=None): the input dtype's epsilon
            fields["eps"] = torch.finfo(dtype if dtype.is_floating_point else torch.float32).eps
        if module._parameters.get("weight") is None:  # weight-free (a scale-free one's weight of ones is not used)
            fields["weight"] = None
        return fields

    def from_call(self, cap: Any, node: Any, x: Any) -> dict[str, Any]:
        fields = trailing_call_fields(cap, node, x, 3)
        if fields["eps"] is None:  # F.rms_norm's default: the input dtype's epsilon
            fields["eps"] = torch.finfo(cap.dtype(x) or torch.float32).eps
        return dict(fields, weight=cap.param_name(arg(node, 2, "weight")), bias=None)

    def native(self, site: Any, tensors: dict[str, torch.Tensor | None], shape: tuple[int, ...],
               dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, str, list[str]]:
        # x * rsqrt(mean(x^2) + eps) * w  =>  make_rmsnorm(ns, eps, w)
        ns, eps = tuple(site.normalized_shape), float(site.eps)
        mod = make_rmsnorm(ns, eps, weight=trailing_scale(site, tensors["weight"], dtype), dtype=dtype).to(device)
        notes = [f"weight stored as {site.weight_offset:g} + w"] if site.weight_offset else []
        return mod, f"RMSNorm({shape_text(ns)}, eps={eps:g})", notes

    def reduce_dims(self, site: Any, x: torch.Tensor) -> tuple[int, ...]:
        return tuple(site.dims) if site.dims else (-1,)

    def statistics(self, site: Any, x: torch.Tensor) -> tuple[float, float]:
        # it squares x itself: x^2 and mean(x^2)
        x = x.detach().double()
        dims = self.reduce_dims(site, x)
        sq = x * x
        return float(sq.max()), float(sq.mean(dims).max())

    def onnx_op(self, target: str, opset: int) -> str:
        if target == "ort":
            return "SimplifiedLayerNormalization"
        return "RMSNormalization" if opset >= 23 else "normconv.RMSNorm (ONNX function body attached)"

    def torch_only(self, module: nn.Module) -> nn.Module | None:
        # normconv's fast RMSNorm  =>  nn.RMSNorm (same parameter, same state_dict key)
        if not isinstance(module, FastRMSNorm):
            return None
        new = nn.RMSNorm.__new__(nn.RMSNorm)
        new.__dict__.update(module.__dict__)  # same parameters, buffers, hooks and flags: only the class changes
        new.__dict__["_parameters"] = dict(module._parameters)
        return new


RMSNORM = RMSNormKind()
