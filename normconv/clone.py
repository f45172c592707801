"""Copies that cost only what changes: the module tree is copied, the tensors are shared until written.

    work = clone_sharing_tensors(model)   # new modules, the user's Parameters and buffers (no bytes copied)
    w = owned(work, work.conv.weight)     # before writing: one clone, swapped in wherever the tensor is held
    w.mul_(s)                             # the user's model never sees it

A pass never writes into a tensor it did not get from ``owned``: that is what keeps the user's model
bit-identical while a 7B model is rewritten at the memory of the tensors that change.

A weight mapped from its file (``from_file``: a model loaded from safetensors by ``from_pretrained`` or
``safetensors.torch.load_file`` keeps its weights in a private mapping of the file) is copied by ``owned`` even in a
model the command line may write in place: writing the mapping copies each 4 KiB page on its first write, one fault
each, far slower than a copy into fresh memory (GPT-2 124M's 24 output projections, 141 MB: 195-260 ms written in
place, 27-29 ms copied, BENCHMARKS.md). Its file pages are then let go (``let_go``, madvise DONTNEED): a later read
maps them from the file again, the same bytes, so memory holds one copy, as it did when the write copied each page.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import copyreg
import ctypes
import functools
import mmap
import os
from typing import Any, Iterator

import torch
import torch.nn as nn

from normconv.libc import c_function

_OWNED_ATTR = "_normconv_owned_ids"  # the copy's ``_Owned`` record (kept on the root, out of state)


class _Owned(set):
    """The ids of the tensors a copy may write in place, and the copies ``owned`` made: id(tensor) -> (tensor, its
    copy), so that a pass asking again with the tensor it held before gets the copy, not a second one (nor, where the
    tensor is the user's, the user's tensor itself)."""

    def __init__(self, ids=()) -> None:
        super().__init__(ids)
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def clone_sharing_tensors(model: nn.Module, writable: bool = False) -> nn.Module:
    """A copy of ``model``'s module tree (modes, hooks, attributes) whose parameters and buffers are the
    original tensor objects; plain tensor attributes and everything else are deep-copied.

    ``writable``: the original's tensors count as the copy's own (``owned`` returns them as they are), so passes
    write into them: only for a model nobody else holds (the command line's), whose outputs were already taken."""
    memo: dict[int, object] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        memo[id(t)] = t
    tensor_ids = _Owned(memo) if writable else _Owned()
    clone = _copy_module(model, memo)
    clone.__dict__[_OWNED_ATTR] = tensor_ids
    return clone


def _copy_module(m: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """``copy.deepcopy(m, memo)``, the same copy, made without deepcopy's generic reduce / reconstruct per module
    and per empty hook table (0.22 of normconv.fold's 1.43 ms a block on a conv-BN chain went there): a module of a
    class that copies the plain way (``_plain``) is a new instance given, through its own ``__setstate__``, its
    ``__getstate__``'s entries: the submodules copied likewise, the parameter and buffer tables new with the tensors
    in ``memo``, an empty dict or set new, everything else deep-copied with the same ``memo`` (objects shared
    inside the model stay shared in the copy). Any other class is deep-copied."""
    if id(m) in memo:
        return memo[id(m)]
    cls = type(m)
    if not _plain(cls):
        return copy.deepcopy(m, memo)
    new = cls.__new__(cls)
    memo[id(m)] = new
    state = {}
    for k, v in m.__getstate__().items():
        if k in ("_parameters", "_buffers") and type(v) is dict:
            state[k] = {n: None if t is None else memo[id(t)] if id(t) in memo else copy.deepcopy(t, memo)
                        for n, t in v.items()}
        elif k == "_modules" and type(v) is dict:
            state[k] = {n: None if c is None else _copy_module(c, memo) for n, c in v.items()}
        elif type(v) in _ATOMIC or type(v) is tuple and all(type(x) in _ATOMIC for x in v):
            state[k] = v  # what deepcopy returns for them: the object itself
        elif type(v) in _EMPTY_NEW and not v and id(v) not in memo:
            state[k] = type(v)()
        elif isinstance(v, torch.Tensor) and v.grad_fn is not None:
            # a tensor computed from parameters (the deprecated torch.nn.utils.weight_norm's weight, recomputed by
            # its hook before each forward): shared, as parameters are; deepcopy refuses a non-leaf
            state[k] = v
        else:
            state[k] = copy.deepcopy(v, memo)
    new.__setstate__(state)
    return new


_EMPTY_NEW = (dict, set, collections.OrderedDict)  # an empty one is copied as a new empty one
_ATOMIC = frozenset((int, float, bool, str, bytes, type(None), torch.dtype))  # deepcopy gives these themselves


@functools.lru_cache(maxsize=None)
def _plain(cls: type) -> bool:
    """``cls`` is deep-copied by reduce / reconstruct with nn.Module's state: no copy hook of its own (``__deepcopy__``,
    ``__reduce_ex__``, ``__reduce__``, constructor arguments, a copyreg entry), nn.Module's ``__getstate__``, no
    slots. Its own ``__setstate__`` (Conv2d's) is called, as deepcopy calls it."""
    return (getattr(cls, "__deepcopy__", None) is None and cls.__reduce_ex__ is object.__reduce_ex__
            and cls.__reduce__ is object.__reduce__ and cls.__getstate__ is nn.Module.__getstate__
            and not hasattr(cls, "__getnewargs_ex__")
            and not hasattr(cls, "__getnewargs__") and cls not in copyreg.dispatch_table
            and cls not in copy._deepcopy_dispatch and not copyreg._slotnames(cls))


def owned(root: nn.Module, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as ``root``'s own copy, safe to write in place. Every module of ``root`` that holds the tensor
    (tied weights) gets the same copy, so ties survive. A tensor already owned is returned as it is, unless it lives
    in a mapping of its file (module docstring): then it is copied too, and its file pages let go."""
    mine: _Owned = root.__dict__.setdefault(_OWNED_ATTR, _Owned())
    copied = mine.copies.get(id(tensor))
    if copied is not None and copied[0] is tensor:  # copied already: the pass held on to the tensor it asked for
        tensor = copied[1]
    mapped = id(tensor) in mine and from_file(tensor)
    if id(tensor) in mine and not mapped:
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
    if mapped:  # whoever still holds the old tensor reads the same bytes, mapped from the file again
        let_go(tensor)
    mine.add(id(new))
    mine.copies[id(tensor)] = (tensor, new)
    return new


def adopt(root: nn.Module, tensor: torch.Tensor) -> torch.Tensor:
    """Record ``tensor`` (one the pass just made, e.g. an untied copy) as ``root``'s own: ``owned`` returns it as it
    is instead of cloning it again."""
    root.__dict__.setdefault(_OWNED_ATTR, _Owned()).add(id(tensor))
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
    part.__dict__[_OWNED_ATTR] = root.__dict__.setdefault(_OWNED_ATTR, _Owned())
    try:
        yield part
    finally:
        part.__dict__.pop(_OWNED_ATTR, None)


# -- weights mapped from their file ----------------------------------------------------------------------------

_MADV_DONTNEED = 4  # linux/mman.h
# /proc/self/pagemap entry bits 63 (page present) and 61 (file-backed or shared anonymous), as a signed 64-bit pattern
_BOTH = -(1 << 63) | (1 << 61)
_SMALL = 1 << 20  # under 1 MiB a tensor spans at most 256 pages: its faults cost less than the checks


def _madvise():
    """libc's madvise, or None where this is not Linux or libc has none."""
    return c_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int)


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """The first and one-past-last page address wholly inside ``t``'s bytes (only whole pages: a page shared with a
    neighbouring tensor is never touched), or None where ``t`` is not a plain contiguous CPU tensor of 1 MiB or more."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "cpu" or not t.is_contiguous() \
            or _madvise() is None:
        return None
    start, nbytes = t.data_ptr(), t.numel() * t.element_size()
    if nbytes < _SMALL or not start:
        return None
    page = mmap.PAGESIZE
    first, end = -(-start // page) * page, (start + nbytes) // page * page
    return (first, end) if end > first else None


def from_file(t: torch.Tensor) -> bool:
    """Every whole page of ``t`` is present and a page of a file this process never wrote (module docstring)."""
    span = _span(t)
    if span is None:
        return False
    page = mmap.PAGESIZE
    count = (span[1] - span[0]) // page
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return False
    try:
        raw = os.pread(fd, count * 8, span[0] // page * 8)
    except OSError:
        return False
    finally:
        os.close(fd)
    if len(raw) != count * 8:
        return False
    entries = torch.frombuffer(bytearray(raw), dtype=torch.int64)  # bit 63 is the sign bit: compared as a pattern
    return bool((entries & _BOTH).eq(_BOTH).all())


def let_go(t: torch.Tensor) -> bool:
    """Unmap the whole pages of ``t`` (module docstring); call it only where ``from_file(t)`` held. True when done."""
    span = _span(t)
    return span is not None and _madvise()(span[0], span[1] - span[0], _MADV_DONTNEED) == 0


__all__ = ["from_file", "let_go", "clone_sharing_tensors", "owned", "adopt", "copy_on_write", "release", "owning_as"]
