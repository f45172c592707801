"""A norm written over a regrouped view: GroupNorm and InstanceNorm as users write them (Wu & He's own code).

  x (N, C, *S)  --view / reshape / flatten-->  (N, G, L)  or  (N * G, L)      G divides C, G * L = C * prod(S)
  standardize over the last axis (biased variance, eps inside the root)
  --view back to (N, C, *S)-->                                  =>  nn.GroupNorm(G, C, eps) on x
  (G = C on an image or volume: the InstanceNorm of its rank)
A regrouping keeps the row-major order, so row (n, g) of the view holds exactly sample n's channels
g C/G .. (g + 1) C/G - 1 at every position: the statistics of GroupNorm's group g. A per-channel affine after the
view back (``* w.view(1, C, 1, 1) + b.view(1, C, 1, 1)``) is the GroupNorm's affine (``graph.handwritten``'s tail).
The native module takes any spatial size, as the user's ``view(N, G, -1)`` does; the example's LayerNorm over L
would not (a norm pinned to the example's size).
"""

from __future__ import annotations

import math

import torch.fx as fx

from normconv.graph.capture import Captured
from normconv.match import REGROUP, call_name


def regrouped(cap: Captured, x: fx.Node, y: fx.Node) -> tuple[fx.Node, fx.Node, int] | None:
    """(x0, back, G): the norm's input ``x`` is ``x0`` regrouped into G groups per sample and its output ``y`` is
    regrouped back to ``x0``'s shape by ``back``; None for any other norm."""
    x0 = x.args[0] if call_name(x) in REGROUP and x.args else None
    shape, shape0 = cap.shape(x), cap.shape(x0) if isinstance(x0, fx.Node) else None
    if not shape or not shape0 or len(shape0) < 2 or len(shape) not in (2, 3):
        return None
    n, c, total = shape0[0], shape0[1], math.prod(shape0[1:])
    # (N, G, L): the batch kept, G groups  |  (N * G, L): samples and groups folded into rows
    groups = shape[1] if len(shape) == 3 and shape[0] == n else shape[0] // n if len(shape) == 2 and n else 0
    if not groups or c % groups or groups * shape[-1] != total or (len(shape) == 2 and shape[0] != n * groups):
        return None
    if groups == c and len(shape0) == 3:  # a row per (sample, dim-1 entry) of a 3-D tensor: its last axis, as a
        return None  # LayerNorm reads tokens (B, S, H) flattened to rows; the layernorm rule keeps S free
    users = cap.users(y)
    back = users[0] if len(users) == 1 else None
    if back is None or call_name(back) not in REGROUP or back.args[0] is not y or cap.shape(back) != shape0:
        return None
    return x0, back, groups


__all__ = ["regrouped"]
