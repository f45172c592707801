"""InstanceNorm: y = (x - mean_HW(x)) / sqrt(var_HW(x) + eps) * w + b per sample and channel, over the spatial
dims (a LayerNorm-shaped hand-written norm over every spatial dim of NC(D)HW is one).

torch: nn.InstanceNorm1d/2d/3d, F.instance_norm / aten.instance_norm (eps default 1e-5).
ONNX: InstanceNormalization.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from normconv.match import arg, scalar
from normconv.kinds.base import NormKind, channels_of, copy_affine


class InstanceNormKind(NormKind):
    name = "instancenorm"
    modules = (nn.modules.instancenorm._InstanceNorm,)
    functional = "instance_norm"
    onnx_ops = (("", "InstanceNormalization"),)

    def from_call(self, cap: Any, node: Any, x: Any) -> dict[str, Any]:
        return dict(weight=cap.param_name(arg(node, 3, "weight")), bias=cap.param_name(arg(node, 4, "bias")),
                    eps=scalar(arg(node, 7, "eps", 1e-5)), num_features=channels_of(cap, x))

    def native(self, site: Any, tensors: dict[str, torch.Tensor | None], shape: tuple[int, ...],
               dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, str, list[str]]:
        # (x - mean_HW) / sqrt(var_HW + eps) * w + b  =>  nn.InstanceNormNd(C, eps, affine)
        c, w, b = int(site.num_features), tensors["weight"], tensors["bias"]
        cls = {2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}[{2: 1, 3: 1, 4: 2, 5: 3}.get(len(shape), 1)]
        affine = w is not None or b is not None
        mod = cls(c, eps=float(site.eps), affine=affine, track_running_stats=False, device=device, dtype=dtype)
        notes: list[str] = []
        if affine:
            copy_affine(mod, w, b, c, site.weight_offset, notes)
        return mod, f"nn.{cls.__name__}({c}, eps={float(site.eps):g})", notes

    def onnx_op(self, target: str, opset: int) -> str:
        return "InstanceNormalization"


INSTANCENORM = InstanceNormKind()
