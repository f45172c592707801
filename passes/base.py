"""The pass contract.

A pass is a small object with ``name``, ``exact`` and two calls:
  plan(cap, norms) -> list[Site]      decide, per site, apply or skip-with-a-reason; changes nothing
  __call__(model, cap) -> PassResult  apply what plan decided; PassResult(model, modified, sites)
Passes compose in an explicit tuple; ``run_sequence`` names the pass that failed.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch.nn as nn

from normconv.graph.detect import NormSite
from normconv.graph.capture import Captured
from normconv.report import PassResult, Site


class Pass(Protocol):
    name: str
    exact: bool
    # optional ``by_parts = True``: the rewrite is proved within one submodule's graph, so a model no method
    # captures whole may be rewritten part by part (flow._pass_by_parts); the whole result is verified as always

    def plan(self, cap: Captured, norms: Sequence[NormSite]) -> list[Site]: ...

    def __call__(self, model: nn.Module, cap: Captured) -> PassResult: ...


def skip(pass_name: str, site: NormSite, reason: str) -> Site:
    return Site(pass_name, site.target, False, reason)


def apply(pass_name: str, site: NormSite, reason: str) -> Site:
    return Site(pass_name, site.target, True, reason)


def replace_module(root: nn.Module, path: str, new: nn.Module) -> nn.Module:
    """Put ``new`` at dotted ``path`` in ``root`` (the user's class stays), in the replaced module's mode."""
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    new.train(getattr(parent, name).training)
    setattr(parent, name, new)
    for i in range(len(path.split("."))):
        _fastpath_off(root.get_submodule(".".join(path.split(".")[:i])))
    return new


def _fastpath_off(m: nn.Module) -> None:
    """torch's fused inference kernels hard-code LayerNorm math: turn them off on a module whose norm was replaced.

    ``TransformerEncoderLayer`` in eval / no_grad calls ``torch._transformer_encoder_layer_fwd`` with
    ``norm1.weight / norm1.bias / norm1.eps`` (a LayerNorm whatever ``norm1`` now is) unless
    ``activation_relu_or_gelu`` is 0; that flag gates only the fused path (the slow path calls ``self.activation``).
    ``TransformerEncoder`` packs inputs into nested tensors for that path when ``use_nested_tensor`` is set.
    """
    # a replaced norm inside torch's encoder layer  =>  the layer runs its module-by-module path
    if isinstance(m, nn.TransformerEncoderLayer):
        m.activation_relu_or_gelu = 0
    # ... and the encoder around it stops packing nested tensors for the fused path
    if isinstance(m, nn.TransformerEncoder):
        m.use_nested_tensor = False
