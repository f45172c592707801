"""A functional norm's scale computed as a parameter plus a constant number:

    F.layer_norm(x, shape, self.weight + 1, self.bias, eps)   (Nemotron's LayerNorm1P, Megatron's apply_layernorm_1p:
                                                              the weight stored minus one, zero-centred)
    F.rms_norm(x, shape, 1 + self.weight, eps)                (Gemma's scale written into the call)

is the same norm with the scale ``w + c``: the site's weight is ``w`` with ``weight_offset`` ``c``
(``NormSite.weight_offset``, as a hand-written ``x * (1 + w)`` is read), and the add is one of the site's nodes.
Recognized by what the argument computes, whatever the module's class.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from normconv.graph.capture import Captured
from normconv.graph.handwritten import param_through_views
from normconv.match import scalar


def offset_weight(cap: Captured, value: Any) -> tuple[str, float, tuple[str, ...]] | None:
    """``value`` computes ``w + c`` (either order; casts and views of ``w`` allowed) with ``w`` a parameter and ``c``
    a constant number: (state_dict name of w, c, names of the nodes computing it); else None."""
    if not isinstance(value, fx.Node) or cap.op(value) != "add" or len(value.args) < 2 or \
            any(k not in ("alpha",) for k in value.kwargs) or value.kwargs.get("alpha", 1) != 1:
        return None
    for param, const in ((value.args[0], value.args[1]), (value.args[1], value.args[0])):
        c = scalar(const)
        if c is None:
            continue
        views: set[str] = set()
        name = param_through_views(cap, param, views)
        if name is not None:
            # the add and the views read only for it: nothing else uses them
            if any(len(cap.users(cap.nodes[n])) != 1 for n in views | {value.name}):
                return None
            return name, c, tuple(sorted(views | {value.name}, key=cap.order.__getitem__))
    return None
