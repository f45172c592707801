"""BatchNorm (inference): y = (x - running_mean) / sqrt(running_var + eps) * w + b per channel (dim 1).

torch: nn.BatchNorm1d/2d/3d, nn.SyncBatchNorm, nn.LazyBatchNorm*, F.batch_norm and its aten forms
(aten.batch_norm, native_batch_norm, _native_batch_norm_legit(_no_training)); eps default 1e-5.
ONNX: BatchNormalization (when no neighbour absorbs it: fold).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from normconv.match import batch_norm_args, scalar
from normconv.kinds.base import NormKind, channels_of, copy_affine


class BatchNormKind(NormKind):
    name = "batchnorm"
    modules = (nn.modules.batchnorm._BatchNorm,)
    functional = "batch_norm"
    onnx_ops = (("", "BatchNormalization"),)

    def from_call(self, cap: Any, node: Any, x: Any) -> dict[str, Any]:
        a, p = batch_norm_args(node), cap.param_name
        fields = dict(eps=scalar(a["eps"]), weight=p(a["weight"]), bias=p(a["bias"]),
                      running_mean=p(a["running_mean"]), running_var=p(a["running_var"]),
                      num_features=channels_of(cap, x))
        if a["training"] is True:
            fields["notes"] = ("training=True: normalizes with batch statistics",)
        return fields

    def native(self, site: Any, tensors: dict[str, torch.Tensor | None], shape: tuple[int, ...],
               dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, str, list[str]]:
        # (x - rm) / sqrt(rv + eps) * w + b  =>  nn.BatchNormNd(C, eps) in eval with rm, rv copied
        c, w, b = int(site.num_features), tensors["weight"], tensors["bias"]
        cls = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[{2: 1, 3: 1, 4: 2, 5: 3}.get(len(shape), 1)]
        affine = w is not None or b is not None
        mod = cls(c, eps=float(site.eps), affine=affine, device=device, dtype=dtype)
        with torch.no_grad():
            mod.running_mean.copy_(tensors["running_mean"].detach().reshape(c))
            mod.running_var.copy_(tensors["running_var"].detach().reshape(c))
        mod.eval()
        notes = ["eval mode, running statistics copied"]
        if affine:
            copy_affine(mod, w, b, c, site.weight_offset, notes)
        return mod, f"nn.{cls.__name__}({c}, eps={float(site.eps):g})", notes

    def statistics(self, site: Any, x: torch.Tensor) -> tuple[float, float]:
        return 0.0, 0.0  # eval BN squares nothing at run time: its statistic is the running var

    def onnx_op(self, target: str, opset: int) -> str:
        return "BatchNormalization"


BATCHNORM = BatchNormKind()
