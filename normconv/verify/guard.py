"""normconv's own forwards change nothing (``forward_guard``): eval mode and no autograd inside; on exit every
module's training flag, buffer (bit for bit), Python attribute and hook dict or cache is as it was.

    with forward_guard(model) as guard:
        out = model(x)
    guard.mutated  # the buffers the forward changed, by path, as it left them (all of them put back)

A snapshot is taken at the guard's start and put back at its end. ``one_snapshot(model)`` lets the guarded
forwards of one model inside it share one snapshot: each still starts from the state the snapshot holds and has
its changes undone at its end, so each forward sees the model exactly as the first did, and the snapshot is taken
once (the example's forward and the second shape's, of the original and of the rewrite). Nothing but guarded
forwards may change the model inside ``one_snapshot``: their changes are undone, anything else's would be too.

Cost: a guard walks every module (a 3,000-block model has 12,000); the common case, a forward that changed
nothing, is checked by identity and emptiness in C loops (``map(operator.is_, ...)``, ``any``), and buffers are
compared as one flat copy per (dtype, device).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import operator
import threading
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn as nn
from torch.nn.modules.lazy import LazyModuleMixin

from normconv.errors import NormconvError

try:  # torch's lazily compiled GraphModule: its code generated on its first run (normconv's symbolic traces make
    # them: graph.capture; ``lazy_code`` asks torch.export for them); the one place normconv names it. None on a
    # torch without it
    from torch.fx._lazy_graph_module import _LazyGraphModule as LazyGraphModule, _use_lazy_graph_module
except ImportError:  # pragma: no cover - an older torch
    LazyGraphModule = _use_lazy_graph_module = None


def lazy_code() -> contextlib.AbstractContextManager:
    """Inside the block, each GraphModule torch makes generates its Python code when first run or read, not when
    made (torch.export builds and rebuilds several on the way to one program)."""
    return _use_lazy_graph_module(True) if _use_lazy_graph_module is not None else contextlib.nullcontext()

_TORCH_STATE = frozenset(("_parameters", "_buffers", "_modules", "training"))  # guarded on their own (buffers) or left alone
_CONTAINERS = frozenset((dict, collections.OrderedDict, collections.defaultdict, list, set))
_MISSING = object()
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # a float compared as its bits: NaN == NaN, -0.0 != 0.0
_is = operator.is_


class _ModuleState:
    """A module's Python state before a forward: its attributes, and the contents of the containers among them
    (hook dicts, caches). A forward that leaves state behind is undone: LeViT caching ``attention_biases`` under
    ``str(device)`` (a tracer's Proxy as the key), transformers installing closures as output-capturing hooks on
    the first call, symbolic_trace's ``_tensor_constant`` attributes. Left there, they are the original's state
    no more, and they do not pickle (``torch.save`` of the rewrite failed on them)."""

    __slots__ = ("module", "attrs", "empty", "filled")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.attrs = attrs = module.__dict__.copy()  # _TORCH_STATE's keys come along and are left alone by restore
        # every container attribute but torch's own state: the empty ones (a forward may fill them), and the items of
        # the others (one comprehension each: five guarded forwards of a 3,000-block model snapshot 60,000 modules)
        found = [(k, v) for k, v in attrs.items() if v.__class__ in _CONTAINERS and k not in _TORCH_STATE]
        self.empty = [v for _, v in found if not v]
        self.filled = [(v, list(v) if v.__class__ is list or v.__class__ is set else list(v.items()))
                       for _, v in found if v]

    def restore(self) -> None:
        d, attrs = self.module.__dict__, self.attrs
        # the common case, every attribute the same object under the same name, is checked in C
        if not (len(d) == len(attrs) and all(map(_is, d.values(), attrs.values())) and d.keys() == attrs.keys()):
            for k in d.keys() - attrs.keys():
                del d[k]  # an attribute the forward added
            for k, v in attrs.items():
                if d.get(k, _MISSING) is not v and k not in _TORCH_STATE:
                    d[k] = v  # an attribute the forward re-bound
        if any(self.empty):
            for v in self.empty:
                if v:
                    v.clear()  # a cache or hook dict the forward filled
        for v, items in self.filled:
            if isinstance(v, dict):
                if len(v) != len(items) or any(v.get(key, _MISSING) is not x for key, x in items):
                    v.clear()
                    v.update(items)
            elif len(v) != len(items) or any(a is not b for a, b in zip(v, items)):
                if isinstance(v, list):
                    v[:] = items
                else:
                    v.clear()
                    v.update(items)


class _Buffers:
    """Every buffer of ``modules`` with its values saved: one flat copy per (dtype, device) for the plain (strided)
    ones (a buffer's saved values are its slice of it, made only where it changed); a clone each for the rest
    (sparse, quantized)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.slots = [(m, name, b) for m in modules for name, b in m._buffers.items()
                      if isinstance(b, torch.Tensor) and not b.is_meta]  # a meta buffer holds no values to guard
        self.clones: dict[int, torch.Tensor] = {}
        plain: dict[tuple, list[int]] = {}
        for i, (_, _, b) in enumerate(self.slots):
            if b.layout is torch.strided and not b.is_quantized:
                plain.setdefault((b.dtype, b.device), []).append(i)
            else:
                self.clones[i] = b.detach().clone()
        self.groups: list[tuple[list[int], torch.Tensor]] = []
        self.at: dict[int, tuple[torch.Tensor, int, torch.Size]] = {}  # plain buffer -> (its group's copy, offset, shape)
        for idx in plain.values():
            flat, at = torch.cat([self.slots[i][2].detach().reshape(-1) for i in idx]), 0
            for i in idx:
                shape = self.slots[i][2].shape
                self.at[i], at = (flat, at, shape), at + shape.numel()
            self.groups.append((idx, flat))

    def saved(self, i: int) -> torch.Tensor:
        """Buffer ``i``'s values as they were."""
        if i in self.clones:
            return self.clones[i]
        flat, at, shape = self.at[i]
        return flat[at:at + shape.numel()].view(shape)

    def restore(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every buffer object and value put back; returns the changed ones by module path, as the forward left them."""
        untouched: set[int] = set()
        slots = self.slots
        for idx, flat in self.groups:  # the common case: one compare for a whole group
            nows = [slots[i][0]._buffers.get(slots[i][1]) for i in idx]
            if all(n is slots[i][2] and n.shape == self.at[i][2] for i, n in zip(idx, nows)) and \
                    _same(torch.cat([n.detach().reshape(-1) for n in nows]), flat):
                untouched.update(idx)
        mutated: dict[str, torch.Tensor] = {}
        paths: dict[int, str] | None = None  # module paths, looked up once a buffer changed
        for i, (m, name, b) in enumerate(slots):
            if i in untouched:
                continue
            saved = self.saved(i)
            now = m._buffers.get(name)
            if now is not None and (now is not b or not _same(now, saved)):
                paths = paths or {id(x): p for p, x in model.named_modules(remove_duplicate=False)}
                mutated[f"{paths[id(m)]}.{name}".lstrip(".")] = now.detach().clone()
            m._buffers[name] = b  # a forward that re-bound the buffer gets the original object back
            if not _same(b, saved):
                with torch.no_grad():
                    b.set_(saved.clone()) if b.shape != saved.shape else b.copy_(saved)
        return mutated


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit: a float compared as the integers of its bits (NaN equals itself, -0.0 differs from 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = _BITS.get(a.element_size()) if a.is_floating_point() and a.layout is torch.strided else None
    return bool(torch.equal(a.view(bits), b.view(bits)) if bits is not None else torch.equal(a, b))


@dataclass
class Guard:
    """What a guarded forward saw: the buffers the forward changed (compared when the output holds no tensor)."""
    mutated: dict[str, torch.Tensor] = field(default_factory=dict)


def _set_training(m: nn.Module, flag: bool) -> None:
    """``m.training = flag``, past nn.Module.__setattr__'s slow checks where the class does not override it."""
    if type(m).__setattr__ is nn.Module.__setattr__:
        object.__setattr__(m, "training", flag)
    else:
        m.training = flag


@contextlib.contextmanager
def _gc_paused():
    """The cyclic collector off (if on): a snapshot's thousands of small lists would make it walk the whole model."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


class _Snapshot:
    """A model's state (module docstring): every module, its training flag, its Python state, its buffers."""

    def __init__(self, model: nn.Module) -> None:
        self.in_use = False  # a guard is running on it
        self.modules = modules = list(model.modules())
        # an uninitialized lazy module (nn.LazyConv2d)  =>  its first forward would change the model: refused, said
        lazy = next((m for m in modules if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()), None)
        if lazy is not None:
            path = next(n for n, m in model.named_modules() if m is lazy) or "the model"
            raise NormconvError(f"{path} ({type(lazy).__name__}) is an uninitialized lazy module: its first forward "
                                f"would change the model; run the model once on an input to initialize it, then call "
                                f"normconv")
        # a lazily compiled GraphModule compiles on its first run: here, or the guard would undo the code it adds (the
        # module would keep its compiled forward, not its code)
        for m in modules if LazyGraphModule is not None else ():
            if isinstance(m, LazyGraphModule):
                m.real_recompile()
        self.flags = [m.training for m in modules]
        with _gc_paused():
            self.state = [_ModuleState(m) for m in modules]
            self.buffers = _Buffers(modules)

    def same_tree(self, model: nn.Module) -> bool:
        """The model still has exactly the modules the snapshot holds."""
        now = list(model.modules())
        return len(now) == len(self.modules) and all(map(_is, now, self.modules))

    def put_back(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model as the snapshot holds it; returns the buffers that had changed."""
        with _gc_paused():
            for m, flag in zip(self.modules, self.flags):
                if m.training is not flag:
                    _set_training(m, flag)
            for saved_state in self.state:
                saved_state.restore()
            return self.buffers.restore(model)


_SHARED = threading.local()  # id(model) -> the _Snapshot its guarded forwards share, inside ``one_snapshot``


def _shared() -> dict[int, _Snapshot]:
    if not hasattr(_SHARED, "snapshots"):
        _SHARED.snapshots = {}
    return _SHARED.snapshots


@contextlib.contextmanager
def one_snapshot(model: nn.Module) -> Iterator[None]:
    """The guarded forwards of ``model`` inside the block share one snapshot (module docstring); nested, the
    outer one's."""
    shared = _shared()
    if id(model) in shared:
        yield
        return
    shared[id(model)] = _Snapshot(model)
    try:
        yield
    finally:
        del shared[id(model)]


@contextlib.contextmanager
def forward_guard(model: nn.Module, training: bool = False) -> Iterator[Guard]:
    """normconv's own forwards change nothing: eval mode (``training``: every module in training mode, as
    ``model.train()`` sets it) and no autograd inside; on exit every module's training flag, buffer (bit for bit;
    ``_Buffers``: the running statistics a training-mode BatchNorm updates), Python attribute and hook dict or cache
    (``_ModuleState``) is as it was; ``mutated`` names the buffers the forward changed. Flags are set on each module,
    never through ``.eval()``: an exported program's module refuses it, and a user's override of ``train()`` is not
    ours to call."""
    snapshot = _shared().get(id(model))
    # a snapshot of its own: none shared, a guard of the model already running (nested: the model is in eval mode
    # now, and the outer guard puts back what it saw), or a forward before added a submodule
    if snapshot is None or snapshot.in_use or not snapshot.same_tree(model):
        snapshot = _Snapshot(model)
    snapshot.in_use = True
    guard = Guard()
    try:
        for m, flag in zip(snapshot.modules, snapshot.flags):
            if flag is not training:
                _set_training(m, training)
        with torch.no_grad():
            yield guard
    finally:
        guard.mutated.update(snapshot.put_back(model))
        snapshot.in_use = False


__all__ = ["forward_guard", "one_snapshot", "Guard", "LazyGraphModule", "lazy_code"]
