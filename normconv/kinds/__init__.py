"""Norm kinds, one file each, listed in one explicit tuple.

    from normconv.kinds import KINDS, by_name, of_module
    for kind in KINDS: ...                 # detection, canonicalize, headroom, outputs, ONNX iterate this tuple

  base.py          the NormKind contract (what a kind knows: modules, functional op, site fields, the native
                   module, statistics for headroom, its ONNX op, its torch-only form)
  batchnorm.py layernorm.py rmsnorm.py groupnorm.py instancenorm.py   one kind each

Adding a kind: one file with a NormKind subclass and its instance, one entry in KINDS (ARCHITECTURE.md, "How to
add a norm kind"). Kinds import torch, normconv.nn and normconv.match only: everything else imports them.
"""

from __future__ import annotations

import torch.nn as nn

from normconv.kinds.base import NormKind
from normconv.kinds.batchnorm import BATCHNORM
from normconv.kinds.groupnorm import GROUPNORM
from normconv.kinds.instancenorm import INSTANCENORM
from normconv.kinds.layernorm import LAYERNORM
from normconv.kinds.rmsnorm import RMSNORM

KINDS: tuple[NormKind, ...] = (BATCHNORM, LAYERNORM, RMSNORM, GROUPNORM, INSTANCENORM)
NAMES: tuple[str, ...] = tuple(k.name for k in KINDS)
# every native norm module class (a subclass whose forward is its own is user code: ``is_native``)
NATIVE_MODULES: tuple[type, ...] = tuple(cls for k in KINDS for cls in k.modules)
_BY_NAME = {k.name: k for k in KINDS}
_BY_OP = {k.functional: k for k in KINDS}


def by_name(name: str) -> NormKind:
    return _BY_NAME[name]


def for_op(op: str | None) -> NormKind | None:
    """The kind whose functional form is the canonical op ``op`` (normconv.match), or None."""
    return _BY_OP.get(op) if op is not None else None


def of_module(module: nn.Module) -> NormKind | None:
    """The kind of a norm module (native or a subclass), or None."""
    return next((k for k in KINDS if isinstance(module, k.modules)), None)


def is_native(module: nn.Module) -> bool:
    """A norm module whose forward is torch's own (or normconv's exact fast subclass)."""
    kind = of_module(module)
    return kind is not None and kind.is_native(module)


__all__ = ["KINDS", "NAMES", "NATIVE_MODULES", "NormKind", "by_name", "for_op", "of_module", "is_native"]
