"""The module a norm site can be replaced as: the norm module itself, or a module whose forward is the norm followed
by its own child modules alone, which a replacement keeps in their order:

  nn.BatchNorm2d / SyncBatchNorm / a hand-written norm module        ->  ModuleForm(path)
  timm's BatchNormAct2d: F.batch_norm(x, ...) -> self.drop -> self.act  ->  ModuleForm(path, tail=("drop", "act"))
  mmcv's SyncBatchNorm, detectron2's FrozenBatchNorm2d: F.batch_norm   ->  ModuleForm(path)

A module's forward qualifies when, in the call that computes the site, the norm reads the module's input as it comes
and every value from the norm's output to the module's output is computed by one child module after another. Nodes
the output does not depend on (timm's ``_assert(x.ndim == 4)``) do not count. Children that leave no node in a graph
(nn.Identity, nn.Dropout in eval) are kept too, in the order the module registers them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx
import torch.nn as nn

from normconv.graph.capture import Captured
from normconv.graph.site import NormSite
from normconv.report import Why

_SILENT = (nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)


class FormWhy(Why):
    """Why a norm site is not a module a replacement can take the place of."""

    INLINE = "inline"  # the norm is computed inside a larger forward
    MORE_CODE = "forward-computes-more"  # the module's forward computes more than the norm and its children
    CALLED_TWICE = "module-called-several-times"  # one module, several calls: replacing it replaces every call


class NotAModule(Exception):
    """The site is no module to replace: its code, and the message reported for the site."""

    def __init__(self, code: FormWhy, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ModuleForm:
    """The module at ``path`` computes the site and then its children ``tail`` in order, nothing else."""

    path: str
    tail: tuple[str, ...] = ()


def module_form(cap: Captured, site: NormSite) -> ModuleForm:
    """Where a replacement of ``site`` goes, or NotAModule."""
    whole = site.source == "module" or (site.source == "handwritten" and site.target == site.owner)
    path = site.target if whole else site.owner
    module = cap.model if path == "" else cap.modules.get(path)
    # a whole norm module called twice is two sites of one target (detect counts them); a module around a
    # functional norm is counted by its calls in the graph
    calls = set() if whole or not path else \
        {c for n in cap.gm.graph.nodes if (c := cap.call_of(n, path)) is not None}
    if site.calls > 1 or len(calls) > 1 or cap.module_calls.get(path, 1) > 1:
        raise NotAModule(FormWhy.CALLED_TWICE, f"{path} is called at {max(site.calls, len(calls), 2)} places: a "
                                               f"replacement would replace every call")
    if whole:
        return ModuleForm(path)
    if module is None:
        raise NotAModule(FormWhy.INLINE, f"the {site.kind} is computed inline in {site.owner or 'the root forward'}")
    inside = [n for n in cap.gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")
              and not cap.is_noise(n) and (path == "" or path in cap.owner_stack(n))]
    names = {n.name for n in inside}
    start = cap.nodes[site.input]
    if start.name in names:
        raise NotAModule(FormWhy.MORE_CODE, f"{path or 'the model'} computes the {site.kind}'s input itself "
                                            f"({cap.describe(start)})")
    # from the norm's output, one child module after another to the module's output
    v, visited, chain = cap.nodes[site.node], [], []
    while True:
        users = [u for u in cap.users(v) if u.name in names]
        if not users:
            break
        child = _child(cap, users[0], path)
        if len(users) > 1 or child is None:
            raise NotAModule(FormWhy.MORE_CODE, f"{path or 'the model'} computes more than the {site.kind} and its "
                                                f"child modules ({cap.describe(users[0])})")
        if not chain or chain[-1] != child:
            if child in chain:
                raise NotAModule(FormWhy.MORE_CODE, f"{path}.{child} is called twice after the {site.kind}")
            chain.append(child)
        visited.append(users[0])
        v = users[0]
    # nothing else inside the module feeds its output
    ours = set(site.nodes) | {n.name for n in visited}
    extra = [n for n in inside if n.name not in ours and n.name in cap.upstream([v])]
    if extra:
        raise NotAModule(FormWhy.MORE_CODE, f"{path or 'the model'} computes more than the {site.kind} and its child "
                                            f"modules ({cap.describe(extra[0])})")
    registered = [name for name, _ in module.named_children()]
    if [c for c in registered if c in chain] != chain:
        raise NotAModule(FormWhy.MORE_CODE, f"{path or 'the model'} calls its children in another order than it "
                                            f"registers them")
    tail = tuple(c for c in registered if c in chain or isinstance(getattr(module, c), _SILENT))
    return ModuleForm(path, tail)


def _child(cap: Captured, node: fx.Node, path: str) -> str | None:
    """The direct child of the module at ``path`` that computes ``node`` (None: the module's own code)."""
    prefix = f"{path}." if path else ""
    for p in cap.owner_stack(node):
        if p.startswith(prefix) and p != path and p:
            return p[len(prefix):].split(".")[0]
    return None


__all__ = ["FormWhy", "NotAModule", "ModuleForm", "module_form"]
