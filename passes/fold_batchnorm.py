"""Fold BatchNorm into the neighbouring conv / linear for inference (eval mode, running statistics).

  s = gamma / sqrt(var + eps),  t = beta - mean * s
  backward (conv -> bn):  W' = W * s (per output channel),  b' = (b - mean) * s + beta
  forward  (bn -> layer): y = W (s x + t) = (W s) x + W t   (Linear; conv only with zero padding)
"""

from __future__ import annotations

from typing import Sequence

import torch.fx as fx

from normconv.detect import NormSite, producer_of
from normconv.graph import Captured
from normconv.report import Site

from .base import apply, skip

NAME = "fold"


def _single_consumer(cap: Captured, node: fx.Node) -> fx.Node | None:
    users = cap.users(node)
    return users[0] if len(users) == 1 else None


def plan(cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
    """What folding would do at each batchnorm site, or why it cannot."""
    return [_plan_one(cap, s) for s in norms if s.kind == "batchnorm"]


def _plan_one(cap: Captured, site: NormSite) -> Site:
    mod = cap.modules.get(site.target) if site.source != "functional" else None
    # no running statistics  =>  nothing to fold
    if site.running_mean is None or site.running_var is None:
        return skip(NAME, site, "no running statistics (track_running_stats=False): it normalizes with batch statistics")
    # training mode  =>  BN uses batch statistics, folding would change the model
    if mod is not None and mod.training:
        return skip(NAME, site, "module is in training mode: call .eval() first (or pass --eval)")
    kind, prod = producer_of(cap, cap.nodes[site.input])
    if kind in ("conv", "conv_transpose", "linear"):
        prod_mod = cap.modules.get(prod.target) if prod.op == "call_module" else None
        # conv output used elsewhere  =>  folding would change the other user
        if len(cap.users(prod)) > 1:
            return skip(NAME, site, f"{_name(prod)} output is also used elsewhere")
        # same module called at several places  =>  one weight cannot carry two folds
        if prod_mod is not None and cap.module_calls.get(prod.target, 0) > 1:
            return skip(NAME, site, f"{prod.target} is called at {cap.module_calls[prod.target]} places")
        # Linear on (N, L, C) + BatchNorm1d normalizes dim 1, not the linear's output features
        shape = cap.shape(cap.nodes[site.input])
        if kind == "linear" and shape is not None and len(shape) != 2:
            return skip(NAME, site, f"BatchNorm normalizes dim 1 of a {len(shape)}-d output, but "
                                    f"{_name(prod)} writes features on the last dim")
        return apply(NAME, site, f"fold into {_name(prod)} (backward)")
    consumer = _single_consumer(cap, cap.nodes[site.node])
    ckind = cap.op(consumer) if consumer is not None else None
    if consumer is not None and consumer.op == "call_module" and ckind in ("linear", "conv"):
        cmod = cap.modules[consumer.target]
        padding = getattr(cmod, "padding", 0)
        # bn -> conv with padding  =>  zeros padded after BN are not t
        if ckind == "conv" and (padding == "same" or any(p != 0 for p in (padding if isinstance(padding, tuple) else (padding,)))):
            return skip(NAME, site, f"forward fold into {consumer.target} needs zero padding (it has padding={padding})")
        return apply(NAME, site, f"fold into {consumer.target} (forward)")
    between = f"{kind} between the producer and the BN" if kind not in ("input", "other") else f"input comes from {kind}"
    return skip(NAME, site, f"no foldable neighbour ({between}): a per-channel scale and shift at best")


def _name(node: fx.Node) -> str:
    return node.target if node.op == "call_module" else node.name
