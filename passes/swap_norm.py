"""Swap LayerNorm <-> RMSNorm, exactly where the residual stream allows it.

  LN(x) = LN(x - mean(x));  if every writer of the stream is zero-mean, mean(x) = 0 and
  LN(x) = RMSNorm(x) * gamma + beta   (same eps; beta folds into the consuming linears or stays a bias)
Pre-LN: center embeddings (row means) and each sublayer's output projection (W <- W - mean_rows W, b <- b - mean b).
Post-LN: the stream is re-normalized with a bias after every sublayer, so it is not zero-mean: approximate only.
"""

from __future__ import annotations

from typing import Sequence

from normconv.detect import NormSite
from normconv.graph import Captured
from normconv.report import Site

from .base import apply, skip

NAME = "swap"


def plan(cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
    return [_plan_one(cap, s) for s in norms if s.kind in ("layernorm", "rmsnorm")]


def _plan_one(cap: Captured, site: NormSite) -> Site:
    if site.kind == "rmsnorm":
        # RMSNorm -> LayerNorm is exact only on a zero-mean stream
        return skip(NAME, site, "to layernorm: exact only where its input stream is zero-mean; else --approximate")
    # pre-norm / final norm of a pre-norm stack  =>  exact once the stream writers are centered
    if site.placement in ("pre-norm", "final-norm"):
        return apply(NAME, site, "to rmsnorm, exact: center the residual-stream writers (Pre-LN)")
    # post-norm  =>  LN re-adds its bias to the stream; no exact swap
    if site.placement == "post-norm":
        return skip(NAME, site, "post-LN: the residual stream is not zero-mean; only --approximate (drift measured)")
    return skip(NAME, site, f"not in a pre-norm residual stream ({site.placement}); only --approximate")
