"""Copies that cost only what changes: the module tree is copied, the tensors are shared until written.

    work = clone_sharing_tensors(model)   # new modules, the user's Parameters and buffers (no bytes copied)
    w = owned(work, work.conv.weight)     # before writing: one clone, swapped in wherever the tensor is held
    w.mul_(s)                             # the user's model never sees it

A pass never writes into a tensor it did not get from ``owned``: that is what keeps the user's model
bit-identical while a 7B model is rewritten at the memory of the tensors that change.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import torch
import torch.nn as nn

_OWNED_ATTR = "_normconv_owned_ids"  # ids of tensors this copy made for itself (kept on the root, out of state)


def clone_sharing_tensors(model: nn.Module, writable: bool = False) -> nn.Module:
    """A copy of ``model``'s module tree (modes, hooks, attributes) whose parameters and buffers are the
    original tensor objects; plain tensor attributes and everything else are deep-copied.

    ``writable``: the original's tensors count as the copy's own (``owned`` returns them as they are), so passes
    write into them: only for a model nobody else holds (the command line's), whose outputs were already taken."""
    memo: dict[int, object] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        memo[id(t)] = t
    tensor_ids = set(memo) if writable else set()
    clone = copy.deepcopy(model, memo)
    clone.__dict__[_OWNED_ATTR] = tensor_ids
    return clone


def owned(root: nn.Module, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as ``root``'s own copy, safe to write in place. Every module of ``root`` that holds the tensor
    (tied weights) gets the same copy, so ties survive. A tensor already owned is returned as it is."""
    mine: set[int] = root.__dict__.setdefault(_OWNED_ATTR, set())
    if id(tensor) in mine:
        return tensor
    data = tensor.detach().clone()
    new = nn.Parameter(data, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else data
    found = False
    for module in root.modules():
        for name, p in list(module._parameters.items()):
            if p is tensor:
                module._parameters[name] = new
                found = True
        for name, b in list(module._buffers.items()):
            if b is tensor:
                module._buffers[name] = new
                found = True
    if not found:  # not a parameter or buffer of root: a tensor the pass made itself, already its own
        mine.add(id(tensor))
        return tensor
    mine.add(id(new))
    return new


def adopt(root: nn.Module, tensor: torch.Tensor) -> torch.Tensor:
    """Record ``tensor`` (one the pass just made, e.g. an untied copy) as ``root``'s own: ``owned`` returns it as it
    is instead of cloning it again."""
    root.__dict__.setdefault(_OWNED_ATTR, set()).add(id(tensor))
    return tensor


def copy_on_write(root: nn.Module, originals: nn.Module) -> None:
    """The tensors of ``originals`` are no longer ``root``'s own (a writable copy made them so): from now on
    ``owned`` copies them before a write, and ``originals`` keeps its values."""
    mine = root.__dict__.get(_OWNED_ATTR)
    if mine:
        mine.difference_update(id(t) for t in list(originals.parameters()) + list(originals.buffers()))


def release(root: nn.Module) -> nn.Module:
    """Forget the ownership record before the model leaves normconv (it is not part of the user's model)."""
    root.__dict__.pop(_OWNED_ATTR, None)
    return root


@contextlib.contextmanager
def owning_as(part: nn.Module, root: nn.Module) -> Iterator[nn.Module]:
    """Within the block, ``part`` (a submodule of ``root`` a pass rewrites alone) shares ``root``'s ownership record:
    a tensor ``root`` owns is written in place, not cloned again, and no record is left on ``part`` after."""
    part.__dict__[_OWNED_ATTR] = root.__dict__.setdefault(_OWNED_ATTR, set())
    try:
        yield part
    finally:
        part.__dict__.pop(_OWNED_ATTR, None)


__all__ = ["clone_sharing_tensors", "owned", "adopt", "copy_on_write", "release", "owning_as"]
