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
    return new
