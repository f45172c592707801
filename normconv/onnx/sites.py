"""The norm sites of an ONNX file, for ``inspect``: each with its kind, eps, shape and what feeds it.

Two sources, one row per site:

  op       a norm op the file holds already: ONNX's own (BatchNormalization, LayerNormalization,
           InstanceNormalization, GroupNormalization, RMSNormalization), onnxruntime's contrib ops
           ((Skip)(Simplified)LayerNormalization), normconv's placeholders (normconv.RMSNorm, normconv.GroupNorm).
           eps: the node's ``epsilon`` attribute, else the op schema's default; shape: the scale's shape
           (C= for the per-channel ops), G= where the op has groups.
  pattern  a norm written out in elementwise ops that a fuse rule looked at (``rules``): its facts as the rule
           read them (eps, normalized shape) where it matched; "-" where it refused before reading them.

The bodies of normconv's placeholder functions are not sites (the placeholder op is); a norm op inside a
subgraph (If, Loop, Scan) or a local function is.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir

from normconv.onnx.ops import DOMAIN, MS_DOMAIN
from normconv.onnx.rules.base import SiteLog, attr, const, fed_by, name_of

# (domain, op_type) -> (kind, the schema's default epsilon)
NORM_OPS: dict[tuple[str, str], tuple[str, float]] = {
    ("", "BatchNormalization"): ("batchnorm", 1e-5),
    ("", "LayerNormalization"): ("layernorm", 1e-5),
    ("", "InstanceNormalization"): ("instancenorm", 1e-5),
    ("", "GroupNormalization"): ("groupnorm", 1e-5),
    ("", "RMSNormalization"): ("rmsnorm", 1e-5),
    ("", "SimplifiedLayerNormalization"): ("rmsnorm", 1e-5),  # onnxruntime registers it in the ONNX domain
    (MS_DOMAIN, "SkipLayerNormalization"): ("layernorm", 1e-12),
    (MS_DOMAIN, "SkipSimplifiedLayerNormalization"): ("rmsnorm", 1e-12),
    (DOMAIN, "RMSNorm"): ("rmsnorm", 1e-5),
    (DOMAIN, "GroupNorm"): ("groupnorm", 1e-5),
}
_SCALE = {"BatchNormalization": 1, "SkipLayerNormalization": 2, "SkipSimplifiedLayerNormalization": 2}  # else 1
_PER_CHANNEL = ("batchnorm", "instancenorm", "groupnorm")  # a scale of C channels, not a normalized shape


def _domain(node: ir.Node) -> str:
    return "" if node.domain in ("", "ai.onnx") else node.domain


def _nodes(model: ir.Model):
    """Every node of the main graph and its subgraphs, and of the file's own local functions (not normconv's
    placeholder bodies)."""
    yield from ir.traversal.RecursiveGraphIterator(model.graph)
    for f in model.functions.values():
        if f.domain != DOMAIN:
            yield from ir.traversal.RecursiveGraphIterator(f)


def _shape(node: ir.Node, kind: str) -> str:
    """The scale's shape ("C=64", "768", "4x8"), with the groups where the op has them; "-" where unknown."""
    i = _SCALE.get(node.op_type, 1)
    scale = node.inputs[i] if len(node.inputs) > i else None
    dims = None
    if scale is not None and scale.shape is not None and all(isinstance(d, int) for d in scale.shape):
        dims = list(scale.shape)
    elif scale is not None and (c := const(scale)) is not None:
        dims = list(c.shape)
    groups = attr(node, "num_groups")
    parts = []
    if dims is not None:
        parts.append(f"C={dims[0]}" if kind in _PER_CHANNEL and len(dims) == 1 else "x".join(map(str, dims)))
    if groups is not None:
        parts.append(f"G={groups}")
    return " ".join(parts) or "-"


def norm_sites(model: ir.Model) -> list[dict[str, Any]]:
    """The norm ops ``model`` holds, one row each (call before a rewrite changes the model)."""
    out = []
    for node in _nodes(model):
        known = NORM_OPS.get((_domain(node), node.op_type))
        if known is None:
            continue
        kind, eps = known
        op = node.op_type if not _domain(node) else f"{node.domain}.{node.op_type}"
        out.append({"target": name_of(node), "kind": kind, "source": "op", "op": op,
                    "eps": float(attr(node, "epsilon", eps)), "shape": _shape(node, kind), "fed_by": fed_by(node.inputs[0] if node.inputs else None)})
    return out


def pattern_sites(log: SiteLog, kinds: tuple[str, ...]) -> list[dict[str, Any]]:
    """The written-out norms the fuse rules looked at (``kinds``: the log's norm kinds), with what they read."""
    out = []
    for kind, site in log.sites():
        if kind in kinds:
            facts = log.facts.get(site.target, {})
            out.append({"target": site.target, "kind": kind, "source": "pattern", "op": "elementwise ops",
                        "eps": facts.get("eps"), "shape": facts.get("shape", "-"), "fed_by": facts.get("fed_by", "-")})
    return out


PATTERN_KINDS = ("layernorm", "rmsnorm", "groupnorm")  # the fuse rules' kinds (the fold rules log op sites)


def inspect_sites(found: list[dict[str, Any]], log: SiteLog) -> list[dict[str, Any]]:
    """Every site once: the norm ops ``found`` before the rewrite, then the written-out norms the rules looked at
    (an op inside a written-out norm, GroupNorm's InstanceNormalization, is that norm's, not a site of its own).
    Each with ``plan``: the rules' rows for it (what fold / export would do, or why not), none for an op kept as
    it is."""
    inner = {f.get("inner") for f in log.facts.values()}
    rows = [r for r in found if r["target"] not in inner] + pattern_sites(log, PATTERN_KINDS)
    for r in rows:
        seen = dict.fromkeys((s.pass_name, s.applied, str(s.code), s.reason) for _, s in log.rows.get(r["target"], []))
        r["plan"] = [{"pass": p, "applied": a, "code": c, "reason": why} for p, a, c, why in seen]
    return rows


__all__ = ["NORM_OPS", "PATTERN_KINDS", "inspect_sites", "norm_sites", "pattern_sites"]
