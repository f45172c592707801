"""What detection finds: one record per normalization site (``NormSite``), and per weight standardization.

``normconv.graph.detect`` fills them; every pass, the ONNX plan and the reports read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NormSite:
    """One normalization site and everything a pass needs to decide about it."""

    target: str  # module path (module / handwritten module) or node name (functional / inline)
    kind: str  # a kind name (normconv.kinds.NAMES)
    source: str  # module | functional | handwritten
    node: str  # graph node holding the norm's output
    input: str  # graph node holding the norm's input
    owner: str = ""  # module path that computes the site ('' = root)
    module_type: str | None = None  # class name of the norm module (native or hand-written)
    dims: tuple[int, ...] | None = None  # normalized dims, negative (layernorm / rmsnorm)
    normalized_shape: tuple[int, ...] | None = None
    num_features: int | None = None  # channels (batchnorm / groupnorm / instancenorm)
    num_groups: int | None = None
    eps: float | None = None  # effective epsilon (nn.RMSNorm(eps=None) -> finfo(dtype).eps)
    weight: str | None = None  # state_dict name of the scale
    bias: str | None = None
    weight_offset: float = 0.0  # 1.0 for Gemma-style x * (1 + w)
    running_mean: str | None = None
    running_var: str | None = None
    upcast: bool = False  # statistics computed in float32 from a lower-precision input
    producer: str = "other"  # what computes the input: conv, conv_transpose, linear, embedding, add, input, ...
    placement: str = "other"
    calls: int = 1  # how many sites share this target (a module called more than once)
    nodes: tuple[str, ...] = ()  # every node of the site
    self_contained: bool = True  # no intermediate value of the site is used outside it
    channel_vectors: bool = False  # its statistics and affine are (C,) vectors read along dim 1 (checked on shapes)
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "kind": self.kind,
            "source": self.source,
            "module_type": self.module_type,
            "owner": self.owner,
            "eps": self.eps,
            "dims": list(self.dims) if self.dims is not None else None,
            "normalized_shape": list(self.normalized_shape) if self.normalized_shape is not None else None,
            "num_features": self.num_features,
            "num_groups": self.num_groups,
            "affine": {"weight": self.weight, "bias": self.bias, "weight_offset": self.weight_offset},
            "running_stats": ({"mean": self.running_mean, "var": self.running_var}
                              if self.running_mean or self.running_var else None),
            "upcast": self.upcast,
            "producer": self.producer,
            "placement": self.placement,
            "calls": self.calls,
            "nodes": len(self.nodes),
            "node": self.node,
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class WeightStandardization:
    """A norm-shaped computation whose input is a parameter (BiT / timm StdConv: F.batch_norm or a hand-written
    (w - mean) / sqrt(var + eps) on a conv's weight): it standardizes a constant, it is not an activation norm."""

    site: NormSite  # the computation as detection matched it (kind: how it is written)
    param: str  # state_dict name of the standardized tensor
    consumer: str  # what reads the result (a conv / linear module path, or a node name; '' when none)

    def to_json(self) -> dict[str, Any]:
        return {"target": self.site.target, "node": self.site.node, "param": self.param,
                "consumer": self.consumer, "written_as": f"{self.site.source} {self.site.kind}",
                "eps": self.site.eps,
                "reason": (f"weight standardization of {self.param}: the input is a parameter, not an activation; "
                           f"constant at inference (not an activation {self.site.kind}); fold and export compute it "
                           f"once into the conv's weight") if self.consumer else
                          (f"a {self.site.kind} of the parameter {self.param}, not of an activation: constant at "
                           f"inference, recomputed by every forward; left as written (no layer reads it as its "
                           f"weight, so there is no weight to fold it into)")}
