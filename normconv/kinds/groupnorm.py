"""GroupNorm: the channels (dim 1) split into G groups; y = (x - mean_g) / sqrt(var_g + eps) * w + b, with mean and
variance over each group's channels and spatial positions, w and b per channel.

torch: nn.GroupNorm, F.group_norm / aten.group_norm / aten.native_group_norm (eps default 1e-5).
ONNX: GroupNormalization (opset 21, per-channel scale and bias), below 21 the normconv.GroupNorm function op with its
body attached (Reshape + InstanceNormalization + Reshape, then the affine).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from normconv.match import arg, scalar
from normconv.kinds.base import NormKind, channels_of, copy_affine


class GroupNormKind(NormKind):
    name = "groupnorm"
    modules = (nn.GroupNorm,)
    functional = "group_norm"
    onnx_ops = (("", "GroupNormalization"), ("normconv", "GroupNorm"))

    def from_call(self, cap: Any, node: Any, x: Any) -> dict[str, Any]:
        return dict(num_groups=arg(node, 1, "num_groups"), weight=cap.param_name(arg(node, 2, "weight")),
                    bias=cap.param_name(arg(node, 3, "bias")), eps=scalar(arg(node, 4, "eps", 1e-5)),
                    num_features=channels_of(cap, x))

    def native(self, site: Any, tensors: dict[str, torch.Tensor | None], shape: tuple[int, ...],
               dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, str, list[str]]:
        # per-group statistics, per-channel affine  =>  nn.GroupNorm(G, C, eps)
        c, g, w, b = int(site.num_features), int(site.num_groups), tensors["weight"], tensors["bias"]
        affine = w is not None or b is not None
        mod = nn.GroupNorm(g, c, eps=float(site.eps), affine=affine, device=device, dtype=dtype)
        notes: list[str] = []
        if affine:
            copy_affine(mod, w, b, c, site.weight_offset, notes)
        return mod, f"nn.GroupNorm({g}, {c}, eps={float(site.eps):g})", notes

    def statistics(self, site: Any, x: torch.Tensor) -> tuple[float, float]:
        # statistics per (sample, group): x viewed as (N, G, -1)
        if not site.num_groups or x.dim() < 2:
            return super().statistics(site, x)
        x = x.detach().double().reshape(x.shape[0], site.num_groups, -1)
        xc = x - x.mean(-1, keepdim=True)
        sq = xc * xc
        return float(sq.max()), float(sq.mean(-1).max())

    def onnx_op(self, target: str, opset: int) -> str:
        return "GroupNormalization" if opset >= 21 else "normconv.GroupNorm (ONNX function body attached)"


GROUPNORM = GroupNormKind()
