"""normconv's ONNX rules, one file per norm kind (patterns, checks, rewrites), and the rule set of each job.

  fold    BatchNormalization into its Conv / ConvTranspose / Gemm / MatMul neighbour      (batchnorm.py)
  fuse    LayerNorm -> LayerNormalization, RMSNorm -> normconv.RMSNorm, GroupNorm -> normconv.GroupNorm
          (layernorm.py, rmsnorm.py, groupnorm.py); the placeholders are lowered per target afterwards
          (passes/lower.py), so the rule set of a target is ``fuse`` + its lowering
LayerNorm rules come before RMSNorm's: d / sqrt(E[d²] + ε) with d = x − E[x] also reads as an RMSNorm of d.
"""

from __future__ import annotations

from normconv.onnx.rules import batchnorm, groupnorm, layernorm, rmsnorm
from normconv.onnx.rules.base import SiteLog


def fold_rules(log: SiteLog) -> list:
    return batchnorm.rules(log)


def fuse_rules(log: SiteLog) -> list:
    return layernorm.rules(log) + rmsnorm.rules(log) + groupnorm.rules(log)


def inline_rules(log: SiteLog) -> list:
    """The torch export's ONNX half: LayerNorms and RMSNorms written inside bigger modules (not replaced in torch)
    matched in the exported graph; the exporter emits GroupNorm as normconv's placeholder itself."""
    return layernorm.rules(log) + rmsnorm.rules(log)
