"""DeepNorm (Wang et al. 2022): every post-LN sublayer computes LN(alpha * x + f(x)) instead of LN(x + f(x));
at init, FFN, v_proj and out_proj weights (not q, k) are scaled by beta.

  encoder-only  alpha = (2N)^(1/4),  beta = (8N)^(-1/4)      decoder-only  alpha = (2M)^(1/4),  beta = (8M)^(-1/4)
  enc-dec: encoder alpha = 0.81 (N^4 M)^(1/16), beta = 0.87 (N^4 M)^(-1/16); decoder alpha = (3M)^(1/4), beta = (12M)^(-1/4)
"""

from __future__ import annotations

from typing import Sequence

from normconv.detect import NormSite
from normconv.graph import Captured
from normconv.report import Site

from .base import apply, skip

NAME = "deepnorm"


def plan(cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
    return [_plan_one(cap, s) for s in norms if s.kind in ("layernorm", "rmsnorm")]


def _plan_one(cap: Captured, site: NormSite) -> Site:
    # LN(x + f(x))  =>  LN(alpha * x + f(x))
    if site.placement == "post-norm":
        return apply(NAME, site, "residual x scaled by alpha: LN(alpha*x + f(x))")
    # x + f(LN(x))  =>  DeepNorm is defined on post-LN only
    if site.placement in ("pre-norm", "final-norm"):
        return skip(NAME, site, "pre-LN: DeepNorm is defined on post-LN residuals")
    return skip(NAME, site, f"not after a residual add ({site.placement})")
