"""The norm-kind contract: everything normconv knows about one kind of normalization, in one object.

A kind is one file in ``normconv/kinds/`` holding one ``NormKind`` subclass and its instance; ``kinds.KINDS`` lists
them in an explicit tuple (no import-time registry). Detection, canonicalize, headroom, the torch-only output forms,
the ONNX lowering and the before/after counts iterate through that tuple:

  name            "layernorm", the ``NormSite.kind`` and JSON name
  modules         torch's native modules of the kind (a subclass whose forward is its own is user code)
  functional      the canonical op (``normconv.match``) of its functional / aten form: "layer_norm"
  onnx_ops        the (domain, op_type) pairs that count as its one fused op in an ONNX graph
  from_module     NormSite fields read off a native module
  from_call       NormSite fields read off a functional / aten call
  native          the torch module computing a detected site (canonicalize), with how to say it
  statistics      what the norm squares and the statistic it forms on an input (half-precision headroom)
  onnx_op         the one op a site exports as at a target and opset
  torch_only      torch's own module for a normconv module of the kind (None when it is not one)

Kinds sit low (below detection, the passes, the outputs and ONNX): they import torch, ``normconv.nn`` and the
matching primitives of ``normconv.match`` only.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn as nn


class NormKind:
    """One kind of normalization; see the module docstring."""

    name: ClassVar[str]
    modules: ClassVar[tuple[type, ...]]
    functional: ClassVar[str]
    onnx_ops: ClassVar[tuple[tuple[str, str], ...]] = ()

    def from_module(self, module: nn.Module, path: str, dtype: torch.dtype) -> dict[str, Any]:
        """NormSite fields of a native module at ``path`` computing in ``dtype``."""
        eps = getattr(module, "eps", None)
        shape = getattr(module, "normalized_shape", None)
        param = lambda attr: f"{path}.{attr}" if getattr(module, attr, None) is not None else None  # noqa: E731
        return dict(
            dims=tuple(range(-len(shape), 0)) if shape is not None else None,
            normalized_shape=tuple(shape) if shape is not None else None,
            num_features=getattr(module, "num_features", getattr(module, "num_channels", None)),
            num_groups=getattr(module, "num_groups", None),
            eps=float(eps) if eps is not None else None, weight=param("weight"), bias=param("bias"),
            running_mean=param("running_mean"), running_var=param("running_var"))

    def from_call(self, cap: Any, node: Any, x: Any) -> dict[str, Any]:
        """NormSite fields of a functional / aten call ``node`` on input ``x`` in the capture ``cap``."""
        raise NotImplementedError

    def native(self, site: Any, tensors: dict[str, torch.Tensor | None], shape: tuple[int, ...],
               dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, str, list[str]]:
        """(module, its description, notes): the native module computing ``site`` with the site's ``tensors``
        (weight, bias, running_mean, running_var; None when absent), in ``dtype`` on ``device``; ``shape`` is the
        input's."""
        raise NotImplementedError

    def reduce_dims(self, site: Any, x: torch.Tensor) -> tuple[int, ...]:
        """The dims the norm reduces over on ``x`` (batch and channels kept by batch / instance / group norms)."""
        return tuple(range(2, x.dim())) if x.dim() > 2 else (0,)

    def statistics(self, site: Any, x: torch.Tensor) -> tuple[float, float]:
        """(largest squared element, largest statistic) the norm forms on ``x``, in float64: by default the
        centered square (x - mean)^2 and the variance."""
        x = x.detach().double()
        dims = self.reduce_dims(site, x)
        xc = x - x.mean(dims, keepdim=True)
        sq = xc * xc
        return float(sq.max()), float(sq.mean(dims).max())

    def onnx_op(self, target: str, opset: int) -> str:
        """The one op a site of this kind exports as (``target`` onnx | ort)."""
        raise NotImplementedError

    def torch_only(self, module: nn.Module) -> nn.Module | None:
        """torch's own module for a normconv module of this kind, or None when ``module`` is not one."""
        return None

    def is_native(self, module: nn.Module) -> bool:
        """A module of the kind whose forward is torch's own (or normconv's exact fast subclass); a subclass that
        overrides forward anywhere else is user code."""
        if not isinstance(module, self.modules):
            return False
        owner = next(cls for cls in type(module).__mro__ if "forward" in cls.__dict__)
        return owner.__module__.startswith(("torch.nn.", "normconv."))

    def __repr__(self) -> str:
        return f"<norm kind {self.name}>"


def shape_text(ns: tuple[int, ...]) -> str:
    return str(ns[0]) if len(ns) == 1 else str(tuple(ns))


def channels_of(cap: Any, x: Any) -> int | None:
    """dim 1 of the input (a batch / group / instance norm's channels), when known."""
    shape = cap.shape(x)
    return shape[1] if shape and len(shape) > 1 else None


def copy_affine(module: nn.Module, w: torch.Tensor | None, b: torch.Tensor | None, size: Any, offset: float,
                notes: list[str]) -> None:
    """Weight and bias of a per-channel native module from the site's (ones / zeros where one is missing)."""
    with torch.no_grad():
        module.weight.copy_(w.detach().reshape(size) + offset if w is not None else torch.ones(size))
        module.bias.copy_(b.detach().reshape(size) if b is not None else torch.zeros(size))
    if w is None or b is None:
        notes.append("weight of ones added" if w is None else "bias of zeros added")


__all__ = ["NormKind", "shape_text", "channels_of", "copy_affine"]
